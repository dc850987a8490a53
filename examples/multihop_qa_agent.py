"""A multi-hop QA agent on HotpotQA: a fact finder and an answerer read the same ten paragraphs.

    python examples/multihop_qa_agent.py --n 5 [--certificate CERT.json --mapper STEM]

The fact finder (Gemma 3 270M) lists the facts the question needs; the answerer (SmolLM2-135M) answers from the
same paragraphs and the facts. With a certificate for the pair (``cachecert certify --pair
gemma3-270m:smollm2-135m --workload hotpotqa --alpha 0.2 --out CERT.json``; the mapper stem is
``$CACHECERT_HOME/mappers/gemma3-270m__smollm2-135m__hotpotqa``), the answerer receives the fact finder's cache
when the certificate accepts; without one, every step prefills (and the log says why). Needs ../shared/data or
``--data PATH`` (HotpotQA dev distractor JSON).
"""

from __future__ import annotations

import argparse
import logging
from typing import TypedDict

from langgraph.graph import END, START, StateGraph

from cachecert_agents import CacheCertRuntime, ModelCall, RouteConfig, RuntimeConfig, cachecert_node
from cachecert_agents.eval.workloads import get_workload


class State(TypedDict, total=False):
    paragraphs: str
    question: str
    facts: str
    answer: str


def build_graph(runtime: CacheCertRuntime, finder_model: str, answer_model: str):
    @cachecert_node(runtime, model=finder_model, output_key="facts")
    def fact_finder(state: State) -> ModelCall:
        return ModelCall(context=state["paragraphs"], max_new_tokens=40,
                         instruction=f"Which facts in the paragraphs above answer: {state['question']}")

    @cachecert_node(runtime, model=answer_model, output_key="answer")
    def answerer(state: State) -> ModelCall:
        return ModelCall(context=state["paragraphs"], max_new_tokens=24, stop_strings=("\n",),
                         instruction=f"Facts: {state['facts'][:300]}\nQuestion: {state['question']}\n"
                                     f"Answer with a few words only.")

    graph = StateGraph(State)
    graph.add_node("fact_finder", fact_finder)
    graph.add_node("answerer", answerer)
    graph.add_edge(START, "fact_finder")
    graph.add_edge("fact_finder", "answerer")
    graph.add_edge("answerer", END)
    return graph.compile()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--data")
    ap.add_argument("--finder", default="gemma3-270m")
    ap.add_argument("--answerer", default="smollm2-135m")
    ap.add_argument("--certificate")
    ap.add_argument("--mapper")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    routes = ([RouteConfig(sender=args.finder, receiver=args.answerer, mapper=args.mapper,
                           certificate=args.certificate)] if args.certificate and args.mapper else [])
    runtime = CacheCertRuntime(RuntimeConfig(routes=routes))
    graph = build_graph(runtime, args.finder, args.answerer)
    workload = get_workload("hotpotqa", data=args.data)
    for ex in workload.examples("evaluation", limit=args.n):
        question = ex.instruction.split("Question:")[-1].split("\n")[0].strip() or ex.instruction
        out = graph.invoke({"paragraphs": ex.context, "question": question})
        print(f"Q: {question}\n   facts: {out['facts'][:120]!r}\n   answer: {out['answer']!r} "
              f"(gold {ex.references[0]!r}, F1 {workload.score(out['answer'], ex.references):.2f})")
    print(runtime.summary()["metrics"])


if __name__ == "__main__":
    main()

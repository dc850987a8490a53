"""Report generation with three LangGraph nodes on two local models, through the cachecert node wrapper.

    python examples/report_pipeline.py --sets 3

planner (Gemma 3 270M) outlines a FreshWiki article from its sections; writer (SmolLM2-135M) writes the summary
from the same sections and the outline; reviewer (Gemma again) checks it. The writer receives the planner's
cache through a certified transfer when the certificate accepts the request (else it prefills), and the reviewer
reuses the planner's exact cache. The first run fits the route (mapper, labels, certificate) on the sample's
calibration articles and caches it; `cachecert demo` runs this same pipeline with a plain-prefill comparison.

The nodes are ordinary functions returning a ModelCall; `cachecert_node` is the only change to a LangGraph app.
"""

from __future__ import annotations

import argparse
import logging
import operator
from pathlib import Path
from typing import Annotated, TypedDict

from langgraph.graph import END, START, StateGraph

from cachecert_agents import CacheCertRuntime, ModelCall, RuntimeConfig, cachecert_node
from cachecert_agents.agents.report_demo import prepare_route
from cachecert_agents.eval.workloads import get_workload

SAMPLE = Path(__file__).parent / "data" / "freshwiki"


class State(TypedDict, total=False):
    topic: str
    documents: list[str]
    outline: str
    report: str
    review: str
    decisions: Annotated[list[dict], operator.add]


def build_graph(runtime: CacheCertRuntime, planner_model: str, writer_model: str):
    @cachecert_node(runtime, model=planner_model, output_key="outline", decisions_key="decisions")
    def planner(state: State) -> ModelCall:
        return ModelCall(context=state["documents"], max_new_tokens=48,
                         instruction=f"Outline a short encyclopedic summary of '{state['topic']}' from the sources "
                                     f"above: list its three main points, one line each.")

    @cachecert_node(runtime, model=writer_model, output_key="report", decisions_key="decisions")
    def writer(state: State) -> ModelCall:
        return ModelCall(context=state["documents"], max_new_tokens=96,
                         instruction=f"Write a short encyclopedic summary (2-3 sentences) of '{state['topic']}' "
                                     f"based on the sources above. Outline: {state['outline'][:300]}")

    @cachecert_node(runtime, model=planner_model, output_key="review", decisions_key="decisions")
    def reviewer(state: State) -> ModelCall:
        return ModelCall(context=state["documents"], max_new_tokens=32,
                         instruction=f"Is this summary supported by the sources above? Answer yes or no, then one "
                                     f"reason. Summary: {state['report'][:400]}")

    graph = StateGraph(State)
    graph.add_node("planner", planner)
    graph.add_node("writer", writer)
    graph.add_node("reviewer", reviewer)
    graph.add_edge(START, "planner")
    graph.add_edge("planner", "writer")
    graph.add_edge("writer", "reviewer")
    graph.add_edge("reviewer", END)
    return graph.compile()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--planner", default="gemma3-270m")
    ap.add_argument("--writer", default="smollm2-135m")
    ap.add_argument("--alpha", type=float, default=0.2)
    ap.add_argument("--audit-log", default="report_pipeline_audit.jsonl")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    runtime = CacheCertRuntime(RuntimeConfig(audit_log=args.audit_log, audit_probability=0.5))
    workload = get_workload("report", data=SAMPLE)
    planner, writer = runtime.model(args.planner), runtime.model(args.writer)
    runtime.add_route(prepare_route(planner, writer, workload, split=writer.geometry.num_layers, alpha=args.alpha))

    graph = build_graph(runtime, args.planner, args.writer)
    for ex in workload.examples("evaluation", limit=args.sets):
        out = graph.invoke({"topic": ex.meta["title"], "documents": [ex.context]})
        print(f"\n## {ex.meta['title']}")
        for d in out["decisions"]:
            print(f"  {d['node']:9} {d['model']:14} {d['action']:8} {d['reason']}")
        print(f"  report: {out['report'][:300]}")
    print("\n", runtime.summary()["metrics"])
    runtime.close()


if __name__ == "__main__":
    main()

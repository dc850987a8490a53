"""Report generation with three LangGraph nodes on two local models, through the cachecert node wrapper.

    python examples/report_pipeline.py --sets 3

planner (Gemma 3 270M) outlines a FreshWiki article from its sections; writer (SmolLM2-135M) writes the summary
from the same sections and the outline; reviewer (Gemma again) checks it. The writer receives the planner's
cache through a certified transfer when the certificate accepts the request (else it prefills), and the reviewer
reuses the planner's exact cache. The first run fits the route (mapper, labels, certificate) on the sample's
calibration articles and caches it; `cachecert demo` runs this same pipeline with a plain-prefill comparison.

The node bodies are ordinary functions returning a ModelCall (`plan`, `write`, `review` in
`cachecert_agents/agents/report_demo.py`); `cachecert_node` is the only change to a LangGraph app.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from langgraph.graph import END, START, StateGraph

from cachecert_agents import CacheCertRuntime, RuntimeConfig, cachecert_node
from cachecert_agents.agents.report_demo import ReportState, plan, prepare_route, review, write
from cachecert_agents.eval.workloads import get_workload

SAMPLE = Path(__file__).parent / "data" / "freshwiki"


def build_graph(runtime: CacheCertRuntime, planner_model: str, writer_model: str):
    # plan / write / review are plain functions State -> ModelCall (the prompts, in agents/report_demo.py);
    # wrapping them is the only change a LangGraph app needs
    planner = cachecert_node(runtime, model=planner_model, output_key="outline", decisions_key="decisions")(plan)
    writer = cachecert_node(runtime, model=writer_model, output_key="report", decisions_key="decisions")(write)
    reviewer = cachecert_node(runtime, model=planner_model, output_key="review", decisions_key="decisions")(review)

    graph = StateGraph(ReportState)
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

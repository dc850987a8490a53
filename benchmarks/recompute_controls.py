"""Selective recompute against its controls on the SAME questions: for each pair, the evaluation examples that
have a record for every compared method, and per method the task score, retention (paired-bootstrap 95% interval),
agreement with the full-prefill answer and prefill saved (1 - median transfer time / median prefill time of those
records). Reads the per-example records of ``cachecert eval transfer``; runs no model. Writes JSON with the command.

    python benchmarks/recompute_controls.py --pair smollm2-135m:qwen2.5-coder-0.5b \
        --pair qwen2.5-coder-0.5b:qwen2.5-coder-1.5b --out docs/results/recompute_controls.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import sys
from pathlib import Path

from cachecert_agents.cli import write_json_atomic
from cachecert_agents.eval.metrics import ratio_interval
from cachecert_agents.eval.transfer_eval import load_records
from cachecert_agents.eval.workloads import get_workload

METHODS = ["ridge-kv", "ridge-kv+r20", "ridge-kv+r35", "pruned-context@20", "pruned-context@35",
           "lexical-context@20", "lexical-context@35", "no-context"]


def compare(results_dir: Path, sender: str, receiver: str, workload: str, n: int, methods: list[str]) -> dict:
    ids = [e.id for e in get_workload(workload).examples("evaluation")[:n]]
    records, full_records = load_records(results_dir, sender, receiver, workload, ids)
    full = {r["id"]: r for r in full_records}
    by = {(r["id"], r["method"]): r for r in records}
    present = [m for m in methods if any(k[1] == m for k in by)]
    common = [i for i in ids if i in full and all((i, m) in by for m in present)]
    rows = []
    for m in present:
        recs = [by[(i, m)] for i in common]
        scores, ref = [r["score"] for r in recs], [full[i]["score"] for i in common]
        times = [r["transfer_s"] for r in recs if r.get("transfer_s") is not None]
        low, high = ratio_interval(scores, ref)
        rows.append({"method": m, "n": len(common), "score_full": statistics.mean(ref),
                     "score": statistics.mean(scores),
                     "retention": statistics.mean(scores) / statistics.mean(ref) if statistics.mean(ref) else None,
                     "retention_ci95": [low, high],
                     "agreement": statistics.mean(1.0 if r["agree"] else 0.0 for r in recs),
                     "prefill_saved": (1 - statistics.median(times) / statistics.median(r["prefill_s"] for r in recs))
                     if times else None})
    return {"sender": sender, "receiver": receiver, "workload": workload, "examples": len(common), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", action="append", required=True, help="SENDER:RECEIVER (repeatable)")
    ap.add_argument("--workload", default="hotpotqa")
    ap.add_argument("--n", type=int, default=100, help="among the first N evaluation examples")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--results-dir", default="docs/results/transfer")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = []
    for pair in args.pair:
        sender, receiver = pair.split(":")
        res = compare(Path(args.results_dir), sender, receiver, args.workload, args.n, args.methods.split(","))
        out.append(res)
        print(f"{pair} {args.workload}: {res['examples']} questions with every method")
        for r in res["rows"]:
            saved = "-" if r["prefill_saved"] is None else f"{r['prefill_saved']:.2f}"
            print(f"  {r['method']:20s} retention {r['retention']:.3f} ({r['retention_ci95'][0]:.2f}-"
                  f"{r['retention_ci95'][1]:.2f}) agreement {r['agreement']:.2f} saved {saved}")
    write_json_atomic(Path(args.out), {"command": "python " + shlex.join(sys.argv),
                                       "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                       "results": out})


if __name__ == "__main__":
    main()

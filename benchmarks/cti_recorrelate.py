"""Re-correlate an earlier ``cachecert cti`` result with the current retention table, next to the current one
on the same points: the ablation of a change to the index (e.g. the GCV residual) when the retention table moved
in between. The earlier file is read from git, so nothing is recomputed.

    python benchmarks/cti_recorrelate.py --before 70c27b9:docs/results/cti.json --after docs/results/cti.json \
        --before 70c27b9:docs/results/cti_k4.json --after docs/results/cti_k4.json \
        --out docs/results/cti_residual_ablation.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import subprocess
import sys
from pathlib import Path

from cachecert_agents.cli import write_json_atomic
from cachecert_agents.eval.cti_eval import TARGETS, correlate, spearman


def _pairs(ref: str) -> list[dict]:
    text = (subprocess.run(["git", "show", ref], check=True, capture_output=True, text=True).stdout
            if ":" in ref else Path(ref).read_text())
    results = json.loads(text)["results"]
    return results["pairs"] if "pairs" in results else results


def _summary(pairs: list[dict], rows: list[dict], target: str) -> dict:
    keys = ("n_points", "spearman_cti", "spearman_residual_fraction", "spearman_r2", "n_points_pure_kv",
            "spearman_cti_pure_kv", "spearman_residual_fraction_pure_kv", "spearman_r2_pure_kv")
    return {group: {k: c[k] for k in keys} for group, c in correlate(pairs, rows, target)["correlations"].items()}


def _index_agreement(before: list[dict], after: list[dict], rows: list[dict], target: str) -> dict:
    """How alike the two runs' indices are on the points both rank (same pair, workload and method): Spearman's
    rho between them, and the largest absolute difference of the index."""
    def by_point(pairs: list[dict]) -> dict:
        return {(p["sender"], p["receiver"], p["workload"], p["method"]): p["cti"]
                for p in correlate(pairs, rows, target)["points"]}

    b, a = by_point(before), by_point(after)
    shared = sorted(set(b) & set(a))
    return {"n_points": len(shared), "spearman": spearman([b[k] for k in shared], [a[k] for k in shared]),
            "max_abs_difference": max((abs(b[k] - a[k]) for k in shared), default=float("nan"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", action="append", required=True, help="GIT_REF:PATH (or a path) of the earlier run")
    ap.add_argument("--after", action="append", required=True, help="the current run, one per --before")
    ap.add_argument("--transfer", default="docs/results/transfer.json")
    ap.add_argument("--out", default="docs/results/cti_residual_ablation.json")
    ap.add_argument("--before-as-workload", default=None, metavar="W",
                    help="correlate the earlier run's indices with retention on W (a cross-workload run: statistics "
                         "from one workload's text, retention measured on W)")
    ap.add_argument("--target", choices=TARGETS, default="retention",
                    help="what the indices are correlated with: retention (the issue's target), the agreement "
                         "rate with the receiver's full-prefill answer, or context_gain (the share of the "
                         "context's lift over no context that the transfer carries)")
    args = ap.parse_args()
    rows = json.loads(Path(args.transfer).read_text())["results"]
    comparisons = []
    for before_ref, after_ref in zip(args.before, args.after, strict=True):
        before, after = _pairs(before_ref), _pairs(after_ref)
        if args.before_as_workload:
            before = [dict(p, workload=args.before_as_workload) for p in before]
        keys = {(p["sender"], p["receiver"], p["workload"]) for p in before}
        same = [p for p in after if (p["sender"], p["receiver"], p["workload"]) in keys]
        comparisons.append({"before": before_ref, "after": after_ref, "before_gcv": before[0].get("gcv", False),
                            "after_gcv": after[0].get("gcv", False), "target": args.target,
                            "index_agreement": _index_agreement(before, same, rows, args.target),
                            "before_corr": _summary(before, rows, args.target),
                            "after_same_pairs": _summary(same, rows, args.target),
                            "after_all": _summary(after, rows, args.target)})
        print(before_ref, "->", after_ref, json.dumps({k: comparisons[-1][k]["pooled"]["spearman_cti"]
                                                        for k in ("before_corr", "after_same_pairs", "after_all")}),
              "index agreement", json.dumps(comparisons[-1]["index_agreement"]))
    write_json_atomic(Path(args.out), {"command": "python " + shlex.join(sys.argv),
                                       "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                       "comparisons": comparisons})


if __name__ == "__main__":
    main()

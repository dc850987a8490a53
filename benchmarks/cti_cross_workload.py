"""Does a pair's index computed on one workload's calibration text rank retention measured on another?

``cachecert cti --all`` computes every pair's index from each workload's own calibration text
(docs/results/cti_k4_p1.json holds all four pooled workloads for all twelve pairs). Here the index from workload
``A``'s text is matched to the retention points of workload ``B`` (same pair, same method: the split layers are
``round(f L)`` on every workload) and ranked by Spearman's rho, for every ordered pair ``A, B``: the diagonal is
the usual per-workload figure, the off-diagonal the issue's generalisation check on the complete retention table.
Also: pooled over the four retention workloads with each point's index taken from a *different* workload's text
(one row per source ``A``, the points of ``A`` itself left out), and over all four with every point's index from
``A``'s text alone (what one statistics pass on a user's own text gives), each next to the pooled figure from
each point's own text on the same points. No model is run.

    python benchmarks/cti_cross_workload.py --out docs/results/cti_cross_workload_matrix.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from pathlib import Path

from cachecert_agents.cli import write_json_atomic
from cachecert_agents.eval.cti_eval import correlate, spearman

WORKLOADS = ("hotpotqa", "musique", "squad-long", "tool-results")


def points_from_text(pairs: list[dict], rows: list[dict], text: str, retention: str) -> list[dict]:
    """The retention points of workload ``retention`` with each pair's index from ``text``'s calibration pass."""
    relabelled = [dict(p, workload=retention) for p in pairs if p["workload"] == text]
    return correlate(relabelled, [r for r in rows if r["workload"] == retention])["points"]


def _key(p: dict) -> tuple:
    return p["sender"], p["receiver"], p["workload"], p["method"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cti", default="docs/results/cti_k4_p1.json", help="a `cachecert cti --all` result")
    ap.add_argument("--transfer", default="docs/results/transfer.json", help="the current retention table")
    ap.add_argument("--out", default="docs/results/cti_cross_workload_matrix.json")
    args = ap.parse_args()
    pairs = json.loads(Path(args.cti).read_text())["results"]["pairs"]
    rows = json.loads(Path(args.transfer).read_text())["results"]
    own = {_key(p): p for w in WORKLOADS for p in points_from_text(pairs, rows, w, w)}
    matrix: dict[str, dict[str, dict]] = {}
    for text in WORKLOADS:
        matrix[text] = {}
        for target in WORKLOADS:
            pts = [p for p in points_from_text(pairs, rows, text, target) if _key(p) in own]
            matrix[text][target] = {
                "n_points": len(pts),
                "spearman_cti": spearman([p["cti"] for p in pts], [p["retention"] for p in pts]),
                "spearman_cti_own_text": spearman([own[_key(p)]["cti"] for p in pts], [p["retention"] for p in pts])}
    pooled: dict[str, dict[str, dict]] = {"other_workloads": {}, "all_workloads": {}}
    for text in WORKLOADS:
        for name, targets in (("other_workloads", [w for w in WORKLOADS if w != text]), ("all_workloads", WORKLOADS)):
            pts = [p for target in targets for p in points_from_text(pairs, rows, text, target) if _key(p) in own]
            pooled[name][text] = {"retention_workloads": list(targets), "n_points": len(pts),
                                  "spearman_cti": spearman([p["cti"] for p in pts], [p["retention"] for p in pts]),
                                  "spearman_cti_own_text": spearman([own[_key(p)]["cti"] for p in pts],
                                                                    [p["retention"] for p in pts])}
    out = {"command": shlex.join(["python", *sys.argv]), "date": dt.datetime.now(dt.timezone.utc).isoformat(),
           "cti_file": args.cti, "transfer_file": args.transfer, "matrix": matrix,
           "pooled": pooled}
    write_json_atomic(Path(args.out), out)
    print("index text \\ retention: " + "  ".join(f"{w:>12}" for w in WORKLOADS))
    for text in WORKLOADS:
        print(f"{text:>23}: " + "  ".join(
            f"{matrix[text][w]['spearman_cti']:+.3f} ({matrix[text][w]['n_points']:>2})" for w in WORKLOADS))
    for name, by_text in pooled.items():
        for text, c in by_text.items():
            print(f"pooled over {name}, index from {text:>12} text: {c['spearman_cti']:+.3f} over "
                  f"{c['n_points']} points (each point's own text {c['spearman_cti_own_text']:+.3f})")


if __name__ == "__main__":
    main()

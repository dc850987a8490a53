"""Selective recompute against its controls on the SAME questions: for each pair, the evaluation examples that
have a record for every compared method, and per method the task score, retention (paired-bootstrap 95% interval),
agreement with the full-prefill answer and prefill saved (1 - median transfer time / median prefill time of those
records), and each method's agreement against a reference method's on the same questions (the first repaired
``+rP`` method unless ``--reference`` names another): the discordant counts and the exact McNemar p-value, with a
summary over every compared cell. Reads the per-example records of ``cachecert eval transfer``; runs no model.
Writes JSON with the command.

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
from cachecert_agents.eval.metrics import mcnemar_exact, ratio_interval
from cachecert_agents.eval.transfer_eval import load_records
from cachecert_agents.eval.workloads import get_workload
from cachecert_agents.models.registry import EMBEDDED_MODELS

METHODS = ["ridge-kv", "ridge-kv+r20", "ridge-kv+r35", "pruned-context@20", "pruned-context@35",
           "lexical-context@20", "lexical-context@35", "no-context"]


def compare(results_dir: Path, sender: str, receiver: str, workload: str, n: int, methods: list[str],
            reference: str | None = None) -> dict:
    ids = [e.id for e in get_workload(workload).examples("evaluation")[:n]]
    records, full_records = load_records(results_dir, sender, receiver, workload, ids)
    full = {r["id"]: r for r in full_records}
    by = {(r["id"], r["method"]): r for r in records}
    present = [m for m in methods if any(k[1] == m for k in by)]
    common = [i for i in ids if i in full and all((i, m) in by for m in present)] if present else []
    reference = reference or next((m for m in present if "+r" in m), None)
    cell = {"sender": sender, "receiver": receiver, "workload": workload, "reference": reference}
    if not common or (reference is not None and reference not in present):
        # nothing to compare here (no question has every method, or the named reference has no records): skipped
        return {**cell, "examples": 0, "rows": []}
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
        if reference is not None and m != reference:
            pairs = [(by[(i, reference)]["agree"], by[(i, m)]["agree"]) for i in common]
            only_ref = sum(1 for a, b in pairs if a and not b)
            only_m = sum(1 for a, b in pairs if b and not a)
            rows[-1]["agreement_vs_reference"] = {"reference": reference, "only_reference": only_ref,
                                                  "only_method": only_m, "p_mcnemar": mcnemar_exact(only_ref, only_m)}
    return {**cell, "examples": len(common), "rows": rows}


def summarise_cells(results: list[dict]) -> list[dict]:
    """Per method, over every compared pair x workload (cell): in how many cells the reference method agreed with
    the receiver's own answer more often than this method, less often, or as often; in how many the difference is
    significant (exact McNemar p < 0.05) either way; and a sign test over the cells that differ (two-sided, exact).
    Cells share questions (one workload's questions serve every pair), so the sign test is descriptive."""
    by_method: dict[tuple[str, str], list[dict]] = {}  # (reference, method): cells never pool two references
    for res in results:
        for row in res["rows"]:
            if (v := row.get("agreement_vs_reference")) is not None:
                by_method.setdefault((v["reference"], row["method"]), []).append(v)
    out = []
    for (reference, method), cells in by_method.items():
        better = sum(c["only_reference"] > c["only_method"] for c in cells)
        worse = sum(c["only_reference"] < c["only_method"] for c in cells)
        out.append({"method": method, "reference": reference, "cells": len(cells),
                    "reference_agrees_more": better, "reference_agrees_less": worse,
                    "ties": len(cells) - better - worse,
                    "significant_more": sum(c["only_reference"] > c["only_method"] and c["p_mcnemar"] < 0.05
                                            for c in cells),
                    "significant_less": sum(c["only_reference"] < c["only_method"] and c["p_mcnemar"] < 0.05
                                            for c in cells),
                    "p_sign_test": mcnemar_exact(better, worse)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", action="append", required=True,
                    help="SENDER:RECEIVER (repeatable), or 'all' for every directed pair of embedded models")
    ap.add_argument("--workload", action="append", default=None, help="repeatable (default: hotpotqa)")
    ap.add_argument("--n", type=int, default=100, help="among the first N evaluation examples")
    ap.add_argument("--min-examples", type=int, default=1,
                    help="skip a pair and workload with fewer questions that have every method")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--reference", default=None,
                    help="method whose agreement the others are tested against (default: the first +rP method)")
    ap.add_argument("--results-dir", default="docs/results/transfer")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    pairs = ([(s, r) for s in EMBEDDED_MODELS for r in EMBEDDED_MODELS if s != r] if "all" in args.pair
             else [tuple(p.split(":")) for p in args.pair])
    out = []
    for workload in args.workload or ["hotpotqa"]:
        for sender, receiver in pairs:
            res = compare(Path(args.results_dir), sender, receiver, workload, args.n, args.methods.split(","),
                          args.reference)
            if res["examples"] < max(1, args.min_examples):
                continue
            out.append(res)
            print(f"{sender}:{receiver} {workload}: {res['examples']} questions with every method")
            for r in res["rows"]:
                saved = "-" if r["prefill_saved"] is None else f"{r['prefill_saved']:.2f}"
                low, high = ("-" if v is None else f"{v:.2f}" for v in r["retention_ci95"])  # None: unbounded
                print(f"  {r['method']:20s} retention {r['retention']:.3f} ({low}-{high}) agreement "
                      f"{r['agreement']:.2f} saved {saved}"
                      + (f" | vs {v['reference']}: {v['only_reference']} only it, {v['only_method']} only this, "
                         f"McNemar p {v['p_mcnemar']:.2g}" if (v := r.get("agreement_vs_reference")) else ""))
    summary = summarise_cells(out)
    for c in summary:
        print(f"{c['reference']} against {c['method']} over {c['cells']} cells: agrees more in "
              f"{c['reference_agrees_more']} ({c['significant_more']} at p < 0.05), less in "
              f"{c['reference_agrees_less']} ({c['significant_less']}), ties {c['ties']}; sign test p "
              f"{c['p_sign_test']:.2g}")
    write_json_atomic(Path(args.out), {"command": "python " + shlex.join(sys.argv),
                                       "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                       "results": out, "summary": summary})


if __name__ == "__main__":
    main()

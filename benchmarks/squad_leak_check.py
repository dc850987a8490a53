"""Did the squad-long calibration leak inflate the committed squad-long results?

Until the fifteenth session, squad-long drew calibration distractors from every paragraph, so most evaluation
examples' gold paragraphs also sat in some calibration context, and a mapper fitted on the first ``K``
calibration contexts (plus 4 held out) had seen some evaluation golds (``SquadLong(calibration_distractors="any")``
rebuilds those contexts). This script splits each committed squad-long cell's evaluation questions into *leaked*
(gold paragraph inside the mapper's calibration text) and *clean*, and compares agreement with the full-prefill
answer, the task score and the score minus the receiver's own full-prefill score on the two (the last is what
retention measures, question by question; leaked questions may simply be easier, which the full-prefill score
takes out). ``no-context`` is the placebo: its answers cannot depend on the mapper, so a
difference there is chance (or leaked questions being easier), not the leak. Pooled over cells, a within-cell
permutation test (leak labels shuffled inside each cell) gives the p-value of the summed leaked-minus-clean
difference. The mapper's calibration size ``K`` is not recorded in the old records: the script reports both sizes
the committed runs used (20 and the earlier default 32). Runs no model; writes JSON with the command.

    python benchmarks/squad_leak_check.py --out docs/results/squad_leak_check.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from pathlib import Path

import numpy as np

from cachecert_agents.cli import write_json_atomic
from cachecert_agents.eval.transfer_eval import load_records
from cachecert_agents.eval.workloads import get_workload

METHODS = ["ridge-kv", "ridge-kv+r20", "no-context"]
HELDOUT = 4


def leaked_ids(n_calibration: int) -> set[str]:
    """Evaluation ids whose gold paragraph sits in the first ``n_calibration + HELDOUT`` calibration contexts of
    the earlier construction."""
    earlier = get_workload("squad-long", calibration_distractors="any")
    seen = {tuple(d) for e in earlier.examples("calibration")[:n_calibration + HELDOUT] for d in e.meta["distractors"]}
    return {e.id for e in earlier.examples("evaluation") if tuple(e.meta["paragraph"]) in seen}


def cell_values(results_dir: Path, sender: str, receiver: str, n: int, method: str
                ) -> dict[str, tuple[float, float, float]]:
    """``id -> (agree, score, score - full-prefill score)`` of one method's latest records on the first ``n``
    evaluation questions (the last: how far the answer falls below the receiver's own, question by question)."""
    ids = [e.id for e in get_workload("squad-long").examples("evaluation")[:n]]
    records, full_records = load_records(results_dir, sender, receiver, "squad-long", ids)
    full = {r["id"]: float(r["score"]) for r in full_records}
    return {r["id"]: (1.0 if r["agree"] else 0.0, float(r["score"]), float(r["score"]) - full[r["id"]])
            for r in records if r["method"] == method and r["id"] in full}


def pooled_test(cells: list[tuple[np.ndarray, np.ndarray]], permutations: int, seed: int = 0) -> dict:
    """Sum over cells of ``n_leaked * (mean leaked - mean clean)`` and its within-cell permutation p-value
    (two-sided)."""
    def statistic(pairs: list[tuple[np.ndarray, np.ndarray]]) -> float:
        return float(sum(m.sum() * (v[m].mean() - v[~m].mean()) for v, m in pairs if 0 < m.sum() < m.size))

    observed = statistic(cells)
    rng = np.random.default_rng(seed)
    draws = np.array([statistic([(v, rng.permutation(m)) for v, m in cells]) for _ in range(permutations)])
    return {"statistic": observed, "p_two_sided": float((np.abs(draws) >= abs(observed) - 1e-12).mean()),
            "permutations": permutations}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results-dir", default="docs/results/transfer")
    p.add_argument("--n", type=int, default=100, help="evaluation questions per cell (the first n)")
    p.add_argument("--calibration-sizes", default="20,32")
    p.add_argument("--permutations", type=int, default=5000)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    results_dir = Path(args.results_dir)
    pairs = sorted(f.name.split("__")[:2] for f in results_dir.glob("*__squad-long.jsonl"))
    out: dict = {"command": "python benchmarks/squad_leak_check.py " + shlex.join(argv or sys.argv[1:]),
                 "date": dt.date.today().isoformat(), "by_calibration_size": {}}
    for k in (int(x) for x in args.calibration_sizes.split(",")):
        leaked = leaked_ids(k)
        rows, pooled = [], {}
        for method in METHODS:
            agree_cells, score_cells, gap_cells = [], [], []
            for sender, receiver in pairs:
                values = cell_values(results_dir, sender, receiver, args.n, method)
                if not values:
                    continue
                ids = sorted(values)
                mask = np.array([i in leaked for i in ids])
                agree = np.array([values[i][0] for i in ids])
                score = np.array([values[i][1] for i in ids])
                gap = np.array([values[i][2] for i in ids])
                rows.append({"sender": sender, "receiver": receiver, "method": method, "n": len(ids),
                             "n_leaked": int(mask.sum()),
                             "agreement_leaked": float(agree[mask].mean()) if mask.any() else None,
                             "agreement_clean": float(agree[~mask].mean()) if (~mask).any() else None,
                             "score_leaked": float(score[mask].mean()) if mask.any() else None,
                             "score_clean": float(score[~mask].mean()) if (~mask).any() else None})
                agree_cells.append((agree, mask))
                score_cells.append((score, mask))
                gap_cells.append((gap, mask))
            n_leaked = sum(int(m.sum()) for _, m in agree_cells)
            agree_test, score_test, gap_test = (pooled_test(agree_cells, args.permutations),
                                                pooled_test(score_cells, args.permutations),
                                                pooled_test(gap_cells, args.permutations))
            pooled[method] = {
                "cells": len(agree_cells), "n_leaked": n_leaked, "n": sum(m.size for _, m in agree_cells),
                "agreement_leaked_minus_clean_per_leaked_question": (
                    agree_test["statistic"] / n_leaked if n_leaked else None),
                "agreement_test": agree_test,
                "score_leaked_minus_clean_per_leaked_question": score_test["statistic"] / n_leaked if n_leaked else None,
                "score_test": score_test,
                "gap_to_full_leaked_minus_clean_per_leaked_question": (
                    gap_test["statistic"] / n_leaked if n_leaked else None),
                "gap_test": gap_test}
        out["by_calibration_size"][str(k)] = {"leaked_evaluation_ids": len(leaked), "cells": rows, "pooled": pooled}
        for method, r in pooled.items():
            print(f"K={k} {method}: {r['n_leaked']} leaked of {r['n']} in {r['cells']} cells; agreement "
                  f"leaked-clean {r['agreement_leaked_minus_clean_per_leaked_question']:+.3f} "
                  f"(p {r['agreement_test']['p_two_sided']:.3f}); score "
                  f"{r['score_leaked_minus_clean_per_leaked_question']:+.3f} (p {r['score_test']['p_two_sided']:.3f}); "
                  f"score - full {r['gap_to_full_leaked_minus_clean_per_leaked_question']:+.3f} "
                  f"(p {r['gap_test']['p_two_sided']:.3f})")
    write_json_atomic(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

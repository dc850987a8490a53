"""The receiver's no-context floor as a predictor of retention, alone and combined with the CTI, cross-fitted.

Retention is ``score_transfer / score_full``. A transfer that carries nothing still retains
``floor = score_no_context / score_full`` (the receiver answers that well without the context), so retention
decomposes as ``floor + (1 - floor) * context_gain`` (``cti_eval.context_gain``). The floor is a property of the
receiver and the workload only: no sender, no mapper. This script asks how much of the retention table it ranks,
and whether ``floor + (1 - floor) * CTI`` (no fitted constant) ranks it better than the CTI alone.

Computed naively on the same questions, floor and retention share the denominator ``score_full``, and the noise
of that mean alone correlates them (the spurious correlation of ratios with a common denominator; Pearson 1897).
So every figure here is **cross-fitted**: per repetition, the questions of each receiver x workload are split at
random in two halves (the same halves for every sender into that receiver); the floor is measured on half A, and
every predictor is ranked against retention recomputed on half B. The in-sample (same-half) floor is reported
beside it to show how much the shared denominator adds. The CTI is computed from calibration text and does not
depend on the halves.

With ``--floors`` (the rows of ``cachecert eval floor``: each receiver's floor measured on the workload's
*calibration* split, so it shares no question with retention), the floor and the combination are also ranked
against the whole retention table, with no halving: the deployable version of the same predictor.

    python benchmarks/cti_floor.py --cti docs/results/cti_k4_p1.json --floors docs/results/receiver_floors.json \
        --out docs/results/cti_floor.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from pathlib import Path

import numpy as np
from retention_noise import _group_scores, _retention
from tqdm import tqdm

from cachecert_agents.cli import write_json_atomic
from cachecert_agents.eval.cti_eval import correlate, spearman

PREDICTORS = ("cti", "floor", "floor_plus_cti", "floor_in_sample", "floor_plus_cti_in_sample")


def _floor(no_context: np.ndarray, full: np.ndarray, idx: np.ndarray) -> float:
    """``mean no-context score / mean full-prefill score`` over the examples ``idx`` that have a no-context
    answer; NaN when their full-prefill scores sum to zero."""
    nc = no_context[idx]
    has = ~np.isnan(nc)
    den = full[idx][has].sum()
    return float(nc[has].sum() / den) if den > 0 else float("nan")


def _rank_all(groups: list[dict], a_sets: dict[tuple[str, str], set[str]] | None) -> dict[str, dict[str, float]]:
    """Spearman of each predictor against retention, pooled, per workload and on the pure-KV points. With
    ``a_sets`` (receiver, workload) -> the ids of half A, the floor comes from half A and retention from half B
    (``*_in_sample`` predictors use half B's floor); without, everything uses every question."""
    rows: list[dict] = []
    for g in groups:
        ids = g["ids"]
        if a_sets is None:
            a = b = np.arange(len(ids))
        else:
            in_a = np.array([i in a_sets[(g["receiver"], g["workload"])] for i in ids])
            a, b = np.flatnonzero(in_a), np.flatnonzero(~in_a)
        ret_b = _retention(g["transfer"], g["full"], b)
        floor_a, floor_b = _floor(g["no_context"], g["full"], a), _floor(g["no_context"], g["full"], b)
        for p, r in zip(g["points"], ret_b):
            rows.append({"workload": p["workload"], "pure_kv": p["pure_kv"], "retention": float(r), "cti": p["cti"],
                         "floor": floor_a, "floor_plus_cti": floor_a + (1 - floor_a) * p["cti"],
                         "floor_in_sample": floor_b, "floor_plus_cti_in_sample": floor_b + (1 - floor_b) * p["cti"]})
    subsets = {"pooled": rows, "pure_kv": [r for r in rows if r["pure_kv"]]} | {
        w: [r for r in rows if r["workload"] == w] for w in sorted({r["workload"] for r in rows})}
    out = {}
    for name, rs in subsets.items():
        ok = [r for r in rs if all(np.isfinite(r[k]) for k in ("retention", *PREDICTORS))]
        out[name] = {"n_points": len(ok)} | {k: spearman([r[k] for r in ok], [r["retention"] for r in ok])
                                             for k in PREDICTORS}
    return out


def _rank_with_calibration_floors(points: list[dict], floors: dict[tuple[str, str], float]) -> dict:
    """Spearman of the CTI, the calibration-split floor and ``floor + (1 - floor) * CTI`` against the retention of
    every question, pooled, on the pure-KV points and per workload; points whose receiver has no floor on their
    workload are left out (counted)."""
    rows = []
    for p in points:
        f = floors.get((p["receiver"], p["workload"]))
        if f is not None:
            rows.append({"workload": p["workload"], "pure_kv": p["pure_kv"], "retention": p["retention"],
                         "cti": p["cti"], "floor": f, "floor_plus_cti": f + (1 - f) * p["cti"]})
    subsets = {"pooled": rows, "pure_kv": [r for r in rows if r["pure_kv"]]} | {
        w: [r for r in rows if r["workload"] == w] for w in sorted({r["workload"] for r in rows})}
    out: dict = {"points_without_floor": len(points) - len(rows)}
    for name, rs in subsets.items():
        out[name] = {"n_points": len(rs)} | {k: spearman([r[k] for r in rs], [r["retention"] for r in rs])
                                             for k in ("cti", "floor", "floor_plus_cti")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cti", default="docs/results/cti_k4_p1.json", help="a `cachecert cti` result (its indices)")
    ap.add_argument("--transfer", default="docs/results/transfer.json", help="the current retention table")
    ap.add_argument("--results-dir", default="docs/results/transfer", help="the per-example transfer records")
    ap.add_argument("--floors", default=None,
                    help="rows of `cachecert eval floor` (calibration-split floors): also rank against every question")
    ap.add_argument("--repetitions", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/results/cti_floor.json")
    args = ap.parse_args()
    if args.repetitions < 1:
        ap.error("--repetitions must be at least 1")
    pairs = json.loads(Path(args.cti).read_text())["results"]["pairs"]
    points = correlate(pairs, json.loads(Path(args.transfer).read_text())["results"])["points"]
    by_group: dict[tuple[str, str, str], list[dict]] = {}
    for p in points:
        by_group.setdefault((p["sender"], p["receiver"], p["workload"]), []).append(p)
    groups = []
    for (sender, receiver, workload), pts in by_group.items():
        methods = [p["method"] for p in pts]
        scores, full, _, ids = _group_scores(Path(args.results_dir), sender, receiver, workload,
                                             [*methods, "no-context"], max(p["n"] for p in pts))
        transfer = scores[:-1]
        for p, r in zip(pts, _retention(transfer, full, np.arange(full.size))):
            if not np.isclose(p["retention"], r, atol=1e-9):
                raise ValueError(f"{sender}->{receiver} {workload} {p['method']}: the records give retention {r}, "
                                 f"the table {p['retention']}")
        groups.append({"receiver": receiver, "workload": workload, "points": pts, "ids": ids, "transfer": transfer,
                       "no_context": scores[-1], "full": full})
    question_sets: dict[tuple[str, str], set[str]] = {}  # every question of a receiver x workload, all senders
    for g in groups:
        question_sets.setdefault((g["receiver"], g["workload"]), set()).update(g["ids"])
    rng = np.random.default_rng(args.seed)
    reps = []
    for _ in tqdm(range(args.repetitions), desc="cross-fitted halves"):
        a_sets = {key: set(rng.permutation(sorted(ids))[: len(ids) // 2].tolist())
                  for key, ids in question_sets.items()}
        reps.append(_rank_all(groups, a_sets))

    def summary(values: list[float]) -> dict:
        v = np.asarray([x for x in values if np.isfinite(x)])
        return {"median": float(np.median(v)), "mean": float(v.mean()), "std": float(v.std()),
                "q05": float(np.quantile(v, 0.05)), "q95": float(np.quantile(v, 0.95)), "repetitions": int(v.size)}

    cross_fitted = {name: {"n_points": reps[0][name]["n_points"]} | {
        k: summary([r[name][k] for r in reps]) for k in PREDICTORS} | {
        # paired over the repetitions: the same halves rank both predictors
        f"{k}_minus_cti": summary([r[name][k] - r[name]["cti"] for r in reps]) for k in ("floor", "floor_plus_cti")} | {
        f"{k}_ahead_fraction": float(np.mean([r[name][k] > r[name]["cti"] for r in reps]))
        for k in ("floor", "floor_plus_cti")} for name in reps[0]}
    calibration = None
    if args.floors:
        floor_rows = json.loads(Path(args.floors).read_text())["results"]
        calibration_floors = {(r["receiver"], r["workload"]): r["floor"] for r in floor_rows}
        # how well the calibration floors reproduce the floors of the evaluation questions (the largest group of
        # each receiver x workload, every question)
        evaluation_floors: dict[tuple[str, str], tuple[int, float]] = {}
        for g in groups:
            key = (g["receiver"], g["workload"])
            if len(g["ids"]) > evaluation_floors.get(key, (0, 0.0))[0]:
                evaluation_floors[key] = (len(g["ids"]),
                                          _floor(g["no_context"], g["full"], np.arange(len(g["ids"]))))
        both = sorted(k for k in evaluation_floors if k in calibration_floors)
        calibration = {"floors_file": args.floors, "floors": floor_rows,
                       "spearman_calibration_vs_evaluation_floor": spearman(
                           [calibration_floors[k] for k in both], [evaluation_floors[k][1] for k in both]),
                       "n_receiver_workloads": len(both),
                       **_rank_with_calibration_floors(points, calibration_floors)}
    write_json_atomic(Path(args.out), {
        "command": "python " + shlex.join(sys.argv),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cti_file": args.cti, "transfer_file": args.transfer, "repetitions": args.repetitions,
        "n_points": len(points), "n_groups": len(groups),
        "every_question": _rank_all(groups, None), "cross_fitted": cross_fitted,
        "calibration_floor": calibration})
    for name, c in cross_fitted.items():
        print(f"{name:14s} n={c['n_points']:3d} " + " ".join(f"{k}={c[k]['median']:+.3f}" for k in PREDICTORS)
              + f" ahead={c['floor_plus_cti_ahead_fraction']:.2f}")
    if calibration is not None:
        for name, c in calibration.items():
            if isinstance(c, dict) and "n_points" in c:
                print(f"calibration floor {name:14s} n={c['n_points']:3d} cti={c['cti']:+.3f} "
                      f"floor={c['floor']:+.3f} floor_plus_cti={c['floor_plus_cti']:+.3f}")


if __name__ == "__main__":
    main()

"""How much of the CTI's rank correlation the retention table's own noise allows.

Each retention is a ratio of mean task scores over 37-150 questions with nearly binary F1, so its 95% interval
spans about +-0.3. A perfect predictor of the *true* retention would still correlate imperfectly with the
*measured* one. This script measures that from the per-example records, with no model run:

- ``spearman_cti_bootstrap``: the CTI's Spearman against retention recomputed on bootstrap resamples of each pair's
  questions (paired across that pair's methods and the full-prefill reference): what the reported figure could
  have been with other draws of the questions.
- ``split_half``: the questions of each pair are split at random in two halves and retention recomputed on each;
  the Spearman between the two halves' rankings is the table's split-half reliability ``r``. The Spearman-Brown
  step ``2 r / (1 + r)`` estimates the full-length reliability ``R``, and ``sqrt(R)`` the highest correlation a
  predictor of the true retention could expect against the measured one (the attenuation bound of classical test
  theory, Spearman 1904; exact for Pearson correlation under additive noise, an approximation for ranks).
- The same figures per workload (``workload_<name>``) and over the receivers whose full-prefill score reaches
  ``--min-full-score``, so the index can be set against the ceiling where it falls short.
- ``questions_multiplier_for_ceiling``: how many times more questions per cell the same Spearman-Brown formula
  says the table needs before its ceiling reaches ``--ceiling`` (reliability ``c^2``):
  ``k = c^2 (1 - R) / (R (1 - c^2))``; ``questions_needed_per_group`` is ``ceil(k n)`` for each cell of ``n``
  questions (a workload with fewer evaluation examples than that cannot get there by more questions alone).

Pairs are resampled independently of each other (receivers' full-prefill references shared between pairs are not
tied together). The points are the index's per-pair predictions matched to the current retention table
(``--transfer``, as ``benchmarks/cti_recorrelate.py`` and ``benchmarks/cti_floor.py`` do), so the figures describe
the table as it stands, not as it stood when the index was computed.

    python benchmarks/retention_noise.py --cti docs/results/cti_k4_p1.json --out docs/results/cti_retention_noise.json
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
from cachecert_agents.eval.cti_eval import correlate, spearman
from cachecert_agents.eval.transfer_eval import artifact_stem
from cachecert_agents.jsonl import read_jsonl


def _group_scores(results_dir: Path, sender: str, receiver: str, workload: str, methods: list[str], n: int,
                  target: str = "retention") -> tuple[np.ndarray, np.ndarray, float, list[str]]:
    """``(transfer [methods, ids], full [ids], mean full-prefill task score, ids)`` over the first ``n`` examples
    evaluated (a run in progress may have appended more); NaN where a method lacks an example. For
    ``target="agreement"`` the transfer entries are 0/1 agreement with the full-prefill answer and ``full`` is all
    ones, so the same ratio of means is the agreement rate."""
    records = read_jsonl(results_dir / f"{artifact_stem(sender, receiver, workload)}.jsonl")
    full = {r["id"]: r["score"] for r in read_jsonl(results_dir / "full" / f"{receiver}__{workload}.jsonl")}
    key = "score" if target == "retention" else "agree"
    latest = {(r["id"], r["method"]): float(r[key]) for r in records if r["id"] in full}
    ids = list(dict.fromkeys(i for i, m in latest if m in methods))[:n]  # in evaluation order
    transfer = np.array([[latest.get((i, m), np.nan) for i in ids] for m in methods])
    return transfer, np.array([full[i] if target == "retention" else 1.0 for i in ids]), float(
        np.mean([full[i] for i in ids])), ids


def _retention(transfer: np.ndarray, full: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Retention of every method on the examples ``idx`` (with repeats): mean transfer / mean full over the
    examples the method has."""
    t = transfer[:, idx]
    has = ~np.isnan(t)
    den = np.where(has, full[idx][None], 0.0).sum(1)
    return np.where(den > 0, np.nansum(t, 1) / np.where(den > 0, den, 1), np.nan)


def _noise(data: list[tuple[list[dict], np.ndarray, np.ndarray]], target: str, resamples: int, seed: int,
           ceiling: float) -> dict:
    """The bootstrap, split-half and questions-needed figures of the module docstring over the groups ``data``."""
    cti = [p["cti"] for pts, _, _ in data for p in pts]
    rng = np.random.default_rng(seed)
    boot, halves = [], []
    for _ in range(resamples):
        resampled = np.concatenate([_retention(t, f, rng.integers(0, f.size, f.size)) for _, t, f in data])
        has = ~np.isnan(resampled)  # a resample may draw none of a method's examples, or only zero references
        boot.append(spearman(np.asarray(cti)[has].tolist(), resampled[has].tolist()))
        a, b = [], []
        for _, t, f in data:
            perm = rng.permutation(f.size)
            a.append(_retention(t, f, perm[: f.size // 2]))
            b.append(_retention(t, f, perm[f.size // 2:]))
        a, b = np.concatenate(a), np.concatenate(b)
        ok = ~(np.isnan(a) | np.isnan(b))
        halves.append(spearman(a[ok].tolist(), b[ok].tolist()))
    boot, halves = np.array(boot), np.array(halves)
    r_half = float(np.nanmedian(halves))
    r_full = 2 * r_half / (1 + r_half)

    def summary(v: np.ndarray) -> dict:
        v = v[~np.isnan(v)]
        return {"median": float(np.median(v)), "mean": float(v.mean()), "std": float(v.std()),
                "q05": float(np.quantile(v, 0.05)), "q95": float(np.quantile(v, 0.95)), "resamples": int(v.size)}

    return {"n_points": len(cti), "n_groups": len(data),
            "spearman_cti_measured": spearman(cti, [p[target] for pts, _, _ in data for p in pts]),
            "spearman_cti_bootstrap": summary(boot), "split_half": summary(halves),
            "reliability_spearman_brown": r_full, "attenuation_ceiling": float(np.sqrt(max(r_full, 0.0))),
            **_questions_needed(data, r_full, ceiling)}


def _questions_needed(data: list[tuple[list[dict], np.ndarray, np.ndarray]], reliability: float,
                      ceiling: float) -> dict:
    """Spearman-Brown's answer to "how many more questions": the multiplier ``k`` of the module docstring and
    ``ceil(k n)`` per group (``None`` when the table's reliability is not positive: no number of questions is
    predicted to suffice)."""
    wanted = ceiling ** 2
    k = wanted * (1 - reliability) / (reliability * (1 - wanted)) if reliability > 0 else None
    return {"ceiling_wanted": ceiling, "questions_multiplier_for_ceiling": k,
            "questions_needed_per_group": {f"{pts[0]['sender']}->{pts[0]['receiver']} {pts[0]['workload']}":
                                           (int(np.ceil(k * f.size)) if k is not None else None)
                                           for pts, _, f in data}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cti", default="docs/results/cti_k4_p1.json", help="a `cachecert cti --all` result")
    ap.add_argument("--transfer", default="docs/results/transfer.json", help="the current retention table")
    ap.add_argument("--results-dir", default="docs/results/transfer", help="the per-example transfer records")
    ap.add_argument("--target", choices=("retention", "agreement"), default="retention",
                    help="what the index is correlated with: retention (the issue's target) or the agreement rate "
                         "with the receiver's full-prefill answer")
    ap.add_argument("--resamples", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-full-score", type=float, default=0.1,
                    help="also report the pairs whose receiver's full-prefill task score reaches this")
    ap.add_argument("--ceiling", type=float, default=0.9,
                    help="the correlation wanted (the issue's 0.9): how many questions would let the table allow it")
    ap.add_argument("--out", default="docs/results/cti_retention_noise.json")
    args = ap.parse_args()
    if not 0 < args.ceiling < 1:
        ap.error(f"--ceiling {args.ceiling} must lie in (0, 1)")
    pairs = json.loads(Path(args.cti).read_text())["results"]["pairs"]
    points = correlate(pairs, json.loads(Path(args.transfer).read_text())["results"], args.target)["points"]
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for p in points:
        groups.setdefault((p["sender"], p["receiver"], p["workload"]), []).append(p)
    data, full_scores = [], []
    for (sender, receiver, workload), pts in groups.items():
        transfer, full, full_score, _ = _group_scores(Path(args.results_dir), sender, receiver, workload,
                                                   [p["method"] for p in pts], max(p["n"] for p in pts), args.target)
        recomputed = _retention(transfer, full, np.arange(full.size))
        for p, r in zip(pts, recomputed):
            if not np.isclose(p[args.target], r, atol=1e-9):
                raise ValueError(f"{sender}->{receiver} {workload} {p['method']}: the records give {args.target} "
                                 f"{r}, the table {p[args.target]}")
        data.append((pts, transfer, full))
        full_scores.append(full_score)
    result = {
        "command": "python " + shlex.join(sys.argv),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cti_file": args.cti, "transfer_file": args.transfer, "target": args.target,
        "examples_per_group": {f"{pts[0]['sender']}->{pts[0]['receiver']} {pts[0]['workload']}": int(f.size)
                               for pts, _, f in data},
        "full_score_per_group": {f"{pts[0]['sender']}->{pts[0]['receiver']} {pts[0]['workload']}": score
                                 for (pts, _, _), score in zip(data, full_scores)},
        "all_points": _noise(data, args.target, args.resamples, args.seed, args.ceiling),
        **{f"workload_{w}": _noise([g for g in data if g[0][0]["workload"] == w], args.target, args.resamples,
                                   args.seed, args.ceiling)
           for w in sorted({g[0][0]["workload"] for g in data})},
        f"receivers_scoring_at_least_{args.min_full_score}": _noise(
            [g for g, score in zip(data, full_scores) if score >= args.min_full_score], args.target, args.resamples,
            args.seed, args.ceiling),
    }
    write_json_atomic(Path(args.out), result)
    print(json.dumps({k: {f: x for f, x in v.items() if f != "questions_needed_per_group"}
                      for k, v in result.items() if isinstance(v, dict) and "n_points" in v}, indent=1))


if __name__ == "__main__":
    main()

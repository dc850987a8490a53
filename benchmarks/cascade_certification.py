"""Would a cascade of transfers save more than one certified transfer? Measured on the labelled pools (no model run).

A *cascade* tries the cheapest transfer first (``ridge-kv``: mapping only), serves it when its risk score is at most
a threshold ``theta``, else builds the next one (``ridge-kv+r20``, then ``+r35`` where recorded), and prefills when
every stage is refused. One threshold serves every stage: entropy and margin are read off the same receiver's
first-token distribution, so they are on one scale across stages (the guarantee does not need that; the power
does). A request served by stage k pays the transfers and scoring passes of stages 1..k; a refused one pays all of
them, then a prefill (conservative: stage k+1 remaps instead of reusing stage k's mapped keys/values).

Guarantee. The loss ``L_i(theta) = unsafe label of the stage that serves request i`` is not monotone in ``theta``
(a larger theta can move a request from an unsafe later stage to a safe earlier one), so CRC is run on its running
maximum ``Lmax_i(theta) = max_{t <= theta} L_i(t)``, which is monotone, bounded by 1 and above ``L_i``: CRC's
``E[Lmax_{n+1}(theta_hat)] <= alpha`` (Angelopoulos et al., "Conformal Risk Control", ICLR 2024, Thm. 1) then bounds
the served-and-unsafe rate. The realised risk over random splits is reported to check it.

Compared on each pool's common requests, at each alpha, over the same random calibration/test halves:
the single transfer ``ridge-kv+r20`` (CRC on its own score), the same screened by ``ridge-kv`` (cert.md, "Two-stage
certificates"), the cascade, and each one's perfect-score ceiling (in-sample: every safe request served by the
cheapest safe stage, plus alpha of the requests by their most profitable unsafe stage).

    python benchmarks/cascade_certification.py --out docs/results/cascade_certification.json
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import numpy as np

from cachecert_agents.cert.conformal import InfeasibleRiskError, crc_threshold
from cachecert_agents.eval.cert_eval import (LabelledRequests, labelled_requests, perfect_score_saving,
                                             screened_requests)
from cachecert_agents.eval.transfer_eval import recorded_pools

STAGES = ("ridge-kv", "ridge-kv+r20", "ridge-kv+r35")


def cascade_losses(scores: np.ndarray, unsafe: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidates ``[C]`` (``-inf`` then every stage score) and the monotonised cascade loss ``[n, C]`` for stage
    ``scores`` and labels ``unsafe`` ``[n, K]`` (stage order = the order tried)."""
    cand = np.concatenate(([-np.inf], np.unique(scores)))
    served = scores[:, :, None] <= cand[None, None, :]  # [n, K, C]
    stage = np.argmax(served, axis=1)  # [n, C]: the first stage accepted
    loss = np.where(served.any(axis=1), np.take_along_axis(unsafe, stage, axis=1), 0.0)
    return cand, np.maximum.accumulate(loss, axis=1)


def cascade_threshold(scores: np.ndarray, unsafe: np.ndarray, alpha: float) -> float:
    """CRC's largest candidate with ``(sum_i Lmax_i(theta) + 1) / (n + 1) <= alpha`` (the loss is monotone, so the
    feasible set is a prefix); raises :class:`InfeasibleRiskError` when not even ``-inf`` is feasible."""
    n = scores.shape[0]
    if 1 / (n + 1) > alpha:
        raise InfeasibleRiskError(f"n={n} is too small for alpha={alpha}")
    cand, loss = cascade_losses(scores, unsafe)
    k = int(np.count_nonzero(loss.sum(0) <= alpha * (n + 1) - 1 + 1e-9))
    return float(np.inf) if k == cand.size else float(cand[k - 1])


def cascade_outcome(scores: np.ndarray, unsafe: np.ndarray, gain_served: np.ndarray, gain_refused: np.ndarray,
                    theta: float) -> tuple[np.ndarray, np.ndarray]:
    """Per request: the served-and-unsafe loss and the prefill saved under threshold ``theta``."""
    served = scores <= theta
    stage = np.argmax(served, axis=1)
    rows = np.arange(scores.shape[0])
    anyone = served.any(axis=1)
    return (np.where(anyone, unsafe[rows, stage], 0.0), np.where(anyone, gain_served[rows, stage], gain_refused))


def cascade_ceiling(unsafe: np.ndarray, gain_served: np.ndarray, gain_refused: np.ndarray, alpha: float) -> float:
    """In-sample optimum over per-request stage choices with at most ``floor(alpha n)`` served-and-unsafe."""
    n = unsafe.shape[0]
    safe_gain = np.where(unsafe < 0.5, gain_served, -np.inf).max(axis=1)
    base = np.maximum(np.where(np.isfinite(safe_gain), safe_gain, gain_refused), gain_refused)
    unsafe_gain = np.where(unsafe > 0.5, gain_served, -np.inf).max(axis=1)
    extra = np.sort((unsafe_gain - base)[unsafe_gain > base])[::-1][:int(np.floor(alpha * n + 1e-9))]
    return max(0.0, float((base.sum() + extra.sum()) / n))


def stage_arrays(pool: dict[str, LabelledRequests], stages: list[str], ids: list[str], score: str
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Scores and labels ``[n, K]``, the prefill saved when served by each stage ``[n, K]`` and when refused
    ``[n]`` (stage costs accumulate; costs as :meth:`LabelledRequests.gains`)."""
    cols = {k: [] for k in ("score", "unsafe", "served_cost", "tried_cost")}
    prefill = None
    for m in stages:
        lr = pool[m]
        at = [lr.ids.index(i) for i in ids]
        served_gain, refused_gain = lr.gains(score)
        cols["score"].append(lr.scores[score][at])
        cols["unsafe"].append(lr.unsafe[at])
        cols["served_cost"].append(1 - served_gain[at])
        cols["tried_cost"].append(-refused_gain[at])
        prefill = lr.prefill_s[at] if prefill is None else prefill
    s, u, served_cost, tried_cost = (np.stack(cols[k], axis=1) for k in ("score", "unsafe", "served_cost",
                                                                          "tried_cost"))
    before = np.concatenate([np.zeros((len(ids), 1)), np.cumsum(tried_cost, axis=1)[:, :-1]], axis=1)
    return s, u, 1 - (before + served_cost), -tried_cost.sum(axis=1)


def evaluate_pool(pool: dict[str, LabelledRequests], alphas: list[float], splits: int, seed: int = 0,
                  stages: tuple[str, ...] = STAGES) -> list[dict]:
    """Rows for one pool: the cascade over the ``stages`` recorded in it (in the order given), against the single
    and screened ``ridge-kv+r20``."""
    stages = [m for m in stages if m in pool]
    ids = sorted(set.intersection(*(set(pool[m].ids) for m in stages)))
    n = len(ids)
    single = pool["ridge-kv+r20"]
    screened = screened_requests(single, pool["ridge-kv"])
    rows = []
    for score in ("entropy", "margin", "geometry"):
        s, u, g_served, g_refused = stage_arrays(pool, stages, ids, score)
        variants = {"single": stage_arrays({"x": single}, ["x"], ids, score),
                    "screened": stage_arrays({"x": screened}, ["x"], ids, score),
                    "cascade": (s, u, g_served, g_refused)}
        for alpha in alphas:
            rng = np.random.default_rng(seed)
            perms = [rng.permutation(n) for _ in range(splits)]
            for name, (vs, vu, vg, vr) in variants.items():
                risks, saved, infeasible = [], [], 0
                for perm in perms:
                    cal, test = perm[: n // 2], perm[n // 2:]
                    try:
                        theta = (cascade_threshold(vs[cal], vu[cal], alpha) if vs.shape[1] > 1
                                 else crc_threshold(vs[cal, 0], vu[cal, 0], alpha))
                    except InfeasibleRiskError:
                        infeasible += 1
                        continue
                    loss, gain = cascade_outcome(vs[test], vu[test], vg[test], vr[test], theta)
                    risks.append(loss.mean())
                    saved.append(0.0 if theta == -np.inf else gain.mean())  # accepting nothing is never tried
                ceiling = (cascade_ceiling(vu, vg, vr, alpha) if vs.shape[1] > 1
                           else perfect_score_saving(vu[:, 0], vg[:, 0], vr, alpha))
                r = np.asarray(risks)
                rows.append({"sender": single.sender, "receiver": single.receiver, "workload": single.workload,
                             "variant": name, "stages": stages if name == "cascade" else [single.method]
                             if name == "single" else [screened.method], "score": score, "alpha": alpha, "n": n,
                             "splits": splits, "n_infeasible": infeasible,
                             "risk_mean": float(r.mean()) if r.size else None,
                             "risk_std": float(r.std(ddof=1)) if r.size > 1 else None,
                             "risk_max": float(r.max()) if r.size else None,
                             "prefill_saved": float(np.mean(saved)) if saved else None,
                             "prefill_saved_perfect_score": ceiling,
                             "unsafe_rate_stages": [float(x) for x in u.mean(0)]})
    return rows


def write_markdown(rows: list[dict], command: str, path: Path, alpha: float = 0.1) -> None:
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = ["# Cascades of transfers against one certified transfer", "", f"Command: `{command}`", "",
             "Per pool (the requests common to every stage), CRC at "
             f"alpha = {alpha}, calibration on a random half, {rows[0]['splits']} splits. *single*: `ridge-kv+r20` "
             "on its own score; *screened*: `ridge-kv+r20` decided by the `ridge-kv` score; *cascade*: the "
             "cascade's stages, tried in that order, one threshold. Each cell: mean realised risk / mean prefill "
             "saved (perfect-score ceiling). See the script's docstring for costs and the guarantee.", "",
             "| pair | workload | n | score | single | screened | cascade (stages) |", "|---|---|---|---|---|---|---|"]
    by = {}
    for r in rows:
        if r["alpha"] == alpha:
            by.setdefault((r["sender"], r["receiver"], r["workload"], r["n"], r["score"]), {})[r["variant"]] = r
    for (s, rcv, w, n, score), v in sorted(by.items()):
        cell = lambda r: f"{f(r['risk_mean'])} / {f(r['prefill_saved'])} ({f(r['prefill_saved_perfect_score'])})"  # noqa: E731
        lines.append(f"| {s} -> {rcv} | {w} | {n} | {score} | {cell(v['single'])} | {cell(v['screened'])} | "
                     f"{cell(v['cascade'])} ({', '.join(v['cascade']['stages'])}) |")
    valid = [r for r in rows if r["risk_mean"] is not None]
    lines += ["", f"Validity: {sum(r['risk_mean'] <= r['alpha'] + 1e-12 for r in valid)} of {len(valid)} feasible "
              "rows (every variant, score and alpha) have mean realised risk at or below alpha.", ""]
    best = {}
    for r in valid:
        if r["alpha"] == alpha:
            key = (r["sender"], r["receiver"], r["workload"])
            best.setdefault(key, {}).setdefault(r["variant"], []).append(r["prefill_saved"])
    wins = sum(max(v.get("cascade", [-9])) > max(max(v.get("single", [-9])), max(v.get("screened", [-9]))) + 1e-3
               for v in best.values())
    lines += [f"At alpha = {alpha} the cascade's best score saves more than the best single or screened transfer on "
              f"{wins} of {len(best)} pools.", ""]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results-dir", default="docs/results/transfer")
    ap.add_argument("--alpha", default="0.05,0.1,0.2")
    ap.add_argument("--splits", type=int, default=500)
    ap.add_argument("--min-n", type=int, default=20)
    ap.add_argument("--stages", default=None,
                    help="comma-separated methods tried in this order (default: ridge-kv,ridge-kv+r20 and "
                         "ridge-kv+r35 where recorded); given, only pools recording every one are evaluated")
    ap.add_argument("--out", default="docs/results/cascade_certification.json")
    args = ap.parse_args()
    alphas = [float(a) for a in args.alpha.split(",")]
    stages = tuple(args.stages.split(",")) if args.stages else STAGES
    required = set(stages) if args.stages else set()
    rows = []
    for sender, receiver, workload in recorded_pools(Path(args.results_dir)):
        pool = labelled_requests(Path(args.results_dir), sender, receiver, workload)
        if not {"ridge-kv", "ridge-kv+r20"} | required <= set(pool):
            continue
        common = set.intersection(*(set(pool[m].ids) for m in {"ridge-kv", "ridge-kv+r20"} | required))
        if len(common) >= args.min_n:
            rows += evaluate_pool(pool, alphas, args.splits, stages=stages)
    command = "python benchmarks/cascade_certification.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None
    ) + f" --out {args.out}"
    out = Path(args.out)
    out.write_text(json.dumps({"command": command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "results": rows}, indent=1) + "\n")
    write_markdown(rows, command, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()

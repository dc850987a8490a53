"""Does the geometry score add anything to entropy and margin? A combined score learnt on the *other* pools.

The geometry score alone ranks unsafe transfers worse than the receiver's entropy on most pools
(``docs/results/cert_counts.json``). That leaves open whether it carries information the output scores lack. This
benchmark (records only, no model run) fits a logistic regression of the label ``unsafe`` on request scores over
every pool except the one evaluated (leave-pool-out: all methods of the same sender, receiver and workload are held
out, since they share requests), and uses its log-odds as a risk score on the held-out pool:

- ``pooled:entropy+margin``: features entropy and margin;
- ``pooled:entropy+margin+geometry``: the same plus ``log(geometry)``.

The difference between the two is the geometry score's marginal value. Because the weights never see the
evaluated pool, the pooled score is a fixed function of the request there and CRC's guarantee holds exactly as for
any other score. Each score is validated like ``cachecert eval cert`` (CRC at ``--alpha``, ``--splits`` random
half/half splits, :func:`cachecert_agents.eval.cert_eval.validate`): AUC, mean realised risk and the certified
saving with the savings guard. Every score but the constant is charged alike (:meth:`LabelledRequests.gains`).

    python benchmarks/pooled_risk_score.py --out docs/results/pooled_risk_score.json
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import shlex
import sys
from typing import Callable

import numpy as np
from pool_args import parse_pool_args

from cachecert_agents.cli import write_json_atomic
from cachecert_agents.eval.cert_eval import LabelledRequests, labelled_requests, validate
from cachecert_agents.eval.transfer_eval import recorded_pools

POOLED = {"pooled:entropy+margin": ("entropy", "margin"),
          "pooled:entropy+margin+geometry": ("entropy", "margin", "geometry")}
REFERENCES = ("entropy", "margin", "geometry")
TIE = 1e-3


def features(lab: LabelledRequests, names: tuple[str, ...]) -> np.ndarray:
    """``[n, len(names)]``: the requests' scores, geometry on a log scale (it spans orders of magnitude)."""
    cols = [np.log(np.maximum(lab.scores[s], 1e-12)) if s == "geometry" else lab.scores[s] for s in names]
    return np.stack(cols, axis=1)


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-2, steps: int = 50) -> Callable[[np.ndarray], np.ndarray]:
    """L2-regularised logistic regression of ``y`` ``[n]`` (0/1) on standardised ``x`` ``[n, d]`` by Newton's
    method; returns the log-odds function (larger = riskier) for new rows."""
    mu, sd = x.mean(0), x.std(0) + 1e-12
    design = lambda a: np.c_[(a - mu) / sd, np.ones(len(a))]  # noqa: E731
    z = design(x)
    w = np.zeros(z.shape[1])
    for _ in range(steps):
        p = 1 / (1 + np.exp(-z @ w))
        grad = z.T @ (p - y) + l2 * w
        hess = (z.T * (p * (1 - p))) @ z + l2 * np.eye(len(w))
        w -= np.linalg.solve(hess, grad)
    return lambda a: design(a) @ w


def main() -> None:
    args = parse_pool_args(__doc__)
    pools = {(s, r, w, m): lab for s, r, w in recorded_pools(args.results)
             for m, lab in labelled_requests(args.results, s, r, w).items() if len(lab) >= args.min_n}
    rows = []
    for key, lab in pools.items():
        train = [other for k, other in pools.items() if k[:3] != key[:3]]
        extra = {}
        for name, names in POOLED.items():
            model = fit_logistic(np.concatenate([features(t, names) for t in train]),
                                 np.concatenate([t.unsafe for t in train]))
            extra[name] = model(features(lab, names))
        scored = dataclasses.replace(lab, scores={**lab.scores, **extra})
        checked = validate(scored, [args.alpha], args.splits, delta=None, scores=REFERENCES + tuple(POOLED))
        rows.append({"sender": key[0], "receiver": key[1], "workload": key[2], "method": key[3], "n": len(lab),
                     "unsafe_rate": float(lab.unsafe.mean()),
                     "prefill_saved_perfect_score": checked[0]["prefill_saved_perfect_score"],
                     "scores": {r["score"]: {"auc": r["score_auc"], "risk_mean": r["risk_mean"],
                                             "risk_max": r["risk_max"],
                                             "feasible": r["n_infeasible"] < r["splits"],
                                             "prefill_saved_guarded": r["prefill_saved_guarded"],
                                             "accept_rate_guarded": r["accept_rate_guarded"]} for r in checked}})
    with_geo, without = "pooled:entropy+margin+geometry", "pooled:entropy+margin"

    def count(metric: str, a: str, b: Callable[[dict], float], only_saving: bool = False) -> dict:
        ahead = tied = behind = 0
        for row in rows:
            s = row["scores"]
            if any(s[x]["auc"] is None for x in s):
                continue
            if only_saving and max(v["prefill_saved_guarded"] for v in s.values()) <= TIE:
                continue
            diff = s[a][metric] - b(s)
            ahead, tied, behind = ahead + (diff > TIE), tied + (abs(diff) <= TIE), behind + (diff < -TIE)
        return {"ahead": ahead, "tied": tied, "behind": behind}

    best_output = lambda m: (lambda s: max(s["entropy"][m], s["margin"][m]))  # noqa: E731
    summary = {
        "pools": len(rows),
        "median_auc": {name: float(np.median([r["scores"][name]["auc"] for r in rows
                                              if r["scores"][name]["auc"] is not None]))
                       for name in REFERENCES + tuple(POOLED)},
        "auc_geometry_added": count("auc", with_geo, lambda s: s[without]["auc"]),
        "auc_pooled_against_best_output_score": count("auc", with_geo, best_output("auc")),
        "saving_geometry_added_where_any_saves": count("prefill_saved_guarded", with_geo,
                                                       lambda s: s[without]["prefill_saved_guarded"], True),
        "saving_pooled_against_best_output_score_where_any_saves": count(
            "prefill_saved_guarded", with_geo, best_output("prefill_saved_guarded"), True),
        "best_guarded_saving": {name: max(r["scores"][name]["prefill_saved_guarded"] for r in rows)
                                for name in REFERENCES + tuple(POOLED)},
        "crc_feasible_rows_at_or_below_alpha": sum(v["feasible"] and v["risk_mean"] <= args.alpha + 1e-12
                                                   for r in rows for v in r["scores"].values()),
        "crc_feasible_rows": sum(v["feasible"] for r in rows for v in r["scores"].values()),
    }
    write_json_atomic(args.out, {"command": "python " + shlex.join(sys.argv), "date": datetime.date.today().isoformat(),
                                 "alpha": args.alpha, "splits": args.splits, "summary": summary, "rows": rows})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

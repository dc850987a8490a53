"""Does a second cheap answer tell a certificate which repaired transfers are unsafe? (records only, no model run)

A repaired transfer (``ridge-kv+r20``) is unsafe when its answer differs from the receiver's own full-prefill
answer. A *consistency check* asks a second, independent cheap answer to the same request and compares the two:
``lexical-context@20`` (the receiver prefills the 20% of the context chosen by the question's words, no cache)
or ``pruned-context@20`` (the 20% chosen on the transferred cache); or two answers that exist before any
transfer: ``no-context`` (the receiver answers from the question alone) and ``sender`` (the sender answers on its
own exact cache, which the handoff already holds). All four answers are already in every pool's records, so the
check can be scored without running a model:

- ``consistency``: 1 when the two answers disagree under the workload's agreement criterion, else 0;
- ``consistency+entropy``: consistency first, the entropy score within each class (``100 * consistency +
  entropy``), a continuous score with the same order between classes;
- ``entropy``: the library's entropy score alone (the reference; free, it comes from the answer's first pass).

Each is validated like ``cachecert eval cert`` (CRC at ``--alpha``, ``--splits`` random half/half splits,
:func:`cachecert_agents.eval.cert_eval.validate`), on the same labels and prefill times. The check's cost is its
recorded time (choice plus its prefill: ``transfer_s`` of the control's record) and is paid on every request,
served or refused. Its decode is not timed in the records and is left out, so the savings of the two
consistency scores are upper bounds. ``no-context`` and ``sender`` records carry no time of their own at all,
so those checks are charged nothing (``check_cost_recorded: false``): their savings are upper bounds on what the
check could buy at no cost, and their AUC is the figure to read. For ``pruned-context@20`` the recorded time
includes a second choice of the tokens that a deployment would share with the transfer, so its cost is
overstated; its AUC is reported as well.

    python benchmarks/answer_consistency_score.py --out docs/results/answer_consistency_score.json
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

import numpy as np
from pool_args import parse_pool_args

from cachecert_agents.eval.cert_eval import LabelledRequests, labelled_requests, validate
from cachecert_agents.eval.transfer_eval import recorded_pools, records_path
from cachecert_agents.eval.workloads import get_workload
from cachecert_agents.jsonl import read_jsonl

TARGET = "ridge-kv+r20"
CHECKS = ("lexical-context@20", "pruned-context@20", "no-context", "sender")


def crc_row(lab: LabelledRequests, name: str, score: np.ndarray, extra_cost_s: np.ndarray, alpha: float,
            splits: int) -> dict:
    """CRC validation of ``score`` (larger = riskier), named ``name``, on ``lab``, its cost ``extra_cost_s`` added to
    the scoring time of every request. Any score but geometry and constant is accounted like entropy by
    :meth:`LabelledRequests.gains` (transfer + scoring when served, transfer + answer pass + scoring when
    refused)."""
    scored = dataclasses.replace(lab, scores={**lab.scores, name: score}, score_s=lab.score_s + extra_cost_s)
    row = validate(scored, [alpha], splits, delta=None, scores=(name,))[0]
    return {"prefill_saved": row["prefill_saved"], "prefill_saved_guarded": row["prefill_saved_guarded"],
            "risk_mean": row["risk_mean"], "risk_max": row["risk_max"], "accept_rate": row["accept_rate"],
            "prefill_saved_perfect_score": row["prefill_saved_perfect_score"], "auc": row["score_auc"]}


def pool_rows(results_dir: Path, sender: str, receiver: str, workload: str, alpha: float, splits: int,
              min_n: int) -> list[dict]:
    lab = labelled_requests(results_dir, sender, receiver, workload).get(TARGET)
    if lab is None:
        return []
    records = {(r["id"], r["method"]): r for r in read_jsonl(records_path(results_dir, sender, receiver, workload))}
    agree = get_workload(workload).agree
    rows = []
    for check in CHECKS:
        keep = [k for k, i in enumerate(lab.ids) if (i, check) in records and (i, TARGET) in records]
        if len(keep) < min_n:
            continue
        sub = lab.take(keep)
        disagree = np.array([0.0 if agree(records[(i, TARGET)]["answer"], records[(i, check)]["answer"]) else 1.0
                             for i in sub.ids])
        timed = all("transfer_s" in records[(i, check)] for i in sub.ids)  # else charged nothing (see above)
        check_s = np.array([float(records[(i, check)]["transfer_s"]) if timed else 0.0 for i in sub.ids])
        entropy = sub.scores["entropy"]
        rows.append({
            "sender": sender, "receiver": receiver, "workload": workload, "method": TARGET, "check": check,
            "n": len(sub), "unsafe_rate": float(sub.unsafe.mean()), "consistent_rate": float(1 - disagree.mean()),
            "unsafe_rate_when_consistent": (float(sub.unsafe[disagree == 0].mean()) if (disagree == 0).any()
                                            else None),
            "check_cost_recorded": timed,
            "check_cost_over_prefill_median": float(np.median(check_s / sub.prefill_s)) if timed else None,
            "scores": {name: crc_row(sub, name, score, cost, alpha, splits) for name, score, cost in (
                ("entropy", entropy, np.zeros_like(check_s)), ("consistency", disagree, check_s),
                ("consistency+entropy", 100 * disagree + entropy, check_s))}})
    return rows


def _median(values: list[float | None]) -> float | None:
    """Median of the values that are not None (None when there are none)."""
    known = [v for v in values if v is not None]
    return float(np.median(known)) if known else None


def main() -> None:
    args = parse_pool_args(__doc__, "skip pools with fewer labelled requests holding the check")
    rows = [row for sender, receiver, workload in recorded_pools(args.results)
            for row in pool_rows(args.results, sender, receiver, workload, args.alpha, args.splits, args.min_n)]
    summary = {}
    for check in CHECKS:
        mine = [r for r in rows if r["check"] == check]
        summary[check] = {
            "pools": len(mine),
            "median_auc": {s: _median([r["scores"][s]["auc"] for r in mine])
                           for s in ("entropy", "consistency", "consistency+entropy")},
            "auc_above_entropy": sum((r["scores"]["consistency+entropy"]["auc"] or 0)
                                     > (r["scores"]["entropy"]["auc"] or 0) for r in mine),
            "saving_above_entropy": sum(r["scores"]["consistency+entropy"]["prefill_saved_guarded"]
                                        > r["scores"]["entropy"]["prefill_saved_guarded"] + 1e-3 for r in mine),
            "best_guarded_saving": {s: max((r["scores"][s]["prefill_saved_guarded"] for r in mine), default=None)
                                    for s in ("entropy", "consistency", "consistency+entropy")}}
    out = {"command": "python benchmarks/answer_consistency_score.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "results"),
           "date": datetime.date.today().isoformat(), "alpha": args.alpha, "splits": args.splits,
           "summary": summary, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

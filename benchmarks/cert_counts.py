"""Counts over every pool of ``cert.json`` (no model run): how often the guarantees held, and how the scores compare.

- **validity**: CRC rows whose mean realised risk over the splits is at or below alpha, and LTT rows whose fraction
  of splits above alpha is at or below delta, among the feasible rows (fewer infeasible splits than splits);
  the LTT exceptions' range.
- **geometry against the baselines**: for each pool x method with all three scores (CRC, at ``--alpha``), whether
  the geometry score saves more prefill than both the entropy and the margin score, ties (within ``--tie``), or
  saves less; and how many rows save anything with any score.
- **savings guard**: mean certified saving at ``--alpha`` without and with the guard, and the guarded CRC rows'
  validity.

    python benchmarks/cert_counts.py --cert docs/results/cert.json --out docs/results/cert_counts.json
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections import defaultdict
from pathlib import Path


def validity(rows: list[dict]) -> dict:
    feasible = [r for r in rows if r.get("n_infeasible", 0) < r["splits"]]
    crc = [r for r in feasible if r["control"] == "crc"]
    ltt = [r for r in feasible if r["control"] == "ltt"]
    crc_ok = sum(r["risk_mean"] <= r["alpha"] + 1e-12 for r in crc)
    exceptions = sorted(r["frac_above_alpha"] for r in ltt if r["frac_above_alpha"] > r["delta"] + 1e-12)
    return {"pools": len({(r["sender"], r["receiver"], r["workload"]) for r in rows}),
            "pairs": len({(r["sender"], r["receiver"]) for r in rows}),
            "crc_feasible": len(crc), "crc_at_or_below_alpha": crc_ok,
            "ltt_feasible": len(ltt), "ltt_at_or_below_delta": len(ltt) - len(exceptions),
            "ltt_exception_range": [exceptions[0], exceptions[-1]] if exceptions else None}


def geometry_against_baselines(rows: list[dict], alpha: float, tie: float) -> dict:
    saved: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if r["control"] == "crc" and r["alpha"] == alpha:
            saved[(r["sender"], r["receiver"], r["workload"], r["method"])][r["score"]] = r["prefill_saved"]
    ahead = tied = behind = positive = 0
    for scores in saved.values():
        if not {"geometry", "entropy", "margin"} <= set(scores):
            continue
        g, best_baseline = scores["geometry"], max(scores["entropy"], scores["margin"])
        if abs(g - best_baseline) <= tie:
            tied += 1
        elif g > best_baseline:
            ahead += 1
        else:
            behind += 1
        positive += max(scores.values()) > tie
    return {"alpha": alpha, "tie": tie, "rows": ahead + tied + behind, "geometry_ahead": ahead,
            "tied": tied, "geometry_behind": behind, "rows_where_any_score_saves": positive}


def savings_guard(rows: list[dict], alpha: float) -> dict:
    """The savings guard's effect (CRC rows at ``alpha``, every score): mean certified saving without and with it,
    and how many guarded CRC rows (every alpha) keep mean realised risk at or below alpha."""
    def finite(x) -> bool:
        return x is not None and x == x

    at = [r for r in rows if r["control"] == "crc" and r["alpha"] == alpha
          and finite(r.get("prefill_saved_guarded")) and finite(r["prefill_saved"])]
    crc = [r for r in rows if r["control"] == "crc" and finite(r.get("risk_mean_guarded"))]
    return {"alpha": alpha, "score_rows": len(at),
            "mean_saved_plain": sum(r["prefill_saved"] for r in at) / max(1, len(at)),
            "mean_saved_guarded": sum(r["prefill_saved_guarded"] for r in at) / max(1, len(at)),
            "min_saved_guarded": min((r["prefill_saved_guarded"] for r in at), default=None),
            "max_saved_guarded": max((r["prefill_saved_guarded"] for r in at), default=None),
            "guarded_crc_rows": len(crc),
            "guarded_crc_at_or_below_alpha": sum(r["risk_mean_guarded"] <= r["alpha"] + 1e-12 for r in crc)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cert", default="docs/results/cert.json")
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--tie", type=float, default=1e-3)
    ap.add_argument("--out", default="docs/results/cert_counts.json")
    args = ap.parse_args()
    rows = json.loads(Path(args.cert).read_text())["results"]
    out = {"command": f"python benchmarks/cert_counts.py --cert {args.cert} --alpha {args.alpha} --out {args.out}",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "validity": validity(rows), "geometry_against_baselines": geometry_against_baselines(rows, args.alpha,
                                                                                                args.tie),
           "savings_guard": savings_guard(rows, args.alpha)}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

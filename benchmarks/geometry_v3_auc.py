"""The geometry score before and after v3 on the same repaired transfers: how well each ranks unsafe requests.

v2 counted the context tokens that selective recompute (``+rP``) had repaired as if their keys/values were
mapped; v3 leaves them out (they are the receiver's own). A records file re-recorded under v3 keeps its v2
records above the new ones (append-only JSONL), so both scores exist for the same requests, transfers and labels.
Per pool and repaired method: the AUC of v2 and v3 geometry (and of entropy and margin, unchanged) for the label
``unsafe = not agree``, on the requests holding both versions.

    python benchmarks/geometry_v3_auc.py --out docs/results/geometry_v3_auc.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
from pathlib import Path

import numpy as np

from cachecert_agents.cli import write_json_atomic
from cachecert_agents.eval.cert_eval import score_auc
from cachecert_agents.eval.transfer_eval import recorded_pools, records_path
from cachecert_agents.jsonl import read_jsonl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results-dir", default="docs/results/transfer")
    ap.add_argument("--min-n", type=int, default=20, help="skip pools with fewer requests holding both versions")
    ap.add_argument("--out", default="docs/results/geometry_v3_auc.json")
    args = ap.parse_args()
    rows = []
    for sender, receiver, workload in recorded_pools(Path(args.results_dir)):
        by_version: dict[int, dict[tuple[str, str], dict]] = {2: {}, 3: {}}
        for rec in read_jsonl(records_path(Path(args.results_dir), sender, receiver, workload)):
            version = rec.get("risk", {}).get("version")
            if rec.get("recomputed_tokens") and version in by_version:
                by_version[version][(rec["id"], rec["method"])] = rec  # the last record per version wins
        for method in sorted({m for _, m in by_version[3]}):
            keys = sorted(k for k in by_version[3] if k[1] == method and k in by_version[2])
            if len(keys) < args.min_n:
                continue
            old, new = [by_version[2][k] for k in keys], [by_version[3][k] for k in keys]
            unsafe = np.array([0.0 if r["agree"] else 1.0 for r in new])
            same_answer = float(np.mean([a["answer"] == b["answer"] for a, b in zip(old, new)]))
            auc = lambda recs, s: score_auc(np.array([r["risk"][s] for r in recs]), unsafe)  # noqa: E731
            rows.append({"sender": sender, "receiver": receiver, "workload": workload, "method": method,
                         "n": len(keys), "unsafe_rate": float(unsafe.mean()), "same_answer_v2_v3": same_answer,
                         "auc_geometry_v2": auc(old, "geometry"), "auc_geometry_v3": auc(new, "geometry"),
                         "auc_entropy": auc(new, "entropy"), "auc_margin": auc(new, "margin")})
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()))
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    write_json_atomic(Path(args.out), {"command": "python " + shlex.join(sys.argv), "date": date, "results": rows})


if __name__ == "__main__":
    main()

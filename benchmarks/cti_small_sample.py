"""How optimistic the calibration residual is on a few contexts, and how much of that the GCV factor removes.

For every pair x workload with both the index's own small statistics (``$CACHECERT_HOME/cti/*__kK.stats``, from
``cachecert cti --statistics-contexts K``) and the mapper's (``$CACHECERT_HOME/mappers/*.stats``, 20 contexts), the
unweighted residual fraction ``mean_l tr(Sres_l) / tr(Syy_l)`` over the receiver's key/value targets, in-sample and
GCV-inflated (:func:`cachecert_agents.cti.index.gcv_inflation`). Statistics only: no model runs.

    python benchmarks/cti_small_sample.py --k 4 --out docs/results/cti_small_sample.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
from pathlib import Path

from cachecert_agents.cli import write_json_atomic
from cachecert_agents.cti.index import gcv_inflation, schur_residual
from cachecert_agents.paths import cache_home
from cachecert_agents.transfer.statistics import PairStatistics


def residual_fractions(stats: PairStatistics, rho: float = 1e-2) -> dict[str, float]:
    """Mean over ``kv:*`` targets of ``tr(Sres)/tr(Syy)``, in-sample and GCV-inflated, and the mean ``dof/n``."""
    raw, gcv, dof_ratio = [], [], []
    for name in stats.targets:
        if name.startswith("kv:"):
            res, cyy, dof = schur_residual(stats, name, rho)
            frac = float(res.trace() / cyy.trace())
            raw.append(frac)
            gcv.append(frac * gcv_inflation(dof, stats.n_tokens))
            dof_ratio.append(dof / stats.n_tokens)
    return {"in_sample": sum(raw) / len(raw), "gcv": sum(gcv) / len(gcv), "dof_over_n": sum(dof_ratio) / len(raw)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=4, help="contexts of the small statistics")
    ap.add_argument("--out", default="docs/results/cti_small_sample.json")
    args = ap.parse_args()
    rows = []
    for small in sorted((cache_home() / "cti").glob(f"*__k{args.k}.stats.json")):
        name = small.name[: -len(f"__k{args.k}.stats.json")]
        full = cache_home() / "mappers" / f"{name}.stats"
        if not full.with_suffix(".stats.json").exists():
            continue
        a = PairStatistics.load(str(small)[: -len(".json")])
        b = PairStatistics.load(full)
        sender, receiver, workload = name.split("__")
        row = {"sender": sender, "receiver": receiver, "workload": workload,
               "small": dict(residual_fractions(a), contexts=args.k, tokens=a.n_tokens),
               "mapper": dict(residual_fractions(b), contexts=b.header.get("n_calibration_contexts"),
                              tokens=b.n_tokens)}
        rows.append(row)
        print(f"{name}: 1 - residual, {args.k} contexts vs mapper's: in-sample {1 - row['small']['in_sample']:.3f} vs "
              f"{1 - row['mapper']['in_sample']:.3f}; GCV {1 - row['small']['gcv']:.3f} vs {1 - row['mapper']['gcv']:.3f}")
    write_json_atomic(Path(args.out), {
        "command": "python " + shlex.join(sys.argv),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "rows": rows})


if __name__ == "__main__":
    main()

"""Build the ``split@s+wW`` mapper of a pair from the dumps of ``benchmarks/hidden_map_dump.py`` instead of a
second statistics pass: the same artifact ``cachecert calibrate --hidden-width W`` writes (same calibration
contexts, same features, same ridge), in seconds instead of a pass of both models over the calibration text.

It reads the pair's default mapper and statistics (key/value targets: unchanged, copied) and replaces the
residual-stream targets by maps from ``W`` sender layers, fitted on the dumps of the same first
``n_calibration_contexts`` calibration contexts (checked: the token count must match the statistics exactly),
``rho`` chosen on the next 4. One difference: the dumps keep sender features in float16 (the library pass uses
float32); the rounding (~1e-3 relative) is far below the map's residual.

    python benchmarks/hidden_map_refit.py --pair qwen2.5-coder-0.5b:qwen2.5-coder-1.5b --width 9 --splits 14,17
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from cachecert_agents.artifacts import artifact_paths
from cachecert_agents.eval.transfer_eval import mapper_stem
from cachecert_agents.paths import cache_home
from cachecert_agents.transfer.calibrate import pair_fingerprints
from cachecert_agents.transfer.mappers import RidgeMapper
from cachecert_agents.transfer.statistics import PairStatistics, sender_layers_for

logger = logging.getLogger("hidden_map_refit")


def add_dumps(stats: PairStatistics, files: list[Path], splits: list[int], width: int, receiver_boundaries: int,
              count_tokens: bool) -> None:
    """Accumulate ``hidden:s`` moments from dumps into ``stats`` (one context per file; per-context products in
    float32, running sums in float64)."""
    for path in files:
        with safe_open(str(path), "pt") as f:
            sender = f.get_tensor("sender")
            for s in splits:
                layers = sender_layers_for(s, receiver_boundaries, sender.shape[0], width)
                x = torch.cat([sender[m].float() for m in layers], -1)
                stats.add(f"hidden:{s}", layers, x, f.get_tensor(f"hidden:{s}").float(),
                          count_tokens=count_tokens and s == splits[0], product_dtype=torch.float32)
        stats.end_context()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", required=True)
    ap.add_argument("--workload", default="hotpotqa")
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("--splits", default="14")
    ap.add_argument("--receiver-boundaries", type=int, default=29, help="receiver layers + 1")
    ap.add_argument("--dir", help="dumps (default: $CACHECERT_HOME/experiments/<pair>__<workload>)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    s_name, r_name = args.pair.split(":")
    splits = [int(x) for x in args.splits.split(",")]
    stem = mapper_stem(s_name, r_name, args.workload, hidden_width=args.width)
    if artifact_paths(stem)[1].exists():
        raise SystemExit(f"{stem} exists; remove it first (not overwritten)")
    base = mapper_stem(s_name, r_name, args.workload)
    old_mapper = RidgeMapper.load(base)
    expect = pair_fingerprints(old_mapper.header)
    old = PairStatistics.load(f"{base}.stats", expect=expect)
    n_ctx = int(old.header["n_calibration_contexts"])
    root = Path(args.dir) if args.dir else cache_home() / "experiments" / f"{s_name}__{r_name}__{args.workload}"
    files = sorted(root.glob("*.safetensors"))
    if len(files) < n_ctx + 4:
        raise SystemExit(f"{root}: {len(files)} dumps, need {n_ctx + 4}")
    # the dumps must be the statistics' own contexts: the same token count
    dump_tokens = sum(safe_open(str(p), "pt").get_slice(f"hidden:{splits[0]}").get_shape()[0] for p in files[:n_ctx])
    if dump_tokens != old.n_tokens:
        raise SystemExit(f"dumps hold {dump_tokens} tokens, the statistics {old.n_tokens}: not the same contexts")
    header = dict(old.header, hidden_width=args.width, hidden_targets_from="benchmarks/hidden_map_refit.py")
    stats = PairStatistics(header, dict(old.features), {k: v for k, v in old.targets.items() if k.startswith("kv:")},
                           old.n_tokens)
    add_dumps(stats, files[:n_ctx], splits, args.width, args.receiver_boundaries, count_tokens=False)
    heldout = PairStatistics.empty(header)
    add_dumps(heldout, files[n_ctx:n_ctx + 4], splits, args.width, args.receiver_boundaries, count_tokens=True)
    fitted = RidgeMapper.fit(stats, heldout, targets=[f"hidden:{s}" for s in splits])
    mapper = RidgeMapper(dict(old_mapper.header, hidden_width=args.width,
                              hidden_targets_from="benchmarks/hidden_map_refit.py"))
    mapper.header["targets"] = {k: v for k, v in old_mapper.header["targets"].items() if k.startswith("kv:")}
    for name in old_mapper.weights:
        if name.startswith("kv:"):
            mapper.weights[name], mapper.biases[name] = old_mapper.weights[name], old_mapper.biases[name]
    for name in fitted.weights:
        mapper.weights[name], mapper.biases[name] = fitted.weights[name], fitted.biases[name]
        mapper.header["targets"][name] = fitted.header["targets"][name]
        logger.info("%s: sender layers %s, rho %g, held-out R^2 %.4f (width-3 mapper: %s)", name,
                    fitted.header["targets"][name]["sender_layers"], fitted.header["targets"][name]["rho"],
                    fitted.header["targets"][name]["heldout_r2"],
                    old_mapper.header["targets"].get(name, {}).get("heldout_r2"))
    stats.save(f"{stem}.stats")
    mapper.save(stem)
    logger.info("saved %s", stem)


if __name__ == "__main__":
    main()

"""Which sender features predict the receiver's residual stream at a split layer best? Offline comparison on the
dumps of ``benchmarks/hidden_map_dump.py`` (no model runs here).

For each split s and feature variant, a closed-form ridge (``cachecert_agents.transfer.mappers.ridge_solve``) is
fitted on the first ``--fit`` contexts, its ``rho`` chosen on the next ``--val`` contexts, and scored on the last
``--test`` contexts: pooled R^2 of the raw residual stream, and the mean per-token cosine between predicted and
true residual stream (the direction the receiver's RMSNorm passes on). Writes JSON with the command.

    python benchmarks/hidden_map_features.py --pair qwen2.5-coder-0.5b:qwen2.5-coder-1.5b \
        --out docs/results/hidden_map_features.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from cachecert_agents.paths import cache_home
from cachecert_agents.transfer.features import rms_normalise
from cachecert_agents.transfer.mappers import RHO_GRID, ridge_solve
from cachecert_agents.transfer.statistics import sender_layers_for


def variants(s: int, receiver_boundaries: int, sender_boundaries: int) -> dict[str, list[int] | str]:
    out: dict[str, list[int] | str] = {}
    for width in (3, 5, 9, 13):
        out[f"width{width}"] = sender_layers_for(s, receiver_boundaries, sender_boundaries, width)
    centre = sender_layers_for(s, receiver_boundaries, sender_boundaries, 1)
    out["width3+prev-token"] = sender_layers_for(s, receiver_boundaries, sender_boundaries, 3) + ["prev"] + centre
    out["width3+final"] = sender_layers_for(s, receiver_boundaries, sender_boundaries, 3) + [sender_boundaries - 1]
    out["every-2nd"] = list(range(0, sender_boundaries, 2))
    # receiver-anchored: the receiver's own (exact, cheap) residual stream entering layer a < s joins the features
    for a in (2, 4):
        if a < s:
            out[f"anchor{a}-only"] = [f"anchor:{a}"]
            out[f"width13+anchor{a}"] = out["width13"] + [f"anchor:{a}"]
    return out


def features(f, spec: list) -> torch.Tensor:
    """Features ``[n, F]`` from an open dump ``f``: sender layers (``sender`` ``[B, n, d]``) by index, ``"prev"``
    shifts the following layers by one token, ``"anchor:a"`` is the receiver's residual stream entering layer
    ``a``, RMS-normalised per token like the sender's features."""
    sender = f.get_tensor("sender")
    parts, shift = [], False
    for item in spec:
        if item == "prev":
            shift = True
            continue
        if isinstance(item, str) and item.startswith("anchor:"):
            parts.append(rms_normalise(f.get_tensor(f"hidden:{item.split(':')[1]}").float()))
            continue
        x = sender[item].float()
        if shift:
            x = torch.cat([torch.zeros_like(x[:1]), x[:-1]])
        parts.append(x)
    return torch.cat(parts, -1).double()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", required=True)
    ap.add_argument("--workload", default="hotpotqa")
    ap.add_argument("--dir")
    ap.add_argument("--splits", default="14,17")
    ap.add_argument("--fit", type=int, default=28)
    ap.add_argument("--val", type=int, default=4)
    ap.add_argument("--test", type=int, default=4)
    ap.add_argument("--fit-use", type=int, help="fit on only the first N of the --fit contexts (same val/test)")
    ap.add_argument("--variants", help="comma-separated subset")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    s_name, r_name = args.pair.split(":")
    root = Path(args.dir) if args.dir else cache_home() / "experiments" / f"{s_name}__{r_name}__{args.workload}"
    files = sorted(root.glob("*.safetensors"))
    need = args.fit + args.val + args.test
    if len(files) < need:
        sys.exit(f"{root} has {len(files)} dumps; need {need}")
    files = files[:need]
    fit, val, test = files[:args.fit], files[args.fit:args.fit + args.val], files[args.fit + args.val:]
    fit = fit[:args.fit_use or args.fit]
    with safe_open(str(files[0]), "pt") as f:
        sender_boundaries = f.get_slice("sender").get_shape()[0]
    receiver_boundaries = {"qwen2.5-coder-1.5b": 29, "qwen2.5-coder-0.5b": 25, "smollm2-135m": 31,
                           "gemma3-270m": 19}[r_name]
    rows = []
    for s in [int(x) for x in args.splits.split(",")]:
        specs = variants(s, receiver_boundaries, sender_boundaries)
        if args.variants:
            specs = {k: v for k, v in specs.items() if k in args.variants.split(",")}
        for name, spec in specs.items():
            xx = xy = sx = sy = None
            n = 0
            for path in fit:
                with safe_open(str(path), "pt") as f:
                    x = features(f, spec)
                    y = f.get_tensor(f"hidden:{s}").double()
                if xx is None:
                    xx, xy = x.T @ x, x.T @ y
                    sx, sy = x.sum(0), y.sum(0)
                else:
                    xx += x.T @ x
                    xy += x.T @ y
                    sx += x.sum(0)
                    sy += y.sum(0)
                n += x.shape[0]
            mx, my = sx / n, sy / n
            cxx, cxy = xx / n - torch.outer(mx, mx), xy / n - torch.outer(mx, my)
            del xx, xy

            def score(paths, w, b):
                sse = sst = 0.0
                cos = []
                for path in paths:
                    with safe_open(str(path), "pt") as f:
                        x = features(f, spec)
                        y = f.get_tensor(f"hidden:{s}").double()
                    pred = x @ w + b
                    sse += float(((pred - y) ** 2).sum())
                    sst += float(((y - my) ** 2).sum())
                    cos.append(torch.nn.functional.cosine_similarity(pred, y, dim=-1))
                cos = torch.cat(cos)
                return 1 - sse / sst, float(cos.mean()), float(cos.quantile(0.1))

            best = None
            for rho in RHO_GRID:
                w = ridge_solve(cxx, cxy, rho)
                b = my - mx @ w
                r2 = score(val, w, b)[0]
                if best is None or r2 > best[0]:
                    best = (r2, rho, w, b)
            _, rho, w, b = best
            r2, cos, cos_p10 = score(test, w, b)
            fit_r2 = score(fit[:4], w, b)[0]
            row = {"split": s, "variant": name, "sender_layers": [str(v) for v in spec], "features": cxx.shape[0],
                   "fit_tokens": n, "rho": rho, "test_r2": r2, "test_cosine_mean": cos,
                   "test_cosine_p10": cos_p10, "fit_r2_first4": fit_r2}
            print(json.dumps(row), flush=True)
            rows.append(row)
    payload = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
               "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "pair": args.pair, "workload": args.workload,
               "contexts": {"fit": len(fit), "val": args.val, "test": args.test}, "rows": rows}
    Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()

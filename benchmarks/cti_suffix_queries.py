"""Does the CTI rank retention better when its queries are the ones that read a transferred cache?

The index weighs each receiver head's key/value error by the attention concentration ``c_h = E_i sum_{j in
context} a_ij^2`` and the query moments ``q2``, both taken at the receiver's *context* tokens of the calibration
pass (``cti/queries.py``): the calibration pass runs no suffix. At answer time it is the *suffix* tokens (the
question and the answer prompt) that read the transferred context. docs/cti.md names this as a proxy. This script
measures the receiver's suffix-token statistics on the same calibration examples (receiver only: no sender, no
mapper, no generation) and asks whether they rank the retention table better.

Analysis fixed before any figure was seen (thirty-fifth session):

- **V1, suffix concentration.** Per receiver layer, ``r_l = sum_h c_h(suffix) / sum_h c_h(context)`` and the
  index becomes ``-log10 mean_l r_l D_l``, with ``D_l`` the stored per-layer deviation of the point (the pure-KV
  profile for layers the map serves, the propagated profile for layers a split recomputes). This rescales each
  layer, not each head (the stored profile is summed over heads), and leaves the query moments of the key term
  at their context values: a first-order check of whether the proxy matters, not the full recomputation.
- **V2, context mass.** ``M = mean_{l,h} E_{i in suffix} sum_{j in context} a_ij``, how much of the receiver's
  attention at answer time lands on the context at all: a receiver-and-workload property (like the no-context
  floor of ``cti_floor.py``, but from statistics, without a generation). Predictor ``-M`` (a receiver that reads
  the context less loses less when it is disturbed).

Both are ranked against the current retention table by Spearman's rho, pooled and per workload, next to the CTI
on the same points. The suffix statistics come from the calibration split, so they share no question with
retention.

    python benchmarks/cti_suffix_queries.py --out docs/results/cti_suffix_queries.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import shlex
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from cachecert_agents.cli import write_json_atomic
from cachecert_agents.cti.queries import context_attention
from cachecert_agents.eval.cti_eval import correlate, grouped_spearman, spearman
from cachecert_agents.eval.workloads import get_workload
from cachecert_agents.kv.rope import apply_rope, rope_tables
from cachecert_agents.models.handle import ModelHandle

RECEIVERS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
WORKLOADS = ("hotpotqa", "musique", "squad-long", "tool-results")


@torch.inference_mode()
def suffix_statistics(receiver: ModelHandle, examples: list, sample_queries: int = 32) -> list[dict[str, list]]:
    """Per layer, per head (mean over ``examples``): ``conc_context`` (the index's proxy: ``sum_{j in context}
    a_ij^2`` at ``sample_queries`` context rows, as :class:`~cachecert_agents.cti.queries.QueryAccumulator`
    samples them), ``conc_suffix`` (the same at every suffix row), ``mass_suffix`` (``sum_{j in context} a_ij`` at
    the suffix rows) and the mean query energy ``q2_context`` / ``q2_suffix`` (``sum_c q_c^2``, pre-RoPE)."""
    geo = receiver.geometry
    attn = receiver._attention_modules()
    keys = ("conc_context", "conc_suffix", "mass_suffix", "q2_context", "q2_suffix")
    sums = [{k: torch.zeros(geo.num_heads, dtype=torch.float64) for k in keys} for _ in range(geo.num_layers)]
    for ex in examples:
        prompt = receiver.format_prompt(ex.context, ex.instruction)
        start, end = prompt.context_span
        n = len(prompt)
        with receiver.capture_qk(queries=True, keys=True) as cap:
            receiver.forward(prompt.input_ids, logits_to_keep=1)
        positions = torch.arange(n)
        ctx_rows = torch.linspace(start, end - 1, min(sample_queries, end - start)).round().long().unique()
        suf_rows = torch.arange(end, n)
        for layer in range(geo.num_layers):
            q, k = cap.query(layer)[0].cpu().double(), cap.key(layer)[0].cpu().double()
            cos, sin = rope_tables(geo.rope_for_layer(layer), positions)
            window = geo.sliding_window if layer in geo.sliding_layers else None
            qr, kr = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            scaling = float(attn[layer].scaling)
            a_ctx = context_attention(qr, kr, positions, ctx_rows, (start, end), scaling, window)
            a_suf = context_attention(qr, kr, positions, suf_rows, (start, end), scaling, window)
            s = sums[layer]
            s["conc_context"] += (a_ctx * a_ctx).sum(-1).mean(-1)
            s["conc_suffix"] += (a_suf * a_suf).sum(-1).mean(-1)
            s["mass_suffix"] += a_suf.sum(-1).mean(-1)
            s["q2_context"] += (q[:, start:end] ** 2).sum(-1).mean(-1)
            s["q2_suffix"] += (q[:, end:n] ** 2).sum(-1).mean(-1)
    return [{k: (v / len(examples)).tolist() for k, v in s.items()} for s in sums]


def _point_deviations(pair: dict, method: str) -> list[float]:
    """The stored per-layer deviations ``D_l`` behind a point: the pure-KV profile, with a split's recomputed
    layers taken from its propagated profile."""
    profile = [p["deviation"] for p in pair["profile"]]
    if method == "ridge-kv":
        return profile
    s = int(method.split("@")[1])
    recomputed = {p["layer"]: p["deviation"] for p in pair["splits"][str(s)]["recomputed_profile"]}
    return [recomputed.get(layer, d) for layer, d in enumerate(profile)]


def analyse(pairs: list[dict], transfer_rows: list[dict], stats: dict) -> dict:
    points = correlate(pairs, transfer_rows)["points"]
    rows = []
    for p in points:
        if p["workload"] not in stats.get(p["receiver"], {}):
            continue  # a partial (smoke) run
        pair = next(q for q in pairs if q["sender"] == p["sender"] and q["receiver"] == p["receiver"]
                    and q["workload"] == p["workload"])
        layers = stats[p["receiver"]][p["workload"]]
        devs = _point_deviations(pair, p["method"])
        ratio = [sum(lay["conc_suffix"]) / sum(lay["conc_context"]) for lay in layers]
        check = -math.log10(sum(devs) / len(devs))
        if abs(check - p["cti"]) > 1e-6:
            raise ValueError(f"stored profile does not reproduce the CTI of {p['sender']}->{p['receiver']} "
                             f"{p['workload']} {p['method']}: {check} vs {p['cti']}")
        mass = sum(sum(lay["mass_suffix"]) / len(lay["mass_suffix"]) for lay in layers) / len(layers)
        rows.append(dict(p, cti_suffix=-math.log10(sum(r * d for r, d in zip(ratio, devs)) / len(devs)),
                         neg_context_mass=-mass))
    out = grouped_spearman(rows, ("cti", "cti_suffix", "neg_context_mass"))
    # exploratory, added after the figures above were seen: the same two indexes within groups that share a
    # receiver (and workload), where the suffix ratio can only reweight layers, not rescale the receiver
    within = {}
    for by in (("receiver", "workload"), ("receiver",)):
        groups_by: dict[tuple, list[dict]] = {}
        for r in rows:
            groups_by.setdefault(tuple(r[k] for k in by), []).append(r)
        entry = {}
        for key in ("cti", "cti_suffix"):
            rhos = [(spearman([r[key] for r in g], [r["retention"] for r in g]), len(g)) for g in groups_by.values()
                    if len(g) >= 3]
            rhos = [(rho, n) for rho, n in rhos if rho == rho]
            total = sum(n for _, n in rhos)
            entry[f"mean_spearman_{key}"] = sum(rho * n for rho, n in rhos) / total if total else float("nan")
        entry["n_groups"], entry["n_points"] = len(rhos), sum(n for _, n in rhos)
        within["_".join(by)] = entry
    return {"correlations": out, "within_groups_exploratory": within,
            "points": [{k: r[k] for k in ("sender", "receiver", "workload", "method", "n", "retention", "cti",
                                          "cti_suffix", "neg_context_mass")} for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cti", default="docs/results/cti_k4_p1.json", help="a `cachecert cti --all` result")
    ap.add_argument("--transfer", default="docs/results/transfer.json", help="the current retention table")
    ap.add_argument("--contexts", type=int, default=4,
                    help="calibration examples per receiver and workload (the index's own: 4)")
    ap.add_argument("--statistics", default=None,
                    help="reuse the suffix statistics of an earlier --out instead of running the receivers")
    ap.add_argument("--receivers", default=",".join(RECEIVERS), help="comma-separated (a smoke run: one)")
    ap.add_argument("--out", default="docs/results/cti_suffix_queries.json")
    args = ap.parse_args()
    command = shlex.join(["python", *sys.argv])
    statistics_command = command
    if args.statistics:
        earlier = json.loads(Path(args.statistics).read_text())
        stats = earlier["statistics"]
        statistics_command = earlier.get("statistics_command", earlier["command"])
    else:
        stats = {}
        for name in tqdm(args.receivers.split(","), desc="receivers"):
            receiver = ModelHandle.load(name)
            stats[name] = {w: suffix_statistics(receiver, get_workload(w).examples("calibration",
                                                                                  limit=args.contexts))
                           for w in WORKLOADS}
            del receiver
    pairs = json.loads(Path(args.cti).read_text())["results"]["pairs"]
    result = analyse(pairs, json.loads(Path(args.transfer).read_text())["results"], stats)
    out = {"command": command, "date": dt.datetime.now(dt.timezone.utc).isoformat(),
           "cti_file": args.cti, "transfer_file": args.transfer, "contexts": args.contexts, **result,
           "statistics_command": statistics_command, "statistics": stats}
    write_json_atomic(Path(args.out), out)
    for name, c in result["correlations"].items():
        print(f"{name:>13} n={c['n_points']:>2}  CTI {c['spearman_cti']:+.3f}  suffix {c['spearman_cti_suffix']:+.3f}"
              f"  -mass {c['spearman_neg_context_mass']:+.3f}   pure KV ({c['n_points_pure_kv']}): CTI "
              f"{c['spearman_cti_pure_kv']:+.3f} suffix {c['spearman_cti_suffix_pure_kv']:+.3f} -mass "
              f"{c['spearman_neg_context_mass_pure_kv']:+.3f}")


if __name__ == "__main__":
    main()

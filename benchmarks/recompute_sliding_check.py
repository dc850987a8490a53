"""Selective recompute on a real sliding-window receiver (Gemma 3 270M: window 512 on 15 of 18 layers), with
contexts longer than the window, so the full-length working cache and the per-layer-type masks are exercised.

No mapper is needed: the damaged cache is the receiver's own cache of a *different* context (the next evaluation
example's tokens at the same positions), the worst a transfer could hand over. For each fraction ``r`` the
request's suffix chooses ``r`` of the context tokens on that cache (``repair.choose_tokens``), the receiver
recomputes them (``repair.recompute_tokens``), the cache is cut back to the receiver's layout
(``repair.windowed_cache``) and the answer is compared with the receiver's own full prefill: the largest
next-token logit difference, the same greedy next token, and the token F1 of the greedy answer against the full
prefill's answer. ``r = 1`` must reproduce the full prefill.

    python benchmarks/recompute_sliding_check.py --model gemma3-270m --workload hotpotqa --n 5 \
        --out docs/results/recompute_sliding_check.json
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from cachecert_agents.cli import write_json_atomic
from cachecert_agents.eval.metrics import token_f1
from cachecert_agents.eval.workloads import get_workload
from cachecert_agents.models.handle import ModelHandle
from cachecert_agents.transfer.repair import choose_tokens, full_length_cache, recompute_tokens, windowed_cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--workload", default="hotpotqa")
    ap.add_argument("--n", type=int, default=5, help="evaluation examples")
    ap.add_argument("--fractions", default="0,0.2,0.35,0.5,1")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", default="docs/results/recompute_sliding_check.json")
    args = ap.parse_args()
    fractions = [float(f) for f in args.fractions.split(",")]
    model = ModelHandle.load(args.model)
    geo = model.geometry
    if not geo.sliding_layers:
        ap.error(f"{args.model} has no sliding-window layers; this check is for those that do")
    examples = get_workload(args.workload).examples("evaluation", limit=args.n + 1)
    rows = []
    for a, b in zip(examples, examples[1:]):
        prompt = model.format_prompt(a.context, a.instruction)
        start, end = prompt.context_span
        n_ctx = end - start
        other = model.format_prompt(b.context, b.instruction).context_ids.reshape(-1)
        other = other.repeat(n_ctx // other.numel() + 1)[:n_ctx]  # the other context, at the same positions
        native = model.prefill(prompt.input_ids[:end]).cache
        exact = model.continue_from(copy.deepcopy(native), prompt.suffix_ids, logits_to_keep=1).logits[-1]
        exact_answer = model.generate(prompt.suffix_ids, cache=copy.deepcopy(native),
                                      max_new_tokens=args.max_new_tokens).text
        damaged = full_length_cache(model.prefill(prompt.prefix_ids).cache)
        model.forward(other, damaged, logits_to_keep=1)
        row = {"id": a.id, "context_tokens": n_ctx, "window": geo.sliding_window, "exact_answer": exact_answer,
               "fractions": []}
        for r in fractions:
            cache = copy.deepcopy(damaged)
            t0 = time.perf_counter()
            index = choose_tokens(model, cache, prompt, r)
            recompute_tokens(model, cache, prompt.context_ids, start, index)
            cache = windowed_cache(cache, geo)
            repair_s = time.perf_counter() - t0
            layout_ok = all(type(x) is type(y) and x.keys.shape == y.keys.shape
                            for x, y in zip(cache.layers, native.layers))
            logits = model.continue_from(copy.deepcopy(cache), prompt.suffix_ids, logits_to_keep=1).logits[-1]
            answer = model.generate(prompt.suffix_ids, cache=cache, max_new_tokens=args.max_new_tokens).text
            row["fractions"].append({
                "r": r, "recomputed_tokens": int(index.numel()), "repair_s": round(repair_s, 3),
                "max_abs_logit_diff": float((logits - exact).abs().max()),
                "same_next_token": bool(int(logits.argmax()) == int(exact.argmax())),
                "answer": answer, "answer_f1_vs_full": token_f1(answer, exact_answer), "layout_ok": layout_ok})
            print(f"{a.id} r={r:<4} diff={row['fractions'][-1]['max_abs_logit_diff']:.2e} "
                  f"same_next={row['fractions'][-1]['same_next_token']} "
                  f"F1_vs_full={row['fractions'][-1]['answer_f1_vs_full']:.2f} layout_ok={layout_ok}", flush=True)
        rows.append(row)
    summary = []
    for i, r in enumerate(fractions):
        per = [row["fractions"][i] for row in rows]
        summary.append({"r": r, "n": len(per),
                        "max_abs_logit_diff_median": statistics.median(p["max_abs_logit_diff"] for p in per),
                        "max_abs_logit_diff_max": max(p["max_abs_logit_diff"] for p in per),
                        "same_next_token_rate": sum(p["same_next_token"] for p in per) / len(per),
                        "answer_f1_vs_full_mean": sum(p["answer_f1_vs_full"] for p in per) / len(per),
                        "layout_ok": all(p["layout_ok"] for p in per)})
    payload = {"command": "python " + " ".join(shlex.quote(x) for x in sys.argv),
               "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "model": args.model, "workload": args.workload, "window": geo.sliding_window,
               "sliding_layers": len(geo.sliding_layers), "num_layers": geo.num_layers,
               "summary": summary, "examples": rows}
    write_json_atomic(Path(args.out), payload)
    for s in summary:
        print(s)


if __name__ == "__main__":
    main()

"""What the scoring pass costs with and without the geometry score's attention weights, against the context's
prefill, on real evaluation examples. A screen (``cachecert certify --screen``) pays this pass on every request.

    python benchmarks/suffix_pass_cost.py --model qwen2.5-coder-0.5b --workload hotpotqa --n 3 \
        --out docs/results/suffix_pass_cost.json
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from cachecert_agents.cli import write_json_atomic
from cachecert_agents.eval.workloads import get_workload
from cachecert_agents.models.handle import ModelHandle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--workload", default="hotpotqa")
    ap.add_argument("--n", type=int, default=3, help="evaluation examples")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="docs/results/suffix_pass_cost.json")
    args = ap.parse_args()
    model = ModelHandle.load(args.model)
    rows = []
    for ex in get_workload(args.workload).examples("evaluation", limit=args.n):
        prompt = model.format_prompt(ex.context, ex.instruction)
        start, end = prompt.context_span
        t0 = time.perf_counter()
        base = model.prefill(prompt.input_ids[:end]).cache
        prefill_s = time.perf_counter() - t0
        timings: dict[str, list[float]] = {"with_attention": [], "plain": []}
        for _ in range(args.repeats):
            for variant, attn in (("with_attention", True), ("plain", False)):
                cache = copy.deepcopy(base)
                t0 = time.perf_counter()
                model.forward(prompt.suffix_ids, cache, output_attentions=attn, logits_to_keep=1)
                timings[variant].append(time.perf_counter() - t0)
        row = {"id": ex.id, "context_tokens": end - start, "suffix_tokens": int(prompt.suffix_ids.numel()),
               "prefill_s": prefill_s} | {f"{k}_pass_s_median": statistics.median(v) for k, v in timings.items()}
        row["plain_pass_over_prefill"] = row["plain_pass_s_median"] / prefill_s
        rows.append(row)
        print(json.dumps(row))
    write_json_atomic(Path(args.out), {
        "command": "python " + shlex.join(sys.argv), "model": args.model, "workload": args.workload,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "note": "medians of --repeats passes over a copy of the same prefilled cache; other jobs shared the CPU",
        "results": rows})


if __name__ == "__main__":
    main()

"""What one sender prefill per example saves in ``cachecert eval transfer``, on real evaluation examples.

Before the twenty-second session the evaluation prefilled the sender twice per example: once inside
``generate(whole prompt)`` for the ``sender`` control's answer, once in ``sender_features`` for what a transfer
reads. Now ``prefill_with_features`` runs once and the sender's answer is generated from its cache over the
suffix. Per example this script times both ways on the same model and checks that they give the same answer:

- ``old_s``: ``generate(prompt.input_ids)`` plus ``prefill_with_features`` (the two passes);
- ``new_s``: ``prefill_with_features`` plus ``generate(prompt.suffix_ids, cache=...)``.

    python benchmarks/sender_prefill_once.py --model qwen2.5-coder-1.5b --workload squad-long --n 3 \
        --out docs/results/sender_prefill_once.json
"""

from __future__ import annotations

import argparse
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
from cachecert_agents.transfer.features import prefill_with_features


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="the sender")
    ap.add_argument("--workload", default="squad-long")
    ap.add_argument("--n", type=int, default=3, help="evaluation examples")
    ap.add_argument("--out", default="docs/results/sender_prefill_once.json")
    args = ap.parse_args()
    model = ModelHandle.load(args.model)
    workload = get_workload(args.workload)
    gen_kw = dict(max_new_tokens=workload.max_new_tokens, stop_strings=workload.stop_strings)
    rows = []
    for ex in workload.examples("evaluation", limit=args.n):
        prompt = model.format_prompt(ex.context, ex.instruction)
        t0 = time.perf_counter()
        whole = model.generate(prompt.input_ids, **gen_kw)
        whole_s = time.perf_counter() - t0
        cache, _, prefill_s = prefill_with_features(model, prompt)
        t0 = time.perf_counter()
        once = model.generate(prompt.suffix_ids, cache=cache, **gen_kw)
        suffix_s = time.perf_counter() - t0
        start, end = prompt.context_span
        row = {"id": ex.id, "context_tokens": end - start, "answer_tokens": len(once.token_ids),
               "whole_prompt_answer_s": whole_s, "prefill_with_features_s": prefill_s, "answer_from_cache_s": suffix_s,
               "old_s": whole_s + prefill_s, "new_s": prefill_s + suffix_s, "same_answer": whole.text == once.text}
        rows.append(row)
        print(json.dumps(row))
    old, new = statistics.median(r["old_s"] for r in rows), statistics.median(r["new_s"] for r in rows)
    write_json_atomic(Path(args.out), {
        "command": "python " + shlex.join(sys.argv), "model": args.model, "workload": args.workload,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "note": "one run per example, at the thread count the caller set; other jobs may have shared the CPU",
        "old_s_median": old, "new_s_median": new, "saved_s_median": old - new,
        "answers_equal": sum(r["same_answer"] for r in rows), "n": len(rows), "results": rows})


if __name__ == "__main__":
    main()

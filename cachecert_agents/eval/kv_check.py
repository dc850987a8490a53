"""``cachecert kv-check``: prove that a cache segment round trip is exact on a real model.

Prefill ``prefix + context`` of a real prompt, convert the cache to a :class:`KVSegment` (RoPE removed), split it
into prefix and context segments, concatenate them again, rebuild a ``DynamicCache`` at the same positions, let the
model process the suffix on top, and compare the next-token logits with one full forward pass over the whole
prompt. A deliberately corrupted rebuild (context tokens' keys and values in shuffled order) must differ by a
lot, showing that the cache is really used.
"""

from __future__ import annotations

import time
from importlib.resources import files

import torch

from cachecert_agents.kv.segment import KVSegment
from cachecert_agents.models.handle import ModelHandle

INSTRUCTION = "Summarise the text above in one sentence."


def sample_text() -> str:
    """Bundled real text (FreshWiki, CC BY-SA 4.0; see ``data/ATTRIBUTION.md``), about 3,000 tokens."""
    return files("cachecert_agents").joinpath("data/sample_context.txt").read_text()


def context_of_tokens(handle: ModelHandle, n_tokens: int, text: str | None = None) -> str:
    """The longest prefix of ``text`` (the bundled sample by default) that has ``n_tokens`` tokens."""
    text = text or sample_text()
    ids, offsets = handle.tokenize(text)
    if ids.numel() < n_tokens:
        raise ValueError(f"the sample text has only {ids.numel()} tokens for {handle.name}; ask for fewer")
    return text[: int(offsets[n_tokens - 1, 1])]


def kv_check(handle: ModelHandle, context_tokens: int = 640, seed: int = 0) -> dict:
    """Run the round trip and return the measured differences (see module docstring)."""
    geometry = handle.geometry
    prompt = handle.format_prompt(context_of_tokens(handle, context_tokens), INSTRUCTION)
    ids = prompt.input_ids
    start, end = prompt.context_span

    t0 = time.perf_counter()
    reference = handle.forward(ids, logits_to_keep=1).logits[-1]
    full_s = time.perf_counter() - t0

    prefilled = handle.prefill(ids[:end])
    direct = handle.continue_from(prefilled.cache, prompt.suffix_ids, logits_to_keep=1).logits[-1]
    prefilled = handle.prefill(ids[:end])

    t0 = time.perf_counter()
    segment = KVSegment.from_cache(prefilled.cache, geometry, token_ids=ids[:end])
    prefix_seg, context_seg = segment.slice(0, start), segment.slice(start, end)
    rebuilt = KVSegment.concatenate([prefix_seg, context_seg]).to_cache(geometry)
    roundtrip_s = time.perf_counter() - t0
    restored = handle.continue_from(rebuilt, prompt.suffix_ids, logits_to_keep=1).logits[-1]

    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(context_seg.length, generator=gen)
    corrupted_layers = []
    for layer in context_seg.layers:
        # Shuffle which token's key/value sits at which index (only among the tokens this layer stores).
        inv = torch.full((context_seg.length,), -1, dtype=torch.long)
        inv[layer.token_index] = torch.arange(layer.n_stored)
        src = inv[perm[layer.token_index]]
        src = torch.where(src >= 0, src, torch.arange(layer.n_stored))
        corrupted_layers.append(type(layer)(layer.keys[:, :, src], layer.values[:, :, src], layer.token_index))
    corrupted_seg = KVSegment(geometry, corrupted_layers, context_seg.length, context_seg.positions)
    corrupted = handle.continue_from(KVSegment.concatenate([prefix_seg, corrupted_seg]).to_cache(geometry),
                                     prompt.suffix_ids, logits_to_keep=1).logits[-1]

    return {
        "model": handle.name,
        "source": handle.source,
        "context_tokens": int(prompt.context_ids.numel()),
        "prompt_tokens": int(len(prompt)),
        "sliding_window": geometry.sliding_window,
        "sliding_layers": len(geometry.sliding_layers),
        "max_abs_logit_diff": float((restored - reference).abs().max()),
        "direct_cache_max_abs_logit_diff": float((direct - reference).abs().max()),
        "corrupted_max_abs_logit_diff": float((corrupted - reference).abs().max()),
        "same_next_token": bool(restored.argmax() == reference.argmax()),
        "segment_mib": round(segment.nbytes / 2**20, 2),
        "full_forward_s": round(full_s, 3),
        "roundtrip_s": round(roundtrip_s, 4),
    }

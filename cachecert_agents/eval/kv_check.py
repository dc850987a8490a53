"""``cachecert kv-check``: prove that a cache segment round trip is exact on a real model.

Prefill ``prefix + context`` of a real prompt, convert the cache to a :class:`KVSegment` (RoPE removed), split it
into prefix and context segments, concatenate them again, rebuild a ``DynamicCache`` at the same positions, let the
model process the suffix on top, and compare the next-token logits with one full forward pass over the whole
prompt. A deliberately corrupted rebuild (context keys and values replaced by noise of the same per-channel
statistics) must differ by a lot, showing that the cache is really used; a milder corruption (context tokens'
keys and values in shuffled order) is reported too.
"""

from __future__ import annotations

import time
from importlib.resources import files

import torch

from cachecert_agents.kv.segment import KVSegment, LayerKV
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
    t0 = time.perf_counter()
    segment = KVSegment.from_cache(prefilled.cache, geometry, token_ids=ids[:end])
    prefix_seg, context_seg = segment.slice(0, start), segment.slice(start, end)
    rebuilt = KVSegment.concatenate([prefix_seg, context_seg]).to_cache(geometry)
    roundtrip_s = time.perf_counter() - t0
    restored = handle.continue_from(rebuilt, prompt.suffix_ids, logits_to_keep=1).logits[-1]
    # The model's own cache, continued directly: the floor of numerical noise (segment tensors are copies).
    direct = handle.continue_from(prefilled.cache, prompt.suffix_ids, logits_to_keep=1).logits[-1]

    gen = torch.Generator().manual_seed(seed)
    shuffled = _continue(handle, prefix_seg, _shuffled(context_seg, gen), prompt.suffix_ids)
    corrupted = _continue(handle, prefix_seg, _noised(context_seg, gen), prompt.suffix_ids)

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
        "corruption": "context keys/values replaced by Gaussian noise of the same per-channel mean and std",
        "shuffled_max_abs_logit_diff": float((shuffled - reference).abs().max()),
        "same_next_token": bool(restored.argmax() == reference.argmax()),
        "segment_mib": round(segment.nbytes / 2**20, 2),
        "full_forward_s": round(full_s, 3),
        "roundtrip_s": round(roundtrip_s, 4),
    }


def _continue(handle: ModelHandle, prefix: KVSegment, context: KVSegment, suffix_ids: torch.Tensor) -> torch.Tensor:
    cache = KVSegment.concatenate([prefix, context]).to_cache(handle.geometry)
    return handle.continue_from(cache, suffix_ids, logits_to_keep=1).logits[-1]


def _shuffled(segment: KVSegment, gen: torch.Generator) -> KVSegment:
    """The segment with its tokens' keys and values permuted (among the tokens each layer stores)."""
    layers = []
    for layer in segment.layers:
        perm = torch.randperm(layer.n_stored, generator=gen)
        layers.append(LayerKV(layer.keys[:, :, perm], layer.values[:, :, perm], layer.token_index))
    return KVSegment(segment.geometry, layers, segment.length, segment.positions)


def _noised(segment: KVSegment, gen: torch.Generator) -> KVSegment:
    """The segment with keys and values replaced by Gaussian noise of the same per-channel mean and std."""
    def noise(x: torch.Tensor) -> torch.Tensor:
        mean, std = x.mean(dim=2, keepdim=True), x.std(dim=2, keepdim=True)
        return mean + std * torch.randn(x.shape, generator=gen, dtype=x.dtype)
    layers = [LayerKV(noise(layer.keys), noise(layer.values), layer.token_index) for layer in segment.layers]
    return KVSegment(segment.geometry, layers, segment.length, segment.positions)

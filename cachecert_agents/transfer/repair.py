"""Query-aware selective recompute: repair a transferred cache where the request needs it.

A pure KV transfer (``ridge-kv``) is nearly free but its keys/values are only approximately the receiver's own,
which is too coarse for retrieval from a long context. Selective recompute (in the spirit of CacheBlend, Yao et
al. 2024, "CacheBlend: Fast Large Language Model Serving for RAG with Cached Knowledge Fusion") lets the receiver
compute its own keys/values, at every layer, for a chosen fraction ``r`` of the context tokens, attending (causally,
by position) to the transferred keys/values of the rest. Here the tokens are chosen by the request itself: the
receiver runs its suffix (question, instruction) once over the transferred cache, and the context chunks that the
suffix's queries attend to most are recomputed. Work: about ``r`` of a context prefill, plus one suffix pass.

- :func:`suffix_pass_relevance` scores the context tokens ``[n]`` by the suffix's attention on the transferred cache
  and keeps that pass's last logits;
- :func:`select_chunks` turns scores into token indices (whole chunks, highest total first, ``ceil(r * n)`` tokens);
  :func:`choose_tokens` is the two together (:func:`choose_tokens_with_logits` keeps the pass's logits too);
- :func:`recompute_tokens` runs the receiver over the chosen tokens only and writes their keys/values into the
  cache in place (``r = 1`` reproduces a full prefill; tested);
- the same selection serves as a control without the transferred keys/values (``pruned-context@P`` and
  ``pruned-positions@P`` in :mod:`cachecert_agents.eval.transfer_eval`): the chosen tokens' ids, which the receiver
  prefills as a shorter context (query-aware context pruning). If it answers as well, the transfer's value lies
  in choosing the tokens, not in the keys/values it carries for the rest;
- :func:`lexical_relevance` scores the context tokens without any cache (the suffix's token ids found in the
  context, weighted by their rarity there): the control that asks whether the choice needs the transfer at all.

Receivers with sliding-window layers (Gemma 3): their own cache keeps only the last ``window - 1`` rows of a
sliding layer, but a recomputed token early in the context needs its window there, and the suffix pass needs every
row's position. Selection and recompute therefore run on a *full-length* cache (:func:`full_length_cache`: every
layer keeps every row; the model's masks still apply each layer's window, by position), and the result is cut back
to the receiver's own layout afterwards (:func:`windowed_cache`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cachecert_agents.kv.rope import exact_dtype
from cachecert_agents.kv.segment import build_dynamic_cache, context_attention
from cachecert_agents.models.geometry import ModelGeometry
from cachecert_agents.models.handle import ModelHandle


class ScatterCache:
    """The cache seen by one :func:`recompute_tokens` pass. It wraps a full cache whose layer ``l`` holds keys and
    values ``[1, kv_heads, N, head_dim]`` for every position ``0 .. N-1``; ``update`` overwrites the rows at
    ``index`` (``[r]``, the recomputed tokens' positions) with the new keys/values ``[1, kv_heads, r, head_dim]``
    and returns the full tensors, so the chosen tokens attend to the cached rows and to each other.

    Before overwriting, it records ``observed[l]``, the squared distance between the new and the old rows and the
    new rows' energy for keys and values (``[4]``, on the cache's device, so the forward pass is not synchronised
    per layer; :func:`relative_errors` turns them into ratios). The new rows are the repaired ones, not the
    receiver's full-prefill rows: from layer 1 up a recomputed token also attends to the transferred rows of the
    tokens not chosen, so only layer 0 (and any layer the receiver computed itself) compares against exact rows.
    RoPE is a rotation, so post-RoPE keys give the pre-RoPE distance."""

    def __init__(self, cache: Any, index: torch.Tensor):
        self.cache, self.index = cache, index
        self.observed: dict[int, torch.Tensor] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.cache.layers[layer_idx]
        self.observed[layer_idx] = torch.cat([squared_distance(key_states, layer.keys[:, :, self.index]),
                                              squared_distance(value_states, layer.values[:, :, self.index])])
        layer.keys[:, :, self.index] = key_states.to(layer.keys.dtype)
        layer.values[:, :, self.index] = value_states.to(layer.values.dtype)
        return layer.keys, layer.values


def squared_distance(reference: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """``[|reference - approx|^2, |reference|^2]`` over every element, on ``reference``'s device (float64 where
    the device has it, float32 on MPS)."""
    dtype = exact_dtype(reference.device)
    reference, approx = reference.to(dtype), approx.to(reference.device, dtype)
    return torch.stack([((reference - approx) ** 2).sum(), (reference * reference).sum()])


def relative_errors(observed: dict[int, torch.Tensor], num_layers: int) -> torch.Tensor:
    """``[num_layers, 2]`` float64 on the CPU: per layer, ``|new - old|^2 / |new|^2`` of keys and of values from
    :class:`ScatterCache`'s ``observed`` (0 where the new rows are all zeros). Raises a ValueError naming the
    layers the pass did not write (a model whose layers share or skip the cache)."""
    missing = [layer for layer in range(num_layers) if layer not in observed]
    if missing:
        raise ValueError(f"the recompute pass wrote no keys/values at layers {missing}; the observed error is "
                         f"undefined there")
    sums = torch.stack([observed[layer] for layer in range(num_layers)]).cpu().double().reshape(num_layers, 2, 2)
    distance, energy = sums[..., 0], sums[..., 1]
    return distance / energy.masked_fill(energy == 0, float("inf"))  # all-zero rows: 0


def full_length_cache(cache: Any) -> Any:
    """The same keys/values as ``cache`` in a ``DynamicCache`` whose every layer keeps every row (no sliding-window
    eviction), so later updates keep them too. ``cache`` must still hold every row at every layer (e.g. a template
    prefix shorter than the window); otherwise a ValueError says which layer dropped rows."""
    from transformers import DynamicCache

    length = cache.get_seq_length()
    if length == 0:
        return DynamicCache()
    for i, layer in enumerate(cache.layers):
        if layer.keys is None or layer.keys.shape[-2] != length:
            stored = 0 if layer.keys is None else layer.keys.shape[-2]
            raise ValueError(f"layer {i} of the cache stores {stored} of its {length} rows (a sliding window "
                             f"dropped the rest); a full-length cache cannot be rebuilt from it")
    return build_dynamic_cache([(layer.keys, layer.values) for layer in cache.layers],
                               [None] * len(cache.layers), length)


def windowed_cache(cache: Any, geometry: ModelGeometry) -> Any:
    """The receiver's own cache layout from a full-length ``cache``: each sliding-window layer keeps its last
    ``window - 1`` rows (what the model's own prefill keeps), full-attention layers keep all. A receiver without
    sliding layers gets ``cache`` back unchanged."""
    windows = geometry.layer_windows()
    if not any(w is not None for w in windows):
        return cache
    keep = [slice(None) if w is None else slice(-(w - 1), None) for w in windows]
    layers = [(layer.keys[:, :, rows], layer.values[:, :, rows]) for layer, rows in zip(cache.layers, keep)]
    return build_dynamic_cache(layers, windows, cache.get_seq_length())


def _check_full_length(cache: Any) -> None:
    """Selection and recompute read and write every context row: a cache that evicted rows is refused."""
    length = cache.get_seq_length()
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False) or (layer.keys is not None and layer.keys.shape[-2] != length):
            raise ValueError(f"selective recompute needs a full-length cache, but layer {i} is a sliding-window "
                             f"layer that keeps only its window; build the transfer with windowed=False "
                             f"(transfer.apply.transfer) or convert with repair.full_length_cache")


@torch.inference_mode()
def suffix_pass_relevance(receiver: ModelHandle, cache: Any, suffix_ids: torch.Tensor,
                          span: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """How much the request's suffix ``[m]`` attends to each context token ``[n = end - start]`` of ``cache``
    (the transferred cache over ``prefix + context``, length ``end``): per layer, the largest attention weight any
    head and suffix token puts on the token, summed over layers. The maximum over heads singles out the sharp
    (retrieval) heads; a plain sum is dominated by attention sinks (frequent function words), which every head
    touches a little. Also returns the pass's last logits ``[vocab]`` (the first answer token's distribution on
    this cache, before any repair). The suffix pass is undone afterwards (the cache is cropped back to ``end``).
    ``cache`` must be full-length (:func:`full_length_cache`); on sliding-window layers the suffix sees its window
    only, as usual."""
    _check_full_length(cache)
    start, end = span
    out = receiver.forward(suffix_ids, cache, output_attentions=True, logits_to_keep=1)
    total = end + int(suffix_ids.numel())
    relevance = torch.zeros(end - start, dtype=exact_dtype(receiver.device), device=receiver.device)
    for weights in out.attentions:  # [heads, m, total]; summed on the device, copied to the host once
        relevance += context_attention(weights, span, total).float().amax((0, 1))
    relevance = relevance.cpu().double()
    cache.crop(-int(suffix_ids.numel()))
    return relevance, out.logits[-1]


def lexical_relevance(context_ids: torch.Tensor, suffix_ids: torch.Tensor) -> torch.Tensor:
    """A cache-free relevance ``[n]`` of the context tokens ``context_ids`` ``[n]``: a token whose id also occurs in
    ``suffix_ids`` scores ``1 / (its count in the context)`` (rare shared tokens, such as names, weigh most;
    frequent ones such as " the" little), every other token 0."""
    ctx = context_ids.reshape(-1)
    ids, counts = torch.unique(ctx, return_counts=True)
    weight = torch.zeros(int(ctx.max()) + 1, dtype=torch.float64)
    weight[ids] = 1.0 / counts.double()
    shared = torch.isin(ctx, suffix_ids.reshape(-1))
    return torch.where(shared, weight[ctx], torch.zeros((), dtype=torch.float64))


def select_chunks(relevance: torch.Tensor, fraction: float, chunk: int = 16) -> torch.Tensor:
    """Indices (sorted, ``[k]``, ``k = min(n, ceil(fraction * n))``) of the context tokens to recompute: the
    context ``[n]`` is cut into consecutive chunks of ``chunk`` tokens, chunks are taken by their summed relevance,
    highest first, and the last one taken is trimmed to the budget. Whole chunks keep the phrases a question
    retrieves intact."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    n = relevance.numel()
    budget = min(n, math.ceil(fraction * n))
    if budget == 0:
        return torch.zeros(0, dtype=torch.long)
    starts = torch.arange(0, n, chunk)
    totals = torch.stack([relevance[s:s + chunk].sum() for s in starts.tolist()])
    order = torch.argsort(totals, descending=True, stable=True)
    picked: list[torch.Tensor] = []
    left = budget
    for c in order.tolist():
        idx = torch.arange(int(starts[c]), min(int(starts[c]) + chunk, n))[:left]
        picked.append(idx)
        left -= idx.numel()
        if left == 0:
            break
    return torch.sort(torch.cat(picked)).values


def choose_tokens_with_logits(receiver: ModelHandle, cache: Any, prompt: Any,
                              fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The context tokens ``[k]`` (offsets into ``prompt.context_ids``, sorted) that selective recompute takes for
    ``prompt`` (:class:`~cachecert_agents.models.handle.PromptSegments`) on the transferred ``cache``: the
    chunks its suffix attends to most, ``fraction`` of the context. Also returns the choosing pass's last logits
    ``[vocab]`` (:func:`suffix_pass_relevance`), which the transfer keeps as its unrepaired answer distribution."""
    relevance, logits = suffix_pass_relevance(receiver, cache, prompt.suffix_ids, prompt.context_span)
    return select_chunks(relevance, fraction), logits


def choose_tokens(receiver: ModelHandle, cache: Any, prompt: Any, fraction: float) -> torch.Tensor:
    """The indices ``[k]`` of :func:`choose_tokens_with_logits` alone."""
    return choose_tokens_with_logits(receiver, cache, prompt, fraction)[0]


@torch.inference_mode()
def recompute_tokens(receiver: ModelHandle, cache: Any, context_ids: torch.Tensor, start: int,
                     index: torch.Tensor) -> torch.Tensor | None:
    """Overwrite, in place, the keys/values of context tokens ``index`` (``[k]``, offsets into ``context_ids``
    ``[n]``, which sit at positions ``start .. start + n - 1`` of ``cache``) with the receiver's own, computed at
    every layer. Each chosen token attends to every cached position up to its own (the cache's rows for the
    others, the new rows for the chosen ones), so ``index = all`` reproduces the receiver's full prefill.
    ``cache`` must be full-length (:func:`full_length_cache`); on a sliding-window layer a token attends to the
    positions within its window, as in the model's own prefill.

    Returns how far the overwritten rows were from the repaired ones, ``[num_layers, 2]`` (keys, values;
    :class:`ScatterCache`, :func:`relative_errors`), or None when ``index`` is empty: a per-request measurement
    the repair gets for free (``TransferResult.observed_error``). It is not a certificate score: as one it
    ranked unsafe transfers no better than chance (``benchmarks/observed_error_score.py``, docs/cert.md)."""
    _check_full_length(cache)
    if index.numel() == 0:
        return None
    total = start + int(context_ids.numel())
    if cache.get_seq_length() != total:
        raise ValueError(f"cache holds {cache.get_seq_length()} positions; expected prefix + context = {total}")
    positions = (index + start).to(receiver.device)
    allowed = torch.arange(total, device=receiver.device)[None, :] <= positions[:, None]  # [k, total]
    dtype = receiver.model.dtype

    def additive(keep: torch.Tensor) -> torch.Tensor:
        # additive (0 / most negative), which eager and SDPA attention read the same way; 4-D masks pass as-is
        return torch.zeros(keep.shape, dtype=dtype, device=receiver.device).masked_fill(
            ~keep, torch.finfo(dtype).min)[None, None]

    mask: Any = additive(allowed)
    window = receiver.geometry.sliding_window
    if receiver.geometry.sliding_layers:  # one mask per layer type, as the model's forward accepts them
        in_window = torch.arange(total, device=receiver.device)[None, :] > positions[:, None] - window
        mask = {"full_attention": mask, "sliding_attention": additive(allowed & in_window)}
    scatter = ScatterCache(cache, positions)
    receiver.model(input_ids=context_ids.reshape(-1)[index].reshape(1, -1).to(receiver.device),
                   position_ids=positions.reshape(1, -1), attention_mask=mask,
                   cache=scatter, use_cache=True, logits_to_keep=1)
    return relative_errors(scatter.observed, len(cache.layers))

"""Apply a transfer: sender features for a context -> the receiver's cache for ``prefix + context``.

Split transfer with receiver repair at split layer ``s`` (``0 <= s <= L``):

- the receiver's own template prefix is exact (its prefill, cacheable once per receiver);
- layers ``< s``: context keys/values predicted by the mapper (pre-RoPE), rotated with the receiver's RoPE at the
  receiver's positions and written into the cache;
- layers ``>= s``: the receiver computes them itself over the context, from the mapper's prediction of the residual
  stream entering layer ``s`` (exact given that input);
- ``s = L`` is a pure KV transfer (no receiver layer runs); ``s = 0`` is a full prefill (exact).

Anchored split transfer (a mapper fitted with an anchor ``a < s``): the receiver also computes its layers ``< a``
over the context itself (exact keys/values there), and the maps of layers ``a .. s-1`` and of the stream at ``s``
read its own residual stream entering layer ``a`` next to the sender's features. Work avoided: about
``(s - a) / L``.

The receiver's work avoided is about ``s / L`` of its context prefill; the result reports the measured time.
The partial forward reuses the model's own forward (masks, sliding windows, positions) with the layers below
``s`` temporarily replaced by stubs that write the mapped keys/values into the cache.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from cachecert_agents.kv.rope import apply_rope, rope_tables
from cachecert_agents.models.handle import ModelHandle, PromptSegments, synchronize
from cachecert_agents.transfer.features import SenderFeatures, alignment_for, rms_normalise, unflatten_kv
from cachecert_agents.transfer.mappers import RidgeMapper
from cachecert_agents.transfer.repair import (choose_tokens_with_logits, full_length_cache, recompute_tokens,
                                               windowed_cache)


@dataclass
class TransferResult:
    """The receiver's cache over ``prefix + context`` and the time the receiver spent (mapping + partial prefill,
    seconds; the prefix prefill is not counted: it is cached per receiver)."""

    cache: Any
    split: int
    transfer_s: float
    coverage: dict | None = None
    features: SenderFeatures | None = None  # the sender features on the receiver's context tokens
    recomputed_index: torch.Tensor | None = None  # [r] context offsets the receiver recomputed (selective recompute)
    observed_error: torch.Tensor | None = None  # [L, 2] relative distance, transferred to repaired rows (k, v)
    unrepaired_logits: torch.Tensor | None = None  # [vocab] the suffix's last logits on the cache before repair
    choice_s: float | None = None  # seconds from the transfer's start until the recompute tokens were chosen

    @property
    def recomputed(self) -> int:
        """How many context tokens' keys/values the receiver recomputed (selective recompute; 0 without)."""
        return 0 if self.recomputed_index is None else int(self.recomputed_index.numel())


class MappedLayer(torch.nn.Module):
    """Stands in for a decoder layer: writes precomputed keys/values into the cache, passes hidden states on
    (or replaces them with ``output``: the mapped residual stream entering the split layer)."""

    def __init__(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, output: torch.Tensor | None):
        super().__init__()
        self.layer_idx, self.keys, self.values, self.output = layer_idx, keys, values, output

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        cache.update(self.keys, self.values, self.layer_idx)
        return self.output.to(hidden_states.dtype) if self.output is not None else hidden_states


@contextlib.contextmanager
def replaced_layers(model: Any, replacements: dict[int, torch.nn.Module]) -> Iterator[None]:
    base = getattr(model, model.base_model_prefix, model)
    original = {i: base.layers[i] for i in replacements}
    try:
        for i, module in replacements.items():
            base.layers[i] = module
        yield
    finally:
        for i, module in original.items():
            base.layers[i] = module


class _AnchoredMapping:
    """The maps of an anchored split transfer, run once when the receiver's forward reaches the anchor layer
    ``a`` (its input there is the receiver's own exact residual stream over the context, ``[1, n, hidden]``):
    keys/values of layers ``a .. s-1`` and the stream entering ``s`` (None when ``s = L``)."""

    def __init__(self, receiver: ModelHandle, mapper: RidgeMapper, features: SenderFeatures, split: int,
                 positions: torch.Tensor):
        self.receiver, self.mapper, self.features, self.split, self.positions = (receiver, mapper, features, split,
                                                                                 positions)
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.hidden: torch.Tensor | None = None

    def run(self, anchor_stream: torch.Tensor) -> None:
        anchor_x = rms_normalise(anchor_stream[0].float())
        for layer in range(self.mapper.anchor, self.split):
            self.kv[layer] = mapped_kv(self.receiver, self.mapper, self.features, layer, self.positions, anchor_x)
        if self.split < self.receiver.geometry.num_layers:
            self.hidden = self.mapper.predict(f"hidden:{self.split}", mapper_input(
                self.mapper, f"hidden:{self.split}", self.features, anchor_x))[None]


class _AnchoredLayer(torch.nn.Module):
    """Stands in for decoder layer ``a <= l < s`` of an anchored split transfer (see :class:`_AnchoredMapping`)."""

    def __init__(self, layer_idx: int, mapping: _AnchoredMapping):
        super().__init__()
        self.layer_idx, self.mapping = layer_idx, mapping

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        m = self.mapping
        if self.layer_idx == m.mapper.anchor:
            m.run(hidden_states)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        cache.update(*m.kv[self.layer_idx], self.layer_idx)
        last = self.layer_idx == m.split - 1 and m.hidden is not None
        return m.hidden.to(hidden_states.dtype) if last else hidden_states


def mapper_input(mapper: RidgeMapper, name: str, features: SenderFeatures,
                 anchor_x: torch.Tensor | None = None) -> torch.Tensor:
    """The features target ``name`` reads ``[n, F]``: its sender layers, then the anchor stream for an anchored
    mapper (``anchor_x`` ``[n, hidden_r]``, RMS-normalised)."""
    x = features.select(mapper.sender_layers(name))
    if mapper.anchor is None:
        return x
    if anchor_x is None:
        raise ValueError(f"{name} of an anchored mapper (anchor {mapper.anchor}) needs the receiver's stream there")
    return torch.cat([x.to(anchor_x.device), anchor_x], dim=-1)


def mapped_kv(receiver: ModelHandle, mapper: RidgeMapper, features: SenderFeatures, layer: int,
              positions: torch.Tensor, anchor_x: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Predicted keys (RoPE applied at ``positions`` ``[n]``) and values ``[1, kv_heads, n, head_dim]``, in the
    receiver's dtype, from features already on the receiver's tokens (and, for an anchored mapper, the receiver's
    normalised stream at the anchor, ``anchor_x`` ``[n, hidden_r]``). The mapping itself runs in the mapper's
    precision (float32), so a half-precision receiver gets keys rounded once, at the end."""
    geo = receiver.geometry
    x = mapper_input(mapper, f"kv:{layer}", features, anchor_x)
    k, v = unflatten_kv(mapper.predict(f"kv:{layer}", x.to(receiver.device)), geo.num_kv_heads, geo.head_dim)
    cos, sin = rope_tables(geo.rope_for_layer(layer), positions.to(k.device))
    dtype = receiver.model.dtype
    return apply_rope(k, cos, sin).to(dtype), v.to(dtype)


@torch.inference_mode()
def transfer(receiver: ModelHandle, prompt: PromptSegments, features: SenderFeatures, mapper: RidgeMapper,
             split: int, prefix_cache: Any | None = None, true_targets: Any | None = None,
             oracle: str | None = None, recompute: float = 0.0, windowed: bool = True) -> TransferResult:
    """Build the receiver's cache for ``prompt.prefix + prompt.context`` from the sender's ``features``.

    ``prefix_cache`` is the receiver's own cache of ``prompt.prefix_ids`` (computed when None; it is copied, not
    modified). Returns the cache, ready for ``receiver.generate(prompt.suffix_ids, cache=...)``.

    Diagnostics only: with ``true_targets`` (the receiver's own :class:`ReceiverTargets` for this context),
    ``oracle="kv"`` uses the true keys/values below the split instead of mapped ones, and ``oracle="hidden"``
    the true residual stream at the split, so the two parts' share of the error can be measured apart;
    ``oracle="both"`` reproduces a full prefill (a check of the machinery).

    ``recompute > 0``: then repair the cache by query-aware selective recompute
    (:mod:`cachecert_agents.transfer.repair`): the receiver computes its own keys/values for that fraction of the
    context tokens, those ``prompt.suffix_ids`` attends to most on the transferred cache. Its time is included.
    On a receiver with sliding-window layers the transfer and the repair run on a full-length cache, which is cut
    back to the receiver's own layout at the end.

    ``windowed=False`` returns that full-length cache instead (every row at every layer; what
    :func:`~cachecert_agents.transfer.repair.choose_tokens` needs on a sliding-window receiver). It generates the
    same tokens, at the memory of a full-attention cache.
    """
    import copy

    geo = receiver.geometry
    if not 0 <= split <= geo.num_layers:
        raise ValueError(f"split must be in [0, {geo.num_layers}], got {split}")
    cache = copy.deepcopy(prefix_cache) if prefix_cache is not None else receiver.prefill(prompt.prefix_ids).cache
    start, end = prompt.context_span
    if features.context_text is not None and features.context_text != prompt.context_text:
        raise ValueError("the sender's features were computed over another context text than the receiver's prompt "
                         f"({len(features.context_text)} against {len(prompt.context_text)} characters)")
    if cache.get_seq_length() != start:  # the mapped rows would sit at positions the cache does not have
        raise ValueError(f"prefix_cache holds {cache.get_seq_length()} tokens but the prompt's prefix has {start}: "
                         f"pass the receiver's own cache of prompt.prefix_ids")
    full_length = bool(geo.sliding_layers) and (recompute > 0 or not windowed)
    if full_length:
        cache = full_length_cache(cache)
    positions = torch.arange(start, end)
    t0 = time.perf_counter()
    alignment = alignment_for(prompt.context_offsets, features.offsets) if split > 0 else None
    features = features.on_receiver_tokens(alignment)
    anchor = mapper.anchor if split > 0 else None
    if anchor is not None and (split <= anchor or oracle):
        raise ValueError(f"an anchored mapper (anchor {anchor}) transfers at splits above {anchor} only, and has "
                         f"no oracle diagnostics; got split {split}")
    if split == 0:
        receiver.forward(prompt.context_ids, cache, logits_to_keep=1)
    elif anchor is not None:
        mapping = _AnchoredMapping(receiver, mapper, features, split, positions)
        with replaced_layers(receiver.model, {i: _AnchoredLayer(i, mapping) for i in range(anchor, split)}):
            receiver.forward(prompt.context_ids, cache, logits_to_keep=1)
    else:
        stubs = {}
        hidden = None
        if oracle not in (None, "kv", "hidden", "both") or (oracle and true_targets is None):
            raise ValueError("oracle must be 'kv', 'hidden' or 'both' and needs true_targets")
        if split < geo.num_layers:
            if oracle in ("hidden", "both"):
                hidden = true_targets.hidden[split].to(receiver.device)[None]
            else:
                x = mapper_input(mapper, f"hidden:{split}", features)
                hidden = mapper.predict(f"hidden:{split}", x.to(receiver.device))[None]
        for layer in range(split):
            if oracle in ("kv", "both"):
                k, v = unflatten_kv(true_targets.kv[layer].to(receiver.device), geo.num_kv_heads, geo.head_dim)
                cos, sin = rope_tables(geo.rope_for_layer(layer), positions.to(k.device))
                k, v = apply_rope(k, cos, sin).to(receiver.model.dtype), v.to(receiver.model.dtype)
            else:
                k, v = mapped_kv(receiver, mapper, features, layer, positions)
            stubs[layer] = MappedLayer(layer, k, v, hidden if layer == split - 1 else None)
        if split == geo.num_layers:
            for layer, stub in stubs.items():
                cache.update(stub.keys, stub.values, layer)
        else:
            with replaced_layers(receiver.model, stubs):
                receiver.forward(prompt.context_ids, cache, logits_to_keep=1)
    index = observed = unrepaired = choice_s = None
    if recompute > 0 and split > 0:
        index, unrepaired = choose_tokens_with_logits(receiver, cache, prompt, recompute)
        choice_s = time.perf_counter() - t0
        observed = recompute_tokens(receiver, cache, prompt.context_ids, start, index)
    if full_length and windowed:
        cache = windowed_cache(cache, geo)
    synchronize(receiver.device)  # a pure-KV transfer ends in queued cache writes, not in a (synchronised) forward
    elapsed = time.perf_counter() - t0
    return TransferResult(cache, split, elapsed, alignment.coverage() if alignment is not None else None, features,
                          index, observed, unrepaired, choice_s)

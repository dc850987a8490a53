"""Model-agnostic KV cache segments: pre-RoPE keys and values of a run of tokens, per layer.

A transformers ``DynamicCache`` holds keys *after* RoPE at the positions they were computed at, and sliding-window
layers hold only their last ``window - 1`` tokens. A :class:`KVSegment` holds the same information without the
positions baked in: per layer, pre-RoPE keys and values of the tokens it stores, the index of each stored token
within the segment, and the :class:`~cachecert_agents.models.geometry.ModelGeometry` it belongs to. It converts
back into a ``DynamicCache`` at any target positions (RoPE re-applied with the model's own parameters, sliding
layers' cumulative length set to the real token count), slices, and concatenates (a receiver's own template
prefix + a context segment).

Shapes: ``keys``/``values`` ``[batch, kv_heads, n_stored, head_dim]``; ``token_index`` ``[n_stored]`` (int64,
increasing, in ``[0, length)``); ``positions`` ``[length]`` (int64, where the segment was computed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from cachecert_agents.errors import GeometryMismatchError
from cachecert_agents.kv.rope import apply_rope, remove_rope, rope_tables
from cachecert_agents.models.geometry import ModelGeometry


def build_dynamic_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], windows: list[int | None], length: int
                        ) -> DynamicCache:
    """A ``DynamicCache`` from per-layer post-RoPE ``(keys, values)`` ``[batch, kv_heads, n_stored, head_dim]``.

    ``windows[i]`` is layer i's sliding window (None: full attention); a sliding layer stores its last
    ``window - 1`` tokens and gets its cumulative length set to ``length``, the real token count, so masks and
    positions stay right when the model continues from the cache."""
    if len(layers) != len(windows):
        raise ValueError(f"{len(layers)} layers of tensors but {len(windows)} window entries")
    data = [(k, v, torch.tensor(w)) if w is not None else (k, v) for (k, v), w in zip(layers, windows)]
    cache = DynamicCache(ddp_cache_data=data)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.cumulative_length = length
    return cache


@dataclass
class LayerKV:
    """One layer of a segment: pre-RoPE keys/values of the stored tokens and their index in the segment."""

    keys: torch.Tensor
    values: torch.Tensor
    token_index: torch.Tensor

    @property
    def n_stored(self) -> int:
        return int(self.token_index.numel())

    def select(self, mask: torch.Tensor, shift: int = 0) -> "LayerKV":
        """Keep the stored tokens where ``mask`` ``[n_stored]`` is true, shifting their index by ``shift``."""
        return LayerKV(self.keys[:, :, mask], self.values[:, :, mask], self.token_index[mask] + shift)


@dataclass
class KVSegment:
    """Pre-RoPE KV cache of ``length`` consecutive tokens of one model (see module docstring for shapes)."""

    geometry: ModelGeometry
    layers: list[LayerKV]
    length: int
    positions: torch.Tensor
    token_ids: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.layers) != self.geometry.num_layers:
            raise ValueError(f"segment has {len(self.layers)} layers, geometry has {self.geometry.num_layers}")
        if self.positions.shape != (self.length,):
            raise ValueError(f"positions must be [{self.length}], got {tuple(self.positions.shape)}")

    # ------------------------------------------------------------------ conversion from a cache
    @classmethod
    def from_cache(cls, cache: DynamicCache, geometry: ModelGeometry, start: int = 0, end: int | None = None,
                   positions: torch.Tensor | None = None, token_ids: torch.Tensor | None = None) -> "KVSegment":
        """Take tokens ``[start, end)`` of a ``DynamicCache`` as a segment, removing RoPE.

        ``positions`` ``[T]`` are the positions the cache's T tokens were computed at (default ``arange(T)``);
        ``token_ids`` ``[T]`` optionally records the tokens.
        """
        if len(cache.layers) != geometry.num_layers:
            raise GeometryMismatchError(f"cache has {len(cache.layers)} layers but the geometry is "
                                        f"{geometry.describe()}")
        total = cache.get_seq_length()
        end = total if end is None else end
        if not 0 <= start <= end <= total:
            raise ValueError(f"cannot take tokens [{start}, {end}) of a cache of {total} tokens")
        if positions is None:
            positions = torch.arange(total)
        positions = positions.to(torch.long).cpu()
        layers = []
        for i, layer in enumerate(cache.layers):
            keys, values = layer.keys, layer.values
            if keys.shape[1] != geometry.num_kv_heads or keys.shape[-1] != geometry.head_dim:
                raise GeometryMismatchError(f"cache layer {i} has keys {tuple(keys.shape)}, geometry is "
                                            f"{geometry.describe()}")
            n = keys.shape[-2]
            index = torch.arange(total - n, total)
            cos, sin = rope_tables(geometry.rope_for_layer(i), positions[index], device=keys.device)
            full = LayerKV(remove_rope(keys, cos, sin), values, index)
            layers.append(full.select((index >= start) & (index < end), shift=-start))
        ids = token_ids[start:end].cpu() if token_ids is not None else None
        return cls(geometry, layers, end - start, positions[start:end].clone(), ids)

    # ------------------------------------------------------------------ conversion to a cache
    def check_geometry(self, target: ModelGeometry) -> None:
        """Raise :class:`GeometryMismatchError` naming both geometries unless ``target`` has this layout."""
        if target.kv_fingerprint() != self.geometry.kv_fingerprint():
            raise GeometryMismatchError(
                "this cache segment belongs to a model of another geometry and cannot be used as its cache; "
                f"segment: {self.geometry.describe()}; target model: {target.describe()}. "
                "Use a mapper (cachecert_agents.transfer) to move a cache between models.")

    def to_cache(self, target: ModelGeometry | None = None, start_position: int = 0,
                 positions: torch.Tensor | None = None, device: torch.device | str | None = None) -> DynamicCache:
        """Build a ``DynamicCache`` holding this segment at ``positions`` ``[length]``.

        Default positions are ``start_position + arange(length)``; a cache whose positions are not
        ``0..length-1`` needs explicit ``position_ids`` when the model continues from it. ``target`` is the
        geometry of the model that will use the cache; a different layout raises ``GeometryMismatchError``.
        Sliding-window layers get their cumulative length set to ``length`` so masks and positions stay right.
        """
        self.check_geometry(target or self.geometry)
        if positions is None:
            positions = start_position + torch.arange(self.length)
        positions = positions.to(torch.long)
        if positions.shape != (self.length,):
            raise ValueError(f"target positions must be [{self.length}], got {tuple(positions.shape)}")
        data = []
        for i, layer in enumerate(self.layers):
            self._check_complete(i, layer)
            device_i = device if device is not None else layer.keys.device
            target_positions = positions.to(device_i)[layer.token_index.to(device_i)]
            cos, sin = rope_tables(self.geometry.rope_for_layer(i), target_positions)
            keys = apply_rope(layer.keys.to(device_i), cos, sin)
            values = layer.values.to(device_i)
            data.append((keys, values))
        return build_dynamic_cache(data, self.geometry.layer_windows(), self.length)

    def _check_complete(self, i: int, layer: LayerKV) -> None:
        needed = self.length
        if self.geometry.layer_types[i] == "sliding_attention":
            needed = min(self.length, self.geometry.sliding_window - 1)
        stored = layer.token_index
        if needed and (stored.numel() < needed
                       or not torch.equal(stored[-needed:].cpu(), torch.arange(self.length - needed, self.length))):
            raise ValueError(f"layer {i} ({self.geometry.layer_types[i]}) stores {stored.numel()} of the last "
                             f"{needed} tokens it needs; this segment cannot stand as a cache on its own")

    # ------------------------------------------------------------------ algebra
    def slice(self, start: int, end: int) -> "KVSegment":
        """Tokens ``[start, end)`` of this segment (sliding layers keep only what they stored)."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"cannot slice [{start}, {end}) of a segment of {self.length} tokens")
        layers = [layer.select((layer.token_index >= start) & (layer.token_index < end), shift=-start)
                  for layer in self.layers]
        ids = self.token_ids[start:end] if self.token_ids is not None else None
        return KVSegment(self.geometry, layers, end - start, self.positions[start:end].clone(), ids, dict(self.meta))

    @staticmethod
    def concatenate(segments: list["KVSegment"]) -> "KVSegment":
        """Join segments of one geometry end to end (e.g. a receiver's template prefix + a context segment)."""
        if not segments:
            raise ValueError("nothing to concatenate")
        first = segments[0]
        for seg in segments[1:]:
            first.check_geometry(seg.geometry)
        layers, offset = [], 0
        offsets = []
        for seg in segments:
            offsets.append(offset)
            offset += seg.length
        for i in range(first.geometry.num_layers):
            parts = [seg.layers[i] for seg in segments]
            layers.append(LayerKV(
                torch.cat([p.keys for p in parts], dim=2),
                torch.cat([p.values for p in parts], dim=2),
                torch.cat([p.token_index + off for p, off in zip(parts, offsets)]),
            ))
        ids = None
        if all(seg.token_ids is not None for seg in segments):
            ids = torch.cat([seg.token_ids for seg in segments])
        positions = torch.cat([seg.positions for seg in segments])
        return KVSegment(first.geometry, layers, offset, positions, ids)

    def __add__(self, other: "KVSegment") -> "KVSegment":
        return KVSegment.concatenate([self, other])

    # ------------------------------------------------------------------ bookkeeping
    @property
    def nbytes(self) -> int:
        """Memory held by the keys and values, in bytes."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values))

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "KVSegment":
        layers = [LayerKV(layer.keys.to(device=device, dtype=dtype), layer.values.to(device=device, dtype=dtype),
                          layer.token_index) for layer in self.layers]
        return KVSegment(self.geometry, layers, self.length, self.positions, self.token_ids, dict(self.meta))

    def __repr__(self) -> str:
        return (f"KVSegment({self.geometry.model_type}, length={self.length}, layers={len(self.layers)}, "
                f"{self.nbytes / 2**20:.1f} MiB)")


def context_attention(weights: torch.Tensor, span: tuple[int, int], total: int) -> torch.Tensor:
    """The suffix queries' attention on the context tokens, ``[heads, m, end - start]``, from one layer's weights
    ``[heads, m, k]`` over the ``k`` most recent of ``total`` positions. ``k < total`` on a sliding-window layer
    (Gemma 3), whose cache keeps only the window: context tokens that fell out of it get weight 0."""
    start, end = span
    offset = total - weights.shape[-1]
    kept = weights[..., max(start - offset, 0):max(end - offset, 0)]
    return torch.nn.functional.pad(kept, (end - start - kept.shape[-1], 0))

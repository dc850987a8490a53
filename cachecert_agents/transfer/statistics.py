"""Streaming float64 second moments between a sender's features and a receiver's targets, over calibration text.

For each receiver *target* (``kv:l``: pre-RoPE keys and values of receiver layer l; ``hidden:s``: residual stream
entering layer s) the features are the sender's normalised residual stream at a few layer boundaries around the
proportional depth (:func:`sender_layers_for`), optionally followed by an *anchor*: the receiver's own normalised
residual stream entering layer ``a`` (for anchored split transfers, where the receiver computes its layers below
``a`` itself). Moments are accumulated uncentred (sums, ``X^T X``, ``X^T Y``,
``Y^T Y``) in float64, so contexts can be added one at a time and statistics from several runs can be merged.
Feature moments are shared between targets that read the same sender layers.

Saved as one safetensors file plus a JSON header (pair, geometry and tokenizer fingerprints, data, token count,
library version); loading against another pair is refused. Nothing is pickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from cachecert_agents import __version__
from cachecert_agents.artifacts import load_artifact, save_artifact

FORMAT = "cachecert-pair-statistics/1"


def sender_layers_for(receiver_index: int, receiver_boundaries: int, sender_boundaries: int, width: int = 3
                      ) -> list[int]:
    """Sender residual-stream boundaries (``0..sender_boundaries-1``) that feed receiver boundary
    ``receiver_index`` (of ``receiver_boundaries``): ``width`` consecutive ones centred on the proportional
    depth, clipped to the valid range."""
    scale = (sender_boundaries - 1) / max(receiver_boundaries - 1, 1)
    centre = round(receiver_index * scale)
    lo = min(max(centre - width // 2, 0), max(sender_boundaries - width, 0))
    return list(range(lo, min(lo + width, sender_boundaries)))


@dataclass
class Moments:
    """Uncentred float64 moments of a feature block (``sum_x`` ``[F]``, ``xx`` ``[F, F]``)."""

    sum_x: torch.Tensor
    xx: torch.Tensor


@dataclass
class TargetMoments:
    """Moments of one target against its feature block: ``sum_y`` ``[D]``, ``xy`` ``[F, D]``, ``yy`` ``[D, D]``."""

    feature_key: str
    sender_layers: list[int]
    sum_y: torch.Tensor
    xy: torch.Tensor
    yy: torch.Tensor
    anchor: int | None = None  # receiver layer whose input stream follows the sender features (None: no anchor)


@dataclass
class PairStatistics:
    """Streaming second moments for one (sender, receiver) pair; see the module docstring."""

    header: dict
    features: dict[str, Moments] = field(default_factory=dict)
    targets: dict[str, TargetMoments] = field(default_factory=dict)
    n_tokens: int = 0

    @classmethod
    def empty(cls, header: dict) -> "PairStatistics":
        return cls(dict(header, format=FORMAT, version=__version__))

    def add(self, name: str, sender_layers: list[int], x: torch.Tensor, y: torch.Tensor,
            count_tokens: bool = False, product_dtype: torch.dtype = torch.float64, anchor: int | None = None
            ) -> None:
        """Accumulate features ``x`` ``[n, F]`` and targets ``y`` ``[n, D]`` of one context for target ``name``
        (``x`` ends with the receiver's anchor stream when ``anchor`` is given).

        Feature moments are added once per context and feature block: pass ``count_tokens=True`` for the first
        target of each context (it also counts the tokens). The running sums are float64; ``product_dtype``
        float32 forms one context's products in float32 first (about 4x faster at 10k features).
        """
        xp, yp = x.to(product_dtype), y.to(product_dtype)
        key = "x" + "-".join(map(str, sender_layers)) + (f"+r{anchor}" if anchor is not None else "")
        first_for_block = key not in self._seen_this_context
        if key not in self.features:
            self.features[key] = Moments(torch.zeros(x.shape[1], dtype=torch.float64),
                                         torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64))
        if first_for_block:
            self.features[key].sum_x += xp.sum(0)
            self.features[key].xx += xp.T @ xp
            self._seen_this_context.add(key)
        if name not in self.targets:
            d = y.shape[1]
            self.targets[name] = TargetMoments(key, list(sender_layers), torch.zeros(d, dtype=torch.float64),
                                               torch.zeros(x.shape[1], d, dtype=torch.float64),
                                               torch.zeros(d, d, dtype=torch.float64), anchor)
        t = self.targets[name]
        t.sum_y += yp.sum(0)
        t.xy += xp.T @ yp
        t.yy += yp.T @ yp
        if count_tokens:
            self.n_tokens += x.shape[0]

    def end_context(self) -> None:
        """Call after all targets of one context were added."""
        self._seen_this_context = set()

    def __post_init__(self) -> None:
        self._seen_this_context: set[str] = set()

    # ------------------------------------------------------------------ centred views
    def centred(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(mean_x [F], mean_y [D], Cxx [F,F], Cxy [F,D], Cyy [D,D])``: covariances (divided by n)."""
        t = self.targets[name]
        f = self.features[t.feature_key]
        n = self.n_tokens
        mx, my = f.sum_x / n, t.sum_y / n
        cxx = f.xx / n - torch.outer(mx, mx)
        cxy = t.xy / n - torch.outer(mx, my)
        cyy = t.yy / n - torch.outer(my, my)
        return mx, my, cxx, cxy, cyy

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> Path:
        """Write ``<path>.safetensors`` and ``<path>.json`` atomically (see :mod:`cachecert_agents.artifacts`)."""
        tensors = {}
        for key, m in self.features.items():
            tensors[f"{key}/sum_x"], tensors[f"{key}/xx"] = m.sum_x, m.xx
        for name, t in self.targets.items():
            tensors[f"{name}/sum_y"], tensors[f"{name}/xy"], tensors[f"{name}/yy"] = t.sum_y, t.xy, t.yy
        header = dict(self.header, n_tokens=self.n_tokens,
                      targets={n: {"feature_key": t.feature_key, "sender_layers": t.sender_layers,
                                   **({"anchor": t.anchor} if t.anchor is not None else {})}
                               for n, t in self.targets.items()})
        return save_artifact(path, tensors, header)

    @classmethod
    def load(cls, path: str | Path, expect: dict | None = None) -> "PairStatistics":
        """Load statistics; ``expect`` (e.g. ``{"sender_kv": fp, "receiver_kv": fp}``) must match the header."""
        header, tensors = load_artifact(path, FORMAT, expect, "statistics")
        stats = cls(header, n_tokens=int(header["n_tokens"]))
        for name, spec in header["targets"].items():
            key = spec["feature_key"]
            if key not in stats.features:
                stats.features[key] = Moments(tensors[f"{key}/sum_x"], tensors[f"{key}/xx"])
            stats.targets[name] = TargetMoments(key, spec["sender_layers"], tensors[f"{name}/sum_y"],
                                                tensors[f"{name}/xy"], tensors[f"{name}/yy"], spec.get("anchor"))
        return stats

"""Closed-form ridge mappers fitted from :class:`PairStatistics`, with held-out R^2 from moments alone.

For target t with centred covariances ``Cxx``, ``Cxy`` the map is ``W = (Cxx + lam I)^-1 Cxy``, ``b = mean_y -
mean_x W``, with ``lam = rho * tr(Cxx) / F`` (``rho`` relative, so one grid works for every pair). The held-out
error of any (W, b) is a quadratic form in the held-out moments, so ``rho`` is chosen per target on held-out
statistics without revisiting a single token.

Saved as safetensors (``W``, ``b`` per target) plus a JSON header with the pair's fingerprints; loading it for
another pair raises ``GeometryMismatchError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from cachecert_agents import __version__
from cachecert_agents.artifacts import (artifact_fingerprint, artifact_paths, file_fingerprint, load_artifact,
                                        save_artifact)
from cachecert_agents.transfer.statistics import PairStatistics

FORMAT = "cachecert-ridge-mapper/1"
RHO_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)


def ridge_solve(cxx: torch.Tensor, cxy: torch.Tensor, rho: float) -> torch.Tensor:
    """``(Cxx + rho * tr(Cxx)/F * I)^-1 Cxy`` in float64 (Cholesky)."""
    f = cxx.shape[0]
    lam = rho * torch.trace(cxx) / f
    a = cxx + lam * torch.eye(f, dtype=cxx.dtype)
    return torch.cholesky_solve(cxy, torch.linalg.cholesky(a))


def heldout_r2(w: torch.Tensor, b: torch.Tensor, stats: PairStatistics, name: str) -> float:
    """``1 - SSE/SST`` of ``y ~ x W + b`` on the tokens behind ``stats`` (uncentred moments, float64).

    ``SSE = tr(YY) - 2 tr(W^T XY) - 2 b.sum_y + tr(W^T XX W) + 2 b.(W^T sum_x) + n |b|^2``.
    """
    t = stats.targets[name]
    f = stats.features[t.feature_key]
    n = stats.n_tokens
    sse = (torch.trace(t.yy) - 2 * torch.sum(w * t.xy) - 2 * b @ t.sum_y + torch.sum(w * (f.xx @ w))
           + 2 * b @ (w.T @ f.sum_x) + n * b @ b)
    sst = torch.trace(t.yy) - (t.sum_y @ t.sum_y) / n
    return float(1 - sse / sst)


@dataclass
class RidgeMapper:
    """Per-target linear maps ``y = x W + b`` (float32), from sender features to receiver targets."""

    header: dict
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    biases: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def fit(cls, stats: PairStatistics, heldout: PairStatistics | None = None, rho: float | None = None,
            targets: list[str] | None = None) -> "RidgeMapper":
        """Fit every target (or ``targets``); choose ``rho`` per target on ``heldout`` unless given."""
        header = {k: v for k, v in stats.header.items() if k not in ("targets", "format", "tensors_sha256")}
        header.update(format=FORMAT, version=__version__, fit_tokens=stats.n_tokens, targets={})
        mapper = cls(header)
        for name in targets or list(stats.targets):
            mx, my, cxx, cxy, _ = stats.centred(name)
            grid = RHO_GRID if rho is None and heldout is not None else (rho if rho is not None else 1e-2,)
            best = None
            for r in grid:
                w = ridge_solve(cxx, cxy, r)
                b = my - mx @ w
                score = heldout_r2(w, b, heldout, name) if heldout is not None else float("nan")
                if best is None or score > best[0]:
                    best = (score, r, w, b)
            score, r, w, b = best
            mapper.weights[name], mapper.biases[name] = w.float(), b.float()
            mapper.header["targets"][name] = {
                "sender_layers": stats.targets[name].sender_layers, "rho": r,
                **({"anchor": stats.targets[name].anchor} if stats.targets[name].anchor is not None else {}),
                "heldout_r2": score, "fit_r2": heldout_r2(w, b, stats, name)}
        return mapper

    def randomised(self, seed: int = 0) -> "RidgeMapper":
        """A control: same shapes, biases and per-target weight norms, but Gaussian random weights. Its outputs
        have the right mean and scale and carry no information about the context."""
        gen = torch.Generator().manual_seed(seed)
        out = RidgeMapper(dict(self.header, control="random-map", tensors_sha256=None))
        for name, w in self.weights.items():
            r = torch.randn(w.shape, generator=gen)
            out.weights[name] = r * (w.norm() / r.norm())
            out.biases[name] = self.biases[name].clone()
        return out

    @property
    def fingerprint(self) -> str | None:
        """sha256 (16 hex) of the saved tensor file this mapper was loaded from or saved to (what certificates and
        labelled records name it by); None for a mapper never saved."""
        return self.header.get("tensors_sha256")

    def sender_layers(self, name: str) -> list[int]:
        return self.header["targets"][name]["sender_layers"]

    @property
    def anchor(self) -> int | None:
        """For an anchored mapper, the receiver layer ``a`` whose input stream (computed by the receiver itself
        over the context) its maps read after the sender features; None for a sender-only mapper."""
        return self.header.get("anchor")

    def predict(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``[n, F]`` features -> ``[n, D]`` predicted targets (on the features' device)."""
        w = self.weights[name].to(x.device)
        return x @ w + self.biases[name].to(x.device)

    def save(self, path: str | Path) -> Path:
        """Write ``<path>.safetensors`` and ``<path>.json`` atomically (see :mod:`cachecert_agents.artifacts`)."""
        tensors = {}
        for name in self.weights:
            tensors[f"{name}/W"], tensors[f"{name}/b"] = self.weights[name], self.biases[name]
        st = save_artifact(path, tensors, self.header)
        self.header["tensors_sha256"] = artifact_fingerprint(path)
        return st

    @classmethod
    def load(cls, path: str | Path, expect: dict | None = None) -> "RidgeMapper":
        """Load a mapper; ``expect`` (pair fingerprints) must match its header."""
        header, tensors = load_artifact(path, FORMAT, expect, "mapper")
        if not header.get("tensors_sha256"):  # saved before the header recorded it
            header["tensors_sha256"] = file_fingerprint(artifact_paths(path)[0])
        mapper = cls(header)
        for name in header["targets"]:
            mapper.weights[name], mapper.biases[name] = tensors[f"{name}/W"], tensors[f"{name}/b"]
        return mapper

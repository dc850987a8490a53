"""Rotary position embedding: apply and remove, exactly as transformers' models do.

Conventions (transformers' ``rotate_half``): for a head vector x of ``head_dim`` channels, the first
``rotary_dim`` channels rotate, channel i pairing with channel ``i + rotary_dim // 2``; the rest pass through.
``cos``/``sin`` tables are ``[n, rotary_dim]`` float32, built with the same operations as the models'
rotary modules (``freqs = position.float() * inv_freq``; ``cat(freqs, freqs)``; times ``attention_scaling``), so
re-applying RoPE at the original positions reproduces the model's keys to float32 rounding.
"""

from __future__ import annotations

import torch

from cachecert_agents.models.geometry import RopeSpec


def rope_tables(spec: RopeSpec, positions: torch.Tensor, device: torch.device | str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[n, rotary_dim]`` (float32) for integer ``positions`` ``[n]``."""
    device = device if device is not None else positions.device
    inv_freq = spec.inv_freq_tensor(device)
    freqs = positions.to(device)[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * spec.attention_scaling, emb.sin() * spec.attention_scaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` split in halves along the last dimension."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pre-RoPE vectors ``x`` ``[..., n, head_dim]`` by position tables ``[n, rotary_dim]``."""
    rot = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    out = (x_rot * cos) + (rotate_half(x_rot) * sin)
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


def exact_dtype(device: torch.device | str) -> torch.dtype:
    """The widest float the device computes in: float64, except on Apple's MPS, which has none (float32 there)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def remove_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Invert :func:`apply_rope`: post-RoPE ``x`` ``[..., n, head_dim]`` back to pre-RoPE vectors.

    Computed in float64 (:func:`exact_dtype`: float32 on MPS) and divided by ``cos^2 + sin^2`` (which is
    ``attention_scaling^2``), so the inverse is exact up to the input's own rounding, for any scaling.
    """
    rot = cos.shape[-1]
    wide = exact_dtype(x.device)
    c, s = cos.to(x.device, wide), sin.to(x.device, wide)
    x_rot = x[..., :rot].to(wide)
    out = ((x_rot * c) - (rotate_half(x_rot) * s)) / (c * c + s * s)
    out = out.to(x.dtype)
    return torch.cat((out, x[..., rot:]), dim=-1) if x.shape[-1] > rot else out

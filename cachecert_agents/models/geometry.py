"""Model geometry: everything about a model's attention that a KV cache depends on, as a JSON-able record.

A :class:`ModelGeometry` is read from a transformers config (and tokenizer). Rotary inverse frequencies are
taken from the model's own rotary-embedding module, built from the config, so RoPE removal and re-application
use exactly the numbers the model uses (per layer type: Gemma 3 has different theta on local and global layers).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, Field

from cachecert_agents.artifacts import json_fingerprint

_SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope_static", "proportional"}


class RopeSpec(BaseModel):
    """Rotary embedding of one layer type.

    ``inv_freq`` has ``rotary_dim // 2`` entries (radians per position); cos/sin are scaled by
    ``attention_scaling``; the first ``rotary_dim`` channels of a head rotate, the rest pass through.
    The convention is transformers' ``rotate_half`` (channel i pairs with channel i + rotary_dim/2).
    """

    rope_type: str
    theta: float | None = None
    attention_scaling: float = 1.0
    rotary_dim: int
    inv_freq: list[float]

    def inv_freq_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[rotary_dim // 2]`` float32 inverse frequencies."""
        return torch.tensor(self.inv_freq, dtype=torch.float32, device=device)


class ModelGeometry(BaseModel):
    """Attention geometry of a decoder-only model.

    Shapes of this model's cache: per layer, keys and values ``[batch, num_kv_heads, seq, head_dim]``.
    ``layer_types[i]`` is ``"full_attention"`` or ``"sliding_attention"`` (window ``sliding_window`` tokens).
    """

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    layer_types: list[str]
    sliding_window: int | None = None
    rope: dict[str, RopeSpec] = Field(description="rotary embedding per layer type")
    qk_norm: bool = False
    tokenizer_fingerprint: str | None = None

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "sliding_attention"]

    def rope_for_layer(self, layer: int) -> RopeSpec:
        return self.rope[self.layer_types[layer]]

    def kv_signature(self) -> dict[str, Any]:
        """The fields a KV cache's layout and positions depend on."""
        return {
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "layer_types": self.layer_types,
            "sliding_window": self.sliding_window,
            "rope": {k: v.model_dump() for k, v in sorted(self.rope.items())},
        }

    def layer_windows(self) -> list[int | None]:
        """Per layer, the sliding window of a sliding-attention layer, None for full attention."""
        return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]

    def kv_fingerprint(self) -> str:
        """sha256 (16 hex) of :meth:`kv_signature`: equal fingerprints mean interchangeable cache layouts."""
        return json_fingerprint(self.kv_signature())

    def fingerprint(self) -> str:
        """sha256 (16 hex) of the whole geometry, tokenizer included."""
        return json_fingerprint(self.model_dump())

    def describe(self) -> str:
        """One line naming the geometry, for error messages."""
        rope = ", ".join(f"{k}: theta={v.theta}" for k, v in sorted(self.rope.items()))
        window = f", window {self.sliding_window} on {len(self.sliding_layers)} layers" if self.sliding_layers else ""
        return (f"{self.model_type}: {self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_dim} dims"
                f"{window}, rope [{rope}] (fingerprint {self.kv_fingerprint()})")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 (16 hex) of a tokenizer's vocabulary and special tokens; equal for interchangeable tokenizers."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    return json_fingerprint({"vocab": vocab, "special": special})


def _skeleton(config: Any) -> torch.nn.Module:
    """The model's module tree on the meta device (no memory, no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _rotary_module(skeleton: torch.nn.Module, config: Any) -> torch.nn.Module:
    """Build the model's own rotary-embedding module on the CPU from its config."""
    base = getattr(skeleton, skeleton.base_model_prefix, skeleton)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        raise NotImplementedError(f"model type {config.model_type!r} has no rotary_emb module; "
                                  "cachecert-agents supports rotary-embedding decoders")
    return type(rotary)(config)


def _rope_specs(rotary: torch.nn.Module, config: Any, layer_types: list[str]) -> dict[str, RopeSpec]:
    params = getattr(config, "rope_parameters", None) or {}
    specs: dict[str, RopeSpec] = {}
    for layer_type in sorted(set(layer_types)):
        per_type = params.get(layer_type, params) if isinstance(params, dict) else {}
        rope_type = (per_type or {}).get("rope_type", "default")
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise NotImplementedError(f"rope type {rope_type!r} changes with sequence length; "
                                      "cache segments support static rope types only")
        if hasattr(rotary, f"{layer_type}_inv_freq"):
            inv_freq = getattr(rotary, f"{layer_type}_inv_freq")
            scaling = getattr(rotary, f"{layer_type}_attention_scaling")
        else:
            inv_freq, scaling = rotary.inv_freq, rotary.attention_scaling
        specs[layer_type] = RopeSpec(
            rope_type=rope_type,
            theta=(per_type or {}).get("rope_theta"),
            attention_scaling=float(scaling),
            rotary_dim=2 * inv_freq.numel(),
            inv_freq=[float(x) for x in inv_freq.float().tolist()],
        )
    return specs


def geometry_from_config(config: Any, tokenizer: Any | None = None) -> ModelGeometry:
    """Read the attention geometry of a transformers causal-LM config (text config for multimodal ones)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n_layers = text.num_hidden_layers
    layer_types = list(getattr(text, "layer_types", None) or ["full_attention"] * n_layers)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    has_sliding = "sliding_attention" in layer_types
    skeleton = _skeleton(text)
    return ModelGeometry(
        model_type=text.model_type,
        num_layers=n_layers,
        num_heads=text.num_attention_heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        head_dim=head_dim,
        hidden_size=text.hidden_size,
        vocab_size=text.vocab_size,
        layer_types=layer_types,
        sliding_window=getattr(text, "sliding_window", None) if has_sliding else None,
        rope=_rope_specs(_rotary_module(skeleton, text), text, layer_types),
        qk_norm=any(hasattr(m, "k_norm") for m in skeleton.modules()),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer) if tokenizer is not None else None,
    )

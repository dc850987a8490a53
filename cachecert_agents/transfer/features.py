"""What a transfer reads from the sender and writes for the receiver, per context.

Sender side (:func:`sender_features`): the sender's residual stream over the context tokens, one tensor per layer
boundary, RMS-normalised per token (the receiver applies an RMSNorm before its projections anyway, and this
removes the sender's scale and massive-activation spikes from the features), pooled onto the receiver's tokens by
character-span alignment. In a real handoff these already exist: the upstream node computed them.

Receiver side (:func:`receiver_targets`): what a mapper must predict, from one receiver prefill over calibration
text: per layer, pre-RoPE keys and values of the context tokens flattened over KV heads
(``[n, 2 * kv_heads * head_dim]``: keys first), and the residual stream entering each split layer
(``[n, hidden]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cachecert_agents.kv.alignment import TokenAlignment, align_tokens
from cachecert_agents.models.handle import ModelHandle, PromptSegments, QKCapture


@dataclass
class SenderFeatures:
    """``hidden`` ``[num_layers + 1, n_context, hidden]`` (float32, RMS-normalised; index 0 = embeddings) over
    the sender's context tokens, their character ``offsets`` ``[n_context, 2]``, the sender's prefill time of
    prefix + context in seconds (not a cost of the transfer: the sender already paid it), and the context text the
    offsets point into (None when not recorded), which a transfer checks against the receiver's."""

    hidden: torch.Tensor
    offsets: torch.Tensor
    prefill_s: float
    context_text: str | None = None

    def select(self, layers: list[int]) -> torch.Tensor:
        """``[n_context, len(layers) * hidden]``: the chosen layer boundaries side by side."""
        return torch.cat([self.hidden[m] for m in layers], dim=-1)

    def on_receiver_tokens(self, alignment: TokenAlignment | None) -> "SenderFeatures":
        """The same features pooled onto the receiver's context tokens (one sparse product for all layers);
        ``offsets`` stay the sender's. Identity when ``alignment`` is None."""
        if alignment is None or alignment.is_identity:
            return self
        n_layers, n, d = self.hidden.shape
        flat = self.hidden.permute(1, 0, 2).reshape(n, n_layers * d)
        pooled = alignment.pool(flat).reshape(alignment.n_receiver, n_layers, d).permute(1, 0, 2)
        return SenderFeatures(pooled.contiguous(), self.offsets, self.prefill_s, self.context_text)


def rms_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def prefill_with_features(model: ModelHandle, prompt: PromptSegments, keep_features: bool = True
                          ) -> tuple[Any, SenderFeatures | None, float]:
    """Prefill ``prefix + context`` in one forward; returns the cache, the normalised residual stream over the
    context (when ``keep_features``; what a transfer from this model reads) and the seconds it took.

    The features are written by hooks into one preallocated tensor during the forward
    (:meth:`ModelHandle.capture_residual_stream`), so a sender's prefill costs little more than a plain one."""
    import time

    start, end = prompt.context_span
    t0 = time.perf_counter()
    if not keep_features:
        out = model.forward(prompt.input_ids[:end], logits_to_keep=1)
        return out.cache, None, time.perf_counter() - t0
    with model.capture_residual_stream(start, end, transform=rms_normalise) as hidden:
        out = model.forward(prompt.input_ids[:end], logits_to_keep=1)
    elapsed = time.perf_counter() - t0
    return out.cache, SenderFeatures(hidden, prompt.context_offsets, elapsed, prompt.context_text), elapsed


def sender_features(sender: ModelHandle, prompt: PromptSegments) -> SenderFeatures:
    """Prefill the sender on ``prefix + context`` and keep its normalised residual stream over the context."""
    return prefill_with_features(sender, prompt)[1]


def alignment_for(receiver_offsets: torch.Tensor, sender_offsets: torch.Tensor) -> TokenAlignment | None:
    """Alignment of receiver context tokens to sender context tokens; None when the tokenizations coincide."""
    if torch.equal(receiver_offsets, sender_offsets):
        return None
    return align_tokens(receiver_offsets, sender_offsets)


@dataclass
class ReceiverTargets:
    """``kv[l]`` ``[n_context, 2 * kv_heads * head_dim]`` pre-RoPE keys then values; ``hidden[s]``
    ``[n_context, hidden]`` residual stream entering layer ``s``; ``qk``, when asked for, the pre-RoPE queries
    and keys of every token the prefill read (what :class:`cachecert_agents.cti.queries.QueryAccumulator` reads);
    ``context_span``: the context's ``[start, end)`` token positions in that prefill; ``continuation_nll``: with a
    continuation, its mean negative log-likelihood (nats per token) read teacher-forced after the whole prompt."""

    kv: list[torch.Tensor]
    hidden: dict[int, torch.Tensor]
    qk: QKCapture | None = None
    context_span: tuple[int, int] = (0, 0)
    continuation_nll: float | None = None


def receiver_targets(receiver: ModelHandle, prompt: PromptSegments, splits: list[int],
                     queries: bool = False, continuation: torch.Tensor | None = None) -> ReceiverTargets:
    """One receiver prefill over ``prefix + context``; returns the mapper's regression targets (and, with
    ``queries``, the recorded queries and keys, so the CTI's query statistics need no second pass).

    ``continuation`` ``[m]`` token ids: the prefill reads the whole prompt and then these tokens teacher-forced
    (one forward; causal, so the context's targets are unchanged) and returns their mean NLL, the with-context
    half of the receiver's likelihood floor (:mod:`cachecert_agents.eval.receiver_floor`) at the price of the
    suffix and continuation tokens only."""
    start, end = prompt.context_span
    if continuation is None:
        ids, keep = prompt.input_ids[:end], 1
    else:
        if continuation.numel() == 0:
            raise ValueError("the continuation has no tokens")
        ids, keep = torch.cat([prompt.input_ids, continuation.to(prompt.input_ids)]), continuation.numel() + 1
    # One forward over prefix + context: with no cache before it the attention runs its causal kernel, about 20%
    # faster on a 3k-token context than the prefix cache plus an explicit mask (same values to rounding).
    with receiver.capture_qk(queries=queries, keys=True, values=True) as cap:  # every token, sliding layers too
        out = receiver.forward(ids, output_hidden_states=True, logits_to_keep=keep)
    kv = [flatten_kv(cap.key(layer)[:, :, start:end], cap.value(layer)[:, :, start:end])
          for layer in range(receiver.geometry.num_layers)]
    hidden = {s: out.hidden_states[s][start:end].float() for s in splits}
    nll = None if continuation is None else continuation_nll(out.logits, continuation)
    return ReceiverTargets(kv, hidden, cap if queries else None, (start, end), nll)


def continuation_nll(logits: torch.Tensor, continuation: torch.Tensor) -> float:
    """Mean negative log-likelihood (nats per token) of ``continuation`` ``[m]`` read teacher-forced, from the
    logits ``[m + 1, vocab]`` of the last ``m + 1`` positions of a forward over prompt + continuation (position
    ``i`` predicts token ``i`` of the continuation; the last position predicts past it and is dropped)."""
    return float(torch.nn.functional.cross_entropy(logits[:-1].float(), continuation.to(logits.device)))


def flatten_kv(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[1, heads, n, d]`` keys and values -> ``[n, 2 * heads * d]`` (keys first, head-major)."""
    k = keys[0].transpose(0, 1).reshape(keys.shape[2], -1)
    v = values[0].transpose(0, 1).reshape(values.shape[2], -1)
    return torch.cat([k, v], dim=-1)


def unflatten_kv(flat: torch.Tensor, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`flatten_kv`: ``[n, 2 * heads * d]`` -> keys, values ``[1, heads, n, d]``."""
    n = flat.shape[0]
    half = kv_heads * head_dim
    k = flat[:, :half].reshape(n, kv_heads, head_dim).transpose(0, 1)[None]
    v = flat[:, half:].reshape(n, kv_heads, head_dim).transpose(0, 1)[None]
    return k.contiguous(), v.contiguous()

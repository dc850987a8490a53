"""The attention-output cosine baseline of CTI (issue: "the expensive kind of predictor CTI replaces").

Needs a *fitted mapper* and receiver forward passes on held-out text. Per held-out example and receiver layer
``l``, with the receiver's own queries of the request's suffix tokens (what answering reads):

    o_l      = W_O softmax(q K^T * scale, causal/window mask) V          (true keys/values everywhere)
    o_l^map  = the same with the context tokens' K, V replaced by the mapper's prediction
    cos_l    = mean over suffix tokens of cos(o_l, o_l^map)               (vectors of size hidden)

Prefix and suffix keys/values stay the receiver's own, as in a transfer. A pure KV transfer is predicted by
``mean_l cos_l``; a split transfer at ``s`` maps only the layers below ``s`` and recomputes the rest, so its
prediction is ``mean_l (cos_l if l < s else 1)`` (the recomputed layers' error is not seen by this baseline).
Higher means more transferable, like the CTI.
"""

from __future__ import annotations

from typing import Any

import torch

from cachecert_agents.kv.rope import apply_rope, rope_tables
from cachecert_agents.models.handle import ModelHandle, PromptSegments
from cachecert_agents.transfer.apply import mapped_kv
from cachecert_agents.transfer.features import alignment_for, sender_features
from cachecert_agents.transfer.mappers import RidgeMapper


def attention_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, scaling: float,
                      window: int | None, w_o: torch.Tensor) -> torch.Tensor:
    """``[m, hidden]``: the attention block's output for query rows ``rows`` ``[m]`` (positions ``0..n-1``).

    ``q`` ``[H, n, d]`` and ``k`` ``[Hk, n, d]`` with RoPE applied, ``v`` ``[Hk, n, d]``, ``w_o`` ``[hidden, H*d]``;
    causal masking (and a sliding ``window``), grouped-query heads repeated."""
    heads, kv_heads = q.shape[0], k.shape[0]
    kk = k.repeat_interleave(heads // kv_heads, 0)
    vv = v.repeat_interleave(heads // kv_heads, 0)
    logits = torch.einsum("hmd,hnd->hmn", q[:, rows], kk) * scaling
    j = torch.arange(k.shape[1], device=q.device)[None, :]
    i = rows[:, None]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    a = torch.softmax(logits.masked_fill(~allowed[None], float("-inf")), dim=-1)
    heads_out = torch.einsum("hmn,hnd->mhd", a, vv).reshape(len(rows), -1)  # [m, H*d]
    return heads_out @ w_o.T


@torch.inference_mode()
def attention_output_cosines(sender: ModelHandle, receiver: ModelHandle, mapper: RidgeMapper,
                             prompt: PromptSegments, sender_prompt: PromptSegments) -> list[float]:
    """``cos_l`` per receiver layer for one request (see the module docstring). ``prompt`` is the receiver's,
    ``sender_prompt`` the sender's prompt over the same context."""
    geo = receiver.geometry
    attn = receiver._attention_modules()
    start, end = prompt.context_span
    n = len(prompt)
    with receiver.capture_qk(queries=True, keys=True, values=True) as cap:
        receiver.forward(prompt.input_ids, logits_to_keep=1)
    feats = sender_features(sender, sender_prompt)
    feats = feats.on_receiver_tokens(alignment_for(prompt.context_offsets, feats.offsets))
    positions = torch.arange(n)
    rows = torch.arange(end, n)  # the request's own tokens
    cosines = []
    for layer in range(geo.num_layers):
        cos, sin = rope_tables(geo.rope_for_layer(layer), positions)
        q = apply_rope(cap.query(layer)[0].cpu().double(), cos, sin)  # float64 on the CPU
        k = apply_rope(cap.key(layer)[0].cpu().double(), cos, sin)
        v = cap.value(layer)[0].cpu().double()
        k_map, v_map = mapped_kv(receiver, mapper, feats, layer, positions[start:end])
        k2, v2 = k.clone(), v.clone()
        k2[:, start:end], v2[:, start:end] = k_map[0].double().cpu(), v_map[0].double().cpu()
        window = geo.sliding_window if layer in geo.sliding_layers else None
        w_o = attn[layer].o_proj.weight.detach().double().cpu()
        scaling = float(attn[layer].scaling)
        o_true = attention_outputs(q, k, v, rows, scaling, window, w_o)
        o_map = attention_outputs(q, k2, v2, rows, scaling, window, w_o)
        cosines.append(float(torch.nn.functional.cosine_similarity(o_true, o_map, dim=-1).mean()))
    return cosines


def cosine_predictions(per_example: list[list[float]], splits: list[int]) -> dict[str, float]:
    """Per split layer ``s`` (``L``: pure KV), ``mean_l (cos_l if l < s else 1)`` averaged over examples."""
    cos = torch.tensor(per_example, dtype=torch.float64)  # [examples, L]
    L = cos.shape[1]
    out = {}
    for s in splits:
        kept = torch.where(torch.arange(L) < s, cos, torch.ones_like(cos))
        out[str(s)] = float(kept.mean())
    return out


def attention_cosine_baseline(sender: ModelHandle, receiver: ModelHandle, mapper: RidgeMapper,
                              examples: list[Any], splits: list[int]) -> dict[str, Any]:
    """The baseline over held-out ``examples`` (workload :class:`Example`s): per-layer mean cosines and the
    prediction for each split layer."""
    per_example = []
    for ex in examples:
        per_example.append(attention_output_cosines(sender, receiver, mapper,
                                                    receiver.format_prompt(ex.context, ex.instruction),
                                                    sender.format_prompt(ex.context, ex.instruction)))
    per_layer = torch.tensor(per_example, dtype=torch.float64).mean(0).tolist()
    return {"n_examples": len(examples), "per_layer": per_layer,
            "predictions": cosine_predictions(per_example, splits)}

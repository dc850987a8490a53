"""Collect :class:`PairStatistics` for a pair over calibration contexts (never a workload's evaluation split)."""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from tqdm.auto import tqdm

from cachecert_agents.artifacts import OPTIONAL_IDENTITY_KEYS
from cachecert_agents.models.handle import ModelHandle
from cachecert_agents.transfer.features import (ReceiverTargets, alignment_for, receiver_targets, rms_normalise,
                                                 sender_features)
from cachecert_agents.transfer.statistics import PairStatistics, sender_layers_for

logger = logging.getLogger(__name__)


def pair_header(sender: ModelHandle, receiver: ModelHandle, **extra: object) -> dict:
    """The identity of a pair, recorded in (and checked against) every artifact built for it: names, cache
    geometries, tokenizers and weights (:attr:`ModelHandle.weights_fingerprint`, so an artifact built for one
    model is refused for a fine-tune or another quantisation of the same architecture and tokenizer)."""
    return {
        "sender": sender.name, "receiver": receiver.name,
        "sender_kv": sender.geometry.kv_fingerprint(), "receiver_kv": receiver.geometry.kv_fingerprint(),
        "sender_tokenizer": sender.geometry.tokenizer_fingerprint,
        "receiver_tokenizer": receiver.geometry.tokenizer_fingerprint,
        "sender_weights": sender.weights_fingerprint, "receiver_weights": receiver.weights_fingerprint,
        **extra,
    }


FINGERPRINT_KEYS = ("sender_kv", "receiver_kv", "sender_tokenizer", "receiver_tokenizer")


def pair_fingerprints(header: dict) -> dict:
    """The fingerprint entries of a pair header (what an artifact must match to be used for that pair): the
    :data:`FINGERPRINT_KEYS` and, where the header records them, the weights
    (:data:`~cachecert_agents.artifacts.OPTIONAL_IDENTITY_KEYS`; artifacts built before they were recorded lack
    them)."""
    return ({k: header[k] for k in FINGERPRINT_KEYS}
            | {k: header[k] for k in OPTIONAL_IDENTITY_KEYS if k in header})


def collect_statistics(sender: ModelHandle, receiver: ModelHandle, contexts: Iterable[tuple[str, str]],
                       splits: list[int], header: dict | None = None, width: int = 3,
                       progress: bool = True, total: int | None = None, hidden_width: int | None = None,
                       anchor: int | None = None, kv_until: int | None = None) -> PairStatistics:
    """Stream ``(context, instruction)`` pairs through both models and accumulate moments for every receiver
    layer's keys/values (``kv:l``) and the residual stream entering each split layer (``hidden:s``).

    Each target reads ``width`` consecutive sender layer boundaries around its proportional depth;
    ``hidden_width`` (default ``width``) widens that window for the residual-stream targets only (a wider window
    predicts the stream better: ``docs/results/hidden_map_features.md``).

    ``anchor`` ``a``: statistics of an anchored mapper. Every target's features end with the receiver's own
    normalised residual stream entering layer ``a`` (the receiver computes its layers below ``a`` itself at
    transfer time); the targets below the anchor (``kv:l``, ``l < a``; ``hidden:s``, ``s <= a``) are not
    collected, since an anchored transfer computes them exactly. ``kv_until``: collect ``kv:l`` for ``l <
    kv_until`` only (split transfers at or below it never read the layers above; they are the largest part of
    the statistics' memory)."""
    stats = PairStatistics.empty(header or pair_header(sender, receiver))
    if anchor is not None:
        if not all(anchor < s for s in splits):
            raise ValueError(f"anchor {anchor} must be below every split ({splits})")
        stats.header["anchor"] = anchor
    import time

    n_contexts = 0
    t0 = time.perf_counter()
    for context, instruction in tqdm(contexts, desc=f"calibrate {sender.name}->{receiver.name}", unit="ctx",
                                     disable=not progress, total=total):
        add_context(stats, sender, receiver, context, instruction, splits, width, hidden_width, anchor, kv_until)
        n_contexts += 1
    stats.header["n_contexts"] = n_contexts
    stats.header["collect_s"] = time.perf_counter() - t0  # both models' passes and the moment updates
    logger.info("collected statistics over %d contexts, %d receiver tokens", n_contexts, stats.n_tokens)
    return stats


def add_context(stats: PairStatistics, sender: ModelHandle, receiver: ModelHandle, context: str, instruction: str,
                splits: list[int], width: int = 3, hidden_width: int | None = None, anchor: int | None = None,
                kv_until: int | None = None, queries: bool = False,
                product_dtype: torch.dtype = torch.float32, continuation: torch.Tensor | None = None
                ) -> ReceiverTargets:
    """Run both models over one context and add its moments to ``stats`` (the body of
    :func:`collect_statistics`, whose docstring explains the arguments). Returns the receiver's targets, with its
    recorded queries when ``queries`` (the CTI's single pass reuses them) and the NLL of ``continuation`` read
    after the whole prompt when one is given (:func:`~cachecert_agents.transfer.features.receiver_targets`).

    ``product_dtype``: one context's products are formed in float32 and added to the float64 running sums
    (:meth:`PairStatistics.add`); on a 3k-token context (SmolLM2 -> Qwen 0.5B) the moment updates took 9 s instead
    of 18 s, and the rounding (relative ~1e-7 per product over one context) is far below the sampling error."""
    ls, lr = sender.geometry.num_layers + 1, receiver.geometry.num_layers + 1
    s_prompt = sender.format_prompt(context, instruction)
    r_prompt = receiver.format_prompt(context, instruction)
    targets = receiver_targets(receiver, r_prompt, sorted(set(splits) | ({anchor} if anchor else set())), queries,
                               continuation)
    anchor_x = rms_normalise(targets.hidden[anchor]) if anchor else None
    alignment = alignment_for(r_prompt.context_offsets, s_prompt.context_offsets)
    feats = sender_features(sender, s_prompt).on_receiver_tokens(alignment)

    def features_for(boundary: int, w: int = width):
        layers = sender_layers_for(boundary, lr, ls, w)
        x = feats.select(layers)
        return layers, x if anchor_x is None else torch.cat([x, anchor_x], dim=-1)

    first = True
    for layer, y in enumerate(targets.kv):
        if (anchor and layer < anchor) or (kv_until is not None and layer >= kv_until):
            continue
        layers, x = features_for(layer)
        stats.add(f"kv:{layer}", layers, x, y, count_tokens=first, anchor=anchor, product_dtype=product_dtype)
        first = False
    for s in splits:
        if anchor and s <= anchor:
            continue
        layers, x = features_for(s, hidden_width or width)
        stats.add(f"hidden:{s}", layers, x, targets.hidden[s], anchor=anchor, product_dtype=product_dtype)
    stats.end_context()
    return targets

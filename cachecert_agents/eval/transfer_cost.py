"""``cachecert bench transfer-cost``: transfer time against receiver prefill time, at fixed context lengths.

For each context length (receiver tokens of the bundled sample text) and each split, the median over repeats of
(a) the receiver's prefill of the context on top of its cached template prefix and (b) the transfer (mapping,
RoPE, and the receiver's own layers above the split), measured in one run with (a) and (b) interleaved repeat by
repeat, and their ratio. The sender's features are computed once and not charged: in a handoff the sender already
has them.
"""

from __future__ import annotations

import copy
import statistics
import time

from cachecert_agents.eval.kv_check import context_of_tokens
from cachecert_agents.eval.transfer_eval import method_name, method_variants
from cachecert_agents.models.handle import ModelHandle
from cachecert_agents.transfer.apply import transfer
from cachecert_agents.transfer.features import sender_features
from cachecert_agents.transfer.mappers import RidgeMapper

INSTRUCTION = "Summarise the text above in one sentence."


def transfer_cost(sender: ModelHandle, receiver: ModelHandle, mapper: RidgeMapper, splits: list[int],
                  context_tokens: list[int], repeats: int = 3, recompute: tuple[int, ...] = (),
                  recompute_splits: list[int] | None = None) -> list[dict]:
    """Rows per context length and method: each split, and the splits in ``recompute_splits`` (default: see
    :func:`~cachecert_agents.eval.transfer_eval.method_variants`) repaired by selective recompute of every
    percentage in ``recompute`` (``...+rP``; its suffix pass over the instruction is charged)."""
    rows = []
    for n in context_tokens:
        context = context_of_tokens(receiver, n)
        r_prompt = receiver.format_prompt(context, INSTRUCTION)
        feats = sender_features(sender, sender.format_prompt(context, INSTRUCTION))
        prefix = receiver.prefill(r_prompt.prefix_ids).cache
        variants = method_variants(splits, recompute, receiver.geometry.num_layers, recompute_splits)
        prefill: list[float] = []
        times: list[list[float]] = [[] for _ in variants]
        for _ in range(repeats):  # interleaved: a change of load during the run lands on both sides of a ratio
            cache = copy.deepcopy(prefix)
            t0 = time.perf_counter()
            receiver.forward(r_prompt.context_ids, cache, logits_to_keep=1)
            prefill.append(time.perf_counter() - t0)
            for (s, pct), spent in zip(variants, times):
                spent.append(transfer(receiver, r_prompt, feats, mapper, s, prefix_cache=prefix,
                                      recompute=(pct or 0) / 100).transfer_s)
        prefill_med = statistics.median(prefill)
        for (s, pct), spent in zip(variants, times):
            med = statistics.median(spent)
            rows.append({"sender": sender.name, "receiver": receiver.name,
                         "context_tokens": int(r_prompt.context_ids.numel()),
                         "split": s, "num_layers": receiver.geometry.num_layers,
                         "method": method_name(s, receiver.geometry.num_layers, mapper.header.get("hidden_width"),
                                               mapper.anchor, pct),
                         "prefill_s_median": prefill_med, "transfer_s_median": med,
                         "ratio": med / prefill_med, "repeats": repeats})
    return rows

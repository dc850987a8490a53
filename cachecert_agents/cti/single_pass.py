"""Everything the CTI needs from one pass over the calibration contexts (what ``cachecert bench cti-cost`` times).

The index reads three things (docs/cti.md): the pair's second moments (:mod:`cachecert_agents.transfer.statistics`),
the receiver's query moments and attention concentration (:mod:`cachecert_agents.cti.queries`) and, for split
layers, the propagation of the stream error through the receiver (:mod:`cachecert_agents.cti.propagation`). Run
separately they cost three receiver prefills per context. Here the statistics pass records the receiver's queries
as well, and keeps the clean targets of the first ``propagation_contexts`` contexts, so the propagation runs only
its perturbed prefills (which start at the split layer). The results equal the separate passes' on the same
contexts (tested).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from cachecert_agents.cti.index import stream_residuals
from cachecert_agents.cti.propagation import propagated_error_moments
from cachecert_agents.cti.queries import QueryAccumulator, QueryStatistics
from cachecert_agents.models.handle import ModelHandle
from cachecert_agents.transfer.calibrate import add_context, pair_header
from cachecert_agents.transfer.statistics import PairStatistics


@dataclass
class CTIInputs:
    """The index's inputs for one pair, and the seconds each part took (``pass_s``: both models over every
    context, moments and query sums included; ``propagation_s``: the perturbed receiver prefills)."""

    statistics: PairStatistics
    queries: QueryStatistics
    propagated: dict[int, dict[int, torch.Tensor]] | None
    seconds: dict[str, float] = field(default_factory=dict)


@torch.inference_mode()
def cti_inputs(sender: ModelHandle, receiver: ModelHandle, contexts: Sequence[tuple[str, str]], splits: list[int],
               workload: str = "", propagation_contexts: int = 2, header: dict | None = None,
               progress: bool = True, gcv: bool = True) -> CTIInputs:
    """Statistics (``kv:l`` for every receiver layer, ``hidden:s`` for ``splits``), query statistics and the
    propagated split errors over ``contexts`` in one pass (see the module docstring); ``propagation_contexts = 0``
    or no split leaves ``propagated`` None (the first-order split model). ``gcv``: the stream error propagated is
    the GCV-inflated residual (:func:`~cachecert_agents.cti.index.stream_residuals`), as the index's default."""
    if not contexts:
        raise ValueError("no calibration contexts given")
    L = receiver.geometry.num_layers
    splits = sorted({s for s in splits if 0 < s < L})
    stats = PairStatistics.empty(header or pair_header(sender, receiver, workload=workload,
                                                       n_calibration_contexts=len(contexts)))
    queries = QueryAccumulator(receiver)
    kept = []
    t0 = time.perf_counter()
    for i, (context, instruction) in enumerate(tqdm(contexts, desc=f"CTI pass {sender.name}->{receiver.name}",
                                                    unit="ctx", disable=not progress)):
        targets = add_context(stats, sender, receiver, context, instruction, splits, queries=True)
        end = targets.qk.key(0).shape[2]  # the capture holds prefix + context; the targets the context
        queries.add(targets.qk, end - targets.kv[0].shape[0], end)
        targets.qk = None  # the recorded queries are summed; drop them
        if i < propagation_contexts:
            kept.append(targets)
    stats.header["n_contexts"] = len(contexts)
    seconds = {"pass_s": time.perf_counter() - t0}
    stats.header["collect_s"] = seconds["pass_s"]
    propagated = None
    if kept and splits:
        propagated, _, seconds["propagation_s"] = propagated_error_moments(
            receiver, contexts[:len(kept)], stream_residuals(stats, gcv=gcv), clean=kept, progress=progress)
    return CTIInputs(stats, queries.result(workload), propagated, seconds)

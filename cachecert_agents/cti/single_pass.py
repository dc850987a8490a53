"""Everything the CTI needs from one pass over the calibration contexts (what ``cachecert bench cti-cost`` times).

The index reads three things (docs/cti.md): the pair's second moments (:mod:`cachecert_agents.transfer.statistics`),
the receiver's query moments and attention concentration (:mod:`cachecert_agents.cti.queries`) and, for split
layers, the propagation of the stream error through the receiver (:mod:`cachecert_agents.cti.propagation`). Run
separately they cost three receiver prefills per context. Here the statistics pass records the receiver's queries
as well, and keeps the clean targets of the first ``propagation_contexts`` contexts, so the propagation runs only
its perturbed prefills (which start at the split layer). The results equal the separate passes' on the same
contexts (tested).

Given continuations (the reference answers' tokens, :func:`cachecert_agents.eval.receiver_floor.reference_continuations`),
the receiver's prefill of a context also reads the rest of the prompt and the answer teacher-forced, so the
with-context half of the receiver's likelihood floor costs a few tokens more instead of a prefill of its own.
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
    context, moments and query sums included; ``propagation_s``: the perturbed receiver prefills).
    ``continuation_nll``: the mean NLL (nats per token) of each continuation given, in context order."""

    statistics: PairStatistics
    queries: QueryStatistics
    propagated: dict[int, dict[int, torch.Tensor]] | None
    seconds: dict[str, float] = field(default_factory=dict)
    continuation_nll: list[float] = field(default_factory=list)


@torch.inference_mode()
def cti_inputs(sender: ModelHandle, receiver: ModelHandle, contexts: Sequence[tuple[str, str]], splits: list[int],
               workload: str = "", propagation_contexts: int = 2, header: dict | None = None,
               progress: bool = True, gcv: bool = True, continuations: Sequence[torch.Tensor] = ()) -> CTIInputs:
    """Statistics (``kv:l`` for every receiver layer, ``hidden:s`` for ``splits``), query statistics and the
    propagated split errors over ``contexts`` in one pass (see the module docstring); ``propagation_contexts = 0``
    or no split leaves ``propagated`` None (the first-order split model). ``gcv``: the stream error propagated is
    the GCV-inflated residual (:func:`~cachecert_agents.cti.index.stream_residuals`), as the index's default.
    ``continuations``: token ids ``[m]`` read after the receiver's prompt of each of the first contexts (at most
    one per context); their NLLs come back in ``continuation_nll``."""
    if not contexts:
        raise ValueError("no calibration contexts given")
    if len(continuations) > len(contexts):
        raise ValueError(f"{len(continuations)} continuations for {len(contexts)} contexts")
    L = receiver.geometry.num_layers
    splits = sorted({s for s in splits if 0 < s < L})
    stats = PairStatistics.empty(header or pair_header(sender, receiver, workload=workload,
                                                       n_calibration_contexts=len(contexts)))
    queries = QueryAccumulator(receiver)
    kept, nlls = [], []
    t0 = time.perf_counter()
    for i, (context, instruction) in enumerate(tqdm(contexts, desc=f"CTI pass {sender.name}->{receiver.name}",
                                                    unit="ctx", disable=not progress)):
        targets = add_context(stats, sender, receiver, context, instruction, splits, queries=True,
                              continuation=continuations[i] if i < len(continuations) else None)
        queries.add(targets.qk, *targets.context_span)
        targets.qk = None  # the recorded queries are summed; drop them
        if targets.continuation_nll is not None:
            nlls.append(targets.continuation_nll)
        if i < propagation_contexts:
            kept.append(targets)
    stats.header["n_contexts"] = len(contexts)
    seconds = {"pass_s": time.perf_counter() - t0}
    stats.header["collect_s"] = seconds["pass_s"]
    propagated = None
    if kept and splits:
        propagated, _, seconds["propagation_s"] = propagated_error_moments(
            receiver, contexts[:len(kept)], stream_residuals(stats, gcv=gcv), clean=kept, progress=progress)
    return CTIInputs(stats, queries.result(workload), propagated, seconds, nlls)

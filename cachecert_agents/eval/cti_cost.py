"""``cachecert bench cti-cost``: what the index costs against what it replaces, measured in one run.

Two routes to "how well does this pair transfer?", both from scratch (nothing read from the user cache), on the
same loaded models and workload:

- **CTI**: one pass of both models over ``K`` calibration contexts (the pair's statistics and the receiver's query
  statistics together, :func:`cachecert_agents.cti.single_pass.cti_inputs`), the perturbed receiver prefills of
  the split model's propagation and the index arithmetic (:mod:`cachecert_agents.cti`);
- **mapper + retention**: the statistics the mapper is fitted on (``M`` calibration contexts plus held-out ones),
  the fit, and the retention evaluation (receiver full prefill and generation, then each transfer method and its
  generation) on ``E`` evaluation examples, the work ``cachecert eval transfer`` does without its controls.

With ``floor_examples`` the CTI route also measures the receiver's likelihood floor, what ``cachecert cti
--floor-examples`` adds to predict retention rather than rank transfer quality: the single pass reads the first
examples' reference answers after their contexts (its time includes them), the floor then reads every answer
without the context and the rest with it; both ratios, with and without the floor, are reported.

Each part is timed with ``time.perf_counter``. The evaluation's cost grows linearly with the number of examples a
retention figure needs, so the ratio is reported for the ``E`` examples measured and extrapolated (per-example
mean x N) to the example counts of the retention table; the report says which is which.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from cachecert_agents.cti.index import compute_cti
from cachecert_agents.cti.single_pass import CTIInputs, cti_inputs
from cachecert_agents.eval.receiver_floor import likelihood_floor, reference_continuations, require_references
from cachecert_agents.eval.transfer_eval import evaluate_transfer
from cachecert_agents.eval.workloads import Workload
from cachecert_agents.models.handle import ModelHandle
from cachecert_agents.transfer.calibrate import collect_statistics, pair_header
from cachecert_agents.transfer.mappers import RidgeMapper


def _timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def _cti_route(sender: ModelHandle, receiver: ModelHandle, workload: Workload, pairs: list[tuple[str, str]],
               splits: list[int], header: dict, statistics_contexts: int, propagation_contexts: int,
               readers: list) -> tuple[dict[str, Any], CTIInputs]:
    """One timed CTI route on the first ``statistics_contexts`` contexts (single pass, reading ``readers``'
    reference answers, then the index): its report entry and the single pass's inputs."""
    inputs, pass_s = _timed(cti_inputs, sender, receiver, pairs[:statistics_contexts], splits, workload.name,
                            propagation_contexts, dict(header, n_calibration_contexts=statistics_contexts),
                            continuations=reference_continuations(receiver, readers))
    index, index_s = _timed(compute_cti, inputs.statistics, inputs.queries, receiver, propagated=inputs.propagated)
    return {"statistics_contexts": statistics_contexts, "statistics_tokens": inputs.statistics.n_tokens,
            "propagation_contexts": propagation_contexts, "single_pass_s": inputs.seconds["pass_s"],
            "propagation_pass_s": inputs.seconds.get("propagation_s", 0.0), "index_s": index_s,
            "total_s": pass_s + index_s, "index": index["cti"],
            "split_cti": {s: v["cti"] for s, v in index["splits"].items()}}, inputs


def cti_cost(sender: ModelHandle, receiver: ModelHandle, workload: Workload, splits: list[int],
             statistics_contexts: int = 4, propagation_contexts: int = 2,
             mapper_contexts: int = 20, heldout_contexts: int = 4, eval_examples: int = 4,
             extrapolate_to: tuple[int, ...] = (31, 100), floor_examples: int = 0,
             also_contexts: tuple[int, ...] = ()) -> dict[str, Any]:
    """Both routes' times (seconds) and their ratios; see the module docstring. ``splits`` are the split layers
    (below the receiver's depth) whose stream the statistics hold; pure KV is always evaluated too.
    ``floor_examples``: also time the receiver's likelihood floor on that many calibration examples.
    ``also_contexts``: also time the CTI route on each of these numbers of statistics contexts, against the same
    mapper route (``cti_by_contexts`` and ``ratio_by_contexts`` in the row)."""
    L = receiver.geometry.num_layers
    splits = sorted({s for s in splits if 0 < s < L})
    cal = workload.examples("calibration")
    need = max(statistics_contexts, *also_contexts, propagation_contexts, mapper_contexts + heldout_contexts)
    if len(cal) < need:
        raise ValueError(f"{workload.name} has {len(cal)} calibration examples; this benchmark needs {need}")
    if propagation_contexts > min((statistics_contexts, *also_contexts)):
        raise ValueError(f"{propagation_contexts} propagation contexts exceed the statistics pass's contexts")
    pairs = [(e.context, e.instruction) for e in cal]
    header = pair_header(sender, receiver, workload=workload.name)

    readers = require_references(workload, min(floor_examples, statistics_contexts)) if floor_examples else []
    cti, inputs = _cti_route(sender, receiver, workload, pairs, splits, header, statistics_contexts,
                             propagation_contexts, readers)
    cti_s = cti["total_s"]
    floor, floor_s = (_timed(likelihood_floor, receiver, workload, floor_examples,
                             with_context=inputs.continuation_nll) if floor_examples else (None, 0.0))
    del inputs  # free the primary pass's moments before the next
    others = {str(k): _cti_route(sender, receiver, workload, pairs, splits, header, k, propagation_contexts, [])[0]
              for k in also_contexts}

    mapper_header = dict(header, n_calibration_contexts=mapper_contexts)
    mapper_stats, mapper_stats_s = _timed(collect_statistics, sender, receiver, pairs[:mapper_contexts], splits,
                                          mapper_header, total=mapper_contexts)
    heldout, heldout_s = _timed(collect_statistics, sender, receiver,
                                pairs[mapper_contexts:mapper_contexts + heldout_contexts], splits, mapper_header,
                                total=heldout_contexts)
    mapper, fit_s = _timed(RidgeMapper.fit, mapper_stats, heldout)
    with tempfile.TemporaryDirectory() as tmp:  # a fresh results folder: nothing cached is reused
        _, eval_s = _timed(evaluate_transfer, sender, receiver, workload, mapper, splits + [L], eval_examples,
                           Path(tmp), controls=False)
    per_example = eval_s / eval_examples
    mapper_route = mapper_stats_s + heldout_s + fit_s

    def ratios_for(seconds: float) -> dict[str, float]:
        return ({str(eval_examples): seconds / (mapper_route + eval_s)}
                | {str(n): seconds / (mapper_route + n * per_example) for n in extrapolate_to})

    ratios = ratios_for(cti_s)
    extra: dict[str, Any] = {}
    if floor is not None:
        extra = {
            "floor": {"examples": floor_examples, "from_pass": floor["n_from_pass"], "floor_s": floor_s,
                      "floor": floor["floor"], "total_with_floor_s": cti_s + floor_s},
            "ratio_cti_with_floor_to_mapper_route": ratios_for(cti_s + floor_s)}
    if others:
        extra |= {"cti_by_contexts": others,
                  "ratio_by_contexts": {k: ratios_for(v["total_s"]) for k, v in others.items()}}
    return {
        "sender": sender.name, "receiver": receiver.name, "workload": workload.name, "splits": splits,
        "cti": cti,
        "mapper_route": {"mapper_contexts": mapper_contexts, "heldout_contexts": heldout_contexts,
                         "statistics_tokens": mapper_stats.n_tokens, "statistics_pass_s": mapper_stats_s,
                         "heldout_pass_s": heldout_s, "fit_s": fit_s, "eval_examples": eval_examples,
                         "eval_s": eval_s, "eval_s_per_example": per_example,
                         "methods_evaluated": len(splits) + 1},
        "ratio_cti_to_mapper_route": ratios,
        **extra,
        "ratio_note": f"measured for {eval_examples} evaluation examples; the others extrapolate the measured "
                      f"per-example evaluation time linearly",
    }

"""``cachecert bench cti-cost``: what the index costs against what it replaces, measured in one run.

Two routes to "how well does this pair transfer?", both from scratch (nothing read from the user cache), on the
same loaded models and workload:

- **CTI**: one pass of both models over ``K`` calibration contexts (the pair's statistics and the receiver's query
  statistics together, :func:`cachecert_agents.cti.single_pass.cti_inputs`), the perturbed receiver prefills of
  the split model's propagation and the index arithmetic (:mod:`cachecert_agents.cti`);
- **mapper + retention**: the statistics the mapper is fitted on (``M`` calibration contexts plus held-out ones),
  the fit, and the retention evaluation (receiver full prefill and generation, then each transfer method and its
  generation) on ``E`` evaluation examples, the work ``cachecert eval transfer`` does without its controls.

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
from cachecert_agents.cti.single_pass import cti_inputs
from cachecert_agents.eval.transfer_eval import evaluate_transfer
from cachecert_agents.eval.workloads import Workload
from cachecert_agents.models.handle import ModelHandle
from cachecert_agents.transfer.calibrate import collect_statistics, pair_header
from cachecert_agents.transfer.mappers import RidgeMapper


def _timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def cti_cost(sender: ModelHandle, receiver: ModelHandle, workload: Workload, splits: list[int],
             statistics_contexts: int = 4, propagation_contexts: int = 2,
             mapper_contexts: int = 20, heldout_contexts: int = 4, eval_examples: int = 4,
             extrapolate_to: tuple[int, ...] = (31, 100)) -> dict[str, Any]:
    """Both routes' times (seconds) and their ratios; see the module docstring. ``splits`` are the split layers
    (below the receiver's depth) whose stream the statistics hold; pure KV is always evaluated too."""
    L = receiver.geometry.num_layers
    splits = sorted({s for s in splits if 0 < s < L})
    cal = workload.examples("calibration")
    need = max(statistics_contexts, propagation_contexts, mapper_contexts + heldout_contexts)
    if len(cal) < need:
        raise ValueError(f"{workload.name} has {len(cal)} calibration examples; this benchmark needs {need}")
    pairs = [(e.context, e.instruction) for e in cal]
    header = pair_header(sender, receiver, workload=workload.name)

    inputs, cti_pass_s = _timed(cti_inputs, sender, receiver, pairs[:statistics_contexts], splits, workload.name,
                                propagation_contexts, dict(header, n_calibration_contexts=statistics_contexts))
    stats = inputs.statistics
    index, index_s = _timed(compute_cti, stats, inputs.queries, receiver, propagated=inputs.propagated)
    cti_s = cti_pass_s + index_s

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
    ratios = {str(eval_examples): cti_s / (mapper_route + eval_s)}
    ratios |= {str(n): cti_s / (mapper_route + n * per_example) for n in extrapolate_to}
    return {
        "sender": sender.name, "receiver": receiver.name, "workload": workload.name, "splits": splits,
        "cti": {"statistics_contexts": statistics_contexts, "statistics_tokens": stats.n_tokens,
                "propagation_contexts": propagation_contexts, "single_pass_s": inputs.seconds["pass_s"],
                "propagation_pass_s": inputs.seconds.get("propagation_s", 0.0), "index_s": index_s,
                "total_s": cti_s, "index": index["cti"],
                "split_cti": {s: v["cti"] for s, v in index["splits"].items()}},
        "mapper_route": {"mapper_contexts": mapper_contexts, "heldout_contexts": heldout_contexts,
                         "statistics_tokens": mapper_stats.n_tokens, "statistics_pass_s": mapper_stats_s,
                         "heldout_pass_s": heldout_s, "fit_s": fit_s, "eval_examples": eval_examples,
                         "eval_s": eval_s, "eval_s_per_example": per_example,
                         "methods_evaluated": len(splits) + 1},
        "ratio_cti_to_mapper_route": ratios,
        "ratio_note": f"measured for {eval_examples} evaluation examples; the others extrapolate the measured "
                      f"per-example evaluation time linearly",
    }

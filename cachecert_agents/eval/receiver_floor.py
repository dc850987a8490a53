"""The receiver's no-context floor: how well it answers a workload without the shared context.

Retention (``score_transfer / score_full``) of a transfer that carries nothing is ``score_no_context /
score_full``, the *floor*; retention decomposes as ``floor + (1 - floor) * context_gain``
(:func:`cachecert_agents.eval.cti_eval.context_gain`). The floor belongs to the receiver and the workload alone: no
sender or mapper runs, and one measurement serves every sender into that receiver. It is measured here on the
workload's **calibration** split, so it shares no question (and no noise) with the retention it is compared with,
which is measured on the evaluation split (``benchmarks/cti_floor.py``).

Two measurements: :func:`receiver_floor` generates both answers and scores them (task-score units, the
definition above); :func:`likelihood_floor` generates nothing: the receiver reads the reference answer
teacher-forced after either prompt, and the geometric-mean probability of its tokens stands in for the score
(``benchmarks/cti_likelihood_floor.py`` ranks retention with it; docs/cti.md, thirty-fifth session).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from cachecert_agents.eval.transfer_eval import current_records, record_settings
from cachecert_agents.eval.workloads import Workload
from cachecert_agents.jsonl import append_jsonl, read_jsonl
from cachecert_agents.models.handle import ModelHandle, PromptSegments
from cachecert_agents.transfer.features import continuation_nll

logger = logging.getLogger(__name__)


def floor_records_path(results_dir: Path, receiver: str, workload: str) -> Path:
    """Per-example records of :func:`receiver_floor` (JSONL, resumable)."""
    return results_dir / "floor" / f"{receiver}__{workload}.jsonl"


def receiver_floor(receiver: ModelHandle, workload: Workload, n: int, results_dir: Path,
                   progress: bool = True) -> dict[str, Any]:
    """Answer the first ``n`` calibration examples of ``workload`` twice with ``receiver``, with its full prefill
    of the context and with the instruction alone, and return the floor ``mean no-context score / mean full
    score`` (task-score units: token F1 or ROUGE-L) with both means, ``n`` and the receiver's weights fingerprint.

    Resumes from the records at :func:`floor_records_path` (records made with other weights, data or generation
    settings are redone). Raises ``ValueError`` when the workload has no calibration example or the full-prefill
    answers score zero on every example (the floor is then undefined)."""
    examples = workload.examples("calibration")[:n]
    if not examples:
        raise ValueError(f"{workload.name} has no calibration example to measure the floor on")
    path = floor_records_path(results_dir, receiver.name, workload.name)
    settings = {ex.id: record_settings(workload, ex, receiver) for ex in examples}
    kept, stale = current_records(read_jsonl(path), settings)
    if stale:
        logger.warning("%s: %d record(s) were made with other weights, data or settings; they are redone", path,
                       stale)
    done = {(r["id"], r["method"]): r for r in kept}
    gen_kw = dict(max_new_tokens=workload.max_new_tokens, stop_strings=workload.stop_strings)
    for ex in tqdm(examples, desc=f"floor {receiver.name} {workload.name}", disable=not progress):
        for method, context in (("full", ex.context), ("no-context", "")):
            if (ex.id, method) in done:
                continue
            answer = receiver.generate(receiver.format_prompt(context, ex.instruction).input_ids, **gen_kw).text
            rec = {"id": ex.id, "receiver": receiver.name, "workload": workload.name, "method": method,
                   "answer": answer, "score": workload.score(answer, ex.references), "settings": settings[ex.id]}
            append_jsonl(path, rec)
            done[(ex.id, method)] = rec
    full = [done[(ex.id, "full")]["score"] for ex in examples]
    no_context = [done[(ex.id, "no-context")]["score"] for ex in examples]
    if sum(full) <= 0:
        raise ValueError(f"{receiver.name} scores 0 with the full context on all {len(examples)} calibration "
                         f"examples of {workload.name}: the floor is undefined")
    return {"receiver": receiver.name, "workload": workload.name, "subset": "calibration", "measure": "generation",
            "n": len(examples), "score_full": sum(full) / len(full), "score_no_context": sum(no_context) / len(no_context),
            "floor": sum(no_context) / sum(full), "receiver_weights": receiver.weights_fingerprint}


def answer_token_ids(receiver: ModelHandle, prompt: PromptSegments, answer: str) -> torch.Tensor:
    """``[m]`` token ids of ``answer`` as read after ``prompt`` (a space goes before it when the prompt does not
    end in whitespace, e.g. a base model's ``Answer:``). ``ValueError`` when the answer has no tokens."""
    tail = receiver.tokenizer.decode(prompt.suffix_ids[-1:]) if prompt.suffix_ids.numel() else ""
    sep = "" if tail[-1:].isspace() else " "
    ids = torch.tensor(receiver.tokenizer(sep + answer, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError(f"the answer {answer!r} has no tokens")
    return ids


@torch.inference_mode()
def answer_nll(receiver: ModelHandle, context: str, instruction: str, answer: str) -> float:
    """Mean negative log-likelihood (nats per token) of ``answer`` teacher-forced after the receiver's prompt of
    ``context`` and ``instruction`` (one forward; tokens as :func:`answer_token_ids`)."""
    prompt = receiver.format_prompt(context, instruction)
    answer_ids = answer_token_ids(receiver, prompt, answer)
    out = receiver.forward(torch.cat([prompt.input_ids, answer_ids]), logits_to_keep=answer_ids.numel() + 1)
    return continuation_nll(out.logits, answer_ids)


def reference_continuations(receiver: ModelHandle, examples: list) -> list[torch.Tensor]:
    """The first reference answer of each example as :func:`answer_token_ids` after its full prompt: what the
    CTI's statistics pass reads teacher-forced (:func:`cachecert_agents.cti.single_pass.cti_inputs`) to give
    :func:`likelihood_floor` its with-context NLLs (``with_context``) at no prefill of their own."""
    return [answer_token_ids(receiver, receiver.format_prompt(ex.context, ex.instruction), ex.references[0])
            for ex in examples]


def mean_answer_probability(nlls: list[float]) -> float:
    """Mean over examples of ``exp(-nll)``, the geometric-mean probability of each answer's tokens: the likelihood
    floor's stand-in for a task score (its ratio without / with the context is the floor)."""
    return sum(math.exp(-x) for x in nlls) / len(nlls)


def require_references(workload: Workload, n: int) -> list:
    """The first ``n`` calibration examples of ``workload``, each with a non-empty first reference answer (what
    :func:`likelihood_floor` reads); ``ValueError`` naming the examples otherwise, or when ``n < 1`` or there are
    none. Cheap: callers check it before loading a model."""
    if n < 1:
        raise ValueError(f"the likelihood floor needs at least 1 calibration example, not {n}")
    examples = workload.examples("calibration")[:n]
    if not examples:
        raise ValueError(f"{workload.name} has no calibration example to measure the floor on")
    missing = [ex.id for ex in examples if not ex.references or not ex.references[0].strip()]
    if missing:
        raise ValueError(f"{workload.name}: calibration example(s) {missing[:5]} have no reference answer to read; "
                         "the likelihood floor needs one per example (the generation floor, `cachecert eval floor "
                         "--measure generation`, needs none)")
    return examples


def likelihood_floor(receiver: ModelHandle, workload: Workload, n: int, progress: bool = True,
                     earlier: dict[str, Any] | None = None, with_context: Sequence[float] = ()) -> dict[str, Any]:
    """The floor without generation, on the first ``n`` calibration examples of ``workload``: ``floor = mean
    p_no_context / mean p_full`` with ``p = exp(-answer_nll)`` of the first reference (the geometric-mean
    probability of its tokens) after the full prompt and after the instruction alone. Returns the row with both
    means, the per-example NLLs and their example ids, and the receiver's weights fingerprint.

    ``earlier``: a row of this function on the first of the same examples; its per-example NLLs are kept and only
    the examples it lacks are measured (growing a floor). ``with_context``: the with-context NLLs of the first
    examples, already read by the CTI's statistics pass (:func:`reference_continuations`); only their no-context
    NLLs are measured (``n_from_pass`` in the row counts them). ``ValueError`` when the earlier row's ids are not
    the workload's first calibration examples, as :func:`require_references`, on a non-finite NLL, or when the
    full-context probability underflows to 0 everywhere."""
    examples = require_references(workload, n)
    full = list(earlier["nll_full"]) if earlier else []
    first_new = len(full)
    none = list(earlier["nll_no_context"]) if earlier else []
    if earlier and earlier["ids"] != [ex.id for ex in examples[:len(earlier["ids"])]]:
        raise ValueError(f"{receiver.name} {workload.name}: the earlier floor's examples are not the workload's first "
                         "calibration examples")
    for i, ex in enumerate(tqdm(examples[len(full):], desc=f"likelihood floor {receiver.name} {workload.name}",
                                disable=not progress), start=len(full)):
        full.append(with_context[i] if i < len(with_context)
                    else answer_nll(receiver, ex.context, ex.instruction, ex.references[0]))
        none.append(answer_nll(receiver, "", ex.instruction, ex.references[0]))
        if not (math.isfinite(full[-1]) and math.isfinite(none[-1])):
            raise ValueError(f"{receiver.name} gives example {ex.id} of {workload.name} a non-finite answer NLL "
                             f"({full[-1]} with the context, {none[-1]} without): its weights or logits hold NaN/inf")
    p_full, p_none = mean_answer_probability(full), mean_answer_probability(none)
    if not p_full > 0:
        raise ValueError(f"{receiver.name} gives the reference answers of {workload.name} probability 0 with the "
                         f"full context on all {len(full)} calibration examples: the floor is undefined")
    return {"receiver": receiver.name, "workload": workload.name, "subset": "calibration", "measure": "likelihood",
            "n": len(full), "p_full": p_full, "p_no_context": p_none, "floor": p_none / p_full,
            "nll_full": full, "nll_no_context": none, "ids": [ex.id for ex in examples[:len(full)]],
            "n_from_pass": max(0, min(len(with_context), len(full)) - first_new),
            "receiver_weights": receiver.weights_fingerprint}

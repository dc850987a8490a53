"""``cachecert eval transfer``: full prefill against transfer on the same examples, with controls.

Per evaluation example the receiver answers (greedy) after:

- ``full``: its own prefill of ``prefix + context`` (the reference; cached per receiver and workload);
- ``no-context``: the instruction alone (the floor: a transfer must beat it to count);
- ``split@s`` for each split layer s (``s = L``: pure KV transfer, named ``ridge-kv``): the transferred cache;
- ``sender``: the sender's own answer on its own prompt (a control: is the receiver adding anything?);
- ``random-map``: a transfer at the largest split through a random map of the same scale (a control: the
  floor for a cache that carries nothing about the context);
- ``pruned-context@P`` (with selective recompute ``+rP``): the receiver prefills only the ``P`` percent of the
  context tokens that ``+rP`` would recompute (chosen on the pure KV transfer), without any transferred
  keys/values (a control: is it the choice of tokens or the transferred rest that carries the answer?);
- ``lexical-context@P`` (with ``+rP``): the receiver prefills ``P`` percent of the context chosen without any
  cache, by the suffix's tokens found in the context (a control: does choosing the tokens need the transfer?);
- ``pruned-positions@P`` (with ``+rP``, only when asked: ``position_controls``): the tokens of
  ``pruned-context@P`` prefilled at their *original* positions, the suffix after the whole context's end, so the
  receiver sees the layout ``+rP`` gives it (the same relative distances) without the transferred rest (a control:
  is it the transferred keys/values of the other tokens, or only where the chosen ones sit, that keeps ``+rP``'s
  answers close to the receiver's own?). Sliding-window layers (Gemma 3) measure their window in cache slots, not
  positions, so on such a receiver a chosen token may see a little further back than in its own prefill.

Each record is appended to a JSONL file as soon as it exists, and a rerun skips what is done, so long runs are
resumable. :func:`summarise` turns the records into the rows of ``docs/results/transfer.json``.
"""

from __future__ import annotations

import copy
import logging
import re
import statistics
from collections import Counter
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from tqdm.auto import tqdm

from cachecert_agents.artifacts import (artifact_fingerprint, artifact_paths, json_fingerprint, keep_artifact_aside,
                                        read_artifact_header)
from cachecert_agents.cert.scores import RiskScorer, scores_are_current
from cachecert_agents.errors import CacheCertError
from cachecert_agents.eval.metrics import ratio_interval
from cachecert_agents.eval.workloads import Example, Workload
from cachecert_agents.jsonl import append_jsonl, read_jsonl
from cachecert_agents.models.handle import ModelHandle
from cachecert_agents.paths import cache_home
from cachecert_agents.transfer.apply import transfer
from cachecert_agents.transfer.calibrate import collect_statistics, pair_fingerprints, pair_header
from cachecert_agents.transfer.features import prefill_with_features, sender_features
from cachecert_agents.transfer.mappers import RidgeMapper
from cachecert_agents.transfer.repair import choose_tokens, lexical_relevance, select_chunks
from cachecert_agents.transfer.statistics import PairStatistics

logger = logging.getLogger(__name__)


def method_name(split: int, num_layers: int, hidden_width: int | None = None, anchor: int | None = None,
                recompute: int | None = None) -> str:
    """``ridge-kv`` (``split == num_layers``), ``split@s``, ``split@s+wW`` for a residual-stream map that reads
    ``W`` sender layers, ``+aA`` for an anchored mapper (the receiver computes its layers below ``A``; see
    :func:`build_mapper`), and ``+rP`` for query-aware selective recompute of ``P`` percent of the context tokens
    (:mod:`cachecert_agents.transfer.repair`)."""
    tail = (f"+a{anchor}" if anchor is not None else "") + (f"+r{recompute}" if recompute else "")
    if split == num_layers:
        return "ridge-kv" + tail
    return f"split@{split}" + (f"+w{hidden_width}" if hidden_width else "") + tail


def method_variants(splits: list[int], recompute: tuple[int, ...] = (), num_layers: int | None = None,
                    repaired: list[int] | None = None) -> list[tuple[int, int | None]]:
    """``(split, recompute percent or None)`` of every transfer method asked for: each split as it is, then the
    splits in ``repaired`` repaired by selective recompute of every percentage in ``recompute``. By default
    (``repaired`` None) only the pure KV transfer (``num_layers``) is repaired when it is among ``splits``, every
    split otherwise: a split transfer already recomputes its upper layers, and repairing each one as well
    multiplies the work for little."""
    if repaired is None:
        repaired = [s for s in splits if s == num_layers] or list(splits)
    return [(s, None) for s in splits] + [(s, p) for s in repaired for p in recompute]


class MethodSpec(NamedTuple):
    """A transfer method's parts: split layer (``num_layers`` for pure KV, None when unknown), residual-stream
    window (None: default), anchor (None: sender features only) and selective recompute (percent of the context
    tokens, None: none)."""

    split: int | None
    hidden_width: int | None
    anchor: int | None
    recompute: int | None = None


def parse_method(method: str, num_layers: int | None = None) -> MethodSpec:
    """Inverse of :func:`method_name`; the split of ``ridge-kv`` is ``num_layers`` (None when not given). Raises
    ``ValueError`` naming the accepted forms."""
    m = re.fullmatch(r"(?:ridge-kv|split@(\d+)(?:\+w(\d+))?)(?:\+a(\d+))?(?:\+r(\d+))?", method)
    if m is None or (m.group(4) is not None and not 0 < int(m.group(4)) <= 100):
        raise ValueError(f"method must be ridge-kv, split@K or split@K+wW, each optionally +aA and/or +rP "
                         f"(P percent, 1-100), got {method!r}")
    to_int = lambda g: int(g) if g else None  # noqa: E731
    split = to_int(m.group(1)) if method.startswith("split@") else num_layers
    return MethodSpec(split, to_int(m.group(2)), to_int(m.group(3)), to_int(m.group(4)))


def artifact_stem(sender: str, receiver: str, workload: str) -> str:
    return f"{sender}__{receiver}__{workload}".replace("/", "_")


def mapper_stem(sender: str, receiver: str, workload: str, out_dir: Path | None = None,
                hidden_width: int | None = None, anchor: int | None = None) -> Path:
    """Where a pair's mapper lives (``<stem>.json/.safetensors``; its statistics at ``<stem>.stats.*``); a mapper
    with a wider residual-stream window or an anchor has its own (``<stem>__w<W>``, ``<stem>__a<A>``)."""
    stem = (artifact_stem(sender, receiver, workload) + (f"__w{hidden_width}" if hidden_width else "")
            + (f"__a{anchor}" if anchor is not None else ""))
    return (out_dir or cache_home() / "mappers") / stem


DEFAULT_CALIBRATION_CONTEXTS = 32
"""Calibration contexts of a mapper :func:`build_mapper` fits when none is cached and no size is asked for."""


def recorded_mapper_contexts(records: list[dict], stem: str | Path) -> int | None:
    """The calibration contexts (``n_calibration_contexts``) of the saved mapper at ``stem`` when every record that
    names a mapper (``mapper_sha256``) names this one; None when the mapper is not saved there, a record names
    another, or no record names any. Reads the JSON header only (no tensors)."""
    named = {r["mapper_sha256"] for r in records if r.get("mapper_sha256")}
    if not named or not artifact_paths(stem)[1].exists():
        return None
    header = read_artifact_header(stem)
    return header.get("n_calibration_contexts") if named == {header.get("tensors_sha256")} else None


def calibration_fingerprint(workload: Workload, n_contexts: int) -> str:
    """sha256 (16 hex) of the calibration text a mapper of ``n_contexts`` contexts is fitted on (the held-out
    ones after them only tune it, and callers hold out different numbers): recorded in the mapper
    (``calibration_sha256``) and in the CTI's statistics, so an artifact whose workload's calibration contexts
    have changed since (other data, another context construction) is rebuilt rather than reused."""
    cal = workload.examples("calibration")[:n_contexts]
    return json_fingerprint([[e.context, e.instruction] for e in cal])


def reusable_statistics(stem: str | Path, expect: dict, header: dict, wanted: set[str], n_contexts: int
                        ) -> PairStatistics | None:
    """The statistics saved at ``stem`` when they are exactly those :func:`build_mapper` is about to collect (same
    pair and weights, calibration text, context count, residual-stream width, anchor and targets), else None.

    The statistics pass is most of a mapper's cost (about 25 minutes through the 1.5B sender), and they are saved
    before the held-out pass and the fit: a run stopped in between (killed, out of memory) resumes from them
    instead of collecting them again. Unreadable or mismatched statistics are logged and collected anew (the
    earlier files are then kept aside, never overwritten)."""
    if not artifact_paths(stem)[1].exists():
        return None
    try:  # the JSON header first: mismatched statistics (gigabytes of tensors) are not read at all
        saved = read_artifact_header(stem)
        same = {k: (saved.get(k), header.get(k)) for k in ("calibration_sha256", "hidden_width", "anchor")}
        same["n_contexts"] = (saved.get("n_contexts"), n_contexts)
        same["targets"] = (set(saved.get("targets", {})), wanted)
        differ = sorted(k for k, (found, asked) in same.items() if found != asked)
        if differ:
            logger.info("statistics %s differ from those asked for in %s; collecting them again", stem,
                        ", ".join(differ))
            return None
        stats = PairStatistics.load(stem, expect=expect)
    except (ValueError, OSError, KeyError) as exc:
        logger.info("statistics %s are not reusable (%s); collecting them again", stem, exc)
        return None
    logger.info("reusing statistics %s (%d contexts, %d receiver tokens) saved by an earlier run", stem,
                stats.header["n_contexts"], stats.n_tokens)
    return stats


def build_mapper(sender: ModelHandle, receiver: ModelHandle, workload: Workload, splits: list[int],
                 n_contexts: int | None, n_heldout: int = 4, out_dir: Path | None = None, force: bool = False,
                 hidden_width: int | None = None, anchor: int | None = None) -> RidgeMapper:
    """Load the pair's mapper from the user cache, or calibrate it on the workload's calibration split.

    ``n_contexts``: calibration contexts; a cached mapper fitted on another number is replaced (kept aside).
    ``None`` takes the cached mapper whatever its size (refitting one that lacks a split on the same number), and
    calibrates on :data:`DEFAULT_CALIBRATION_CONTEXTS` when there is none; the size used is in
    ``mapper.header["n_calibration_contexts"]``.

    ``hidden_width``: how many sender layer boundaries the residual-stream maps (``hidden:s``) read (default 3,
    like the key/value maps); such a mapper is stored apart and its transfers are named ``split@s+wW``.
    ``anchor``: an anchored mapper (:mod:`cachecert_agents.transfer.apply`), for splits above the anchor only;
    its transfers are named ``...+aA``."""
    if anchor is not None and not 0 < anchor < min(splits, default=0):
        raise ValueError(f"anchor {anchor} must be above 0 and below every split ({splits})")
    stem = mapper_stem(sender.name, receiver.name, workload.name, out_dir, hidden_width, anchor)
    header = pair_header(sender, receiver, workload=workload.name, n_calibration_contexts=n_contexts)
    if hidden_width:
        header["hidden_width"] = hidden_width
    if anchor is not None:
        header["anchor"] = anchor
    expect = pair_fingerprints(header)
    L = receiver.geometry.num_layers
    # an anchored mapper for split transfers only keeps the key/value maps those read (it is large)
    kv_until = max(splits) if anchor is not None and L not in splits else None
    wanted = ({f"hidden:{s}" for s in splits if 0 < s < L}
              | {f"kv:{layer}" for layer in range(anchor or 0, kv_until or L)})
    size = None  # the cached mapper's calibration size
    if artifact_paths(stem)[1].exists() and not force:
        mapper = RidgeMapper.load(stem, expect=expect)
        size = mapper.header.get("n_calibration_contexts")
        recorded = mapper.header.get("calibration_sha256")
        same_text = recorded is None or recorded == calibration_fingerprint(workload, size)
        if wanted <= set(mapper.header["targets"]) and n_contexts in (None, size) and same_text:
            if recorded is None:
                logger.warning("mapper %s predates the calibration-text fingerprint: whether it was fitted on the "
                               "workload's current calibration contexts cannot be checked (squad-long mappers made "
                               "before the fifteenth session were not: refit them)", stem)
            logger.info("using mapper %s (%s calibration contexts)", stem, size)
            return mapper
        logger.info("mapper %s lacks splits or calibration size asked for, or was fitted on other calibration text "
                    "(%s contexts, asked %s); recalibrating (the earlier one is kept aside)", stem, size, n_contexts)
    if n_contexts is None:
        n_contexts = header["n_calibration_contexts"] = size or DEFAULT_CALIBRATION_CONTEXTS
    cal = workload.examples("calibration")
    if len(cal) < n_contexts + n_heldout:
        raise ValueError(f"{workload.name} has {len(cal)} calibration examples; asked for {n_contexts} + "
                         f"{n_heldout} held out")
    header["calibration_sha256"] = calibration_fingerprint(workload, n_contexts)
    hidden_splits = sorted(int(t.split(":")[1]) for t in wanted if t.startswith("hidden:"))
    stats = None if force else reusable_statistics(f"{stem}.stats", expect, header, wanted, n_contexts)
    if stats is None:
        stats = collect_statistics(sender, receiver, [(e.context, e.instruction) for e in cal[:n_contexts]],
                                   hidden_splits, header, total=n_contexts, hidden_width=hidden_width,
                                   anchor=anchor, kv_until=kv_until)
        keep_artifact_aside(f"{stem}.stats")
        stats.save(f"{stem}.stats")
    heldout = collect_statistics(sender, receiver, [(e.context, e.instruction) for e in
                                                    cal[n_contexts:n_contexts + n_heldout]],
                                 hidden_splits, header, total=n_heldout, hidden_width=hidden_width, anchor=anchor,
                                 kv_until=kv_until)
    mapper = RidgeMapper.fit(stats, heldout)
    mapper.header["statistics_sha256"] = artifact_fingerprint(f"{stem}.stats")  # the risk scorer's statistics
    keep_artifact_aside(stem)
    mapper.save(stem)
    logger.info("saved mapper %s", stem)
    return mapper


def build_scorer(sender: ModelHandle, receiver: ModelHandle, workload: Workload, mapper: RidgeMapper,
                 out_dir: Path | None = None) -> RiskScorer:
    """The risk scorer of a mapper built by :func:`build_mapper` (reads the statistics saved beside it). Anchored
    mappers have no risk scores yet (the geometry score's leverage would need the anchor stream)."""
    if mapper.anchor is not None:
        raise CacheCertError("risk scores are not defined for anchored mappers (+aA methods) yet; evaluate them "
                             "with --no-scores")
    stem = mapper_stem(sender.name, receiver.name, workload.name, out_dir, mapper.header.get("hidden_width"))
    expect = pair_fingerprints(mapper.header)
    stats = load_mapper_statistics(mapper, f"{stem}.stats", expect)
    return RiskScorer.from_statistics(receiver, mapper, stats)


def load_mapper_statistics(mapper: RidgeMapper, stem: str | Path, expect: dict | None = None) -> PairStatistics:
    """The statistics a mapper was fitted from (what its risk scores read), refused when they are not the ones
    its header names (``statistics_sha256``; e.g. a calibration interrupted between saving the statistics and
    the mapper). Mappers built before the name was recorded are matched by token count only."""
    stats = PairStatistics.load(stem, expect=expect)
    recorded = mapper.header.get("statistics_sha256")
    found = stats.header.get("tensors_sha256") or artifact_fingerprint(stem)  # verified on load when recorded
    if recorded is not None and recorded != found:
        raise CacheCertError(f"statistics {stem} ({found}) are not the ones mapper {mapper.fingerprint} was fitted "
                             f"from ({recorded}); recalibrate with `cachecert calibrate`")
    if recorded is None and stats.n_tokens != mapper.header.get("fit_tokens", stats.n_tokens):
        raise CacheCertError(f"statistics {stem} hold {stats.n_tokens} tokens, but the mapper was fitted on "
                             f"{mapper.header['fit_tokens']}; recalibrate with `cachecert calibrate`")
    return stats


def full_reference_path(results_dir: Path, receiver: str, workload: str) -> Path:
    """Where the receiver's full-prefill answers on a workload are cached (shared by every sender)."""
    return results_dir / "full" / f"{receiver}__{workload}.jsonl".replace("/", "_")


def records_path(results_dir: Path, sender: str, receiver: str, workload: str) -> Path:
    """Where the per-example records of a pair on a workload are appended (JSONL)."""
    return Path(results_dir) / f"{artifact_stem(sender, receiver, workload)}.jsonl"


def recorded_pools(results_dir: Path) -> list[tuple[str, str, str]]:
    """``(sender, receiver, workload)`` of every records file in ``results_dir`` (the inverse of
    :func:`records_path`; other JSONL files there, e.g. ``diagnose__S__R__W.jsonl``, are not pools)."""
    stems = (p.name[:-len(".jsonl")].split("__") for p in Path(results_dir).glob("*__*__*.jsonl"))
    return sorted({(s[0], s[1], s[2]) for s in stems if len(s) == 3})


def record_settings(workload: Workload, example: Example, *models: ModelHandle) -> str:
    """sha256 (16 hex) of what a record's answer and score depend on besides its method: the ``models``' names
    and weights (the receiver's alone for a full-prefill record; sender and receiver for the rest), the example's
    context, instruction and references, and the workload's generation settings. Stored as the record's
    ``settings``: a resumed run redoes a record whose settings differ (records written before it was stored are
    taken as they are). The agreement criterion is not in it (it labels answers, it does not make them): each
    record names the one its ``agree`` was judged by (``agreement``), and ``eval cert --agreement`` relabels."""
    return json_fingerprint({
        "models": [[m.name, m.weights_fingerprint] for m in models],
        "example": [example.id, example.context, example.instruction, example.references],
        "workload": [workload.name, workload.max_new_tokens, list(workload.stop_strings)]})


def current_records(records: list[dict], settings: dict[str, str],
                    key: Callable[[dict], tuple] = lambda r: (r["id"], r.get("method"))) -> tuple[list[dict], int]:
    """The latest record per ``key`` (default: example and method) when its ``settings`` match ``settings[id]``
    (or it predates them, or its example is not in ``settings``), and how many latest records do not match (made
    with other weights, data or settings: redone, not resumed). The latest decides: an earlier matching record
    under a newer one made with other settings does not count as done."""
    latest = {key(r): r for r in records}
    kept = [r for r in latest.values()
            if r["id"] not in settings or r.get("settings", settings[r["id"]]) == settings[r["id"]]]
    return kept, len(latest) - len(kept)


def load_records(results_dir: Path, sender: str, receiver: str, workload: str, ids: list[str],
                 settings: dict[str, str] | None = None, full_settings: dict[str, str] | None = None
                 ) -> tuple[list[dict], list[dict]]:
    """The latest records of a pair (every method) and the receiver's full-prefill records, for the example
    ``ids`` only: the input of :func:`summarise`. With ``settings`` / ``full_settings`` (per example id, from
    :func:`record_settings`), a latest record made with other models, data or settings is left out (with a
    warning), as :func:`current_records` decides; without them every latest record is taken as it is."""
    path, full_path = records_path(results_dir, sender, receiver, workload), full_reference_path(
        results_dir, receiver, workload)
    out = []
    for file, expected in ((path, settings), (full_path, full_settings)):
        records = read_jsonl(file)
        if expected is not None:
            records, stale = current_records(records, expected)
            if stale:
                logger.warning("%s: %d latest record(s) were made with other weights, data or settings; left out",
                               file, stale)
        out.append(latest_records(records, ids))
    return out[0], out[1]


def evaluate_transfer(sender: ModelHandle, receiver: ModelHandle, workload: Workload, mapper: RidgeMapper,
                      splits: list[int], n: int, results_dir: Path, progress: bool = True,
                      scorer: RiskScorer | None = None, controls: bool = True, subset: str = "evaluation",
                      offset: int = 0, recompute: tuple[int, ...] = (), transfers: bool = True,
                      recompute_splits: list[int] | None = None, require_mapper: bool = False,
                      position_controls: bool = False) -> tuple[list[dict], list[dict]]:
    """Run (or resume) the evaluation; returns every record for this pair and workload, and the receiver's
    full-prefill records (the input of :func:`summarise`).

    With a ``scorer``, each transfer is answered through its scoring pass and the record carries ``risk``
    (every score of :mod:`cachecert_agents.cert.scores`) and its cost: these records are the labelled requests
    that certificates are calibrated on (label: ``agree`` false = unsafe). ``controls=False`` skips every control
    (no-context, sender, random-map, and the pruned-context, lexical-context and pruned-positions answers).
    ``subset`` picks the workload's ``evaluation`` (default) or ``calibration`` examples, from the ``offset``-th
    on (e.g. past those a mapper was fitted on); keep the records of different subsets in different
    ``results_dir``. ``recompute`` (percentages) adds the transfer
    repaired by query-aware selective recompute of that share of the context (``...+rP``), for the splits in
    ``recompute_splits`` (default: see :func:`method_variants`).
    ``transfers=False`` runs the controls only (e.g. to add ``pruned-context@P`` to a finished run while another
    process runs the transfers). Each transfer record names the mapper it used (``mapper_sha256``), and so does
    each pruned-context/pruned-positions record (the mapper its tokens were chosen on; ``choice_reused``: taken
    from the ``+rP`` transfer of the same pass);
    ``require_mapper`` counts a transfer as done only when it was made with this ``mapper`` (labels for a
    certificate of this mapper; by default any record resumes, e.g. one made by an identical recalibration)."""
    L = receiver.geometry.num_layers
    width, anchor = mapper.header.get("hidden_width"), mapper.anchor
    if recompute and anchor is not None:
        raise ValueError("selective recompute (+rP) is not defined for anchored mappers (+aA)")
    path = records_path(results_dir, sender.name, receiver.name, workload.name)
    full_path = full_reference_path(results_dir, receiver.name, workload.name)
    examples = workload.examples(subset)[offset:offset + n]
    settings = {ex.id: record_settings(workload, ex, sender, receiver) for ex in examples}
    full_settings = {ex.id: record_settings(workload, ex, receiver) for ex in examples}
    kept, stale = current_records(read_jsonl(path), settings)
    # full-prefill answers of these weights (records from before weights were recorded are taken as they are)
    weights = receiver.weights_fingerprint
    full_kept, full_stale = current_records(read_jsonl(full_path), full_settings)
    if stale or full_stale:
        logger.warning("%s: %d record(s) and %d full-prefill answer(s) were made with other weights, data or "
                       "settings; they are redone (the latest record of an example and method is the one used)",
                       path, stale, full_stale)
    # with a scorer, a transfer record counts as done only if it carries scores of the current definition
    done = {(r["id"], r["method"]) for r in kept
            if "split" not in r or r.get("method") == "random-map"
            or ((scorer is None or scores_are_current(r))
                and (not require_mapper or r.get("mapper_sha256") == mapper.fingerprint))}
    others = sum(1 for r in kept  # already the latest record per example and method
                 if "split" in r and r.get("method") != "random-map" and (r["id"], r["method"]) in done
                 and r.get("mapper_sha256") != mapper.fingerprint)
    if others:
        logger.warning("%s: %d transfer record(s) kept were made with another or an unrecorded mapper; they are not "
                       "redone, so rows may pool mappers (each row lists them under `mappers`)", path, others)
    full_done = {r["id"]: r for r in full_kept if r.get("receiver_weights", weights) == weights}
    prefix_cache = None
    random_mapper = mapper.randomised(seed=0)
    gen_kw = dict(max_new_tokens=workload.max_new_tokens, stop_strings=workload.stop_strings)
    variants = method_variants(splits, recompute, L, recompute_splits) if transfers else []
    pruned = [f"pruned-context@{p}" for p in recompute] if controls else []
    lexical = [f"lexical-context@{p}" for p in recompute] if controls else []
    positioned = [f"pruned-positions@{p}" for p in recompute] if controls and position_controls else []
    transfer_methods = [method_name(s, L, width, anchor, p) for s, p in variants]
    methods = (transfer_methods + (["no-context", "sender", "random-map"] if controls else []) + pruned + lexical
               + positioned)
    for ex in tqdm(examples, desc=f"eval {sender.name}->{receiver.name} {workload.name}", disable=not progress):
        if all((ex.id, m) in done for m in methods) and ex.id in full_done:
            continue
        r_prompt = receiver.format_prompt(ex.context, ex.instruction)
        if prefix_cache is None:
            prefix_cache = receiver.prefill(r_prompt.prefix_ids).cache
        # the receiver's context prefill, timed in this run (its answer is cached per receiver and workload, but
        # a time measured in another run, under another load, would make prefill_saved meaningless)
        cache = copy.deepcopy(prefix_cache)
        t0 = time.perf_counter()
        receiver.forward(r_prompt.context_ids, cache, logits_to_keep=1)
        prefill_s = time.perf_counter() - t0
        if ex.id not in full_done:
            gen = receiver.generate(r_prompt.suffix_ids, cache=cache, **gen_kw)
            rec = {"id": ex.id, "receiver": receiver.name, "receiver_weights": weights, "workload": workload.name,
                   "settings": full_settings[ex.id], "answer": gen.text,
                   "score": workload.score(gen.text, ex.references), "prefill_s": prefill_s,
                   "context_tokens": int(r_prompt.context_ids.numel())}
            append_jsonl(full_path, rec)
            full_done[ex.id] = rec
        del cache
        full = full_done[ex.id]

        def record(method: str, answer: str, **extra: Any) -> None:
            rec = {"id": ex.id, "sender": sender.name, "receiver": receiver.name, "workload": workload.name,
                   "method": method, "answer": answer, "score": workload.score(answer, ex.references),
                   "agree": workload.agree(answer, full["answer"]), "prefill_s": prefill_s,
                   "prefill_timed": "same-run", "settings": settings[ex.id], "agreement": str(workload.agreement),
                   **extra}
            append_jsonl(path, rec)
            done.add((ex.id, method))

        if controls and (ex.id, "no-context") not in done:
            nc = receiver.format_prompt("", ex.instruction)
            record("no-context", receiver.generate(nc.input_ids, **gen_kw).text)
        s_prompt = sender.format_prompt(ex.context, ex.instruction)
        feats = None
        if controls and (ex.id, "sender") not in done:
            # one sender prefill of prefix + context serves both its own answer and the transfers' features
            s_cache, feats, _ = prefill_with_features(sender, s_prompt)
            record("sender", sender.generate(s_prompt.suffix_ids, cache=s_cache, **gen_kw).text)
            del s_cache
        chosen: dict[int, tuple[torch.Tensor, float]] = {}  # percent -> the pure KV transfer's choice and its time
        for (s, pct), m in zip(variants, transfer_methods):
            if (ex.id, m) in done:
                continue
            feats = feats or sender_features(sender, s_prompt)
            result = transfer(receiver, r_prompt, feats, mapper, s, prefix_cache=prefix_cache,
                              recompute=(pct or 0) / 100)
            extra: dict[str, Any] = {}
            if scorer is None:
                gen = receiver.generate(r_prompt.suffix_ids, cache=result.cache, **gen_kw)
            else:
                risk, out, cost = scorer.scoring_pass(result.cache, r_prompt.suffix_ids, r_prompt.context_span, s,
                                                      result.features, exact=result.recomputed_index)
                gen = receiver.decode(out.cache, out.logits[-1], **gen_kw)
                extra = {"risk": risk, **cost}
            if pct:
                extra["recomputed_tokens"] = result.recomputed
                if s == L:
                    chosen[pct] = (result.recomputed_index, result.choice_s)
            record(m, gen.text, split=s, num_layers=L, transfer_s=result.transfer_s,
                   alignment=result.coverage, mapper_sha256=mapper.fingerprint, **extra)
        if controls and (ex.id, "random-map") not in done:  # control: right scale, no information, at the largest split
            feats = feats or sender_features(sender, s_prompt)
            result = transfer(receiver, r_prompt, feats, random_mapper, max(splits), prefix_cache=prefix_cache)
            gen = receiver.generate(r_prompt.suffix_ids, cache=result.cache, **gen_kw)
            record("random-map", gen.text, split=max(splits), num_layers=L, transfer_s=result.transfer_s)
        def answer_on_subset(method: str, context_ids: Any, choice_s: float, positions: Any = None,
                             **extra: Any) -> None:
            """A control's answer after the receiver prefills only ``context_ids``, at ``positions`` ``[k]`` when
            given (the suffix then sits after the whole context, as on a full cache). Its cost: ``choice_s`` (the
            seconds spent choosing the tokens) plus that prefill. ``extra`` goes into the record."""
            cache = copy.deepcopy(prefix_cache)
            t0 = time.perf_counter()
            receiver.forward(context_ids, cache, position_ids=positions, logits_to_keep=1)
            spent = choice_s + time.perf_counter() - t0
            end = r_prompt.context_span[1]
            suffix_positions = (None if positions is None
                                else torch.arange(end, end + int(r_prompt.suffix_ids.numel())))
            gen = receiver.generate(r_prompt.suffix_ids, cache=cache, position_ids=suffix_positions, **gen_kw)
            record(method, gen.text, transfer_s=spent, choice_s=choice_s, recomputed_tokens=int(context_ids.numel()),
                   **extra)

        for pct, m, mp in zip(recompute, pruned, positioned or [None] * len(pruned)):
            todo = [x for x in (m, mp) if x is not None and (ex.id, x) not in done]
            if not todo:
                continue
            # chosen on the pure KV transfer, as +rP chooses; +rP's own choice when it ran in this pass
            reused = pct in chosen
            if not reused:
                feats = feats or sender_features(sender, s_prompt)
                kv = transfer(receiver, r_prompt, feats, mapper, L, prefix_cache=prefix_cache, windowed=False)
                t0 = time.perf_counter()
                index = choose_tokens(receiver, kv.cache, r_prompt, pct / 100)
                # timed as TransferResult.choice_s: the transfer (from its own clock) until the tokens are chosen
                chosen[pct] = (index, kv.transfer_s + time.perf_counter() - t0)
            index, choice_s = chosen[pct]
            tokens = r_prompt.context_ids.reshape(-1)[index]
            provenance = {"mapper_sha256": mapper.fingerprint, "choice_reused": reused}
            if m in todo:
                answer_on_subset(m, tokens, choice_s, **provenance)
            if mp in todo:
                answer_on_subset(mp, tokens, choice_s, positions=index + r_prompt.context_span[0], **provenance)
        for pct, m in zip(recompute, lexical):  # chosen with no cache at all
            if (ex.id, m) not in done:
                t0 = time.perf_counter()
                index = select_chunks(lexical_relevance(r_prompt.context_ids, r_prompt.suffix_ids), pct / 100)
                answer_on_subset(m, r_prompt.context_ids.reshape(-1)[index], time.perf_counter() - t0)
    return load_records(results_dir, sender.name, receiver.name, workload.name, [ex.id for ex in examples],
                        settings, full_settings)


def latest_records(records: list[dict], ids: list[str]) -> list[dict]:
    """The last record per ``(id, method)`` (a redone record replaces the earlier one) for the given example
    ``ids`` only (a resumed file may hold other examples, e.g. a partly done one after an interruption)."""
    wanted = set(ids)
    latest: dict[tuple[str, str | None], dict] = {}
    for r in records:
        if r["id"] in wanted:
            latest[(r["id"], r.get("method"))] = r
    return list(latest.values())


def _control_mean(values: dict[str, float], ids: list[str]) -> float | None:
    """Mean of a control's per-example values over a row's examples ``ids``; None unless the control covers every
    one of them (a floor measured on other questions than the transfer's is not a comparison)."""
    if not ids or any(i not in values for i in ids):
        return None
    return statistics.mean(values[i] for i in ids)


def summarise(records: list[dict], full_records: list[dict]) -> list[dict]:
    """Rows of ``transfer.json``: one per (sender, receiver, workload, method). The controls (no context, the
    sender's answer, a random map) are reported on a row only when they cover all of its examples."""
    full = {r["id"]: r for r in full_records}
    by_method: dict[str, list[dict]] = {}
    for r in records:
        if r["id"] in full:
            by_method.setdefault(r["method"], []).append(r)
    controls = ("no-context", "sender", "random-map")
    scores = {m: {r["id"]: r["score"] for r in by_method.get(m, [])} for m in controls}
    no_ctx_agree = {r["id"]: 1.0 if r["agree"] else 0.0 for r in by_method.get("no-context", [])}
    rows = []
    for method, recs in sorted(by_method.items()):
        if method in controls:
            continue  # the pruned-/lexical-context@P controls get rows: their retention and cost are the comparison
        ids = [r["id"] for r in recs]
        score_full = statistics.mean(full[i]["score"] for i in ids)
        score_transfer = statistics.mean(r["score"] for r in recs)
        # each record's own prefill time (same run as its transfer; older records copied the cached reference's)
        prefill = [r.get("prefill_s", full[r["id"]]["prefill_s"]) for r in recs]
        spent = [r["transfer_s"] for r in recs]
        prefill_med, transfer_med = statistics.median(prefill), statistics.median(spent)
        spent_low, spent_high = ratio_interval(spent, prefill)  # of sum(transfer) / sum(prefill), paired
        first = recs[0]
        low, high = ratio_interval([r["score"] for r in recs], [full[i]["score"] for i in ids])
        agreement = statistics.mean(1.0 if r["agree"] else 0.0 for r in recs)
        rows.append({
            "sender": first["sender"], "receiver": first["receiver"], "workload": first["workload"],
            "method": method, "split": first.get("split"), "num_layers": first.get("num_layers"), "n": len(recs),
            "score_full": score_full, "score_transfer": score_transfer,
            "score_no_context": _control_mean(scores["no-context"], ids),
            "score_sender": _control_mean(scores["sender"], ids),
            "score_random_map": _control_mean(scores["random-map"], ids),
            "retention": score_transfer / score_full if score_full else None,
            "retention_ci95": [low, high],  # paired bootstrap over the examples
            "agreement": agreement, "unsafe_rate": 1 - agreement,
            "agreement_no_context": _control_mean(no_ctx_agree, ids),
            "prefill_saved": 1 - transfer_med / prefill_med,
            # the same, as total work over the row's examples (with a paired-bootstrap interval) and per example
            "prefill_saved_total": 1 - sum(spent) / sum(prefill),
            "prefill_saved_total_ci95": [None if spent_high is None else 1 - spent_high,
                                         None if spent_low is None else 1 - spent_low],
            "prefill_saved_median_per_example": statistics.median(1 - t / p for t, p in zip(spent, prefill)),
            # the mappers the row's transfers were made with (a resumed run may mix them): fingerprint -> count
            "mappers": dict(Counter((r.get("mapper_sha256") or "unrecorded")[:16] for r in recs)),
            "prefill_timing": "same run" if all(r.get("prefill_timed") == "same-run" for r in recs)
            else "receiver prefill from the cached full-prefill reference (another run)",
            "prefill_s_median": prefill_med, "transfer_s_median": transfer_med,
        })
    return rows


def diagnose_splits(sender: ModelHandle, receiver: ModelHandle, workload: Workload, mapper: RidgeMapper,
                    splits: list[int], n: int, results_dir: Path, progress: bool = True) -> list[dict]:
    """Where does a split transfer lose the context? For each split, answer with (a) mapped KV below the split +
    mapped residual stream at it (the method), (b) the receiver's TRUE KV below + mapped residual stream
    (``oracle-kv``), (c) mapped KV below + TRUE residual stream (``oracle-hidden``). Resumable JSONL; returns
    summary rows (score and agreement with the full-prefill answer per variant and split)."""
    from cachecert_agents.transfer.features import receiver_targets

    L = receiver.geometry.num_layers
    path = results_dir / f"diagnose__{artifact_stem(sender.name, receiver.name, workload.name)}.jsonl"
    candidates = workload.examples("evaluation")
    full_settings = {ex.id: record_settings(workload, ex, receiver) for ex in candidates}
    full_kept, _ = current_records(read_jsonl(full_reference_path(results_dir, receiver.name, workload.name)),
                                   full_settings)
    weights = receiver.weights_fingerprint
    full = {r["id"]: r for r in full_kept if r.get("receiver_weights", weights) == weights}  # the latest per id
    examples = [e for e in candidates if e.id in full][:n]
    settings = {ex.id: record_settings(workload, ex, sender, receiver) for ex in examples}
    variant_key = lambda r: (r["id"], r["variant"], r["split"])  # noqa: E731
    done = {variant_key(r) for r in current_records(read_jsonl(path), settings, variant_key)[0]}
    gen_kw = dict(max_new_tokens=workload.max_new_tokens, stop_strings=workload.stop_strings)
    prefix_cache = None
    for ex in tqdm(examples, desc=f"diagnose {sender.name}->{receiver.name}", disable=not progress):
        todo = [(v, s) for s in splits for v in ("mapped", "oracle-kv", "oracle-hidden") if (ex.id, v, s) not in done]
        if not todo:
            continue
        r_prompt = receiver.format_prompt(ex.context, ex.instruction)
        prefix_cache = prefix_cache or receiver.prefill(r_prompt.prefix_ids).cache
        feats = sender_features(sender, sender.format_prompt(ex.context, ex.instruction))
        truth = receiver_targets(receiver, r_prompt, [s for s in splits if s < L])
        for variant, s in todo:
            oracle = None if variant == "mapped" else variant.split("-")[1]
            result = transfer(receiver, r_prompt, feats, mapper, s, prefix_cache=prefix_cache,
                              true_targets=truth, oracle=oracle)
            answer = receiver.generate(r_prompt.suffix_ids, cache=result.cache, **gen_kw).text
            append_jsonl(path, {"id": ex.id, "variant": variant, "split": s, "answer": answer,
                                 "score": workload.score(answer, ex.references),
                                 "agree": workload.agree(answer, full[ex.id]["answer"]),
                                 "settings": settings[ex.id], "agreement": str(workload.agreement)})
    rows = []
    records = [r for r in current_records(read_jsonl(path), settings, variant_key)[0] if r["id"] in settings]
    for s in splits:
        for variant in ("mapped", "oracle-kv", "oracle-hidden"):
            recs = [r for r in records if r["split"] == s and r["variant"] == variant]
            if recs:
                rows.append({"sender": sender.name, "receiver": receiver.name, "workload": workload.name,
                             "split": s, "num_layers": L, "variant": variant, "n": len(recs),
                             "score_full": statistics.mean(full[r["id"]]["score"] for r in recs),
                             "score": statistics.mean(r["score"] for r in recs),
                             "agreement": statistics.mean(1.0 if r["agree"] else 0.0 for r in recs)})
    return rows

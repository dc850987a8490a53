"""Evaluation workloads on the real data in ``../shared/data`` (found by walking up from the repository root,
skipped where it is absent) and on small malformed files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachecert_agents.eval.workloads import (
    DATA_ENV,
    WORKLOADS,
    DataFormatError,
    DataNotFoundError,
    Workload,
    assign_split,
    get_workload,
    resolve_data_dir,
)
from cachecert_agents.errors import CacheCertError

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def real() -> dict[str, Workload]:
    """Every workload built with ``data=None`` from the repository root (examples loaded once, then cached)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(DATA_ENV, raising=False)
        mp.chdir(REPO_ROOT)
        try:
            for sub in ("hotpotqa", "musique", "squad", "freshwiki"):
                resolve_data_dir(None, sub)
        except DataNotFoundError as exc:
            pytest.skip(f"real evaluation data not available: {exc}")
        workloads = {name: get_workload(name) for name in WORKLOADS}
        for w in workloads.values():
            w.examples()
    return workloads


def _raw(workload: Workload):
    return json.loads(Path(workload.source).read_text())


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_real_examples_load(real, name):
    w = real[name]
    examples = w.examples()
    assert examples and all(ex.workload == name for ex in examples)
    ids = [ex.id for ex in examples]
    assert len(set(ids)) == len(ids)
    assert all(ex.context.strip() and ex.instruction.strip() and ex.references for ex in examples)
    assert all(ref.strip() for ex in examples for ref in ex.references)
    cal, ev = w.examples("calibration"), w.examples("evaluation")
    assert cal and ev and len(cal) + len(ev) == len(examples)
    assert all(ex.split == assign_split(name, ex.id) for ex in examples)
    assert w.examples(limit=3) == examples[:3]
    assert w.examples("evaluation", limit=2) == ev[:2]


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_real_split_and_content_deterministic(real, name):
    again = get_workload(name, data=real[name].source)
    first = {ex.id: (ex.split, ex.context) for ex in real[name].examples()}
    assert {ex.id: (ex.split, ex.context) for ex in again.examples()} == first


def test_calibration_fraction_is_about_forty_percent(real):
    total = sum(len(w.examples()) for w in real.values())
    cal = sum(len(w.examples("calibration")) for w in real.values())
    assert 0.35 < cal / total < 0.45


@pytest.mark.parametrize("name", ["squad-long", "tool-results"])
def test_seed_changes_construction_not_split(real, name):
    other = get_workload(name, data=real[name].source, seed=1)
    a, b = real[name].examples(limit=30), other.examples(limit=30)
    assert [ex.id for ex in a] == [ex.id for ex in b]
    assert [ex.split for ex in a] == [ex.split for ex in b]
    assert any(x.context != y.context for x, y in zip(a, b))


def test_hotpotqa_documents(real):
    rows = {row["_id"]: row for row in _raw(real["hotpotqa"])}
    for ex in real["hotpotqa"].examples(limit=50):
        row = rows[ex.id]
        assert ex.context.count("Document [") == len(row["context"]) == ex.meta["n_paragraphs"]
        assert ex.references == [row["answer"]]
        assert row["question"].strip() in ex.instruction
        for title, _ in row["context"]:
            assert f"(Title: {title}):" in ex.context
    assert any(ex.references[0] in ("yes", "no") for ex in real["hotpotqa"].examples())


def test_tool_results_is_json_of_the_same_paragraphs(real):
    hotpot = {ex.id: ex for ex in real["hotpotqa"].examples()}
    for ex in real["tool-results"].examples(limit=50):
        head, body = ex.context.split("Tool result:\n", 1)
        assert head.startswith('Tool call: search(query="')
        results = json.loads(body)
        assert [r["rank"] for r in results] == list(range(1, hotpot[ex.id].meta["n_paragraphs"] + 1))
        assert sorted(ex.meta["order"]) == list(range(len(results)))
        assert all(results[k - 1]["title"] in ex.meta["supporting_titles"] for k in ex.meta["supporting_ranks"])
        assert {results[k - 1]["title"] for k in ex.meta["supporting_ranks"]} == set(ex.meta["supporting_titles"])
        assert ex.references == hotpot[ex.id].references
        for r in results:
            assert f"(Title: {r['title']}): {r['snippet']}" in hotpot[ex.id].context


def test_musique_keeps_supporting_paragraphs_within_budget(real):
    w = real["musique"]
    rows = {row["id"]: row for row in _raw(w)}
    assert w.context_chars == 6000
    for ex in w.examples():
        row = rows[ex.id]
        assert row["answerable"]
        assert ex.references[0] == row["answer"] and set(row["answer_aliases"]) <= set(ex.references)
        supporting = [p for p in row["paragraphs"] if p["is_supporting"]]
        for p in supporting:
            assert p["paragraph_text"].strip() in ex.context
        # original order kept
        positions = [ex.context.index(p["paragraph_text"].strip()) for p in row["paragraphs"]
                     if p["paragraph_text"].strip() in ex.context]
        assert positions == sorted(positions)
        assert ex.meta["n_paragraphs"] + ex.meta["dropped_paragraphs"] == len(row["paragraphs"])
        if ex.meta["over_budget"]:
            assert ex.meta["n_paragraphs"] == len(supporting)
        else:
            assert len(ex.context) <= 6000
    assert any(ex.meta["dropped_paragraphs"] > 0 for ex in w.examples())


def test_squad_long_calibration_contexts_never_hold_an_evaluation_gold_paragraph(real):
    """A mapper is fitted on calibration contexts: none of them may hold the paragraph an evaluation question is
    answered from. The earlier construction (``calibration_distractors="any"``) did, for most evaluation golds;
    both give the same evaluation examples."""
    w = real["squad-long"]
    golds = {tuple(e.meta["paragraph"]) for e in w.examples("evaluation")}
    assert not any(tuple(d) in golds for e in w.examples("calibration") for d in e.meta["distractors"])
    earlier = get_workload("squad-long", data=w.data, calibration_distractors="any")
    assert sum(any(tuple(d) in golds for d in e.meta["distractors"]) for e in earlier.examples("calibration")) > 100
    assert earlier.examples("evaluation") == w.examples("evaluation")
    with pytest.raises(ValueError, match="calibration_distractors"):
        get_workload("squad-long", calibration_distractors="some")


def test_squad_long_contains_gold_paragraph_and_answers(real):
    w = real["squad-long"]
    articles = _raw(w)["data"]
    per_paragraph = set()
    for ex in w.examples():
        a, p = ex.meta["paragraph"]
        gold = articles[a]["paragraphs"][p]
        assert gold["context"].strip() in ex.context
        for ref in ex.references:
            assert ref in ex.context
        assert (a, p) not in per_paragraph
        per_paragraph.add((a, p))
        assert all(da != a for da, _ in ex.meta["distractors"])
        assert ex.meta["n_distractors"] == len(ex.meta["distractors"]) > 0
        assert ex.context.count("Document [") == ex.meta["n_distractors"] + 1
        assert len(ex.references) == len(set(ex.references))
    assert w.excluded["unanswerable"] > 0


def test_report_examples(real):
    w = real["report"]
    assert w.answer_kind == "long" and w.max_new_tokens == 96 and w.stop_strings == ()
    for ex in w.examples():
        assert ex.references and ex.references[0].strip()
        assert len(ex.context) <= 5000
        assert ex.context.startswith("## ")
        assert "## References" not in ex.context and "## External links" not in ex.context
        assert ex.meta["title"] in ex.instruction


def test_score_agree_and_criterion(real):
    short, long = real["hotpotqa"], real["report"]
    assert short.score("The Eiffel Tower", ["eiffel tower", "tower"]) == 1.0
    assert short.agree("Paris.", "paris") and not short.agree("Paris", "Paris, France")
    assert "exact match" in short.criterion()
    assert long.score("a b c d", ["a b c d"]) == 1.0
    assert long.agree("x y z w", "x y z q") and not long.agree("x y z w", "p q r s")
    assert "ROUGE-L" in long.criterion() and "0.5" in long.criterion()
    assert short.max_new_tokens == 24 and short.stop_strings == ("\n",)


def test_unknown_workload():
    with pytest.raises(ValueError, match="hotpotqa"):
        get_workload("nope")
    with pytest.raises(CacheCertError, match="unknown workload"):  # the CLI prints it as a one-line error
        get_workload("nope")


def test_bad_context_chars():
    with pytest.raises(ValueError):
        get_workload("musique", context_chars=0)


# ------------------------------------------------------------------------------------------ small files


def _hotpot_row(i: int = 0) -> dict:
    return {"_id": f"id{i}", "question": "Which city?", "answer": "Paris", "type": "bridge", "level": "easy",
            "supporting_facts": [["A", 0]],
            "context": [["A", ["Paris is a city.", " It is big."]], ["B", ["Berlin too."]]]}


def _write(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def test_small_valid_file_and_env_folder(tmp_path, monkeypatch):
    _write(tmp_path / "hotpotqa" / "hotpot_dev_distractor_v1.json", [_hotpot_row(i) for i in range(20)])
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    w = get_workload("hotpotqa")
    examples = w.examples()
    assert len(examples) == 20 and w.source == tmp_path / "hotpotqa" / "hotpot_dev_distractor_v1.json"
    assert examples[0].context == ("Document [1] (Title: A): Paris is a city. It is big.\n\n"
                                   "Document [2] (Title: B): Berlin too.")
    cut = get_workload("hotpotqa", context_chars=60).examples()[0]
    assert "Title: A" in cut.context and "Title: B" not in cut.context and cut.meta["dropped_paragraphs"] == 1


def test_invalid_json(tmp_path):
    bad = _write(tmp_path / "hotpot.json", '[{"_id": "x", ')
    with pytest.raises(DataFormatError, match="hotpot.json"):
        get_workload("hotpotqa", data=bad).examples()


def test_row_missing_question(tmp_path):
    row = _hotpot_row(1)
    del row["question"]
    bad = _write(tmp_path / "hotpot.json", [_hotpot_row(0), row])
    with pytest.raises(DataFormatError) as info:
        get_workload("tool-results", data=bad).examples()
    msg = str(info.value)
    assert "hotpot.json" in msg and "row 1" in msg and "'question'" in msg
    assert isinstance(info.value, CacheCertError)


def test_top_level_dict_instead_of_list(tmp_path):
    bad = _write(tmp_path / "musique.json", {"rows": []})
    with pytest.raises(DataFormatError, match="musique.json.*list"):
        get_workload("musique", data=bad).examples()


def test_malformed_nested_rows(tmp_path):
    row = {"id": "m1", "question": "q", "answer": "a", "answerable": True,
           "paragraphs": [{"title": "T", "paragraph_text": "text"}]}
    bad = _write(tmp_path / "musique.json", [row])
    with pytest.raises(DataFormatError, match="row 0, paragraph 0.*'is_supporting'"):
        get_workload("musique", data=bad).examples()
    squad = _write(tmp_path / "squad.json", {"version": "v2.0", "data": [{"title": "T", "paragraphs": [
        {"context": "c", "qas": [{"id": "q1", "answers": []}]}]}]})
    with pytest.raises(DataFormatError, match=r"data\[0\]\.paragraphs\[0\]\.qas\[0\].*'question'"):
        get_workload("squad-long", data=squad).examples()
    article = _write(tmp_path / "wiki" / "Some_Title.json", {"title": "Some_Title", "content": []})
    with pytest.raises(DataFormatError, match="Some_Title.json.*'summary'"):
        get_workload("report", data=article.parent).examples()


@pytest.mark.parametrize("name,obj,match", [
    ("musique", [{"id": "m", "question": "q", "answer": "a", "paragraphs": [
        {"title": "T", "paragraph_text": None, "is_supporting": True}]}], "paragraph 0, key 'paragraph_text'"),
    ("musique", [{"id": "m", "question": 5, "answer": "a", "paragraphs": []}], "row 0, key 'question'"),
    ("musique", [{"id": "m", "question": "q", "answer": 7, "paragraphs": []}], "row 0, key 'answer'"),
    ("squad-long", {"data": [{"title": "T", "paragraphs": [{"context": 3, "qas": []}]}]}, "key 'context'"),
    ("squad-long", {"data": [{"title": "T", "paragraphs": [{"context": "c", "qas": [
        {"id": "q", "question": None, "answers": []}]}]}]}, "qas\\[0\\], key 'question'"),
    ("squad-long", {"data": [{"title": "T", "paragraphs": [{"context": "c", "qas": [
        {"id": "q", "question": "q", "answers": [{"text": None}]}]}]}]}, "answers\\[0\\], key 'text'"),
    ("musique", [{"id": "m", "question": "q", "answer": "a", "answerable": "false", "paragraphs": []}],
     "row 0, key 'answerable'"),  # bool("false") is True: a string flag would count the row as answerable
    ("musique", [{"id": "m", "question": "q", "answer": "a", "paragraphs": [
        {"title": "T", "paragraph_text": "p", "is_supporting": "false"}]}], "paragraph 0, key 'is_supporting'"),
    ("musique", [{"id": "m", "question": "q", "answer": "a", "paragraphs": [
        {"title": None, "paragraph_text": "p", "is_supporting": True}]}], "paragraph 0, key 'title'"),
    ("musique", [{"id": "m", "question": "q", "answer": " . ", "paragraphs": [
        {"title": "T", "paragraph_text": "p", "is_supporting": True}]}], "no musique examples.*no reference answer"),
    ("musique", [], "no musique examples"),
    ("squad-long", {"data": []}, "no squad-long examples"),
])
def test_wrong_types_name_the_file_row_and_key(tmp_path, name, obj, match):
    bad = _write(tmp_path / f"{name}.json", obj)
    with pytest.raises(DataFormatError, match=match):
        get_workload(name, data=bad).examples()


def test_duplicate_ids_rejected(tmp_path):
    bad = _write(tmp_path / "hotpot.json", [_hotpot_row(0), _hotpot_row(0)])
    with pytest.raises(DataFormatError, match="id0"):
        get_workload("hotpotqa", data=bad).examples()


def test_missing_data_names_the_flag(tmp_path, monkeypatch):
    monkeypatch.delenv(DATA_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataNotFoundError, match="--data") as info:
        get_workload("hotpotqa", data=tmp_path / "nowhere").examples()
    assert "nowhere" in str(info.value)
    with pytest.raises(DataNotFoundError, match="--data"):
        resolve_data_dir(tmp_path / "nowhere", "musique", "musique/musique_ans_train.first100.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataNotFoundError, match="--data"):
        get_workload("squad-long", data=empty).examples()


def test_agreement_criteria_parse_judge_and_describe():
    from cachecert_agents.eval.workloads import Agreement

    f1 = Agreement.parse(" Token-F1 >= .5 ")
    assert str(f1) == "token-f1>=0.5" and Agreement.parse(str(f1)) == f1 and Agreement.parse(f1) is f1
    assert f1("Paris", "The capital is Paris")  # F1 = 0.5: a rephrased answer with the same entity agrees
    assert not f1("London", "The capital is Paris") and not Agreement.parse("exact")("Paris", "The capital is Paris")
    assert Agreement.parse("rouge-l>=0.57")("red green blue", "red green x y")  # LCS 2: F1 = 2(2/3)(1/2)/(7/6)
    assert not Agreement.parse("rouge-l>=0.58")("red green blue", "red green x y")
    for bad in ("f1>0.5", "token-f1>=0", "token-f1>=1.5", "rouge", ""):
        with pytest.raises(ValueError, match="exact"):
            Agreement.parse(bad)
    hot = get_workload("hotpotqa", agreement="token-f1>=0.5")
    assert hot.agree("Paris", "The capital is Paris") and "token F1 >= 0.5" in hot.criterion()
    assert str(get_workload("hotpotqa").agreement) == "exact"
    assert str(get_workload("report").agreement) == "rouge-l>=0.5"
    with pytest.raises(ValueError, match="agreement criterion"):
        get_workload("hotpotqa", agreement="f1")

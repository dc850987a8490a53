"""Evaluation workloads: real QA / report / tool-output data turned into ``(context, instruction)`` examples.

Every workload reads public data from disk (never from the network) and yields :class:`Example` objects with a
shared *context* (the part whose KV cache is transferred between models), an *instruction* that follows it,
gold *references* and a deterministic *split*:

``calibration`` if ``int(sha256(f"{workload}:{id}").hexdigest()[:8], 16) / 2**32 < 0.4`` else ``evaluation``
(:func:`assign_split`). The split depends only on the workload name and the example id, not on the seed, the
machine or the order of the file, so calibration and evaluation never share an example.

Workloads (``WORKLOADS`` / :func:`get_workload`):

* ``hotpotqa``: HotpotQA dev, distractor setting, 10 paragraphs rendered as documents (about 1.2k tokens).
* ``musique``: MuSiQue-Ans, answerable rows only, non-supporting paragraphs dropped (last first) to a budget.
* ``squad-long``: SQuAD v2 dev, answerable questions only, one per paragraph, gold paragraph hidden among
  seeded distractor paragraphs from other articles.
* ``report``: FreshWiki articles, sections as sources, 2-3 sentence summary; long answers judged by ROUGE-L.
* ``tool-results``: HotpotQA rows formatted as the JSON output of a search tool (agent pipelines).

Where the data comes from (:func:`resolve_data_dir`): the ``data`` argument (``--data PATH`` on the command
line), else ``$CACHECERT_DATA``, else a folder ``shared/data`` found by walking up from the current directory
or from this file (a checkout with ``../shared/data`` beside it works without configuration). Missing data
raises :class:`DataNotFoundError`; malformed files raise :class:`DataFormatError` naming the file, the row and
the key. Malformed rows are never skipped silently; rows left out by a documented rule (unanswerable
questions, extra questions of a paragraph, empty articles) are counted in :attr:`Workload.excluded`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
from abc import ABC, abstractmethod
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from cachecert_agents.errors import CacheCertError
from cachecert_agents.eval.metrics import best_over_references, exact_match, normalize_answer, rouge_l, token_f1

logger = logging.getLogger(__name__)

__all__ = [
    "Agreement",
    "CALIBRATION_FRACTION",
    "DATA_ENV",
    "DataFormatError",
    "DataNotFoundError",
    "Example",
    "HotpotQA",
    "MuSiQue",
    "Report",
    "SquadLong",
    "ToolResults",
    "WORKLOADS",
    "Workload",
    "assign_split",
    "get_workload",
    "resolve_data_dir",
    "stable_int",
]

DATA_ENV = "CACHECERT_DATA"
CALIBRATION_FRACTION = 0.4

QA_INSTRUCTION = ("Answer the question using the documents above. Reply with a short phrase only, no explanation.\n"
                  "Question: {question}")
TOOL_INSTRUCTION = ("Using the tool results above, answer the user's question with a short phrase only.\n"
                    "Question: {question}")
REPORT_INSTRUCTION = "Write a short encyclopedic summary (2-3 sentences) of '{title}' based on the sources above."


class DataNotFoundError(CacheCertError):
    """The evaluation data of a workload could not be located."""


class UnknownWorkloadError(CacheCertError, ValueError):
    """A workload name that is not one of :data:`WORKLOADS` (a ``ValueError`` too, as before)."""


class DataFormatError(CacheCertError, ValueError):
    """An evaluation data file is not valid JSON or lacks what a workload needs (file, row and key named)."""


class Example(BaseModel):
    """One evaluation example: ``context`` (shared, transferred) followed by ``instruction``."""

    id: str
    workload: str
    context: str
    instruction: str
    references: list[str]
    split: Literal["calibration", "evaluation"]
    meta: dict = Field(default_factory=dict)


# --------------------------------------------------------------------------------------------------- helpers


def stable_int(text: str) -> int:
    """A 32-bit integer derived from ``text`` by SHA-256 (same on every machine, unlike ``hash``)."""
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:8], 16)


def assign_split(workload: str, example_id: str) -> Literal["calibration", "evaluation"]:
    """``calibration`` for about 40 % of the ids (SHA-256 of ``"{workload}:{id}"``), ``evaluation`` otherwise."""
    return "calibration" if stable_int(f"{workload}:{example_id}") / 2**32 < CALIBRATION_FRACTION else "evaluation"


def _candidate_roots() -> list[Path]:
    """Folders named ``shared/data`` above the current directory and above this file (nearest first)."""
    here = Path(__file__).resolve()
    starts = [Path.cwd().resolve(), here.parent]
    roots: list[Path] = []
    for start in starts:
        for ancestor in (start, *start.parents):
            roots.append(ancestor / "shared" / "data")
    roots.append(here.parents[2].parent / "shared" / "data")  # ../shared/data beside the repository root
    seen: set[Path] = set()
    return [r for r in roots if not (r in seen or seen.add(r))]


def resolve_data_dir(data: str | Path | None, sub: str, expected: str | None = None) -> Path:
    """Locate the data of one workload: a file or a folder.

    ``data`` (a file or a folder; a folder holding ``sub`` is descended into) wins, then ``$CACHECERT_DATA``
    (same rules), then the first ``shared/data/<sub>`` found walking up from the current directory or from this
    file. ``expected`` (e.g. ``"hotpotqa/hotpot_dev_distractor_v1.first500.json"``) only improves the message of
    the :class:`DataNotFoundError` raised when nothing is found.
    """
    want = expected or f"{sub}/"
    given: list[tuple[str, str]] = []
    if data is not None:
        given.append(("--data", str(data)))
    elif os.environ.get(DATA_ENV):
        given.append((f"${DATA_ENV}", os.environ[DATA_ENV]))
    for origin, value in given:
        path = Path(value).expanduser()
        if not path.exists():
            raise DataNotFoundError(
                f"{origin} points to {path}, which does not exist. Pass --data PATH with the {sub} data "
                f"(a file like {want} or the folder holding it).")
        if path.is_dir() and (path / sub).exists():
            return path / sub
        return path
    for root in _candidate_roots():
        if (root / sub).exists():
            return root / sub
    raise DataNotFoundError(
        f"no {sub} data found: expected {want} under a shared/data folder above the current directory "
        f"({Path.cwd()}) or above the package. Pass --data PATH (the file or its folder) or set ${DATA_ENV}.")


def _find_file(root: Path, patterns: tuple[str, ...], expected: str) -> Path:
    """``root`` itself if it is a file, else the first (sorted) match of the first pattern that matches."""
    if root.is_file():
        return root
    for pattern in patterns:
        matches = sorted(p for p in root.glob(pattern) if p.is_file())
        if matches:
            return matches[0]
    raise DataNotFoundError(f"{root} holds no file matching {', '.join(patterns)} (expected {expected}). "
                            f"Pass --data PATH with the file itself.")


def _load_json(path: Path) -> Any:
    """Parse a JSON file (or JSON Lines when the name ends in ``.jsonl``); errors name the file and position."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataFormatError(f"{path}: not UTF-8 text ({exc})") from exc
    if path.suffix == ".jsonl":
        rows = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataFormatError(f"{path}: line {lineno} is not valid JSON: {exc.msg}") from exc
        return rows
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataFormatError(
            f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}") from exc


def _expect_list(obj: Any, path: Path, what: str) -> list:
    if not isinstance(obj, list):
        raise DataFormatError(f"{path}: expected a JSON list of {what} at the top level, found {type(obj).__name__}")
    return obj


def _require(row: Any, keys: tuple[str, ...], path: Path, where: str) -> dict:
    """``row`` as a dict holding every key, else :class:`DataFormatError` naming file, row and missing key."""
    if not isinstance(row, dict):
        raise DataFormatError(f"{path}: {where} is a {type(row).__name__}, expected a JSON object")
    for key in keys:
        if key not in row:
            raise DataFormatError(f"{path}: {where} lacks required key {key!r}")
    return row


def _expect(cond: bool, path: Path, where: str, key: str, what: str) -> None:
    if not cond:
        raise DataFormatError(f"{path}: {where}, key {key!r}: expected {what}")


def _render_documents(docs: list[tuple[str, str]]) -> str:
    """``Document [i] (Title: t): text`` blocks (1-based), separated by blank lines."""
    return "\n\n".join(f"Document [{i}] (Title: {title}): {text}" for i, (title, text) in enumerate(docs, 1))


def _fit_documents(docs: list[tuple[str, str]], supporting: list[bool], budget: int | None,
                   render=_render_documents) -> tuple[list[int], bool]:
    """Indices of ``docs`` kept under ``budget`` characters (rendered), dropping NON-supporting documents from
    the end first; every supporting document and the original order are kept. Returns ``(kept, over_budget)``
    where ``over_budget`` says the supporting documents alone exceed the budget."""
    kept = list(range(len(docs)))
    if budget is None:
        return kept, False
    droppable = [i for i in kept if not supporting[i]]
    while len(render([docs[i] for i in kept])) > budget and droppable:
        kept.remove(droppable.pop())
    return kept, len(render([docs[i] for i in kept])) > budget


class _UseDefault:
    def __repr__(self) -> str:
        return "<workload default>"


USE_DEFAULT: Any = _UseDefault()


# ------------------------------------------------------------------------------------------ agreement criteria

_AGREEMENT_METRICS = {"token-f1": token_f1, "rouge-l": rouge_l}


class Agreement(BaseModel, frozen=True):
    """An agreement criterion between an answer and the receiver's own full-prefill answer (unsafe = disagree).

    ``exact``: SQuAD-normalised exact match (the default for short answers, DESIGN.md section 1);
    ``token-f1>=T`` / ``rouge-l>=T``: SQuAD token F1 / ROUGE-L F1 of the normalised answers at least ``T``
    (``rouge-l>=0.5`` is the default for long outputs). ``str(agreement)`` is the spec :meth:`parse` reads.
    """

    metric: Literal["exact", "token-f1", "rouge-l"]
    threshold: float = Field(1.0, gt=0.0, le=1.0)

    @classmethod
    def parse(cls, spec: "str | Agreement") -> "Agreement":
        """``"exact"``, ``"token-f1>=0.5"`` or ``"rouge-l>=0.5"`` (threshold in (0, 1]); a clear error otherwise."""
        if isinstance(spec, Agreement):
            return spec
        text = str(spec).strip().lower()
        if text == "exact":
            return cls(metric="exact")
        m = re.fullmatch(r"(token-f1|rouge-l)\s*>=\s*([0-9]*\.?[0-9]+)", text)
        if m is None or not 0.0 < float(m.group(2)) <= 1.0:
            raise ValueError(f"agreement criterion {spec!r}: expected 'exact', 'token-f1>=T' or 'rouge-l>=T' with "
                             f"0 < T <= 1")
        return cls(metric=m.group(1), threshold=float(m.group(2)))

    def __str__(self) -> str:
        return "exact" if self.metric == "exact" else f"{self.metric}>={self.threshold:g}"

    def __call__(self, prediction: str, full_prefill_prediction: str) -> bool:
        if self.metric == "exact":
            return exact_match(prediction, full_prefill_prediction) == 1.0
        return _AGREEMENT_METRICS[self.metric](prediction, full_prefill_prediction) >= self.threshold

    def describe(self) -> str:
        """The criterion in words, as results record it."""
        if self.metric == "exact":
            return "SQuAD-normalised exact match"
        name = "SQuAD token F1" if self.metric == "token-f1" else "ROUGE-L F1 (SQuAD-normalised tokens)"
        return f"{name} >= {self.threshold:g}"


# ------------------------------------------------------------------------------------------------- base class


class Workload(ABC):
    """A source of :class:`Example` objects plus its scoring and agreement rules.

    ``score`` is the task score against the gold references (short answers: best SQuAD token F1 over the
    references; long answers: ROUGE-L). ``agree`` is the criterion that decides whether an answer generated
    from a transferred cache agrees with the answer generated from a full prefill of the same prompt.
    """

    name: ClassVar[str]
    answer_kind: ClassVar[Literal["short", "long"]] = "short"
    max_new_tokens: ClassVar[int] = 24
    stop_strings: ClassVar[tuple[str, ...]] = ("\n",)
    agreement_threshold: ClassVar[float] = 0.5
    default_context_chars: ClassVar[int | None] = None
    data_sub: ClassVar[str]
    data_patterns: ClassVar[tuple[str, ...]]
    expected_file: ClassVar[str]

    def __init__(self, data: str | Path | None = None, seed: int = 0,
                 context_chars: int | None = USE_DEFAULT, agreement: str | Agreement | None = None) -> None:
        if context_chars is USE_DEFAULT:
            context_chars = self.default_context_chars
        if context_chars is not None and (not isinstance(context_chars, int) or context_chars <= 0):
            raise ValueError(f"context_chars must be a positive integer or None, got {context_chars!r}")
        self.data = data
        self.seed = int(seed)
        self.context_chars: int | None = context_chars
        self.agreement: Agreement = self.default_agreement() if agreement is None else Agreement.parse(agreement)
        self.source: Path | None = None
        self.excluded: Counter[str] = Counter()
        self._examples: list[Example] | None = None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(data={self.data!r}, seed={self.seed}, context_chars={self.context_chars}, "
                f"agreement={str(self.agreement)!r})")

    # data --------------------------------------------------------------------------------------------------
    def data_path(self) -> Path:
        """The file (or folder, for ``report``) the examples are read from."""
        root = resolve_data_dir(self.data, self.data_sub, self.expected_file)
        return _find_file(root, self.data_patterns, self.expected_file)

    @abstractmethod
    def _build(self, path: Path) -> list[Example | None]:
        """All examples of the data at ``path``, in a deterministic order (None for one :meth:`_example` excluded)."""

    def _example(self, example_id: str, context: str, instruction: str, references: list[str],
                 meta: dict) -> Example | None:
        """An :class:`Example`; references that normalise to nothing (``"."``, ``"the"``) are dropped, as the
        official SQuAD v2 script drops them (any answer would match one). An example left with none is excluded
        (None; counted in ``excluded`` and logged), not scored against nothing."""
        scorable = [r for r in references if normalize_answer(r)]
        if not scorable:
            self.excluded["no reference answer with text"] += 1
            logger.warning("%s example %r has no reference answer with any text (%r); excluded", self.name,
                           example_id, references)
            return None
        return Example(id=example_id, workload=self.name, context=context, instruction=instruction,
                       references=scorable, split=assign_split(self.name, example_id), meta=meta)

    def examples(self, split: str | None = None, limit: int | None = None) -> list[Example]:
        """Examples in file order, optionally of one split and at most ``limit`` of them (loaded once)."""
        if split not in (None, "calibration", "evaluation"):
            raise ValueError(f"split must be 'calibration', 'evaluation' or None, got {split!r}")
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        if self._examples is None:
            path = self.data_path()
            self.excluded = Counter()
            built = [ex for ex in self._build(path) if ex is not None]  # None: excluded by _example
            if not built:
                raise DataFormatError(f"{path}: no {self.name} examples in it (excluded: {dict(self.excluded) or 'none'})")
            seen: set[str] = set()
            for ex in built:
                if ex.id in seen:
                    raise DataFormatError(f"{path}: example id {ex.id!r} occurs more than once")
                seen.add(ex.id)
            self.source, self._examples = path, built
        out = [ex for ex in self._examples if split is None or ex.split == split]
        return out if limit is None else out[:limit]

    # scoring -----------------------------------------------------------------------------------------------
    def score(self, prediction: str, references: list[str]) -> float:
        """Task score: best token F1 over the references (short) or best ROUGE-L (long)."""
        metric = token_f1 if self.answer_kind == "short" else rouge_l
        return best_over_references(metric, prediction, references)

    @classmethod
    def default_agreement(cls) -> Agreement:
        """The workload's own criterion: exact match for short answers, ROUGE-L >= threshold for long outputs."""
        if cls.answer_kind == "short":
            return Agreement(metric="exact")
        return Agreement(metric="rouge-l", threshold=cls.agreement_threshold)

    def agree(self, prediction: str, full_prefill_prediction: str) -> bool:
        """Whether an answer agrees with the full-prefill answer under :attr:`agreement` (see :meth:`criterion`)."""
        return self.agreement(prediction, full_prefill_prediction)

    def criterion(self) -> str:
        """One-line description of the agreement criterion, recorded with results."""
        what = "answer" if self.answer_kind == "short" else "output"
        stop = ", stop at newline" if "\n" in self.stop_strings else ""
        if self.agreement.metric == "rouge-l":  # the threshold after the pair, as results have always said it
            return (f"{self.name}: agree iff ROUGE-L F1 (SQuAD-normalised tokens) between the transferred-cache "
                    f"{what} and the full-prefill {what} >= {self.agreement.threshold:g} (greedy, <= "
                    f"{self.max_new_tokens} new tokens{stop})")
        return (f"{self.name}: agree iff {self.agreement.describe()} between the transferred-cache {what} and the "
                f"full-prefill {what} (greedy, <= {self.max_new_tokens} new tokens{stop})")


# ---------------------------------------------------------------------------------------------------- HotpotQA


def _hotpot_rows(path: Path) -> list[dict]:
    """Validated HotpotQA rows: ``_id, question, answer, context=[[title, [sentences]]], supporting_facts``."""
    rows = _expect_list(_load_json(path), path, "HotpotQA rows")
    for i, row in enumerate(rows):
        where = f"row {i}"
        _require(row, ("_id", "question", "answer", "context", "supporting_facts"), path, where)
        _expect(isinstance(row["question"], str) and isinstance(row["answer"], str), path, where, "question/answer",
                "strings")
        ctx = row["context"]
        _expect(isinstance(ctx, list) and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], list)
            and all(isinstance(s, str) for s in p[1]) for p in ctx), path, where, "context",
            "a list of [title, [sentences]] pairs")
        _expect(isinstance(row["supporting_facts"], list) and all(
            isinstance(f, list) and f and isinstance(f[0], str) for f in row["supporting_facts"]),
            path, where, "supporting_facts", "a list of [title, sentence index] pairs")
    return rows


def _hotpot_docs(row: dict) -> tuple[list[tuple[str, str]], list[str]]:
    docs = [(title, "".join(sentences).strip()) for title, sentences in row["context"]]
    supporting = list(dict.fromkeys(f[0] for f in row["supporting_facts"]))
    return docs, supporting


class HotpotQA(Workload):
    """HotpotQA dev, distractor setting: the paragraphs (10; a few rows have fewer) in file order as documents;
    answers kept as given (yes/no included). With ``context_chars`` set, non-supporting paragraphs are dropped
    from the end to fit."""

    name = "hotpotqa"
    data_sub = "hotpotqa"
    data_patterns = ("hotpot_dev_distractor_v1*.json", "hotpot_*distractor*.json*")
    expected_file = "hotpotqa/hotpot_dev_distractor_v1.first500.json"

    def _build(self, path: Path) -> list[Example | None]:
        out = []
        for row in _hotpot_rows(path):
            docs, supporting = _hotpot_docs(row)
            kept, over = _fit_documents(docs, [t in supporting for t, _ in docs], self.context_chars)
            out.append(self._example(
                str(row["_id"]), _render_documents([docs[i] for i in kept]),
                QA_INSTRUCTION.format(question=row["question"].strip()), [row["answer"]],
                {"supporting_titles": supporting, "type": row.get("type"), "level": row.get("level"),
                 "n_paragraphs": len(kept), "dropped_paragraphs": len(docs) - len(kept), "over_budget": over}))
        return out


class ToolResults(Workload):
    """An agent step: the JSON output of a ``search`` tool as context. Built from the same HotpotQA rows as
    ``hotpotqa`` (same ids, answers and paragraphs) but formatted as ranked tool results in a seeded shuffled
    order (``random.Random(seed + stable_int(id))``), so the split and the prompt format differ."""

    name = "tool-results"
    data_sub = HotpotQA.data_sub
    data_patterns = HotpotQA.data_patterns
    expected_file = HotpotQA.expected_file

    @staticmethod
    def _render(question: str, docs: list[tuple[str, str]]) -> str:
        results = [{"rank": i + 1, "title": t, "snippet": text} for i, (t, text) in enumerate(docs)]
        return (f'Tool call: search(query="{question}")\nTool result:\n'
                + json.dumps(results, indent=1, ensure_ascii=False))

    def _build(self, path: Path) -> list[Example | None]:
        out = []
        for row in _hotpot_rows(path):
            docs, supporting = _hotpot_docs(row)
            question = row["question"].strip()
            order = list(range(len(docs)))
            random.Random(self.seed + stable_int(str(row["_id"]))).shuffle(order)
            shuffled = [docs[i] for i in order]
            kept, over = _fit_documents(shuffled, [t in supporting for t, _ in shuffled], self.context_chars,
                                        render=lambda d, q=question: self._render(q, d))
            final = [shuffled[i] for i in kept]
            out.append(self._example(
                str(row["_id"]), self._render(question, final), TOOL_INSTRUCTION.format(question=question),
                [row["answer"]],
                {"supporting_titles": supporting, "type": row.get("type"), "level": row.get("level"),
                 "order": [order[i] for i in kept],
                 "supporting_ranks": [r + 1 for r, (t, _) in enumerate(final) if t in supporting],
                 "dropped_paragraphs": len(docs) - len(kept), "over_budget": over, "seed": self.seed}))
        return out


# ----------------------------------------------------------------------------------------------------- MuSiQue


class MuSiQue(Workload):
    """MuSiQue-Ans: rows with ``answerable`` true (absent counts as true); paragraphs rendered as documents and
    cut to ``context_chars`` (default 6000, about 1.5k tokens) by dropping non-supporting paragraphs, the last
    first, keeping every supporting paragraph and the original order. References: answer + aliases."""

    name = "musique"
    default_context_chars = 6000
    data_sub = "musique"
    data_patterns = ("musique_ans*.json", "musique_ans*.jsonl", "musique*.json", "musique*.jsonl")
    expected_file = "musique/musique_ans_train.first100.json"

    def _build(self, path: Path) -> list[Example | None]:
        rows = _expect_list(_load_json(path), path, "MuSiQue rows")
        out = []
        for i, row in enumerate(rows):
            where = f"row {i}"
            _require(row, ("id", "question", "answer", "paragraphs"), path, where)
            _expect(isinstance(row["question"], str), path, where, "question", "a string")
            _expect(isinstance(row["answer"], str), path, where, "answer", "a string")
            _expect(isinstance(row["paragraphs"], list), path, where, "paragraphs", "a list")
            _expect(isinstance(row.get("answerable", True), bool), path, where, "answerable", "true or false")
            for j, par in enumerate(row["paragraphs"]):
                _require(par, ("title", "paragraph_text", "is_supporting"), path, f"{where}, paragraph {j}")
                for key, kind, what in (("paragraph_text", str, "a string"), ("title", str, "a string"),
                                        ("is_supporting", bool, "true or false")):
                    _expect(isinstance(par[key], kind), path, f"{where}, paragraph {j}", key, what)
            aliases = row.get("answer_aliases") or []
            _expect(isinstance(aliases, list) and all(isinstance(a, str) for a in aliases), path, where,
                    "answer_aliases", "a list of strings")
            if not row.get("answerable", True):
                self.excluded["unanswerable"] += 1
                continue
            docs = [(p["title"], p["paragraph_text"].strip()) for p in row["paragraphs"]]
            supporting = [bool(p["is_supporting"]) for p in row["paragraphs"]]
            kept, over = _fit_documents(docs, supporting, self.context_chars)
            references = list(dict.fromkeys([row["answer"], *aliases]))
            out.append(self._example(
                str(row["id"]), _render_documents([docs[k] for k in kept]),
                QA_INSTRUCTION.format(question=row["question"].strip()), references,
                {"supporting_titles": [docs[k][0] for k in kept if supporting[k]],
                 "n_paragraphs": len(kept), "dropped_paragraphs": len(docs) - len(kept), "over_budget": over,
                 "hops": len(row.get("question_decomposition") or [])}))
        return out


# ------------------------------------------------------------------------------------------------------- SQuAD


class SquadLong(Workload):
    """SQuAD v2 dev made long: answerable questions only (unanswerable ones are excluded, counted in
    ``excluded``), at most one question per paragraph (the first answerable one). The gold paragraph sits at a
    seeded position among distractor paragraphs of OTHER articles, drawn with
    ``random.Random(seed + stable_int(id))`` and added until the context reaches ``context_chars``
    (default 5000; the last distractor may overshoot it)."""

    name = "squad-long"
    default_context_chars = 5000
    data_sub = "squad"
    data_patterns = ("squad_v2_dev*.json", "dev-v2.0.json", "*dev*v2*.json", "*v2*dev*.json")
    expected_file = "squad/squad_v2_dev.json"

    def __init__(self, *args: Any, calibration_distractors: Literal["no-evaluation-gold", "any"] = "no-evaluation-gold",
                 **kwargs: Any) -> None:
        """``calibration_distractors``: ``"no-evaluation-gold"`` (default, from the fifteenth session) keeps every
        evaluation example's gold paragraph out of the calibration contexts, so a mapper (fitted on calibration
        contexts) never sees the text an evaluation question is answered from; ``"any"`` rebuilds the earlier
        contexts, in which most evaluation gold paragraphs served as calibration distractors
        (benchmarks/squad_leak_check.py measures what that did). Evaluation contexts are the same either way."""
        if calibration_distractors not in ("no-evaluation-gold", "any"):
            raise ValueError(f"calibration_distractors must be 'no-evaluation-gold' or 'any', got "
                             f"{calibration_distractors!r}")
        super().__init__(*args, **kwargs)
        self.calibration_distractors = calibration_distractors

    def _build(self, path: Path) -> list[Example | None]:
        obj = _load_json(path)
        _require(obj, ("data",), path, "the top level")
        articles = _expect_list(obj["data"], path, "articles under 'data'")
        pool: list[tuple[int, int, str, str]] = []  # (article, paragraph, title, text)
        golds: list[tuple[int, int, dict]] = []
        for a, art in enumerate(articles):
            _require(art, ("title", "paragraphs"), path, f"data[{a}]")
            _expect(isinstance(art["paragraphs"], list), path, f"data[{a}]", "paragraphs", "a list")
            title = str(art["title"]).replace("_", " ")
            for p, par in enumerate(art["paragraphs"]):
                where = f"data[{a}].paragraphs[{p}]"
                _require(par, ("context", "qas"), path, where)
                _expect(isinstance(par["context"], str), path, where, "context", "a string")
                _expect(isinstance(par["qas"], list), path, where, "qas", "a list")
                pool.append((a, p, title, par["context"].strip()))
                first = None
                for q, qa in enumerate(par["qas"]):
                    _require(qa, ("id", "question", "answers"), path, f"{where}.qas[{q}]")
                    _expect(isinstance(qa["question"], str), path, f"{where}.qas[{q}]", "question", "a string")
                    _expect(isinstance(qa["answers"], list), path, f"{where}.qas[{q}]", "answers", "a list")
                    for k, ans in enumerate(qa["answers"]):
                        _require(ans, ("text",), path, f"{where}.qas[{q}].answers[{k}]")
                        _expect(isinstance(ans["text"], str), path, f"{where}.qas[{q}].answers[{k}]", "text",
                                "a string")
                    if qa.get("is_impossible", False) or not qa["answers"]:
                        self.excluded["unanswerable"] += 1
                    elif first is None:
                        first = qa
                    else:
                        self.excluded["not first answerable of its paragraph"] += 1
                if first is not None:
                    golds.append((a, len(pool) - 1, first))
        evaluation_golds = {g for _, g, qa in golds if assign_split(self.name, str(qa["id"])) == "evaluation"}
        return [self._make(a, g, qa, pool, evaluation_golds) for a, g, qa in golds]

    def _make(self, article: int, gold: int, qa: dict, pool: list[tuple[int, int, str, str]],
              evaluation_golds: set[int]) -> Example:
        qid = str(qa["id"])
        rng = random.Random(self.seed + stable_int(qid))
        # distractors a calibration context may not hold: the evaluation examples' gold paragraphs
        banned = (evaluation_golds if self.calibration_distractors == "no-evaluation-gold"
                  and assign_split(self.name, qid) == "calibration" else set())
        eligible = sum(1 for j, entry in enumerate(pool) if entry[0] != article and j not in banned)
        budget = self.context_chars
        distractors: list[int] = []
        used: set[int] = set()

        def docs_of(order: list[int]) -> list[tuple[str, str]]:
            return [(pool[i][2], pool[i][3]) for i in order]

        while (budget is not None and len(distractors) < eligible
               and len(_render_documents(docs_of([gold, *distractors]))) < budget):
            j = rng.randrange(len(pool))
            if pool[j][0] == article or j in used or j in banned:
                continue
            used.add(j)
            distractors.append(j)
        position = rng.randint(0, len(distractors))
        order = distractors[:position] + [gold] + distractors[position:]
        references = list(dict.fromkeys(a["text"].strip() for a in qa["answers"] if a["text"].strip()))
        return self._example(
            qid, _render_documents(docs_of(order)), QA_INSTRUCTION.format(question=qa["question"].strip()),
            references,
            {"gold_position": position, "n_distractors": len(distractors), "seed": self.seed,
             "title": pool[gold][2], "paragraph": [pool[gold][0], pool[gold][1]],
             "distractors": [[pool[j][0], pool[j][1]] for j in distractors]})


# ------------------------------------------------------------------------------------------------------ Report

_SKIP_SECTIONS = frozenset({"references", "external links", "see also", "further reading", "notes", "footnotes",
                            "citations", "sources", "bibliography", "notes and references"})
_END = re.compile(r"""[.!?…]["'”’)\]]*$""")


_MIN_PARTIAL_SECTION = 500
_SENTENCE_END = re.compile(r"""[.!?…]["'”’)\]]*(?=\s|$)""")


def _cut_at_sentence(text: str, limit: int) -> str:
    """The longest prefix of ``text`` of at most ``limit`` characters ending at a sentence end (else at a space)."""
    if len(text) <= limit:
        return text
    cut = text[:limit + 1]
    ends = [m.end() for m in _SENTENCE_END.finditer(cut) if m.end() <= limit]
    if ends:
        return cut[:ends[-1]].rstrip()
    return cut[:limit].rsplit(None, 1)[0].rstrip() if " " in cut[:limit] else ""


def _sentence(text: str) -> str:
    """Whitespace collapsed, with a final period added when the sentence has no end punctuation."""
    text = " ".join(text.split())
    if not text or _END.search(text):
        return text
    return text.rstrip(",;:") + "."


class Report(Workload):
    """FreshWiki report generation: an article's sections (``## title`` + sentences, subsections as ``###``)
    are the sources, cut to ``context_chars`` (default 5000): whole top-level sections in article order while
    they fit; the first section that does not fit is cut at a sentence end to fill the rest of the budget when
    at least 500 characters are left (or when nothing fits yet), else dropped, and later sections are dropped
    (``meta["truncated_section"]`` says whether a section was cut). Whole sections alone left many articles with
    a few hundred characters, because FreshWiki sections are often longer than the budget. Reference-like
    sections (References, External links, See also, Notes, Further reading, ...) and empty sections are left
    out. The reference is the article's lead summary. Articles without any body text are excluded (counted in
    ``excluded``)."""

    name = "report"
    answer_kind = "long"
    max_new_tokens = 96
    stop_strings = ()
    agreement_threshold = 0.5
    default_context_chars = 5000
    data_sub = "freshwiki"
    data_patterns = ("*.json",)
    expected_file = "freshwiki/json/*.json"

    def data_path(self) -> Path:
        root = resolve_data_dir(self.data, self.data_sub, self.expected_file)
        if root.is_file():
            return root
        folder = root / "json" if (root / "json").is_dir() else root
        if not any(folder.glob("*.json")):
            raise DataNotFoundError(f"{folder} holds no *.json article (expected {self.expected_file}). "
                                    f"Pass --data PATH with the folder of FreshWiki article files.")
        return folder

    def _section(self, sec: dict, path: Path, where: str, depth: int = 2) -> str:
        _require(sec, ("section_title", "section_content"), path, where)
        title = " ".join(str(sec["section_title"]).split())
        if title.lower() in _SKIP_SECTIONS:
            return ""
        _expect(isinstance(sec["section_content"], list), path, where, "section_content", "a list")
        sentences = []
        for k, s in enumerate(sec["section_content"]):
            _require(s, ("sentence",), path, f"{where}, sentence {k}")
            if text := _sentence(str(s["sentence"])):
                sentences.append(text)
        subs = sec.get("subsections") or []
        _expect(isinstance(subs, list), path, where, "subsections", "a list")
        blocks = [b for n, sub in enumerate(subs)
                  if (b := self._section(sub, path, f"{where}, subsection {n}", depth + 1))]
        if not sentences and not blocks:
            return ""
        head = f"{'#' * depth} {title}" + (f"\n{' '.join(sentences)}" if sentences else "")
        return "\n\n".join([head, *blocks])

    def _article(self, art: Any, path: Path, where: str, default_id: str) -> Example | None:
        _require(art, ("title", "summary", "content"), path, where)
        _expect(isinstance(art["content"], list), path, where, "content", "a list")
        _expect(isinstance(art["summary"], str) and art["summary"].strip() != "", path, where, "summary",
                "a non-empty string")
        titles, blocks = [], []
        for n, sec in enumerate(art["content"]):
            if block := self._section(sec, path, f"{where}, section {n}"):
                titles.append(str(sec["section_title"]))
                blocks.append(block)
        if not blocks:
            self.excluded["article without body text"] += 1
            return None
        kept: list[str] = []
        truncated = False
        budget = self.context_chars
        for block in blocks:
            if budget is None or len("\n\n".join([*kept, block])) <= budget:
                kept.append(block)
                continue
            room = budget - len("\n\n".join(kept)) - (2 if kept else 0)
            if room >= _MIN_PARTIAL_SECTION or not kept:
                if part := _cut_at_sentence(block, room):
                    kept.append(part)
                    truncated = True
            break
        title = str(art["title"]).replace("_", " ")
        return self._example(
            default_id, "\n\n".join(kept), REPORT_INSTRUCTION.format(title=title), [art["summary"].strip()],
            {"title": title, "url": art.get("url"), "sections_kept": titles[:len(kept)],
             "sections_available": len(blocks), "truncated_section": truncated})

    def _build(self, path: Path) -> list[Example | None]:
        out: list[Example | None] = []
        if path.is_dir():
            for file in sorted(path.glob("*.json")):
                obj = _load_json(file)
                out.append(self._article(obj, file, "the article", file.stem))
        else:
            obj = _load_json(path)
            if isinstance(obj, dict):
                out.append(self._article(obj, path, "the article", path.stem))
            else:
                for i, art in enumerate(_expect_list(obj, path, "FreshWiki articles")):
                    where = f"row {i}"
                    _require(art, ("title",), path, where)
                    out.append(self._article(art, path, where, str(art["title"])))
        return [ex for ex in out if ex is not None]


# ---------------------------------------------------------------------------------------------------- registry

WORKLOADS: dict[str, type[Workload]] = {cls.name: cls for cls in (HotpotQA, MuSiQue, SquadLong, Report, ToolResults)}


def get_workload(name: str, data: str | Path | None = None, **kw: Any) -> Workload:
    """Instantiate the workload called ``name`` (``seed`` and ``context_chars`` go through ``kw``)."""
    try:
        cls = WORKLOADS[name]
    except KeyError:
        raise UnknownWorkloadError(f"unknown workload {name!r}; known workloads: {', '.join(WORKLOADS)}") from None
    return cls(data=data, **kw)

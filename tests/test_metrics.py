"""Answer metrics on hand-made strings: normalisation, exact match, token F1, ROUGE-L, best over references."""

from __future__ import annotations

import math
import random

import pytest

from cachecert_agents.eval.metrics import (
    _lcs_length,
    best_over_references,
    exact_match,
    mcnemar_exact,
    normalize_answer,
    rouge_l,
    token_f1,
)


def test_normalize_answer():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("  A cat, an owl and THE dog. ") == "cat owl and dog"
    assert normalize_answer("theory") == "theory"  # articles only as whole words
    assert normalize_answer("") == ""
    assert normalize_answer("the a an") == ""


def test_exact_match():
    assert exact_match("The Beatles.", "beatles") == 1.0
    assert exact_match("Paris", "paris, France") == 0.0
    assert exact_match("", "") == 1.0
    assert exact_match("the", "") == 1.0  # both normalise to empty


def test_token_f1_partial_overlap():
    # pred "barack obama" vs ref "president barack obama": P = 1, R = 2/3
    assert token_f1("Barack Obama", "President Barack Obama") == pytest.approx(0.8)
    # one shared token of 2 and 3: P = 1/2, R = 1/3 -> F1 = 0.4
    assert token_f1("red apple", "green pear apple") == pytest.approx(0.4)
    assert token_f1("New York", "new york") == 1.0
    assert token_f1("London", "Paris") == 0.0


def test_token_f1_counts_repeated_tokens_once_per_occurrence():
    # pred has "the" removed; "new new york" vs "new york": common = 2, P = 2/3, R = 1
    assert token_f1("new new york", "new york") == pytest.approx(0.8)


def test_token_f1_empty_cases():
    assert token_f1("", "") == 1.0
    assert token_f1("The", "a") == 1.0
    assert token_f1("", "answer") == 0.0
    assert token_f1("answer", "") == 0.0


def test_rouge_l_known_values():
    assert rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(0.75)  # LCS 3 of 4 and 4
    assert rouge_l("police killed the gunman", "the gunman police killed") == pytest.approx(2 / 3)
    # pred 2 tokens, ref 4 tokens, LCS 2: P = 1, R = 1/2 -> F = 2/3
    assert rouge_l("w y", "w x y z") == pytest.approx(2 / 3)
    assert rouge_l("Identical text here.", "identical text here") == 1.0
    assert rouge_l("x y z", "p q r") == 0.0


def test_rouge_l_empty_cases():
    assert rouge_l("", "") == 1.0
    assert rouge_l("", "some words") == 0.0
    assert rouge_l("some words", "") == 0.0


def _lcs_reference(a: list[str], b: list[str]) -> int:
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            table[i][j] = (table[i - 1][j - 1] + 1 if a[i - 1] == b[j - 1]
                           else max(table[i - 1][j], table[i][j - 1]))
    return table[-1][-1]


def test_lcs_matches_textbook_dp():
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.choice("pqrst") for _ in range(rng.randint(0, 15))]
        b = [rng.choice("pqrst") for _ in range(rng.randint(0, 15))]
        assert _lcs_length(a, b) == _lcs_reference(a, b), (a, b)


def test_rouge_l_handles_a_few_hundred_tokens():
    words = [f"w{i % 97}" for i in range(400)]
    assert rouge_l(" ".join(words), " ".join(words)) == 1.0
    assert 0.0 < rouge_l(" ".join(words), " ".join(reversed(words))) < 1.0


def test_best_over_references():
    assert best_over_references(exact_match, "NYC", ["New York City", "nyc"]) == 1.0
    assert best_over_references(token_f1, "Barack Obama", ["Obama", "President Barack Obama"]) == pytest.approx(0.8)
    assert best_over_references(token_f1, "anything", []) == 0.0


def test_mcnemar_exact_against_binomial_values():
    # 10 discordant pairs all one way: 2 * (1/2)^10; balanced or none: 1
    assert mcnemar_exact(10, 0) == pytest.approx(2 / 1024)
    assert mcnemar_exact(0, 10) == pytest.approx(2 / 1024)
    assert mcnemar_exact(5, 5) == pytest.approx(1.0)
    assert mcnemar_exact(0, 0) == 1.0
    # 21 against 4: 2 * P(Binomial(25, 1/2) <= 4)
    tail = sum(math.comb(25, k) for k in range(5)) / 2 ** 25
    assert mcnemar_exact(21, 4) == pytest.approx(2 * tail)
    assert mcnemar_exact(21, 4) == mcnemar_exact(4, 21)
    with pytest.raises(ValueError, match="non-negative"):
        mcnemar_exact(-1, 3)

"""Answer-quality metrics: SQuAD normalisation, exact match, token F1 and ROUGE-L.

All functions are pure and deterministic. Every metric compares *normalised* text (see
:func:`normalize_answer`): lower case, punctuation removed, the articles ``a``/``an``/``the`` removed and
whitespace collapsed. Conventions for empty strings (after normalisation): two empty strings match perfectly
(1.0); an empty string against a non-empty one scores 0.0.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["normalize_answer", "exact_match", "token_f1", "rouge_l", "best_over_references"]

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """SQuAD answer normalisation: lower case, drop punctuation, drop articles, collapse whitespace.

    The steps run in the order of the official SQuAD evaluation script (lower, remove punctuation, remove
    articles, fix whitespace), so ``"The  Eiffel-Tower!"`` becomes ``"eiffeltower"``.
    """
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _tokens(s: str) -> list[str]:
    return normalize_answer(s).split()


def exact_match(pred: str, ref: str) -> float:
    """1.0 when the normalised prediction equals the normalised reference, else 0.0."""
    return 1.0 if normalize_answer(pred) == normalize_answer(ref) else 0.0


def token_f1(pred: str, ref: str) -> float:
    """SQuAD token-level F1 between normalised prediction and reference tokens (multiset overlap).

    Both empty -> 1.0; exactly one empty -> 0.0.
    """
    p, r = _tokens(pred), _tokens(ref)
    if not p or not r:
        return 1.0 if not p and not r else 0.0
    common = sum((Counter(p) & Counter(r)).values())
    if common == 0:
        return 0.0
    precision = common / len(p)
    recall = common / len(r)
    return 2 * precision * recall / (precision + recall)


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence of two token lists, O(len(a) * len(b)) time, O(len(b)) memory.

    The classic DP row ``L[i][j] = L[i-1][j-1] + 1 if a[i-1] == b[j-1] else max(L[i-1][j], L[i][j-1])`` equals
    ``max(cand[j], L[i][j-1])`` with ``cand[j] = max(L[i-1][j], L[i-1][j-1] + [a[i-1] == b[j-1]])`` (a row never
    grows by more than one), i.e. a running maximum, which numpy computes per row.
    """
    if not a or not b:
        return 0
    vocab: dict[str, int] = {}
    b_ids = np.fromiter((vocab.setdefault(t, len(vocab)) for t in b), dtype=np.int64, count=len(b))
    prev = np.zeros(len(b) + 1, dtype=np.int64)
    for tok in a:
        tok_id = vocab.get(tok, -1)
        cand = np.maximum(prev[1:], prev[:-1] + (b_ids == tok_id))
        row = np.empty_like(prev)
        row[0] = 0
        row[1:] = np.maximum.accumulate(cand)
        prev = row
    return int(prev[-1])


def rouge_l(pred: str, ref: str) -> float:
    """ROUGE-L F-measure (beta = 1) on normalised whitespace tokens, via the longest common subsequence.

    ``P = LCS / len(pred)``, ``R = LCS / len(ref)``, ``F = 2PR / (P + R)``. Both empty -> 1.0; one empty -> 0.0.
    """
    p, r = _tokens(pred), _tokens(ref)
    if not p or not r:
        return 1.0 if not p and not r else 0.0
    lcs = _lcs_length(p, r)
    if lcs == 0:
        return 0.0
    precision = lcs / len(p)
    recall = lcs / len(r)
    return 2 * precision * recall / (precision + recall)


def best_over_references(metric: Callable[[str, str], float], pred: str, refs: Sequence[str]) -> float:
    """The best ``metric(pred, ref)`` over all references (aliases); 0.0 when there is no reference."""
    return max((metric(pred, ref) for ref in refs), default=0.0)


def ratio_interval(numerator: Sequence[float], denominator: Sequence[float], level: float = 0.95,
                   resamples: int = 2000, seed: int = 0) -> tuple[float | None, float | None]:
    """Paired percentile-bootstrap interval of ``mean(numerator) / mean(denominator)`` (e.g. retention: transfer
    scores over full-prefill scores of the same examples). Examples are resampled with replacement, keeping each
    pair together. Returns ``(low, high)`` at ``level``. A resample whose denominator sums to zero has ratio
    ``+inf`` when its numerator is positive (it stays in the upper tail: dropping it would pull ``high`` down) and
    none when both are zero (0/0, dropped); ``(None, None)`` when more than one tail's share (``(1 - level) / 2``)
    is dropped, and ``high`` None when the upper percentile itself is infinite (no finite upper bound)."""
    num, den = np.asarray(numerator, dtype=float), np.asarray(denominator, dtype=float)
    if num.shape != den.shape or num.ndim != 1 or num.size == 0:
        raise ValueError("numerator and denominator must be non-empty sequences of the same length")
    alpha = (1 - level) / 2
    idx = np.random.default_rng(seed).integers(0, num.size, size=(resamples, num.size))
    sums_den, sums_num = den[idx].sum(1), num[idx].sum(1)
    keep = (sums_den != 0) | (sums_num != 0)
    if keep.mean() < 1 - alpha:
        return None, None
    # x / 0 is +-inf for x != 0 (0 / 0 was dropped above); quantiles may interpolate between two infinities
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = sums_num[keep] / sums_den[keep]
        low, high = float(np.quantile(ratios, alpha)), float(np.quantile(ratios, 1 - alpha))
    return (low if np.isfinite(low) else None), (high if np.isfinite(high) else None)


def mcnemar_exact(only_first: int, only_second: int) -> float:
    """Two-sided exact McNemar p-value for paired binary outcomes (McNemar 1947, "Note on the sampling error of the
    difference between correlated proportions or percentages"): ``only_first`` pairs where the first method
    succeeds and the second fails, ``only_second`` the reverse. Under the null (either discordance equally likely)
    the first count is Binomial(n, 1/2), n = their sum; the p-value sums the probabilities no larger than the
    observed one. No discordant pair gives 1."""
    if only_first < 0 or only_second < 0:
        raise ValueError(f"counts must be non-negative, got {only_first}, {only_second}")
    n = only_first + only_second
    probs = [math.comb(n, k) / 2 ** n for k in range(n + 1)]
    observed = probs[only_first]
    return min(1.0, sum(p for p in probs if p <= observed * (1 + 1e-9)))

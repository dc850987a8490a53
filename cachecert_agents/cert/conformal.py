"""Certified acceptance thresholds for transferred KV caches: Conformal Risk Control and Learn-then-Test.

Setting. Each calibration request ``i = 1..n`` has a risk score ``r_i`` (higher = riskier) and a label
``unsafe_i`` (1 = the output produced with the transferred cache disagreed with full prefill). A transfer is
*accepted* when ``r_i <= lam``. The loss of a threshold is

    L_i(lam) = 1{r_i <= lam} * unsafe_i          (accepted AND unsafe),

which is non-decreasing in ``lam`` and bounded by ``B = 1``. ``lam = -inf`` means "never transfer" (loss 0);
``lam = +inf`` means "always transfer". The empirical risk ``R_hat(lam) = mean_i L_i(lam)`` is a right-continuous,
non-decreasing step function of ``lam`` that only changes at calibration scores, so every procedure here only
needs to look at :func:`candidate_thresholds`.

Two guarantees are offered:

* :func:`crc_threshold` -- Conformal Risk Control (Angelopoulos, Bates, Fisch, Lei, Schuster, "Conformal Risk
  Control", ICLR 2024, arXiv:2208.02814). Guarantee *in expectation* over calibration and test point:
  ``E[L_{n+1}(lam_hat)] <= alpha`` when the n calibration requests and the new one are exchangeable.
* :func:`ltt_threshold` -- Learn then Test (Angelopoulos, Bates, Candes, Jordan, Lei, "Learn then Test:
  Calibrating Predictive Algorithms to Achieve Risk Control", arXiv:2110.01052, Annals of Applied Statistics
  2025) with the Hoeffding-Bentkus p-value and fixed-sequence testing. Guarantee *with high probability*:
  ``P(R(lam_hat) <= alpha) >= 1 - delta`` over the draw of i.i.d. calibration data, where ``R`` is the
  population risk.

All functions are pure numpy (no scipy): inputs are array-likes, outputs plain floats / dicts.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from cachecert_agents.errors import CacheCertError

__all__ = [
    "InfeasibleRiskError",
    "empirical_risk",
    "candidate_thresholds",
    "crc_min_n",
    "crc_threshold",
    "hoeffding_bentkus_pvalue",
    "ltt_min_n",
    "ltt_threshold",
    "certify",
    "calibration_gain",
    "guard_threshold",
    "split_validation",
]

# Slack for float round-off when comparing sums of 0/1 losses with alpha * (n + 1) - B, and when turning
# n * R_hat back into an integer count. Far below any real change of the risk (which moves in steps of 1/n).
_TOL = 1e-9


class InfeasibleRiskError(CacheCertError):
    """No threshold satisfies the requested risk bound with this calibration set, not even "never transfer".

    The message states ``n``, ``alpha`` (and ``delta``) and the minimum calibration size needed when it can be
    computed: collect more calibration requests or relax ``alpha`` / ``delta``."""


# ----------------------------------------------------------------------------------------------- validation


def _as_arrays(scores: ArrayLike, unsafe: ArrayLike, bound: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=float).reshape(-1)
    u = np.asarray(unsafe, dtype=float).reshape(-1)
    if s.shape != u.shape:
        raise ValueError(f"scores and unsafe must have the same length, got {s.size} and {u.size}")
    if s.size == 0:
        raise ValueError("the calibration set is empty: pass at least one (score, unsafe) pair")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores must be finite (no NaN or inf): drop or repair the offending requests")
    if not np.all(np.isfinite(u)) or u.min() < 0.0 or u.max() > bound:
        raise ValueError(f"unsafe labels (losses) must lie in [0, {bound}], got range [{u.min()}, {u.max()}]")
    return s, u


def _check_alpha(alpha: float, upper: float = 1.0) -> float:
    alpha = float(alpha)
    if not (0.0 < alpha < upper):
        raise ValueError(f"alpha must lie in (0, {upper}), got {alpha}")
    return alpha


def _check_delta(delta: float) -> float:
    delta = float(delta)
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    return delta


def _risk_curve(s: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidates ``[-inf, unique sorted scores...]`` and the summed loss ``sum_i L_i(lam)`` at each of them.

    Ties: the sum at a candidate includes *every* calibration point whose score equals it (``<=``)."""
    order = np.argsort(s, kind="stable")
    s_sorted, u_sorted = s[order], u[order]
    csum = np.cumsum(u_sorted)
    uniq, last = np.unique(s_sorted[::-1], return_index=True)  # last occurrence of each value in s_sorted
    last = s_sorted.size - 1 - last
    cand = np.concatenate(([-np.inf], uniq))
    loss_sum = np.concatenate(([0.0], csum[last]))
    return cand, loss_sum


# ------------------------------------------------------------------------------------------ basic quantities


def empirical_risk(scores: ArrayLike, unsafe: ArrayLike, lam: float) -> float:
    """Empirical risk ``R_hat(lam) = (1/n) sum_i 1{score_i <= lam} * unsafe_i`` (accepted-and-unsafe rate).

    ``lam = -inf`` gives 0 (never transfer); ``lam = +inf`` gives the mean of ``unsafe``."""
    s, u = _as_arrays(scores, unsafe, bound=np.inf)
    return float(np.mean((s <= lam) * u))


def candidate_thresholds(scores: ArrayLike) -> np.ndarray:
    """``-inf`` followed by the sorted unique scores: the only thresholds at which ``R_hat`` can change.

    Because ``R_hat`` is right-continuous and constant on ``[c_j, c_{j+1})``, any supremum / fixed-sequence walk
    over real-valued thresholds is reproduced exactly by walking these candidates."""
    s = np.asarray(scores, dtype=float).reshape(-1)
    if np.any(np.isnan(s)):
        raise ValueError("scores must not contain NaN")
    return np.concatenate(([-np.inf], np.unique(s)))


# ----------------------------------------------------------------------------------------------------- CRC


def crc_min_n(alpha: float, B: float = 1.0) -> int:
    """Smallest calibration size for which CRC can certify anything: ``B / (n + 1) <= alpha``, i.e.
    ``n >= B / alpha - 1``."""
    return max(1, math.ceil(B / alpha - 1.0 - _TOL))


def crc_threshold(scores: ArrayLike, unsafe: ArrayLike, alpha: float, B: float = 1.0) -> float:
    """Conformal Risk Control threshold (Angelopoulos et al., "Conformal Risk Control", ICLR 2024, Thm. 1).

    Orientation: a request is accepted when ``score <= lam``; the loss ``1{score <= lam} * unsafe`` is
    non-decreasing in ``lam`` and bounded by ``B``. Returns

        lam_hat = max{ lam in candidate_thresholds(scores) : (n/(n+1)) R_hat_n(lam) + B/(n+1) <= alpha },

    the largest *candidate* in the feasible set (the paper's inf over a non-increasing loss, mirrored). Since
    ``R_hat_n`` is a non-decreasing step function the feasible set is a prefix of the candidates, found by a scan.

    * Ties: ``lam_hat`` is a calibration score (or ``+-inf``) and every calibration point with
      ``score == lam_hat`` is accepted; the bound above holds with all of them counted.
    * Between ``lam_hat`` and the next calibration score the calibration risk is unchanged; returning the lower
      end means a new request scored strictly inside that gap is rejected (conservative, still valid).
    * If the bound already holds with every calibration point accepted, ``R_hat_n`` is constant beyond the
      largest score and the feasible set is all of the real line: ``np.inf`` is returned (always transfer).
    * If even ``lam = -inf`` (never transfer, ``R_hat = 0``) is infeasible, i.e. ``B/(n+1) > alpha``,
      :class:`InfeasibleRiskError` is raised (needs ``n >= B/alpha - 1``).

    Guarantee: if the n calibration pairs and a new pair are exchangeable, ``E[L_{n+1}(lam_hat)] <= alpha``.
    (Proof sketch in this orientation: ``lam_hat`` is also feasible for the (n+1)-sample oracle
    ``R_hat_{n+1}(lam) <= alpha`` because ``L_{n+1} <= B``; the oracle's largest feasible candidate is a symmetric
    function of the n+1 points, so its expected test loss equals its expected empirical risk <= alpha, and the
    loss is monotone in ``lam``.) ``alpha`` must lie in ``(0, B)``.
    """
    B = float(B)
    if not B > 0:
        raise ValueError(f"the loss bound B must be positive, got {B}")
    alpha = _check_alpha(alpha, upper=B)
    s, u = _as_arrays(scores, unsafe, bound=B)
    n = s.size
    budget = alpha * (n + 1) - B  # feasible  <=>  sum_i L_i(lam) <= alpha (n+1) - B
    if budget < -_TOL:
        raise InfeasibleRiskError(
            f"conformal risk control is infeasible with n={n} calibration requests at alpha={alpha} (B={B}): "
            f"even never transferring gives B/(n+1)={B / (n + 1):.4g} > alpha. "
            f"Need n >= B/alpha - 1, i.e. at least {crc_min_n(alpha, B)} calibration requests, or a larger alpha.")
    cand, loss_sum = _risk_curve(s, u)
    feasible = loss_sum <= budget + _TOL
    k = int(np.count_nonzero(feasible))  # prefix length (loss_sum is non-decreasing)
    if k == cand.size:
        return float(np.inf)
    return float(cand[k - 1])


# ------------------------------------------------------------------------------------------ Hoeffding-Bentkus


def _h1(a: np.ndarray, b: float) -> np.ndarray:
    """Bernoulli KL divergence ``h1(a, b) = a log(a/b) + (1-a) log((1-a)/(1-b))`` with the 0 log 0 = 0 limits."""
    a = np.asarray(a, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        t1 = np.where(a > 0, a * np.log(np.where(a > 0, a, 1.0) / b), 0.0)
        t2 = np.where(a < 1, (1 - a) * np.log(np.where(a < 1, 1 - a, 1.0) / (1 - b)), 0.0)
    return t1 + t2


@functools.lru_cache(maxsize=64)
def _binom_logcdf(n: int, alpha: float) -> np.ndarray:
    """``log P(Binomial(n, alpha) <= k)`` for ``k = 0..n``: exact log-pmf via ``math.lgamma``, then a running
    log-sum-exp (accurate to floating-point precision). Cached per ``(n, alpha)``; read-only."""
    ln_n1 = math.lgamma(n + 1)
    la, lb = math.log(alpha), math.log1p(-alpha)
    logpmf = np.array([ln_n1 - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * la + (n - k) * lb
                       for k in range(n + 1)])
    logcdf = np.minimum(np.logaddexp.accumulate(logpmf), 0.0)
    logcdf[-1] = 0.0
    logcdf.setflags(write=False)
    return logcdf


def _hb_pvalues(risk_hat: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """Vectorised :func:`hoeffding_bentkus_pvalue` over an array of empirical risks (same n, alpha)."""
    r = np.asarray(risk_hat, dtype=float)
    hoeffding = np.exp(-n * _h1(np.minimum(r, alpha), alpha))
    m = np.ceil(n * r - _TOL).astype(np.int64)
    m = np.clip(m, 0, n)
    bentkus = math.e * np.exp(_binom_logcdf(n, alpha)[m])
    return np.minimum(hoeffding, bentkus)


def hoeffding_bentkus_pvalue(risk_hat: float, n: int, alpha: float) -> float:
    """Hoeffding-Bentkus p-value for the null ``H0: R(lam) > alpha`` (Learn then Test, Angelopoulos, Bates,
    Candes, Jordan, Lei, arXiv:2110.01052, Prop. 3 / Sec. 3.1.1)::

        p = min( exp(-n * h1(min(R_hat, alpha), alpha)),  e * P(Binomial(n, alpha) <= ceil(n * R_hat)) )

    with ``h1(a, b) = a log(a/b) + (1-a) log((1-a)/(1-b))`` (Hoeffding 1963; Bentkus, "On Hoeffding's
    inequalities", Ann. Probab. 2004). Valid (super-uniform under the null) for losses in ``[0, 1]``; the binomial
    CDF is computed exactly in log space with ``math.lgamma`` (no scipy). ``R_hat = 0`` gives
    ``(1 - alpha)^n``; ``R_hat >= alpha`` gives a p-value of at least ``min(1, e * P(Bin <= n alpha))``."""
    r = float(risk_hat)
    if not (0.0 <= r <= 1.0):
        raise ValueError(f"risk_hat must lie in [0, 1], got {r}")
    if int(n) != n or n < 1:
        raise ValueError(f"n must be a positive integer, got {n}")
    alpha = _check_alpha(alpha)
    return float(_hb_pvalues(np.array([r]), int(n), alpha)[0])


# ----------------------------------------------------------------------------------------------------- LTT


def ltt_min_n(alpha: float, delta: float) -> int:
    """Smallest n at which LTT with the HB p-value certifies "never transfer": ``(1 - alpha)^n <= delta``."""
    return max(1, math.ceil(math.log(delta) / math.log1p(-alpha) - _TOL))


def ltt_threshold(scores: ArrayLike, unsafe: ArrayLike, alpha: float, delta: float) -> float:
    """Learn-then-Test threshold with Hoeffding-Bentkus p-values and fixed-sequence testing (Angelopoulos et al.,
    "Learn then Test", arXiv:2110.01052, Thm. 1 with the fixed-sequence FWER procedure, Sec. 4).

    Walks :func:`candidate_thresholds` from the conservative end (``-inf`` = never transfer, tested formally
    with ``R_hat = 0``, which needs ``(1 - alpha)^n <= delta``) towards larger ``lam`` and rejects
    ``H0: R(lam) > alpha`` while the HB p-value is ``<= delta``; returns the last rejected (certified) candidate,
    or ``np.inf`` when every candidate is certified (``R_hat`` is constant beyond the largest score).

    The walk over data-dependent candidates is the same as a fixed-sequence walk over the whole real line: the
    p-value depends on the data only through ``R_hat(lam)``, which is constant on ``[c_j, c_{j+1})``, and a
    monotone walk over a continuum of nested nulls still controls the FWER at ``delta``.

    Guarantee: for i.i.d. calibration data, ``P(R(lam_hat) <= alpha) >= 1 - delta`` where ``R`` is the population
    risk ``P(score <= lam, unsafe)``. Raises :class:`InfeasibleRiskError` when not even ``-inf`` is certified."""
    alpha = _check_alpha(alpha)
    delta = _check_delta(delta)
    s, u = _as_arrays(scores, unsafe, bound=1.0)
    n = s.size
    cand, loss_sum = _risk_curve(s, u)
    p = _hb_pvalues(loss_sum / n, n, alpha)
    rejected = p <= delta
    if not rejected[0]:
        raise InfeasibleRiskError(
            f"learn-then-test is infeasible with n={n} calibration requests at alpha={alpha}, delta={delta}: "
            f"even never transferring has Hoeffding-Bentkus p-value {p[0]:.4g} > delta. Need (1-alpha)^n <= delta, "
            f"i.e. at least {ltt_min_n(alpha, delta)} calibration requests, or a larger alpha / delta.")
    k = cand.size if rejected.all() else int(np.argmin(rejected))  # first non-rejected index
    if k == cand.size:
        return float(np.inf)
    return float(cand[k - 1])


# ------------------------------------------------------------------------------------------------- wrappers


def certify(scores: ArrayLike, unsafe: ArrayLike, alpha: float, delta: float | None = None) -> dict[str, Any]:
    """Fit a certified acceptance threshold: CRC (``delta is None``, guarantee in expectation) or LTT (guarantee
    with probability ``>= 1 - delta``). Returns ``{"method", "lambda", "alpha", "delta", "n",
    "empirical_risk_at_lambda", "accept_rate"}``; raises :class:`InfeasibleRiskError` like the fitters."""
    s, u = _as_arrays(scores, unsafe)
    if delta is None:
        method, lam = "crc", crc_threshold(s, u, alpha)
    else:
        method, lam = "ltt", ltt_threshold(s, u, alpha, delta)
    accepted = s <= lam
    return {
        "method": method,
        "lambda": lam,
        "alpha": float(alpha),
        "delta": None if delta is None else float(delta),
        "n": int(s.size),
        "empirical_risk_at_lambda": float(np.mean(accepted * u)),
        "accept_rate": float(np.mean(accepted)),
    }


def calibration_gain(scores: ArrayLike, lam: float, gain_accepted: ArrayLike, gain_rejected: ArrayLike) -> float:
    """Mean gain of the rule ``accept iff score <= lam`` on the calibration requests themselves (e.g. the fraction
    of prefill saved: ``gain_accepted`` for a served transfer, ``gain_rejected`` (negative: the wasted transfer and
    scoring) for a refused one); 0 for ``lam = -inf`` (a rule that accepts nothing is never tried)."""
    s = np.asarray(scores, dtype=float).reshape(-1)
    if lam == -np.inf:
        return 0.0
    return float(np.mean(np.where(s <= lam, np.asarray(gain_accepted, float), np.asarray(gain_rejected, float))))


def guard_threshold(scores: ArrayLike, lam: float, gain_accepted: ArrayLike, gain_rejected: ArrayLike) -> float:
    """The *savings guard*: ``-inf`` (never transfer) when the certified rule ``lam`` does not pay on its own
    calibration requests (:func:`calibration_gain` ``<= 0``), else ``lam`` unchanged.

    Validity is kept: the guarded threshold is a function of the calibration data only, and its loss
    ``1{score <= lam'} * unsafe`` is pointwise at most that of ``lam`` (never transferring has loss 0), so CRC's
    ``E[L_{n+1}] <= alpha`` and LTT's ``P(R <= alpha) >= 1 - delta`` carry over unchanged. What changes is the
    cost: a route whose refusals would cost more than its served transfers save is switched off rather than
    deployed at a loss (a data-dependent choice, so its saving is estimated, not guaranteed)."""
    if lam == -np.inf or calibration_gain(scores, lam, gain_accepted, gain_rejected) > 0:
        return lam
    return float(-np.inf)


def split_validation(scores: ArrayLike, unsafe: ArrayLike, alpha: float, n_cal: int, splits: int,
                     rng_seed: int | None = 0, delta: float | None = None, gain_accepted: ArrayLike | None = None,
                     gain_rejected: ArrayLike | None = None, guard: bool = False) -> dict[str, Any]:
    """Repeat ``splits`` random calibration/test splits of a labelled pool (calibration size ``n_cal``, test =
    the rest), fit ``lam_hat`` on calibration (CRC if ``delta is None`` else LTT) and measure the realised test
    risk ``mean_test 1{score <= lam_hat} * unsafe``.

    For CRC, random splits of a fixed pool are exchangeable, so the mean test risk over splits estimates a
    quantity that is ``<= alpha`` exactly. For LTT, ``frac_risk_above_alpha`` should be ``<= delta`` up to the
    test-set sampling noise. Infeasible splits are counted in ``n_infeasible`` and excluded from the statistics
    (which are NaN when every split is infeasible). Returns a dict with ``method, alpha, delta, n_cal, n_test,
    splits, n_infeasible, test_risk_mean, test_risk_std, test_risk_se, test_risk_max, frac_risk_above_alpha,
    accept_rate_mean, test_risks`` (array of the feasible splits' risks). With per-request ``gain_accepted`` and
    ``gain_rejected`` (e.g. the fraction of prefill saved when a transfer is served, and the negative cost of a
    refused one), also ``gain_mean, gain_std``: the mean test gain per split, averaged over splits (0 for a split
    whose threshold is ``-inf``: a certificate that accepts nothing is never tried). ``guard`` (needs the gains)
    applies :func:`guard_threshold` to each split's threshold on that split's calibration half; ``n_guarded``
    counts the splits it switched off. With gains, the guarded rule's ``gain_mean, test_risk_mean,
    test_risk_max, accept_rate_mean`` are also returned under ``guarded`` (same splits, one pass), whatever
    ``guard`` is."""
    s, u = _as_arrays(scores, unsafe)
    n = s.size
    n_cal, splits = int(n_cal), int(splits)
    if not (1 <= n_cal < n):
        raise ValueError(f"n_cal must lie in [1, {n - 1}] for a pool of {n} requests, got {n_cal}")
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    rng = np.random.default_rng(rng_seed)
    n_infeasible = n_guarded = 0
    ga = None if gain_accepted is None else np.asarray(gain_accepted, dtype=float)
    gr = np.zeros(n) if gain_rejected is None else np.asarray(gain_rejected, dtype=float)
    if guard and ga is None:
        raise ValueError("guard=True needs gain_accepted (and gain_rejected): the guard compares savings")
    # per split: realised risk, acceptance and gain of the plain threshold (False) and, with gains, the guarded one
    outcomes: dict[bool, tuple[list[float], list[float], list[float]]] = {False: ([], [], []), True: ([], [], [])}
    for _ in range(splits):
        perm = rng.permutation(n)
        cal, test = perm[:n_cal], perm[n_cal:]
        try:
            if delta is None:
                lam = crc_threshold(s[cal], u[cal], alpha)
            else:
                lam = ltt_threshold(s[cal], u[cal], alpha, delta)
        except InfeasibleRiskError:
            n_infeasible += 1
            continue
        guarded = lam if ga is None else guard_threshold(s[cal], lam, ga[cal], gr[cal])
        n_guarded += guarded != lam
        for use_guard, threshold in ((False, lam), (True, guarded)) if ga is not None else ((False, lam),):
            risks, accepts, gains = outcomes[use_guard]
            acc = s[test] <= threshold
            risks.append(float(np.mean(acc * u[test])))
            accepts.append(float(np.mean(acc)))
            if ga is not None:  # a certificate that accepts nothing is never tried: no gain, no cost
                gains.append(calibration_gain(s[test], threshold, ga[test], gr[test]))
    risks, accepts, gains = outcomes[guard]
    r = np.asarray(risks, dtype=float)
    k = r.size
    nan = float("nan")
    std = float(np.std(r, ddof=1)) if k >= 2 else (0.0 if k == 1 else nan)
    g_risks, g_accepts, g_gains = outcomes[True]
    guarded_summary = {"gain_mean": float(np.mean(g_gains)) if g_gains else nan,
                       "test_risk_mean": float(np.mean(g_risks)) if g_risks else nan,
                       "test_risk_max": float(np.max(g_risks)) if g_risks else nan,
                       "accept_rate_mean": float(np.mean(g_accepts)) if g_accepts else nan}
    return {
        "method": "crc" if delta is None else "ltt",
        "alpha": float(alpha),
        "delta": None if delta is None else float(delta),
        "n_cal": n_cal,
        "n_test": n - n_cal,
        "splits": splits,
        "n_infeasible": n_infeasible,
        "n_guarded": n_guarded,
        "test_risk_mean": float(r.mean()) if k else nan,
        "test_risk_std": std,
        "test_risk_se": std / math.sqrt(k) if k else nan,
        "test_risk_max": float(r.max()) if k else nan,
        "frac_risk_above_alpha": float(np.mean(r > alpha)) if k else nan,
        "accept_rate_mean": float(np.mean(accepts)) if k else nan,
        "test_risks": r,
        **({"guarded": guarded_summary} if ga is not None else {}),
        **({"gain_mean": float(np.mean(gains)) if gains else nan,
            "gain_std": float(np.std(gains, ddof=1)) if len(gains) >= 2 else nan} if ga is not None else {}),
    }

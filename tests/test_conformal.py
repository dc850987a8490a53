"""Statistical and edge-case tests of certified thresholds (CRC and Learn-then-Test) on synthetic scores whose
population risk is known in closed form: s ~ U(0, 1), P(unsafe | s) = sigmoid(4 (s - 0.5)), hence
R(lam) = P(s <= lam, unsafe) = (softplus(4 (lam - 0.5)) - softplus(-2)) / 4 on [0, 1]."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from cachecert_agents.cert.conformal import (
    InfeasibleRiskError,
    candidate_thresholds,
    certify,
    crc_threshold,
    empirical_risk,
    hoeffding_bentkus_pvalue,
    ltt_threshold,
    split_validation,
)
from cachecert_agents.errors import CacheCertError


def _softplus(x: np.ndarray | float) -> np.ndarray:
    return np.logaddexp(0.0, x)


def population_risk(lam: float) -> float:
    """Exact R(lam) of the synthetic population."""
    c = min(max(lam, 0.0), 1.0)  # clamps -inf to 0 and +inf to 1
    return float((_softplus(4 * (c - 0.5)) - _softplus(-2.0)) / 4)


def draw(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    s = rng.random(n)
    p = 1.0 / (1.0 + np.exp(-4 * (s - 0.5)))
    return s, (rng.random(n) < p).astype(float)


def test_population_risk_formula():
    rng = np.random.default_rng(0)
    s, u = draw(rng, 200_000)
    for lam in (0.1, 0.3, 0.6, 1.0):
        assert empirical_risk(s, u, lam) == pytest.approx(population_risk(lam), abs=5e-3)
    assert population_risk(-np.inf) == 0.0 and population_risk(np.inf) == pytest.approx(0.5)


# ------------------------------------------------------------------------------------------- basic helpers


def test_empirical_risk_and_candidates():
    s = np.array([0.3, 0.1, 0.3, 0.9])
    u = np.array([1, 0, 0, 1])
    assert empirical_risk(s, u, -np.inf) == 0.0
    assert empirical_risk(s, u, 0.1) == 0.0
    assert empirical_risk(s, u, 0.3) == 0.25  # both tied points accepted
    assert empirical_risk(s, u, np.inf) == 0.5
    np.testing.assert_array_equal(candidate_thresholds(s), [-np.inf, 0.1, 0.3, 0.9])


def test_input_validation():
    with pytest.raises(ValueError):
        crc_threshold([0.1, 0.2], [1], 0.1)
    with pytest.raises(ValueError):
        crc_threshold([], [], 0.1)
    with pytest.raises(ValueError):
        crc_threshold([0.1, np.nan], [0, 1], 0.5)
    with pytest.raises(ValueError):
        crc_threshold([0.1, 0.2], [0, 2], 0.5)
    with pytest.raises(ValueError):
        ltt_threshold([0.1, 0.2], [0, 1], 0.1, 1.5)
    with pytest.raises(ValueError):
        hoeffding_bentkus_pvalue(1.2, 10, 0.1)


# ----------------------------------------------------------------------------------------------------- CRC


@pytest.mark.parametrize("alpha", [0.05, 0.1, 0.2])
def test_crc_expected_risk_controlled(alpha):
    """E[R(lam_hat)] <= alpha (population risk, fresh i.i.d. calibration sets), and CRC is nearly tight."""
    rng = np.random.default_rng(int(alpha * 1000))
    n, trials = 200, 600
    risks = np.array([population_risk(crc_threshold(*draw(rng, n), alpha)) for _ in range(trials)])
    se = risks.std(ddof=1) / math.sqrt(trials)
    assert risks.mean() <= alpha + 3 * se
    assert risks.mean() >= alpha - 3.0 / (n + 1) - 3 * se  # not vacuous: within a few B/(n+1) of alpha


@pytest.mark.parametrize("alpha", [0.05, 0.1, 0.2])
def test_crc_split_validation_mean_risk(alpha):
    """Random splits of one fixed pool are exchangeable: mean realised test risk <= alpha (+ 3 MC s.e.)."""
    rng = np.random.default_rng(7)
    s, u = draw(rng, 4000)
    res = split_validation(s, u, alpha, n_cal=200, splits=500, rng_seed=1)
    assert res["method"] == "crc" and res["n_infeasible"] == 0 and res["n_test"] == 3800
    assert res["test_risks"].shape == (500,)
    assert res["test_risk_mean"] <= alpha + 3 * res["test_risk_se"]
    assert res["test_risk_mean"] >= alpha - 0.03
    assert 0.0 < res["accept_rate_mean"] < 1.0
    assert res["test_risk_max"] >= res["test_risk_mean"]


def test_crc_infeasible_small_n():
    s, u = np.linspace(0, 1, 5), np.zeros(5)
    with pytest.raises(InfeasibleRiskError, match=r"n=5") as info:
        crc_threshold(s, u, 0.05)
    assert isinstance(info.value, CacheCertError)
    assert "19" in str(info.value)  # n >= 1/alpha - 1 = 19
    assert crc_threshold(np.linspace(0, 1, 19), np.zeros(19), 0.05) == np.inf  # boundary n is feasible
    with pytest.raises(InfeasibleRiskError, match=r"n=18"):
        crc_threshold(np.linspace(0, 1, 18), np.zeros(18), 0.05)


def test_crc_ties():
    rng = np.random.default_rng(3)
    levels = np.round(np.arange(0.1, 1.0, 0.1), 1)
    s = rng.choice(levels, size=400)
    u = (rng.random(400) < s).astype(float)  # riskier at high scores
    alpha, n = 0.1, 400
    lam = crc_threshold(s, u, alpha)
    assert lam in set(s.tolist())
    accepted = s <= lam
    assert accepted[s == lam].all() and (s == lam).sum() > 1
    r_hat = empirical_risk(s, u, lam)
    assert n / (n + 1) * r_hat + 1 / (n + 1) <= alpha
    nxt = levels[levels > lam].min()  # maximality: the next tie group breaks the bound
    assert n / (n + 1) * empirical_risk(s, u, nxt) + 1 / (n + 1) > alpha


def test_crc_all_safe_returns_inf_and_monotone_in_alpha():
    rng = np.random.default_rng(4)
    s = rng.random(300)
    assert crc_threshold(s, np.zeros(300), 0.05) == np.inf
    assert ltt_threshold(s, np.zeros(300), 0.05, 0.1) == np.inf
    s, u = draw(rng, 500)
    alphas = [0.4, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01]
    crc = [crc_threshold(s, u, a) for a in alphas]
    ltt = [ltt_threshold(s, u, a, 0.1) for a in alphas]
    assert all(x >= y for x, y in zip(crc, crc[1:]))
    assert all(x >= y for x, y in zip(ltt, ltt[1:]))
    assert all(x >= y for x, y in zip(crc, ltt))  # LTT (high probability) is more conservative here


@pytest.mark.parametrize("method", ["crc", "ltt"])
def test_orientation_not_flipped(method):
    rng = np.random.default_rng(5)
    n, alpha = 1000, 0.1
    s = rng.random(n)
    delta = None if method == "crc" else 0.1
    high = certify(s, (s > 0.7).astype(float), alpha, delta)  # unsafe only at HIGH scores
    assert high["method"] == method
    assert 0.7 <= high["accept_rate"] <= 0.7 + alpha + 0.03
    assert high["lambda"] > 0.69
    low = certify(s, (s < 0.3).astype(float), alpha, delta)  # unsafe only at LOW scores
    assert low["accept_rate"] <= alpha  # only the alpha budget of (unsafe) low scores, never the safe top
    assert low["lambda"] < 0.3
    assert low["empirical_risk_at_lambda"] == pytest.approx(low["accept_rate"])
    everything_unsafe = certify(s, np.ones(n), alpha, delta)
    assert everything_unsafe["accept_rate"] <= alpha


def test_certify_dict():
    rng = np.random.default_rng(6)
    s, u = draw(rng, 400)
    out = certify(s, u, 0.1)
    assert set(out) == {"method", "lambda", "alpha", "delta", "n", "empirical_risk_at_lambda", "accept_rate"}
    assert out["method"] == "crc" and out["delta"] is None and out["n"] == 400
    assert out["lambda"] == crc_threshold(s, u, 0.1)
    assert out["empirical_risk_at_lambda"] == empirical_risk(s, u, out["lambda"])
    out = certify(s, u, 0.1, delta=0.1)
    assert out["method"] == "ltt" and out["delta"] == 0.1 and out["lambda"] == ltt_threshold(s, u, 0.1, 0.1)


# ----------------------------------------------------------------------------------------------------- LTT


def test_ltt_high_probability_guarantee():
    """P(R(lam_hat) > alpha) <= delta (population risk, fresh calibration sets); a naive plug-in threshold
    (largest lam with R_hat <= alpha) violates far more often, so the check has power."""
    rng = np.random.default_rng(8)
    alpha, delta, n, trials = 0.1, 0.1, 300, 600
    viol, naive_viol, risks = 0, 0, []
    for _ in range(trials):
        s, u = draw(rng, n)
        r = population_risk(ltt_threshold(s, u, alpha, delta))
        risks.append(r)
        viol += r > alpha
        order = np.argsort(s)
        r_hat = np.cumsum(u[order]) / n  # scores are continuous: no ties
        ok = np.flatnonzero(r_hat <= alpha)
        naive = s[order][ok[-1]] if ok.size else -np.inf
        naive_viol += population_risk(naive) > alpha
    margin = 3 * math.sqrt(delta * (1 - delta) / trials)
    assert viol / trials <= delta + margin
    assert naive_viol / trials > 0.3
    assert np.mean(risks) > alpha / 3  # conservative but not vacuous


def test_ltt_split_validation():
    rng = np.random.default_rng(9)
    alpha, delta = 0.1, 0.1
    s, u = draw(rng, 20_000)
    res = split_validation(s, u, alpha, n_cal=1000, splits=500, rng_seed=2, delta=delta)
    assert res["method"] == "ltt" and res["n_infeasible"] == 0
    assert res["frac_risk_above_alpha"] <= delta + 3 * math.sqrt(delta * (1 - delta) / 500)
    assert res["test_risk_mean"] <= alpha
    assert res["accept_rate_mean"] > 0.2


def test_ltt_infeasible():
    # (1 - 0.1)^n <= 0.1 needs n >= 22
    with pytest.raises(InfeasibleRiskError, match=r"n=21.*delta=0.1.*22"):
        ltt_threshold(np.linspace(0, 1, 21), np.zeros(21), 0.1, 0.1)
    assert ltt_threshold(np.linspace(0, 1, 22), np.zeros(22), 0.1, 0.1) == np.inf
    res = split_validation(np.linspace(0, 1, 40), np.zeros(40), 0.1, n_cal=10, splits=5, delta=0.1)
    assert res["n_infeasible"] == 5 and math.isnan(res["test_risk_mean"])


# ------------------------------------------------------------------------------------------ HB p-value


def _brute_hb(k: int, n: int, alpha: float) -> float:
    """HB p-value at R_hat = k/n with an exact rational binomial CDF."""
    a = Fraction(alpha).limit_denominator(10**6)
    cdf = sum(math.comb(n, j) * a**j * (1 - a) ** (n - j) for j in range(0, k + 1))
    r = min(k / n, alpha)
    h1 = (r * math.log(r / alpha) if r > 0 else 0.0) + (1 - r) * math.log((1 - r) / (1 - alpha))
    return min(math.exp(-n * h1), math.e * float(cdf))


def test_hb_pvalue_sanity():
    assert hoeffding_bentkus_pvalue(0.0, 100, 0.1) < 1e-3
    assert hoeffding_bentkus_pvalue(0.0, 100, 0.1) == pytest.approx(0.9**100, rel=1e-9)
    assert hoeffding_bentkus_pvalue(0.1, 100, 0.1) >= 0.5
    assert hoeffding_bentkus_pvalue(0.5, 100, 0.1) == 1.0
    ps = [hoeffding_bentkus_pvalue(k / 50, 50, 0.2) for k in range(51)]
    assert all(x <= y for x, y in zip(ps, ps[1:]))  # non-decreasing in R_hat
    assert all(0.0 < p <= 1.0 for p in ps)


@pytest.mark.parametrize("n,alpha", [(1, 0.3), (7, 0.1), (20, 0.25), (40, 0.05)])
def test_hb_pvalue_matches_bruteforce(n, alpha):
    for k in range(n + 1):
        assert hoeffding_bentkus_pvalue(k / n, n, alpha) == pytest.approx(_brute_hb(k, n, alpha), rel=1e-9)



def test_savings_guard_switches_off_a_rule_that_does_not_pay_and_keeps_the_risk_bound():
    """guard_threshold returns -inf when the rule loses on its calibration requests; under split validation the
    guarded rule's risk is pointwise at most the unguarded one's (so the bound carries over), and a route whose
    refusals cost more than its served transfers save ends at 0 instead of a loss."""
    from cachecert_agents.cert.conformal import calibration_gain, guard_threshold

    s = np.array([0.1, 0.2, 0.3, 0.4])
    assert calibration_gain(s, 0.2, np.full(4, 0.9), np.full(4, -0.5)) == pytest.approx((0.9 * 2 - 0.5 * 2) / 4)
    assert guard_threshold(s, 0.2, np.full(4, 0.9), np.full(4, -0.5)) == 0.2  # pays: kept
    assert guard_threshold(s, 0.1, np.full(4, 0.9), np.full(4, -0.5)) == -np.inf  # 0.9 - 1.5 < 0: off
    assert guard_threshold(s, -np.inf, np.full(4, 0.9), np.full(4, -0.5)) == -np.inf
    assert calibration_gain(s, -np.inf, np.ones(4), -np.ones(4)) == 0.0
    rng = np.random.default_rng(3)
    scores, unsafe = draw(rng, 300)
    for refused_cost, served_gain in ((0.6, 0.7), (0.01, 0.9)):  # a costly repair that rarely pays; a cheap map
        kw = dict(alpha=0.1, n_cal=150, splits=200, rng_seed=0, gain_accepted=np.full(300, served_gain),
                  gain_rejected=np.full(300, -refused_cost))
        plain, guarded = split_validation(scores, unsafe, **kw), split_validation(scores, unsafe, guard=True, **kw)
        assert np.all(guarded["test_risks"] <= plain["test_risks"] + 1e-12)
        assert guarded["test_risk_mean"] <= 0.1 + 3 * max(guarded["test_risk_se"], 1e-9)
        if refused_cost == 0.6:
            assert plain["gain_mean"] < 0 and guarded["n_guarded"] > 150 and guarded["gain_mean"] > plain["gain_mean"]
        else:
            assert guarded["n_guarded"] == 0 and guarded["gain_mean"] == plain["gain_mean"] > 0
    with pytest.raises(ValueError, match="guard"):
        split_validation(scores, unsafe, 0.1, 150, 5, guard=True)

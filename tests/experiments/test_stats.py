"""Intervals, paired tests and the verdict, on numbers whose answer is known by hand or by an independent route."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sst

from difftransformer.experiments.stats import (
    Interval,
    beside,
    compare_paired,
    format_p,
    holm,
    mean_std,
    number_format,
    paired_differences,
    t_interval,
    verdict,
    verdict_text,
)

# t quantile 0.975 with 2 degrees of freedom; for df = 2 it is (2p − 1) / sqrt(2p(1 − p)) = 4.3026527297
T_975_2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)


def test_paired_differences_use_the_seeds_both_arms_have():
    assert paired_differences({0: 3.0, 1: 3.5, 2: 4.0}, {0: 2.5, 2: 3.0, 5: 1.0}) == [0.5, 1.0]
    assert paired_differences({}, {0: 1.0}) == []


def test_mean_and_sample_std():
    assert mean_std([2.0]) == (2.0, None)
    m, s = mean_std([1.0, 2.0, 3.0])
    assert m == 2.0 and s == pytest.approx(1.0)


def test_t_interval_by_hand():
    assert T_975_2 == pytest.approx(4.302653, abs=5e-7)  # printed tables
    iv = t_interval([1.0, 2.0, 3.0])
    half = T_975_2 / math.sqrt(3)
    assert (iv.mean, iv.n, iv.confidence) == (2.0, 3, 0.95) and iv.std == pytest.approx(1.0)
    assert iv.low == pytest.approx(2 - half, rel=1e-12) and iv.high == pytest.approx(2 + half, rel=1e-12)
    assert iv.contains(2 - half + 1e-9) and not iv.contains(2 + half + 1e-9) and not iv.excludes_zero


@pytest.mark.parametrize("n, confidence", [(2, 0.95), (5, 0.9), (17, 0.99)])
def test_t_interval_matches_an_independent_computation(n, confidence):
    xs = np.random.default_rng(n).normal(0.3, 0.2, n)
    iv = t_interval(list(xs), confidence)
    low, high = sst.t.interval(confidence, n - 1, loc=xs.mean(), scale=sst.sem(xs))  # numpy/scipy route
    assert iv.low == pytest.approx(low, rel=1e-10) and iv.high == pytest.approx(high, rel=1e-10)
    assert iv.std == pytest.approx(xs.std(ddof=1), rel=1e-12)


def test_t_interval_edge_cases():
    one = t_interval([0.7])
    assert (one.mean, one.low, one.high, one.std, one.n) == (0.7, None, None, None, 1)
    assert one.contains(1e9) and not one.excludes_zero  # unknown spread excludes nothing
    flat = t_interval([0.5, 0.5, 0.5])
    assert (flat.low, flat.high, flat.std) == (0.5, 0.5, 0.0) and flat.excludes_zero
    with pytest.raises(ValueError, match="at least one value"):
        t_interval([])
    with pytest.raises(ValueError, match="not finite"):
        t_interval([1.0, math.nan])
    with pytest.raises(ValueError, match="between 0 and 1"):
        t_interval([1.0, 2.0], confidence=95)


def test_paired_test_matches_ttest_rel_and_a_textbook_value():
    # Student's sleep data (Cushny & Peebles; R: t.test(g1, g2, paired = TRUE) gives t = -4.0621, p = 0.002833)
    g1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
    g2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]
    cmp = compare_paired(dict(enumerate(g1)), dict(enumerate(g2)), arm="a", baseline="b")
    ref = sst.ttest_rel(g1, g2)
    assert cmp.t == pytest.approx(ref.statistic, rel=1e-12) and cmp.p == pytest.approx(ref.pvalue, rel=1e-12)
    assert cmp.t == pytest.approx(-4.0621, abs=1e-4) and cmp.p == pytest.approx(0.002833, abs=1e-6)
    assert cmp.interval.low == pytest.approx(-2.4598858, abs=1e-6)  # R: 95% CI -2.4598858 -0.7001142
    assert cmp.interval.high == pytest.approx(-0.7001142, abs=1e-6)
    d = np.subtract(g1, g2)  # scipy's exact Wilcoxon on the same differences (one zero, dropped by both)
    assert cmp.wilcoxon_p == pytest.approx(sst.wilcoxon(d, method="exact").pvalue)
    assert cmp.outcome == "better"  # a has the lower values and lower is better


def test_pairs_by_seed_and_drops_unpaired_seeds():
    cmp = compare_paired({0: 3.0, 1: 3.5, 7: 9.0}, {1: 3.0, 0: 2.0, 4: 1.0}, arm="diff", baseline="transformer")
    assert cmp.seeds == (0, 1) and cmp.diffs == (1.0, 0.5) and cmp.n == 2
    assert cmp.wilcoxon_p is None  # fewer than 5 seeds


@pytest.mark.parametrize("diffs, lower_is_better, outcome", [
    ([-0.10, -0.11, -0.09], True, "better"),
    ([0.10, 0.11, 0.09], True, "worse"),
    ([-0.10, 0.18, -0.10], True, "inconclusive"),
    ([-0.10, -0.11, -0.09], False, "worse"),   # e.g. accuracy: lower is worse
    ([0.02, 0.03, 0.025, 0.021, 0.028], False, "better"),
    ([0.4], True, "single seed"),
    ([], True, "no data"),
])
def test_outcome_follows_the_interval(diffs, lower_is_better, outcome):
    base = {s: 1.0 for s in range(len(diffs))}
    arm = {s: 1.0 + d for s, d in enumerate(diffs)}
    cmp = compare_paired(arm, base, arm="diff", baseline="transformer", metric="accuracy",
                         lower_is_better=lower_is_better)
    assert cmp.outcome == outcome
    if len(diffs) >= 2:  # outcome and interval agree with an independent interval
        low, high = sst.t.interval(0.95, len(diffs) - 1, loc=np.mean(cmp.diffs), scale=sst.sem(cmp.diffs))
        assert (outcome == "inconclusive") == (low <= 0 <= high)


def test_the_interval_is_where_the_verdict_turns():
    # diffs [0.2 - k, 0.2, 0.2 + k] have std k; the 95% interval touches 0 when t_{.975,2} · k / sqrt(3) = 0.2
    s = 0.2 / (T_975_2 / math.sqrt(3))  # the std at which the interval of mean 0.2 just touches 0
    inside = [0.2 - 1.01 * s, 0.2, 0.2 + 1.01 * s]   # std 1.01 s: contains 0
    outside = [0.2 - 0.99 * s, 0.2, 0.2 + 0.99 * s]  # std 0.99 s: excludes 0
    assert "cannot separate" in verdict("diff", "transformer", inside)
    assert "transformer reaches the lower" in verdict("diff", "transformer", outside)
    assert 0.2 >= 2 * np.std(inside, ddof=1)  # a "|mean| >= 2 std" rule would name a winner here


def test_verdict_text():
    win = verdict("diff", "transformer", [-0.10, -0.11, -0.09])
    assert win.startswith("**diff vs transformer:** diff reaches the lower final validation loss")
    assert "95% interval [" in win and "over 3 seeds" in win and "paired t-test p = " in win
    assert "With only 3 seeds" in win and "-0.1000 nats" in win and "within seed noise" not in win
    noise = verdict("diff", "transformer", [-0.01, 0.02, -0.03])
    assert "cannot separate" in noise and "within seed noise" in noise and "reaches" not in noise
    assert "So few seeds (3) give a wide interval" in noise
    one = verdict("diff", "transformer", [-0.3])
    assert "single seed cannot separate the arms" in one and "--seeds 0,1,2" in one and "reaches" not in one
    assert "nothing to compare" in verdict("diff", "transformer", [])
    assert "identical" in verdict("diff", "transformer", [0.0, 0.0])
    many = verdict("diff", "transformer", [0.02, 0.03, 0.025, 0.021, 0.028], metric="accuracy", unit="points",
                   lower_is_better=False)
    assert "diff reaches the higher accuracy" in many and "Wilcoxon" in many and "With only" not in many
    assert "points" in many


def test_zero_spread_keeps_a_degenerate_interval_and_no_t_test():
    cmp = compare_paired({0: 3.5, 1: 4.5}, {0: 3.0, 1: 4.0}, arm="diff", baseline="transformer")
    assert (cmp.interval.low, cmp.interval.high, cmp.t, cmp.p) == (0.5, 0.5, None, None)
    assert cmp.outcome == "worse" and "no t-test" in verdict_text(cmp)
    zeros = compare_paired({s: 1.0 for s in range(6)}, {s: 1.0 for s in range(6)}, arm="a", baseline="b")
    assert zeros.outcome == "inconclusive" and zeros.wilcoxon_p is None and zeros.p is None


def test_a_spread_within_float_rounding_is_zero_spread():
    """3 fewer errors of 10,000 on every seed: the 1 − e/n differences differ in their last bits (std ~6e-17).
    That is the zero-width case (no t-test, "no test" in a Holm family), not t ~ 8e12 and p ~ 1e-26."""
    from difftransformer.experiments.report.fmt import holm_separations

    acc = {s: 1 - e / 10_000 for s, e in {0: 0, 1: 5, 2: 12}.items()}
    base = {s: 1 - e / 10_000 for s, e in {0: 3, 1: 8, 2: 15}.items()}
    assert len({acc[s] - base[s] for s in acc}) > 1  # not bit-identical: the case at issue
    cmp = compare_paired(acc, base, arm="diff", baseline="transformer", metric="accuracy")
    assert (cmp.t, cmp.p, cmp.interval.std) == (None, None, 0.0)
    assert cmp.interval.low == cmp.interval.high == cmp.interval.mean == pytest.approx(3e-4, rel=1e-9)
    assert cmp.outcome == "worse" and "no t-test" in verdict_text(cmp)
    assert holm_separations([cmp]) == [(None, "no test")]
    # the rounding is judged on the compared values' magnitude, not the difference's: 0.3 apart at ~1e6
    big = {0: 1234567.1, 1: 2345678.2, 2: 3456789.3}
    shifted = compare_paired({s: v + 0.3 for s, v in big.items()}, big, arm="a", baseline="b")
    assert shifted.p is None and shifted.interval.std == 0.0 and shifted.interval.mean == pytest.approx(0.3)
    # differences that are 0 up to rounding: the interval [0, 0], identical arms, no Wilcoxon
    same = compare_paired({0: 0.1 + 0.2, 1: 0.7, 2: 0.9, 3: 0.4, 4: 0.6}, {0: 0.3, 1: 0.7, 2: 0.9, 3: 0.4, 4: 0.6},
                          arm="a", baseline="b")
    assert (same.interval.low, same.interval.high, same.p, same.wilcoxon_p) == (0.0, 0.0, None, None)
    assert same.outcome == "inconclusive" and "identical" in verdict_text(same)
    # a spread well above rounding is still tested
    real = compare_paired({0: 0.5 + 1e-9, 1: 0.5, 2: 0.5 - 1e-9}, {0: 0.2, 1: 0.2, 2: 0.2}, arm="a", baseline="b")
    assert real.p is not None and real.interval.std == pytest.approx(1e-9, rel=1e-6)
    assert t_interval([0.25, 0.25 + 1e-17, 0.25]).std == 0.0  # plain values: the same rule
    rounded = t_interval([-5.6e-17, 2.8e-17, 0.0])  # differences passed alone (a Δ cell): 0 up to rounding
    assert (rounded.mean, rounded.low, rounded.high, rounded.std) == (0.0, 0.0, 0.0, 0.0)


def test_nan_is_an_error_naming_seed_and_arm():
    with pytest.raises(ValueError, match=r"arm 'diff' at seed 2 is nan"):
        compare_paired({0: 1.0, 2: math.nan}, {0: 1.0, 2: 1.0}, arm="diff", baseline="transformer")
    with pytest.raises(ValueError, match=r"arm 'transformer' at seed 0 is inf"):
        compare_paired({0: 1.0}, {0: math.inf}, arm="diff", baseline="transformer")
    with pytest.raises(ValueError, match="not finite"):
        verdict("diff", "transformer", [0.1, math.nan])


def test_interval_is_frozen():
    iv = Interval(1.0, 0.5, 1.5, 3, 0.2, 0.95)
    with pytest.raises(AttributeError):
        iv.mean = 2.0  # type: ignore[misc]
    assert iv.half_width == 0.5 and iv.known


def test_holm_by_hand():
    """Sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> kept monotone: 0.04 -> 0.06."""
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.02]) == [0.02]  # a family of one is not adjusted
    assert holm([0.4, 0.5]) == [0.8, 0.8]  # capped at 1 only when (m - k) p exceeds it; monotone otherwise
    assert holm([0.6, 0.7]) == [1.0, 1.0]
    assert holm([None, 0.01, None, 0.02]) == pytest.approx([None, 0.02, None, 0.02])  # undefined tests do not count
    assert holm([]) == []


def test_holm_rejects_what_the_step_down_procedure_rejects():
    """An independent statement of Holm's procedure: at level a, walk the sorted p-values and reject while
    p_(k) <= a / (m - k); the adjusted p-values below a must be exactly those rejections."""
    rng = np.random.default_rng()
    for _ in range(200):
        ps = list(rng.uniform(0, 0.2, size=int(rng.integers(1, 9))) ** 2)
        a = 0.05
        rejected = set()
        for k, i in enumerate(sorted(range(len(ps)), key=lambda i: ps[i])):
            if ps[i] > a / (len(ps) - k):
                break
            rejected.add(i)
        adjusted = holm(ps)
        assert {i for i, q in enumerate(adjusted) if q <= a} == rejected
        assert all(p <= q <= 1 for p, q in zip(ps, adjusted))


def test_holm_names_a_value_that_is_not_a_p_value():
    with pytest.raises(ValueError, match="1.5 at position 1 is not in"):
        holm([0.1, 1.5])


def test_numbers_printed_together_keep_two_significant_digits():
    """A learned synthetic task's losses (1e-6 nats) and rare error rates are never printed as 0.0000."""
    f = number_format([3e-6, -1e-6, 7e-6], signed=True)
    assert [f(v) for v in (3e-6, -1e-6, 7e-6)] == ["+3.00e-06", "-1.00e-06", "+7.00e-06"]
    assert number_format([0.9998, 0.9991])(0.9998) == "0.9998"
    assert number_format([0.0012, None])(0.0012) == "0.0012"  # two significant digits at 4 decimals: fixed
    assert number_format([9.1e-4, 1.1e-5])(1.1e-5) == "1.10e-05"  # 0.0009 would keep one: scientific
    f = number_format([-0.0288, -0.0576, -1.96e-6], signed=True)  # an interval that excludes 0 by little
    assert [f(v) for v in (-0.0288, -0.0576, -1.96e-6)] == ["-0.0288000", "-0.0576000", "-0.0000020"]
    f = number_format([0.092, 4.2e-4, 0.183], digits=3, signed=True)
    assert [f(v) for v in (0.092, 4.2e-4, 0.183)] == ["+0.09200", "+0.00042", "+0.18300"]
    assert number_format([0.5, -1e-9], signed=True)(-1e-9) == "-1.00e-09"  # past two more decimals: scientific
    assert number_format([0.5, -1e-17], signed=True)(-1e-17) == "+0.0000"  # float rounding beside 0.5: no sign
    assert number_format([0.0, 0.0])(0.0) == "0.0000" and number_format([math.nan, None])(0.25) == "0.2500"
    assert number_format([2e-4], digits=3)(2e-4) == "2.00e-04"
    tiny = verdict("diff", "transformer", [2e-6, 3e-6, 4e-6])
    assert "= +3.00e-06 nats" in tiny and "[+5.16e-07, +5.48e-06]" in tiny and "0.0000" not in tiny
    small = verdict("a", "b", [3e-5, 4e-5, 2e-5])  # an interval that excludes 0 never prints as touching it
    assert "= +3.00e-05 nats" in small and "[+5.16e-06, +5.48e-05]" in small


def test_a_p_value_is_never_printed_on_the_other_side_of_the_significance_level():
    """Three decimals would print 0.0499 as 0.050, beside a separation read at p < 0.05."""
    assert [format_p(p) for p in (0.049862, 0.050293, 0.04999999, 0.05, 0.123456, 0.0004)] == [
        "0.0499", "0.0503", "0.04999999", "0.050", "0.123", "4.0e-04"]
    assert [beside(v, 1.0, 2) for v in (0.996, 1.004, 1.0, 0.5)] == ["0.996", "1.004", "1.00", "0.50"]
    assert format_p(np.float64(0.0499)) == "0.0499"  # scipy's p-values are numpy floats
    assert format_p(0.05 + 1e-12) == "0.050000000001" and beside(1 - 1e-10, 1.0, 2) == "0.9999999999"
    assert format_p(None) == "–" and format_p(None, none="undefined") == "undefined"

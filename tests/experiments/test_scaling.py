"""Power-law fits and the equivalent-size fraction, on synthetic points whose law and fraction are known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from difftransformer.experiments import scaling
from difftransformer.experiments.scaling import (
    PowerLaw,
    ScalingResult,
    equivalent_fraction,
    fit_power_law,
    headline,
    scaling_fraction,
)

X = np.geomspace(1e5, 1e7, 6)  # six model sizes, 100K to 10M parameters


@pytest.mark.parametrize("a, alpha, c", [(40.0, 0.3, 2.1), (1e3, 0.5, 1.0), (2e6, 1.2, 3.3), (8.0, 0.08, 0.5)])
def test_fit_recovers_an_exact_law(a, alpha, c):
    fit = fit_power_law(X, PowerLaw(a, alpha, c)(X))
    assert fit.a == pytest.approx(a, rel=1e-6) and fit.alpha == pytest.approx(alpha, rel=1e-6)
    assert fit.c == pytest.approx(c, rel=1e-6)


def test_fit_recovers_a_noisy_law_approximately():
    true = PowerLaw(40.0, 0.3, 2.1)
    rng = np.random.default_rng(0)
    x = np.repeat(X, 4)  # four seeds per size
    fit = fit_power_law(x, true(x) + rng.normal(0, 0.003, x.size))
    assert fit.alpha == pytest.approx(0.3, rel=0.15) and fit.c == pytest.approx(2.1, abs=0.15)
    assert np.max(np.abs(fit(X) - true(X))) < 0.005  # the curve itself is pinned much tighter than a, alpha, c


def test_pure_power_law_without_irreducible_loss():
    fit = fit_power_law([1e6, 1e7], [3.0, 3.0 * 10 ** -0.25], irreducible=False)  # two points: a line in log-log
    assert fit.alpha == pytest.approx(0.25, rel=1e-12) and fit.c == 0.0
    assert fit.a == pytest.approx(3.0 * 1e6 ** 0.25, rel=1e-10)
    x = np.geomspace(1e3, 1e9, 7)
    fit = fit_power_law(x, 17.0 * x ** -0.07, irreducible=False)
    assert (fit.a, fit.alpha) == (pytest.approx(17.0, rel=1e-9), pytest.approx(0.07, rel=1e-9))


def test_law_call_and_inverse():
    law = PowerLaw(40.0, 0.3, 2.1)
    assert law(1e6) == pytest.approx(2.1 + 40.0 * 1e6 ** -0.3, rel=1e-15)
    np.testing.assert_allclose(law(X), [law(float(x)) for x in X], rtol=1e-15)
    for x in (1.0, 1e5, 3.3e9):
        assert law.inverse(law(x)) == pytest.approx(x, rel=1e-9)
    assert law.inverse(2.1) is None and law.inverse(2.0) is None
    with pytest.raises(ValueError, match="alpha > 0"):
        PowerLaw(1.0, -0.1, 0.0)


def test_equivalent_fraction_known_by_hand():
    base = PowerLaw(10.0, 0.5, 0.0)
    arm = PowerLaw(5.0, 0.5, 0.0)  # 5 / sqrt(x) = 10 / sqrt(x_base) at x_base = 4x
    assert equivalent_fraction(arm, base, 1e6) == pytest.approx(0.25, rel=1e-12)
    base = PowerLaw(40.0, 0.3, 2.1)
    arm = PowerLaw(40.0 * 0.6 ** 0.3, 0.3, 2.1)  # arm(x) = base(x / 0.6)
    for x in (1e4, 1e6, 1e9):
        assert equivalent_fraction(arm, base, x) == pytest.approx(0.6, rel=1e-9)
    assert equivalent_fraction(base, arm, 1e6) == pytest.approx(1 / 0.6, rel=1e-9)
    below = PowerLaw(40.0, 0.3, 1.5)  # at huge x it is below the baseline's floor 2.1
    assert equivalent_fraction(below, base, 1e12) is None


def _seeds(true: dict[str, PowerLaw], seeds: int, noise: float, rng_seed: int = 1, x=X) -> dict:
    """points[arm][seed]: each seed shifts both arms alike (paired) plus small independent noise per point."""
    rng = np.random.default_rng(rng_seed)
    points: dict = {name: {} for name in true}
    for s in range(seeds):
        shared = rng.normal(0, noise)
        for name, law in true.items():
            y = law(x) + shared + rng.normal(0, noise / 2, len(x))
            points[name][s] = [(float(xi), float(yi)) for xi, yi in zip(x, y)]
    return points


TRUE = {"transformer": PowerLaw(40.0, 0.3, 2.1), "diff": PowerLaw(40.0 * 0.6 ** 0.3, 0.3, 2.1)}


def test_bootstrap_interval_contains_the_true_fraction():
    points = _seeds(TRUE, seeds=4, noise=0.002)
    res = scaling_fraction(points, "diff", "transformer", at=1e6, n_boot=150, seed=0)
    assert res.irreducible and res.seeds == (0, 1, 2, 3) and res.n_boot == 150
    assert res.fraction == pytest.approx(0.6, abs=0.05)
    low, high = res.interval
    assert low <= 0.6 <= high and high - low < 0.3 and res.n_failed < 15
    again = scaling_fraction(points, "diff", "transformer", at=1e6, n_boot=150, seed=0)
    assert again.interval == res.interval  # the seeded generator makes the bootstrap reproducible
    assert set(res.fits) == {"diff", "transformer"}


def _plain_bootstrap(points, at: float, n_boot: int, seed: int, confidence: float):
    """The percentile bootstrap over 3 paired seeds written out: every resample refitted, in the order drawn;
    (the interval, the sorted draws)."""
    seeds, rng, fracs, draws = [0, 1, 2], np.random.default_rng(seed), [], []
    for _ in range(n_boot):
        drawn = [seeds[i] for i in rng.integers(0, 3, 3)]
        draws.append(tuple(sorted(drawn)))
        fits = {arm: fit_power_law([x for s in drawn for x, _ in points[arm][s]],
                                   [y for s in drawn for _, y in points[arm][s]], irreducible=True)
                for arm in ("diff", "transformer")}
        fracs.append(equivalent_fraction(fits["diff"], fits["transformer"], at))
    tail = 100 * (1 - confidence) / 2
    return tuple(np.percentile(fracs, [tail, 100 - tail])), draws


def test_bootstrap_is_the_plain_percentile_bootstrap_with_one_fit_per_multiset_of_seeds(monkeypatch):
    """The interval equals the bootstrap written out (a 50% interval: with 3 seeds the 95% one is two fits' values,
    which other draws would give too), and resamples that draw the same seeds share one fit: each multiset drawn
    is fitted exactly once."""
    points = _seeds(TRUE, seeds=3, noise=0.01, rng_seed=4)
    want, draws = _plain_bootstrap(points, 1e6, 300, seed=7, confidence=0.5)
    calls = []
    real = scaling._fraction
    monkeypatch.setattr(scaling, "_fraction", lambda *a: calls.append(tuple(a[3])) or real(*a))
    res = scaling_fraction(points, "diff", "transformer", at=1e6, n_boot=300, seed=7, confidence=0.5)
    assert res.irreducible and res.n_failed == 0 and res.interval == pytest.approx(want, rel=1e-6)
    assert sorted(calls[1:]) == sorted(set(draws))  # calls[0]: the point estimate on all seeds


def test_bootstrap_counts_failed_resamples_not_failed_fits(monkeypatch):
    """A multiset whose fit fails (ValueError) and one whose fraction is unreachable (None) are fitted once each,
    and every resample that draws them counts as failed."""
    points = _seeds(TRUE, seeds=3, noise=0.01, rng_seed=4)
    _, draws = _plain_bootstrap(points, 1e6, 300, seed=7, confidence=0.95)
    real = scaling._fraction

    def flaky(points, arm, baseline, seeds, at, irreducible):
        if tuple(seeds) == (0, 0, 1):
            raise ValueError("no fit")
        return ({}, None) if tuple(seeds) == (1, 2, 2) else real(points, arm, baseline, seeds, at, irreducible)

    monkeypatch.setattr(scaling, "_fraction", flaky)
    res = scaling_fraction(points, "diff", "transformer", at=1e6, n_boot=300, seed=7)
    failed = sum(d in ((0, 0, 1), (1, 2, 2)) for d in draws)
    assert failed > 2 and res.n_failed == failed and res.n_boot == 300


def test_single_seed_has_no_interval_and_two_sizes_fit_without_floor():
    one = scaling_fraction(_seeds(TRUE, seeds=1, noise=0.0), "diff", "transformer", at=1e6)
    assert one.interval is None and one.n_boot == 0 and one.fraction == pytest.approx(0.6, rel=1e-5)
    assert "single seed" in headline(one, "diff", "transformer")
    pure = {"transformer": PowerLaw(10.0, 0.5, 0.0), "diff": PowerLaw(5.0, 0.5, 0.0)}
    two = scaling_fraction(_seeds(pure, seeds=1, noise=0.0, x=np.array([1e5, 1e6])), "diff", "transformer", at=1e6)
    assert not two.irreducible and two.fraction == pytest.approx(0.25, rel=1e-9)


def test_headline_wording():
    fits = {"DIFF": PowerLaw(1.0, 0.3, 1.0), "Transformer": PowerLaw(1.0, 0.3, 1.0)}
    res = ScalingResult(fits, 0.62, (0.55, 0.70), 1000, 0, 1.2e6, 0.95, True, (0, 1, 2))
    assert headline(res, "DIFF", "Transformer") == (
        "DIFF matches the Transformer with 62% (95% interval 55–70%, 1000 bootstrap resamples over 3 seeds) "
        "of the parameters at 1.2M parameters. With only 3 seeds a bootstrap interval is too narrow: read it as a "
        "lower bound on the uncertainty.")
    five = ScalingResult(fits, 0.62, (0.55, 0.70), 1000, 0, 1.2e6, 0.95, True, tuple(range(5)))
    assert "With only 5 seeds a bootstrap interval is too narrow" in headline(five, "DIFF", "Transformer")
    many = ScalingResult(fits, 0.62, (0.55, 0.70), 1000, 0, 1.2e6, 0.95, True, tuple(range(8)))
    assert headline(many, "DIFF", "Transformer").endswith("over 8 seeds) of the parameters at 1.2M parameters.")
    wide = ScalingResult(fits, 0.9, (0.7, 1.2), 200, 7, 3e9, 0.95, True, (0, 1))
    text = headline(wide, "DIFF", "Transformer", what="training tokens")
    assert "at 3B training tokens" in text and "7 of 200 resamples" in text and "cannot separate" in text
    none = ScalingResult(fits, None, None, 0, 0, 1e6, 0.95, True, (0,))
    assert "no fraction" in headline(none, "DIFF", "Transformer")
    with pytest.raises(ValueError, match="no fit for 'diff'"):
        headline(res, "diff", "Transformer")
    near = ScalingResult(fits, 0.996, (0.98, 0.999), 1000, 0, 1e6, 0.95, True, tuple(range(8)))
    assert "with 99.6% (95% interval 98–99.9%," in headline(near, "DIFF", "Transformer")  # never 100% beside < 1
    # the Transformer measured at 0.8M-8M: at 2.36M a fraction of 21.49 reads its fit at 110K, 7.28x below 0.8M
    far = ScalingResult(fits, 21.49, (11.8, 29.1), 1000, 0, 2.36e6, 0.95, True, (0, 1, 2), (8e5, 8e6))
    assert far.extrapolated() == "7.28x below its smallest measured 800K"
    assert headline(far, "DIFF", "Transformer").endswith(
        "The Transformer's fit is read there at 110K parameters, 7.28x below its smallest measured 800K: an "
        "extrapolation of its fit, not a measurement.")
    inside = ScalingResult(fits, 0.62, (0.55, 0.70), 1000, 0, 1.2e6, 0.95, True, (0, 1, 2), (8e5, 8e6))
    assert inside.extrapolated() is None and "extrapolation" not in headline(inside, "DIFF", "Transformer")


@pytest.mark.parametrize("x, y, kwargs, match", [
    ([1e5, 1e6, 1e7], [3.0, 2.8, 2.7], {}, ">= 4 points at >= 3 distinct x"),
    ([1e5, 1e5, 1e6, 1e6], [3.0, 3.1, 2.8, 2.7], {}, ">= 4 points at >= 3 distinct x"),
    ([1e5, 1e5], [3.0, 2.9], {"irreducible": False}, ">= 2 distinct x"),
    ([1e5, -1e6, 1e7, 1e8], [3.0, 2.8, 2.7, 2.6], {}, "x = -1000000.0 at position 1"),
    ([1e5, 1e6, 1e7, 1e8], [3.0, math.nan, 2.7, 2.6], {}, "loss = nan at position 1"),
    ([1e5, 1e6, 1e7, 1e8], [3.0, 0.0, 2.7, 2.6], {}, "finite positive"),
    ([1e5, 1e6], [3.0], {}, "2 x values and 1 losses"),
    ([1e5, 1e6, 1e7], [2.0, 2.5, 3.0], {"irreducible": False}, "does not fall with x"),
    ([1e5, 1e6, 1e7, 1e8], [2.0, 2.5, 3.0, 3.5], {}, "does not fall with x"),
])
def test_bad_fit_inputs(x, y, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fit_power_law(x, y, **kwargs)


def test_a_fit_that_does_not_converge_is_a_value_error(monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("Optimal parameters not found: The maximum number of function evaluations is exceeded.")
    monkeypatch.setattr(scaling, "curve_fit", fail)
    with pytest.raises(ValueError, match="did not converge .*maximum number of function evaluations"):
        fit_power_law(X, TRUE["diff"](X))


def test_bad_scaling_inputs():
    points = _seeds(TRUE, seeds=2, noise=0.0)
    with pytest.raises(ValueError, match="no points for arm 'DIFF'"):
        scaling_fraction(points, "DIFF", "transformer", at=1e6)
    with pytest.raises(ValueError, match="no seed has points for both"):
        scaling_fraction({"diff": {0: points["diff"][0]}, "transformer": {1: points["transformer"][1]}},
                         "diff", "transformer", at=1e6)
    for kwargs, match in (({"at": 0.0}, "at = 0.0"), ({"at": 1e6, "n_boot": -1}, "n_boot"),
                          ({"at": 1e6, "confidence": 1.5}, "confidence")):
        with pytest.raises(ValueError, match=match):
            scaling_fraction(points, "diff", "transformer", **kwargs)
    with pytest.raises(ValueError, match="x = 0"):
        equivalent_fraction(TRUE["diff"], TRUE["transformer"], 0)

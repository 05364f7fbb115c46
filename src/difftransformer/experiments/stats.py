"""Statistics of a comparison over seeds: paired differences, their 95% interval, the paired tests and the verdict.

Contract:
- `t_interval(xs)` is the Student-t interval of the mean (scipy.stats.t.ppf), the textbook interval for a
  handful of roughly normal values whose spread is unknown. One value gives no interval (low = high = None:
  the spread is unknown, so the mean could be anywhere); identical values give the degenerate interval [m, m].
- `compare_paired(arm, baseline)` pairs the two arms by training seed (same seed = same data order and, with
  paired init, the same initial weights), so seed-to-seed noise common to both arms cancels in the difference
  arm − baseline. It returns the interval of those differences, the two-sided paired t-test (= scipy's ttest_rel)
  and, from 5 seeds on, the exact Wilcoxon signed-rank test as a check that does not assume normality.
- The outcome follows the interval only: "better"/"worse" when the 95% interval of arm − baseline excludes 0
  (on the good or bad side given `lower_is_better`), "inconclusive" when it contains 0, "single seed" with one
  seed (spread unknown: nothing can be separated), "no data" with none. The p-values are reported, never used
  to decide: the interval already says the same as the t-test at the same level and also gives the size.
- `verdict`/`verdict_text` write one Markdown sentence that never claims more than the interval.
- `holm(ps)` adjusts a family of p-values (Holm 1979): a report testing one arm pair on many metrics or conditions
  expects about one 95% interval in twenty to exclude 0 by chance, and the adjusted p says which readings survive
  that (adjusted p < 0.05 keeps the chance of any false reading in the family below 5%, whatever the tests'
  dependence). The interval still decides the reading; the adjusted p qualifies it.

Choices where the paper is silent (it reports single runs, no intervals):
- 95% two-sided, Student t rather than a normal interval: with 2-5 seeds the normal interval is far too narrow.
- A non-finite value is an error (naming seed and arm), not silently dropped: a diverged run is a result to
  look at, and dropping it would bias the comparison towards the arm that diverged.
- Zero spread with n >= 2 (every seed gives the same difference, e.g. fully deterministic arms) keeps the
  degenerate interval [m, m]; the t-test is then undefined (t = ±inf) and reported as None.
- A spread no larger than float rounding is zero spread: std <= SPREAD_RTOL (1e-12) × max(1, |mean|, scale), scale
  being the largest |value| the xs were computed from (for paired differences a − b, the largest |a|, |b|; by
  default the largest |x|). "3 fewer errors of 10,000 on every seed" gives 1 − e/n differences that differ in their
  last bits (a spread of ~6e-17, t ~ 1e13); that is the zero-width case above, not a test with p ~ 1e-26. A double
  rounds at 1.1e-16 relative, so 1e-12 leaves room for thousands of rounded operations behind a metric, and is far
  below any spread that training seeds produce. The floor 1 covers differences passed without their values'
  magnitude (a table's Δ cell): this project's metrics are losses, rates and magnitudes whose seed-to-seed spread
  is nowhere near 1e-12. The interval is then [m, m], and [0, 0] when |m| is itself within that tolerance (every
  difference is 0 up to rounding).
- The Wilcoxon test needs 5 seeds: below that its exact two-sided p can never reach 0.05, so it says nothing.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scipy import stats as _st

OUTCOMES = ("better", "worse", "inconclusive", "single seed", "no data")
WILCOXON_MIN_SEEDS = 5
FEW_SEEDS = 4  # up to this many seeds the verdict says the interval is wide because of the few seeds
SPREAD_RTOL = 1e-12  # a spread up to this fraction of the numbers' magnitude is float rounding: zero spread


def number_format(values: Sequence[float | None], digits: int = 4, signed: bool = False):
    """One format for numbers printed together (a mean and its interval): `digits` decimals, more (up to three more)
    where the smallest non-zero magnitude would print as 0 (two significant digits of it), else scientific with three
    significant digits (a loss of 3e-5 nats; an interval bound of -2e-6 beside a mean of -0.03): so no value prints
    as 0 or with another sign, and an interval that excludes 0 never prints as one that touches it. Only a value
    that is float rounding beside the others (SPREAD_RTOL of the largest) prints as 0, without a sign."""
    sign = "+" if signed else ""
    finite = [abs(v) for v in values if v is not None and math.isfinite(v)]
    big = max(finite, default=0.0)
    small = min((a for a in finite if a > SPREAD_RTOL * big), default=big)
    if 0 < big < 10 ** (1 - digits):
        return lambda v: f"{v:{sign}.2e}"
    places = digits
    if small > 0 and round(small, digits) == 0:  # `digits` would print it as 0: two significant digits of it
        places = 1 - math.floor(math.log10(small))
        if places > digits + 3:
            return lambda v: f"{v:{sign}.2e}"

    def fixed(v: float) -> str:
        if abs(v) <= SPREAD_RTOL * big:
            return f"{0.0:{sign}.{places}f}"
        return f"{v:{sign}.{places}f}"
    return fixed


def beside(value: float, threshold: float, places: int) -> str:
    """`value` at `places` decimals, or more (every digit past 8) where fewer would print it on the threshold or
    across it, when it is not: a p of 0.0499 beside 0.05 prints 0.0499, a bound of 0.996 beside 1 prints 0.996,
    not 1.00."""
    value = float(value)  # numpy's bools do not subtract
    side = (value > threshold) - (value < threshold)
    for n in range(places, 9):
        text = f"{value:.{n}f}"
        shown = float(text)
        if (shown > threshold) - (shown < threshold) == side:
            return text
    return repr(value)  # closer than 8 decimals: every digit


def format_p(p: float | None, none: str = "–") -> str:
    """A p-value for a table or a sentence: three decimals (scientific below 0.001), or as many more as keep it on
    its side of 0.05, the significance level (`beside`)."""
    if p is None:
        return none
    return f"{p:.1e}" if p < 1e-3 else beside(p, 0.05, 3)


def mean_std(xs: list[float]) -> tuple[float, float | None]:
    """Mean and sample std (None for a single value: one run says nothing about spread)."""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def paired_differences(arm: Mapping[int, float], baseline: Mapping[int, float]) -> list[float]:
    """arm[s] − baseline[s] for every seed s that both have, in seed order."""
    return [arm[s] - baseline[s] for s in sorted(arm) if s in baseline]


@dataclass(frozen=True)
class Interval:
    """A two-sided confidence interval of a mean; low = high = None when the spread is unknown (n = 1)."""

    mean: float
    low: float | None
    high: float | None
    n: int
    std: float | None
    confidence: float

    @property
    def known(self) -> bool:
        """Whether the interval has finite bounds (needs n >= 2)."""
        return self.low is not None and self.high is not None

    def contains(self, x: float) -> bool:
        """Whether x lies in [low, high]; with unknown spread every x does (nothing is excluded)."""
        if self.low is None or self.high is None:
            return True
        return self.low <= x <= self.high

    @property
    def excludes_zero(self) -> bool:
        return not self.contains(0.0)

    @property
    def half_width(self) -> float | None:
        return None if self.low is None or self.high is None else (self.high - self.low) / 2


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence!r} must lie strictly between 0 and 1 (e.g. 0.95)")


def _check_finite(xs: Sequence[float], what: str) -> list[float]:
    out = [float(x) for x in xs]
    bad = [i for i, x in enumerate(out) if not math.isfinite(x)]
    if bad:
        raise ValueError(f"{what}: value {out[bad[0]]!r} at position {bad[0]} is not finite; "
                         f"drop or fix that run before computing statistics")
    return out


def t_interval(xs: Sequence[float], confidence: float = 0.95, *, scale: float | None = None) -> Interval:
    """Student-t interval of the mean of xs: mean ± t_{(1+confidence)/2, n-1} · std / sqrt(n).

    A std within float rounding of the numbers (<= SPREAD_RTOL × max(1, |mean|, scale); scale defaults to the
    largest |x|, pass the largest |a|, |b| for differences a − b) is zero spread: the interval [m, m], or [0, 0]
    when |m| is within that rounding too."""
    _check_confidence(confidence)
    values = _check_finite(xs, "t_interval")
    n = len(values)
    if n == 0:
        raise ValueError("t_interval needs at least one value, got none; pass the per-seed values")
    m = statistics.fmean(values)
    if n == 1:
        return Interval(m, None, None, 1, None, confidence)
    s = statistics.stdev(values)
    rounding = SPREAD_RTOL * max(1.0, abs(m), max(abs(v) for v in values) if scale is None else abs(scale))
    if s <= rounding:
        m = 0.0 if abs(m) <= rounding else m
        return Interval(m, m, m, n, 0.0, confidence)
    half = float(_st.t.ppf((1 + confidence) / 2, n - 1)) * s / math.sqrt(n)
    return Interval(m, m - half, m + half, n, s, confidence)


@dataclass(frozen=True)
class PairedComparison:
    """arm vs baseline on one metric, paired by seed; `outcome` follows the interval of the differences."""

    arm: str
    baseline: str
    metric: str
    lower_is_better: bool
    seeds: tuple[int, ...]
    diffs: tuple[float, ...]  # arm − baseline per seed, in the order of `seeds`
    interval: Interval | None  # None when no seed has both arms
    t: float | None  # paired t statistic; None for n < 2 or zero spread
    p: float | None  # its two-sided p-value
    wilcoxon_p: float | None  # exact two-sided Wilcoxon signed-rank p; None for n < 5 or all diffs 0

    @property
    def n(self) -> int:
        return len(self.diffs)

    @property
    def outcome(self) -> str:
        if self.interval is None:
            return "no data"
        if self.n == 1:
            return "single seed"
        if not self.interval.excludes_zero:
            return "inconclusive"
        arm_lower = self.interval.mean < 0
        return "better" if arm_lower == self.lower_is_better else "worse"


def _t_test(diffs: Sequence[float], std: float | None) -> tuple[float | None, float | None]:
    """Two-sided one-sample t-test of diffs against 0 (the paired t-test); None where it is undefined: fewer than
    2 diffs or zero spread (std 0, which t_interval also gives for a spread within float rounding)."""
    if len(diffs) < 2 or not std:
        return None, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # scipy's "nearly identical data" precision warning
        res = _st.ttest_1samp(list(diffs), 0.0)
    t, p = float(res.statistic), float(res.pvalue)
    return (t, p) if math.isfinite(t) and math.isfinite(p) else (None, None)


def _wilcoxon(diffs: Sequence[float]) -> float | None:
    if len(diffs) < WILCOXON_MIN_SEEDS or all(d == 0 for d in diffs):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = float(_st.wilcoxon(list(diffs), method="exact", alternative="two-sided").pvalue)
    return p if math.isfinite(p) else None


def _comparison(arm: str, baseline: str, seeds: Sequence[int], diffs: Sequence[float], *, metric: str,
                lower_is_better: bool, confidence: float, scale: float | None = None) -> PairedComparison:
    """scale: the largest |value| the differences were computed from (None: the largest |difference|), which
    sets what spread is float rounding (t_interval)."""
    _check_confidence(confidence)
    diffs = _check_finite(diffs, f"{arm} − {baseline} differences")
    interval = t_interval(diffs, confidence, scale=scale) if diffs else None
    t, p = _t_test(diffs, interval.std if interval else None)
    zero = interval is not None and interval.std == 0 and interval.mean == 0  # every difference 0 up to rounding
    return PairedComparison(arm, baseline, metric, lower_is_better, tuple(seeds), tuple(diffs), interval,
                            t, p, None if zero else _wilcoxon(diffs))


def compare_paired(arm_values: Mapping[int, float], baseline_values: Mapping[int, float], *, arm: str,
                   baseline: str, metric: str = "final validation loss", lower_is_better: bool = True,
                   confidence: float = 0.95) -> PairedComparison:
    """Pair arm and baseline by the seeds both have; a non-finite value is a ValueError naming seed and arm."""
    for name, values in ((arm, arm_values), (baseline, baseline_values)):
        for seed, v in values.items():
            if not math.isfinite(float(v)):
                raise ValueError(f"{metric} of arm {name!r} at seed {seed} is {v!r}, not a finite number; "
                                 f"that run diverged or did not finish: fix or rerun it before comparing")
    seeds = sorted(s for s in arm_values if s in baseline_values)
    diffs = [float(arm_values[s]) - float(baseline_values[s]) for s in seeds]
    scale = max((abs(float(v[s])) for s in seeds for v in (arm_values, baseline_values)), default=0.0)
    return _comparison(arm, baseline, seeds, diffs, metric=metric, lower_is_better=lower_is_better,
                       confidence=confidence, scale=scale)


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values of one family of tests, in the input order; None (an undefined test)
    stays None and does not count towards the family size m.

    Sorted ascending, the k-th smallest p (k = 0..m-1) becomes max over j <= k of min(1, (m - j) * p_(j)): the
    smallest is multiplied by m, the next by m - 1, and so on, kept monotone."""
    order = sorted((i for i, p in enumerate(pvalues) if p is not None), key=lambda i: pvalues[i])
    for i in order:
        if not 0.0 <= pvalues[i] <= 1.0:
            raise ValueError(f"p-value {pvalues[i]!r} at position {i} is not in [0, 1]; pass p-values, not statistics")
    out: list[float | None] = [None] * len(pvalues)
    running, m = 0.0, len(order)
    for k, i in enumerate(order):
        running = max(running, min(1.0, (m - k) * pvalues[i]))
        out[i] = running
    return out


def verdict_text(cmp: PairedComparison, unit: str = "nats") -> str:
    """One honest Markdown sentence on the comparison; it names a better arm only if the interval excludes 0."""
    head = f"**{cmp.arm} vs {cmp.baseline}:**"
    if cmp.outcome == "no data":
        return f"{head} no seed has finished both arms yet, so there is nothing to compare."
    iv = cmp.interval
    assert iv is not None
    if cmp.outcome == "single seed":
        return (f"{head} {cmp.arm} − {cmp.baseline} {cmp.metric} = {number_format([iv.mean], signed=True)(iv.mean)} "
                f"{unit} with a single seed. "
                f"A single seed cannot separate the arms: how much the {cmp.metric} moves from seed to seed is "
                f"unknown, so there is no interval, and at this scale seed noise is typically as large as "
                f"differences like this one. Run several seeds (`--seeds 0,1,2`) before reading anything "
                f"into the sign.")
    assert iv.low is not None and iv.high is not None
    pct = f"{iv.confidence:.0%}"
    if iv.std == 0 and iv.mean == 0:
        return (f"{head} identical {cmp.metric} on all {cmp.n} seeds (every paired difference is 0): "
                f"no difference to separate.")
    tests = f"paired t-test p = {format_p(cmp.p, none='undefined')}"
    if cmp.wilcoxon_p is not None:
        tests += f", Wilcoxon signed-rank p = {format_p(cmp.wilcoxon_p, none='undefined')}"
    if iv.std == 0:
        tests = "the same difference on every seed, so no t-test"
    f = number_format([iv.mean, iv.low, iv.high], signed=True)
    core = (f"{cmp.arm} − {cmp.baseline} {cmp.metric} = {f(iv.mean)} {unit} (mean paired difference over "
            f"{cmp.n} seeds, {pct} interval [{f(iv.low)}, {f(iv.high)}], {tests}).")
    few = cmp.n <= FEW_SEEDS
    if cmp.outcome == "inconclusive":
        return (f"{head} {core} The {pct} interval contains 0: the difference is within seed noise, and "
                f"these runs cannot separate the two arms."
                + (f" So few seeds ({cmp.n}) give a wide interval; more seeds narrow it." if few else ""))
    better, worse = (cmp.arm, cmp.baseline) if cmp.outcome == "better" else (cmp.baseline, cmp.arm)
    side = "lower" if cmp.lower_is_better else "higher"
    return (f"{head} {better} reaches the {side} {cmp.metric}: {core} The {pct} interval excludes 0, so "
            f"{worse} is behind at this scale and budget; small-model results need not carry over to larger "
            f"models." + (f" With only {cmp.n} seeds the spread behind the interval is itself a rough estimate."
                          if few else ""))


def verdict(arm: str, baseline: str, diffs: list[float], *, metric: str = "final validation loss",
            unit: str = "nats", lower_is_better: bool = True, confidence: float = 0.95) -> str:
    """One honest sentence on `arm` − `baseline` from paired per-seed differences (see `verdict_text`)."""
    cmp = _comparison(arm, baseline, range(len(diffs)), diffs, metric=metric, lower_is_better=lower_is_better,
                      confidence=confidence)
    return verdict_text(cmp, unit=unit)

"""Scaling-law fits and the paper's headline read off them: "DIFF matches the Transformer with f of the parameters".

Contract:
- `PowerLaw(a, alpha, c)` is L(x) = c + a · x^(−alpha) (x = parameters or training tokens, L = loss), with
  a > 0 and alpha > 0 so L falls with x towards the irreducible loss c >= 0; `inverse(L)` is the x that reaches L
  (None when L <= c: no amount of x reaches it).
- `fit_power_law(x, y)` fits it. irreducible=True fits c too and needs >= 4 points at >= 3 distinct x (three
  parameters); irreducible=False fixes c = 0 and fits log L = log a − alpha log x by least squares (>= 2
  distinct x), the paper's straight lines on log-log axes (Fig. 3).
- `equivalent_fraction(arm_fit, base_fit, x)` = x / x_base where base_fit(x_base) = arm_fit(x): the share of the
  baseline's parameters (tokens) the arm needs for the same loss. The paper's "~62% of the parameters" is this
  number for DIFF vs Transformer.
- `scaling_fraction(points, arm, baseline, at=...)` fits both arms on every seed both have and bootstraps the
  fraction over seeds (paired: a resample draws seeds, and each drawn seed brings both arms' points).

Choices where the paper is silent (it gives no fitting procedure, no intervals, one run per size):
- Least squares on the loss itself (not its log) for the 3-parameter fit: seed noise on the loss is additive and
  roughly the same size at every x. The start comes from a 1-D search over c of the log-log straight-line fit
  (its best c), so the 3-parameter fit starts near the answer; x is rescaled by its geometric mean so a stays
  O(1) for any x range (1e5 parameters or 1e10 tokens).
- The bound 0 <= c < min(y): an irreducible loss above an observed loss is not irreducible.
- Bootstrap over seeds, not over points: points of one seed share data order and initial weights, so they are
  not independent; the seed is the unit that was repeated. Percentile interval; resamples whose fit fails or whose
  fraction is unreachable are counted in `n_failed` and left out (the headline says how many).
- irreducible=None picks the 3-parameter fit when every arm has >= 3 distinct x and >= 4 points, else c = 0.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import OptimizeWarning, curve_fit, minimize_scalar

from difftransformer.experiments.stats import beside

MIN_POINTS_IRREDUCIBLE = 4
MIN_DISTINCT_X_IRREDUCIBLE = 3
MIN_DISTINCT_X_PURE = 2
FEW_SEEDS = 5  # up to this many seeds the headline warns that the bootstrap interval is too narrow (measured:
# the nominal 95% interval held the true fraction in 75% of synthetic studies at 3 seeds, 86% at 5; docs/studies.md)


@dataclass(frozen=True)
class PowerLaw:
    """L(x) = c + a · x^(−alpha)."""

    a: float
    alpha: float
    c: float

    def __post_init__(self) -> None:
        if not (self.a > 0 and self.alpha > 0 and self.c >= 0 and math.isfinite(self.a * self.alpha * self.c)):
            raise ValueError(f"PowerLaw(a={self.a!r}, alpha={self.alpha!r}, c={self.c!r}) needs finite a > 0, "
                             f"alpha > 0 and c >= 0 (a loss that falls with x towards c)")

    def __call__(self, x):  # float -> float, numpy array -> numpy array
        return self.c + self.a * np.power(x, -self.alpha) if isinstance(x, np.ndarray) else \
            self.c + self.a * float(x) ** (-self.alpha)

    def inverse(self, loss: float) -> float | None:
        """The x with L(x) = loss; None when loss <= c (the law never gets there)."""
        if not loss > self.c:
            return None
        return (self.a / (loss - self.c)) ** (1.0 / self.alpha)


def _as_points(x: Sequence[float], y: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    xa, ya = np.asarray(x, dtype=float).ravel(), np.asarray(y, dtype=float).ravel()
    if xa.size != ya.size:
        raise ValueError(f"fit_power_law got {xa.size} x values and {ya.size} losses; pass one loss per x")
    for name, v in (("x", xa), ("loss", ya)):
        bad = ~np.isfinite(v) | (v <= 0)
        if bad.any():
            raise ValueError(f"fit_power_law: {name} = {float(v[bad][0])!r} at position {int(np.argmax(bad))} is not a "
                             f"finite positive number; power laws need x > 0 and loss > 0")
    return xa, ya


def _loglog(lx: np.ndarray, ly: np.ndarray) -> tuple[float, float, float]:
    """Least-squares line ly = intercept − alpha · lx; returns (intercept, alpha, sum of squared residuals)."""
    slope, intercept = np.polyfit(lx, ly, 1)
    sse = float(np.sum((ly - (intercept + slope * lx)) ** 2))
    return float(intercept), float(-slope), sse


def _fit_pure(xa: np.ndarray, ya: np.ndarray) -> PowerLaw:
    if np.unique(xa).size < MIN_DISTINCT_X_PURE:
        raise ValueError(f"fit_power_law(irreducible=False) needs >= {MIN_DISTINCT_X_PURE} distinct x, got "
                         f"{np.unique(xa).size}; train at least two sizes (budgets)")
    log_a, alpha, _ = _loglog(np.log(xa), np.log(ya))
    if not alpha > 0:
        raise ValueError(f"fit_power_law: the loss does not fall with x (fitted exponent alpha = {alpha:.3g} <= 0); "
                         f"no power law L = a · x^(−alpha) describes these points")
    return PowerLaw(math.exp(log_a), alpha, 0.0)


def _start(u: np.ndarray, ya: np.ndarray) -> tuple[float, float, float]:
    """(b, alpha, c) for b · u^(−alpha) + c: the log-log line of y − c at the c that fits it best."""
    lu, ymin = np.log(u), float(ya.min())

    def sse(frac: float) -> float:
        return _loglog(lu, np.log(ya - frac * ymin))[2]

    frac = float(minimize_scalar(sse, bounds=(0.0, 0.999), method="bounded").x)
    log_b, alpha, _ = _loglog(lu, np.log(ya - frac * ymin))
    return math.exp(log_b), max(alpha, 1e-3), frac * ymin


def _fit_irreducible(xa: np.ndarray, ya: np.ndarray) -> PowerLaw:
    distinct = np.unique(xa).size
    if xa.size < MIN_POINTS_IRREDUCIBLE or distinct < MIN_DISTINCT_X_IRREDUCIBLE:
        raise ValueError(f"fit_power_law(irreducible=True) fits 3 parameters and needs >= {MIN_POINTS_IRREDUCIBLE} "
                         f"points at >= {MIN_DISTINCT_X_IRREDUCIBLE} distinct x, got {xa.size} points at {distinct}; "
                         f"train more sizes or seeds, or use irreducible=False (c = 0)")
    x0 = float(np.exp(np.mean(np.log(xa))))  # rescale: a stays O(1) whatever the range of x
    u = xa / x0
    ymin = float(ya.min())
    b0, alpha0, c0 = _start(u, ya)
    upper_c = float(np.nextafter(ymin, 0.0))
    p0 = [b0, alpha0, min(c0, upper_c * (1 - 1e-9))]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizeWarning)  # covariance not estimable: we do not use it
            (b, alpha, c), _ = curve_fit(lambda v, b, al, c: c + b * v ** (-al), u, ya, p0=p0,
                                         bounds=([0.0, 0.0, 0.0], [np.inf, np.inf, upper_c]), method="trf",
                                         ftol=1e-15, xtol=1e-15, gtol=1e-15, max_nfev=20000)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"fit_power_law: the 3-parameter fit did not converge ({e}); check the points, or use "
                         f"irreducible=False") from None
    if not (np.isfinite([b, alpha, c]).all() and b > 0 and alpha > 1e-9):
        raise ValueError(f"fit_power_law: the loss does not fall with x (fit gave a = {b:.3g}, alpha = {alpha:.3g}); "
                         f"no power law L = c + a · x^(−alpha) describes these points")
    return PowerLaw(float(b) * x0 ** float(alpha), float(alpha), float(c))


def fit_power_law(x: Sequence[float], y: Sequence[float], *, irreducible: bool = True) -> PowerLaw:
    """Fit L(x) = c + a · x^(−alpha) to the points (x_i, y_i) (c = 0 when irreducible is False)."""
    xa, ya = _as_points(x, y)
    return _fit_irreducible(xa, ya) if irreducible else _fit_pure(xa, ya)


def equivalent_fraction(arm_fit: PowerLaw, base_fit: PowerLaw, x: float) -> float | None:
    """x / x_base with base_fit(x_base) = arm_fit(x); None when the baseline never reaches arm_fit(x)."""
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"equivalent_fraction: x = {x!r} must be a finite positive size (parameters or tokens)")
    x_base = base_fit.inverse(arm_fit(x))
    return None if x_base is None else x / x_base


@dataclass(frozen=True)
class ScalingResult:
    """Both arms' fits on all paired seeds, the fraction at x = `at` and its bootstrap interval over seeds."""

    fits: Mapping[str, PowerLaw]
    fraction: float | None
    interval: tuple[float, float] | None  # percentile bootstrap interval; None with one seed or no usable resample
    n_boot: int  # resamples drawn (0 with one seed)
    n_failed: int  # resamples whose fit failed or whose fraction was unreachable
    at: float
    confidence: float
    irreducible: bool
    seeds: tuple[int, ...] = ()  # the seeds both arms have: the bootstrap's unit
    base_range: tuple[float, float] | None = None  # the baseline's smallest and largest measured x

    def extrapolated(self) -> str | None:
        """Where the fraction reads the baseline's fit outside the x it was measured at (a fraction far from 1 is
        then a claim about sizes neither arm trained): a phrase for the headline and the claims, or None."""
        if self.fraction is None or self.base_range is None:
            return None
        x_base, (low, high) = self.at / self.fraction, self.base_range
        if x_base < low:
            return f"{low / x_base:.3g}x below its smallest measured {_human(low)}"
        if x_base > high:
            return f"{x_base / high:.3g}x above its largest measured {_human(high)}"
        return None


Points = Mapping[str, Mapping[int, Sequence[tuple[float, float]]]]


def _pool(per_seed: Mapping[int, Sequence[tuple[float, float]]], seeds: Sequence[int]) -> tuple[list, list]:
    xs = [float(p[0]) for s in seeds for p in per_seed[s]]
    ys = [float(p[1]) for s in seeds for p in per_seed[s]]
    return xs, ys


def _fraction(points: Points, arm: str, baseline: str, seeds: Sequence[int], at: float,
              irreducible: bool) -> tuple[dict[str, PowerLaw], float | None]:
    fits = {name: fit_power_law(*_pool(points[name], seeds), irreducible=irreducible) for name in (arm, baseline)}
    return fits, equivalent_fraction(fits[arm], fits[baseline], at)


def _auto_irreducible(points: Points, arms: Sequence[str], seeds: Sequence[int]) -> bool:
    for name in arms:
        xs, _ = _pool(points[name], seeds)
        if len(xs) < MIN_POINTS_IRREDUCIBLE or len(set(xs)) < MIN_DISTINCT_X_IRREDUCIBLE:
            return False
    return True


def _check_scaling_args(points: Points, arm: str, baseline: str, at: float, n_boot: int,
                        confidence: float) -> list[int]:
    for name in (arm, baseline):
        if name not in points:
            raise ValueError(f"scaling_fraction: no points for arm {name!r} (have {sorted(points)}); "
                             f"pass points[arm][seed] = [(x, loss), ...]")
    if arm == baseline:
        raise ValueError(f"scaling_fraction: arm and baseline are both {arm!r}; compare two different arms")
    if not (math.isfinite(at) and at > 0):
        raise ValueError(f"scaling_fraction: at = {at!r} must be a finite positive size (parameters or tokens)")
    if n_boot < 0:
        raise ValueError(f"scaling_fraction: n_boot = {n_boot!r} must be >= 0 (0 = no bootstrap)")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"scaling_fraction: confidence = {confidence!r} must lie strictly between 0 and 1")
    seeds = sorted(set(points[arm]) & set(points[baseline]))
    if not seeds:
        raise ValueError(f"scaling_fraction: no seed has points for both {arm!r} and {baseline!r}; "
                         f"train both arms with the same seeds")
    return seeds


def scaling_fraction(points: Points, arm: str, baseline: str, *, at: float, n_boot: int = 1000, seed: int = 0,
                     confidence: float = 0.95, irreducible: bool | None = None) -> ScalingResult:
    """Fraction of the baseline's x the arm needs for the same loss at x = `at`, with a paired seed bootstrap.

    Each resample draws len(seeds) seeds with replacement; resamples that draw the same multiset of seeds share
    one fit (with 3 seeds there are only 10 multisets), so n_boot costs little beyond the distinct fits."""
    seeds = _check_scaling_args(points, arm, baseline, at, n_boot, confidence)
    if irreducible is None:
        irreducible = _auto_irreducible(points, (arm, baseline), seeds)
    fits, fraction = _fraction(points, arm, baseline, seeds, at, irreducible)
    xs = _pool(points[baseline], seeds)[0]
    base_range = (min(xs), max(xs))
    if len(seeds) < 2 or n_boot == 0:
        return ScalingResult(fits, fraction, None, 0, 0, at, confidence, irreducible, tuple(seeds), base_range)
    rng = np.random.default_rng(seed)
    fracs: list[float] = []
    fitted: dict[tuple[int, ...], float | None] = {}  # a resample is a multiset of seeds: few distinct, fit each once
    for _ in range(n_boot):
        drawn = tuple(sorted(seeds[i] for i in rng.integers(0, len(seeds), len(seeds))))
        if drawn not in fitted:
            try:
                fitted[drawn] = _fraction(points, arm, baseline, drawn, at, irreducible)[1]
            except ValueError:
                fitted[drawn] = None
        if fitted[drawn] is not None:
            fracs.append(fitted[drawn])
    tail = 100 * (1 - confidence) / 2
    interval = (float(np.percentile(fracs, tail)), float(np.percentile(fracs, 100 - tail))) if fracs else None
    return ScalingResult(fits, fraction, interval, n_boot, n_boot - len(fracs), at, confidence, irreducible,
                         tuple(seeds), base_range)


def _human(x: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if x >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def headline(result: ScalingResult, arm: str, baseline: str, what: str = "parameters") -> str:
    """The paper's sentence read off our fit, e.g. "DIFF matches the Transformer with 62% (95% interval ...)"."""
    for name in (arm, baseline):
        if name not in result.fits:
            raise ValueError(f"headline: the result has no fit for {name!r} (has {sorted(result.fits)}); "
                             f"pass the arm and baseline given to scaling_fraction")
    where = f"at {_human(result.at)} {what}"
    n = len(result.seeds)
    if result.fraction is None:
        return (f"{arm} {where} reaches loss {result.fits[arm](result.at):.4f}, at or below the {baseline} fit's "
                f"irreducible loss {result.fits[baseline].c:.4f}: the {baseline} fit never gets there, so no "
                f"fraction of the {what} can be read off.")
    pct = f"{result.confidence:.0%}"
    if result.interval is None:
        why = ("a single seed gives no interval; run several seeds (`--seeds 0,1,2`)" if n < 2 else
               "no bootstrap was run" if result.n_boot == 0 else
               f"all {result.n_boot} bootstrap resamples failed, so there is no interval")
        return (f"{arm} matches the {baseline} with {beside(100 * result.fraction, 100, 0)}% of the {what} {where} "
                f"({why}).{_extrapolation(result, baseline, what)}")
    low, high = result.interval
    failed = (f"; {result.n_failed} of {result.n_boot} resamples gave no fraction and are left out"
              if result.n_failed else "")
    span = f"{beside(100 * low, 100, 0)}–{beside(100 * high, 100, 0)}%"  # 99.6% is not printed as 100%
    text = (f"{arm} matches the {baseline} with {beside(100 * result.fraction, 100, 0)}% ({pct} interval {span}, "
            f"{result.n_boot} "
            f"bootstrap resamples over {n} seeds{failed}) of the {what} {where}.")
    if n <= FEW_SEEDS:
        text += (f" With only {n} seeds a bootstrap interval is too narrow: read it as a lower bound on the "
                 f"uncertainty.")
    if low <= 1.0 <= high:
        text += " The interval contains 100%: these runs cannot separate how the two arms scale."
    return text + _extrapolation(result, baseline, what)


def _extrapolation(result: ScalingResult, baseline: str, what: str) -> str:
    where = result.extrapolated()
    return "" if where is None else (f" The {baseline}'s fit is read there at {_human(result.at / result.fraction)} "
                                     f"{what}, {where}: an extrapolation of its fit, not a measurement.")

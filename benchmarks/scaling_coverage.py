"""How often the scaling headline's bootstrap interval holds the true fraction, by number of seeds.

The headline "the arm matches the baseline with f of the parameters" (experiments/scaling.py) comes with a
percentile bootstrap interval over paired seeds. With few seeds a bootstrap interval is too narrow; this script
measures how narrow on synthetic studies whose answer is known: both arms follow L(x) = c + a·x^(−α) exactly, the
arm with a·(x/f)^(−α) (so it needs the fraction f of the baseline's x for the same loss), each seed adds Gaussian
noise of `--noise` nats to every final loss, and the grid has `--sizes` sizes as the CPU scaling study has.
Coverage is the share of simulated studies whose interval holds f, with its Wilson 95% interval.

    python benchmarks/scaling_coverage.py                       # 3, 5 and 8 seeds, 200 studies each
    python benchmarks/scaling_coverage.py --seeds 3 5 --trials 400 --n-boot 1000

The report's warning at `FEW_SEEDS` seeds or fewer (experiments/scaling.py) rests on this table (docs/studies.md).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
from scipy.stats import norm

from difftransformer.experiments.scaling import scaling_fraction


def simulated_points(rng: np.random.Generator, seeds: int, sizes: np.ndarray, fraction: float, a: float,
                     alpha: float, c: float, noise: float) -> dict[str, dict[int, list[tuple[float, float]]]]:
    """One synthetic study: per arm, per seed, (size, final loss) at every size of the grid."""
    base = c + a * sizes ** -alpha
    arm = c + a * (sizes / fraction) ** -alpha
    return {name: {s: list(zip(sizes.tolist(), (mean + rng.normal(0.0, noise, sizes.size)).tolist()))
                   for s in range(seeds)} for name, mean in (("arm", arm), ("baseline", base))}


def wilson(hits: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a proportion hits / n."""
    z = norm.ppf(0.5 + confidence / 2)
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def coverage(args: argparse.Namespace, seeds: int) -> dict[str, float]:
    """Simulate `args.trials` studies with `seeds` seeds; count the intervals that hold the true fraction."""
    rng = np.random.default_rng(args.seed + seeds)
    sizes = np.geomspace(args.smallest, args.largest, args.sizes)
    at = float(math.exp(np.log(sizes).mean()))  # the geometric mean of the grid, as the report reads it
    hits = usable = 0
    widths = []
    for trial in range(args.trials):
        points = simulated_points(rng, seeds, sizes, args.fraction, args.a, args.alpha, args.c, args.noise)
        result = scaling_fraction(points, "arm", "baseline", at=at, n_boot=args.n_boot, seed=trial,
                                  confidence=args.confidence)
        if result.interval is None:
            continue
        usable += 1
        lo, hi = result.interval
        hits += lo <= args.fraction <= hi
        widths.append(hi - lo)
    lo, hi = wilson(hits, usable, 0.95) if usable else (math.nan, math.nan)
    return {"seeds": seeds, "studies": usable, "coverage": hits / usable if usable else math.nan,
            "lo": lo, "hi": hi, "width": float(np.median(widths)) if widths else math.nan}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[3, 5, 8], help="seed counts to measure (each >= 2)")
    p.add_argument("--trials", type=int, default=200, help="simulated studies per seed count")
    p.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples per study (the report's 1000)")
    p.add_argument("--confidence", type=float, default=0.95, help="nominal level of the interval")
    p.add_argument("--fraction", type=float, default=0.62, help="the true fraction f (the paper's 62%%)")
    p.add_argument("--a", type=float, default=40.0, help="power-law scale a (x in parameters)")
    p.add_argument("--alpha", type=float, default=0.3, help="power-law exponent α")
    p.add_argument("--c", type=float, default=2.0, help="irreducible loss c (nats)")
    p.add_argument("--noise", type=float, default=0.05, help="seed-to-seed SD of a final loss (nats)")
    p.add_argument("--sizes", type=int, default=4, help="sizes in the grid (the CPU scaling study has 4)")
    p.add_argument("--smallest", type=float, default=1e6, help="smallest size (non-embedding parameters)")
    p.add_argument("--largest", type=float, default=8e6, help="largest size")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulation")
    args = p.parse_args(argv)
    if min(args.seeds) < 2:
        p.error(f"--seeds {args.seeds}: a bootstrap over seeds needs at least 2; pass counts >= 2")
    if args.trials < 1 or args.n_boot < 1:
        p.error(f"--trials {args.trials} and --n-boot {args.n_boot} must both be >= 1")
    if not 0 < args.fraction or args.sizes < 3 or not 0 < args.smallest < args.largest:
        p.error("--fraction must be > 0, --sizes >= 3 and 0 < --smallest < --largest")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"# true fraction {args.fraction}, L = {args.c} + {args.a}·x^-{args.alpha}, {args.sizes} sizes "
          f"{args.smallest:.3g}-{args.largest:.3g}, seed noise {args.noise} nats, {args.n_boot} resamples, "
          f"nominal {args.confidence:.0%}")
    print("| seeds | studies | coverage | Wilson 95% | median width | seconds |")
    print("|---|---|---|---|---|---|")
    for seeds in args.seeds:
        t0 = time.perf_counter()
        row = coverage(args, seeds)
        print(f"| {seeds} | {row['studies']} | {row['coverage']:.1%} | {row['lo']:.1%}-{row['hi']:.1%} | "
              f"{row['width']:.3f} | {time.perf_counter() - t0:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

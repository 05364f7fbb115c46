"""Statistics of a comparison over seeds: paired differences, mean and spread, and the verdict rule.

The verdict rule: a paired difference (arm − baseline, same training seed, so the same initial
weights and batches) separates the arms only when |mean| >= NOISE_FACTOR × its std over seeds; with
one seed nothing can be separated, because seed noise is unknown.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

NOISE_FACTOR = 2.0  # |mean paired difference| must reach this many stds to call a winner


def mean_std(xs: list[float]) -> tuple[float, float | None]:
    """Mean and sample std (None for a single value: one run says nothing about spread)."""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def paired_differences(arm: Mapping[int, float], baseline: Mapping[int, float]) -> list[float]:
    """arm[s] − baseline[s] for every seed s that both have, in seed order."""
    return [arm[s] - baseline[s] for s in sorted(arm) if s in baseline]


def verdict(arm: str, baseline: str, diffs: list[float]) -> str:
    """One honest sentence on `arm` − `baseline` final validation loss, from paired per-seed differences."""
    n = len(diffs)
    if n == 0:
        return f"**{arm} vs {baseline}:** no seed has finished both arms yet, so there is nothing to compare."
    m, s = mean_std(diffs)
    if n == 1:
        return (f"**{arm} vs {baseline}:** {arm} − {baseline} = {m:+.4f} nats with a single seed. A single seed "
                f"cannot separate the arms: how much the loss moves from seed to seed is unknown, and at this "
                f"scale it is typically as large as differences like this one. Run several seeds "
                f"(`--seeds 0,1,2`) before reading anything into the sign.")
    assert s is not None
    if s == 0 and m == 0:
        return f"**{arm} vs {baseline}:** identical final validation loss on all {n} seeds."
    if abs(m) < NOISE_FACTOR * s:
        return (f"**{arm} vs {baseline}:** {arm} − {baseline} = {m:+.4f} ± {s:.4f} nats (mean ± std of the paired "
                f"difference over {n} seeds). That is within seed noise (|mean| < {NOISE_FACTOR:g} × std): "
                f"these runs cannot separate the two arms.")
    lower, higher = (arm, baseline) if m < 0 else (baseline, arm)
    return (f"**{arm} vs {baseline}:** {lower} reaches the lower validation loss: {arm} − {baseline} = "
            f"{m:+.4f} ± {s:.4f} nats (mean ± std of the paired difference over {n} seeds), "
            f"{abs(m) / s if s else math.inf:.1f} × the std, beyond the {NOISE_FACTOR:g} × std noise threshold. "
            f"{higher} is behind at this scale and budget; with {n} seeds the std itself is rough, and "
            f"small-model results need not carry over to larger models.")

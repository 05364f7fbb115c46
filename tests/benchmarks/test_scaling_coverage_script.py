"""benchmarks/scaling_coverage.py: its Wilson interval, its synthetic studies and its table."""

import numpy as np
import pytest
from scipy.stats import binomtest

from tests.helpers import benchmark_script


@pytest.fixture(scope="module")
def script():
    return benchmark_script("scaling_coverage")


@pytest.mark.parametrize("hits,n", [(0, 10), (5, 10), (80, 100), (100, 100), (937, 1000)])
def test_wilson_interval_equals_scipys(script, hits, n):
    ci = binomtest(hits, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert script.wilson(hits, n) == pytest.approx((ci.low, ci.high), abs=1e-12)


def test_noiseless_study_follows_the_power_laws_and_gives_the_true_fraction(script):
    from difftransformer.experiments.scaling import scaling_fraction

    sizes = np.geomspace(1e6, 8e6, 4)
    points = script.simulated_points(np.random.default_rng(0), 3, sizes, 0.62, 40.0, 0.3, 2.0, 0.0)
    assert sorted(points) == ["arm", "baseline"] and sorted(points["arm"]) == [0, 1, 2]
    for x, y in points["baseline"][1]:
        assert y == pytest.approx(2.0 + 40.0 * x ** -0.3, rel=1e-12)
    for x, y in points["arm"][2]:  # the arm at x has the baseline's loss at x / 0.62
        assert y == pytest.approx(2.0 + 40.0 * (x / 0.62) ** -0.3, rel=1e-12)
    at = float(np.exp(np.log(sizes).mean()))
    assert scaling_fraction(points, "arm", "baseline", at=at, n_boot=0).fraction == pytest.approx(0.62, rel=1e-3)


def test_coverage_counts_the_intervals_that_hold_the_true_fraction(script, monkeypatch):
    """Stubbed fits with known intervals: one holds f, one misses it, one has none (left out of the count)."""
    intervals = iter([(0.5, 0.7), (0.7, 0.9), None])
    seen = []

    def stub(points, arm, baseline, *, at, n_boot, seed, confidence):
        seen.append((at, n_boot, confidence, sorted(points["arm"])))
        return type("Result", (), {"interval": next(intervals)})()

    monkeypatch.setattr(script, "scaling_fraction", stub)
    args = script.parse_args(["--trials", "3", "--n-boot", "7", "--confidence", "0.9", "--fraction", "0.62",
                              "--sizes", "3", "--smallest", "1e6", "--largest", "4e6"])
    row = script.coverage(args, 4)
    assert [s[1:] for s in seen] == [(7, 0.9, [0, 1, 2, 3])] * 3
    assert all(s[0] == pytest.approx(2e6, rel=1e-12) for s in seen)  # the grid's geometric mean, not its mean
    assert (row["seeds"], row["studies"], row["coverage"]) == (4, 2, 0.5)
    assert (row["lo"], row["hi"]) == pytest.approx(script.wilson(1, 2))
    assert row["width"] == pytest.approx(0.2)


def test_table_has_a_row_per_seed_count(script, capsys):
    assert script.main(["--seeds", "2", "3", "--trials", "2", "--n-boot", "5"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line[:4] in ("| 2 ", "| 3 ")]
    assert [r.split("|")[1].strip() for r in rows] == ["2", "3"]
    assert all(len(r.split("|")) == 8 for r in rows)


def test_one_seed_is_refused_in_one_line(script, capsys):
    with pytest.raises(SystemExit):
        script.main(["--seeds", "1"])
    assert "needs at least 2" in capsys.readouterr().err

"""Paired differences, mean and spread, and the verdict rule, on numbers whose answer is known."""

import pytest

from difftransformer.experiments import NOISE_FACTOR, mean_std, paired_differences, verdict


def test_paired_differences_use_the_seeds_both_arms_have():
    assert paired_differences({0: 3.0, 1: 3.5, 2: 4.0}, {0: 2.5, 2: 3.0, 5: 1.0}) == [0.5, 1.0]
    assert paired_differences({}, {0: 1.0}) == []


def test_mean_and_sample_std():
    assert mean_std([2.0]) == (2.0, None)
    m, s = mean_std([1.0, 2.0, 3.0])
    assert m == 2.0 and s == pytest.approx(1.0)


def test_verdict_rules():
    assert "cannot separate" in verdict("diff", "transformer", [-0.3])
    assert "within seed noise" in verdict("diff", "transformer", [-0.01, 0.02, -0.03])
    assert "diff reaches the lower" in verdict("diff", "transformer", [-0.10, -0.11, -0.09])
    assert "nothing to compare" in verdict("diff", "transformer", [])


def test_the_noise_threshold_is_where_the_verdict_turns():
    # mean 0.2, std 0.1: exactly 2 stds is a winner, just under is noise
    at = [0.1, 0.2, 0.3]
    assert NOISE_FACTOR == 2.0 and "transformer reaches the lower" in verdict("diff", "transformer", at)
    under = [0.09, 0.2, 0.31]  # std 0.11 > mean / 2
    assert "within seed noise" in verdict("diff", "transformer", under)
    assert "identical" in verdict("diff", "transformer", [0.0, 0.0])

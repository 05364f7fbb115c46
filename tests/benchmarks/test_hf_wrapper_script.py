"""benchmarks/hf_wrapper.py runs end to end (tiny sizes; its timings mean nothing here and are not checked)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def test_hf_wrapper_benchmark_prints_a_row_per_preset_and_kind():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_wrapper.py"), "--preset", "tiny,tiny",
                          "--prompt", "8", "--new-tokens", "2", "--repeats", "1"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| tiny |")]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("tiny", "diff"), ("tiny", "transformer")] * 2
    assert all(len(r) == 8 and float(r[4]) > 0 and float(r[7]) > 0 for r in rows), run.stdout
    assert run.stdout.count(": generate open, forward open") == 4  # one round: no interval, no verdict


def test_ratios_get_intervals_and_a_verdict_that_follows_them():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_wrapper.py"), "--preset", "tiny",
                          "--kinds", "diff", "--prompt", "8", "--new-tokens", "3", "--repeats", "6"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    row = next(line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| tiny |"))
    verdicts = next(line for line in run.stdout.splitlines() if line.startswith("- tiny diff: "))
    for cell, name in ((row[4], "forward"), (row[7], "generate")):
        med, lo, hi = map(float, re.fullmatch(r"\s*(\S+) \[(\S+), (\S+)\]\s*", cell).groups())
        assert lo <= med <= hi
        if 1.05 not in (lo, hi):  # the verdict reads unrounded bounds
            want = "met" if hi <= 1.05 else "not met" if lo > 1.05 else "open"
            assert f"{name} {want}" in verdicts, (cell, verdicts)

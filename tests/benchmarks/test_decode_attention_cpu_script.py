"""benchmarks/decode_attention_cpu.py runs end to end (tiny sizes; its timings mean nothing here and are not
checked)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import CPP_KERNEL_DISABLED

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(CPP_KERNEL_DISABLED, reason="DIFFTRANSFORMER_DISABLE_CPU_KERNEL=1")


def _run(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_attention_cpu.py"), *args],
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_row_per_batch_and_key_count_with_ratio_intervals():
    run = _run("--keys", "5", "130", "--batch", "1", "2", "--heads", "2", "--head-dim", "16", "--calls", "2",
               "--repeats", "6", "--threads", "1")
    assert run.returncode == 0, run.stderr
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if re.match(r"\| \d+ \| \d+ \|", line)]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("1", "5"), ("1", "130"), ("2", "5"), ("2", "130")]
    for r in rows:
        assert all(float(c) > 0 for c in r[2:5]), r
        for cell in r[5:]:
            med, lo, hi = map(float, re.fullmatch(r" (\S+) \[(\S+), (\S+)\] ", cell).groups())
            assert 0 < lo <= med <= hi, r


def test_bad_sizes_are_one_line_errors():
    run = _run("--keys", "0")
    assert run.returncode == 2 and "Traceback" not in run.stderr and "must be positive" in run.stderr

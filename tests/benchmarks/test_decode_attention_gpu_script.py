"""benchmarks/decode_attention_gpu.py: without CUDA it refuses in one line, naming the CPU benchmark; with a GPU
(marked gpu) it prints a row per batch and key count with ratio intervals."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_attention_gpu.py"), *args],
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_refuses_and_names_the_cpu_benchmark():
    run = _run()
    assert run.returncode == 2 and "needs a CUDA device; on CPU use decode_attention_cpu.py" in run.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_row_per_batch_and_key_count():
    run = _run("--keys", "130", "300", "--unwritten", "10", "--batch", "1", "2", "--heads", "2", "--head-dim", "16",
               "--calls", "2", "--repeats", "6")
    assert run.returncode == 0, run.stderr
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if re.match(r"\| \d+ \| \d+ \|", line)]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("1", "130"), ("1", "300"), ("2", "130"), ("2", "300")]
    assert all("[" in r[-1] for r in rows), run.stdout

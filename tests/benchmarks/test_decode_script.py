"""benchmarks/decode.py runs end to end (tiny sizes; its timings mean nothing here and are not checked)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = 18  # prompt, batch, 5 prefill times, 1 ratio, 5 decode rates, 5 ratios


def _run(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--preset", "tiny", *args],
                          env=env, capture_output=True, text=True, timeout=300)


def test_decode_benchmark_prints_a_row_per_prompt_and_batch():
    run = _run("--prompts", "8", "16", "--batch", "1", "2", "--new-tokens", "3", "--repeats", "1")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| prompt |"))
    assert len(header.split("|")) == COLUMNS + 2 and "Llama (HF)" in header and "T cpp/sdpa" in header
    rows = [line.split("|")[1:-1] for line in lines if line[:5] in ("| 8 |", "| 16 ")]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("8", "1"), ("8", "2"), ("16", "1"), ("16", "2")]
    assert all(len(r) == COLUMNS for r in rows), run.stdout


def test_decode_benchmark_refuses_too_few_new_tokens():
    run = _run("--prompts", "8", "--new-tokens", "1", "--no-llama")
    assert run.returncode != 0 and "--new-tokens must be at least 2" in run.stderr

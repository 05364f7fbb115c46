"""benchmarks/decode.py runs end to end (tiny sizes; its timings mean nothing here and are not checked)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import benchmark_script

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = 18  # prompt, batch, 5 prefill times, 1 ratio, 5 decode rates, 5 ratios


def _run(*args, **env_overrides):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **env_overrides}
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--preset", "tiny", *args],
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_decode_benchmark_prints_a_row_per_prompt_and_batch():
    run = _run("--prompts", "8", "16", "--batch", "1", "2", "--new-tokens", "3", "--repeats", "1")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| prompt |"))
    assert len(header.split("|")) == COLUMNS + 2 and "Llama (HF)" in header and "T cpp/sdpa" in header
    rows = [line.split("|")[1:-1] for line in lines if line[:5] in ("| 8 |", "| 16 ")]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("8", "1"), ("8", "2"), ("16", "1"), ("16", "2")]
    assert all(len(r) == COLUMNS for r in rows), run.stdout


class _Clock:
    """A stand-in for the benchmark's `time` module: perf_counter reads a clock that only the model advances,
    so the split is checked exactly, whatever the machine's load."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _SleepyLM(torch.nn.Module):
    """A model whose first forward takes `first` s and every later one `step` s of `clock`; generate makes n
    forwards (or `extra` more), the way a library's greedy loop does."""

    def __init__(self, clock: _Clock, first: float, step: float, extra: int = 0):
        super().__init__()
        self.clock, self.first, self.step, self.extra, self.calls = clock, first, step, extra, 0

    def forward(self, ids):
        self.clock.now += self.first if self.calls == 0 else self.step
        self.calls += 1

    def generate(self, prompt, n, on_token=None):
        self.calls = 0
        for _ in range(n + self.extra):
            self(prompt)
            if on_token is not None:  # as our generate reports each new token, right after its forward
                on_token(None)


@pytest.mark.parametrize("streams", [True, False], ids=["at the first token", "at the second forward"])
def test_one_generate_call_is_split_where_the_first_token_is_known(streams, monkeypatch):
    decode = benchmark_script("decode")
    clock = _Clock()
    monkeypatch.setattr(decode, "time", clock)
    lm = _SleepyLM(clock, first=0.2, step=0.1)
    arm = decode.Arm("x", lm, lm.generate, torch.device("cpu"), streams=streams)
    prefill, rest = arm.timed(torch.zeros(1, 3), 4)  # a split one step late or early would be off by 0.1 s
    assert (prefill, rest) == pytest.approx((0.2, 0.3), abs=1e-9)
    lm2 = _SleepyLM(clock, first=0.0, step=0.0, extra=1)
    with pytest.raises(RuntimeError, match="generate of 4 tokens reported 5 steps, not 4"):
        decode.Arm("y", lm2, lm2.generate, torch.device("cpu"), streams=streams).timed(torch.zeros(1, 3), 4)


def test_decode_benchmark_refuses_too_few_new_tokens():
    run = _run("--prompts", "8", "--new-tokens", "1", "--no-llama")
    assert run.returncode != 0 and "--new-tokens must be at least 2" in run.stderr


def _cells(stdout: str) -> dict[str, str]:
    """The first data row of the table, by column title."""
    lines = stdout.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("| prompt |"))
    titles, row = ([c.strip() for c in lines[j].split("|")[1:-1]] for j in (i, i + 2))
    assert len(titles) == len(row), stdout
    return dict(zip(titles, row))


def test_columns_follow_the_backends_asked_and_ratios_match_the_rates():
    run = _run("--device", "cpu", "--backends", "auto", "sdpa", "--precision", "bf16", "--prompts", "8",
               "--batch", "2", "--new-tokens", "4", "--repeats", "1", "--threads", "1", "--no-llama")
    assert run.returncode == 0, run.stderr
    assert "tiny, bf16," in run.stdout and "on cpu (" in run.stdout
    assert re.search(r"auto resolves to T auto=(cpp|sdpa), DIFF auto=(cpp|sdpa)", run.stdout), run.stdout
    cells = _cells(run.stdout)
    arms = ["T auto", "T sdpa", "DIFF auto", "DIFF sdpa"]
    assert list(cells) == ["prompt", "batch", *(f"prefill ms {a}" for a in arms), "prefill DIFF/T (best)",
                           *(f"decode tok/s {a}" for a in arms), "decode DIFF/T (best)",
                           "decode DIFF/T auto", "decode DIFF/T sdpa"]
    for b in ("auto", "sdpa"):
        t, d = (cells[f"decode tok/s {k} {b}"] for k in ("T", "DIFF"))
        if "-" in (t, d):  # noise made a median generate no slower than its prefill: nothing to divide
            continue
        t, d = float(t.replace(",", "")), float(d.replace(",", ""))
        assert abs(float(cells[f"decode DIFF/T {b}"]) - d / t) <= 0.005 + (d + t) / t ** 2, cells


def test_cuda_without_a_gpu_is_a_one_line_error():
    run = _run("--device", "cuda", "--prompts", "8", CUDA_VISIBLE_DEVICES="")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.splitlines()[-1].endswith("no CUDA GPU is visible here (torch.cuda.is_available() is False); "
                                                 "use --device cpu or auto")


def test_a_backend_that_cannot_run_is_refused_before_any_model_is_built():
    run = _run("--device", "cpu", "--backends", "triton", "--prompts", "8", TRITON_INTERPRET=None)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "--backends triton on cpu in fp32: backend 'triton' runs on CUDA" in run.stderr.splitlines()[-1]


def test_triton_runs_for_diff_only():
    pytest.importorskip("triton")
    run = _run("--device", "cpu", "--backends", "triton", "sdpa", "--prompts", "8", "--batch", "1",
               "--new-tokens", "2", "--repeats", "1", "--threads", "1", "--no-llama", TRITON_INTERPRET="1")
    assert run.returncode == 0, run.stderr
    assert "T has no triton arm" in run.stdout
    cells = _cells(run.stdout)
    assert "decode tok/s DIFF triton" in cells and "decode tok/s T triton" not in cells
    assert "decode DIFF/T sdpa" in cells and "decode DIFF/T triton" not in cells


def test_ratios_get_intervals_and_the_targets_a_verdict_that_follows_them():
    run = _run("--device", "cpu", "--backends", "cpp", "sdpa", "--prompts", "8", "--batch", "1", "--new-tokens", "16",
               "--repeats", "8", "--threads", "1", "--no-llama")
    assert run.returncode == 0, run.stderr
    cells = _cells(run.stdout)
    for title, side, line in (("decode DIFF/T (best)", ">=", 0.95), ("decode T cpp/sdpa", ">=", 1.0),
                              ("prefill DIFF/T (best)", "<=", 1.15)):
        m = re.fullmatch(r"(\d+\.\d\d) \[(\d+\.\d\d), (\d+\.\d\d)\]", cells[title])
        assert m, cells[title]
        med, lo, hi = map(float, m.groups())
        assert lo <= med <= hi
        if line in (lo, hi):  # the verdict reads the unrounded bound, which the 2 decimals hide
            continue
        want = ("met" if (lo >= line if side == ">=" else hi <= line) else
                "not met" if (hi < line if side == ">=" else lo > line) else "open")
        summary = next(s for s in run.stdout.splitlines() if s.startswith(f"- {title} {side} {line:g}:"))
        assert summary.endswith(f": {want} at 8/1"), (summary, cells[title])

"""benchmarks/gpu_trace.py, run on CPU through the Triton interpreter: its code paths (a GPU session is
short), its table's arithmetic, and one-line errors for what cannot run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, interpret="1"):
    env = {**os.environ, "TRITON_INTERPRET": interpret, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_trace.py"), *args],
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_smoke_run_traces_the_three_workloads():
    run = _run("--cpu-smoke-test")
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {cells[0]: cells[1:] for line in run.stdout.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.split("|")[1:-1]]] if len(cells) == 5 and cells[0] != "workload"}
    assert set(rows) == {"fused, two-pass backward", "fused, one-pass backward", "baseline (SDPA)"}, run.stdout
    for wall, host, busy, idle in rows.values():
        assert float(wall) > 0 and float(host) > 0 and float(busy) > 0
        # idle = 1 - busy / wall, floored at 0, printed as a whole percentage
        assert idle == f"{max(0.0, 1 - float(busy) / float(wall)):.0%}" or abs(
            int(idle[:-1]) - max(0.0, 1 - float(busy) / float(wall)) * 100) <= 1
    # the fused workloads run the package's two custom ops, once each per call
    assert "| difftransformer::diff_flash_fwd |" in run.stdout and "| difftransformer::diff_flash_bwd |" in run.stdout


@pytest.mark.parametrize("args,message", [(("--cpu-smoke-test", "--iters", "0"), "--iters must be at least 1"),
                                          (("--shapes", "16,8,3,2048,64"), "h a multiple of h_kv")])
def test_bad_arguments_are_one_line(args, message):
    run = _run(*args)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_without_a_gpu_or_the_interpreter_flag_is_one_line():
    run = _run(interpret="0")
    assert run.returncode == 2 and "no CUDA GPU here" in run.stderr and "Traceback" not in run.stderr

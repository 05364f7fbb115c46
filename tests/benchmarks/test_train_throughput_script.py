"""benchmarks/train_throughput.py runs end to end on CPU (tiny sizes; its timings mean nothing here and
are not checked, only that the table and its ratios agree), and refuses impossible devices and
backends in one line. The CUDA path runs in a GPU session; these tests keep its options honest."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ("--preset", "tiny", "--seq-len", "16", "--batch", "2", "--repeats", "2", "--threads", "1")


def _run(*args, **env_overrides):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **env_overrides}
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), *args],
                          env=env, capture_output=True, text=True, timeout=300)


def _table(stdout: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for line in stdout.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.split("|")[1:-1]]] if cells[0] in ("Transformer", "DIFF")}


@pytest.mark.slow
def test_cpu_run_prints_both_arms_and_consistent_ratios():
    run = _run("--device", "cpu", *TINY, "--no-deterministic")
    assert run.returncode == 0, run.stderr
    assert "on cpu (" in run.stdout and "deterministic False" in run.stdout and "threads)" in run.stdout
    rows = _table(run.stdout)
    assert set(rows) == {"Transformer", "DIFF"} and all(len(r) == 5 for r in rows.values()), run.stdout
    ms = {k: float(r[1]) for k, r in rows.items()}
    tput = float(re.search(r"throughput ([\d.]+)x", run.stdout).group(1))
    # step ms is printed to 0.1 ms: the ratio agrees with the printed times within that rounding
    lo = (ms["Transformer"] - 0.05) / (ms["DIFF"] + 0.05)
    hi = (ms["Transformer"] + 0.05) / (ms["DIFF"] - 0.05)
    assert lo - 1e-3 <= tput <= hi + 1e-3, run.stdout
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows.values()), run.stdout  # peak, resident MiB


@pytest.mark.slow
def test_trace_lists_kernels_of_both_arms_with_their_differences():
    """--trace: one row per operator (CPU: operators stand in for kernels), the DIFF - T column the
    difference of the two printed times, rows ordered by its size; DIFF's own attention op is there."""
    run = _run("--device", "cpu", *TINY, "--trace", "1")
    assert run.returncode == 0, run.stderr
    assert "## Kernels per step: Transformer" in run.stdout, run.stdout
    section = run.stdout.split("## Kernels per step")[1]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| kernel")]
    assert 5 <= len(rows) <= 30, section
    deltas = []
    for name, t, d, delta, launches in rows:
        assert abs(float(d) - float(t) - float(delta)) <= 1.5e-3, (name, t, d, delta)
        assert re.fullmatch(r"[\d.]+ / [\d.]+", launches), launches
        deltas.append(abs(float(delta)))
    assert deltas == sorted(deltas, reverse=True), section
    if "DIFF cpp" in run.stdout:  # DIFF's fused C++ op runs in DIFF's steps only
        assert any(r[0].startswith("difftransformer_cpu::diff") and float(r[1]) == 0 < float(r[2]) for r in rows)


@pytest.mark.slow
def test_config_takes_the_model_from_a_run_config_with_overrides():
    """--config FILE --set ...: the run config's model (here cpu-small cut to one layer and width 64), both
    arms at the parameter counts that config gives; mistakes in it are one-line errors naming the file."""
    run = _run("--device", "cpu", *TINY[2:], "--config", str(ROOT / "configs" / "cpu-small.toml"),
               "--set", "model.num_hidden_layers=1", "model.hidden_size=64", "model.num_attention_heads=2")
    assert run.returncode == 0, run.stderr
    from difftransformer import DiffTransformerLM, get_preset

    want = DiffTransformerLM(get_preset("cpu-small").config("diff", num_hidden_layers=1, hidden_size=64,
                                                            num_attention_heads=2), device="meta").num_parameters()
    rows = _table(run.stdout)
    assert f"config {ROOT / 'configs' / 'cpu-small.toml'}" in run.stdout
    assert rows["DIFF"][0] == f"{want / 1e6:.2f}M", run.stdout
    bad = _run("--device", "cpu", *TINY[2:], "--config", str(ROOT / "configs" / "cpu-small.toml"),
               "--set", "model.nope=1")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "unknown key 'nope' in [model]" in bad.stderr
    alone = _run("--device", "cpu", *TINY, "--set", "model.hidden_size=64")
    assert alone.returncode == 2 and "--set overrides a run config: give --config too" in alone.stderr


def test_negative_trace_is_a_one_line_error():
    run = _run("--device", "cpu", *TINY, "--trace", "-1")
    assert run.returncode == 2 and "Traceback" not in run.stderr and "--trace at least 0" in run.stderr


def test_cuda_without_a_gpu_is_a_one_line_error():
    run = _run("--device", "cuda", *TINY, CUDA_VISIBLE_DEVICES="")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.splitlines()[-1].endswith("no CUDA GPU is visible here (torch.cuda.is_available() is False); "
                                                 "use --device cpu or auto")


def test_a_backend_that_cannot_run_on_the_device_is_a_one_line_error():
    run = _run("--device", "cpu", "--backend", "triton", *TINY, TRITON_INTERPRET=None)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "--backend triton on cpu: backend 'triton' runs on CUDA" in run.stderr.splitlines()[-1]


@pytest.mark.slow
def test_triton_backend_gives_the_transformer_arm_its_auto_backend():
    """'triton' is DIFF-only: the Transformer arm runs 'auto' (here the C++ kernel, or SDPA if it does not
    build), DIFF the Triton kernel (through the interpreter on CPU)."""
    pytest.importorskip("triton")
    run = _run("--device", "cpu", "--backend", "triton", "--preset", "tiny", "--seq-len", "8", "--batch", "1",
               "--repeats", "1", "--threads", "1", TRITON_INTERPRET="1")
    assert run.returncode == 0, run.stderr
    assert re.search(r"backend triton \(Transformer (cpp|sdpa), DIFF triton\)", run.stdout), run.stdout
    assert set(_table(run.stdout)) == {"Transformer", "DIFF"}

"""benchmarks/gpu_tile_check.py, run on CPU through the interpreter: its code paths (a GPU session is
short), that pinning a pass to a tile really changes what runs, and that its reference is right."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_tile_check as gtc  # noqa: E402

from difftransformer.kernels import diff_flash  # noqa: E402
from tests.reference import diff_attention_reference  # noqa: E402

pytestmark = pytest.mark.skipif(not diff_flash._INTERPRET, reason="the smoke test runs the interpreter")


@pytest.mark.slow
def test_smoke_run_checks_every_pass_and_finds_them_right():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_tile_check.py"), "--cpu-smoke-test",
                          "--time", "1,2,1,24,16"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| 16 |")]
    pinned = [(p, t) for p in gtc.OUTPUTS for t in gtc.smoke_tiles(p)]  # the key-block pass split and not
    assert len(rows) == 4 + len(pinned)  # 2 shapes x 2 backwards, then one row per pass and tile
    cells = [[c.strip() for c in r.split("|")[2:8]] for r in rows[4:]]
    assert [(c[0], c[5]) for c in cells] == [(p, "yes" if len(t) > 4 else "no") for p, t in pinned]
    assert all(r.rstrip().endswith("| yes |") for r in rows), run.stdout
    timed = run.stdout.split("## Time of each tile, B 1, h 2, h_kv 1, T 24, d 16")[1].splitlines()
    timed = [line.split("|")[1:-1] for line in timed if line.startswith("| ") and not line.startswith("| pass")]
    assert [(c[0].strip(), c[5].strip()) for c in timed] == [(p, "yes" if len(t) > 4 else "no") for p, t in pinned]
    assert all(float(c[6]) > 0 and float(c[7].rstrip("x ")) >= 1.0 and float(c[8]) > 0 for c in timed)
    for p in gtc.OUTPUTS:  # each pass's fastest tile reads 1.00x
        assert "1.00x" in [c[7].strip() for c in timed if c[0].strip() == p], p


@pytest.mark.parametrize("flag,value,message", [("--time", "16,8,3,2048,64", "h a multiple of h_kv"),
                                                ("--head-dims", "abc", "positive integers"),
                                                ("--head-dims", "0", "positive integers")])
def test_bad_shapes_and_dims_are_one_line(flag, value, message):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_tile_check.py"), "--cpu-smoke-test",
                          flag, value], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_without_a_gpu_or_the_interpreter_flag_is_one_line():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_tile_check.py")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "no CUDA GPU here" in run.stderr and "Traceback" not in run.stderr


def test_pin_runs_the_pinned_tile_and_restores_the_tuner():
    kernel = gtc.kernels()["fwd"]
    before = kernel.configs
    q, k, v, do = gtc.inputs(1, 2, 1, 40, 16, "cpu", torch.float32, seed=3)
    with diff_flash.pinned(kernel, (24, 16, 1, 1)):  # not a power of two: only a kernel that runs it can fail
        with pytest.raises(Exception):
            gtc.fused(q, k, v, do, 0.7, True, True)
    assert kernel.configs is before
    outs = []
    for tile in ((16, 16, 1, 1), (16, 32, 1, 1)):
        with diff_flash.pinned(kernel, tile):
            outs.append(gtc.fused(q, k, v, do, 0.7, True, True)["out"])
    assert not torch.equal(outs[0], outs[1])  # another key block: another fp32 rounding, so it did run
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_the_float64_reference(causal):
    B, h, h_kv, T, d = 2, 4, 2, 13, 8
    q, k, v, do = gtc.inputs(B, h, h_kv, T, d, "cpu", torch.float64, seed=int(torch.randint(0, 2**31, ())))
    got = gtc.reference(q, k, v, do, 0.6, causal)
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    lr = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
    want = diff_attention_reference(qr, kr, vr, lr, causal=causal)
    grads = torch.autograd.grad(want, (qr, kr, vr, lr), do)
    for name, w in zip(("out", "dq", "dk", "dv", "dlam"), (want, *grads)):
        torch.testing.assert_close(got[name].double(), w.detach(), rtol=1e-5, atol=1e-5, msg=name)
    assert gtc.error(got["out"] + 0.1, got["out"]) == pytest.approx(0.1 / max(got["out"].abs().max().item(), 1.0))


@pytest.mark.slow
def test_no_check_times_only():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_tile_check.py"), "--cpu-smoke-test",
                          "--no-check", "--time", "1,2,2,20,16"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "## All passes" not in run.stdout and "## One pass pinned" not in run.stdout
    assert "## Time of each tile, B 1, h 2, h_kv 2, T 20, d 16" in run.stdout


@pytest.mark.slow
def test_ncu_driver_refuses_bad_tiles_and_a_missing_gpu_in_one_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    script = str(ROOT / "benchmarks" / "gpu_ncu_driver.py")
    for extra, message in ((["--fwd", "64,64", "--dkdv", "32,64,4,2", "--dq", "64,64,4,2"], "BLOCK_M,BLOCK_N"),
                           (["--fwd", "64,64,8,2", "--dkdv", "32,64,4,2"], "--dq is needed"),
                           (["--fwd", "64,64,8,2,split", "--dkdv", "32,64,4,2", "--one-pass"], "only the key-block"),
                           (["--fwd", "64,64,8,2", "--dkdv", "32,64,4,2,split", "--one-pass"], "no split tiles"),
                           (["--fwd", "64,64,8,2", "--dkdv", "32,64,4,2", "--one-pass"], "no CUDA GPU here")):
        run = subprocess.run([sys.executable, script, *extra], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("one_pass,dkdv", [(False, (16, 16, 1, 1)), (False, (16, 16, 1, 1, "split")),
                                           (True, (16, 16, 1, 1))])
def test_ncu_driver_workload_runs_each_pass_on_its_pinned_tile(one_pass, dkdv, monkeypatch):
    """The workload itself (on CPU through the interpreter): every pass pinned, the tuners restored."""
    import argparse

    import gpu_ncu_driver

    ks = gtc.kernels()
    before = {name: k.configs for name, k in ks.items()}
    seen = []
    real = diff_flash.pinned

    def spy(kernel, tile):
        seen.append((kernel, tile))
        return real(kernel, tile)

    monkeypatch.setattr(diff_flash, "pinned", spy)
    args = argparse.Namespace(shape=(1, 2, 1, 20, 16), fwd=(16, 16, 1, 1), dkdv=dkdv,
                              dq=None if one_pass else (16, 32, 1, 1), one_pass=one_pass, iterations=2)
    gpu_ncu_driver.workload(args, "cpu", torch.float32)
    want = [(ks["fwd"], args.fwd)] + ([(ks["bwd_dkdvq"], dkdv)] if one_pass else [(ks["bwd_dkdv"], dkdv),
                                                                                   (ks["bwd_dq"], args.dq)])
    assert seen == want
    assert all(k.configs is before[name] for name, k in ks.items())

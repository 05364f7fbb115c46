"""Subnormal floats on CPU: flushed by every entry point (so a converged model does not train 10x slower), kept on
request, the mode found restored, and recorded with the machine."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from difftransformer import numerics
from difftransformer.experiments import hardware
from difftransformer.train import train
from tests.helpers import make_cfg, tiny

SUBNORMAL = 1e-39  # below float32's smallest normal number, 1.18e-38
pytestmark = pytest.mark.skipif(not torch.set_flush_denormal(False),
                                reason="this CPU has no flush-to-zero flags (torch.set_flush_denormal says so)")


def _kept_in_this_thread() -> bool:
    """Whether a subnormal input survives a multiplication by 1 here (a small tensor: the main thread alone)."""
    return bool(torch.tensor([SUBNORMAL]).mul(1.0).item() != 0.0)


@pytest.fixture(autouse=True)
def _restore():
    before = numerics.denormals_mode()
    yield
    if before == "kept":
        numerics._unflush()


def test_flushed_reads_a_subnormal_as_zero_and_restores_the_mode_found(monkeypatch):
    monkeypatch.delenv(numerics.KEEP_ENV, raising=False)
    assert numerics.denormals_mode() == "kept" and _kept_in_this_thread()  # IEEE arithmetic by default
    with numerics.denormals_flushed() as flushed:
        assert flushed and numerics.denormals_mode() == "flushed" and not _kept_in_this_thread()
        with numerics.denormals_flushed():  # nested: stays flushed, and the inner block does not restore
            pass
        assert not _kept_in_this_thread()
    assert numerics.denormals_mode() == "kept" and _kept_in_this_thread()


def test_keep_request_computes_with_subnormals(monkeypatch):
    monkeypatch.setenv(numerics.KEEP_ENV, "1")
    assert numerics.keep_requested() and not numerics.flush_denormals()
    assert numerics.denormals_mode() == "kept" and _kept_in_this_thread()
    for off in ("0", "false", "no", "off", ""):
        monkeypatch.setenv(numerics.KEEP_ENV, off)
        assert not numerics.keep_requested()


def test_hardware_records_the_mode(monkeypatch):
    monkeypatch.delenv(numerics.KEEP_ENV, raising=False)
    assert hardware()["denormals"] == "kept"
    with numerics.denormals_flushed():
        assert hardware()["denormals"] == "flushed"


def test_training_runs_flushed_and_restores(data_dir, tmp_path, monkeypatch):
    """train() flushes for library callers too, and leaves the process as it found it."""
    from difftransformer.train import trainer

    monkeypatch.delenv(numerics.KEEP_ENV, raising=False)
    seen = []
    real = trainer._train
    monkeypatch.setattr(trainer, "_train", lambda *a, **k: (seen.append(_kept_in_this_thread()), real(*a, **k))[1])
    train(tiny(), make_cfg(data_dir, tmp_path, max_steps=1, ckpt_interval=1))
    assert seen == [False] and _kept_in_this_thread()


def test_the_cli_flushes_before_torch_starts_its_threads():
    """The flags are per thread and inherited at a thread's creation: importing the CLI must not start torch's
    intra-op threads, so that the ones a command starts (2 here) flush too; a subnormal in each half of a large
    product then reads as 0."""
    probe = ("import torch, difftransformer.cli as cli\n"
             "def run(args):\n"
             "    x = torch.full((1 << 22,), 1e-39)\n"
             "    print('kept', int((x * 1.0 != 0).sum()), torch.get_num_threads())\n"
             "    return 0\n"
             "cli.COMMANDS['report'].run = run\n"
             "raise SystemExit(cli.main(['report', 'nowhere']))\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != numerics.KEEP_ENV}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**env, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["kept", "0", "2"]

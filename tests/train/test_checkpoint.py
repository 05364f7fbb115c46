"""Checkpoints and resumes: atomic writes, a crash mid-write, corruption, refused resumes, set-aside runs, kill -9."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import difftransformer.train.checkpoint as ckpt_mod
from difftransformer._io import atomic_path, atomic_write_text
from difftransformer.model import DiffTransformerLM
from difftransformer.train import CheckpointError, TrainConfig, load_checkpoint, read_metrics, train, verify_checkpoint
from tests.helpers import assert_same_weights, latest_dir, make_cfg, tiny, untimed


def test_crash_mid_checkpoint_write_keeps_previous(data_dir, tmp_path, monkeypatch):
    cfg2 = make_cfg(data_dir, tmp_path, max_steps=2, ckpt_interval=2)
    train(tiny(), cfg2)
    before = (tmp_path / "checkpoints" / "latest").read_text()
    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        assert Path(path).parent.name.endswith(".tmp")  # the tmp dir exists when the crash hits
        raise OSError("simulated crash: disk full")

    monkeypatch.setattr(ckpt_mod, "save_file", failing_save)
    with pytest.raises(OSError, match="simulated crash"):
        train(tiny(), make_cfg(data_dir, tmp_path, max_steps=4, ckpt_interval=2))
    monkeypatch.undo()
    assert calls and (tmp_path / "checkpoints" / "latest").read_text() == before
    assert not (tmp_path / "checkpoints" / "step_00000004").exists()
    verify_checkpoint(tmp_path / "checkpoints" / "step_00000002")
    assert load_checkpoint(tmp_path)["step"] == 2
    res = train(tiny(), make_cfg(data_dir, tmp_path, max_steps=4, ckpt_interval=2))  # cleans the stale tmp dir
    assert res.final_step == 4 and not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_atomic_path_replaces_on_success_and_cleans_up_on_failure(tmp_path):
    target = tmp_path / "latest"
    atomic_write_text(target, "old\n", fsync=True)
    with pytest.raises(OSError, match="simulated"):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise OSError("simulated crash")
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    atomic_write_text(target, "new\n")
    assert target.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_corrupted_checkpoint_and_config_mismatch(data_dir, tmp_path, caplog):
    cfg = make_cfg(data_dir, tmp_path, max_steps=2, ckpt_interval=2)
    train(tiny(), cfg)
    # a different model config names the differing key
    with pytest.raises(CheckpointError, match=r"attention: checkpoint 'diff' vs requested 'transformer'"):
        train(tiny("transformer"), make_cfg(data_dir, tmp_path, max_steps=4))
    with pytest.raises(CheckpointError, match=r"seq_len: checkpoint 32 vs requested 16"):
        train(tiny(), make_cfg(data_dir, tmp_path, max_steps=4, seq_len=16))
    # how attention is computed is not part of the experiment: another backend or the
    # one-pass backward resumes the same run
    other_runtime = dataclasses.replace(tiny(), attn_backend="eager", attn_deterministic=False)
    with caplog.at_level(logging.INFO, logger="difftransformer.train"):
        assert train(other_runtime, make_cfg(data_dir, tmp_path, max_steps=3, ckpt_interval=3)).final_step == 3
    assert "at step 2" in "\n".join(r.getMessage() for r in caplog.records if "resumed from" in r.getMessage())
    # flip bytes in the weights
    weights = latest_dir(tmp_path) / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-10] ^= 0xFF
    weights.write_bytes(bytes(blob))
    msg = r"corrupted: sha256 of model.safetensors does not match.*Delete that checkpoint directory.*--no-resume"
    with pytest.raises(CheckpointError, match=msg):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=msg):
        train(tiny(), make_cfg(data_dir, tmp_path, max_steps=4))
    # resume=False starts over
    res = train(tiny(), make_cfg(data_dir, tmp_path, max_steps=2, ckpt_interval=2), resume=False)
    assert res.final_step == 2 and load_checkpoint(tmp_path)["step"] == 2


KILL_SCRIPT = """
import sys
from difftransformer.model import get_preset
from difftransformer.train import TrainConfig, train
cfg = TrainConfig(data_dir={data!r}, out_dir=sys.argv[1], seq_len=32, batch_size=8, max_steps={steps},
                  warmup_steps=2, lr=3e-3, min_lr=3e-4, eval_interval=5, eval_batches=1, log_interval=1,
                  ckpt_interval=1, keep_last=2, progress=False, tensorboard=False, device="cpu")
train(get_preset("tiny").config("diff"), cfg)
"""


def test_kill_9_leaves_a_valid_checkpoint_and_resume_is_exact(data_dir, tmp_path):
    steps = 30
    script = tmp_path / "run_train.py"
    script.write_text(textwrap.dedent(KILL_SCRIPT.format(data=data_dir, steps=steps)))
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(script), str(out)], env=env)
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 90
    try:
        while not latest.exists():
            assert proc.poll() is None, "training subprocess exited before writing a checkpoint"
            assert time.time() < deadline, "no checkpoint appeared within 90 s"
            time.sleep(0.01)
        time.sleep(0.05)  # land somewhere in later steps/checkpoint writes
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ck_dir = latest_dir(out)
    verify_checkpoint(ck_dir)
    ck = load_checkpoint(out)
    assert 1 <= ck["step"] <= steps
    DiffTransformerLM(ck["model_config"]).load_state_dict(ck["model"])

    ref = train(tiny(), TrainConfig.from_dict({**ck["train_config"].to_dict(), "out_dir": str(tmp_path / "ref")}))
    res = train(tiny(), ck["train_config"])
    assert res.final_step == steps
    assert_same_weights(ref.model, res.model)
    assert untimed(read_metrics(res.metrics_path)) == untimed(read_metrics(ref.metrics_path))


def test_a_fresh_start_never_deletes_what_it_has_not_replaced(data_dir, tmp_path, monkeypatch):
    """--no-resume (resume=False) with a config that fails, or a run killed before its first checkpoint,
    leaves the old checkpoints; they go only once the new run has saved one."""
    from difftransformer.train import RunDir

    train(tiny(), make_cfg(data_dir, tmp_path, max_steps=2, ckpt_interval=2))
    run = RunDir(tmp_path)
    before = latest_dir(tmp_path).name
    with pytest.raises(ValueError):  # the new model cannot be built: nothing is touched
        train(tiny(hidden_size=65), make_cfg(data_dir, tmp_path, max_steps=2), resume=False)
    assert latest_dir(tmp_path).name == before and not run.replaced_checkpoints.exists()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed before the first checkpoint")

    monkeypatch.setattr(ckpt_mod, "save_checkpoint", killed)
    import difftransformer.train.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "save_checkpoint", killed)
    with pytest.raises(KeyboardInterrupt):
        train(tiny(), make_cfg(data_dir, tmp_path, max_steps=2, ckpt_interval=2), resume=False)
    assert (run.replaced_checkpoints / before).is_dir()  # set aside, not deleted
    assert (run.replaced / "metrics.jsonl").is_file() and (run.replaced / "final").is_dir()  # with its log, weights
    monkeypatch.undo()
    train(tiny(), make_cfg(data_dir, tmp_path, max_steps=2, ckpt_interval=2), resume=False)
    assert not run.replaced.exists() and latest_dir(tmp_path).name == "step_00000002"


def test_the_same_state_is_written_as_the_same_bytes(tmp_path):
    """safetensors writes its metadata map in the order of a randomly seeded Rust HashMap, so equal states can give
    files that differ in their header (and in their checksums); canonical_safetensors makes them the same bytes: it
    sorts the metadata keys in place, keeps the tensors and metadata readable, and touches no data."""
    import random

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from difftransformer._io import canonical_safetensors

    rng = random.Random()
    meta = {f"k{rng.randrange(10**6)}é": f"v{i}\n\"ü" for i in range(4)} | {"format": "pt"}
    tensors = {"wé": torch.randn(3, 5), "b": torch.randn(7).half()}
    seen, path = set(), tmp_path / "t.safetensors"
    for _ in range(12):
        save_file(tensors, str(path), metadata=meta)
        canonical_safetensors(path)
        seen.add(path.read_bytes())
    assert len(seen) == 1
    assert all(torch.equal(load_file(str(path))[k], tensors[k]) for k in tensors)
    with safe_open(str(path), "pt") as fh:
        assert fh.metadata() == meta

    from difftransformer.train.distributed import full_optimizer_state_by_name
    from difftransformer.train.optim import build_optimizer

    cfg = make_cfg(str(tmp_path / "data"), tmp_path)
    model = DiffTransformerLM(tiny())
    optim = build_optimizer(model, cfg)
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).loss.backward()
    optim.step()
    dirs = [ckpt_mod.save_checkpoint(tmp_path / f"root{i}", 2, model.state_dict(),
                                     full_optimizer_state_by_name(model, optim, False), {}, tiny(), cfg, 1)
            for i in range(6)]
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert len({(d / name).read_bytes() for d in dirs}) == 1, name


def test_a_resume_runs_on_its_own_optimizer_settings(data_dir, tmp_path):
    """Weight decay, betas and eps changed on resume (tolerated, with a warning) are the ones the optimizer uses from
    there on: loading the checkpoint's optimizer state must not bring back its group settings."""
    train(tiny(), make_cfg(data_dir, tmp_path, max_steps=3))
    train(tiny(), make_cfg(data_dir, tmp_path, max_steps=6, weight_decay=0.5, beta2=0.9, adam_eps=1e-6))
    groups = load_checkpoint(tmp_path)["optimizer"]["param_groups"]
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.5]
    assert all(tuple(g["betas"]) == (0.9, 0.9) and g["eps"] == 1e-6 for g in groups)


def test_a_resume_holds_no_copy_of_the_checkpoint_while_it_trains(data_dir, tmp_path, monkeypatch):
    """The loaded checkpoint's model tensors are in the model once it is built: no second copy of the weights stays
    in host memory for the rest of the run."""
    import weakref

    import difftransformer.train.trainer as trainer_mod

    train(tiny(), make_cfg(data_dir, tmp_path, max_steps=2, ckpt_interval=2))
    loaded, alive = [], []
    real_load, real_run = trainer_mod.load_checkpoint, trainer_mod._Loop.run

    def load(path):
        ckpt = real_load(path)
        loaded.extend(weakref.ref(t) for t in ckpt["model"].values())
        return ckpt

    def run(self, start_step):
        alive.append(sum(ref() is not None for ref in loaded))
        return real_run(self, start_step)

    monkeypatch.setattr(trainer_mod, "load_checkpoint", load)
    monkeypatch.setattr(trainer_mod._Loop, "run", run)
    assert train(tiny(), make_cfg(data_dir, tmp_path, max_steps=3)).steps_trained == 1
    assert loaded and alive == [0]


def test_a_resume_on_another_train_split_of_the_same_corpus_is_refused(data_dir, tmp_path):
    """Same corpus, same tokenizer, other train documents (a training mixture added): the batches would differ, so
    the resume is refused, naming the cause."""
    from difftransformer.data import PreparedData, prepare_data
    from difftransformer.data.config import MixtureConfig

    plain = PreparedData.load(data_dir)
    mixed = prepare_data(corpus=plain.corpus, out_dir=tmp_path / "mixed", vocab_size=300,
                         mixture=MixtureConfig(icl=0.3, length=128))
    assert (mixed.corpus_hash, mixed.tokenizer_hash) == (plain.corpus_hash, plain.tokenizer_hash)
    train(tiny(), make_cfg(data_dir, tmp_path / "run", max_steps=3))
    with pytest.raises(CheckpointError, match="another train split of the same corpus"):
        train(tiny(), make_cfg(str(mixed.out_dir), tmp_path / "run", max_steps=6))
    assert train(tiny(), make_cfg(data_dir, tmp_path / "run", max_steps=4)).steps_trained == 1  # its own data: on


def test_a_refused_resume_leaves_the_run_record_alone(data_dir, tmp_path):
    """A resume refused because the optimizer's groups would differ names the setting and writes nothing: the
    finished run's configs and done.json (its measured throughput) stay as they were."""
    from difftransformer.train import RunDir

    train(tiny(), make_cfg(data_dir, tmp_path, max_steps=3))
    run = RunDir(tmp_path)
    before = [p.read_text() for p in (run.train_config, run.model_config, run.done)]
    with pytest.raises(CheckpointError, match=r"decay_norms_and_lambdas: checkpoint False vs requested True"):
        train(tiny(), make_cfg(data_dir, tmp_path, max_steps=6, decay_norms_and_lambdas=True))
    assert [p.read_text() for p in (run.train_config, run.model_config, run.done)] == before
    assert run.is_finished(3)


def _stopped_in_the_first_step(monkeypatch):
    import difftransformer.train.trainer as trainer_mod

    def stop(self, step, lr):
        raise KeyboardInterrupt("stopped before the first checkpoint")

    monkeypatch.setattr(trainer_mod._Loop, "step", stop)


def test_a_fresh_start_sets_the_whole_previous_run_aside_and_a_plain_resume_does_not_pass_it_by(data_dir, tmp_path,
                                                                                             monkeypatch):
    """--no-resume stopped before its first checkpoint keeps all of the previous run in replaced/ (done.json and its
    configs too); the command run again without --no-resume refuses, naming replaced/, instead of training a third
    run from step 0 beside it."""
    from difftransformer.train import RunDir

    train(tiny(), make_cfg(data_dir, tmp_path, max_steps=3, lr=3e-3))
    run = RunDir(tmp_path)
    done, config = run.done.read_text(), run.train_config.read_text()
    _stopped_in_the_first_step(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        train(tiny(), make_cfg(data_dir, tmp_path, max_steps=3, lr=1e-3), resume=False)
    assert (run.replaced / "done.json").read_text() == done
    assert (run.replaced / "train_config.json").read_text() == config
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"replaced.*--no-resume"):
        train(tiny(), make_cfg(data_dir, tmp_path, max_steps=6))
    assert run.replaced_checkpoints.is_dir()


def test_the_metrics_a_checkpoint_covers_are_on_disk_before_it(data_dir, tmp_path, monkeypatch):
    """A resume keeps the metrics rows up to its checkpoint and never writes them again, so they are fsynced
    before the checkpoint's `latest` pointer is."""
    events: list[str] = []
    real = os.fsync

    def fsync(fd):
        events.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else "?")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    train(tiny(), make_cfg(data_dir, tmp_path, max_steps=3, ckpt_interval=3))
    first_latest = next(i for i, p in enumerate(events) if Path(p).name.startswith("latest"))
    assert "metrics.jsonl" in [Path(p).name for p in events[:first_latest]]

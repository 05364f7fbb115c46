"""Tests for the training core: loop, schedule, param groups, checkpoints (atomicity, kill -9, resume
exactness, corruption), divergence, paired init, gradient accumulation and 2-process DDP on gloo."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import difftransformer.train.checkpoint as ckpt_mod
from difftransformer._io import atomic_path, atomic_write_text
from difftransformer.data import BatchSampler, prepare_data
from difftransformer.model import DiffTransformerLM, get_preset
from difftransformer.train import (
    CheckpointError,
    TrainConfig,
    TrainingDivergedError,
    classify_parameters,
    load_checkpoint,
    lr_at,
    paired_init,
    read_metrics,
    train,
    verify_checkpoint,
)
from difftransformer.train.metrics import METRICS_FILE

TIMING_KEYS = ("tokens_per_s", "elapsed_s")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    """A small prepared corpus (vocab 300) shared by every test in this module."""
    root = tmp_path_factory.mktemp("train_data")
    rng = random.Random(0)
    words = ["the", "of", "and", "to", "in", "a", "is", "that", "for", "it"]
    words += ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) for _ in range(200)]
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(24):
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(400)) + ".\n")
    prepare_data(corpus=str(corpus), out_dir=root / "data", vocab_size=300)
    return str(root / "data")


def tiny(kind: str = "diff"):
    return get_preset("tiny").config(kind)


def make_cfg(data_dir: str, out_dir, **overrides) -> TrainConfig:
    base = dict(data_dir=data_dir, out_dir=str(out_dir), seq_len=32, batch_size=8, max_steps=6, warmup_steps=2,
                lr=3e-3, min_lr=3e-4, eval_interval=3, eval_batches=2, log_interval=1, ckpt_interval=3,
                keep_last=2, progress=False, tensorboard=False, device="cpu")
    base.update(overrides)
    return TrainConfig(**base)


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k].cpu(), sb[k].cpu()), k


def latest_dir(out_dir) -> Path:
    root = Path(out_dir) / "checkpoints"
    return root / (root / "latest").read_text().strip()


# ------------------------------------------------------------------------------------------------
# config, schedule, parameter groups


def test_train_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match=r"unknown TrainConfig key\(s\) \['lr_schedul'\].*valid keys.*lr_schedule"):
        TrainConfig.from_dict({"lr_schedul": "cosine"})
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        TrainConfig(lr_schedule="exp")
    with pytest.raises(ValueError, match="precision must be one of"):
        TrainConfig(precision="fp8")
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match=r"batch_size \(10\) must be divisible by grad_accum_steps \(4\)"):
        TrainConfig(batch_size=10, grad_accum_steps=4)
    with pytest.raises(TypeError, match="lr must be a float, got '1e-3'"):
        TrainConfig.from_dict({"lr": "1e-3"})
    with pytest.raises(TypeError, match="max_steps must be a int"):
        TrainConfig(max_steps=True)
    with pytest.raises(ValueError, match="device must be"):
        TrainConfig(device="gpu")
    cfg = TrainConfig(lr=1, seed=3)
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_seq_len_above_max_positions_names_both(data_dir, tmp_path):
    cfg = make_cfg(data_dir, tmp_path, seq_len=300)
    with pytest.raises(ValueError, match=r"seq_len 300 exceeds the model's max_position_embeddings 256"):
        train(tiny(), cfg)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_lr_schedule_values(schedule):
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110, lr_schedule=schedule)
    assert lr_at(0, cfg) == pytest.approx(0.1)  # warmup: a line from 0
    assert lr_at(4, cfg) == pytest.approx(0.5)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)  # decay starts at the peak
    mid, end = lr_at(60, cfg), lr_at(110, cfg)
    if schedule == "cosine":
        assert mid == pytest.approx(0.55) and end == pytest.approx(0.1)
        assert lr_at(35, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    elif schedule == "linear":
        assert mid == pytest.approx(0.55) and end == pytest.approx(0.1)
        assert lr_at(35, cfg) == pytest.approx(1.0 - 0.9 * 0.25)
    else:
        assert mid == end == 1.0
    lrs = [lr_at(s, cfg) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # non-increasing after warmup


def test_weight_decay_groups():
    model = DiffTransformerLM(tiny())
    decay, no_decay = classify_parameters(model, TrainConfig())
    assert "embed_tokens.weight" in no_decay  # tied with lm_head: listed once
    assert "lm_head.weight" not in decay + no_decay
    for n in no_decay:
        assert n == "embed_tokens.weight" or n.endswith("layernorm.weight") or ".lambda_" in n \
            or n.endswith("subln.weight") or n == "norm.weight", n
    assert any(".lambda_q1" in n for n in no_decay) and any("subln" in n for n in no_decay)
    assert all(n.endswith("proj.weight") for n in decay) and len(decay) == 2 * 7
    decay2, no_decay2 = classify_parameters(model, TrainConfig(decay_norms_and_lambdas=True, decay_embeddings=True))
    assert no_decay2 == [] and len(decay2) == len(decay) + len(no_decay)


# ------------------------------------------------------------------------------------------------
# paired init


def test_paired_init_shares_every_common_parameter():
    diff, base = tiny("diff"), tiny("transformer")
    states = paired_init([diff, base], seed=7)
    d, b = states
    for name in ("embed_tokens.weight", "lm_head.weight", "norm.weight", "layers.0.mlp.up_proj.weight",
                 "layers.1.input_layernorm.weight", "layers.1.self_attn.q_proj.weight",
                 "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
                 "layers.1.self_attn.out_proj.weight"):
        assert torch.equal(d[name], b[name]), name
        assert name in states.shared[1]
    lam = [k for k in d if "lambda_" in k]
    assert lam and not any("lambda_" in k for k in b) and set(lam) <= set(states.own[0]) | set(states.shared[0])
    assert states.own[1] == []  # the baseline has nothing DIFF lacks
    assert not any("subln" in k for k in b)
    model = DiffTransformerLM(base)
    model.load_state_dict(b)  # loadable as init_state
    assert torch.equal(model.lm_head.weight, d["embed_tokens.weight"])
    again = paired_init([diff, base], seed=7)
    assert all(torch.equal(again[0][k], d[k]) for k in d)


# ------------------------------------------------------------------------------------------------
# the loop: reproducibility, files, accumulation


def test_reproducible_and_writes_expected_files(data_dir, tmp_path):
    r1 = train(tiny(), make_cfg(data_dir, tmp_path / "a", tensorboard=True))
    r2 = train(tiny(), make_cfg(data_dir, tmp_path / "b"))
    assert_same_weights(r1.model, r2.model)
    m1, m2 = read_metrics(r1.metrics_path), read_metrics(r2.metrics_path)
    assert untimed(m1) == untimed(m2)
    assert [r["step"] for r in m1 if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert [(r["step"], r["tokens"]) for r in m1 if r["kind"] == "val"] == [(3, 768), (6, 1536)]
    row = m1[0]
    assert set(row) == {"kind", "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s", "lambdas"}
    assert len(row["lambdas"]) == 2 and all(isinstance(x, float) for x in row["lambdas"])
    assert r1.final_step == 6 and r1.final_val_loss == m1[-1]["loss"] and r1.tokens_per_s > 0
    out = Path(r1.out_dir)
    assert (out / "model_config.json").is_file() and (out / "train_config.json").is_file()
    assert list((out / "tb").iterdir())
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_00000003", "step_00000006"]
    assert {p.name for p in (out / "final").iterdir()} == {"config.json", "model.safetensors", "tokenizer.json"}
    assert_same_weights(DiffTransformerLM.from_pretrained(out / "final"), r1.model)
    ck = load_checkpoint(out)
    assert ck["step"] == 6 and ck["train_config"] == make_cfg(data_dir, tmp_path / "a", tensorboard=True)
    fresh = DiffTransformerLM(ck["model_config"])
    fresh.load_state_dict(ck["model"])
    assert_same_weights(fresh, r1.model)


def test_transformer_arm_trains_with_null_lambdas(data_dir, tmp_path):
    r = train(tiny("transformer"), make_cfg(data_dir, tmp_path, max_steps=2, ckpt_interval=2))
    rows = read_metrics(r.metrics_path, "train")
    assert rows[-1]["lambdas"] == [None, None] and math.isfinite(rows[-1]["loss"])


def test_activation_checkpointing_is_exact_and_bf16_trains(data_dir, tmp_path):
    ref = train(tiny(), make_cfg(data_dir, tmp_path / "ref", max_steps=2, ckpt_interval=2))
    ac = train(tiny(), make_cfg(data_dir, tmp_path / "ac", max_steps=2, ckpt_interval=2,
                                activation_checkpointing=True))
    assert_same_weights(ref.model, ac.model)
    assert "forward" not in ac.model.layers[0].__dict__  # the wrapper is removed again
    assert load_checkpoint(tmp_path / "ac")["model"].keys() == load_checkpoint(tmp_path / "ref")["model"].keys()
    bf = train(tiny(), make_cfg(data_dir, tmp_path / "bf", max_steps=2, ckpt_interval=2, precision="bf16"))
    la, lb = read_metrics(ref.metrics_path, "train"), read_metrics(bf.metrics_path, "train")
    assert all(abs(a["loss"] - b["loss"]) < 0.05 for a, b in zip(la, lb))


def test_grad_accumulation_matches_single_batch(data_dir, tmp_path):
    a = train(tiny(), make_cfg(data_dir, tmp_path / "a", max_steps=4, ckpt_interval=4, grad_accum_steps=1))
    b = train(tiny(), make_cfg(data_dir, tmp_path / "b", max_steps=4, ckpt_interval=4, grad_accum_steps=2))
    la, lb = read_metrics(a.metrics_path), read_metrics(b.metrics_path)
    assert [r["kind"] for r in la] == [r["kind"] for r in lb]
    for ra, rb in zip(la, lb):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-5)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.allclose(pa, pb, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# resume exactness, atomicity, corruption, divergence


def test_resume_after_interruption_is_exact(data_dir, tmp_path, monkeypatch):
    """Cosine schedule, killed (by an exception) after checkpoint 3, resumed: equal to uninterrupted."""
    ref = train(tiny(), make_cfg(data_dir, tmp_path / "ref"))
    original = BatchSampler.batch

    def crash_at_step_4(self, step, *a, **k):
        if step == 4:
            raise KeyboardInterrupt("simulated interruption")
        return original(self, step, *a, **k)

    monkeypatch.setattr(BatchSampler, "batch", crash_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        train(tiny(), make_cfg(data_dir, tmp_path / "run"))
    monkeypatch.setattr(BatchSampler, "batch", original)
    assert latest_dir(tmp_path / "run").name == "step_00000003"
    assert max(r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")) == 4  # logged, not saved
    res = train(tiny(), make_cfg(data_dir, tmp_path / "run"))
    assert_same_weights(ref.model, res.model)
    assert untimed(read_metrics(res.metrics_path)) == untimed(read_metrics(ref.metrics_path))


def test_resume_with_more_steps_is_exact(data_dir, tmp_path):
    """Run to 3, then a new call with max_steps 6 (constant schedule: the LR does not depend on max_steps)."""
    ref = train(tiny(), make_cfg(data_dir, tmp_path / "ref", lr_schedule="constant"))
    train(tiny(), make_cfg(data_dir, tmp_path / "run", lr_schedule="constant", max_steps=3))
    res = train(tiny(), make_cfg(data_dir, tmp_path / "run", lr_schedule="constant", max_steps=6))
    assert_same_weights(ref.model, res.model)
    assert untimed(read_metrics(res.metrics_path)) == untimed(read_metrics(ref.metrics_path))
    # a finished run resumed again trains nothing and reports the same val loss
    again = train(tiny(), make_cfg(data_dir, tmp_path / "run", lr_schedule="constant", max_steps=6))
    assert again.final_val_loss == pytest.approx(res.final_val_loss) and again.final_step == 6
    assert_same_weights(ref.model, again.model)


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


def test_metrics_readers_skip_a_torn_last_line(tmp_path):
    from difftransformer.eval.report import read_metrics as report_read_metrics

    path = tmp_path / METRICS_FILE
    rows = [{"kind": "train", "step": 1, "loss": 2.0}, {"kind": "val", "step": 1, "loss": 2.1},
            {"kind": "train", "step": 2, "loss": 1.9}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "train", "st')
    assert read_metrics(path) == rows
    assert read_metrics(path, "val") == rows[1:2]
    assert report_read_metrics(path) == ([rows[0], rows[2]], [rows[1]])
    assert report_read_metrics(tmp_path / "missing.jsonl") == ([], [])


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


def test_nan_loss_raises_with_step_and_keeps_last_good_checkpoint(data_dir, tmp_path, monkeypatch):
    original = DiffTransformerLM.forward
    calls = []

    def nan_after_two_steps(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append(1)
        if len(calls) >= 3 and out.loss is not None:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(DiffTransformerLM, "forward", nan_after_two_steps)
    cfg = make_cfg(data_dir, tmp_path, max_steps=6, ckpt_interval=2, eval_interval=100)
    with pytest.raises(TrainingDivergedError, match=r"diverged at step 3: loss nan.*step_00000002.*lower lr"):
        train(tiny(), cfg)
    assert latest_dir(tmp_path).name == "step_00000002"
    assert load_checkpoint(tmp_path)["step"] == 2
    assert not (tmp_path / "checkpoints" / "step_00000003").exists()


def test_huge_lr_diverges(data_dir, tmp_path):
    cfg = make_cfg(data_dir, tmp_path, lr=1e30, min_lr=0.0, warmup_steps=0, grad_clip=0.0, max_steps=20,
                   ckpt_interval=100, eval_interval=100)
    with pytest.raises(TrainingDivergedError, match=r"diverged at step \d+"):
        train(tiny(), cfg)


# ------------------------------------------------------------------------------------------------
# kill -9 of a real training process

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


# ------------------------------------------------------------------------------------------------
# 2-process DDP (gloo) equals 1 process with the same global batch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world_size: int, port: int, cfg_dicts: list[dict], model_dict: dict) -> None:
    """Runs each config in turn (a later one resumes the earlier one's checkpoint)."""
    from difftransformer.model import DiffTransformerConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    for cfg_dict in cfg_dicts:
        train(DiffTransformerConfig.from_dict(model_dict), TrainConfig.from_dict(cfg_dict))


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_two_processes_match_one(data_dir, tmp_path, fsdp):
    """DDP, or FSDP2 trained to step 2 then resumed to 4 (sharded save and load), equals 1 process."""
    one = train(tiny(), make_cfg(data_dir, tmp_path / "one", max_steps=4, ckpt_interval=4, eval_interval=2))
    cfg2 = make_cfg(data_dir, tmp_path / "two", max_steps=4, ckpt_interval=2, eval_interval=2, fsdp=fsdp)
    runs = [cfg2.to_dict()]
    if fsdp:
        runs.insert(0, {**cfg2.to_dict(), "max_steps": 2})  # warmup covers steps 1-2: the same LRs
    mp.spawn(_ddp_worker, args=(2, _free_port(), runs, tiny().to_dict()), nprocs=2, join=True)
    l1, l2 = read_metrics(one.metrics_path), read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in l1] == [(r["kind"], r["step"]) for r in l2]
    for a, b in zip(l1, l2):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5), (a, b)
    two = DiffTransformerLM.from_pretrained(tmp_path / "two" / "final")
    for pa, pb in zip(one.model.parameters(), two.parameters()):
        assert torch.allclose(pa, pb, atol=1e-5)
    assert load_checkpoint(tmp_path / "two")["state"]["world_size"] == 2

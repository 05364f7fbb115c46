"""The loop: reproducible, the files it writes, λ and λ_init logged, accumulation, resume exactness, divergence."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from difftransformer.data import BatchSampler
from difftransformer.model import DiffTransformerLM
from difftransformer.train import TrainingDivergedError, load_checkpoint, read_metrics, train
from tests.helpers import CPP_KERNEL_DISABLED, assert_same_weights, latest_dir, make_cfg, tiny, untimed


def test_reproducible_and_writes_expected_files(data_dir, tmp_path):
    r1 = train(tiny(), make_cfg(data_dir, tmp_path / "a", tensorboard=True))
    r2 = train(tiny(), make_cfg(data_dir, tmp_path / "b"))
    assert_same_weights(r1.model, r2.model)
    m1, m2 = read_metrics(r1.metrics_path), read_metrics(r2.metrics_path)
    assert untimed(m1) == untimed(m2)
    assert [r["step"] for r in m1 if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert [(r["step"], r["tokens"]) for r in m1 if r["kind"] == "val"] == [(3, 768), (6, 1536)]
    row = m1[0]
    assert set(row) == {"kind", "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s", "lambdas",
                        "lambda_inits"}
    assert len(row["lambdas"]) == 2 and all(isinstance(x, float) for x in row["lambdas"])
    assert row["lambda_inits"] == [0.8 - 0.6 * math.exp(-0.3 * layer) for layer in range(2)]  # logged, per layer
    assert r1.final_step == 6 and r1.final_val_loss == m1[-1]["loss"] and r1.tokens_per_s > 0
    done = json.loads((r1.out_dir / "done.json").read_text())
    assert done["peak_memory_mib"] is None and r1.peak_memory_mib is None  # CUDA's counter only
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
    assert rows[-1]["lambda_inits"] == [None, None]


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
        if ra["kind"] == "train":  # the gradient itself, not only Adam's scale-free step, is the batch's
            assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.allclose(pa, pb, atol=1e-5)


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


def test_an_update_that_blows_up_the_weights_is_never_checkpointed(data_dir, tmp_path):
    """The loss and gradient of step 2 are finite, its update (lr 1e6) is not sane: nothing of it is
    saved, keep_last=1 does not prune the healthy checkpoint, and the message names that one."""
    from difftransformer.train import RunDir

    base = dict(lr_schedule="constant", warmup_steps=0, min_lr=0.0, ckpt_interval=1, keep_last=1, eval_interval=100)
    train(tiny(), make_cfg(data_dir, tmp_path, max_steps=1, lr=1e-3, **base))
    healthy = load_checkpoint(tmp_path)
    with pytest.raises(TrainingDivergedError,
                       match=r"diverged by step 2: the weights' norm grew .*last good checkpoint is "
                             r"step_00000001.*lower lr"):
        train(tiny(), make_cfg(data_dir, tmp_path, max_steps=3, lr=1e6, **base))
    assert latest_dir(tmp_path).name == "step_00000001"
    kept = load_checkpoint(tmp_path)  # intact and the same
    assert all(torch.equal(kept["model"][k], healthy["model"][k]) for k in healthy["model"])
    assert not RunDir(tmp_path).is_finished(3)
    # resuming from it with a sane lr, as the message advises, finishes
    res = train(tiny(), make_cfg(data_dir, tmp_path, max_steps=3, lr=1e-3, **base))
    assert res.final_step == 3 and all(torch.isfinite(p).all() for p in res.model.parameters())


def test_the_weight_guard_can_be_switched_off_and_is_validated(data_dir, tmp_path):
    with pytest.raises(ValueError, match="max_weight_growth must be >= 0"):
        make_cfg(data_dir, tmp_path, max_weight_growth=-1.0)
    base = dict(lr_schedule="constant", warmup_steps=0, min_lr=0.0, ckpt_interval=1, eval_interval=100, grad_clip=0.0)
    with pytest.raises(TrainingDivergedError, match="norm grew"):  # guarded (the default), this jump is refused
        train(tiny(), make_cfg(data_dir, tmp_path / "on", max_steps=1, lr=3.0, **base))
    res = train(tiny(), make_cfg(data_dir, tmp_path / "off", max_steps=1, lr=3.0, max_weight_growth=0.0, **base))
    assert res.final_step == 1  # a large (finite) jump is accepted when the norm check is off


def test_the_weight_guard_measures_against_the_run_start_in_every_call(data_dir, tmp_path):
    """The norm reference is the run's, kept in its checkpoints: the same command run again after a stop resumes from
    the last good checkpoint and stops again at the same state. Measured against that checkpoint's own norm instead,
    the rerun would pass the step the guard refused and save it."""
    import math

    from difftransformer.model import DiffTransformerLM

    def norm(state=None) -> float:  # over the parameters, as the guard counts them (tied weights once)
        torch.manual_seed(0)
        model = DiffTransformerLM(tiny())
        if state is not None:
            model.load_state_dict(state)
        return math.sqrt(sum(float(p.detach().double().norm()) ** 2 for p in model.parameters()))

    base = dict(lr_schedule="constant", warmup_steps=0, min_lr=0.0, ckpt_interval=1, keep_last=3, eval_interval=100,
                grad_clip=0.0, lr=0.3)
    probe = tmp_path / "probe"  # the same run unguarded: its weights' norms at steps 0, 1 and 2
    train(tiny(), make_cfg(data_dir, probe, max_steps=2, max_weight_growth=0.0, **base))
    n0 = norm()  # train() seeds with train.seed (0) and builds the model
    n1, n2 = (norm(load_checkpoint(probe / "checkpoints" / f"step_0000000{s}")["model"]) for s in (1, 2))
    assert n1 > n0 and n2 > n1
    growth = max(n1 / n0, n2 / n1) * 1.0001  # step 1 passes against step 0, step 2 against step 1 only
    assert growth < n2 / n0
    cfg = make_cfg(data_dir, tmp_path / "run", max_steps=2, max_weight_growth=growth, **base)
    for _ in range(2):
        with pytest.raises(TrainingDivergedError, match=r"diverged by step 2: .* at step 0 .*step_00000001"):
            train(tiny(), cfg)
        assert latest_dir(tmp_path / "run").name == "step_00000001"


def test_unaligned_widths_get_a_warning_with_the_fix(caplog):
    """On CUDA the trainer names each width that is not a multiple of 8 and a multiple of 64 above it."""
    import logging
    from types import SimpleNamespace

    from difftransformer import get_preset
    from difftransformer.train import trainer

    cfg = get_preset("gpu-small").config("diff", intermediate_size=None, vocab_size=50257)
    with caplog.at_level(logging.WARNING, logger=trainer.log.name):
        trainer._warn_unaligned(cfg, SimpleNamespace(is_main=True))
        trainer._warn_unaligned(get_preset("gpu-small").config("diff"), SimpleNamespace(is_main=True))
    assert len(caplog.records) == 1
    text = caplog.records[0].getMessage()
    assert text.startswith("intermediate_size 2731, vocab_size 50257 not a multiple of 8")
    assert text.endswith("set e.g. model.intermediate_size=2752, model.vocab_size=50304")


def test_a_new_call_clears_what_a_killed_write_left_in_checkpoints_and_final(data_dir, tmp_path):
    """A kill between an atomic write's temporary file and its rename leaves `<name>.<hex>.tmp`; the next
    train() into the folder (here: a finished run, which trains nothing) deletes those in the run folder,
    checkpoints/ and final/, and keeps every complete file."""
    from difftransformer._io import _new_tmp

    cfg = make_cfg(data_dir, tmp_path / "run")
    first = train(tiny(), cfg)
    out = Path(first.out_dir)
    left = [_new_tmp(out / "metrics.jsonl"), _new_tmp(out / "checkpoints" / "latest"),
            _new_tmp(out / "final" / "model.safetensors")]
    again = train(tiny(), cfg)
    assert not any(p.exists() for p in left)
    assert {p.name for p in (out / "final").iterdir()} == {"config.json", "model.safetensors", "tokenizer.json"}
    assert_same_weights(DiffTransformerLM.from_pretrained(out / "final"), again.model)


def test_a_full_disk_while_copying_the_tokenizer_leaves_no_torn_final_tokenizer(data_dir, tmp_path, monkeypatch):
    import errno
    import os
    import shutil

    def full_disk(src, dst, *args, **kwargs):
        Path(dst).write_bytes(b"")  # the file is created, then nothing fits
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shutil, "copyfile", full_disk)
    with pytest.raises(OSError, match="No space left"):
        train(tiny(), make_cfg(data_dir, tmp_path, max_steps=1))
    assert not (tmp_path / "final" / "tokenizer.json").exists() and not list((tmp_path / "final").glob("*.tmp"))


@pytest.mark.skipif(CPP_KERNEL_DISABLED, reason="the fused C++ kernel is switched off here")
def test_a_resume_that_cannot_use_the_cpp_kernel_says_it_is_not_bitwise_equal(data_dir, tmp_path, monkeypatch,
                                                                               caplog):
    """A checkpoint trained on the C++ kernel resumed where it cannot be built runs on SDPA: said in one line."""
    import logging

    from difftransformer.kernels import flash_cpu

    train(tiny(), make_cfg(data_dir, tmp_path, max_steps=2, ckpt_interval=1))
    assert load_checkpoint(tmp_path)["state"]["attention_backend"] == "cpp"
    monkeypatch.setattr(flash_cpu, "is_available", lambda: False)  # as where no compiler builds it
    with caplog.at_level(logging.WARNING, logger="difftransformer.train"):
        train(tiny(), make_cfg(data_dir, tmp_path, max_steps=3, ckpt_interval=1))
    warned = [r.getMessage() for r in caplog.records if "attention backend" in r.getMessage()]
    assert len(warned) == 1 and "'cpp'" in warned[0] and "'sdpa'" in warned[0] and "bitwise" in warned[0]


def test_grad_accumulation_on_a_synthetic_task_is_the_mean_over_every_answer(tmp_path):
    """A task scores answers only, and micro-batches hold different numbers of them: the step's objective is the
    mean over every answer of the global batch, so accumulating over 2 or 4 micro-batches trains as one batch does
    (the same losses and weights); averaging the micro-batches' means instead moved weights by ~1e-2 in 4 steps."""
    from difftransformer.data.ood import FlipFlop
    from difftransformer.data.prepare import prepare_task
    from difftransformer.train.trainer import TaskSampler

    family = FlipFlop(min_instructions=4, max_instructions=12)
    data = prepare_task(family, tmp_path / "data")
    inputs, targets = TaskSampler(family, 8, 32, seed=0).batch(0, 0, 1)
    counts = (targets != -100).view(2, -1).sum(1).tolist()
    assert counts[0] != counts[1]  # the micro-batches of accumulation 2 score different numbers of answers
    model = tiny(vocab_size=family.vocab_size, max_position_embeddings=64)
    runs = [train(model, make_cfg(str(data.out_dir), tmp_path / f"a{k}", max_steps=4, ckpt_interval=4,
                                  grad_accum_steps=k)) for k in (1, 2, 4)]
    reference = read_metrics(runs[0].metrics_path)
    for run in runs[1:]:
        for ra, rb in zip(reference, read_metrics(run.metrics_path), strict=True):
            assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-5)
            if ra["kind"] == "train":
                assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)
        for pa, pb in zip(runs[0].model.parameters(), run.model.parameters()):
            assert torch.allclose(pa, pb, atol=1e-5)

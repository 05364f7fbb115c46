"""The training loop: one readable function from (model config, train config) to a trained model.

    result = train(get_preset("tiny").config("diff"), TrainConfig(data_dir=..., out_dir=..., max_steps=100))

Everything a step needs is a pure function of the step number (batch offsets, learning rate), and the
model/optimizer/RNG state is checkpointed, so a run killed at any point and resumed ends with exactly
the weights of an uninterrupted run (bit-for-bit on CPU). Parallelism lives in distributed.py,
checkpoint I/O in checkpoint.py, logging in metrics.py; this file is the loop.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from difftransformer.attention import MultiheadDiffAttention
from difftransformer.attention.functional import reparameterized_lambda
from difftransformer.data import BatchSampler, PreparedData, TokenDataset, iter_eval_batches, num_eval_windows
from difftransformer.model import DiffTransformerConfig, DiffTransformerLM
from difftransformer.model.config import RUNTIME_FIELDS
from difftransformer.train.checkpoint import (
    CheckpointError,
    find_latest,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    step_dir_name,
)
from difftransformer.train.config import RESUME_MUST_MATCH, TrainConfig
from difftransformer.train.distributed import (
    DistEnv,
    apply_activation_checkpointing,
    full_model_state,
    full_optimizer_state_by_name,
    full_tensor,
    init_distributed,
    load_full_optimizer_state,
    no_sync,
    remove_activation_checkpointing,
    wrap_model,
)
from difftransformer.train.metrics import METRICS_FILE, MetricsWriter
from difftransformer.train.optim import build_optimizer, lr_at, set_lr

log = logging.getLogger("difftransformer.train")

# Settings that only affect speed, I/O or how far to train: changing them on resume is silent.
_FREELY_CHANGEABLE = {"out_dir", "data_dir", "max_steps", "eval_interval", "eval_batches", "log_interval",
                      "ckpt_interval", "keep_last", "compile", "activation_checkpointing", "device", "fsdp",
                      "tensorboard", "progress"}


class TrainingDivergedError(RuntimeError):
    """The loss or gradient norm became NaN/Inf; nothing of the bad state was saved."""


@dataclass
class TrainResult:
    out_dir: Path
    final_step: int
    final_val_loss: float | None
    tokens_per_s: float  # mean training throughput of this call (excluding eval and checkpointing)
    metrics_path: Path
    model: DiffTransformerLM  # unwrapped, on the training device


def micro_batch_size(cfg: TrainConfig, world_size: int) -> int:
    """Sequences per forward pass on one rank: batch_size / (world_size * grad_accum_steps)."""
    per_step = world_size * cfg.grad_accum_steps
    if cfg.batch_size % per_step:
        raise ValueError(f"batch_size {cfg.batch_size} must be divisible by world_size ({world_size}) x "
                         f"grad_accum_steps ({cfg.grad_accum_steps}) = {per_step}")
    return cfg.batch_size // per_step


def layer_lambdas(model: DiffTransformerLM) -> list[float | None]:
    """model.lambdas(), but also for FSDP-sharded λ vectors (then a collective: call on every rank)."""
    out: list[float | None] = []
    for block in model.layers:
        attn = block.self_attn
        if isinstance(attn, MultiheadDiffAttention):
            vecs = [full_tensor(getattr(attn, n)).detach() for n in ("lambda_q1", "lambda_k1", "lambda_q2",
                                                                       "lambda_k2")]
            out.append(float(reparameterized_lambda(*vecs, attn.lambda_init)))
        else:
            out.append(None)
    return out


@torch.no_grad()
def evaluate(model: nn.Module, dataset: TokenDataset, cfg: TrainConfig, micro: int, env: DistEnv, amp) -> float:
    """Token-weighted mean loss over the first eval_batches * batch_size validation windows.

    The windows do not depend on world size or accumulation, so every layout reports the same number.
    """
    was_training = model.training
    model.eval()
    per_step = cfg.batch_size // micro  # micro-batches per global batch
    max_batches = cfg.eval_batches * per_step
    n_batches = min(-(-num_eval_windows(dataset, cfg.seq_len) // micro), max_batches)
    rounds = -(-n_batches // env.world_size)  # FSDP needs every rank to run the same number of forwards
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)
    batches = iter_eval_batches(dataset, micro, cfg.seq_len, max_batches, env.rank, env.world_size)
    for _ in range(rounds):
        batch = next(batches, None)
        weight = 1.0 if batch is not None else 0.0
        if batch is None:  # this rank ran out: a zero-weight forward keeps FSDP's collectives in step
            batch = next(iter_eval_batches(dataset, micro, cfg.seq_len, 1))
        x, y = (t.to(env.device, non_blocking=True) for t in batch)
        with amp:
            loss = model(x, y).loss
        totals[0] += weight * loss.double() * y.numel()
        totals[1] += weight * y.numel()
    env.all_reduce_sum(totals)
    model.train(was_training)
    return float(totals[0] / totals[1])


def _check_resume(ckpt: dict[str, Any], model_config: DiffTransformerConfig, cfg: TrainConfig,
                  data: PreparedData, warn: bool = True) -> None:
    """Refuse a checkpoint that belongs to another experiment; warn about tolerated changes."""
    path = ckpt["path"]
    hint = "use another out_dir, or start over with --no-resume (resume=False)"
    saved, wanted = ckpt["model_config"].to_dict(), model_config.to_dict()
    diff = {k: (saved[k], wanted[k]) for k in saved if saved[k] != wanted[k] and k not in RUNTIME_FIELDS}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs requested {b!r}" for k, (a, b) in diff.items())
        raise CheckpointError(f"checkpoint {path} was trained with a different model config ({detail}); {hint}")
    tdiff = ckpt["train_config"].differences(cfg)
    strict = {k: v for k, v in tdiff.items() if k in RESUME_MUST_MATCH}
    if strict:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs requested {b!r}" for k, (a, b) in strict.items())
        raise CheckpointError(f"cannot resume from {path}: the batches would differ ({detail}); {hint}")
    saved_data = ckpt["state"].get("data", {})
    for key in ("corpus_hash", "tokenizer_hash"):
        if saved_data.get(key) not in (None, getattr(data, key)):
            raise CheckpointError(f"cannot resume from {path}: it was trained on other data ({key} "
                                  f"{saved_data[key][:12]} vs {getattr(data, key)[:12]} in {cfg.data_dir}); {hint}")
    if ckpt["step"] > cfg.max_steps:
        raise CheckpointError(f"checkpoint {path} is at step {ckpt['step']}, past max_steps={cfg.max_steps}; "
                              f"raise max_steps or {hint}")
    changed = {k: v for k, v in tdiff.items() if k not in _FREELY_CHANGEABLE}
    if not warn:
        return
    if changed:
        log.warning("resuming with changed settings %s; the run will not equal an uninterrupted one",
                    {k: f"{a!r} -> {b!r}" for k, (a, b) in changed.items()})
    if "max_steps" in tdiff and cfg.lr_schedule != "constant":
        log.warning("max_steps changed %s -> %s: the %s LR schedule is stretched from here on",
                    *tdiff["max_steps"], cfg.lr_schedule)


def train(model_config: DiffTransformerConfig, cfg: TrainConfig, *,
          init_state: dict[str, torch.Tensor] | None = None, resume: bool = True) -> TrainResult:
    """Train `model_config` per `cfg` (resuming from out_dir/checkpoints/latest when resume=True).

    init_state: initial weights (e.g. from paired_init); ignored when resuming from a checkpoint.
    Under torchrun (WORLD_SIZE > 1) every rank calls this; only rank 0 writes files.
    """
    if cfg.seq_len > model_config.max_position_embeddings:
        raise ValueError(f"seq_len {cfg.seq_len} exceeds the model's max_position_embeddings "
                         f"{model_config.max_position_embeddings}; lower seq_len or use a longer-context config")
    env = init_distributed(cfg.device)  # the process group is kept for later calls (see distributed.py)
    return _train(model_config, cfg, env, init_state, resume)


def _train(model_config: DiffTransformerConfig, cfg: TrainConfig, env: DistEnv,
           init_state: dict[str, torch.Tensor] | None, resume: bool) -> TrainResult:
    out_dir = Path(cfg.out_dir)
    ckpt_root = out_dir / "checkpoints"
    device = env.device

    # -- data ---------------------------------------------------------------------------------
    data = PreparedData.load(cfg.data_dir)
    if data.vocab_size > model_config.vocab_size:
        raise ValueError(f"the tokenizer in {cfg.data_dir} has {data.vocab_size} tokens but the model's "
                         f"vocab_size is {model_config.vocab_size}; set vocab_size >= {data.vocab_size}")
    micro = micro_batch_size(cfg, env.world_size)
    sampler = BatchSampler(data.dataset("train"), cfg.batch_size, cfg.seq_len, seed=cfg.seed)
    val_ds = data.dataset("val")
    if num_eval_windows(val_ds, cfg.seq_len) == 0:
        log.warning("the val split of %s has fewer than seq_len + 1 tokens; validation is skipped", cfg.data_dir)
        val_ds = None

    # -- resume or start fresh ----------------------------------------------------------------
    ckpt = None
    if resume:
        latest = find_latest(ckpt_root)
        if latest is not None:
            ckpt = load_checkpoint(latest)
            _check_resume(ckpt, model_config, cfg, data, warn=env.is_main)
            if init_state is not None:
                log.info("resuming from %s; init_state is ignored", latest)
    elif env.is_main and list_checkpoints(ckpt_root):
        log.warning("resume=False: removing the old checkpoints in %s", ckpt_root)
        shutil.rmtree(ckpt_root)
    start_step = ckpt["step"] if ckpt else 0
    if env.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        model_config.save(out_dir / "model_config.json")
        cfg.save(out_dir / "train_config.json")
    env.barrier()

    # -- model, parallelism, optimizer --------------------------------------------------------
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = DiffTransformerLM(model_config)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"], strict=True)
    elif init_state is not None:
        model.load_state_dict(init_state, strict=True)
    model.to(device)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model.layers)
    if cfg.compile:
        for block in model.layers:  # per block: the model's input checks would break a whole-model graph
            block.compile()
    wrapped = wrap_model(model, env, cfg.fsdp)
    optimizer = build_optimizer(model, cfg)
    if ckpt is not None:
        load_full_optimizer_state(model, optimizer, ckpt["optimizer"], cfg.fsdp)
        set_rng_state(ckpt["state"]["rng"])
        log.info("resumed from %s at step %d", ckpt["path"], start_step)
    amp = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.precision == "bf16"
           else contextlib.nullcontext())
    tokens_per_step = cfg.tokens_per_step
    if env.is_main:
        log.info("training %s (%s params) on %s x%d: %d steps of %d tokens (micro-batch %d x %d accumulation)",
                 model_config.attention, f"{model.num_parameters():,}", device, env.world_size, cfg.max_steps,
                 tokens_per_step, micro, cfg.grad_accum_steps)

    metrics = MetricsWriter(out_dir, enabled=env.is_main, tensorboard=cfg.tensorboard, progress=cfg.progress,
                            start_step=start_step, max_steps=cfg.max_steps)
    elapsed_before = float(ckpt["state"].get("metrics", {}).get("elapsed_s", 0.0)) if ckpt else 0.0
    t_call = time.perf_counter()
    train_time, window_time, window_steps = 0.0, 0.0, 0
    last_good = ckpt["path"].name if ckpt else None
    val_loss: float | None = None

    def save(step: int) -> None:
        model_state = full_model_state(model, cfg.fsdp)  # collectives under FSDP: every rank calls
        optim_state = full_optimizer_state_by_name(model, optimizer, cfg.fsdp)
        if env.is_main:
            state = {
                "scheduler": {"step": step, "lr": lr_at(step - 1, cfg), "schedule": cfg.lr_schedule},
                "rng": rng_state(),
                "metrics": {"elapsed_s": elapsed_before + time.perf_counter() - t_call,
                            "tokens": step * tokens_per_step},
                "data": {"corpus_hash": data.corpus_hash, "tokenizer_hash": data.tokenizer_hash,
                         "vocab_size": data.vocab_size},
                "world_size": env.world_size,
            }
            path = save_checkpoint(ckpt_root, step, model_state, optim_state, state, model_config, cfg,
                                   cfg.keep_last)
            log.info("saved checkpoint %s", path)
        env.barrier()

    try:
        model.train()
        for step in range(start_step, cfg.max_steps):
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            set_lr(optimizer, lr)
            inputs, targets = sampler.batch(step, env.rank, env.world_size)
            loss_sum = torch.zeros((), device=device)
            for i in range(cfg.grad_accum_steps):
                x = inputs[i * micro:(i + 1) * micro].to(device, non_blocking=True)
                y = targets[i * micro:(i + 1) * micro].to(device, non_blocking=True)
                with no_sync(wrapped, sync=i == cfg.grad_accum_steps - 1):
                    with amp:
                        loss = wrapped(x, y).loss
                    (loss / cfg.grad_accum_steps).backward()
                loss_sum += loss.detach()
            loss_t = env.all_reduce_sum(loss_sum / cfg.grad_accum_steps) / env.world_size
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
            # One device-to-host sync per step for both numbers.
            loss_val, grad_norm = torch.stack([loss_t.float(), full_tensor(norm).float()]).tolist()
            if not (math.isfinite(loss_val) and math.isfinite(grad_norm)):
                what = f"loss {loss_val}" if not math.isfinite(loss_val) else f"gradient norm {grad_norm}"
                raise TrainingDivergedError(
                    f"training diverged at step {step + 1}: {what} (lr {lr:.3g}). Nothing was saved for this "
                    f"step; the last good checkpoint is {last_good or 'none'}. Try a lower lr, gradient "
                    f"clipping (grad_clip > 0), a longer warmup, or precision='fp32'")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            done = step + 1
            dt = time.perf_counter() - t0
            train_time += dt
            window_time += dt
            window_steps += 1
            tok_s = window_steps * tokens_per_step / max(window_time, 1e-9)
            metrics.progress(loss_val, tok_s)
            last = done == cfg.max_steps
            if done % cfg.log_interval == 0 or last:
                metrics.train(done, loss_val, lr, grad_norm, done * tokens_per_step, tok_s,
                              elapsed_before + time.perf_counter() - t_call, layer_lambdas(model))
                window_time, window_steps = 0.0, 0
            if val_ds is not None and (done % cfg.eval_interval == 0 or last):
                val_loss = evaluate(model, val_ds, cfg, micro, env, amp)
                metrics.val(done, val_loss, done * tokens_per_step)
            if done % cfg.ckpt_interval == 0 or last:
                save(done)
                last_good = step_dir_name(done)

        if start_step >= cfg.max_steps and val_ds is not None:  # nothing left to train: report only
            val_loss = evaluate(model, val_ds, cfg, micro, env, amp)
    finally:
        metrics.close()

    # -- final weights in save_pretrained format ----------------------------------------------
    if cfg.activation_checkpointing:
        remove_activation_checkpointing(model.layers)
    if cfg.fsdp and env.distributed:  # gather the shards into a plain model
        full = full_model_state(model, fsdp=True)
        model = DiffTransformerLM(model_config)
        model.load_state_dict({k: v.detach().cpu() for k, v in full.items()})
        model.to(device)
    if env.is_main:
        final = out_dir / "final"
        model.save_pretrained(final)
        if data.tokenizer_path.is_file():
            shutil.copyfile(data.tokenizer_path, final / "tokenizer.json")
        log.info("final weights in %s", final)
    env.barrier()
    trained = cfg.max_steps - start_step
    return TrainResult(out_dir=out_dir, final_step=cfg.max_steps, final_val_loss=val_loss,
                       tokens_per_s=trained * tokens_per_step / train_time if train_time > 0 else 0.0,
                       metrics_path=out_dir / METRICS_FILE, model=model)

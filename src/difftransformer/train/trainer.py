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
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from difftransformer._io import atomic_copy, folder_lock
from difftransformer.data import BatchSampler, PreparedData, TokenDataset, iter_eval_batches, num_eval_windows
from difftransformer.data.ood.sampler import TaskSampler, TaskValSet
from difftransformer.dist import full_tensor
from difftransformer.model import DiffTransformerConfig, DiffTransformerLM
from difftransformer.model.config import model_identity
from difftransformer.model.modeling import IGNORE_INDEX
from difftransformer.numerics import denormals_flushed
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
from difftransformer.train.config import FREELY_CHANGEABLE, OPTIMIZER_GROUPS_MUST_MATCH, RESUME_MUST_MATCH, TrainConfig
from difftransformer.train.distributed import (
    DistEnv,
    apply_activation_checkpointing,
    full_model_state,
    full_optimizer_state_by_name,
    init_distributed,
    load_full_optimizer_state,
    no_sync,
    remove_activation_checkpointing,
    wrap_model,
)
from difftransformer.train.init import (
    check_init_config,
    check_init_outside_run,
    check_init_tokenizer,
    load_init_weights,
)
from difftransformer.train.metrics import MetricsWriter
from difftransformer.train.optim import apply_trainable, build_optimizer, lr_at, set_lr
from difftransformer.train.run_dir import RunDir

log = logging.getLogger("difftransformer.train")


class TrainingDivergedError(RuntimeError):
    """The loss or gradient norm became NaN/Inf; nothing of the bad state was saved."""


@dataclass
class TrainResult:
    out_dir: Path
    final_step: int
    final_val_loss: float | None
    tokens_per_s: float  # mean training throughput of this call (excluding eval and checkpointing)
    metrics_path: Path
    # unwrapped, on the training device; under FSDP on several processes gathered into rank 0's host memory, None on
    # the other ranks (no rank holds the whole model on its device beside its shards and optimizer state)
    model: DiffTransformerLM | None
    peak_memory_mib: float | None = None  # CUDA only: this rank's peak of allocated tensor memory in this call
    steps_trained: int = 0  # optimizer steps this call took (0: the run had already reached max_steps)


def _peak_memory_mib(device: torch.device) -> float | None:
    """The caching allocator's peak of allocated bytes on `device` since the last reset (CUDA only:
    CPU has no such counter). It counts tensors, not the allocator's reserve or the CUDA context."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def micro_batch_size(cfg: TrainConfig, world_size: int) -> int:
    """Sequences per forward pass on one rank: batch_size / (world_size * grad_accum_steps)."""
    per_step = world_size * cfg.grad_accum_steps
    if cfg.batch_size % per_step:
        raise ValueError(f"batch_size {cfg.batch_size} must be divisible by world_size ({world_size}) x "
                         f"grad_accum_steps ({cfg.grad_accum_steps}) = {per_step}")
    return cfg.batch_size // per_step


@torch.no_grad()
def evaluate(model: nn.Module, dataset: TokenDataset, cfg: TrainConfig, micro: int, env: DistEnv, amp) -> float:
    """Token-weighted mean loss over the first eval_batches * batch_size validation windows.

    The windows do not depend on world size or accumulation, so every layout reports the same number.
    """
    was_training = model.training
    model.eval()
    per_step = cfg.batch_size // micro  # micro-batches per global batch
    max_batches = cfg.eval_batches * per_step
    n_batches = min(-(-_val_windows(dataset, cfg.seq_len) // micro), max_batches)
    rounds = -(-n_batches // env.world_size)  # FSDP needs every rank to run the same number of forwards
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)
    batches = _val_batches(dataset, micro, cfg.seq_len, max_batches, env.rank, env.world_size)
    for _ in range(rounds):
        batch = next(batches, None)
        weight = 1.0 if batch is not None else 0.0
        if batch is None:  # this rank ran out: a zero-weight forward keeps FSDP's collectives in step
            batch = next(_val_batches(dataset, micro, cfg.seq_len, 1))
        x, y = (t.to(env.device, non_blocking=True) for t in batch)
        with amp:
            loss = model(x, y).loss
        scored = (y != -100).sum()  # every token of a corpus window; the answers of a task's sequences
        totals[0] += weight * loss.double() * scored
        totals[1] += weight * scored
    env.all_reduce_sum(totals)
    model.train(was_training)
    return float(totals[0] / totals[1])


def _val_windows(dataset: TokenDataset | TaskValSet, seq_len: int) -> int:
    return len(dataset) if isinstance(dataset, TaskValSet) else num_eval_windows(dataset, seq_len)


def _val_batches(dataset: TokenDataset | TaskValSet, micro: int, seq_len: int, max_batches: int | None,
                 rank: int = 0, world_size: int = 1):
    """Validation batches in order: a split's windows, or a task's fixed validation sequences."""
    if isinstance(dataset, TaskValSet):
        return dataset.batches(micro, max_batches, rank, world_size)
    return iter_eval_batches(dataset, micro, seq_len, max_batches, rank, world_size)


def _check_same_run(run: RunDir, model_config: DiffTransformerConfig, cfg: TrainConfig) -> None:
    """A folder that holds a run of another model or batch recipe (its checkpoints deleted, say) is not
    overwritten by resume=True: that needs --no-resume (which sets the old run aside) or another out_dir."""
    if not (run.has_metrics() or run.has_final()):
        return
    for which in (run.model_config, run.train_config):
        if run.unreadable_json(which):
            raise CheckpointError(f"{run.path} holds a run but its {which.name} is unreadable, so it cannot be told "
                                  f"apart from this one; use another out_dir, or --no-resume (resume=False) to "
                                  f"replace it (the old run is kept aside until the new one saves a checkpoint)")
    saved_model, saved_train = run.read_json(run.model_config), run.read_json(run.train_config)
    if not saved_model:
        return
    wanted = model_identity(model_config.to_dict())
    # the saved file also carries bookkeeping (model_type, format_version): only the fields are compared
    diff = {k: (v, wanted[k]) for k, v in model_identity(saved_model).items() if k in wanted and wanted[k] != v}
    diff.update({k: (saved_train.get(k), getattr(cfg, k)) for k in RESUME_MUST_MATCH
                 if k in saved_train and saved_train[k] != getattr(cfg, k)})
    if diff:
        detail = ", ".join(f"{k}: {a!r} there vs {b!r} requested" for k, (a, b) in diff.items())
        raise CheckpointError(f"{run.path} holds another run ({detail}) and no checkpoint to resume; use another "
                              f"out_dir, or --no-resume (resume=False) to replace it (the old run is kept aside "
                              f"until the new one saves a checkpoint)")


def _check_resume(ckpt: dict[str, Any], model_config: DiffTransformerConfig, cfg: TrainConfig,
                  data: PreparedData, warn: bool = True) -> None:
    """Refuse a checkpoint that belongs to another experiment; warn about tolerated changes."""
    path = ckpt["path"]
    hint = "use another out_dir, or start over with --no-resume (resume=False)"
    saved, wanted = model_identity(ckpt["model_config"].to_dict()), model_identity(model_config.to_dict())
    diff = {k: (saved[k], wanted[k]) for k in saved if saved[k] != wanted.get(k)}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs requested {b!r}" for k, (a, b) in diff.items())
        raise CheckpointError(f"checkpoint {path} was trained with a different model config ({detail}); "
                              f"{_init_from_hint(ckpt['train_config'], cfg) or hint}")
    tdiff = ckpt["train_config"].differences(cfg)
    strict = {k: v for k, v in tdiff.items() if k in RESUME_MUST_MATCH}
    if strict:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs requested {b!r}" for k, (a, b) in strict.items())
        raise CheckpointError(f"cannot resume from {path}: the batches would differ ({detail}); {hint}")
    groups = {k: v for k, v in tdiff.items() if k in OPTIMIZER_GROUPS_MUST_MATCH}
    if groups:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs requested {b!r}" for k, (a, b) in groups.items())
        raise CheckpointError(f"cannot resume from {path}: the optimizer's parameter groups would differ ({detail}); "
                              f"resume with the checkpoint's settings, or {hint}")
    saved_data = ckpt["state"].get("data", {})
    for key in ("corpus_hash", "tokenizer_hash"):
        if saved_data.get(key) not in (None, getattr(data, key)):
            raise CheckpointError(f"cannot resume from {path}: it was trained on other data ({key} "
                                  f"{saved_data[key][:12]} vs {getattr(data, key)[:12]} in {cfg.data_dir}); {hint}")
    trained_on = saved_data.get(TRAIN_DOCUMENTS_KEY)  # absent from checkpoints written before it was recorded
    now = str(data.documents_hash("train"))
    if trained_on is not None and trained_on != now:
        raise CheckpointError(f"cannot resume from {path}: {cfg.data_dir} holds another train split of the same "
                              f"corpus (train documents hash {trained_on[:12]} vs {now[:12]}: a training mixture or "
                              f"the document split changed), so the batches would differ and documents it trained on "
                              f"may now be held out; prepare the data as the run had it, or {hint}")
    if ckpt["step"] > cfg.max_steps:
        raise CheckpointError(f"checkpoint {path} is at step {ckpt['step']}, past max_steps={cfg.max_steps}; "
                              f"raise max_steps or {hint}")
    changed = {k: v for k, v in tdiff.items() if k not in FREELY_CHANGEABLE}
    if not warn:
        return
    if changed:
        log.warning("resuming with changed settings %s; the run will not equal an uninterrupted one",
                    {k: f"{a!r} -> {b!r}" for k, (a, b) in changed.items()})
    if "max_steps" in tdiff and cfg.lr_schedule != "constant":
        log.warning("max_steps changed %s -> %s: the %s LR schedule is stretched from here on",
                    *tdiff["max_steps"], cfg.lr_schedule)


def _init_from_hint(saved: TrainConfig, cfg: TrainConfig) -> str | None:
    """When the checkpoint's run started from a model folder and this call names another (or none), that
    is the likely cause of a model mismatch: the model config comes from init_from, so say to pass it
    again rather than to start over (which would throw the run's training away)."""
    if saved.init_from is None or saved.init_from == cfg.init_from:
        return None
    return (f"the run started from init_from {saved.init_from}, so its model comes from there: pass "
            f"--init-from {saved.init_from} (train.init_from) again to continue it")


def train(model_config: DiffTransformerConfig, cfg: TrainConfig, *,
          init_state: dict[str, torch.Tensor] | None = None, resume: bool = True) -> TrainResult:
    """Train `model_config` per `cfg` (resuming from out_dir/checkpoints/latest when resume=True).

    init_state: initial weights (e.g. from experiments.paired_init); ignored when resuming from a checkpoint.
    cfg.init_from names a model folder to start from instead (train/init.py); the two exclude each other.
    Under torchrun (WORLD_SIZE > 1) every rank calls this; only rank 0 writes files.
    On CPU it trains with subnormal floats flushed to zero (difftransformer.numerics: without it a converged model
    can run 10x slower; DIFFTRANSFORMER_KEEP_DENORMALS=1 keeps them).
    """
    if init_state is not None and cfg.init_from is not None:
        raise ValueError(f"give either init_state or TrainConfig.init_from ({cfg.init_from}), not both")
    if cfg.init_from is not None:
        check_init_config(cfg.init_from, model_config)  # before any folder is locked or written
        check_init_outside_run(cfg.init_from, RunDir(cfg.out_dir))
    cfg.check_model(model_config)
    env = init_distributed(cfg.device, cfg.dist_timeout_min)  # the process group is kept for later calls
    model_config.backend_on(env.device)  # a backend that cannot run on this device fails before any write
    run = RunDir(cfg.out_dir)
    # One writer per run folder: a second training into it refuses at once (rank 0 writes for all).
    lock = folder_lock(run.path, purpose="train into another out_dir", kind="a training run",
                       owns=(run.checkpoints.name, run.final.name))
    with lock if env.is_main else contextlib.nullcontext(), denormals_flushed():
        run.check_layout()
        return _train(run, model_config, cfg, env, init_state, resume)


def _warn_unaligned(model_config: DiffTransformerConfig, env: DistEnv) -> None:
    """On CUDA, a width not a multiple of 8 puts the model's matrix products on slow kernels: say which."""
    unaligned = model_config.gpu_unaligned_dims()
    if unaligned and env.is_main:
        fix = ", ".join(f"model.{name}={value}" for name, value in model_config.gpu_aligned_dims().items())
        log.warning("%s not a multiple of 8: on CUDA the matrix products with it run on slow fallback kernels "
                    "(about 2x the step time measured on an H100); for a new run set e.g. %s",
                    ", ".join(f"{name} {value}" for name, value in unaligned.items()), fix)


def _train(run: RunDir, model_config: DiffTransformerConfig, cfg: TrainConfig, env: DistEnv,
           init_state: dict[str, torch.Tensor] | None, resume: bool) -> TrainResult:
    data = _TrainData.load(model_config, cfg, env)
    ckpt = _resume_point(run, model_config, cfg, data.prepared, env, init_state, resume)
    # Built before anything in the run folder changes: a refusal here leaves the previous run's record whole.
    parts = _build(model_config, cfg, env, ckpt, init_state)
    aside = _set_aside_previous_run(run) if not resume and env.is_main else None
    if env.is_main:
        run.path.mkdir(parents=True, exist_ok=True)
        model_config.save(run.model_config)
        cfg.save(run.train_config)
    start_step = ckpt["step"] if ckpt else 0
    if env.is_main and start_step < cfg.max_steps:
        run.done.unlink(missing_ok=True)  # not done until this call has written final/
    env.barrier()
    if env.is_main:
        log.info("training %s (%s params) on %s x%d: %d steps of %d tokens (micro-batch %d x %d accumulation)",
                 model_config.attention, f"{parts.model.num_parameters():,}", env.device, env.world_size,
                 cfg.max_steps, cfg.tokens_per_step, data.micro, cfg.grad_accum_steps)
    if env.is_main and cfg.warmup_steps > cfg.max_steps:
        log.warning("warmup_steps %d > max_steps %d: the warm-up is longer than the run, so the learning rate reaches "
                    "at most %.3g (train.lr %g) and never decays; lower train.warmup_steps", cfg.warmup_steps,
                    cfg.max_steps, lr_at(cfg.max_steps - 1, cfg), cfg.lr)
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
        _warn_unaligned(model_config, env)
    t0 = time.perf_counter()
    loop = _Loop(run, model_config, cfg, env, data, parts, ckpt, replaced=aside)
    val_loss, train_time = loop.run(start_step)
    peak = _peak_memory_mib(env.device)  # of training: writing final/ is not part of it
    model = _write_final(run, model_config, cfg, env, parts.model, data.prepared)
    trained = cfg.max_steps - start_step
    result = TrainResult(out_dir=run.path, final_step=cfg.max_steps, final_val_loss=val_loss,
                         tokens_per_s=trained * cfg.tokens_per_step / train_time if train_time > 0 else 0.0,
                         metrics_path=run.metrics, model=model, peak_memory_mib=peak, steps_trained=trained)
    if env.is_main and not (trained == 0 and _done_record_of(run, cfg.max_steps)):
        # after final/: a run is finished only once its final weights are on disk. A finished run run
        # again (nothing trained) keeps the record of the call that trained it: throughput, wall time, memory
        run.write_done({"final_step": result.final_step, "final_val_loss": result.final_val_loss,
                        "tokens_per_s": result.tokens_per_s, "wall_s": time.perf_counter() - t0,
                        "peak_memory_mib": result.peak_memory_mib})
    return result


def _done_record_of(run: RunDir, step: int) -> bool:
    """Whether run's done.json is a readable record of a call that finished at `step`."""
    record = run.read_json(run.done)
    return record.get("final_step") == step and isinstance(record.get("tokens_per_s"), (int, float))


def _set_aside_previous_run(run: RunDir) -> Path | None:
    """Starting over (resume=False), once the new model is built: move the previous run's checkpoints,
    metrics, final/ weights, done.json, TensorBoard logs and configs into run.replaced.

    They are deleted when the new run has saved its first checkpoint, so a config error, a crash or
    a kill before that loses nothing. A set-aside run is only replaced by one that has checkpoints."""
    entries = (run.checkpoints, run.metrics, run.final, run.done, run.tensorboard, run.model_config, run.train_config)
    if list_checkpoints(run.checkpoints) or (not run.replaced.exists() and any(e.exists() for e in entries)):
        shutil.rmtree(run.replaced, ignore_errors=True)
        run.replaced.mkdir()
        for entry in entries:
            if entry.exists():
                os.replace(entry, run.replaced / entry.name)
    if not run.replaced.exists():
        return None
    log.warning("resume=False: the previous run is set aside in %s until this run saves its first checkpoint",
                run.replaced)
    return run.replaced


@dataclass
class _TrainData:
    """The prepared corpus, the step -> batch sampler and the validation split of one run."""

    prepared: PreparedData
    sampler: BatchSampler | TaskSampler
    val: TokenDataset | TaskValSet | None  # None when the val split is shorter than one window
    micro: int  # sequences per forward pass on one rank

    @classmethod
    def load(cls, model_config: DiffTransformerConfig, cfg: TrainConfig, env: DistEnv) -> _TrainData:
        data = PreparedData.load(cfg.data_dir)
        data.verify()  # shards, tokenizer and manifest belong together
        if data.vocab_size > model_config.vocab_size:
            raise ValueError(f"the tokenizer in {cfg.data_dir} has {data.vocab_size} tokens but the model's "
                             f"vocab_size is {model_config.vocab_size}; set vocab_size >= {data.vocab_size}")
        if cfg.init_from is not None:
            check_init_tokenizer(cfg.init_from, data)
        micro = micro_batch_size(cfg, env.world_size)
        family = data.family()
        if family is not None:  # a synthetic task: generated batches, a fixed validation set of the same size
            size = cfg.eval_batches * cfg.batch_size
            return cls(data, TaskSampler(family, cfg.batch_size, cfg.seq_len, seed=cfg.seed),
                       TaskValSet(family, cfg.seq_len, size), micro)
        sampler = BatchSampler(data.dataset("train"), cfg.batch_size, cfg.seq_len, seed=cfg.seed)
        val: TokenDataset | None = data.dataset("val")
        if num_eval_windows(val, cfg.seq_len) == 0:
            log.warning("the val split of %s has fewer than seq_len + 1 tokens; validation is skipped", cfg.data_dir)
            val = None
        return cls(data, sampler, val, micro)


def _resume_point(run: RunDir, model_config: DiffTransformerConfig, cfg: TrainConfig, data: PreparedData,
                  env: DistEnv, init_state, resume: bool) -> dict[str, Any] | None:
    """The checkpoint to continue from (checked against this run), or None to start fresh (resume=False
    leaves old checkpoints alone here: see _set_aside_old_checkpoints)."""
    if not resume:
        return None
    latest = find_latest(run.checkpoints)
    if latest is None and list_checkpoints(run.replaced_checkpoints):
        raise CheckpointError(f"{run.path} has no checkpoint of its own but {run.replaced} holds the run a call with "
                              f"--no-resume (resume=False) set aside before saving one: move the contents of "
                              f"{run.replaced} back into {run.path} to continue that run, or pass --no-resume again "
                              f"to start over")
    if latest is None:
        _check_same_run(run, model_config, cfg)  # a run whose checkpoints were deleted is not silently replaced
        return None
    ckpt = load_checkpoint(latest)
    _check_resume(ckpt, model_config, cfg, data, warn=env.is_main)
    if init_state is not None or cfg.init_from is not None:
        log.info("resuming from %s; %s is ignored", latest,
                 "init_state" if init_state is not None else f"init_from {cfg.init_from}")
    return ckpt


@dataclass
class _Parts:
    """The model (unwrapped), what the loop calls (DDP/FSDP-wrapped), the optimizer and the autocast context."""

    model: DiffTransformerLM
    wrapped: nn.Module
    optimizer: torch.optim.Optimizer
    amp: Any


def _build(model_config: DiffTransformerConfig, cfg: TrainConfig, env: DistEnv, ckpt, init_state) -> _Parts:
    """Seed, build, load weights, apply checkpointing/compile/parallelism, make the optimizer, restore state."""
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = DiffTransformerLM(model_config)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"], strict=True)
    elif init_state is not None:
        model.load_state_dict(init_state, strict=True)
    elif cfg.init_from is not None:
        load_init_weights(model, cfg.init_from)
        log.info("starting from the weights in %s", cfg.init_from)
    model.to(env.device)
    apply_trainable(model, cfg)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model.layers)
    if cfg.compile:
        for block in model.layers:  # per block: the model's input checks would break a whole-model graph
            block.compile()
    wrapped = wrap_model(model, env, cfg.fsdp)
    optimizer = build_optimizer(model, cfg)
    if ckpt is not None:
        # Loading takes the checkpoint's group settings too; this call's config decides them (weight decay, betas
        # and eps may change on resume, with a warning), so they are put back (lr is set every step anyway).
        settings = [{k: v for k, v in g.items() if k not in ("params", "names")} for g in optimizer.param_groups]
        load_full_optimizer_state(model, optimizer, ckpt["optimizer"], cfg.fsdp)
        for group, own in zip(optimizer.param_groups, settings, strict=True):
            group.update(own)
        set_rng_state(ckpt["state"]["rng"])
        log.info("resumed from %s at step %d", ckpt["path"], ckpt["step"])
        # the model and optimizer hold them now: the loaded copies (the whole model and its Adam moments, on every
        # rank) would otherwise stay in host memory for the whole run
        ckpt["model"] = ckpt["optimizer"] = None
    amp = (torch.autocast(env.device.type, dtype=torch.bfloat16) if cfg.precision == "bf16"
           else contextlib.nullcontext())
    return _Parts(model, wrapped, optimizer, amp)


class _Loop:
    """The optimizer steps of one train() call, with logging, evaluation and checkpoints on their intervals."""

    def __init__(self, run: RunDir, model_config: DiffTransformerConfig, cfg: TrainConfig, env: DistEnv,
                 data: _TrainData, parts: _Parts, ckpt: dict[str, Any] | None, replaced: Path | None = None):
        self.run_dir, self.model_config, self.cfg = run, model_config, cfg
        self.env, self.data, self.parts = env, data, parts
        self.elapsed_before = float(ckpt["state"].get("metrics", {}).get("elapsed_s", 0.0)) if ckpt else 0.0
        self.last_good = ckpt["path"].name if ckpt else None
        self.t_call = time.perf_counter()
        self.replaced = replaced  # old checkpoints set aside by a fresh start, deleted after the first save
        self.norm_reference = _norm_reference(ckpt)  # the run's, kept in its checkpoints (None: a fresh start)
        self.backend = model_config.backend_on(env.device)  # the attention backend the steps run on here
        self.train_documents = data.prepared.documents_hash("train")  # checkpoints record the split trained on
        if ckpt is not None and ckpt["state"].get(BACKEND_KEY, self.backend) != self.backend and env.is_main:
            old = ckpt["state"][BACKEND_KEY]
            why = " (the fused C++ kernel cannot be built here)" if old == "cpp" else ""
            log.warning("%s trained with the %r attention backend and this call runs %r%s: its numbers differ in "
                        "the last bits, so this run is no longer bitwise equal to an uninterrupted one",
                        ckpt["path"], old, self.backend, why)

    def run(self, start_step: int) -> tuple[float | None, float]:
        """Train from start_step to max_steps; returns (last validation loss, seconds spent in steps)."""
        cfg, parts = self.cfg, self.parts
        # the healthy reference for the divergence guard: the weights' norm when the run started, carried from
        # checkpoint to checkpoint, so a command run again after a divergence measures against the same one
        self.start_norm = self.norm_reference or (start_step, self.weight_norm())
        metrics = MetricsWriter(self.run_dir.metrics,
                                tensorboard_dir=self.run_dir.tensorboard if cfg.tensorboard else None,
                                enabled=self.env.is_main, progress=cfg.progress, start_step=start_step,
                                max_steps=cfg.max_steps)
        train_time, window_time, window_steps = 0.0, 0.0, 0
        val_loss: float | None = None
        try:
            parts.model.train()
            parts.model.set_training_step(start_step)  # the head-norm ramp of a diff_retrofit model
            for step in range(start_step, cfg.max_steps):
                t0 = time.perf_counter()
                lr = lr_at(step, cfg)
                loss_val, grad_norm = self.step(step, lr)
                done = step + 1
                dt = time.perf_counter() - t0
                train_time += dt
                window_time += dt
                window_steps += 1
                tok_s = window_steps * cfg.tokens_per_step / max(window_time, 1e-9)
                metrics.progress(loss_val, tok_s)
                last = done == cfg.max_steps
                if done % cfg.log_interval == 0 or last:
                    lambdas = parts.model.lambdas()  # a collective under FSDP: every rank reads them
                    metrics.train(done, loss_val, lr, grad_norm, done * cfg.tokens_per_step, tok_s,
                                  self.elapsed_before + time.perf_counter() - self.t_call,
                                  [None if x is None else x.value for x in lambdas],
                                  [None if x is None else x.init for x in lambdas])
                    window_time, window_steps = 0.0, 0
                if self.data.val is not None and (done % cfg.eval_interval == 0 or last):
                    val_loss = self.evaluate()
                    metrics.val(done, val_loss, done * cfg.tokens_per_step)
                if done % cfg.ckpt_interval == 0 or last:
                    self.check_weights(done, lr)  # never checkpoint (or finish with) a diverged state
                    metrics.sync()  # the rows this checkpoint covers are on disk before it is
                    self.save(done)
                    self.last_good = step_dir_name(done)
            if start_step >= cfg.max_steps and self.data.val is not None:  # nothing left to train: report only
                val_loss = self.evaluate()
        finally:
            metrics.close()
        return val_loss, train_time

    def step(self, step: int, lr: float) -> tuple[float, float]:
        """One optimizer step (all micro-batches); returns (mean loss, gradient norm) after one host sync.

        A non-finite loss or gradient norm raises TrainingDivergedError before the optimizer moves."""
        cfg, env, parts, micro = self.cfg, self.env, self.parts, self.data.micro
        set_lr(parts.optimizer, lr)
        inputs, targets = self.data.sampler.batch(step, env.rank, env.world_size)
        shares = self.token_shares(step, targets)
        loss_sum = torch.zeros((), device=env.device)
        for i in range(cfg.grad_accum_steps):
            x = inputs[i * micro:(i + 1) * micro].to(env.device, non_blocking=True)
            y = targets[i * micro:(i + 1) * micro].to(env.device, non_blocking=True)
            with no_sync(parts.wrapped, sync=i == cfg.grad_accum_steps - 1):
                with parts.amp:
                    loss = parts.wrapped(x, y).loss * shares[i]
                (loss / cfg.grad_accum_steps).backward()
            loss_sum += loss.detach()
        loss_t = env.all_reduce_sum(loss_sum / cfg.grad_accum_steps) / env.world_size
        norm = torch.nn.utils.clip_grad_norm_(parts.model.parameters(),
                                              cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        # One device-to-host sync per step for both numbers.
        loss_val, grad_norm = torch.stack([loss_t.float(), full_tensor(norm).float()]).tolist()
        if not (math.isfinite(loss_val) and math.isfinite(grad_norm)):
            what = f"loss {loss_val}" if not math.isfinite(loss_val) else f"gradient norm {grad_norm}"
            raise TrainingDivergedError(
                f"training diverged at step {step + 1}: {what} (lr {lr:.3g}). Nothing was saved for this "
                f"step; the last good checkpoint is {self.last_good or 'none'}. Try a lower lr, gradient "
                f"clipping (grad_clip > 0), a longer warmup, or precision='fp32'")
        parts.optimizer.step()
        parts.optimizer.zero_grad(set_to_none=True)
        parts.model.set_training_step(step + 1)  # α for the model after this step (no-op for other kinds)
        return loss_val, grad_norm

    def token_shares(self, step: int, targets: torch.Tensor) -> list[float]:
        """Each micro-batch's loss weight, so that the step's objective is the mean over every scored token of the
        global batch, whatever the world size and accumulation: a micro-batch's loss is a mean over its own scored
        tokens, and accumulation and DDP average those means; weighted by (its tokens) x (micro-batches in the
        step) / (the step's tokens), they average to the global mean. 1 where every micro-batch scores as many
        tokens (a corpus: every target), so such a run computes exactly what it did unweighted; a synthetic task,
        scored on its answers only, scores a varying number. targets: this rank's (batch / world size, T) slice."""
        cfg, env = self.cfg, self.env
        if not isinstance(self.data.sampler, TaskSampler):  # a corpus scores every target
            return [1.0] * cfg.grad_accum_steps
        counts = (targets != IGNORE_INDEX).view(cfg.grad_accum_steps, -1).sum(1).tolist()
        n_micro = cfg.grad_accum_steps * env.world_size
        total, empty = float(sum(counts)), float(counts.count(0))
        if env.world_size > 1:  # [scored tokens, micro-batches scoring none] over every rank (float64: exact to 2^53
            # tokens), so that an empty micro-batch stops every rank at once instead of leaving the others waiting
            local = torch.tensor([total, empty], dtype=torch.float64, device=env.device)
            total, empty = env.all_reduce_sum(local).tolist()  # one small collective and host read per step
        if empty:
            raise ValueError(f"step {step + 1}: {int(empty)} micro-batch(es) score no token (every target "
                             f"{IGNORE_INDEX}), so their loss is undefined; every sequence of a synthetic task must "
                             f"have an answer")
        return [c * n_micro / total for c in counts]

    def weight_norm(self) -> float:
        """The global L2 norm of the weights (a collective under FSDP: every rank calls). FSDP's sharded
        parameters (DTensors) and any plain ones are normed apart: the two cannot share one call."""
        params = [p.detach() for p in self.parts.model.parameters()]
        squares = 0.0
        sharded = [p for p in params if hasattr(p, "full_tensor")]
        for group in (sharded, [p for p in params if not hasattr(p, "full_tensor")]):
            if group:
                squares += float(full_tensor(torch.nn.utils.get_total_norm(group))) ** 2
        return math.sqrt(squares)

    def check_weights(self, step: int, lr: float) -> None:
        """TrainingDivergedError if the weights after `step` are not finite or their norm has grown past
        max_weight_growth times its value when this call started: an update can blow the weights up
        although the loss and gradient it was computed from were finite."""
        norm, (ref_step, ref) = self.weight_norm(), self.start_norm
        growth = self.cfg.max_weight_growth
        if math.isfinite(norm) and not (growth > 0 and ref > 0 and norm > growth * ref):
            return
        what = (f"the weights are not finite (norm {norm})" if not math.isfinite(norm) else
                f"the weights' norm grew to {norm:.4g}, {norm / ref:.3g}x its {ref:.4g} at step {ref_step} "
                f"(limit train.max_weight_growth = {growth:g})")
        raise TrainingDivergedError(
            f"training diverged by step {step}: {what} (lr {lr:.3g}). Nothing was saved for it; the last good "
            f"checkpoint is {self.last_good or 'none'}. Resume from it with a lower lr (--set train.lr=...), a "
            f"longer warmup or gradient clipping")

    def evaluate(self) -> float:
        return evaluate(self.parts.model, self.data.val, self.cfg, self.data.micro, self.env, self.parts.amp)

    def save(self, step: int) -> None:
        """Checkpoint `step` (gathering FSDP shards: every rank calls; rank 0 writes)."""
        cfg, env, parts, data = self.cfg, self.env, self.parts, self.data.prepared
        model_state = full_model_state(parts.model, cfg.fsdp, rank0_only=True)
        optim_state = full_optimizer_state_by_name(parts.model, parts.optimizer, cfg.fsdp)
        if env.is_main:
            state = {
                "scheduler": {"step": step, "lr": lr_at(step - 1, cfg), "schedule": cfg.lr_schedule},
                "rng": rng_state(),
                "metrics": {"elapsed_s": self.elapsed_before + time.perf_counter() - self.t_call,
                            "tokens": step * cfg.tokens_per_step},
                "data": {"corpus_hash": data.corpus_hash, "tokenizer_hash": data.tokenizer_hash,
                         "vocab_size": data.vocab_size, TRAIN_DOCUMENTS_KEY: self.train_documents},
                "world_size": env.world_size,
                NORM_REFERENCE: list(self.start_norm),
                BACKEND_KEY: self.backend,
            }
            path = save_checkpoint(self.run_dir.checkpoints, step, model_state, optim_state, state, self.model_config,
                                   cfg, cfg.keep_last)
            log.info("saved checkpoint %s", path)
            if self.replaced is not None:  # the fresh start has a checkpoint of its own now
                shutil.rmtree(self.replaced, ignore_errors=True)
                self.replaced = None
        env.barrier()


NORM_REFERENCE = "weight_norm_reference"  # checkpoint state: [step, norm] the divergence guard measures against
BACKEND_KEY = "attention_backend"  # checkpoint state: the backend its steps ran on (a resume on another is warned)
TRAIN_DOCUMENTS_KEY = "train_documents_hash"  # checkpoint state data: the train split's documents (None: a task)


def _norm_reference(ckpt: dict[str, Any] | None) -> tuple[int, float] | None:
    """The divergence guard's (step, norm) stored in a checkpoint; None without one (a checkpoint written
    before the reference was stored: the norm when this call starts is taken, as then)."""
    ref = (ckpt or {}).get("state", {}).get(NORM_REFERENCE)
    if (isinstance(ref, list) and len(ref) == 2 and isinstance(ref[0], int) and isinstance(ref[1], (int, float))
            and math.isfinite(ref[1]) and ref[1] > 0):
        return int(ref[0]), float(ref[1])
    return None


def _write_final(run: RunDir, model_config: DiffTransformerConfig, cfg: TrainConfig, env: DistEnv,
                 model: DiffTransformerLM, data: PreparedData) -> DiffTransformerLM | None:
    """Write final/ (weights in save_pretrained format and the tokenizer); returns the plain model (TrainResult.model:
    under FSDP gathered into rank 0's host memory alone, as a checkpoint is, and None on the other ranks)."""
    if cfg.activation_checkpointing:
        remove_activation_checkpointing(model.layers)
    if cfg.fsdp and env.distributed:  # gather the shards into a plain model on rank 0's host
        full = full_model_state(model, fsdp=True, rank0_only=True)
        model = None
        if env.is_main:
            model = DiffTransformerLM(model_config)
            model.load_state_dict(full)
        del full
    if env.is_main:
        model.save_pretrained(run.final)
        if data.tokenizer_path.is_file():
            atomic_copy(data.tokenizer_path, run.final_tokenizer)  # a full disk leaves no torn tokenizer.json
        log.info("final weights in %s", run.final)
    env.barrier()
    return model

"""Training throughput of a DIFF LM vs its parameter-matched Transformer, in one run, on CPU or CUDA.

Each arm runs full training steps (forward, loss, backward, AdamW step) on the same random
token batches; the two arms alternate step by step so machine load hits both alike (on CUDA each
timed step starts and ends on a synchronised GPU, so the medians are the GPU's time). Prints
tokens/s and peak memory as DIFF/baseline ratios. Peak memory is the peak of tensor memory that
one steady-state training step allocates above what existed before it (activations, gradients,
temporaries); on CPU from the PyTorch profiler in a fresh process, on CUDA from
torch.cuda.max_memory_allocated in this process (tensors that exist before the step, the other
arm's included, are a constant offset and cancel). "resident MiB" is the arm's weights, gradients
and AdamW state at the step's start; resident + peak is the arm's whole training footprint.

Backends: the same `--backend` for both arms, except 'triton' (the fused kernel exists for
differential attention only), which the Transformer arm replaces with 'auto' (SDPA's
FlashAttention on CUDA), as `DiffTransformerConfig.matched` does. 'auto' picks per call: on CUDA
the fused Triton kernel for DIFF in bf16 (SDPA in fp32) and SDPA for the Transformer; on CPU the
fused C++ kernels for both, if they build. The header names what each arm actually runs.

    python benchmarks/train_throughput.py                        # cpu-small on CPU (gpu-small on CUDA), T=256, batch 8
    python benchmarks/train_throughput.py --preset cpu-medium --seq-len 512 --backend sdpa
    python benchmarks/train_throughput.py --device cuda --preset gpu-small --seq-len 2048 --batch 8 --precision bf16
    python benchmarks/train_throughput.py --device cuda --config configs/gpu-350m.toml --set model.vocab_size=32768 \
        --seq-len 1024 --batch 16 --precision bf16           # the 337 M pair of the multi-GPU recipe, on one GPU

With --trace N it then profiles N more steps of each arm (torch.profiler) and prints each kernel's
time per step in both arms, the largest differences first: where DIFF's extra step time goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    DEVICES,
    cuda_step_peak_mib,
    interleaved_medians,
    kernel_times,
    machine,
    peak_memory_mib,
    print_trace,
    resolve_device,
)

ARMS = (("transformer", "Transformer"), ("diff", "DIFF"))


def arm_config(args, attention: str):
    """The arm's model config: the preset's (or the run config's) DIFF model with the asked backend,
    or its matched `attention` model."""
    from difftransformer import get_preset

    runtime = dict(attn_backend=args.backend, attn_deterministic=args.deterministic)
    if args.config:
        model = args.config_model  # read once by parse_args
        cfg = dataclasses.replace(model, **runtime,
                                  max_position_embeddings=max(args.seq_len, model.max_position_embeddings))
    else:
        cfg = get_preset(args.preset).config("diff", **runtime, max_position_embeddings=max(args.seq_len, 256))
    return cfg if attention == "diff" else cfg.matched(attention)


def arm_backend(args, attention: str, device: torch.device) -> str:
    """The backend the arm's attention runs (what 'auto' resolves to for the compute dtype); a
    ValueError when the asked backend cannot run on `device` ('cpp' on CUDA, 'triton' on CPU)."""
    from difftransformer.attention.backends import resolve_backend

    cfg = arm_config(args, attention)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    return resolve_backend(cfg.attn_backend, device, dtype=dtype, ordinary=not cfg.kind.fused_kernel)


def build_step(args, attention: str):
    """One training step of the arm (a closure over its model, optimizer and batch on args.device)."""
    from difftransformer import DiffTransformerLM

    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = arm_config(args, attention)
    model = DiffTransformerLM(cfg, device=device)
    forward = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1),
                        generator=torch.Generator().manual_seed(1)).to(device)
    dtype = torch.bfloat16 if args.precision == "bf16" else None

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = forward(ids[:, :-1], ids[:, 1:]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def resident_mib() -> float:
        tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
                   *(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t))]
        return sum(t.numel() * t.element_size() for t in tensors) / 2**20

    step.num_params = model.num_parameters()
    step.resident_mib = resident_mib
    return step


def _make(args):
    step = build_step(args, args.attention)
    step()  # optimizer state exists after the first step: measure a steady-state step
    return step


def step_peaks(args, steps, device: torch.device) -> list[float]:
    """Each arm's step peak (MiB, see the module docstring); the steps have run their warm-up."""
    if device.type == "cuda":
        return [cuda_step_peak_mib(step, device) for step in steps]
    return [peak_memory_mib(_make, argparse.Namespace(**vars(args), attention=a), args.threads) for a, _ in ARMS]


def parse_args() -> tuple[argparse.Namespace, torch.device, dict[str, str]]:
    """The options, the device they name, and each arm's resolved backend; a one-line error for impossible asks."""
    from difftransformer.model.config import PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=DEVICES, help="auto: cuda when a GPU is visible")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--preset", default=None, choices=list(PRESETS),
                      help="model size (default: gpu-small on CUDA, cpu-small on CPU)")
    size.add_argument("--config", default=None, metavar="FILE",
                      help="take the model from a run config's [model] section instead (e.g. configs/gpu-350m.toml); "
                           "its sequence length and batch still come from --seq-len and --batch")
    p.add_argument("--set", nargs="+", default=[], metavar="SECTION.KEY=VALUE",
                   help="overrides for --config, as in `difftransformer train --set` "
                        "(e.g. model.vocab_size=32768 where the vocabulary comes from a tokenizer)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--backend", default="auto", choices=["auto", "cpp", "triton", "sdpa", "eager"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast")
    p.add_argument("--deterministic", default=True, action=argparse.BooleanOptionalAction,
                   help="config attn_deterministic: --no-deterministic lets the fused Triton backward add dQ "
                        "with atomics (one pass, run-to-run rounding differences)")
    p.add_argument("--compile", action="store_true", help="torch.compile each arm's model")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--trace", type=int, default=0, metavar="STEPS",
                   help="then profile this many steps of each arm and print the kernels whose time differs most")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="CPU threads (no effect on CUDA's work)")
    args = p.parse_args()
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        p.error(str(e))
    args.device = device.type  # a plain string: args is pickled into the CPU memory probe's process
    if args.set and not args.config:
        p.error("--set overrides a run config: give --config too")
    if not args.config:
        args.preset = args.preset or ("gpu-small" if device.type == "cuda" else "cpu-small")
    if min(args.seq_len, args.batch, args.repeats, args.threads) < 1 or args.trace < 0:
        p.error("--seq-len, --batch, --repeats and --threads must be positive, --trace at least 0")
    if args.config:
        from difftransformer.run_config import load_run_config

        try:  # the run config's own errors (ConfigError is a ValueError) and a missing file
            args.config_model = load_run_config(args.config, overrides=args.set).model.matched("diff")
        except (OSError, ValueError) as e:
            p.error(f"--config {args.config}: {e}")
    try:
        resolved = {name: arm_backend(args, a, device) for a, name in ARMS}
    except ValueError as e:
        p.error(f"--backend {args.backend} on {device.type}: {e}")
    return args, device, resolved


def main() -> None:
    args, device, resolved = parse_args()
    torch.set_num_threads(args.threads)

    steps = [build_step(args, a) for a, _ in ARMS]
    t_base, t_diff = interleaved_medians(steps, args.repeats, warmup=2, device=device)
    mem = step_peaks(args, steps, device)
    res = [step.resident_mib() for step in steps]
    tokens = args.batch * args.seq_len
    attn = ", ".join(f"{name} {b}" for name, b in resolved.items())
    print(f"# Training throughput, {f'config {args.config}' if args.config else f'preset {args.preset}'}, "
          f"T={args.seq_len}, batch {args.batch}, {args.precision}, "
          f"backend {args.backend} ({attn}), deterministic {args.deterministic}"
          f"{', compiled' if args.compile else ''}, on {device.type} ({machine(device)})\n")
    print("| arm | params | step ms | tokens/s | peak MiB | resident MiB |")
    print("|---|---|---|---|---|---|")
    for (_, name), step, t, m, r in zip(ARMS, steps, (t_base, t_diff), mem, res):
        print(f"| {name} | {step.num_params / 1e6:.2f}M | {t * 1e3:.1f} | {tokens / t:,.0f} | {m:.0f} | {r:.0f} |")
    print(f"\nDIFF/Transformer: throughput {t_base / t_diff:.3f}x, peak memory {mem[1] / max(mem[0], 1e-9):.3f}x, "
          f"peak + resident {(mem[1] + res[1]) / max(mem[0] + res[0], 1e-9):.3f}x")
    if args.trace:
        print_trace([kernel_times(step, args.trace) for step in steps], (t_base, t_diff))


if __name__ == "__main__":
    main()

"""Training throughput of a DIFF LM vs its parameter-matched Transformer, in one run.

Each arm runs full training steps (forward, loss, backward, AdamW step) on the same random
token batches; the two arms alternate step by step so machine load hits both alike. Prints
tokens/s and peak memory (the peak of tensor memory allocated during one training step after a
warm-up step, from the PyTorch profiler, in a fresh process) as DIFF/baseline
ratios. Same attention backend for both arms.

    python benchmarks/train_throughput.py                        # cpu-small preset, T=256, batch 8
    python benchmarks/train_throughput.py --preset cpu-medium --seq-len 512 --backend sdpa
    (default backend 'auto': on CPU both arms run the fused C++ kernels, if they build)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved_medians, machine, peak_memory_mib  # noqa: E402


def build_step(args, attention: str):
    from difftransformer import DiffTransformerLM, get_preset

    torch.manual_seed(0)
    cfg = get_preset(args.preset).config(attention, attn_backend=args.backend,
                                         max_position_embeddings=max(args.seq_len, 256))
    model = DiffTransformerLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    dtype = torch.bfloat16 if args.precision == "bf16" else None

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = model(ids[:, :-1], ids[:, 1:]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step.num_params = model.num_parameters()
    return step


def _make(args):
    step = build_step(args, args.attention)
    step()  # optimizer state exists after the first step: measure a steady-state step
    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--backend", default="auto", choices=["auto", "cpp", "sdpa", "eager"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    steps = [build_step(args, "transformer"), build_step(args, "diff")]
    t_base, t_diff = interleaved_medians(steps, args.repeats, warmup=2)
    mem = [peak_memory_mib(_make, argparse.Namespace(**vars(args), attention=a), args.threads)
           for a in ("transformer", "diff")]
    tokens = args.batch * args.seq_len
    print(f"# Training throughput, preset {args.preset}, T={args.seq_len}, batch {args.batch}, {args.precision}, "
          f"backend {args.backend} ({machine()})\n")
    print("| arm | params | step ms | tokens/s | peak MiB |")
    print("|---|---|---|---|---|")
    for name, step, t, m in (("Transformer", steps[0], t_base, mem[0]), ("DIFF", steps[1], t_diff, mem[1])):
        print(f"| {name} | {step.num_params / 1e6:.2f}M | {t * 1e3:.1f} | {tokens / t:,.0f} | {m:.0f} |")
    print(f"\nDIFF/Transformer: throughput {t_base / t_diff:.3f}x, peak memory {mem[1] / max(mem[0], 1e-9):.3f}x")


if __name__ == "__main__":
    main()

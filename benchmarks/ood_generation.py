"""Does generating a synthetic task's batches slow its training? Tokens/s of generation against tokens/s of a
training step, per family, interleaved (gen, step, gen, step, ...) so machine load hits both alike.

    python benchmarks/ood_generation.py                     # every family, the study-sized model
    python benchmarks/ood_generation.py --families mqar --rounds 20 --threads 1

A row's "share" is generation time / (generation + step) per round, median [95% interval]: the fraction of a
training step's wall time that generating its batch would add if done in the same thread (the target is
<= 0.05: generation never slows training). Tokens count every position of the padded window, as the
trainer's tokens/s does.
"""

from __future__ import annotations

import argparse
import datetime as dt
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MedianInterval, interleaved_times, machine  # noqa: E402

from difftransformer import DiffTransformerLM, get_preset  # noqa: E402
from difftransformer.data.ood import FAMILIES  # noqa: E402
from difftransformer.data.ood.sampler import TaskSampler  # noqa: E402


def study_model(vocab: int, attention: str = "diff") -> DiffTransformerLM:
    """The OOD studies' model: 2 layers of width 128 (4 DIFF heads / 8 Transformer heads)."""
    base = get_preset("tiny").config("diff")
    cfg = type(base)(**{**base.to_dict(), "vocab_size": vocab, "hidden_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 2048})
    return DiffTransformerLM(cfg.matched(attention))


def measure(name: str, rounds: int, batch: int) -> tuple[float, float, MedianInterval]:
    family = FAMILIES[name]()
    seq = family.max_length()
    sampler = TaskSampler(family, batch, seq, seed=0)
    model = study_model(family.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = iter(range(10**9))

    def gen():
        sampler.batch(next(steps))

    x, y = sampler.batch(0)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x, y).loss.backward()
        opt.step()

    g, s = interleaved_times([gen, step], rounds, warmup=2)
    tokens = batch * seq
    share = MedianInterval.of([a / (a + b) for a, b in zip(g, s)])
    return tokens / sorted(g)[len(g) // 2], tokens / sorted(s)[len(s) // 2], share


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated families (default: all)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds per family (default 15)")
    p.add_argument("--batch", type=int, default=32, help="sequences per batch (default 32)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the training step (default 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.families.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# OOD task generation vs training, {dt.date.today()}, {machine()}, commit {commit}")
    print(f"# python benchmarks/ood_generation.py --families {','.join(names)} --rounds {args.rounds} "
          f"--batch {args.batch} --threads {args.threads}")
    print("| family | generation tokens/s | training tokens/s | generation share of a step | target <= 0.05 |")
    print("|---|---|---|---|---|")
    for name in names:
        gen, train, share = measure(name, args.rounds, args.batch)
        print(f"| {name} | {gen:,.0f} | {train:,.0f} | {share.cell(3)} | {share.verdict('<=', 0.05)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

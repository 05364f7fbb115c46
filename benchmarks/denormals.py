"""What subnormal floats cost on CPU: a training step's forward and backward with them kept (IEEE arithmetic) and
flushed to zero (what the CLI and `train()` do, difftransformer.numerics), on a trained model and on the same
architecture freshly initialised, interleaved (kept, flushed, kept, ...) so machine load hits both alike.

    python benchmarks/denormals.py --checkpoint runs/ood-maxret/seed1/transformer_lr5e-4/checkpoints/step_00003000 \\
        --data-dir cache/data/task-maxret-5da9ad75a05b

--checkpoint: a run folder, its final/ or one checkpoint of a model trained on a synthetic task (data.task);
--data-dir: that task's prepared-data folder (its batches are the ones the model learned). One thread: the
flags are per thread, and this script switches them between steps in the one thread that computes.
A row's "kept / flushed" is the median ratio of the paired step times [95% interval].
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

from difftransformer import DiffTransformerLM  # noqa: E402
from difftransformer.data import PreparedData  # noqa: E402
from difftransformer.data.ood.sampler import TaskSampler  # noqa: E402
from difftransformer.train.run_dir import load_model  # noqa: E402


def step_fn(model: DiffTransformerLM, batch: tuple[torch.Tensor, torch.Tensor], flush: bool):
    """One forward and backward of `model` on `batch` with subnormals flushed or kept (set in this thread)."""
    x, y = batch

    def step():
        torch.set_flush_denormal(flush)
        model.zero_grad(set_to_none=True)
        model(x, y).loss.backward()

    return step


def measure(model: DiffTransformerLM, batch, rounds: int) -> tuple[MedianInterval, MedianInterval, MedianInterval]:
    kept, flushed = interleaved_times([step_fn(model, batch, False), step_fn(model, batch, True)], rounds, warmup=2)
    torch.set_flush_denormal(False)
    return (MedianInterval.of([t * 1e3 for t in kept]), MedianInterval.of([t * 1e3 for t in flushed]),
            MedianInterval.ratio(kept, flushed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a trained model: run folder, final/ or a checkpoint")
    parser.add_argument("--data-dir", required=True, help="the prepared-data folder of the task it trained on")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step (default 32, the studies')")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds per model (default 10)")
    args = parser.parse_args()
    if not torch.set_flush_denormal(False):
        parser.error("this CPU has no flush-to-zero flags (torch.set_flush_denormal returned False)")
    family = PreparedData.load(args.data_dir).family()
    if family is None:
        parser.error(f"--data-dir {args.data_dir} holds a corpus, not a synthetic task; give the task's folder")
    torch.set_num_threads(1)
    trained = load_model(args.checkpoint).model.train()
    fresh = DiffTransformerLM(trained.config).train()
    batch = TaskSampler(family, args.batch_size, family.max_length(), seed=0).batch(10**6)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"{dt.date.today()}, {machine()}, commit {commit or '?'}; {family.name}, "
          f"{args.batch_size} x {family.max_length()} tokens, {sum(p.numel() for p in trained.parameters()):,} "
          f"parameters, {args.rounds} rounds\n")
    print("| model | kept (ms) | flushed (ms) | kept / flushed |\n|---|---|---|---|")
    for name, model in (("trained", trained), ("fresh initialisation", fresh)):
        kept, flushed, ratio = measure(model, batch, args.rounds)
        print(f"| {name} | {kept} | {flushed} | {ratio} |")


if __name__ == "__main__":
    main()

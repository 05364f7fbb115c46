"""Batches of (inputs, targets) from a token dataset.

Training batches are a pure function of (seed, step): the window offsets of step s come from
numpy.random.default_rng([seed, s]). There is no iterator state to checkpoint; resuming at step
s only needs s. The global batch is drawn first and rank r takes rows [r*B/W, (r+1)*B/W), so a
run on W processes sees exactly the tokens of a single-process run with the same global batch.

Evaluation batches walk the split in order with non-overlapping windows, so a validation loss
is a fixed, reproducible average over (almost) every token of the split.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from .shards import TokenDataset

Batch = tuple[torch.Tensor, torch.Tensor]


def _tokens_and_name(dataset: TokenDataset | np.ndarray) -> tuple[np.ndarray, str]:
    if isinstance(dataset, TokenDataset):
        return dataset.tokens, f"split {dataset.split!r}"
    return np.asarray(dataset), "token array"


def _check_length(n: int, seq_len: int, name: str) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if n < seq_len + 1:
        more = ("a larger corpus, or smaller val/test fractions (they take documents from train)"
                if "train" in name else "a larger val/test fraction or corpus")
        raise ValueError(
            f"{name} has {n} tokens, fewer than seq_len + 1 = {seq_len + 1} needed for one window; "
            f"use a smaller seq_len or more data: {more}"
        )


def _to_batch(windows: np.ndarray) -> Batch:
    w = torch.from_numpy(np.asarray(windows, dtype=np.int64))
    return w[:, :-1], w[:, 1:]


class BatchSampler:
    """Random windows of seq_len + 1 tokens; `batch(step)` is stateless and reproducible."""

    def __init__(self, dataset: TokenDataset | np.ndarray, batch_size: int, seq_len: int, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.tokens, self.name = _tokens_and_name(dataset)
        _check_length(len(self.tokens), seq_len, self.name)
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed

    def offsets(self, step: int) -> np.ndarray:
        """Start offsets of the global batch at `step`: uniform over every full window."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> Batch:
        """(inputs, targets), int64 of shape (batch_size // world_size, seq_len), for this rank."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if self.batch_size % world_size:
            raise ValueError(
                f"batch_size {self.batch_size} is not divisible by world_size {world_size}; "
                "choose a global batch size that is a multiple of the number of processes"
            )
        local = self.batch_size // world_size
        offs = self.offsets(step)[rank * local : (rank + 1) * local]
        return _to_batch(self.tokens[offs[:, None] + np.arange(self.seq_len + 1)])

    def __iter__(self) -> Iterator[Batch]:
        """Endless single-process batches from step 0 (use `batch(step)` to resume or shard)."""
        step = 0
        while True:
            yield self.batch(step)
            step += 1


def num_eval_windows(dataset: TokenDataset | np.ndarray, seq_len: int) -> int:
    """How many non-overlapping windows `iter_eval_batches` yields in all."""
    tokens, _ = _tokens_and_name(dataset)
    return max(len(tokens) - 1, 0) // seq_len


def iter_eval_batches(
    dataset: TokenDataset | np.ndarray,
    batch_size: int,
    seq_len: int,
    max_batches: int | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[Batch]:
    """Walk the split in order: window i has inputs tokens[i*L : (i+1)*L], targets shifted by one.

    Every target token 1..num_windows*L is predicted exactly once; the final tail of fewer than
    seq_len tokens is left out so all windows have the same length. The last batch may hold fewer
    than batch_size rows. With world_size > 1, rank r gets batches r, r + W, r + 2W, ... of the
    same sequence; max_batches limits the global count, before the split across ranks.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    tokens, name = _tokens_and_name(dataset)
    _check_length(len(tokens), seq_len, name)
    n_windows = num_eval_windows(tokens, seq_len)
    n_batches = -(-n_windows // batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for b in range(rank, n_batches, world_size):
        starts = np.arange(b * batch_size, min((b + 1) * batch_size, n_windows)) * seq_len
        yield _to_batch(tokens[starts[:, None] + np.arange(seq_len + 1)])

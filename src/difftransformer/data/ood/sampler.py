"""Generated data as the trainer and the evaluations take it: stateless train batches, fixed test sets.

Streams are seeded by (seed, stream, step or condition), so a train batch is a pure function of
(seed, step), like `BatchSampler`'s, and a test set of (seed, condition, size). Train keeps only
sequences whose partition bit is 0 and test sets only those whose bit is 1 (`partition_bits`), so
no test sequence is ever trained on, whatever the seeds.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import numpy as np
import torch

from .episodes import Episodes, partition_bits
from .families import PAD_ID, TRAIN, Condition, Family

_TRAIN_STREAM, _VAL_STREAM, _TEST_STREAM = 0x7EA1, 0x7A1, 0x7E57
TRAIN_BIT, TEST_BIT = 0, 1


def draw(family: Family, rng: np.random.Generator, n: int, condition: Condition, bit: int) -> Episodes:
    """n sequences of `family` under `condition` whose partition bit is `bit` (the others are dropped)."""
    kept: list[Episodes] = []
    have = 0
    while have < n:
        batch = family.generate(rng, max(8, int((n - have) * 2.2)), condition)
        batch = batch.take(np.flatnonzero(partition_bits(batch) == bit))
        kept.append(batch)
        have += len(batch)
    out = Episodes.concat(kept, PAD_ID) if len(kept) > 1 else kept[0]
    return out.take(np.arange(n))


def _condition_key(condition: Condition) -> int:
    """The test stream of a condition: equal conditions (2 == 2.0) share it, factors keyed as floats."""
    text = json.dumps([float(condition.length), float(condition.density)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


def eval_set(family: Family, condition: Condition, n: int, seed: int = 0) -> Episodes:
    """The fixed test set of `n` sequences under `condition` (seeded by seed and the condition)."""
    family.check_condition(condition)
    rng = np.random.default_rng([seed, _TEST_STREAM, _condition_key(condition)])
    return draw(family, rng, n, condition, TEST_BIT)


class TaskSampler:
    """Train batches of a family at its training distribution; `batch(step)` is stateless and reproducible,
    and with world_size W rank r takes rows [r B/W, (r+1) B/W) of the same global batch."""

    def __init__(self, family: Family, batch_size: int, seq_len: int, seed: int = 0):
        if batch_size < 1 or seed < 0:
            raise ValueError(f"batch_size must be >= 1 and seed >= 0, got {batch_size}, {seed}")
        need = family.max_length(TRAIN)
        if seq_len < need:
            raise ValueError(f"train.seq_len = {seq_len} is shorter than the longest {family.name} training "
                             f"sequence ({need} tokens); set train.seq_len >= {need}")
        self.family, self.batch_size, self.seq_len, self.seed = family, batch_size, seq_len, seed

    def episodes(self, step: int) -> Episodes:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rng = np.random.default_rng([self.seed, _TRAIN_STREAM, step])
        return draw(self.family, rng, self.batch_size, TRAIN, TRAIN_BIT).pad_to(self.seq_len, PAD_ID)

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 (batch_size // world_size, seq_len); targets are -100 off the answers."""
        if world_size < 1 or not 0 <= rank < world_size or self.batch_size % world_size:
            raise ValueError(f"need 0 <= rank < world_size and batch_size ({self.batch_size}) divisible by "
                             f"world_size; got rank={rank}, world_size={world_size}")
        local = self.batch_size // world_size
        inputs, targets = self.episodes(step).tensors()
        return inputs[rank * local:(rank + 1) * local], targets[rank * local:(rank + 1) * local]


class TaskValSet:
    """The validation sequences of a training run: a fixed set at the training distribution (test bit, its
    own stream), walked in order like `iter_eval_batches` walks a token split."""

    def __init__(self, family: Family, seq_len: int, size: int, seed: int = 0):
        rng = np.random.default_rng([seed, _VAL_STREAM])
        self.episodes = draw(family, rng, size, TRAIN, TEST_BIT).pad_to(seq_len, PAD_ID)

    def __len__(self) -> int:
        return len(self.episodes)

    def batches(self, batch_size: int, max_batches: int | None = None, rank: int = 0,
                world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        inputs, targets = self.episodes.tensors()
        n = -(-len(self) // batch_size)
        n = n if max_batches is None else min(n, max_batches)
        for b in range(rank, n, world_size):
            yield inputs[b * batch_size:(b + 1) * batch_size], targets[b * batch_size:(b + 1) * batch_size]

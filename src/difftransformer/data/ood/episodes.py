"""A batch of generated task sequences, with what every position is and what every answer should read.

An `Episodes` holds B sequences padded to one length (PAD after each sequence's end). For next-token
training, `inputs` are the tokens and `targets[b, t]` the token at t + 1 where that token is an
answer, -100 elsewhere: the loss is taken on answer tokens only. For the mechanism (attention noise),
every position carries

    role     what the token is: PAD, BOS (the leading EOS), FILLER (noise, never the answer's source),
             ITEM (a token of a key-value pair, an instruction, a trigger and its successor: something
             a query may ask for) or QUERY (the question part, answers included);
    support  for ITEM tokens, the id of the item they belong to (-1 elsewhere); an item is the unit
             a query retrieves (a key-value pair, a write instruction and its bit, ...);

and every answer position (targets != -100) carries `answer_item`, the support id it must read:
attention from there onto positions with that support id is mass on the target; onto other items,
mass on distractors; onto FILLER, mass on noise. Induction's target is a set (every earlier
occurrence of the trigger): those share one support id. `answer_query` numbers the queries of a
sequence (an answer of several tokens belongs to one query), so accuracy can be counted per query.

Train and test never share a sequence: `partition_bits` hashes each sequence (its tokens up to its
length) and the train stream keeps only even hashes, test sets only odd ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PAD, BOS, FILLER, ITEM, QUERY = 0, 1, 2, 3, 4
IGNORE = -100
_HASH_SEED = 0x5EED_0DD5


@dataclass
class Episodes:
    """B generated sequences; every array is (B, L) except `lengths` (B,)."""

    inputs: np.ndarray  # int64 token ids, PAD-padded
    targets: np.ndarray  # int64: the next token where it is an answer, IGNORE elsewhere
    role: np.ndarray  # int8: PAD, BOS, FILLER, ITEM, QUERY
    support: np.ndarray  # int32: item id of ITEM tokens, -1 elsewhere
    answer_item: np.ndarray  # int32: at answer positions the item id the answer is read from, -1 elsewhere
    answer_query: np.ndarray  # int32: at answer positions the query's number within its sequence, -1 elsewhere
    lengths: np.ndarray  # int64: tokens of each sequence before its padding

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def answer_mask(self) -> np.ndarray:
        return self.targets != IGNORE

    def take(self, rows: np.ndarray) -> Episodes:
        """The sequences `rows` (indices or a boolean mask), cut to their longest length."""
        length = int(self.lengths[rows].max()) if np.size(self.lengths[rows]) else 0
        return Episodes(*(a[rows][:, :length] for a in (self.inputs, self.targets, self.role, self.support,
                                                         self.answer_item, self.answer_query)),
                        self.lengths[rows])

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) as int64 tensors, the trainer's batch."""
        return torch.from_numpy(self.inputs), torch.from_numpy(self.targets)

    def pad_to(self, length: int, pad_id: int) -> Episodes:
        """The same sequences padded (never cut) to `length` columns."""
        extra = length - self.inputs.shape[1]
        if extra < 0:
            raise ValueError(f"cannot pad sequences of {self.inputs.shape[1]} tokens to {length}; the longest "
                             f"sequence is longer than the window (raise train.seq_len)")
        if extra == 0:
            return self
        fill = {"inputs": pad_id, "targets": IGNORE, "role": PAD, "support": -1, "answer_item": -1,
                "answer_query": -1}
        arrays = {k: np.pad(getattr(self, k), ((0, 0), (0, extra)), constant_values=v) for k, v in fill.items()}
        return Episodes(**arrays, lengths=self.lengths)

    @staticmethod
    def concat(parts: list[Episodes], pad_id: int) -> Episodes:
        length = max(p.inputs.shape[1] for p in parts)
        parts = [p.pad_to(length, pad_id) for p in parts]
        names = ("inputs", "targets", "role", "support", "answer_item", "answer_query", "lengths")
        return Episodes(*(np.concatenate([getattr(p, n) for p in parts]) for n in names))


def partition_bits(episodes: Episodes) -> np.ndarray:
    """One bit per sequence from a hash of its tokens (inputs up to its length, and its answers): 0 for the
    train stream, 1 for test sets. A multiply-add hash over uint64 with fixed odd multipliers per position."""
    B, L = episodes.inputs.shape
    # position t's multipliers do not depend on L (a prefix of one stream), so padding changes no bit
    mx, my = (np.random.default_rng([_HASH_SEED, s]).integers(1, 2**63, size=L, dtype=np.uint64) | np.uint64(1)
              for s in (0, 1))
    valid = np.arange(L)[None, :] < episodes.lengths[:, None]
    x = np.where(valid, episodes.inputs + 1, 0).astype(np.uint64)
    y = np.where(episodes.targets >= 0, episodes.targets + 1, 0).astype(np.uint64)
    with np.errstate(over="ignore"):
        h = (x * mx[None]).sum(axis=1, dtype=np.uint64) + (y * my[None]).sum(axis=1, dtype=np.uint64)
        h ^= h >> np.uint64(29)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(32)
    return (h & np.uint64(1)).astype(np.int8)

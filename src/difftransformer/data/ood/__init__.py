"""Synthetic task families for out-of-distribution tests of attention (docs/evaluation.md, `ood`): seeded
generators (families.py), the generated batches with each position's role (episodes.py), and the stateless
train sampler and fixed test sets over them (sampler.py)."""

from .episodes import IGNORE, Episodes, partition_bits
from .families import (
    EOS_ID,
    FAMILIES,
    MQAR,
    PAD_ID,
    SPECIALS,
    TRAIN,
    Condition,
    Family,
    FlipFlop,
    Induction,
    MaxRetrieval,
    family_from_dict,
)

__all__ = [
    "EOS_ID", "FAMILIES", "IGNORE", "MQAR", "PAD_ID", "SPECIALS", "TRAIN", "Condition", "Episodes",
    "Family", "FlipFlop", "Induction", "MaxRetrieval", "family_from_dict", "partition_bits",
]

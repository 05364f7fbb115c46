"""Held-out text for evaluation, in the tokens of the model being evaluated: one place that reads it.

    split = heldout_split(cfg, tokenizer, "long-context")
    split.tokens      # documents of cfg.split, each followed by split.eos_id, in the MODEL's tokenizer
    split.settings()  # what identifies them in a result (corpus, tokenizer, split, re-tokenised or not)
    seq_len = window_length(model, cfg, "seq_len")              # cfg.seq_len or the context, checked
    windows = input_windows(split.tokens, seq_len, budget, cap)  # (n, seq_len) windows, in order

A prepared-data folder stores its splits as token ids of its own tokenizer. When the model was
trained with that tokenizer (the hashes agree) the stored ids are used as they are. When it was not
(another prepared corpus given with --data-dir, or a Hugging Face model with its own vocabulary)
every document is decoded with the folder's tokenizer and encoded with the model's, so a task never
feeds a model ids of a vocabulary it does not know, which would give numbers that look plausible
and mean nothing. Byte-level BPE decodes exactly, so the text is the same text in both cases.
The train split is never read (EvalConfig refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from difftransformer.data import PreparedData
from difftransformer.eval.task import EvalConfig


@dataclass
class HeldOutSplit:
    tokens: np.ndarray  # int64: documents in the model's tokenizer, each followed by eos_id
    eos_id: int  # the model tokenizer's document separator (the data's own, when not re-tokenised)
    data: PreparedData
    split: str
    retokenized: bool  # whether the documents were decoded and encoded again with the model's tokenizer

    def settings(self) -> dict[str, Any]:
        return {"data_dir": str(self.data.out_dir), "split": self.split, "corpus_hash": self.data.corpus_hash,
                "tokenizer_hash": self.data.tokenizer_hash, "retokenized": self.retokenized,
                "split_tokens": int(len(self.tokens))}


def heldout_split(cfg: EvalConfig, tokenizer, task: str) -> HeldOutSplit:
    """The documents of cfg.split of cfg.data_dir as token ids of `tokenizer` (None: the data's own).

    A missing data_dir is a ValueError naming EvalConfig.data_dir and --data-dir."""
    if cfg.data_dir is None:
        raise ValueError(f"{task} reads held-out text: set EvalConfig.data_dir (--data-dir) to a prepared-data "
                         f"folder (e.g. cache/data/sotu-8192)")
    data = PreparedData.load(cfg.data_dir)
    ds = data.dataset(cfg.split)
    own = getattr(tokenizer, "hash", None) if tokenizer is not None else data.tokenizer_hash
    if own == data.tokenizer_hash:
        return HeldOutSplit(np.asarray(ds.tokens, dtype=np.int64), int(ds.eos_id), data, cfg.split, False)
    texts = [data.tokenizer().decode(doc.tolist()) for doc in documents(np.asarray(ds.tokens), ds.eos_id)]
    eos = int(tokenizer.eos_id)
    ids: list[int] = []
    for text in texts:
        ids += [*tokenizer.encode(text), eos]
    return HeldOutSplit(np.asarray(ids, dtype=np.int64), eos, data, cfg.split, True)


def split_too_short(split: str, data_dir: Any, have: int, need: str) -> ValueError:
    """The error for a held-out split with too little text for a task: it names the split, what it has
    and what the task needs, and a fix the command line offers (an empty split was prepared with a
    fraction of 0: the other split, or preparing again, is the way out; lowering a length is not)."""
    other = "val" if split == "test" else "test"
    if have == 0:
        fix = (f"the data was prepared without a {split} split ({split}_fraction 0); evaluate the {other} split "
               f"(--split {other}) or prepare the data again with {split}_fraction > 0")
    else:
        fix = (f"evaluate the {other} split (--split {other}), prepare more held-out text, or (in Python) lower "
               f"EvalConfig.seq_len")
    return ValueError(f"the {split} split of {data_dir} has {have:,} tokens, fewer than {need}; {fix}")


def window_length(model, cfg: EvalConfig, name: str = "seq_len", length: int = 0) -> int:
    """The window a task reads: `length` if set, else cfg.seq_len, else the model's context
    (max_position_embeddings). Beyond the context it is a ValueError naming `name`: a model is never
    asked for positions it cannot represent."""
    context = model.config.max_position_embeddings
    length = length or cfg.seq_len or context
    if length > context:
        raise ValueError(f"{name} {length} is beyond the model's context of {context} tokens "
                         f"(max_position_embeddings); use {name} <= {context}")
    return length


def input_windows(tokens: np.ndarray, seq_len: int, budget: int, cap: int | None) -> np.ndarray:
    """(n, seq_len) int64 non-overlapping windows from the start of the split: window i is
    tokens[i * seq_len:(i + 1) * seq_len], the inputs of the trainer's validation window i
    (data.iter_eval_batches), for tasks that need no next-token target. n = ceil(budget / seq_len),
    fewer when the split (or `cap`) runs out."""
    n = min(-(-budget // seq_len), len(tokens) // seq_len, cap or len(tokens))
    return np.asarray(tokens[:n * seq_len], dtype=np.int64).reshape(n, seq_len)


def documents(tokens: np.ndarray, eos_id: int) -> list[np.ndarray]:
    """The documents of a token stream in which every document is followed by `eos_id` (views, in
    order, EOS excluded). A trailing piece without its EOS counts as a document too; empty ones do not."""
    ends = np.flatnonzero(np.asarray(tokens) == eos_id)
    starts = np.concatenate(([0], ends + 1))
    ends = np.concatenate((ends, [len(tokens)]))
    return [tokens[s:e] for s, e in zip(starts, ends) if e > s]

"""`long-context`: NLL by position in long held-out documents (paper Fig. 4) and the AR-hit / Others
loss slices (paper Table 6, after Zoology).

Protocol (docs/evaluation.md, "`long-context`"):
- Documents: the held-out split (cfg.split, "test" by default) of a prepared corpus, cut at the
  tokenizer's EOS id (every document is followed by EOS in the token file). Each document is scored
  from its start as in training, where the EOS before a document acts as its beginning: the model
  reads [EOS, d_1, ..., d_{L-1}] and is scored on d_1 .. d_L, so position t is the t-th token of the
  document, predicted from the t tokens before it (EOS included).
- The curve: the mean NLL at each position t over the documents, and its cumulative average
  (1/t) * sum_{s<=t} NLL_s, plotted against t on a log axis. Log-spaced buckets of positions
  [1, 1], [2, 3], [4, 7], ... (powers of two; the last cut at L) give the mean NLL over each range.
- AR hits: a scored token is an AR hit when its bigram (previous token, token) already occurred
  earlier in the same scored sequence (it could be predicted by recall); all other tokens are
  "Others". The EOS that starts the sequence counts as the previous token of d_1 (that bigram is
  always new). Reported: the mean NLL on each slice and its token count.

Choices where the paper is silent:
- Documents shorter than L tokens are SKIPPED, never concatenated: every position t then averages
  over the same documents, and position t is always a position inside one document (concatenating
  would put document starts, where the loss jumps, at arbitrary positions). A split with no
  document of L tokens is a one-line error naming its longest document.
- Only each document's first L tokens are scored (one sequence per document: "position" means
  position in the document), in the split's order; `documents` (and cfg.max_windows, each document
  being one window) caps how many, the first ones in order, so the choice needs no seed.
- L: the option `length`; 0 takes cfg.seq_len, else the model's max_position_embeddings. Beyond
  the model's context it is refused: a model is not asked for positions it cannot represent.
- `train_length` (0 = unknown) marks where the model's training length ends: the result gives the
  mean per-position NLL over positions 1..train_length and train_length+1..L (the latter only when
  train_length < L). Position t is inside the training length when t <= train_length (its input
  positions 0..t-1 were all seen in training).
- The AR-hit slices use the same documents and positions as the curve.

Black box: only `model(ids).logits` and `model.config.max_position_embeddings` are used. NLL is
computed by `eval/lm.token_nll` (fp32 or wider logits); the model reads exactly L tokens.
Scoring is batched (cfg.batch_size documents per forward) and summed as it goes: memory is one
batch's logits (B x L x vocab) plus O(L) running sums, whatever the number of documents.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from difftransformer.eval.heldout import HeldOutSplit, heldout_split, split_too_short, window_length
from difftransformer.eval.heldout import documents as split_documents
from difftransformer.eval.lm import token_nll
from difftransformer.eval.task import EvalConfig, Task, TaskResult, register_task


@dataclass
class LongContextOptions:
    length: int = field(default=0, metadata={
        "help": "scored tokens per document (positions 1..length); 0: EvalConfig.seq_len, else the model's context"})
    documents: int = field(default=0, metadata={
        "help": "how many documents to score (the first long-enough ones in split order); 0: all"})
    train_length: int = field(default=0, metadata={
        "help": "the model's training sequence length, marked on the curve (mean NLL before/after it); 0: unknown"})


def ar_hits(ids: torch.Tensor) -> torch.Tensor:
    """(B, N) token ids -> (B, N) bool: entry t is True when t >= 1 and the bigram (ids[t-1], ids[t])
    already occurred at (s-1, s) for some s < t in the same row (an associative-recall hit, Zoology).
    Entry 0 has no previous token and is never a hit."""
    ids = ids.long().cpu()
    B, N = ids.shape
    hits = torch.zeros(B, N, dtype=torch.bool)
    if N < 2:
        return hits
    vocab = int(ids.max()) + 1
    codes = ids[:, :-1] * vocab + ids[:, 1:]  # code j: the bigram that ends at position j + 1
    pos = torch.arange(N - 1)
    for b in range(B):
        uniq, inverse = torch.unique(codes[b], return_inverse=True)
        first = torch.full((len(uniq),), N, dtype=torch.long).scatter_reduce(0, inverse, pos, "amin")
        hits[b, 1:] = pos > first[inverse]
    return hits


def position_buckets(length: int) -> list[tuple[int, int]]:
    """Log-spaced, inclusive ranges of positions covering 1..length: [1,1], [2,3], [4,7], ... (last cut)."""
    out, lo = [], 1
    while lo <= length:
        out.append((lo, min(2 * lo - 1, length)))
        lo *= 2
    return out


@dataclass
class _Totals:
    """Running sums over the scored documents: memory O(L), whatever their number."""

    position_sum: torch.Tensor  # (L,) summed NLL at each position
    documents: int = 0
    hit_sum: float = 0.0
    hit_tokens: int = 0
    other_sum: float = 0.0
    other_tokens: int = 0

    def add(self, nll: torch.Tensor, hits: torch.Tensor) -> None:
        self.position_sum += nll.sum(0)
        self.documents += nll.shape[0]
        self.hit_sum += float(nll[hits].sum())
        self.hit_tokens += int(hits.sum())
        self.other_sum += float(nll[~hits].sum())
        self.other_tokens += int((~hits).sum())


@register_task
class LongContext(Task):
    name = "long-context"
    description = ("cumulative average NLL against position in long held-out documents (Fig. 4), and the loss on "
                   "AR-hit / other tokens (Table 6)")
    Options = LongContextOptions

    def check_options(self) -> None:
        for key in ("length", "documents", "train_length"):
            value = getattr(self.options, key)
            if value < 0:
                raise ValueError(f"long-context option {key} must be >= 0 (0 = automatic), got {value}")

    def run(self, model: torch.nn.Module, tokenizer, cfg: EvalConfig) -> TaskResult:
        split = heldout_split(cfg, tokenizer, self.name)
        length = window_length(model, cfg, "length", self.options.length)
        tokens = split.tokens
        docs = split_documents(tokens, split.eos_id)
        chosen = [i for i, d in enumerate(docs) if len(d) >= length]
        if not chosen:
            longest = max((len(d) for d in docs), default=0)
            if longest == 0:
                raise split_too_short(cfg.split, cfg.data_dir, len(tokens), f"one document of {length} tokens")
            raise ValueError(f"no document in the {cfg.split} split of {cfg.data_dir} has {length} tokens or more "
                             f"(the longest has {longest}; shorter documents are skipped); use --length {longest} "
                             f"or less")
        cap = min(self.options.documents or len(chosen), cfg.max_windows or len(chosen))
        long_enough, chosen = len(chosen), chosen[:cap]
        totals = _Totals(torch.zeros(length, dtype=torch.float64))
        for i in range(0, len(chosen), cfg.batch_size):
            seqs = np.stack([np.concatenate(([split.eos_id], docs[j][:length])) for j in chosen[i:i + cfg.batch_size]])
            seqs = torch.from_numpy(seqs.astype(np.int64))
            totals.add(token_nll(model, seqs.to(cfg.device)).double().cpu(), ar_hits(seqs)[:, 1:])
        counts = {"documents_in_split": len(docs), "documents_long_enough": long_enough}
        return self._result(totals, length, chosen, [len(docs[i]) for i in chosen], split, cfg, counts)

    def _result(self, totals: _Totals, length: int, chosen: list[int], doc_lengths: list[int],
                split: HeldOutSplit, cfg: EvalConfig, counts: dict[str, int]) -> TaskResult:
        per_position = totals.position_sum / totals.documents  # (L,)
        cumulative = per_position.cumsum(0) / torch.arange(1, length + 1, dtype=torch.float64)
        buckets = [{"first": lo, "last": hi, "nll": float(per_position[lo - 1:hi].mean())}
                   for lo, hi in position_buckets(length)]
        slices = {"ar_hit": {"loss": totals.hit_sum / totals.hit_tokens if totals.hit_tokens else None,
                             "tokens": totals.hit_tokens},
                  "others": {"loss": totals.other_sum / totals.other_tokens if totals.other_tokens else None,
                             "tokens": totals.other_tokens}}
        metrics: dict[str, float] = {"final_cumulative_nll": float(cumulative[-1])}
        metrics.update({f"nll_positions_{b['first']}_{b['last']}": b["nll"] for b in buckets})
        for key, s in slices.items():
            if s["loss"] is not None:
                metrics[f"{key}_loss"] = s["loss"]
        metrics["ar_hit_fraction"] = totals.hit_tokens / (totals.documents * length)
        train_length = self.options.train_length
        if train_length:
            metrics["nll_within_train_length"] = float(per_position[:train_length].mean())
            if train_length < length:
                metrics["nll_beyond_train_length"] = float(per_position[train_length:].mean())
        return TaskResult(
            task=self.name,
            metrics=metrics,
            settings={**split.settings(), "length": length, "documents": len(chosen),
                      "tokens": totals.documents * length, "train_length": train_length or None,
                      "short_documents": "skipped", **counts},
            details={"positions_nll": per_position.tolist(), "cumulative_nll": cumulative.tolist(),
                     "buckets": buckets, "slices": slices,
                     "documents": [{"index": i, "tokens": n} for i, n in zip(chosen, doc_lengths)]},
        )

    def plot(self, result: TaskResult, path: Path) -> bool:
        from matplotlib.figure import Figure

        cumulative = result.details["cumulative_nll"]
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        ax.plot(range(1, len(cumulative) + 1), cumulative, label="cumulative average NLL")
        train_length = result.settings.get("train_length")
        if train_length:
            ax.axvline(train_length, color="grey", linestyle="--", label=f"training length {train_length}")
        ax.set_xscale("log")
        ax.set_xlabel("position t (tokens)")
        ax.set_ylabel("average NLL of tokens 1..t (nats)")
        ax.set_title(f"{result.settings['documents']} documents, {result.settings['split']} split")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return True

"""The synthetic task families: where softmax attention is known to fail out of distribution.

Every family is a typed config (its settings, validated early) whose `generate(rng, n, condition)`
returns `n` sequences as `Episodes` (episodes.py). Token ids: 0 is EOS (every sequence starts with
it, as every document of the corpus pipeline does), 1 is PAD, the family's own tokens follow
(`vocab()` names them, for the tokenizer). A `Condition` moves a test set out of distribution:

    length   context length x factor, the number of items unchanged (more filler between them); flipflop,
             which has no filler, takes factor x as many instructions at the same odds instead, so its
             write-to-read distances hardly grow: its length test is one of positions, not of distance
    density  items x factor at the training context length (more distractors, less filler)

Families (docs/evaluation.md, "`ood`"):
- `mqar` (multi-query associative recall with noise; Zoology's MQAR with filler): N key-value pairs
  (keys of `key_len`, values of `value_len` tokens) at random places among filler tokens, then `|`
  and min(queries, N) queries "key value" asking distinct keys of the context; the loss is on the
  value tokens. With queries >= N every pair is asked and the last answer follows by elimination (the
  value no earlier query took), a shortcut small models learn instead of the lookup: keep queries < min_pairs.
- `flipflop` (Liu et al. 2023): instruction-bit pairs, "w b" writes b, "i b" is ignored, "r b" reads:
  b must be the last written bit. The first instruction writes and the last reads (every sequence
  asks at least once). Loss on read bits. Density scales
  the odds of an ignore (more distractor bits between a write and its read).
- `induction` (with distractors; Bietti et al. 2023): background tokens from a fixed random bigram
  chain; trigger tokens, each followed by its own successor drawn per sequence, occur several times;
  the loss is on the successor after every occurrence but the first (readable from an earlier one).
- `maxret` (max retrieval, the dispersion test of Veličković et al. 2024): N items "key value" with
  distinct keys from an ordered alphabet among filler, then `max`: the answer is the value of the
  largest key.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from difftransformer._config import check_field_types, did_you_mean

from .episodes import BOS, FILLER, IGNORE, ITEM, PAD, QUERY, Episodes

EOS_ID, PAD_ID = 0, 1
SPECIALS = ("<|endoftext|>", "<pad>")  # ids 0 and 1 of every family's vocabulary
_SPACE = "\u2581"  # the word-start mark of the task tokenizers (a space in text)


@dataclass(frozen=True)
class Condition:
    """How far a test set is from the training distribution: context length and item count factors."""

    length: float = 1.0
    density: float = 1.0

    def __post_init__(self) -> None:
        for name in ("length", "density"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value <= 1024):
                raise ValueError(f"a test condition's {name} factor must be a number in (0, 1024], got {value!r}")

    @property
    def name(self) -> str:
        return f"length{self.length:g}x-density{self.density:g}x"


TRAIN = Condition()


def _scaled(value: int, factor: float) -> int:
    """A count times a condition's factor, halves rounded up (1.5x of 3 items is 5, of 5 is 8), at least 1."""
    return max(1, math.floor(value * factor + 0.5))


def _episodes(full: np.ndarray, role: np.ndarray, support: np.ndarray, answer_item: np.ndarray,
              answer_query: np.ndarray, total: np.ndarray) -> Episodes:
    """Episodes from whole sequences (B, L) of `total` tokens each (answer_item/answer_query given on the
    answer tokens themselves): inputs drop the last token, targets the first, so position t's target is token t + 1."""
    length = int(total.max()) - 1
    valid = np.arange(length)[None] < (total - 1)[:, None]
    inputs = np.where(valid, full[:, :length], PAD_ID)
    is_answer = answer_item[:, 1:length + 1] >= 0
    return Episodes(inputs.astype(np.int64), np.where(is_answer, full[:, 1:length + 1], IGNORE).astype(np.int64),
                    np.where(valid, role[:, :length], PAD).astype(np.int8),
                    np.where(valid, support[:, :length], -1).astype(np.int32), answer_item[:, 1:length + 1].copy(),
                    answer_query[:, 1:length + 1].copy(), (total - 1).astype(np.int64))


def _distinct(rng: np.random.Generator, rows: int, pool: int, k: int) -> np.ndarray:
    """(rows, k): k distinct draws from range(pool) per row."""
    return rng.random((rows, pool)).argsort(axis=1)[:, :k]


@dataclass
class _Tail:
    """QUERY tokens after the context: tokens (B, T), the item and query number of each answer token (-1
    elsewhere), how many of the T each row has, and the separator before them (None: no separator)."""

    tokens: np.ndarray
    item: np.ndarray
    query: np.ndarray
    length: np.ndarray
    sep: int | None = None


def _items_among_filler(rng: np.random.Generator, contexts: np.ndarray, counts: np.ndarray, items: np.ndarray,
                        filler: np.ndarray, tail: _Tail | None = None, groups: np.ndarray | None = None,
                        item_answers: tuple[np.ndarray, np.ndarray] | None = None) -> Episodes:
    """B sequences [EOS][context][sep][tail], all rows at once. Row b's context has contexts[b] tokens:
    its first counts[b] items (items (B, N, w) token ids) at uniform random places among filler tokens
    (filler (B, >= max context)), item j with support groups[b, j] (default j). item_answers: (item, query)
    arrays (B, N, w) for answers inside the context (-1 where a token answers nothing)."""
    B, N, w = items.shape
    j = np.arange(N)[None]
    real = j < counts[:, None]
    free = contexts - counts * w
    big = int(contexts.max()) + 1  # sorts after every real gap; its rows are never used
    gaps = np.where(real, (rng.random((B, N)) * (free + 1)[:, None]).astype(np.int64), big)
    starts = np.sort(gaps, axis=1) + w * j
    C = int(contexts.max())
    T = 0 if tail is None else tail.tokens.shape[1]
    has_sep = int(tail is not None and tail.sep is not None)
    L = 1 + C + has_sep + T
    full = np.full((B, L), PAD_ID, np.int64)
    role = np.full((B, L), PAD, np.int8)
    support = np.full((B, L), -1, np.int32)
    answer_item = np.full((B, L), -1, np.int32)
    answer_query = np.full((B, L), -1, np.int32)
    full[:, 0], role[:, 0] = EOS_ID, BOS
    in_context = np.arange(C)[None] < contexts[:, None]
    full[:, 1:1 + C] = np.where(in_context, filler[:, :C], PAD_ID)
    role[:, 1:1 + C] = np.where(in_context, FILLER, PAD)
    b, jj = np.nonzero(real)
    cols = 1 + starts[b, jj][:, None] + np.arange(w)[None]
    full[b[:, None], cols] = items[b, jj]
    role[b[:, None], cols] = ITEM
    support[b[:, None], cols] = (jj if groups is None else groups[b, jj])[:, None]
    if item_answers is not None:
        answer_item[b[:, None], cols], answer_query[b[:, None], cols] = (a[b, jj] for a in item_answers)
    total = 1 + contexts
    if tail is not None:
        rows = np.arange(B)
        if has_sep:
            full[rows, total], role[rows, total] = tail.sep, QUERY
        b, t = np.nonzero(np.arange(T)[None] < tail.length[:, None])
        cols = total[b] + has_sep + t
        full[b, cols], role[b, cols] = tail.tokens[b, t], QUERY
        answer_item[b, cols], answer_query[b, cols] = tail.item[b, t], tail.query[b, t]
        total = total + has_sep + tail.length
    return _episodes(full, role, support, answer_item, answer_query, total)


class Family:
    """What every family config provides (see the module doc)."""

    name: ClassVar[str]

    def vocab(self) -> list[str]:
        raise NotImplementedError

    def generate(self, rng: np.random.Generator, n: int, condition: Condition = TRAIN) -> Episodes:
        """n sequences under `condition`, all drawn at once from `rng` (vectorised over the batch)."""
        raise NotImplementedError

    def max_length(self, condition: Condition = TRAIN) -> int:
        """The most tokens a model reads for one sequence under `condition` (inputs, not counting the last
        answer token): the position limit a test needs."""
        raise NotImplementedError

    def check_condition(self, condition: Condition) -> None:
        """ValueError when the family cannot make sequences under `condition` (too many items for the
        keys or the context); the generator would otherwise fail mid-way."""

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.vocab())

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.name, **dataclasses.asdict(self)}

    def fingerprint(self) -> str:
        """sha256 of the settings: the identity of the task's data (its prepared folder, its checkpoints)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def tokenizer(self):
        """A word-level tokenizer of SPECIALS + vocab(): ids as `generate` writes them. Text is the words
        separated by spaces ("w 1 i 0 r"); a word decodes with its leading space (" 1"), as byte-level BPE
        tokens do, so a continuation decoded alone appends to its prompt."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        from ..tokenizer import Tokenizer

        words = [*SPECIALS, *(_SPACE + w for w in self.vocab())]
        inner = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=SPECIALS[1]))
        inner.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="always")
        inner.decoder = decoders.Metaspace(replacement=_SPACE, prepend_scheme="never")
        inner.add_special_tokens(list(SPECIALS))
        return Tokenizer(inner, SPECIALS[0])


def _check_positive(config, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(config, name) < 1:
            raise ValueError(f"data.task.{name} must be >= 1, got {getattr(config, name)}")


def _check_range(owner: str, lo_name: str, hi_name: str, lo: int, hi: int, least: int = 1) -> None:
    if lo < least or hi < lo:
        raise ValueError(f"{owner}: need {least} <= {lo_name} <= {hi_name}, got {lo_name}={lo}, {hi_name}={hi}")


@dataclass(frozen=True)
class MQAR(Family):
    """Multi-query associative recall among filler (see the module doc)."""

    name: ClassVar[str] = "mqar"
    num_keys: int = 64
    num_values: int = 64
    key_len: int = 1
    value_len: int = 1
    min_pairs: int = 8
    max_pairs: int = 8
    queries: int = 4
    filler_vocab: int = 16
    min_context: int = 48
    max_context: int = 80

    def __post_init__(self) -> None:
        check_field_types(self, "data.task")
        _check_positive(self, ("num_keys", "num_values", "key_len", "value_len", "queries", "filler_vocab"))
        _check_range("data.task (mqar)", "min_pairs", "max_pairs", self.min_pairs, self.max_pairs)
        _check_range("data.task (mqar)", "min_context", "max_context", self.min_context, self.max_context)
        self.check_condition(TRAIN)

    @property
    def width(self) -> int:
        return self.key_len + self.value_len

    def _pairs_range(self, condition: Condition) -> tuple[int, int]:
        return _scaled(self.min_pairs, condition.density), _scaled(self.max_pairs, condition.density)

    def check_condition(self, condition: Condition) -> None:
        lo, hi = self._pairs_range(condition)
        if hi > self.num_keys ** self.key_len:
            raise ValueError(f"{hi} pairs need as many distinct keys, but num_keys ** key_len = "
                             f"{self.num_keys ** self.key_len}; raise data.task.num_keys or lower the density")
        if hi * self.width > _scaled(self.min_context, condition.length):
            raise ValueError(f"{hi} pairs of {self.width} tokens do not fit a context of "
                             f"{_scaled(self.min_context, condition.length)} tokens; raise data.task.min_context "
                             f"or lower max_pairs / the density")

    def vocab(self) -> list[str]:
        return ([f"k{i}" for i in range(self.num_keys)] + [f"v{i}" for i in range(self.num_values)]
                + [f"f{i}" for i in range(self.filler_vocab)] + ["|"])

    def ids(self) -> dict[str, int]:
        base = len(SPECIALS)
        return {"key": base, "value": base + self.num_keys, "filler": base + self.num_keys + self.num_values,
                "sep": base + self.num_keys + self.num_values + self.filler_vocab}

    def max_length(self, condition: Condition = TRAIN) -> int:
        return 1 + _scaled(self.max_context, condition.length) + 1 + self.queries * self.width - 1

    def generate(self, rng: np.random.Generator, n: int, condition: Condition = TRAIN) -> Episodes:
        ids = self.ids()
        lo, hi = self._pairs_range(condition)
        counts = rng.integers(lo, hi + 1, size=n)
        clo, chi = _scaled(self.min_context, condition.length), _scaled(self.max_context, condition.length)
        contexts = rng.integers(clo, chi + 1, size=n)
        codes = _distinct(rng, n, self.num_keys ** self.key_len, hi)  # (n, hi): distinct keys per sequence
        keys = (codes[..., None] // self.num_keys ** np.arange(self.key_len)) % self.num_keys + ids["key"]
        values = rng.integers(0, self.num_values, size=(n, hi, self.value_len)) + ids["value"]
        items = np.concatenate([keys, values], axis=2)
        filler = rng.integers(0, self.filler_vocab, size=(n, chi)) + ids["filler"]
        # the queries: min(queries, count) distinct items of each sequence, in random order
        q_max = min(self.queries, hi)
        asked = np.where(np.arange(hi)[None] < counts[:, None], rng.random((n, hi)), np.inf).argsort(1)[:, :q_max]
        w, kl = self.width, self.key_len
        tail = np.take_along_axis(items, asked[..., None], axis=1).reshape(n, q_max * w)
        is_value = np.tile(np.arange(w) >= kl, q_max)[None]
        tail_item = np.where(is_value, np.repeat(asked, w, axis=1), -1)
        tail_query = np.where(is_value, np.repeat(np.arange(q_max)[None], n, 0).repeat(w, axis=1), -1)
        tail_len = np.minimum(self.queries, counts) * w
        return _items_among_filler(rng, contexts, counts, items, filler,
                                   _Tail(tail, tail_item, tail_query, tail_len, ids["sep"]))


@dataclass(frozen=True)
class FlipFlop(Family):
    """The flip-flop language (see the module doc); lengths count instruction-bit pairs."""

    name: ClassVar[str] = "flipflop"
    min_instructions: int = 16
    max_instructions: int = 32
    p_ignore: float = 0.8

    def __post_init__(self) -> None:
        check_field_types(self, "data.task")
        _check_range("data.task (flipflop)", "min_instructions", "max_instructions", self.min_instructions,
                     self.max_instructions, 2)
        if not 0 <= self.p_ignore < 1:
            raise ValueError(f"data.task.p_ignore must lie in [0, 1), got {self.p_ignore}")

    def vocab(self) -> list[str]:
        return ["w", "i", "r", "0", "1"]

    def p_ignore_at(self, condition: Condition) -> float:
        """The ignore probability whose odds are `condition.density` times the training odds."""
        odds = self.p_ignore / (1 - self.p_ignore) * condition.density
        return odds / (1 + odds)

    def max_length(self, condition: Condition = TRAIN) -> int:
        return 1 + 2 * _scaled(self.max_instructions, condition.length) - 1

    def generate(self, rng: np.random.Generator, n: int, condition: Condition = TRAIN) -> Episodes:
        W, IGN, R, B0 = 2, 3, 4, 5  # ids of w, i, r, 0 (1 is B0 + 1)
        lo, hi = _scaled(self.min_instructions, condition.length), _scaled(self.max_instructions, condition.length)
        counts = rng.integers(lo, hi + 1, size=n)
        p_i = self.p_ignore_at(condition)
        u = rng.random((n, hi))
        instr = np.where(u < p_i, IGN, np.where(u < p_i + (1 - p_i) / 2, W, R))
        idx = np.arange(hi)[None]
        instr[:, 0] = W
        instr[np.arange(n), counts - 1] = R  # every sequence asks at least once
        real = idx < counts[:, None]
        last_write = np.maximum.accumulate(np.where(instr == W, idx, 0), axis=1)
        is_read = (instr == R) & real
        bits = rng.integers(0, 2, size=(n, hi))
        bits = np.where(is_read, np.take_along_axis(bits, last_write, axis=1), bits)
        L = 1 + 2 * hi
        full = np.full((n, L), PAD_ID, np.int64)
        role = np.full((n, L), PAD, np.int8)
        support = np.full((n, L), -1, np.int32)
        answer_item = np.full((n, L), -1, np.int32)
        answer_query = np.full((n, L), -1, np.int32)
        full[:, 0], role[:, 0] = EOS_ID, BOS
        full[:, 1::2] = np.where(real, instr, PAD_ID)
        full[:, 2::2] = np.where(real, B0 + bits, PAD_ID)
        item_role = np.where(real, np.where(is_read, QUERY, ITEM), PAD)
        role[:, 1::2] = role[:, 2::2] = item_role
        support[:, 1::2] = support[:, 2::2] = np.where(real & ~is_read, idx, -1)
        answer_item[:, 2::2] = np.where(is_read, last_write, -1)
        answer_query[:, 2::2] = np.where(is_read, np.cumsum(is_read, axis=1) - 1, -1)
        return _episodes(full, role, support, answer_item, answer_query, 1 + 2 * counts)


@dataclass(frozen=True)
class Induction(Family):
    """Induction heads among a bigram background (see the module doc)."""

    name: ClassVar[str] = "induction"
    background_vocab: int = 64
    trigger_vocab: int = 16
    triggers: int = 2
    min_occurrences: int = 2
    max_occurrences: int = 4
    min_context: int = 48
    max_context: int = 80
    chain_seed: int = 0
    chain_concentration: float = 0.3

    def __post_init__(self) -> None:
        check_field_types(self, "data.task")
        _check_positive(self, ("background_vocab", "trigger_vocab", "triggers"))
        _check_range("data.task (induction)", "min_occurrences", "max_occurrences", self.min_occurrences,
                     self.max_occurrences, 2)
        _check_range("data.task (induction)", "min_context", "max_context", self.min_context, self.max_context)
        if self.chain_concentration <= 0 or self.chain_seed < 0:
            raise ValueError("data.task.chain_concentration must be > 0 and chain_seed >= 0")
        self.check_condition(TRAIN)

    def check_condition(self, condition: Condition) -> None:
        k = _scaled(self.triggers, condition.density)
        if k > self.trigger_vocab:
            raise ValueError(f"{k} triggers per sequence need as many trigger tokens; data.task.trigger_vocab is "
                             f"{self.trigger_vocab}")
        if 2 * k * self.max_occurrences > _scaled(self.min_context, condition.length):
            raise ValueError(f"{k} triggers x {self.max_occurrences} occurrences x 2 tokens do not fit a context "
                             f"of {_scaled(self.min_context, condition.length)}; raise data.task.min_context")

    def vocab(self) -> list[str]:
        return [f"b{i}" for i in range(self.background_vocab)] + [f"t{i}" for i in range(self.trigger_vocab)]

    def transitions(self) -> np.ndarray:
        """The fixed bigram chain of the background (rows: cumulative next-token probabilities)."""
        rng = np.random.default_rng([self.chain_seed, 0xB16])
        probs = rng.dirichlet(np.full(self.background_vocab, self.chain_concentration), size=self.background_vocab)
        return np.cumsum(probs, axis=1)

    def max_length(self, condition: Condition = TRAIN) -> int:
        return 1 + _scaled(self.max_context, condition.length) - 1

    @functools.cached_property
    def _chain(self) -> np.ndarray:
        return self.transitions()

    def generate(self, rng: np.random.Generator, n: int, condition: Condition = TRAIN) -> Episodes:
        base = len(SPECIALS)
        k = _scaled(self.triggers, condition.density)
        clo, chi = _scaled(self.min_context, condition.length), _scaled(self.max_context, condition.length)
        contexts = rng.integers(clo, chi + 1, size=n)
        background = self._background(rng, n, chi) + base
        trig = _distinct(rng, n, self.trigger_vocab, k)  # (n, k): each sequence's triggers
        succ = rng.integers(0, self.background_vocab, size=(n, k))
        occ = rng.integers(self.min_occurrences, self.max_occurrences + 1, size=(n, k))
        # each sequence's occurrences in random order: group g repeated occ[b, g] times, then padding
        slots = np.repeat(np.arange(k), self.max_occurrences)[None].repeat(n, 0)  # (n, k * max_occ)
        taken = np.tile(np.arange(self.max_occurrences), k)[None] < occ.repeat(self.max_occurrences, axis=1)
        order = np.take_along_axis(slots, np.where(taken, rng.random(slots.shape), np.inf).argsort(1), axis=1)
        counts = occ.sum(1)
        rows = np.arange(n)[:, None]
        items = np.stack([base + self.background_vocab + trig[rows, order], base + succ[rows, order]], axis=2)
        # every occurrence but a trigger's first is asked, on its successor token
        j = np.arange(order.shape[1])[None]
        first = np.full((n, k), order.shape[1])
        np.minimum.at(first, (np.broadcast_to(rows, order.shape), order), np.broadcast_to(j, order.shape))
        asked = (j < counts[:, None]) & (j != first[rows, order])
        query = np.cumsum(asked, axis=1) - 1
        item_answers = tuple(np.stack([np.full_like(a, -1), np.where(asked, a, -1)], axis=2).astype(np.int32)
                             for a in (order, query))
        return _items_among_filler(rng, contexts, counts, items, background, groups=order,
                                   item_answers=item_answers)

    def _background(self, rng: np.random.Generator, n: int, length: int) -> np.ndarray:
        """n sequences of the bigram chain (the chain steps once per position for all rows)."""
        cum = self._chain
        out = np.empty((n, length), np.int64)
        out[:, 0] = rng.integers(self.background_vocab, size=n)
        draws = rng.random((n, length))
        for t in range(1, length):
            out[:, t] = np.minimum((cum[out[:, t - 1]] < draws[:, t, None]).sum(axis=1), self.background_vocab - 1)
        return out


@dataclass(frozen=True)
class MaxRetrieval(Family):
    """Max retrieval among filler (see the module doc)."""

    name: ClassVar[str] = "maxret"
    num_keys: int = 64
    num_values: int = 16
    min_items: int = 4
    max_items: int = 8
    filler_vocab: int = 16
    min_context: int = 32
    max_context: int = 48

    def __post_init__(self) -> None:
        check_field_types(self, "data.task")
        _check_positive(self, ("num_keys", "num_values", "filler_vocab"))
        _check_range("data.task (maxret)", "min_items", "max_items", self.min_items, self.max_items)
        _check_range("data.task (maxret)", "min_context", "max_context", self.min_context, self.max_context)
        self.check_condition(TRAIN)

    def check_condition(self, condition: Condition) -> None:
        hi = _scaled(self.max_items, condition.density)
        if hi > self.num_keys:
            raise ValueError(f"{hi} items need as many distinct keys; data.task.num_keys is {self.num_keys}")
        if 2 * hi > _scaled(self.min_context, condition.length):
            raise ValueError(f"{hi} items of 2 tokens do not fit a context of "
                             f"{_scaled(self.min_context, condition.length)}; raise data.task.min_context")

    def vocab(self) -> list[str]:
        return ([f"k{i}" for i in range(self.num_keys)] + [f"v{i}" for i in range(self.num_values)]
                + [f"f{i}" for i in range(self.filler_vocab)] + ["max"])

    def max_length(self, condition: Condition = TRAIN) -> int:
        return 1 + _scaled(self.max_context, condition.length) + 1

    def generate(self, rng: np.random.Generator, n: int, condition: Condition = TRAIN) -> Episodes:
        base = len(SPECIALS)
        kb, vb, fb = base, base + self.num_keys, base + self.num_keys + self.num_values
        lo, hi = _scaled(self.min_items, condition.density), _scaled(self.max_items, condition.density)
        counts = rng.integers(lo, hi + 1, size=n)
        clo, chi = _scaled(self.min_context, condition.length), _scaled(self.max_context, condition.length)
        contexts = rng.integers(clo, chi + 1, size=n)
        keys = _distinct(rng, n, self.num_keys, hi)
        values = rng.integers(0, self.num_values, size=(n, hi))
        items = np.stack([kb + keys, vb + values], axis=2)
        best = np.where(np.arange(hi)[None] < counts[:, None], keys, -1).argmax(axis=1)
        filler = rng.integers(0, self.filler_vocab, size=(n, chi)) + fb
        tail = (vb + values[np.arange(n), best])[:, None]
        return _items_among_filler(rng, contexts, counts, items, filler,
                                   _Tail(tail, best[:, None], np.zeros((n, 1), np.int32), np.ones(n, np.int64),
                                         fb + self.filler_vocab))


FAMILIES: dict[str, type[Family]] = {f.name: f for f in (MQAR, FlipFlop, Induction, MaxRetrieval)}


def family_from_dict(values: dict[str, Any], owner: str = "data.task") -> Family:
    """A family config from a table {"family": name, settings...}; unknown names and keys suggest the nearest."""
    if not isinstance(values, dict):
        raise ValueError(f"{owner} must be a table with a 'family' ({', '.join(FAMILIES)}) and its settings, "
                         f"got {values!r}")
    values = dict(values)
    name = values.pop("family", None)
    cls = FAMILIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"{owner}.family must be one of {', '.join(FAMILIES)}, got {name!r}"
                         f"{did_you_mean(name, FAMILIES)}")
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in valid:
            raise ValueError(f"unknown key {key!r} in {owner} for family {name!r}{did_you_mean(key, valid)}; "
                             f"valid: {', '.join(valid)}")
    return cls(**values)

"""The synthetic task families: where softmax attention is known to fail out of distribution.

Every family is a typed config (its settings, validated early) whose `generate(rng, n, condition)`
returns `n` sequences as `Episodes` (episodes.py). Token ids: 0 is EOS (every sequence starts with
it, as every document of the corpus pipeline does), 1 is PAD, the family's own tokens follow
(`vocab()` names them, for the tokenizer). A `Condition` moves a test set out of distribution:

    length   context length x factor, the number of items unchanged (more filler between them)
    density  items x factor at the training context length (more distractors, less filler)

Families (docs/evaluation.md, "Out-of-distribution retrieval"):
- `mqar` (multi-query associative recall with noise; Zoology's MQAR with filler): N key-value pairs
  (keys of `key_len`, values of `value_len` tokens) at random places among filler tokens, then `|`
  and min(queries, N) queries "key value" asking distinct keys of the context; the loss is on the
  value tokens.
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
import difflib
import functools
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from difftransformer._config import check_field_types

from .episodes import BOS, FILLER, ITEM, QUERY, Builder, Episodes

EOS_ID, PAD_ID = 0, 1
SPECIALS = ("<|endoftext|>", "<pad>")  # ids 0 and 1 of every family's vocabulary


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
    return max(1, int(round(value * factor)))


def _place(rng: np.random.Generator, context: int, widths: np.ndarray) -> np.ndarray:
    """Start offsets of items of the given widths, in their order, at uniform random places among
    `context - sum(widths)` filler tokens (a uniform random interleaving)."""
    free = context - int(widths.sum())
    gaps = np.sort(rng.integers(0, free + 1, size=len(widths)))
    return gaps + np.concatenate([[0], np.cumsum(widths)[:-1]])


def _lay_out(rng: np.random.Generator, context: int, items: list[np.ndarray], filler: np.ndarray):
    """(tokens, role, support) of a context of `context` tokens: the items (arrays of token ids, item j
    gets support j) placed in order at random among `filler` tokens."""
    widths = np.array([len(x) for x in items])
    starts = _place(rng, context, widths)
    tokens = filler[:context].copy()
    role = np.full(context, FILLER, np.int8)
    support = np.full(context, -1, np.int32)
    for j, (start, item) in enumerate(zip(starts, items)):
        tokens[start:start + len(item)] = item
        role[start:start + len(item)] = ITEM
        support[start:start + len(item)] = j
    return tokens, role, support, starts


def _row(*parts: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]):
    """Concatenate (tokens, role, support, answer_item, answer_query) pieces into one sequence."""
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(5))


def _plain(tokens: np.ndarray, role: int | np.ndarray, support=None):
    n = len(tokens)
    return (np.asarray(tokens, np.int64), np.broadcast_to(np.asarray(role, np.int8), (n,)).copy(),
            np.full(n, -1, np.int32) if support is None else support, np.full(n, -1, np.int32),
            np.full(n, -1, np.int32))


_BOS = (np.array([EOS_ID], np.int64), np.array([BOS], np.int8), np.array([-1], np.int32),
        np.array([-1], np.int32), np.array([-1], np.int32))


class Family:
    """What every family config provides (see the module doc)."""

    name: ClassVar[str]

    def vocab(self) -> list[str]:
        raise NotImplementedError

    def generate(self, rng: np.random.Generator, n: int, condition: Condition = TRAIN) -> Episodes:
        builder = Builder(PAD_ID)
        for _ in range(n):
            builder.add(*self._sequence(rng, condition))
        return builder.build()

    def _sequence(self, rng: np.random.Generator, condition: Condition):
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
        """A word-level tokenizer of SPECIALS + vocab(): ids as `generate` writes them, text as "k3 v7 ..."."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        from ..tokenizer import Tokenizer

        words = [*SPECIALS, *self.vocab()]
        inner = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=SPECIALS[1]))
        inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        inner.decoder = decoders.WordPiece(prefix="\u0000")  # joins words with spaces, strips nothing
        inner.add_special_tokens(list(SPECIALS))
        return Tokenizer(inner, SPECIALS[0])


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
        for name in ("num_keys", "num_values", "key_len", "value_len", "queries", "filler_vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.task.{name} must be >= 1, got {getattr(self, name)}")
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

    def _sequence(self, rng: np.random.Generator, condition: Condition):
        ids = self.ids()
        lo, hi = self._pairs_range(condition)
        n = int(rng.integers(lo, hi + 1))
        context = int(rng.integers(_scaled(self.min_context, condition.length),
                                   _scaled(self.max_context, condition.length) + 1))
        codes = rng.choice(self.num_keys ** self.key_len, size=n, replace=False)
        keys = np.stack([(codes // self.num_keys ** p) % self.num_keys for p in range(self.key_len)], 1)
        keys = keys + ids["key"]
        values = rng.integers(0, self.num_values, size=(n, self.value_len)) + ids["value"]
        pairs = [np.concatenate([k, v]) for k, v in zip(keys, values)]
        filler = rng.integers(0, self.filler_vocab, size=context) + ids["filler"]
        tokens, role, support, _ = _lay_out(rng, context, pairs, filler)
        asked = rng.choice(n, size=min(self.queries, n), replace=False)
        queries = []
        for q, j in enumerate(asked):
            key_part = _plain(keys[j], QUERY)
            value_part = _plain(values[j], QUERY)
            value_part[3][:] = j
            value_part[4][:] = q
            queries += [key_part, value_part]
        return _row(_BOS, _plain(tokens, role, support), _plain(np.array([ids["sep"]]), QUERY), *queries)


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

    def _sequence(self, rng: np.random.Generator, condition: Condition):
        W, I, R, B0 = 2, 3, 4, 5  # ids of w, i, r, 0 (1 is B0 + 1)
        n = int(rng.integers(_scaled(self.min_instructions, condition.length),
                             _scaled(self.max_instructions, condition.length) + 1))
        p_i = self.p_ignore_at(condition)
        instr = rng.choice(np.array([W, I, R]), size=n, p=[(1 - p_i) / 2, p_i, (1 - p_i) / 2])
        instr[0], instr[-1] = W, R  # every sequence asks at least once
        bits = rng.integers(0, 2, size=n)
        idx = np.arange(n)
        last_write = np.maximum.accumulate(np.where(instr == W, idx, 0))
        is_read = instr == R
        bits = np.where(is_read, bits[last_write], bits)
        tokens = np.stack([instr, bits + B0], 1).reshape(-1)
        role = np.repeat(np.where(is_read, QUERY, ITEM), 2).astype(np.int8)
        support = np.repeat(np.where(is_read, -1, idx), 2).astype(np.int32)
        answer_item = np.full(2 * n, -1, np.int32)
        answer_query = np.full(2 * n, -1, np.int32)
        answer_item[1::2] = np.where(is_read, last_write, -1)
        answer_query[1::2] = np.where(is_read, np.cumsum(is_read) - 1, -1)
        return _row(_BOS, (tokens.astype(np.int64), role, support, answer_item, answer_query))


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
        for name in ("background_vocab", "trigger_vocab", "triggers"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.task.{name} must be >= 1, got {getattr(self, name)}")
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
        """As every family's, with the n backgrounds drawn together (the chain steps once per position for
        all rows, not once per position and row)."""
        longest = _scaled(self.max_context, condition.length)
        cum = self._chain
        background = np.empty((n, longest), np.int64)
        background[:, 0] = rng.integers(self.background_vocab, size=n)
        draws = rng.random((n, longest))
        for t in range(1, longest):
            nxt = (cum[background[:, t - 1]] < draws[:, t, None]).sum(axis=1)
            background[:, t] = np.minimum(nxt, self.background_vocab - 1)
        builder = Builder(PAD_ID)
        for row in background:
            builder.add(*self._sequence(rng, condition, row))
        return builder.build()

    def _sequence(self, rng: np.random.Generator, condition: Condition, background: np.ndarray):
        base = len(SPECIALS)
        k = _scaled(self.triggers, condition.density)
        context = int(rng.integers(_scaled(self.min_context, condition.length),
                                   _scaled(self.max_context, condition.length) + 1))
        trig = rng.choice(self.trigger_vocab, size=k, replace=False)
        succ = rng.integers(0, self.background_vocab, size=k)
        occ = rng.integers(self.min_occurrences, self.max_occurrences + 1, size=k)
        order = rng.permutation(np.repeat(np.arange(k), occ))
        items = [np.array([base + self.background_vocab + trig[g], base + succ[g]]) for g in order]
        tokens, role, support, starts = _lay_out(rng, context, items, background[:context] + base)
        group = np.where(support >= 0, order[np.maximum(support, 0)], -1).astype(np.int32)
        # every occurrence but a trigger's first is asked: its successor is readable from an earlier one
        asked = np.ones(len(order), bool)
        asked[np.unique(order, return_index=True)[1]] = False
        answer_item = np.full(context, -1, np.int32)
        answer_query = np.full(context, -1, np.int32)
        answer_item[starts[asked] + 1] = order[asked]
        answer_query[starts[asked] + 1] = np.arange(int(asked.sum()))
        return _row(_BOS, (tokens, role, group, answer_item, answer_query))


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
        for name in ("num_keys", "num_values", "filler_vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.task.{name} must be >= 1, got {getattr(self, name)}")
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

    def _sequence(self, rng: np.random.Generator, condition: Condition):
        base = len(SPECIALS)
        kb, vb, fb = base, base + self.num_keys, base + self.num_keys + self.num_values
        n = int(rng.integers(_scaled(self.min_items, condition.density), _scaled(self.max_items, condition.density) + 1))
        context = int(rng.integers(_scaled(self.min_context, condition.length),
                                   _scaled(self.max_context, condition.length) + 1))
        keys = rng.choice(self.num_keys, size=n, replace=False)
        values = rng.integers(0, self.num_values, size=n)
        items = [np.array([kb + k, vb + v]) for k, v in zip(keys, values)]
        filler = rng.integers(0, self.filler_vocab, size=context) + fb
        tokens, role, support, _ = _lay_out(rng, context, items, filler)
        best = int(np.argmax(keys))
        answer = _plain(np.array([vb + values[best]]), QUERY)
        answer[3][:], answer[4][:] = best, 0
        return _row(_BOS, _plain(tokens, role, support), _plain(np.array([fb + self.filler_vocab]), QUERY), answer)


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
        close = difflib.get_close_matches(str(name), list(FAMILIES), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{owner}.family must be one of {', '.join(FAMILIES)}, got {name!r}{hint}")
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown key {key!r} in {owner} for family {name!r}{hint}; valid: {', '.join(valid)}")
    return cls(**values)


def geometric(lo: float, hi: float) -> list[float]:
    """Factors lo, 2 lo, 4 lo, ... up to hi (the conditions of a test grid)."""
    return [lo * 2 ** i for i in range(int(math.log2(hi / lo) + 1e-9) + 1)]

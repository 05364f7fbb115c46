"""Seeded synthetic prompts shared by evaluation tasks (and training mixtures): city -> magic-number needles.

One needle is the sentence " The special magic {city} number is: {number}." (the template of the
paper authors' group; LWM's 7-digit numbers by default). `needle_prompt` builds one multi-needle
retrieval prompt AT TOKEN LEVEL, so every offset is exact:

    [EOS] instruction | context: haystack with N needles, the answer needle at `depth` | question

- BOS: the tokenizer's EOS id, as `eval/lm.encode_prompt` starts every scored text (a document
  starts here, as in training).
- instruction: INSTRUCTION (the LWM wording) followed by a newline.
- context: everything between the instruction and the question. The answer needle (the first
  queried city's) starts at context offset round(depth / 100 * (C - L)), C the context's length and
  L the needle's, all in tokens: depth 0 opens the context, depth 100 ends it right before the
  question. The other N - 1 needles lie wholly before or wholly after it, at random places; the
  rest is haystack:
  * "text": a contiguous window of held-out tokens (a split of a prepared corpus, never train),
    EOS ids removed (an EOS mid-prompt would tell the model a new document starts), cut in two by
    the answer needle. Needles go between any two haystack tokens (a word may be split: exact
    depths matter more than pretty text).
  * "needles" (RULER niah_multikey_2): the haystack is only further needles of the same template,
    each with its own city and number ("fillers"); a side whose token budget no whole needle fills
    exactly is padded with single newline tokens at random places between needles. Fillers are
    not among the N: they are distractors for greedy decoding, not forced-choice candidates.
- question: R = 1: "What is the special magic {city} number? The special magic {city} number is"
  (completion style). R > 1: "What are the special magic numbers for {c1}, and {c2}?" (cities in
  random order; three or more read "c1, c2, and c3"), and each queried city gets its own prompt
  ending with the cue " The special magic {ci} number is", so every queried city is scored by
  the same completion (greedy or forced choice). `ids` is the prompt of the first queried city,
  whose needle sits at `depth`; the other queried needles are among the N - 1 others.
- Pieces are tokenised separately and concatenated (the pieces start at a space or newline, where
  byte-level BPE splits anyway), so segment spans are exact; decode(ids) reads as the text.
- Cities and numbers are distinct within a sample, numbers have exactly `digits` digits, and each
  number occurs exactly once in the decoded prompt (a draw colliding with haystack text is drawn
  again), so every answer is recoverable from its prompt and the substring check is unambiguous.

`length` is the exact token count of `ids`, BOS and question included. The other queried cities'
prompts differ only by their city's tokens in the cue (`cue_slack` bounds the difference).
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from difftransformer.data.templates import (  # the formats, shared with training mixtures (data/mixture.py)
    CITIES,
    CUE,
    INSTRUCTION,
    NEEDLE_HEAD,
    NEEDLE_TAIL,
    draw_number,
    pick_cities,
    question_text,
)

HAYSTACKS = ("text", "needles")
PAD = "\n"  # what fills a needles-only side that no whole needle fills exactly


@dataclass(frozen=True)
class Segments:
    """Token spans [start, end) of a prompt's five segments; they tile [0, len(ids)).

    `number` lies inside `answer` (the number tokens of the answer needle, leading space included);
    a probe that takes the number as "the answer" counts the rest of the sentence as context."""

    bos: tuple[int, int]
    before: tuple[int, int]  # instruction and context before the answer needle
    answer: tuple[int, int]  # the whole answer needle sentence
    number: tuple[int, int]  # its number tokens only
    after: tuple[int, int]  # context after the answer needle
    query: tuple[int, int]  # the question (through the completion cue)


@dataclass(frozen=True)
class Needle:
    city: str
    number: str
    span: tuple[int, int]  # the sentence's tokens in the prompt
    number_span: tuple[int, int]  # the number's tokens in the prompt
    filler: bool  # part of a needles-only haystack, not one of the N needles


@dataclass(frozen=True)
class NeedleSample:
    """One retrieval prompt; see the module doc. Token lists are tuples (hashable, immutable)."""

    ids: tuple[int, ...]  # the prompt of queried[0], exactly `length` tokens
    prompts: tuple[tuple[int, ...], ...]  # one prompt per queried city; prompts[0] == ids
    queried: tuple[str, ...]  # the R queried cities; queried[0]'s needle is at `depth`
    targets: tuple[str, ...]  # their numbers, in the same order
    needles: tuple[Needle, ...]  # every needle of the prompt (fillers included), in prompt order
    candidate_ids: tuple[tuple[int, ...], ...]  # tokens of " {number}" for each candidate, as `candidates`
    segments: Segments  # of `ids`
    depth: float
    length: int
    haystack: str
    source_offset: int | None  # "text": where the haystack window starts in the EOS-free held-out tokens
    context_start: int  # where the context (haystack and needles) begins: after BOS and the instruction

    @property
    def candidates(self) -> tuple[str, ...]:
        """The N needles' numbers (fillers excluded), in prompt order: the forced-choice options."""
        return tuple(n.number for n in self.needles if not n.filler)

    @property
    def target_index(self) -> tuple[int, ...]:
        """Index of each target in `candidates`."""
        return tuple(self.candidates.index(t) for t in self.targets)

    def haystack_ids(self) -> list[int]:
        """The prompt's haystack tokens: the context without the N needles (fillers included)."""
        inside = {i for n in self.needles if not n.filler for i in range(*n.span)}
        return [self.ids[i] for i in range(self.context_start, self.segments.query[0]) if i not in inside]


class HeldoutText:
    """The tokens of a held-out split with EOS ids removed: where "text" haystacks come from."""

    def __init__(self, tokens: Sequence[int] | np.ndarray, eos_id: int, name: str = "held-out tokens"):
        arr = np.asarray(tokens)
        self.tokens = arr[arr != eos_id]
        self.name = name

    @classmethod
    def from_prepared(cls, data_dir: str | Path, split: str = "test") -> tuple["HeldoutText", object]:
        """(haystack source, PreparedData) for a held-out split of a prepared-data folder, in the data's own
        tokens, read by eval/heldout.py (the one reader of held-out text); never train."""
        from difftransformer.eval.heldout import heldout_split
        from difftransformer.eval.task import EvalConfig

        if split == "train":
            raise ValueError("a haystack from the train split would be text the model was trained on; "
                             "use split 'test' or 'val'")
        held = heldout_split(EvalConfig(data_dir=str(data_dir), split=split), None, "needle")
        return cls(held.tokens, held.eos_id, f"the {split} split of {data_dir}"), held.data

    def window(self, rng: random.Random, n: int) -> tuple[int, list[int]]:
        """(offset, n contiguous tokens) at a random offset; a ValueError when the split is too short."""
        if n > len(self.tokens):
            raise ValueError(f"a needle haystack needs {n} tokens of held-out text but {self.name} has only "
                             f"{len(self.tokens)}; use shorter lengths or haystack 'needles'")
        start = rng.randrange(len(self.tokens) - n + 1)
        return start, [int(t) for t in self.tokens[start:start + n]]


# ------------------------------------------------------------------------------------------- pieces

_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {key: value}, dropped with it


def _memo(tokenizer, key: tuple, compute: Callable[[], object]):
    """compute(), once per tokenizer and key: for what depends only on the tokenizer and the fixed
    templates (a template's tokens for one city, the length bounds), which every prompt would
    otherwise encode again (min_prompt_length alone encodes every city). Encoding is deterministic,
    so the ids are the ones a fresh encode gives. A tokenizer that cannot be weakly referenced is
    simply not memoised."""
    try:
        memo = _MEMO.setdefault(tokenizer, {})
    except TypeError:
        return compute()
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def template_ids(tokenizer, text: str) -> list[int]:
    """tokenizer.encode(text) for a fixed template string (memoised per tokenizer; a fresh list)."""
    return list(_memo(tokenizer, ("encode", text), lambda: tuple(tokenizer.encode(text))))


def needle_tokens(tokenizer, city: str, number: str) -> tuple[list[int], int, int]:
    """(tokens of the needle sentence, number start, number end) with the number span exact."""
    head = template_ids(tokenizer, NEEDLE_HEAD.format(city=city))
    num = tokenizer.encode(" " + number)
    return head + num + template_ids(tokenizer, NEEDLE_TAIL), len(head), len(head) + len(num)


def cue_slack(tokenizer) -> int:
    """How many more tokens one city's R > 1 cue can take than another's (a bound over CITIES)."""
    lengths = [len(template_ids(tokenizer, CUE.format(city=c))) for c in CITIES]
    return max(lengths) - min(lengths)


def min_prompt_length(tokenizer, needles: int, queries: int, digits: int, typical: bool = False) -> int:
    """The shortest prompt that can hold `needles` needles and the question for `queries` cities,
    from the cities shortest in tokens and one-token numbers (a bound: shorter never fits). With
    `typical`: from median cities and the median number, plus haystack as long as the longest
    needle, so that most draws fit at every depth (when the haystack is at least one needle long,
    the other needles can always be split around the answer at its exact offset). Memoised per tokenizer."""
    return _memo(tokenizer, ("min_prompt_length", needles, queries, digits, typical),
                 lambda: _min_prompt_length(tokenizer, needles, queries, digits, typical))


def _min_prompt_length(tokenizer, needles: int, queries: int, digits: int, typical: bool) -> int:
    by_length = sorted(CITIES, key=lambda c: (len(template_ids(tokenizer, NEEDLE_HEAD.format(city=c))), c))
    if typical:
        mid = len(by_length) // 2
        cities = by_length[mid - needles // 2:][:needles]
        rng = random.Random(0)
        sizes = sorted(len(tokenizer.encode(" " + str(rng.randrange(10 ** (digits - 1), 10 ** digits))))
                       for _ in range(64))
        number = sizes[len(sizes) // 2]
    else:
        cities, number = by_length[:needles], 1
    heads = sum(len(template_ids(tokenizer, NEEDLE_HEAD.format(city=c))) for c in cities)
    needle = heads + needles * (number + len(template_ids(tokenizer, NEEDLE_TAIL)))
    asked = cities[:queries]
    question = len(tokenizer.encode(question_text(asked)))
    if queries > 1:
        question += len(template_ids(tokenizer, CUE.format(city=asked[0])))
    slack = longest_needle(tokenizer, digits) if typical else 0
    return 1 + len(template_ids(tokenizer, INSTRUCTION)) + question + needle + slack


def longest_needle(tokenizer, digits: int) -> int:
    """A bound on one needle's tokens: the longest city and digits + 1 number tokens."""
    head = max(len(template_ids(tokenizer, NEEDLE_HEAD.format(city=c))) for c in CITIES)
    return head + digits + 1 + len(template_ids(tokenizer, NEEDLE_TAIL))


# ------------------------------------------------------------------------------------------- layout


def _assign_sides(rng: random.Random, lengths: list[int], before: int, after: int) -> list[bool] | None:
    """For each needle length, True = before the answer, so that each side's needles fit its budget;
    None when no assignment fits. Random greedy tries first (sides chosen in proportion to their room),
    then every subset when there are few needles."""
    for _ in range(64):
        room = [before, after]
        sides = []
        for n in lengths:
            fits = [s for s in (0, 1) if room[s] >= n]
            if not fits:
                break
            s = fits[0] if len(fits) == 1 else (0 if rng.random() * (room[0] + room[1]) < room[0] else 1)
            room[s] -= n
            sides.append(s == 0)
        else:
            return sides
    if len(lengths) <= 16:
        options = []
        for mask in range(1 << len(lengths)):
            b = sum(n for i, n in enumerate(lengths) if mask >> i & 1)
            if b <= before and sum(lengths) - b <= after:
                options.append(mask)
        if options:
            mask = rng.choice(options)
            return [bool(mask >> i & 1) for i in range(len(lengths))]
    return None


def _interleave(rng: random.Random, units: list[list[int]], items: list) -> list:
    """`units` (token lists) with each of `items` inserted at a random boundary between units,
    keeping both orders; returns a list of ("unit", tokens) and ("item", item) entries."""
    slots = sorted(rng.randint(0, len(units)) for _ in items)
    out, k = [], 0
    for i in range(len(units) + 1):
        while k < len(slots) and slots[k] == i:
            out.append(("item", items[k]))
            k += 1
        if i < len(units):
            out.append(("unit", units[i]))
    return out


def _filler_units(rng, tokenizer, budget: int, digits: int, numbers: set[str], used: set[str]) -> list[tuple]:
    """Whole filler needles (as ("filler", city, number, tokens, a, b)) plus single PAD tokens that
    fill exactly `budget` tokens, with cities not in `used` (added to it) and numbers not in `numbers`."""
    pad = template_ids(tokenizer, PAD)
    if len(pad) != 1:
        raise ValueError(f"the tokenizer encodes {PAD!r} as {len(pad)} tokens; needles-only haystacks pad with one")
    units: list = []
    left = budget
    misses = 0
    while left > 0 and misses < 8:
        city = pick_cities(rng, 1, exclude=used)[0]
        number = draw_number(rng, digits, numbers)
        toks, a, b = needle_tokens(tokenizer, city, number)
        if len(toks) <= left:
            used.add(city)
            units.append(("filler", city, number, toks, a, b))
            left -= len(toks)
            misses = 0
        else:
            numbers.discard(number)
            misses += 1
    for _ in range(left):
        units.insert(rng.randint(0, len(units)), ("pad", pad))
    return units


# ------------------------------------------------------------------------------------------- prompt


def needle_prompt(tokenizer, rng: random.Random, *, length: int, depth: float, needles: int = 1, queries: int = 1,
                  haystack: str = "text", text: HeldoutText | None = None, digits: int = 7,
                  context: int | None = None) -> NeedleSample:
    """One retrieval prompt of exactly `length` tokens (see the module doc); `rng` decides everything.

    `text`: the held-out tokens for haystack "text". `context`: the model's context; a longer
    `length` is refused. Bad values are a one-line ValueError."""
    check_needle_args(length=length, depth=depth, needles=needles, queries=queries, haystack=haystack,
                      digits=digits, context=context)
    if haystack == "text" and text is None:
        raise ValueError("haystack 'text' needs held-out tokens (HeldoutText.from_prepared(data_dir, 'test')); "
                         "pass text=... or use haystack 'needles'")
    shortest = min_prompt_length(tokenizer, needles, queries, digits)
    if length < shortest:
        fewer = " or fewer needles" if needles > 1 else ""
        raise ValueError(f"{needles} needle(s) with the instruction and question do not fit in a {length}-token prompt "
                         f"(the shortest possible is {shortest}); use a length of at least {shortest} tokens{fewer}")
    reason = ""
    for _ in range(50):
        try:
            return _build(tokenizer, rng, length, float(depth), needles, queries, haystack, text, digits)
        except _Redraw as e:
            reason = str(e)
    raise ValueError(reason)


class _Redraw(Exception):
    """This draw of cities and numbers cannot make the prompt; another draw may (the message says why not)."""


def check_needle_args(*, length: int, depth: float, needles: int, queries: int, haystack: str, digits: int,
                      context: int | None) -> None:
    """The one-line ValueErrors for values that cannot make a prompt."""
    if context is not None and length > context:
        raise ValueError(f"needle prompt length {length} is beyond the model's context of {context} tokens; "
                         f"use a length <= {context}")
    if length <= 0:
        raise ValueError(f"needle prompt length must be positive, got {length}")
    if not 0 <= depth <= 100:
        raise ValueError(f"needle depth {depth} is outside 0..100 (percent of the context); "
                         f"use e.g. 0, 25, 50, 75, 100")
    if needles < 1:
        raise ValueError(f"needles must be >= 1, got {needles}")
    if not 1 <= queries <= needles:
        raise ValueError(f"queries (R={queries}) must be between 1 and the number of needles (N={needles}): "
                         f"only needles in the prompt can be asked for")
    if haystack not in HAYSTACKS:
        raise ValueError(f"haystack must be one of {', '.join(HAYSTACKS)}, got {haystack!r}")
    if not 1 <= digits <= 18:
        raise ValueError(f"digits must be between 1 and 18, got {digits}")
    if 9 * 10 ** (digits - 1) < needles:
        raise ValueError(f"{needles} distinct numbers of {digits} digits do not exist; use more digits")


def _build(tokenizer, rng, length, depth, n_needles, n_queries, haystack, text, digits) -> NeedleSample:
    """One draw; _Redraw when its cities or numbers cannot make the prompt (the caller draws again)."""
    cities = pick_cities(rng, n_needles)
    numbers: set[str] = set()
    nums = [draw_number(rng, digits, numbers) for _ in cities]
    queried = [cities[0]] + rng.sample(cities[1:], n_queries - 1)
    shown = list(queried)
    rng.shuffle(shown)
    if n_queries == 1:
        question = template_ids(tokenizer, question_text(queried))
        cues = [question]
    else:
        head = tokenizer.encode(question_text(shown))
        cues = [head + template_ids(tokenizer, CUE.format(city=c)) for c in queried]
        question = cues[0]
    instruction = template_ids(tokenizer, INSTRUCTION)
    made = [needle_tokens(tokenizer, c, x) for c, x in zip(cities, nums)]
    C = length - 1 - len(instruction) - len(question)
    total = sum(len(m[0]) for m in made)
    if C < total:
        raise _Redraw(f"{n_needles} needles with the instruction and question rarely fit in a {length}-token prompt "
                      f"(the last draw needed {length + total - C}); use a longer length or fewer needles")
    answer_len = len(made[0][0])
    a = round(depth / 100 * (C - answer_len))
    before_room, after_room = a, C - a - answer_len
    others = list(range(1, n_needles))
    rng.shuffle(others)
    sides = _assign_sides(rng, [len(made[i][0]) for i in others], before_room, after_room)
    if sides is None:
        raise _Redraw(f"the {n_needles - 1} other needles do not fit around the answer at depth {depth:g} in a "
                      f"{length}-token prompt (an exact depth needs about one needle's length of haystack); use a "
                      f"longer length or fewer needles")
    side_needles = {True: [i for i, s in zip(others, sides) if s], False: [i for i, s in zip(others, sides) if not s]}
    budget = {s: (before_room if s else after_room) - sum(len(made[i][0]) for i in side_needles[s])
              for s in (True, False)}
    offset = None
    if haystack == "text":
        offset, window = text.window(rng, budget[True] + budget[False])
        units = {True: [[t] for t in window[:budget[True]]], False: [[t] for t in window[budget[True]:]]}
    else:
        used = set(cities)
        units = {s: _filler_units(rng, tokenizer, budget[s], digits, numbers, used) for s in (True, False)}

    ids = [tokenizer.eos_id, *instruction]
    placed: list[Needle] = []

    def put(city, number, toks, na, nb, filler):
        start = len(ids)
        ids.extend(toks)
        placed.append(Needle(city, number, (start, start + len(toks)), (start + na, start + nb), filler))

    def emit(side: bool):
        for kind, entry in _interleave(rng, units[side], side_needles[side]):
            if kind == "item":
                toks, na, nb = made[entry]
                put(cities[entry], nums[entry], toks, na, nb, False)
            elif isinstance(entry, tuple) and entry[0] == "filler":
                put(entry[1], entry[2], entry[3], entry[4], entry[5], True)
            elif isinstance(entry, tuple):  # ("pad", tokens)
                ids.extend(entry[1])
            else:
                ids.extend(entry)

    emit(True)
    answer_start = len(ids)
    put(cities[0], nums[0], *made[0], False)
    emit(False)
    query_start = len(ids)
    prefix = list(ids)
    ids.extend(question)
    assert len(ids) == length and answer_start == 1 + len(instruction) + a, "needle layout arithmetic"

    decoded = tokenizer.decode(ids)
    if any(decoded.count(n.number) != 1 for n in placed):
        raise _Redraw(f"could not draw {digits}-digit numbers that each occur once in a {length}-token prompt; "
                      f"use more digits")
    answer = placed[[n.span[0] for n in placed].index(answer_start)]
    segments = Segments(bos=(0, 1), before=(1, answer_start), answer=answer.span, number=answer.number_span,
                        after=(answer.span[1], query_start), query=(query_start, length))
    number_of = {n.city: n.number for n in placed}
    real = [n for n in placed if not n.filler]
    return NeedleSample(
        ids=tuple(ids), prompts=tuple(tuple(prefix + cue) for cue in cues), queried=tuple(queried),
        targets=tuple(number_of[c] for c in queried), needles=tuple(placed),
        candidate_ids=tuple(tuple(tokenizer.encode(" " + n.number)) for n in real), segments=segments,
        depth=depth, length=length, haystack=haystack, source_offset=offset, context_start=1 + len(instruction))

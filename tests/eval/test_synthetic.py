"""Needle prompts: exact token layout, recoverable answers, distinct keys and values, held-out haystacks."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from difftransformer.data import PreparedData
from difftransformer.data.needle import CITIES, cue_slack, min_prompt_length, needle_prompt, template_ids
from difftransformer.eval.task import EvalConfig
from difftransformer.eval.tasks.needle import haystack_text

NEEDLE_RE = r" The special magic (.+?) number is: (\d+)\."


@pytest.fixture(scope="module")
def corpus(data_dir):
    data = PreparedData.load(data_dir)
    text, _ = haystack_text(EvalConfig(data_dir=data_dir, split="test"), None, "needle")
    return data.tokenizer(), text, data


def test_city_list_is_long_and_distinct():
    assert len(CITIES) >= 150 and len(set(CITIES)) == len(CITIES)
    for a in CITIES:
        assert a == a.strip() and re.fullmatch(r"[A-Za-z][A-Za-z .-]*", a), a
        for b in CITIES:  # no city is a whole-word part of another: the oracle and readers never confuse two keys
            assert a == b or not re.search(rf"\b{re.escape(a)}\b", b), (a, b)


def check_layout(tok, s, *, length, depth, needles, queries, digits=7):
    """Every invariant of a sample that can be computed by hand from its spans and decoded text."""
    seg = s.segments
    assert len(s.ids) == s.length == length and s.ids[0] == tok.eos_id and s.prompts[0] == s.ids
    # the five segments tile the prompt; the number lies inside the answer sentence
    assert seg.bos == (0, 1) and seg.before[0] == 1 and seg.before[1] == seg.answer[0]
    assert seg.answer[1] == seg.after[0] and seg.after[1] == seg.query[0] and seg.query[1] == length
    assert seg.answer[0] <= seg.number[0] < seg.number[1] <= seg.answer[1]
    # the answer needle starts at round(depth% of the room the context leaves it)
    C = seg.query[0] - s.context_start
    L = seg.answer[1] - seg.answer[0]
    assert seg.answer[0] - s.context_start == round(depth / 100 * (C - L))
    if depth == 0:
        assert seg.answer[0] == s.context_start
    if depth == 100:
        assert seg.answer[1] == seg.query[0]
    # the answer is the first queried city's needle, and decodes as the template says
    city, target = s.queried[0], s.targets[0]
    assert tok.decode(s.ids[slice(*seg.answer)]) == f" The special magic {city} number is: {target}."
    assert tok.decode(s.ids[slice(*seg.number)]) == f" {target}"
    assert tok.decode(s.ids[:s.context_start]).endswith("I will quiz you about the magic number there.\n")
    # cities and numbers distinct, numbers of `digits` digits, N real needles, R queried among them
    cities = [n.city for n in s.needles]
    numbers = [n.number for n in s.needles]
    assert len(set(cities)) == len(cities) and len(set(numbers)) == len(numbers)
    assert all(len(x) == digits and x[0] != "0" for x in numbers)
    real = [n for n in s.needles if not n.filler]
    assert len(real) == needles == len(s.candidates) == len(s.candidate_ids)
    assert len(s.queried) == len(set(s.queried)) == queries == len(s.prompts) == len(s.targets)
    assert set(s.queried) <= {n.city for n in real}
    for n in s.needles:  # every span decodes to its needle
        assert tok.decode(s.ids[slice(*n.span)]) == f" The special magic {n.city} number is: {n.number}."
        assert tok.decode(s.ids[slice(*n.number_span)]) == f" {n.number}"
    for i, (c, t) in enumerate(zip(s.queried, s.targets)):
        # recoverable from its own prompt: the needle is there exactly once, and the prompt asks for it
        text = tok.decode(s.prompts[i])
        assert text.count(f"The special magic {c} number is: {t}.") == 1 and text.count(t) == 1
        assert text.endswith(f"The special magic {c} number is")
        assert list(s.prompts[i][:seg.query[0]]) == list(s.ids[:seg.query[0]])
        assert s.candidates[s.target_index[i]] == t
        assert tok.decode(s.candidate_ids[s.target_index[i]]) == f" {t}"
    question = tok.decode(s.ids[slice(*seg.query)])
    if queries == 1:
        assert question == f"\nWhat is the special magic {city} number? The special magic {city} number is"
    else:
        m = re.match(r"\nWhat are the special magic numbers for (.+)\? The special magic (.+) number is$", question)
        listed = re.split(r", and |, ", m.group(1))
        assert sorted(listed) == sorted(s.queried) and m.group(2) == city
        if queries == 2:
            assert m.group(1) == f"{listed[0]}, and {listed[1]}"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("haystack", ["text", "needles"])
def test_needle_prompts_have_the_stated_layout(corpus, haystack, seed):
    tok, text, _ = corpus
    rng = random.Random(seed)
    for needles, queries in [(1, 1), (2, 2), (4, 2), (3, 3)]:
        for depth in (0, 25, 50, 75, 100, 33.3):
            length = min_prompt_length(tok, needles, queries, 7, typical=True) + rng.randrange(0, 120)
            s = needle_prompt(tok, rng, length=length, depth=depth, needles=needles, queries=queries,
                              haystack=haystack, text=text, context=length + 5)
            try:
                check_layout(tok, s, length=length, depth=depth, needles=needles, queries=queries)
            except AssertionError as e:  # pragma: no cover - names the draw to reproduce it
                raise AssertionError(f"seed {seed}, N={needles}, R={queries}, depth {depth}: {e}") from e


def test_text_haystack_is_a_window_of_the_test_split_only(corpus, data_dir):
    tok, text, data = corpus
    train = PreparedData.load(data_dir).dataset("train").tokens
    test = data.dataset("test").tokens
    test_free = np.asarray(test)[np.asarray(test) != tok.eos_id]
    rng = random.Random(1)
    for depth in (0, 50, 100):
        s = needle_prompt(tok, rng, length=500, depth=depth, needles=3, text=text)
        hay = s.haystack_ids()
        assert tok.eos_id not in hay and len(hay) > 150
        assert hay == [int(t) for t in test_free[s.source_offset:s.source_offset + len(hay)]]
        as_bytes = np.asarray(hay, dtype=train.dtype).tobytes()
        assert as_bytes not in np.asarray(train).tobytes()  # not text the model was trained on
    with pytest.raises(ValueError, match="split='train' would evaluate on the text the model was trained on"):
        haystack_text(EvalConfig(data_dir=data_dir, split="train"), None, "needle")


def test_needles_only_haystack_is_made_of_other_needles(corpus):
    tok, _, _ = corpus
    s = needle_prompt(tok, random.Random(2), length=700, depth=50, needles=2, haystack="needles")
    hay = tok.decode(s.haystack_ids())
    assert re.fullmatch(rf"(?:{NEEDLE_RE}|\n)*", hay)
    fillers = [n for n in s.needles if n.filler]
    assert len(fillers) >= 5 and hay.count("\n") < 40  # mostly whole needles; single newlines pad the rest
    assert s.source_offset is None and len(s.candidates) == 2


def test_prompts_are_seeded(corpus):
    tok, text, _ = corpus
    a = needle_prompt(tok, random.Random(5), length=400, depth=25, needles=2, text=text)
    b = needle_prompt(tok, random.Random(5), length=400, depth=25, needles=2, text=text)
    c = needle_prompt(tok, random.Random(6), length=400, depth=25, needles=2, text=text)
    assert a == b and a.ids != c.ids


def test_bounds_on_lengths(corpus):
    tok, _, _ = corpus
    assert cue_slack(tok) >= 1
    shortest = min_prompt_length(tok, 3, 2, 7)
    assert shortest < min_prompt_length(tok, 3, 2, 7, typical=True) < min_prompt_length(tok, 4, 2, 7, typical=True)


def test_bad_inputs_are_one_line_value_errors(corpus):
    tok, text, _ = corpus
    rng = random.Random(0)

    def bad(match, **kw):
        args = dict(length=400, depth=50, needles=2, queries=1, text=text)
        args.update(kw)
        with pytest.raises(ValueError, match=match) as e:
            needle_prompt(tok, rng, **args)
        assert "\n" not in str(e.value)

    bad("beyond the model's context of 300 tokens", context=300)
    bad("outside 0..100", depth=101)
    bad("outside 0..100", depth=-5)
    bad(r"queries \(R=3\) must be between 1 and the number of needles \(N=2\)", queries=3)
    bad("do not fit in a 400-token prompt", needles=12)
    bad("haystack 'text' needs held-out tokens", text=None)
    bad("haystack must be one of", haystack="noise")
    bad("distinct numbers of 1 digits do not exist", digits=1, needles=12, length=2000)
    bad("has only", length=len(text.tokens) + 500)  # the split is too short for the haystack


class CountingTokenizer:
    """The corpus tokenizer, counting how often each text is encoded."""

    def __init__(self, inner):
        self.inner, self.eos_id, self.calls = inner, inner.eos_id, {}

    def encode(self, text):
        self.calls[text] = self.calls.get(text, 0) + 1
        return self.inner.encode(text)

    def decode(self, ids):
        return self.inner.decode(ids)


def test_prompts_encode_the_fixed_templates_once_per_tokenizer_and_stay_the_same(corpus):
    tok, text, _ = corpus
    counting = CountingTokenizer(tok)
    made = [needle_prompt(counting, random.Random(seed), length=420, depth=50, needles=4, queries=2, text=text)
            for seed in range(6)]
    plain = [needle_prompt(tok, random.Random(seed), length=420, depth=50, needles=4, queries=2, text=text)
             for seed in range(6)]
    assert made == plain  # memoised encodings give the prompts a fresh encode gives
    head = " The special magic Paris number is:"
    assert counting.calls[head] == 1  # min_prompt_length encodes every city; later prompts reuse it
    assert counting.calls["."] == 1
    ids = template_ids(counting, head)
    ids.append(-1)  # the caller's list is its own: the memo is not changed through it
    assert template_ids(counting, head) == tok.encode(head) and counting.calls[head] == 1

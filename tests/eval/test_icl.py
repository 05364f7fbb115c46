"""The `icl` task: prompts, label trie, constrained decoding, draws and orders, metrics on known answers,
and the bad inputs it refuses.

Most checks use a character-level tokenizer (one token per character, so label prefixes are visible by
hand) and fake LMs whose answer is known: one that always "knows" the label, one that always prefers a
single label; both also prefer a token that is no label at all, which constrained decoding must ignore."""

from __future__ import annotations

import json
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import difftransformer.eval.tasks.icl as icl
from difftransformer.data import PreparedData
from difftransformer.eval import labelled
from difftransformer.eval.labelled import load_labelled
from difftransformer.eval.task import EvalConfig, get_task, run_task
from difftransformer.eval.tasks.icl import (
    SEPARATOR,
    LabelTrie,
    _Plan,
    alternating_order,
    automatic_max_shots,
    automatic_shots,
    balanced_draw,
    build_prompt,
    constrained_decode,
    random_order,
)
from difftransformer.model import DiffTransformerLM
from tests.helpers import tiny

EOS, VOCAB = 256, 300
NOT_A_LABEL = ord("#")


class CharTokenizer:
    """One token per character (code points < 256); EOS is 256."""

    eos_id = EOS

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids if i != EOS)


class FakeLM(torch.nn.Module):
    """Logits from a rule over the decoded text of each row (up to its last non-EOS token). `answer(query,
    prompt)` names the label it wants; the next character of " " + that label gets logit 5, and the token
    '#' (no label starts with it) gets 9. Records every prompt it sees (the row as text)."""

    def __init__(self, answer, context: int = 2048):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(max_position_embeddings=context)
        self.answer, self.seen = answer, []

    def forward(self, ids):
        logits = torch.zeros(*ids.shape, VOCAB)
        for r, row in enumerate(ids.tolist()):
            last = max(i for i, t in enumerate(row) if t != EOS)
            assert row[0] == EOS and last < self.config.max_position_embeddings
            text = CharTokenizer().decode(row[:last + 1])
            self.seen.append(text)
            head, _, so_far = text.rpartition(":")  # the query ends with the label prefix, e.g. "Kind:"
            query = head.rsplit(SEPARATOR, 1)[-1].split("\n")[0].split(": ", 1)[1]
            target = " " + self.answer(query, head)
            if target.startswith(so_far) and len(so_far) < len(target):
                logits[r, :, ord(target[len(so_far)])] = 5.0
            logits[r, :, NOT_A_LABEL] = 9.0
        return SimpleNamespace(logits=logits + 0 * self.w)


def synthetic_truth():
    return dict(load_labelled("synthetic").items)


def run(model, tokenizer=None, **options):
    return run_task(get_task("icl", **options), model, tokenizer or CharTokenizer(), EvalConfig(batch_size=4))


# ------------------------------------------------------------------------------- prompts


def test_a_prompt_holds_k_demonstrations_and_then_the_test_item():
    data = load_labelled("synthetic")
    demos = [("the old horse", "animal"), ("the new iron", "metal")]
    assert build_prompt(data, demos, "the big tree") == (
        "Item: the old horse\nKind: animal\n==\nItem: the new iron\nKind: metal\n==\nItem: the big tree\nKind:")
    assert build_prompt(data, [], "the big tree") == "Item: the big tree\nKind:"


def test_every_prompt_of_a_run_has_k_demonstrations_never_the_test_item():
    truth = synthetic_truth()
    model = FakeLM(lambda q, s: truth[q])
    result = run(model, shots=(0, 1, 3), draws=2, test_size=12, orders=2, order_shots=4)
    demo_counts = Counter()
    for text in model.seen:
        *demos, query = text.split(SEPARATOR)
        query_text = query.split("\n")[0].removeprefix("Item: ")
        demo_texts = [d.split("\n")[0].removeprefix("Item: ") for d in demos]
        assert query_text not in demo_texts and len(set(demo_texts)) == len(demo_texts)
        assert all(truth[t] == d.split("\nKind: ")[1] for t, d in zip(demo_texts, demos))  # demos carry their labels
        demo_counts[len(demos)] += 1
    # 12 test items: k=0 once, k=1 and 3 twice each, 2 x 2 orders of 4 (the first label token is forced: one step)
    assert demo_counts == {0: 12, 1: 24, 3: 24, 4: 48}
    assert result.metrics["accuracy_k0"] == result.metrics["accuracy_k3"] == 1.0


# ------------------------------------------------------------------------------- the trie


def test_trie_cuts_labels_to_their_shortest_unique_prefix_by_hand():
    trie = LabelTrie({"entity animal": [1, 2], "entity body": [1, 3], "human": [4],
                      "location city": [5, 6, 7], "location country": [5, 6, 8, 9]})
    assert trie.cut == {"entity animal": (1, 2), "entity body": (1, 3), "human": (4,),
                        "location city": (5, 6, 7), "location country": (5, 6, 8)}
    assert trie.allowed([]) == [1, 4, 5] and trie.allowed([1]) == [2, 3] and trie.allowed([5]) == [6]
    assert trie.allowed([5, 6, 8]) == [] and trie.label_at([5, 6, 8]) == "location country"
    assert trie.label_at([5, 6]) is None and trie.depth == 3


def test_a_label_inside_another_gets_the_stop_tokens():
    trie = LabelTrie({"A": [1], "A B": [1, 2], "C": [3]}, stop=[9])
    assert trie.cut == {"A": (1, 9), "A B": (1, 2), "C": (3,)}
    with pytest.raises(ValueError, match="share all their tokens"):
        LabelTrie({"x": [1, 2], "y": [1, 2]})
    with pytest.raises(ValueError, match="at least two labels"):
        LabelTrie({"x": [1]})


def test_trie_from_a_tokenizer_cuts_the_text():
    tok = CharTokenizer()
    trie = LabelTrie.from_tokenizer(tok, ["apple", "apricot", "banana", "app"])
    # " app" is inside " apple": it gets "\n", so " app\n" vs " appl" differ at the 5th character
    assert trie.cut_text(tok) == {"apple": "appl", "apricot": "apr", "banana": "b", "app": "app"}
    assert trie.cut["app"] == tuple(map(ord, " app\n")) and trie.allowed([]) == [ord(" ")]


# ------------------------------------------------------------------------------- constrained decoding


class HashLM(torch.nn.Module):
    """Fresh pseudo-random logits, a fixed function of the tokens so far (so a reference can recompute them)."""

    def __init__(self, seed: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(max_position_embeddings=4096)
        self.seed = seed

    def row(self, prefix) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed, tuple(prefix))) % 2**62)
        return torch.randn(VOCAB, generator=g)

    def forward(self, ids):
        out = torch.stack([torch.stack([self.row(r[:t + 1]) for t in range(len(r))]) for r in ids.tolist()])
        return SimpleNamespace(logits=out + 0 * self.w)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_constrained_decoding_is_greedy_among_allowed_tokens(seed):
    rng = random.Random(seed)
    labels = {f"L{i}": [rng.choice([10, 11, 12]) for _ in range(rng.randint(1, 3))] for i in range(6)}
    labels = {y: s for y, s in labels.items() if all(s != t for o, t in labels.items() if o < y)}
    trie = LabelTrie(labels, stop=[13])
    model = HashLM(seed)
    prompts = [[EOS] + [rng.randrange(256) for _ in range(rng.randint(1, 9))] for _ in range(7)]
    got = constrained_decode(model, prompts, trie, batch_size=3, pad_id=EOS)
    for prompt, answer in zip(prompts, got):
        prefix = []
        while trie.label_at(prefix) is None:  # the reference: one sequence at a time, no padding
            allowed = trie.allowed(prefix)
            logits = model.row(prompt + prefix)
            prefix.append(max(allowed, key=lambda t: (logits[t].item(), -t)))
        assert answer == trie.label_at(prefix)


def test_a_model_preferring_another_token_still_yields_a_label():
    tok = CharTokenizer()
    trie = LabelTrie.from_tokenizer(tok, ["yes", "no", "maybe"])
    model = FakeLM(lambda q, s: "never")  # wants " never" (shares " n" with " no") and '#' above all
    answers = constrained_decode(model, [[EOS, *tok.encode("Q: x\nA:")]] * 3, trie, pad_id=EOS)
    assert answers == ["no"] * 3


def test_padding_does_not_change_answers_of_a_real_model(data_dir):
    tok = PreparedData.load(data_dir).tokenizer()
    torch.manual_seed(0)
    model = DiffTransformerLM(tiny("diff", vocab_size=tok.vocab_size, max_position_embeddings=64)).eval()
    trie = LabelTrie.from_tokenizer(tok, ["the of", "the and", "is", "that"])
    rng = random.Random(0)
    prompts = [[tok.eos_id, *[rng.randrange(tok.vocab_size - 1) for _ in range(rng.randint(3, 40))]] for _ in range(9)]
    one = constrained_decode(model, prompts, trie, batch_size=1, pad_id=tok.eos_id)
    assert constrained_decode(model, prompts, trie, batch_size=4, pad_id=tok.eos_id) == one
    assert set(one) <= {"the of", "the and", "is", "that"}


# ------------------------------------------------------------------------------- draws and orders


def test_order_variants_are_permutations_of_one_set():
    pool = [(f"t{i}", "abc"[i % 3]) for i in range(30)]
    fixed = balanced_draw(pool, "abc", 8, random.Random(0))
    assert len(fixed) == 8 and sorted(Counter(y for _, y in fixed).values()) == [2, 3, 3]
    for s in range(5):
        assert sorted(random_order(fixed, random.Random(s))) == sorted(fixed)
        assert sorted(alternating_order(fixed, "abc", random.Random(s))) == sorted(fixed)


def test_alternating_orders_alternate_classes():
    items = [(f"{y}{i}", y) for y in "abcd" for i in range(3)]
    orders = [alternating_order(items, "abcd", random.Random(s)) for s in range(10)]
    for order in orders:
        labels = [y for _, y in order]
        assert all(sorted(labels[i:i + 4]) == list("abcd") for i in range(0, 12, 4))
        assert labels[4:8] == labels[:4] == labels[8:]  # the same class order every round
    assert len({tuple(y for _, y in o[:4]) for o in orders}) > 1  # class order varies over seeds
    assert len({tuple(t for t, y in o if y == "a") for o in orders}) > 1  # so does the order within a class
    uneven = [("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b")]
    assert [y for _, y in alternating_order(uneven, "ab", random.Random(3))] in (list("abaa"), list("baaa"))


def test_automatic_shots_by_hand():
    """Every demonstration 10 tokens, separator 4, longest query 12 (with its separator), labels 2 steps,
    context 100: k demonstrations need 1 + 10k + 4(k - 1) + 12 + 1 = 14k + 10 tokens, so k <= 6."""
    pool = [(f"t{i}", "a") for i in range(50)]
    plan = _Plan(context=100, demo_len={it: 10 for it in pool}, sep_len=4, query_len=12, query_alone=8, depth=2)
    assert plan.needed(pool[:6]) == 94 and plan.needed([]) == 1 + 8 + 1
    assert automatic_max_shots(plan, pool, random.Random(0)) == 6
    assert automatic_shots(6) == [1, 2, 4, 6] and automatic_shots(8) == [1, 2, 4, 8] and automatic_shots(1) == [1]


@pytest.mark.parametrize("context, k_max", [(110, 4), (120, 5)])
def test_automatic_shots_keep_90_percent_of_draws_fitting(context, k_max):
    """Half the pool 10 tokens, half 20: k demonstrations with j long ones need 14k + 10j + 10 tokens. Context
    110 fits k = 5 only with j <= 1, a hypergeometric chance of 0.819 (< 0.9), k = 4 always: k_max = 4.
    Context 120: k = 5 fits with j <= 2, chance 0.972; k = 6 with j <= 1, chance 0.339: k_max = 5."""
    pool = [(f"t{i}", "a") for i in range(100)]
    plan = _Plan(context=context, demo_len={it: 10 + 10 * (i % 2) for i, it in enumerate(pool)}, sep_len=4,
                 query_len=12, query_alone=8, depth=2)
    assert automatic_max_shots(plan, pool, random.Random(0)) == k_max


def test_a_draw_that_does_not_fit_is_drawn_again():
    """The pool of the test above at context 110: 5 demonstrations fit 81.9% of the time; 9 never do."""
    pool = [(f"t{i}", "a") for i in range(100)]
    plan = _Plan(context=110, demo_len={it: 10 + 10 * (i % 2) for i, it in enumerate(pool)}, sep_len=4,
                 query_len=12, query_alone=8, depth=2)
    rng, refused = random.Random(0), 0
    for _ in range(20):
        demos, n = icl._draw(pool, 5, plan, rng, "test", "hint")
        assert len(set(demos)) == 5 and plan.needed(demos) <= 110
        refused += n
    assert 0 < refused < 20
    with pytest.raises(ValueError, match="none of 100 random draws of 9 demonstrations fit .* context of 110 tokens"):
        icl._draw(pool, 9, plan, rng, "test", "hint")


# ------------------------------------------------------------------------------- metrics on known answers


def test_a_model_that_knows_the_label_scores_one():
    truth = synthetic_truth()
    result = run(FakeLM(lambda q, s: truth[q]), shots=(0, 2, 5), draws=2, test_size=20, orders=2)
    assert all(result.metrics[f"accuracy_k{k}"] == 1.0 for k in (0, 2, 5))
    assert result.metrics["order_margin_random"] == result.metrics["order_margin_alternating"] == 0.0
    assert json.loads(json.dumps(result.to_dict()))["metrics"] == result.metrics
    assert result.settings["cut_labels"] == ["a", "p", "m", "t"]


def test_a_model_preferring_one_label_scores_its_share():
    data = load_labelled("synthetic")
    test, _ = data.split(30)
    share = sum(y == "metal" for _, y in test) / 30
    result = run(FakeLM(lambda q, s: "metal"), shots=(1, 4), draws=2, test_size=30, orders=2)
    assert result.metrics["accuracy_k1"] == result.metrics["accuracy_k4"] == pytest.approx(share)
    assert result.details["curve"][0]["predicted"] == {"animal": 0, "plant": 0, "metal": 60, "tool": 0}
    assert result.metrics["majority_share"] == max(Counter(y for _, y in test).values()) / 30
    assert result.metrics["order_margin_random"] == 0.0


def test_copying_from_demonstrations_learns_the_synthetic_task():
    """A model that answers with the label of the last demonstration sharing the test item's noun (else
    'tool'), the induction a small model can do, climbs from the share of 'tool' towards 1 as k grows."""
    def copy(query, prompt):
        noun = query.split()[-1]
        demos = prompt.split(SEPARATOR)[:-1]
        seen = [d.split("\nKind: ")[1] for d in demos if d.split("\n")[0].endswith(" " + noun)]
        return seen[-1] if seen else "tool"

    result = run(FakeLM(copy, context=10**4), shots=(0, 4, 60), draws=3, test_size=40, orders=0)
    test, _ = load_labelled("synthetic").split(40)
    acc = [result.metrics[f"accuracy_k{k}"] for k in (0, 4, 60)]
    assert acc[0] == sum(y == "tool" for _, y in test) / 40
    assert acc[0] < acc[1] < acc[2] and acc[2] >= 0.95
    assert "order_margin_random" not in result.metrics and result.details["orders"] == {}


def test_automatic_shots_fit_the_context_and_the_plot_draws(tmp_path):
    truth = synthetic_truth()
    result = run(FakeLM(lambda q, s: truth[q], context=300), draws=1, test_size=10, orders=2)
    shots = result.settings["shots"]
    assert result.settings["shots_automatic"] and shots[-1] == result.settings["automatic_max_shots"] >= 4
    assert all(c["prompt_tokens_max"] <= 300 for c in result.details["curve"])
    assert result.details["orders"]["shots"] == shots[-1]
    assert get_task("icl").plot(result, tmp_path / "icl.png") and (tmp_path / "icl.png").stat().st_size > 1000


def test_a_real_tiny_model_runs_end_to_end_and_deterministically(data_dir, tmp_path):
    tok = PreparedData.load(data_dir).tokenizer()
    torch.manual_seed(0)
    model = DiffTransformerLM(tiny("diff", vocab_size=tok.vocab_size, max_position_embeddings=128))
    opts = dict(shots=(1, 2), draws=1, test_size=6, orders=2)
    first, again = run(model, tok, **opts), run(model, tok, **opts)
    assert first.metrics == again.metrics and first.details == again.details
    assert all(0.0 <= v <= 1.0 for v in first.metrics.values())
    assert get_task("icl").plot(first, tmp_path / "icl.png")


# ------------------------------------------------------------------------------- bad inputs


def test_unknown_dataset_suggests_and_lists():
    with pytest.raises(ValueError, match=r"'rotten-tomatos' \(did you mean 'rotten-tomatoes'\?\); available: "
                                         r"rotten-tomatoes, sotu-century, sotu-party, synthetic"):
        get_task("icl", dataset="rotten-tomatos")


@pytest.mark.parametrize("options, message", [
    (dict(shots=(-1,)), "shots must be numbers of demonstrations >= 0"),
    (dict(shots=(2, 2)), "lists a shot count twice"),
    (dict(draws=0), "icl.draws must be at least 1"),
    (dict(orders=1), "at least 2"),
    (dict(order_shots=1), "order_shots must be 0"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        get_task("icl", **options)


def test_shots_beyond_the_context_name_the_context():
    truth = synthetic_truth()
    with pytest.raises(ValueError, match=r"icl.shots 40 does not fit: .* the model's context is 300 tokens; "
                                         r"use shots <= \d+") as e:
        run(FakeLM(lambda q, s: truth[q], context=300), shots=(40,), test_size=10)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="more than the 470 demonstrations"):
        run(FakeLM(lambda q, s: truth[q], context=10**6), shots=(471,), test_size=10, orders=0)
    with pytest.raises(ValueError, match="not even one demonstration fits .* context of 60 tokens"):
        run(FakeLM(lambda q, s: truth[q], context=60), test_size=10)


@pytest.mark.parametrize("options, message", [
    (dict(shots=(0, 1)), "needs at least 2 demonstrations, but the largest shot count is 1"),
    (dict(shots=(1, 2), order_shots=471), "order_shots 471 is more than the 470 demonstrations"),
    (dict(shots=(1, 2), order_shots=30), "icl.order_shots 30 on synthetic: none of 100 random draws"),
])
def test_an_order_set_that_cannot_be_drawn_is_refused_before_anything_is_scored(options, message):
    """The order experiment's settings are checked, and its set drawn, before the accuracy curve runs, so a
    refusal loses no work: the model has seen no prompt when the ValueError comes."""
    truth = synthetic_truth()
    model = FakeLM(lambda q, s: truth[q], context=300)
    with pytest.raises(ValueError, match=message) as e:
        run(model, test_size=10, draws=1, **options)
    assert "\n" not in str(e.value)
    assert model.seen == []


class NaNLM(FakeLM):
    """Logits that are NaN everywhere (a diverged model), or only at one label's first token."""

    def __init__(self, value=float("nan"), only=None):
        super().__init__(lambda q, s: "tool")
        self.value, self.only = value, only

    def forward(self, ids):
        logits = super().forward(ids).logits.clone()
        if self.only is None:
            logits.fill_(self.value)
        else:
            logits[..., self.only] = self.value
        return SimpleNamespace(logits=logits)


@pytest.mark.parametrize("model", [NaNLM(), NaNLM(only=ord("p")), NaNLM(float("inf"), only=ord("a"))],
                         ids=["all-nan", "one-label-nan", "one-label-inf"])
def test_non_finite_logits_are_refused_not_read_as_an_answer(model):
    """argmax over NaN answered the lowest-id label: a NaN model scored that label's share, like a model that
    always answers one label."""
    trie = LabelTrie.from_tokenizer(CharTokenizer(), ["animal", "plant", "metal", "tool"])
    with pytest.raises(ValueError, match=r"the model's logits are not finite \((nan|inf) at a label token of test "
                                         r"prompt 0\): a diverged model or an overflow") as e:
        constrained_decode(model, [[EOS, *CharTokenizer().encode("Item: x\nKind:")]], trie, pad_id=EOS)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="not finite"):
        run(model, shots=(0, 2), draws=1, test_size=8, orders=0)


def test_a_missing_tokenizer_is_refused():
    with pytest.raises(ValueError, match="pass the model's tokenizer"):
        run_task(get_task("icl"), FakeLM(lambda q, p: "tool"), None)


def test_a_dataset_not_installed_names_make_venv(tmp_path, monkeypatch):
    labelled._load.cache_clear()
    monkeypatch.setattr(labelled, "labelled_cache_dir", lambda: tmp_path)
    try:
        with pytest.raises(ValueError, match=r"not installed .*run `make venv`"):
            run(FakeLM(lambda q, s: "positive"), dataset="rotten-tomatoes", test_size=10)
    finally:
        labelled._load.cache_clear()

"""The `needle` task on models whose answers are known: an oracle, a uniform model, a recency-biased one."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from difftransformer.data import PreparedData
from difftransformer.eval.task import EvalConfig, get_task, run_task
from difftransformer.eval.tasks import needle
from difftransformer.model import DiffTransformerLM
from tests.helpers import UniformLM, tiny

CONTEXT = 640


class FakeLM(torch.nn.Module):
    """A causal LM with the black-box interface whose answer rule is known.

    mode "oracle": after a prompt ending with "The special magic {city} number is", it puts all its
    mass on the tokens of " {that city's number}" (read from the prompt), and greedy decoding emits
    them; "last": the same with the number of the last needle before the question; "uniform":
    equal logits everywhere, and greedy decoding emits EOS."""

    def __init__(self, tokenizer, mode: str = "oracle", context: int = CONTEXT):
        super().__init__()
        self.tok, self.mode, self.vocab = tokenizer, mode, tokenizer.vocab_size
        self.config = SimpleNamespace(max_position_embeddings=context)
        self.w = torch.nn.Parameter(torch.zeros(1))

    def answer(self, prefix: list[int]) -> list[int] | None:
        text = self.tok.decode(prefix)
        head, _, tail = text.rpartition("The special magic ")
        if not head or not tail.endswith(" number is") or self.mode == "uniform":
            return None
        city = tail[:-len(" number is")]
        needles = [p.split(" number is: ") for p in text.split("The special magic ")[1:] if " number is: " in p]
        numbers = {c: rest.split(".")[0] for c, rest in needles}
        number = numbers[city] if self.mode == "oracle" else needles[-1][1].split(".")[0]
        return self.tok.encode(" " + number)

    def forward(self, ids: torch.Tensor):
        assert ids.shape[1] <= self.config.max_position_embeddings
        logits = torch.zeros(*ids.shape, self.vocab)
        for b, row in enumerate(ids.tolist()):
            for t in range(len(row) - 1, max(len(row) - 20, 0), -1):  # the prompt ends a few tokens before the end
                ans = self.answer(row[:t + 1])
                if ans is not None:
                    for j, tok in enumerate(ans[:len(row) - t]):
                        logits[b, t + j, tok] = 30.0
                    break
        return SimpleNamespace(logits=logits + 0 * self.w)

    def generate(self, ids: torch.Tensor, n: int, *, temperature: float, eos_token_id: int, **_):
        assert temperature == 0 and ids.shape[1] + n <= self.config.max_position_embeddings
        rows = [((self.answer(r) or []) + [eos_token_id] * n)[:n] for r in ids.tolist()]
        return torch.cat((ids, torch.tensor(rows, dtype=ids.dtype)), dim=1)


@pytest.fixture(scope="module")
def tok(data_dir):
    return PreparedData.load(data_dir).tokenizer()


GRID = dict(needles=(1, 3), queries=(1, 2), depths=(0, 50, 100), samples=2)


@pytest.mark.parametrize("haystack", ["text", "needles"])
def test_an_oracle_scores_one_both_ways(tok, data_dir, haystack):
    result = run_task(get_task("needle", haystack=haystack, **GRID), FakeLM(tok), tok, EvalConfig(data_dir=data_dir))
    assert result.metrics == {"greedy@N1R1": 1.0, "forced_choice@N1R1": 1.0, "greedy@N3R2": 1.0,
                              "forced_choice@N3R2": 1.0, "greedy": 1.0, "forced_choice": 1.0}
    cells = result.details["cells"]
    lengths = result.settings["lengths"]
    assert len(cells) == 3 * (len(lengths["N1R1"]) + len(lengths["N3R2"]))
    assert all(c["scored"] == 2 * c["queries"] for c in cells)
    assert max(lengths["N3R2"]) + result.settings["room"]["N3R2"] <= CONTEXT  # automatic lengths fit with the answer
    json.dumps(result.to_dict())


def test_a_uniform_model_scores_chance_for_forced_choice_and_zero_greedy(tok, data_dir):
    samples = needle.needle_samples(tok, needles=3, queries=2, depth=50, length=500, count=3, seed=0,
                                    text=needle.haystack_text(EvalConfig(data_dir=data_dir), tok, "needle")[0])
    assert len({len(c) for s in samples for c in s.candidate_ids}) == 1  # equal token counts: exact ties
    result = run_task(get_task("needle", **GRID), FakeLM(tok, "uniform"), tok, EvalConfig(data_dir=data_dir))
    assert result.metrics["forced_choice@N3R2"] == pytest.approx(1 / 3)
    assert result.metrics["forced_choice@N1R1"] == 1.0  # one candidate: trivially right
    assert result.metrics["greedy"] == 0.0
    assert all(c["forced_choice_chance"] == pytest.approx(1 / c["needles"]) for c in result.details["cells"])


def test_forced_choice_follows_the_likelihood(tok, data_dir):
    """A model that always answers the last needle before the question is right exactly when the
    target is the last candidate: counted by hand from the prompts."""
    cfg = EvalConfig(data_dir=data_dir, batch_size=5)
    text = needle.haystack_text(cfg, tok, "needle")[0]
    samples = [s for d in (0, 50, 100) for s in needle.needle_samples(
        tok, needles=3, queries=2, depth=d, length=520, count=2, seed=3, text=text)]
    expected = [[float(s.target_index[q] == len(s.candidates) - 1) for q in range(2)] for s in samples]
    assert 0 < sum(map(sum, expected)) < 12  # both outcomes occur
    assert needle.forced_choice_scores(FakeLM(tok, "last"), samples, cfg) == expected
    outputs = needle.greedy_outputs(FakeLM(tok, "last"), tok, samples, 12, cfg)
    assert needle.greedy_scores(outputs, samples) == expected


def test_forced_choice_samples_fit_the_length_and_are_reusable(tok, data_dir):
    cfg = EvalConfig(data_dir=data_dir)
    model = FakeLM(tok, context=600)
    samples = needle.forced_choice_samples(model, tok, cfg, 7, 600)
    assert len(samples) == 7 and {s.depth for s in samples} == {0, 25, 50, 75, 100}
    assert all(len(s.ids) + max(map(len, s.candidate_ids)) <= 600 and len(s.candidates) == 4 for s in samples)
    assert needle.forced_choice_accuracy(model, samples, cfg) == 1.0
    assert needle.forced_choice_accuracy(FakeLM(tok, "uniform", 600), samples, cfg) == pytest.approx(0.25)
    assert [s.ids for s in needle.forced_choice_samples(model, tok, cfg, 7, 600)] == [s.ids for s in samples]


def test_a_real_model_runs_deterministically_with_json_and_a_plot(tok, data_dir, tmp_path):
    torch.manual_seed(0)
    model = DiffTransformerLM(tiny("diff", vocab_size=300, max_position_embeddings=CONTEXT))
    task = get_task("needle", needles=(2,), queries=(1,), depths=(0, 100), lengths=(400, 460), samples=1,
                    max_new_tokens=4)
    cfg = EvalConfig(data_dir=data_dir, eval_seed=4)
    a, b = run_task(task, model, tok, cfg), run_task(task, model, tok, cfg)
    assert a.metrics == b.metrics and a.details == b.details
    assert set(a.metrics) == {"greedy@N2R1", "forced_choice@N2R1", "greedy", "forced_choice"}
    assert [(c["depth"], c["length"]) for c in a.details["cells"]] == [(0, 400), (100, 400), (0, 460), (100, 460)]
    assert all(0 <= c[k] <= 1 for c in a.details["cells"] for k in ("greedy", "forced_choice"))
    assert a.details["examples"]["N2R1"]["answer_needle"].startswith(" The special magic ")
    json.dumps(a.to_dict())
    assert task.plot(a, tmp_path / "needle.png") and (tmp_path / "needle.png").stat().st_size > 10_000


def test_bad_inputs_are_one_line_value_errors(tok, data_dir):
    cfg = EvalConfig(data_dir=data_dir)

    def bad(match, cfg=cfg, model=None, **options):
        with pytest.raises(ValueError, match=match) as e:
            run_task(get_task("needle", **options), model or FakeLM(tok), tok, cfg)
        assert "\n" not in str(e.value)

    bad(f"does not fit the model's context of {CONTEXT} tokens", lengths=(CONTEXT,))
    bad("outside 0..100", depths=(0, 101))
    bad(r"queries \(R=3\) must be between 1 and the number of needles \(N=2\)", needles=(2,), queries=(3,))
    bad("do not fit in a 300-token prompt", needles=(12,), queries=(1,), lengths=(300,))
    bad("do not fit the model's context", needles=(40,), queries=(1,))
    bad("EvalConfig.data_dir", cfg=EvalConfig())
    bad("one queries entry", needles=(1, 2), queries=(1,))
    bad("haystack must be one of", haystack="noise")
    with pytest.raises(ValueError, match="beyond the model's context of 600 tokens"):
        needle.forced_choice_samples(FakeLM(tok, context=600), tok, cfg, 3, 700)


def test_a_length_too_short_for_the_needles_drawn_is_refused_before_any_forward_pass(tok, data_dir):
    """min_prompt_length bounds the lengths up front from the shortest cities; the cities actually drawn for 6
    needles need more, so the refusal comes from building the prompts: before anything is scored, not after
    the N1R1 cells have run."""
    from difftransformer.data.needle import min_prompt_length

    model, calls = FakeLM(tok), []
    forward, generate = model.forward, model.generate
    model.forward = lambda *a, **k: (calls.append("forward"), forward(*a, **k))[1]
    model.generate = lambda *a, **k: (calls.append("generate"), generate(*a, **k))[1]
    task = get_task("needle", needles=(1, 6), queries=(1, 2), lengths=(min_prompt_length(tok, 6, 2, 7),), samples=2)
    with pytest.raises(ValueError, match="rarely fit") as e:
        run_task(task, model, tok, EvalConfig(data_dir=data_dir))
    assert "\n" not in str(e.value)
    assert calls == []


def test_forced_choice_candidates_have_one_token_count_where_digits_merge():
    """With a tokenizer that merges digits, 7-digit numbers take 2-6 tokens: the N candidates of an evaluation
    prompt are drawn with one token count, so a model without preference ties exactly (chance, 1/N) and summed
    log-probabilities compare equally long continuations."""
    import random as _random

    from difftransformer.data import Tokenizer

    rng = _random.Random(0)
    words = ["the", "of", "and", "number", "magic", "special", "is", "city"]
    texts = [" ".join(rng.choice(words) if rng.random() < 0.6 else str(rng.randrange(10, 10**7)) for _ in range(300))
             for _ in range(24)]
    tok = Tokenizer.train(texts, vocab_size=400)
    sizes = {len(tok.encode(" " + str(rng.randrange(10**6, 10**7)))) for _ in range(200)}
    assert len(sizes) > 1  # the precondition: numbers of one digit count differ in tokens
    samples = [s for seed in range(4) for s in needle.needle_samples(
        tok, needles=4, queries=2, depth=50, length=400, count=3, seed=seed, haystack="needles")]
    assert all(len({len(c) for c in s.candidate_ids}) == 1 for s in samples)
    assert len({len(s.candidate_ids[0]) for s in samples}) > 1  # prompts differ from one another, not within
    scores = needle.forced_choice_scores(UniformLM(tok.vocab_size, context=400), samples, EvalConfig())
    assert all(v == 0.25 for row in scores for v in row)


def test_needle_prompts_need_pieces_that_read_as_their_text(tok):
    """Pieces encoded apart must read as their text: a SentencePiece-style tokenizer (a prefix space added to every
    encode) would make the model read "1234567 ." and stray spaces, and is refused in one line; a byte-level BPE whose
    pre-tokenizer joins "." and a following newline (Llama 3's, cl100k) gives other ids at that junction but reads
    the same, and is accepted, as the project's own tokenizer is."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as RawTokenizer

    from difftransformer.data import needle as layout

    class Prefixing:
        eos_id = tok.eos_id
        vocab_size = tok.vocab_size

        def encode(self, text):
            return tok.encode(" " + text)

        def decode(self, ids):
            return tok.decode(ids)

    llama3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
              r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(llama3), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raw.decoder = decoders.ByteLevel()
    text = "\n".join(layout.needle_sentence(c, "1234567") + "\nWhat is it?" for c in layout.CITIES) * 3
    raw.train_from_iterator([text], trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))

    class Llama3Style:
        eos_id = raw.token_to_id("<|endoftext|>")
        vocab_size = raw.get_vocab_size()

        def encode(self, text):
            return raw.encode(text).ids

        def decode(self, ids):
            return raw.decode(list(ids))

    joined = Llama3Style()
    assert joined.encode(".") + joined.encode("\nWhat") != joined.encode(".\nWhat")  # the junction's ids differ
    with pytest.raises(ValueError, match="needle-prompt pieces, encoded apart, do not read as their text"):
        needle.needle_samples(Prefixing(), needles=2, queries=1, depth=50, length=600, count=1, seed=0,
                              haystack="needles")
    for accepted in (tok, joined):
        needle.needle_samples(accepted, needles=2, queries=1, depth=50, length=600, count=1, seed=0, haystack="needles")

"""The shared text scoring of eval/lm.py on models whose answers are known by hand.

A stub LM with fixed logits makes every number computable on paper: uniform logits give an NLL of
log V per token; a model that always predicts "next id = this id + 1" scores a counting sequence
with probability p per step and is greedy exactly on it.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from difftransformer.data import Tokenizer
from difftransformer.eval import continuation_logprob, encode_prompt, generate_text, new_token_budget, token_nll
from difftransformer.eval.lm import continuation_token_logprobs, split_continuation, until_eos
from difftransformer.model import DiffTransformerLM
from tests.helpers import tiny

V = 7


class StubLM(torch.nn.Module):
    """logits[t] = log p over V tokens: mass `p` on (ids[t] + 1) % V, the rest spread evenly (p=None: uniform)."""

    def __init__(self, p: float | None = None, context: int = 64):
        super().__init__()
        self.p, self.config = p, SimpleNamespace(max_position_embeddings=context)

    def forward(self, ids):
        B, T = ids.shape
        if self.p is None:
            return SimpleNamespace(logits=torch.zeros(B, T, V))
        probs = torch.full((B, T, V), (1 - self.p) / (V - 1))
        probs.scatter_(-1, ((ids + 1) % V)[..., None], self.p)
        return SimpleNamespace(logits=probs.log())


class CharTokenizer:
    """One token per character of 'abcdef', EOS = 6: token boundaries are obvious."""

    eos_id = 6

    def encode(self, text):
        return ["abcdef".index(c) for c in text]

    def decode(self, ids):
        return "".join("abcdef"[i] for i in ids)


def test_token_nll_of_uniform_logits_is_log_v():
    ids = torch.randint(0, V, (3, 10))
    nll = token_nll(StubLM(), ids)
    assert nll.shape == (3, 9) and torch.allclose(nll, torch.full((3, 9), math.log(V)))


def test_token_nll_of_a_known_next_token_model():
    ids = torch.tensor([[0, 1, 2, 5, 6]])  # right, right, wrong, right
    nll = token_nll(StubLM(p=0.9), ids)[0]
    wrong = -math.log(0.1 / (V - 1))
    assert torch.allclose(nll, torch.tensor([-math.log(0.9)] * 2 + [wrong, -math.log(0.9)]), atol=1e-6)
    with pytest.raises(ValueError, match="seq_len >= 2"):
        token_nll(StubLM(), torch.tensor([[1]]))


def test_continuation_logprob_sums_the_continuation_tokens_and_says_if_greedy():
    tok, lm = CharTokenizer(), StubLM(p=0.9)
    # EOS(6) -> 'a'(0) is "+1 mod 7": context 'ab', continuation 'cd' follows the counting rule
    score = continuation_logprob(lm, tok, "ab", "cd")
    assert score.num_tokens == 2 and score.greedy
    assert score.logprob == pytest.approx(2 * math.log(0.9), abs=1e-6)
    off = continuation_logprob(lm, tok, "ab", "ce")
    assert not off.greedy and off.logprob == pytest.approx(math.log(0.9) + math.log(0.1 / (V - 1)), abs=1e-6)
    with pytest.raises(ValueError, match="encodes to no tokens"):
        continuation_logprob(lm, tok, "ab", "")


def test_split_continuation_moves_the_context_space_into_the_continuation():
    tok = Tokenizer.train(["the cat sat on the mat. the dog sat on the log."] * 20, vocab_size=300)
    ctx, cont = split_continuation(tok, "the cat sat on the ", "mat")
    assert tok.decode(ctx) == "the cat sat on the" and tok.decode(cont) == " mat"
    assert ctx + cont == tok.encode("the cat sat on the mat")


def test_generate_text_stops_at_eos_and_at_the_context():
    tok = CharTokenizer()
    lm = StubLM(p=1.0 - 1e-9, context=6)
    lm.generate = lambda ids, n, **kw: DiffTransformerLM.generate(_Greedy(lm), ids, n, **kw)
    gen = generate_text(lm, tok, "ab", 10, temperature=0.0)
    # EOS a b | c d e f ... but the context is 6: 3 prompt tokens leave room for 3
    assert gen.max_new_tokens == 3 and gen.text == "cde"
    lm.config.max_position_embeddings = 20
    stopped = generate_text(lm, tok, "de", 10, temperature=0.0)
    assert stopped.text == "f" and stopped.tokens == [5]  # after 'f' (5) comes 6 = EOS: cut there
    with pytest.raises(ValueError, match="the prompt is 19 tokens; the model's context is 20"):
        new_token_budget(lm, encode_prompt(tok, "abcdef" * 3 + "a"), 5)


class _Greedy:
    """Lets the real generate() loop drive a stub (it needs .config, .training, eval/train and a forward)."""

    def __init__(self, lm):
        self.lm, self.config, self.training = lm, lm.config, False

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def __call__(self, ids, **kw):
        return self.lm(ids)


def test_real_model_generate_text_equals_model_generate():
    torch.manual_seed(0)
    model = DiffTransformerLM(tiny()).eval()
    tok = CharTokenizer()
    ids = encode_prompt(tok, "abc")
    assert ids.tolist() == [[6, 0, 1, 2]]
    want = model.generate(ids, 5, temperature=0.0)[0, 4:].tolist()
    got = generate_text(model, _Decoded(), "abc", 5, temperature=0.0)
    want = want[:want.index(6)] if 6 in want else want
    assert got.tokens == want


class _Decoded(CharTokenizer):
    def decode(self, ids):
        return ",".join(map(str, ids))


def test_batched_continuation_token_logprobs_are_known_by_hand_whatever_the_padding():
    """StubLM(p) scores a correct next token log p and a wrong one log((1 - p) / (V - 1)); rows of other
    lengths share a batch, padded with an id or with each row's own last token, and never change."""
    p = 0.6
    right, wrong = math.log(p), math.log((1 - p) / (V - 1))
    rows = [([0, 1], [2, 3]), ([4], [5, 6, 3]), ([1, 2, 3, 4], [2])]
    want = [[right, right], [right, right, wrong], [wrong]]
    for pad_id in (None, 6, 0):
        for batch_size in (1, 2, 3):
            got = continuation_token_logprobs(StubLM(p), rows, batch_size=batch_size, pad_id=pad_id)
            assert [g.tolist() for g in got] == [pytest.approx(w, abs=1e-6) for w in want]
            assert all(g.dtype == torch.float32 for g in got)


def test_until_eos_keeps_what_comes_before_the_first_eos():
    assert until_eos([3, 4, 6, 5, 6], 6) == [3, 4]
    assert until_eos([6, 1], 6) == []
    assert until_eos([1, 2], 6) == [1, 2]


def test_forced_choice_credits_nothing_on_a_nan_score():
    """A NaN log-likelihood (a diverged model) gives NaN, wherever it sits, never a believable 0 or 1; an impossible
    choice (-inf) is an ordinary loser, and all impossible tie."""
    from difftransformer.eval.lm import first_place_share

    for scores in ([math.nan, -5.0], [-5.0, math.nan], [math.nan, math.nan]):
        assert all(math.isnan(first_place_share(scores, i)) for i in range(2))
    assert [first_place_share([-1.0, -math.inf], i) for i in range(2)] == [1.0, 0.0]
    assert [first_place_share([-math.inf, -math.inf], i) for i in range(2)] == [0.5, 0.5]

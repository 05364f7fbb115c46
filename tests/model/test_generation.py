"""Generation: greedy equals step-wise argmax, left padding equals one-by-one, seeded sampling, filters."""

import pytest
import torch

from difftransformer import DiffTransformerLM
from difftransformer.model import filter_logits, sample_next_token
from tests.helpers import tiny


def test_greedy_generation_matches_stepwise_argmax():
    torch.manual_seed(2)
    model = DiffTransformerLM(tiny()).eval()
    prompt = torch.randint(0, 512, (2, 6))
    out = model.generate(prompt, 12, temperature=0)
    seq = prompt
    for _ in range(12):  # no cache: recompute everything, take the argmax
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    assert torch.equal(model.generate(prompt, 12, temperature=0, use_cache=False), seq)


@pytest.mark.parametrize("kind", ["diff", "transformer", "diff_v2"])
def test_left_padded_batch_generation_equals_one_by_one(kind):
    torch.manual_seed(3)
    model = DiffTransformerLM(tiny(kind)).eval()
    a, b = torch.randint(1, 512, (1, 9)), torch.randint(1, 512, (1, 4))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :5] = 0
    out = model.generate(batch, 8, temperature=0, attention_mask=mask)
    assert torch.equal(out[0, 9:], model.generate(a, 8, temperature=0)[0, 9:])
    assert torch.equal(out[1, 9:], model.generate(b, 8, temperature=0)[0, 4:])


def test_sampling_is_seeded_and_eos_stops():
    torch.manual_seed(4)
    model = DiffTransformerLM(tiny()).eval()
    prompt = torch.randint(0, 512, (3, 5))
    kw = dict(temperature=0.9, top_k=50, top_p=0.9)
    a = model.generate(prompt, 10, generator=torch.Generator().manual_seed(7), **kw)
    b = model.generate(prompt, 10, generator=torch.Generator().manual_seed(7), **kw)
    assert torch.equal(a, b)
    first = model.generate(prompt[:1], 1, temperature=0)[0, -1].item()
    out = model.generate(prompt[:1], 10, temperature=0, eos_token_id=first)
    assert out.shape[1] == 6  # stopped right after emitting eos


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2)[0, 2:]).all()
    assert torch.isfinite(filter_logits(logits, top_k=2)[0, :2]).all()
    kept = torch.isfinite(filter_logits(logits, top_p=0.7))[0].tolist()
    assert kept == [True, True, False, False]  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    assert torch.isfinite(filter_logits(logits, top_p=0.01))[0].tolist() == [True, False, False, False]
    g = torch.Generator().manual_seed(0)
    draws = [sample_next_token(logits, top_k=1, generator=g).item() for _ in range(20)]
    assert set(draws) == {0}
    with pytest.raises(ValueError, match="top_p must be in"):
        filter_logits(logits, top_p=1.5)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        sample_next_token(logits, temperature=-1)


def test_a_diverged_model_is_a_clear_error_not_a_sampling_traceback():
    model = DiffTransformerLM(tiny())
    with torch.no_grad():
        model.norm.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="non-finite logits .* earlier checkpoint"):
        model.generate(torch.tensor([[1, 2, 3]]), 4)

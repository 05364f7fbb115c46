"""The fused CPU kernel's inference path for DIFF (many queries, no gradient: a prefill, an evaluation).

It keeps each query block's scores over all visible keys and merges the two maps before P V
(`flash_cpu.infer_path_applies` states when it runs). Checked against the independent float64
reference (tests/reference.py) with the tolerance of the other kernel tests: query blocks that do
and do not fill the kernel's 64 rows, bottom-right causal offsets, T > S (rows that see no key),
padding, MHA and GQA, NaN propagation, the fused head norm, bf16, the dispatch rule, and a DIFF LM's
prefill logits equal to its training-path logits.
"""

import pytest
import torch

from difftransformer import DiffTransformerLM, differential_attention
from difftransformer.kernels import flash_cpu
from tests.helpers import count_op_calls, padding_mask, random_inputs, rel_err, shape_id, tiny
from tests.reference import diff_attention_reference

pytestmark = pytest.mark.usefixtures("cpp_extension")


@pytest.fixture
def infer_calls(monkeypatch):
    return count_op_calls(monkeypatch, n="diff_flash_infer")


# (B, h, h_kv, T, S): one block plus one row; several blocks with a causal offset (S > T); GQA n_rep 2
# and 4 (then 33 queries already exceed the decode path's 64 rows); T > S (early causal rows see no key,
# and whole query blocks too); a key length past the training path's 256-key blocks.
SHAPES = [(1, 2, 2, 65, 65), (2, 4, 2, 100, 300), (1, 2, 1, 130, 130), (1, 4, 1, 33, 40), (3, 2, 2, 200, 70),
          (1, 2, 2, 70, 513)]


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_infer_matches_reference(shape, causal, padded, infer_calls):
    B, h, h_kv, T, S = shape
    q, k, v = random_inputs(B, h, h_kv, T, S, 16, seed=S * 3 + T)
    mask = padding_mask(B, S, S) if padded else None
    lam = torch.empty(()).uniform_(-0.5, 0.9)  # λ of either sign
    with torch.no_grad():
        out = differential_attention(q, k, v, lam, causal=causal, key_padding_mask=mask, backend="cpp")
    assert infer_calls["n"] == 1
    ref = diff_attention_reference(q, k, v, lam.item(), causal=causal, key_padding_mask=mask)
    assert out.shape == (B, h, T, 32) and rel_err(out, ref) <= 1e-5


def test_infer_equals_the_training_path():
    """Same inputs through both paths (the training path is forced by asking for a gradient)."""
    q, k, v = random_inputs(2, 4, 2, 150, 400, 32, seed=12)
    with torch.no_grad():
        fast = differential_attention(q, k, v, torch.tensor(0.45), backend="cpp")
    slow = differential_attention(q.requires_grad_(), k, v, torch.tensor(0.45), backend="cpp")
    assert slow.requires_grad
    torch.testing.assert_close(fast, slow.detach(), rtol=1e-5, atol=1e-6)


def test_nan_rows_and_rows_that_see_nothing_behave_as_softmax(infer_calls):
    q, k, v = random_inputs(1, 2, 2, 100, 300, 16, seed=9)
    q[0, 1, 70, 3] = float("nan")  # map 2 of head 0, query 70
    k[0, 2, 250, 0] = float("nan")  # map 1 of head 1, key 250: the queries of head 1 that see it (t >= 50)
    mask = torch.ones(1, 300, dtype=torch.bool)
    mask[0, :205] = False  # causal query 0 sees keys up to 200: all padded, so it sees nothing
    with torch.no_grad():
        out = differential_attention(q, k, v, torch.tensor(0.5), key_padding_mask=mask, backend="cpp")
        eager = differential_attention(q, k, v, torch.tensor(0.5), key_padding_mask=mask, backend="eager")
    assert infer_calls["n"] == 2 - 1  # the eager call does not use the kernel
    assert torch.equal(out.isnan(), eager.isnan()) and out[0, 0, 70].isnan().all()
    assert not out[0, 0, 69].isnan().any()  # the poison stays in its row
    assert out[0, 1, 50:].isnan().all() and not out[0, 1, :50].isnan().any()
    assert torch.equal(out[0, :, :5], torch.zeros_like(out[0, :, :5]))  # queries 0-4 see no key
    ok = ~eager.isnan()
    torch.testing.assert_close(out[ok], eager[ok], rtol=1e-5, atol=1e-6)


def test_fused_head_norm_and_bf16(infer_calls):
    q, k, v = random_inputs(2, 2, 2, 90, 120, 16, seed=4)
    w, eps = torch.rand(32) + 0.5, 1e-5
    with torch.no_grad():
        normed = differential_attention(q, k, v, torch.tensor(0.6), backend="cpp", out_norm=(w, eps))
    ref = diff_attention_reference(q, k, v, 0.6)
    ref = ref / torch.sqrt(ref.square().mean(-1, keepdim=True) + eps) * w.double()
    assert rel_err(normed, ref) <= 1e-5
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    with torch.no_grad():
        half = differential_attention(qb, kb, vb, torch.tensor(0.6), backend="cpp")
        full = differential_attention(qb.float(), kb.float(), vb.float(), torch.tensor(0.6), backend="cpp")
    assert half.dtype == torch.bfloat16 and torch.equal(half, full.to(torch.bfloat16))
    assert infer_calls["n"] == 3


def test_dispatch_rule():
    q, k, v = random_inputs(1, 4, 2, 40, 50, 8)  # n_rep 2 x 40 queries = 80 rows: not the decode path
    lam = torch.tensor(0.5)
    assert flash_cpu.infer_path_applies(q, k, q, k, v, lam)
    assert not flash_cpu.infer_path_applies(q[:, :, :32], k, q, k, v, lam)  # 64 rows: the decode path's
    for needs_grad in (q, k, v, lam):
        needs_grad.requires_grad_(True)
        assert not flash_cpu.infer_path_applies(q, k, q, k, v, lam)  # never under grad
        with torch.no_grad():
            assert flash_cpu.infer_path_applies(q, k, q, k, v, lam)
        needs_grad.requires_grad_(False)
    long_k = torch.empty(1, 4, flash_cpu.INFER_MAX_KEYS + 1, 8)  # more kept scores than allowed: training path
    assert not flash_cpu.infer_path_applies(q, long_k, q, long_k, v, lam)


def test_lm_prefill_logits_equal_the_training_path(infer_calls):
    model = DiffTransformerLM(tiny(attention="diff", attn_backend="cpp")).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 90))
    with torch.no_grad():
        fast = model(ids).logits
    assert infer_calls["n"] == model.config.num_hidden_layers
    slow = model(ids).logits  # parameters require grad: the training path
    torch.testing.assert_close(fast, slow.detach(), rtol=1e-4, atol=1e-5)

"""RoPE (GPT-J interleaved) against the formula, on any view, and its relative-position property."""

import pytest
import torch

from difftransformer import RotaryEmbedding
from tests.helpers import rel_err
from tests.reference import rope_reference


def test_rope_matches_formula():
    x = torch.randn(2, 3, 11, 16)
    pos = torch.arange(5, 16)
    rope = RotaryEmbedding(16, theta=500.0)
    assert rel_err(rope(x, pos), rope_reference(x, pos.tolist(), 500.0)) <= 1e-6
    per_row = torch.stack([pos, pos + 3])  # (B, T) positions
    out = rope(x, per_row)
    assert rel_err(out[1], rope_reference(x[1], (pos + 3).tolist(), 500.0)) <= 1e-6


def test_rope_on_views_that_cannot_be_complex():
    """Odd offsets/strides take the contiguous fallback and still match the formula."""
    base = torch.randn(2, 5, 21)
    x = base[:, :, 1:17]  # storage offset 1: pairs not complex-aligned
    rope = RotaryEmbedding(16)
    pos = torch.arange(5)
    assert rel_err(rope(x, pos), rope_reference(x, pos.tolist())) <= 1e-6
    xt = torch.randn(5, 2, 16).transpose(0, 1)  # a transposed view (layers pass these)
    assert rel_err(rope(xt, pos), rope_reference(xt, pos.tolist())) <= 1e-6


def test_rope_relative():
    """<rope(q, m), rope(k, n)> depends only on m - n."""
    rope = RotaryEmbedding(8)
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    dots = [(rope(q[None], torch.tensor([m])) @ rope(k[None], torch.tensor([m - 3])).T).item() for m in (3, 50, 999)]
    assert max(dots) - min(dots) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_shared_table_gives_the_directly_computed_rotations(dtype):
    """Default positions start .. start + T - 1 come from a table (grown by doubling past 256, 512, ...):
    the same values as the direct float64 computation, bit for bit, on both sides of each growth."""
    rope = RotaryEmbedding(16, theta=5000.0 + torch.rand(()).item())  # a theta no other test shares
    for start, T in ((0, 1), (255, 2), (0, 300), (511, 1), (700, 64), (3, 1000)):
        pos = torch.arange(start, start + T)
        tabled = rope.rotation(pos, dtype, start=start)
        direct = rope.rotation(pos, dtype)
        assert tabled.dtype == direct.dtype and torch.equal(tabled, direct), (start, T)


def test_a_table_built_in_inference_mode_serves_training():
    rope = RotaryEmbedding(8, theta=1234.5)
    with torch.inference_mode():
        rope.rotation(torch.arange(4), start=0)  # the table is built here first
    x = torch.randn(1, 2, 4, 8, requires_grad=True)
    out = rope.rotate(x, rope.rotation(torch.arange(4), start=0))
    out.square().sum().backward()  # an inference tensor saved for backward would raise here
    assert x.grad is not None


def test_compiled_rope_is_real_arithmetic_and_matches_the_formula():
    """Under torch.compile the rotation is (cos, sin) pairs: Inductor fuses the rotation into one kernel instead
    of copying into and out of complex layout around an eager multiply, and the values are the formula's."""
    from torch._inductor.utils import run_and_get_code

    rope = RotaryEmbedding(16, theta=500.0)
    token_major = torch.randn(2, 5, 3, 16).transpose(1, 2)  # (B, H, T, d) as a layer's projection view
    for x in (token_major, token_major.contiguous()):
        for pos in (torch.arange(3, 8), torch.stack([torch.arange(5), torch.arange(2, 7)])):  # (T,), per row
            compiled = torch.compile(lambda x, pos: rope(x, pos), fullgraph=True, dynamic=False)
            out, codes = run_and_get_code(compiled, x, pos)
            assert not any("complex" in code for code in codes)
            want = (rope_reference(x, pos.tolist(), 500.0) if pos.dim() == 1 else
                    torch.stack([rope_reference(x[b], pos[b].tolist(), 500.0) for b in range(2)]))
            assert rel_err(out, want) <= 1e-6
            # written in x's memory order: a token-major q stays token-major (its gradient then needs no copy)
            assert (out.stride(1) < out.stride(2)) == (x.stride(1) < x.stride(2))
            torch._dynamo.reset()

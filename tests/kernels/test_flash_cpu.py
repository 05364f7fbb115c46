"""The fused C++ CPU kernel (backend 'cpp') against the independent float64 reference.

The shared backend tests in tests/attention/ already run 'cpp' at small shapes, for both the
differential kernel and the ordinary one (the matched baseline's); these add shapes that cross the
kernels' query (64) and key (256) blocks, determinism, dtype handling and tracing under torch.compile.
"""

import pytest
import torch

from difftransformer import differential_attention
from difftransformer.attention import multihead_attention
from tests.helpers import (
    check_forward_and_grads,
    lambda_grad_error,
    padding_mask,
    random_inputs,
    rel_err,
)
from tests.reference import diff_attention_reference, mha_reference

pytestmark = pytest.mark.usefixtures("cpp_extension")


def check_against_reference(B, h, h_kv, T, S, d, causal, lam, padded=False, seed=0):
    q, k, v = random_inputs(B, h, h_kv, T, S, d, seed=seed, grad=True)
    lam_t = torch.tensor(lam, requires_grad=True)
    mask = padding_mask(B, S, seed) if padded else None
    out = differential_attention(q, k, v, lam_t, causal=causal, key_padding_mask=mask, backend="cpp")
    ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v, lam_t)]
    ref = diff_attention_reference(*ref_in, causal=causal, key_padding_mask=mask)
    assert out.shape == (B, h, T, 2 * d)
    g = check_forward_and_grads(out, ref, (q, k, v), ref_in[:3])
    assert lambda_grad_error(lam_t.grad, ref_in[3].grad, g, q, k, v, causal=causal, key_padding_mask=mask) <= 1e-6


# (B, h, h_kv, T, S, d, causal, lam, padded): lengths that are not multiples of the blocks, that
# span several key blocks, T < S (cached decoding), T > S (causal rows that see no key), GQA 1/2/4.
CASES = [
    (1, 2, 2, 300, 300, 64, True, 0.5, False),
    (2, 4, 1, 130, 600, 32, True, -0.6, True),
    (1, 4, 2, 257, 513, 16, False, 1.4, False),
    (2, 2, 1, 600, 200, 16, True, 0.3, False),
    (1, 2, 2, 1, 700, 32, True, 0.8, True),
    (1, 1, 1, 65, 65, 128, True, 0.2, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}h{}kv{}T{}S{}d{}{}lam{}{}".format(
    *c[:6], "c" if c[6] else "n", c[7], "pad" if c[8] else ""))
def test_block_crossing_shapes_match_reference(case):
    check_against_reference(*case, seed=sum(case[:6]))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}h{}kv{}T{}S{}d{}{}{}".format(
    *c[:6], "c" if c[6] else "n", "pad" if c[8] else ""))
def test_ordinary_attention_block_crossing_shapes_match_reference(case):
    B, h, h_kv, T, S, d, causal, _, padded = case
    g = torch.Generator().manual_seed(sum(case[:6]))
    q = torch.randn(B, 2 * h, T, d, generator=g, requires_grad=True)  # the baseline has 2h heads
    k, v = (torch.randn(B, 2 * h_kv, S, d, generator=g, requires_grad=True) for _ in range(2))
    mask = padding_mask(B, S, T) if padded else None
    out = multihead_attention(q, k, v, causal=causal, key_padding_mask=mask, backend="cpp")
    ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    check_forward_and_grads(out, mha_reference(*ref_in, causal=causal, key_padding_mask=mask), (q, k, v), ref_in)


def test_deterministic():
    q, k, v = random_inputs(2, 4, 2, 200, 200, 32, seed=1, grad=True)
    lam = torch.tensor(0.4, requires_grad=True)
    do = torch.randn(2, 4, 200, 64)
    runs = [torch.autograd.grad(differential_attention(q, k, v, lam, backend="cpp"), (q, k, v, lam), do)
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_low_precision_is_computed_in_fp32_and_cast_back():
    q, k, v = random_inputs(1, 2, 2, 70, 70, 16, dtype=torch.bfloat16, seed=2)
    out = differential_attention(q, k, v, torch.tensor(0.5), backend="cpp")
    assert out.dtype == torch.bfloat16
    full = differential_attention(q.float(), k.float(), v.float(), torch.tensor(0.5), backend="cpp")
    assert torch.equal(out, full.to(torch.bfloat16))


def test_traces_under_torch_compile():
    q, k, v = random_inputs(1, 2, 1, 50, 50, 16, seed=4, grad=True)
    lam = torch.tensor(0.5, requires_grad=True)

    def f(q, k, v, lam):
        return differential_attention(q, k, v, lam, backend="cpp").square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v, lam), (q, k, v, lam))
    want = torch.autograd.grad(f(q, k, v, lam), (q, k, v, lam))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_transposed_views_are_read_in_place():
    """The layer hands over (B, T, H, d) projections viewed as (B, H, T, d); results and gradients
    must not depend on the layout, and dq comes back in the same layout as q."""
    q, k, v = random_inputs(2, 4, 2, 90, 90, 16, seed=5)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True) for t in (q, k, v)]
    dense = [t.clone().requires_grad_(True) for t in (q, k, v)]
    do = torch.randn(2, 4, 90, 32)
    lam = torch.tensor(0.7)
    outs, grads = [], []
    for inputs in (views, dense):
        out = differential_attention(*inputs, lam, backend="cpp")
        outs.append(out)
        grads.append(torch.autograd.grad(out, inputs, do))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert grads[0][0].stride() == views[0].stride()


def test_broadcast_and_odd_strides_are_handled():
    """Expanded (stride-0) length axes, size-1 dims with odd strides (which `.contiguous()` keeps)
    and empty inputs must not reach BLAS as invalid matrices."""
    q, k, v = random_inputs(1, 2, 1, 9, 9, 8, seed=6)
    k_row, v_row = k[:, :, :1].expand(1, 2, 9, 8), v[:, :, :1].expand(1, 1, 9, 16)  # every key the same
    out = differential_attention(q, k_row, v_row, torch.tensor(0.3), backend="cpp")
    assert rel_err(out, diff_attention_reference(q, k_row.contiguous(), v_row.contiguous(), 0.3)) <= 1e-5
    q1 = torch.randn(1, 2, 8, 1).transpose(-1, -2)  # T = 1 with stride(-2) = 1 < d: "contiguous" to PyTorch
    assert q1.is_contiguous() and q1.stride(-2) < q1.shape[-1]
    out = differential_attention(q1, k, v, torch.tensor(0.3), backend="cpp")
    assert rel_err(out, diff_attention_reference(q1, k, v, 0.3)) <= 1e-5
    d1 = [torch.randn(2, 3, 5, 2)[..., :1] for _ in range(3)]  # d = 1 with stride(-1) = 1, stride(-2) = 2
    assert rel_err(multihead_attention(*d1, backend="cpp"), mha_reference(*d1)) <= 1e-5
    q0, k0, v0 = random_inputs(1, 2, 1, 0, 5, 8, grad=True)  # T = 0: empty output, empty gradients
    differential_attention(q0, k0, v0, 0.5, backend="cpp").sum().backward()
    assert q0.grad.shape == q0.shape and k0.grad.abs().sum() == 0


def test_value_dim_other_than_query_dim_uses_sdpa():
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    v = torch.randn(1, 2, 5, 8)
    out = multihead_attention(q, k, v, backend="cpp")
    assert rel_err(out, mha_reference(q, k, v)) <= 1e-5


def test_non_finite_scores_give_nan_like_softmax():
    """A NaN in q must surface as NaN (the trainer's divergence check relies on it), not as zeros."""
    q, k, v = random_inputs(1, 2, 1, 70, 300, 16, seed=8)
    q[0, 1, 40, 3] = float("nan")
    out = differential_attention(q, k, v, torch.tensor(0.5), backend="cpp")
    eager = differential_attention(q, k, v, torch.tensor(0.5), backend="eager")
    assert torch.equal(out.isnan(), eager.isnan()) and out.isnan().any()
    assert torch.isfinite(out[0, 1, :40]).all()


def test_double_backward_is_refused():
    q, k, v = random_inputs(1, 2, 1, 6, 6, 8, grad=True)
    (dq,) = torch.autograd.grad(differential_attention(q, k, v, 0.5, backend="cpp").sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        dq.sum().backward()


@pytest.mark.parametrize("seconds,after", [(0.0, 0.5), (0.6, 0.1)], ids=["cached", "compiling"])
def test_a_slow_build_says_so_in_one_line(seconds, after, monkeypatch, capsys):
    """Compiling the extension takes 10-40 s on first use: a load slower than BUILD_NOTICE_AFTER_S prints one line
    on stderr saying so; loading a cached build prints nothing. Each case leaves 0.5 s between the load's end and
    the notice's time, so a busy machine does not turn one case into the other."""
    import time

    from torch.utils import cpp_extension

    from difftransformer.kernels import flash_cpu

    monkeypatch.setattr(flash_cpu, "BUILD_NOTICE_AFTER_S", after)
    monkeypatch.setattr(flash_cpu, "_state", {})  # the real build's state stays as it is
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: time.sleep(seconds) or "built")
    flash_cpu._build()
    time.sleep(1.0)  # a notice that was not cancelled would print by now, even on a busy machine
    err = capsys.readouterr().err.strip().splitlines()
    assert flash_cpu._state["module"] == "built"
    assert len(err) == (0 if seconds == 0 else 1) and all("compiling the fused CPU attention kernel" in e for e in err)


def test_build_raises_one_line_naming_the_cause_and_the_fix_and_is_available_answers(monkeypatch):
    """A failed build: `build()` raises one line with the cause and the way out, again on every call without a
    second attempt; `is_available()` answers False without raising; `build_error()` keeps the whole text."""
    from difftransformer.kernels import flash_cpu

    attempts = []

    def failing_build():
        attempts.append(1)
        raise OSError("no C++ compiler found\n[1/2] c++ -O3 flash_cpu.cpp\nexit status 1")

    monkeypatch.setattr(flash_cpu, "_state", {})  # the real build's state stays as it is
    monkeypatch.setattr(flash_cpu, "_build", failing_build)
    for _ in range(2):
        with pytest.raises(RuntimeError) as raised:
            flash_cpu.build()
        message = str(raised.value)
        assert "\n" not in message and "OSError: no C++ compiler found" in message
        assert "backend='sdpa'" in message and "install a C++ compiler and ninja" in message
    assert attempts == [1] and flash_cpu.is_available() is False and flash_cpu.loaded_module() is None
    assert flash_cpu.build_error() == "OSError: no C++ compiler found\n[1/2] c++ -O3 flash_cpu.cpp\nexit status 1"


def test_is_available_builds_once_and_build_is_then_a_no_op(monkeypatch):
    from difftransformer.kernels import flash_cpu

    builds = []
    monkeypatch.setattr(flash_cpu, "_state", {})
    monkeypatch.setattr(flash_cpu, "_build", lambda: builds.append(1) or flash_cpu._state.update(module="built"))
    monkeypatch.setattr(flash_cpu, "_register_fakes", lambda: None)
    assert flash_cpu.loaded_module() is None and builds == []  # answering "is it loaded" never builds
    assert flash_cpu.is_available() and flash_cpu.is_available()
    flash_cpu.build()
    assert builds == [1] and flash_cpu.loaded_module() == "built" and flash_cpu.build_error() is None


def test_a_disabled_kernel_is_not_built_and_says_why(monkeypatch):
    from difftransformer.kernels import flash_cpu

    monkeypatch.setattr(flash_cpu, "_state", {})
    monkeypatch.setattr(flash_cpu, "_build", lambda: pytest.fail("built although disabled"))
    monkeypatch.setenv("DIFFTRANSFORMER_DISABLE_CPU_KERNEL", "1")
    with pytest.raises(RuntimeError, match=r"could not be built \(disabled by DIFFTRANSFORMER_DISABLE_CPU_KERNEL=1\)"):
        flash_cpu.build()
    assert not flash_cpu.is_available()

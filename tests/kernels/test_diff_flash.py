"""The fused Triton kernel against the float64 explicit-map reference: forward and every gradient.

Without CUDA the kernels run on CPU through the Triton interpreter (TRITON_INTERPRET=1, set in
conftest.py before anything imports Triton), so shapes stay tiny and the interpreter uses 16 x 16 blocks:
lengths up to 70 still exercise several blocks, ragged tails and the causal block skipping.
"""

import pytest
import torch

pytest.importorskip("triton")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from difftransformer.kernels import diff_flash, triton_runs  # noqa: E402
from difftransformer.kernels.diff_flash import diff_flash_attention  # noqa: E402
from tests.helpers import CPP_KERNEL_DISABLED  # noqa: E402
from tests.reference import diff_attention_reference  # noqa: E402

if not triton_runs() or (not diff_flash._INTERPRET and not torch.cuda.is_available()):
    pytest.skip("Triton cannot run here (no CUDA and the kernels were not built for the interpreter)",
                allow_module_level=True)


DEVICE = "cpu" if diff_flash._INTERPRET else "cuda"


# Max error relative to the reference's largest magnitude. fp32 is exact up to rounding; half
# precisions round the inputs' products (P, dS) to 8 or 11 mantissa bits, as flash kernels do.
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def make_inputs(B, h, h_kv, T, S, d, dtype, seed, strided=False):
    """Random q, k, v (leaves needing grad) and dO. strided=True gives the non-contiguous views
    a layer produces: (B, T, heads, dim).transpose(1, 2)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        x = torch.randn(*shape, generator=g).to(DEVICE, dtype)
        return x.transpose(1, 2) if strided else x

    if strided:
        q, k, v = rnd(B, T, 2 * h, d), rnd(B, S, 2 * h_kv, d), rnd(B, S, h_kv, 2 * d)
        do = rnd(B, T, h, 2 * d)
    else:
        q, k, v = rnd(B, 2 * h, T, d), rnd(B, 2 * h_kv, S, d), rnd(B, h_kv, S, 2 * d)
        do = rnd(B, h, T, 2 * d)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def max_rel_err(got, want):
    return ((got.detach().cpu().double() - want).abs().max() / want.abs().max().clamp_min(1.0)).item()


def run_and_compare(B, h, h_kv, T, S, d, causal, lam, dtype=torch.float32, seed=0, strided=False, scale=None,
                    deterministic=True):
    q, k, v, do = make_inputs(B, h, h_kv, T, S, d, dtype, seed, strided)
    lam_t = torch.tensor(lam, dtype=torch.float32, device=DEVICE, requires_grad=True)
    out = diff_flash_attention(q, k, v, lam_t, causal=causal, scale=scale, deterministic=deterministic)
    assert out.shape == (B, h, T, 2 * d) and out.dtype == dtype
    out.backward(do)

    qr, kr, vr = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    lr = torch.tensor(lam, dtype=torch.float64, requires_grad=True)
    ref, maps = diff_attention_reference(qr, kr, vr, lr, causal=causal, scale=scale, return_maps=True)
    ref.backward(do.cpu().double())

    tol = TOL[dtype]
    for name, got, want in [("out", out, ref), ("dq", q.grad, qr.grad), ("dk", k.grad, kr.grad),
                            ("dv", v.grad, vr.grad)]:
        assert got.shape == want.shape, name
        err = max_rel_err(got, want)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"
    # dlam = -sum(dO * A2 V) can cancel to near zero, so its error is measured against the sum of
    # its terms' magnitudes rather than against its own value.
    o2 = maps[2] @ vr.detach().repeat_interleave(h // h_kv, dim=1)
    dlam_scale = (do.cpu().double().abs() * o2.abs()).sum().clamp_min(1e-12)
    err = (lam_t.grad.cpu().double() - lr.grad).abs().item() / dlam_scale.item()
    assert lam_t.grad.shape == () and err <= tol, f"dlam: relative error {err:.2e} > {tol:.0e}"
    return out


# (B, h, h_kv, T, S, d, causal, lam): GQA n_rep 1/2/4, ragged and block-aligned lengths, T = 1, S = 1,
# T > S (causal rows that see no key), lam negative and > 1, d = 32/64/96/128 (96 pads to 128).
CASES = [
    (1, 2, 2, 33, 33, 32, True, 0.8),
    (1, 2, 2, 32, 32, 32, True, 0.2),
    (2, 2, 2, 40, 40, 64, False, -0.5),
    (1, 4, 2, 37, 53, 32, True, 1.7),
    (1, 4, 2, 53, 37, 32, False, 1.3),
    (1, 4, 1, 29, 45, 64, False, 0.3),
    (2, 4, 1, 21, 21, 32, True, -0.9),
    (1, 2, 1, 1, 50, 96, True, 0.6),
    (1, 2, 2, 1, 19, 32, False, 2.5),
    (1, 2, 2, 50, 20, 32, True, 0.5),
    (2, 2, 2, 17, 70, 96, False, -1.2),
    (1, 2, 1, 48, 64, 96, True, 0.9),
    (1, 2, 1, 5, 1, 32, True, 0.4),
    (1, 4, 2, 17, 1, 64, False, -0.7),
    (1, 4, 2, 23, 41, 128, True, -0.3),
    (1, 2, 2, 36, 19, 128, False, 1.1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}h{}kv{}T{}S{}d{}{}lam{}".format(
    *c[:6], "causal" if c[6] else "full", c[7]))
def test_fp32_matches_reference(case):
    run_and_compare(*case, seed=sum(case[:6]))


# The one-pass backward (dQ added with atomics in the key-block pass) on the cases that stress it:
# several key blocks and both mask phases adding into each dQ row, GQA n_rep 2/4, T = 1, T > S
# (rows that see no key), ragged lengths, d = 96 padded to 128 and d = 128, causal and not.
@pytest.mark.parametrize("case", [CASES[i] for i in (0, 2, 3, 4, 6, 7, 9, 10, 12, 13, 14)],
                         ids=lambda c: "B{}h{}kv{}T{}S{}d{}{}lam{}".format(*c[:6], "causal" if c[6] else "full", c[7]))
def test_one_pass_backward_matches_reference(case):
    run_and_compare(*case, seed=sum(case[:6]) + 1, deterministic=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_pass_backward_half_precision(dtype):
    run_and_compare(1, 4, 2, 45, 45, 64, True, 0.8, dtype=dtype, seed=11, deterministic=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [(1, 2, 1, 35, 35, 64, True, 0.8), (2, 2, 2, 19, 41, 32, False, -0.4),
                                  (1, 2, 2, 40, 24, 96, True, 1.5), (1, 2, 1, 33, 33, 128, True, -0.6)])
def test_half_precision_matches_reference(case, dtype):
    run_and_compare(*case, dtype=dtype, seed=7)


@pytest.mark.parametrize("causal", [True, False])
def test_strided_views_and_custom_scale(causal):
    """q, k, v and dO as transposed views are read in place; an explicit scale is honoured."""
    run_and_compare(2, 4, 2, 27, 38, 32, causal, 0.7, strided=True, scale=0.3)


# The key-block pass split into a dK1/dK2 program and a dV program per key block (SPLIT tiles, which
# give d = 128 wgmma tiles on an H100). The interpreter autotunes over one unsplit tile, so these pin
# the split one.
SPLIT_TILE = (16, 16, 1, 1, diff_flash.SPLIT_FLAG)


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 3, 4, 6, 7, 9, 10, 12, 14, 15)],
                         ids=lambda c: "B{}h{}kv{}T{}S{}d{}{}lam{}".format(*c[:6], "causal" if c[6] else "full", c[7]))
def test_split_key_block_pass_matches_reference(case):
    with diff_flash.pinned(diff_flash._diff_bwd_dkdv_kernel, SPLIT_TILE):
        run_and_compare(*case, seed=sum(case[:6]) + 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_key_block_pass_half_precision_strided(dtype):
    with diff_flash.pinned(diff_flash._diff_bwd_dkdv_kernel, SPLIT_TILE):
        run_and_compare(1, 4, 2, 33, 33, 128, True, -0.6, dtype=dtype, seed=5, strided=True)


@pytest.mark.parametrize("causal", [True, False])
def test_split_key_block_pass_writes_what_the_fused_pass_writes(causal):
    """Called directly on outputs filled with NaN: the split pass's two programs write every element of
    dK and dV, and the same bits as the one-program pass (same products in the same order)."""
    B, h, h_kv, T, S, d = 2, 4, 2, 37, 45, 32
    q, k, v, do = (x.detach() for x in make_inputs(B, h, h_kv, T, S, d, torch.float32, seed=41 + causal))
    lam, scale = torch.tensor(0.65, device=DEVICE), d ** -0.5
    out, o2, lse1, lse2, _, _ = diff_flash._fwd_impl(q, k, v, lam, None, causal, scale, 0.0)
    r2 = (do * o2).sum(-1)
    d1 = (do * out).sum(-1) + lam * r2

    def key_pass(tile):
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        kernel, grid, args, meta = diff_flash.bwd_dkdv_launch(do, q, k, v, lam, lse1, lse2, d1, r2, dk, dv,
                                                              causal, scale)
        with diff_flash.pinned(kernel, tile):
            kernel[grid](*args, **meta)
        return dk, dv

    fused, split = key_pass((16, 16, 1, 1)), key_pass(SPLIT_TILE)
    assert torch.isfinite(fused[0]).all() and torch.isfinite(fused[1]).all()
    assert torch.equal(split[0], fused[0]) and torch.equal(split[1], fused[1])


def test_split_tiles_are_for_the_key_block_kernels_only():
    with pytest.raises(ValueError, match="only the key-block kernels do"):
        diff_flash.tile_config(SPLIT_TILE, diff_flash._diff_bwd_dq_kernel.fn)
    with pytest.raises(ValueError, match="fifth field may only be 'split'"):
        diff_flash.tile_config((16, 16, 1, 1, "spilt"), diff_flash._diff_bwd_dkdv_kernel.fn)
    config = diff_flash.tile_config(SPLIT_TILE, diff_flash._diff_bwd_dkdv_kernel.fn)
    assert config.kwargs == {"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT": True}
    assert diff_flash.tile_config((16, 16, 1, 1), diff_flash._diff_bwd_dkdv_kernel.fn).kwargs["SPLIT"] is False
    assert diff_flash._tile(config) == SPLIT_TILE


@pytest.mark.parametrize("text,tile", [("64,64,8,2", (64, 64, 8, 2)), ("32,128,8,2,split", (32, 128, 8, 2, "split")),
                                       (" 16, 32 ,4,1", (16, 32, 4, 1))])
def test_parse_tile(text, tile):
    assert diff_flash.parse_tile(text) == tile


@pytest.mark.parametrize("text", ["64,64,8", "64,64,8,2,3", "a,64,8,2", "0,64,8,2", "64,64,8,2,spilt", "split"])
def test_parse_tile_rejects_what_is_not_a_tile(text):
    with pytest.raises(ValueError, match="is not a tile"):
        diff_flash.parse_tile(text)


def test_pinned_restores_the_tuners_configs_and_choices_even_when_the_block_fails():
    kernel = diff_flash._diff_bwd_dkdv_kernel
    before = kernel.configs
    kernel.cache[("an earlier key",)] = kernel.configs[0]  # an earlier choice, kept for its key
    with pytest.raises(RuntimeError, match="the block fails"):
        with diff_flash.pinned(kernel, SPLIT_TILE) as pinned:
            assert pinned is kernel and [diff_flash._tile(c) for c in kernel.configs] == [SPLIT_TILE]
            assert not kernel.cache  # the pinned tile is chosen afresh
            raise RuntimeError("the block fails")  # the tuner is restored all the same
    assert kernel.configs is before and kernel.cache.pop(("an earlier key",)) is before[0]

def test_rows_without_keys_output_zero():
    """Causal with T > S: the first T - S queries see no key; they output zeros, gradients stay finite."""
    q, k, v, do = make_inputs(1, 2, 2, 30, 10, 32, torch.float32, seed=3)
    lam = torch.tensor(0.5, device=DEVICE, requires_grad=True)
    out = diff_flash_attention(q, k, v, lam, causal=True)
    assert torch.all(out[:, :, :20] == 0) and torch.all(out[:, :, 20:].abs().sum(-1) > 0)
    out.backward(do)
    for g in (q.grad, k.grad, v.grad, lam.grad):
        assert torch.isfinite(g).all()
    assert torch.all(q.grad[:, :, :20] == 0)


# The padded key rows overflow to inf inside the interpreter's numpy before they are masked out.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("deterministic", [True, False])
def test_far_negative_scores_with_ragged_keys(deterministic):
    """Every score of a row far below 0 (softmax is shift-invariant, so this is a legal input) with S
    not a multiple of the block: the padded key rows, whose score is 0, must not reach any gradient."""
    B, h, T, S, d = 1, 1, 8, 20, 32
    g = torch.Generator().manual_seed(13)
    q = (5 + 0.1 * torch.randn(B, 2 * h, T, d, generator=g)).to(DEVICE).requires_grad_()
    k = (-5 + 0.1 * torch.randn(B, 2 * h, S, d, generator=g)).to(DEVICE).requires_grad_()
    v = torch.randn(B, h, S, 2 * d, generator=g).to(DEVICE).requires_grad_()
    do = torch.randn(B, h, T, 2 * d, generator=g).to(DEVICE)
    lam = torch.tensor(0.5, device=DEVICE, requires_grad=True)
    out = diff_flash_attention(q, k, v, lam, causal=False, deterministic=deterministic)
    grads = torch.autograd.grad(out, (q, k, v, lam), do)
    qr, kr, vr = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    lr = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    ref = diff_attention_reference(qr, kr, vr, lr, causal=False)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr, lr), do.cpu().double())
    # fp32 rounds a score s to within |s| eps, which moves its probability by that much relatively:
    # at scores near -140 that is 1.7e-5, past TOL (on an H100 dk reaches 1.3e-5; the
    # interpreter's numpy stays under 1e-5). The padded rows this test is about would cost O(1).
    smax = (q.detach().double().cpu().view(B, h, 2, T, d) @ k.detach().double().cpu().view(B, h, 2, S, d)
            .transpose(-1, -2)).abs().max().item() * d ** -0.5
    tol = max(TOL[torch.float32], 4 * smax * torch.finfo(torch.float32).eps)
    for name, got, want in zip(("out", "dq", "dk", "dv", "dlam"), (out, *grads), (ref, *ref_grads)):
        assert torch.isfinite(got).all(), name
        assert max_rel_err(got, want) <= tol, f"{name}: error {max_rel_err(got, want):.1e} > {tol:.1e}"


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("B,T,S", [(0, 5, 5), (1, 0, 7), (1, 6, 0)])
def test_empty_batch_and_lengths(B, T, S, deterministic):
    """Zero-sized inputs launch nothing; with no keys at all (S = 0) every query outputs zeros."""
    q, k, v, do = make_inputs(B, 2, 1, T, S, 32, torch.float32, seed=14)
    lam = torch.tensor(0.5, device=DEVICE, requires_grad=True)
    out = diff_flash_attention(q, k, v, lam, causal=False, deterministic=deterministic)
    assert out.shape == (B, 2, T, 64) and torch.all(out == 0)
    grads = torch.autograd.grad(out, (q, k, v, lam), do)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, lam.shape]
    assert all(torch.all(g == 0) for g in grads)


def test_output_layout_makes_head_merge_free():
    """The (B, h, T, 2d) output is stored token-major, so transpose(1, 2) is contiguous."""
    q, k, v, _ = make_inputs(2, 2, 2, 9, 9, 32, torch.float32, seed=4)
    out = diff_flash_attention(q, k, v, torch.tensor(0.3, device=DEVICE))
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("deterministic", [True, False])
def test_no_buffer_is_read_before_a_kernel_writes_it(with_norm, deterministic, monkeypatch):
    """The ops allocate their outputs and scratch (row dots, weight-gradient rows) uninitialised: with every
    torch.empty / empty_like / empty_strided filled with NaN, the results are the same bits."""
    q, k, v, do = make_inputs(2, 2, 1, 37, 45, 32, torch.float32, seed=19, strided=True)  # batch, GQA, ragged
    lam = torch.tensor(0.45, device=DEVICE, requires_grad=True)
    weight = torch.linspace(0.5, 1.5, 64, device=DEVICE).requires_grad_()
    norm = (weight, 1e-5) if with_norm else None

    def grads():
        out = diff_flash_attention(q, k, v, lam, causal=True, deterministic=deterministic, out_norm=norm)
        return (out, *torch.autograd.grad(out, (q, k, v, lam, *([weight] if with_norm else [])), do))

    clean = grads()
    for name in ("empty", "empty_like", "empty_strided"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, **kw: _real(*a, **kw).fill_(float("nan")))
    poisoned = grads()
    assert torch.isnan(torch.empty(3)).all()  # the patch is in force
    for a, b in zip(clean, poisoned):
        assert torch.equal(a, b)


def test_backward_is_deterministic():
    q, k, v, do = make_inputs(1, 4, 2, 37, 45, 32, torch.float32, seed=5)
    grads = []
    for _ in range(2):
        lam = torch.tensor(0.6, device=DEVICE, requires_grad=True)
        out = diff_flash_attention(q, k, v, lam, causal=True)
        grads.append(torch.autograd.grad(out, (q, k, v, lam), do))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_deterministic_algorithms_mode_forces_the_two_pass_backward():
    """Under torch.use_deterministic_algorithms(True), deterministic=False gives the two-pass
    backward's gradients bit for bit."""
    q, k, v, do = make_inputs(1, 4, 2, 37, 45, 32, torch.float32, seed=12)
    lam = torch.tensor(0.6, device=DEVICE, requires_grad=True)

    def grads(deterministic):
        return torch.autograd.grad(diff_flash_attention(q, k, v, lam, deterministic=deterministic), (q, k, v, lam), do)

    two_pass = grads(True)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        forced = grads(False)
    finally:
        torch.use_deterministic_algorithms(previous)
    for a, b in zip(two_pass, forced):
        assert torch.equal(a, b)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), h_kv=st.integers(1, 2), n_rep=st.sampled_from([1, 2, 4]),
       T=st.integers(1, 50), S=st.integers(1, 50), d=st.sampled_from([32, 64, 96, 128]),
       causal=st.booleans(), lam=st.floats(-1.5, 2.0), seed=st.integers(0, 2**31 - 1),
       deterministic=st.booleans())
def test_random_shapes_match_reference(B, h_kv, n_rep, T, S, d, causal, lam, seed, deterministic):
    h_kv = min(h_kv, 4 // n_rep)  # at most 4 heads under the interpreter
    run_and_compare(B, h_kv * n_rep, h_kv, T, S, d, causal, lam, seed=seed, deterministic=deterministic)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's own
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend, with_norm):
    """Dynamo traces the autograd.Function around the two opaque custom ops (no graph break), and
    the compiled forward and backward equal eager ones, lambda's reparameterisation (and the fused
    head norm's weight, scaled as the layer scales it) included: bit for bit under aot_eager; under
    inductor, which compiles that arithmetic itself and may round it differently, to fp32 rounding."""
    if backend == "inductor" and CPP_KERNEL_DISABLED:
        pytest.skip("inductor on CPU needs the C++ compiler this run was told not to use")
    q, k, v, do = make_inputs(1, 2, 1, 20, 20, 32, torch.float32, seed=6, strided=True)
    lq = (0.1 * torch.randn(32, generator=torch.Generator().manual_seed(1))).to(DEVICE).requires_grad_()
    w = (torch.rand(64, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEVICE).requires_grad_()

    def f(q, k, v, lq, w):
        lam = torch.exp((lq * lq).sum()) - 0.5
        return diff_flash_attention(q, k, v, lam, causal=True, out_norm=(w * 0.8, 1e-5) if with_norm else None)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    leaves = (q, k, v, lq, w) if with_norm else (q, k, v, lq)
    want = f(q, k, v, lq, w)
    want_grads = torch.autograd.grad(want, leaves, do)
    got = compiled(q, k, v, lq, w)
    got_grads = torch.autograd.grad(got, leaves, do)
    tol = dict(rtol=0, atol=0) if backend == "aot_eager" else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("with_norm", [False, True])
def test_custom_ops_pass_opcheck(with_norm):
    """Schemas, fake (meta) implementations and strides agree with the real kernels."""
    q, k, v, _ = make_inputs(1, 2, 1, 20, 20, 32, torch.float32, seed=8, strided=True)
    q, k, v = q.detach(), k.detach(), v.detach()
    lam = torch.tensor(0.4, device=DEVICE)
    weight = torch.rand(64, device=DEVICE) + 0.5 if with_norm else None
    ops = torch.ops.difftransformer
    torch.library.opcheck(ops.diff_flash_fwd.default, (q, k, v, lam, weight, True, 0.2, 1e-5))
    out, o2, lse1, lse2, y, rstd = ops.diff_flash_fwd(q, k, v, lam, weight, True, 0.2, 1e-5)
    assert (y.shape, rstd.shape) == (((1, 2, 20, 64), (1, 2, 20)) if with_norm else ((0,), (0,)))
    do = torch.randn_like(out)
    for deterministic in (True, False):
        torch.library.opcheck(ops.diff_flash_bwd.default, (do, q, k, v, lam, out, o2, lse1, lse2, weight, rstd, True,
                                                           0.2, deterministic))


def head_norm_reference(q, k, v, lam, weight, eps, causal):
    """RMSNorm(A1 V - lam A2 V) * weight per head row, float64, from float64 leaves."""
    z = diff_attention_reference(q, k, v, lam, causal=causal)
    return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("case", [(2, 2, 1, 37, 37, 32, True), (1, 2, 2, 20, 45, 16, False),
                                  (1, 2, 2, 50, 20, 32, True), (1, 4, 2, 23, 41, 96, True)])
def test_fused_head_norm_matches_reference(case, deterministic):
    """out_norm=(weight, eps): the output, and the gradients of q, k, v, lam and the weight, equal
    float64 RMSNorm(A1 V - lam A2 V) * weight, rows that see no key (T > S, causal) included."""
    B, h, h_kv, T, S, d, causal = case
    q, k, v, _ = make_inputs(B, h, h_kv, T, S, d, torch.float32, seed=T + S, strided=True)
    g = torch.Generator().manual_seed(d)
    weight = (torch.rand(2 * d, generator=g) + 0.5).to(DEVICE).requires_grad_()
    lam = torch.tensor(-0.6, device=DEVICE, requires_grad=True)
    y = diff_flash_attention(q, k, v, lam, causal=causal, deterministic=deterministic, out_norm=(weight, 1e-5))
    dy = torch.randn(y.shape, generator=g).to(DEVICE)
    grads = torch.autograd.grad(y, (q, k, v, lam, weight), dy)
    leaves = [x.detach().cpu().double().requires_grad_() for x in (q, k, v, lam, weight)]
    want = head_norm_reference(*leaves[:4], leaves[4], 1e-5, causal)
    want_grads = torch.autograd.grad(want, leaves, dy.cpu().double())
    for name, got, ref in zip(("y", "dq", "dk", "dv", "dlam", "dweight"), (y, *grads), (want, *want_grads)):
        assert got.shape == ref.shape, name
        err = max_rel_err(got, ref)
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 1e-3)])
def test_fused_head_norm_equals_unfused_in_half_precision(dtype, tol):
    """In bf16/fp16 the fused norm rounds where the unfused one does (the kernel's output to the
    input dtype, the normalised rows back to it), so the two agree to a few units of that dtype.
    fp16 is the sharp check here: the interpreter truncates fp32 -> bf16 instead of rounding to
    nearest as torch does, so bf16 differs by about one bf16 unit anyway (on a GPU it rounds; the
    GPU test holds bf16 to the same comparison)."""
    q, k, v, _ = make_inputs(1, 2, 1, 40, 40, 32, dtype, seed=12, strided=True)
    weight = (torch.rand(64, generator=torch.Generator().manual_seed(3)) + 0.5).to(DEVICE).requires_grad_()
    lam = torch.tensor(0.7, device=DEVICE, requires_grad=True)
    y = diff_flash_attention(q, k, v, lam, causal=True, out_norm=(weight, 1e-5))
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    grads = torch.autograd.grad(y, (q, k, v, lam, weight), dy)
    z = diff_flash_attention(q, k, v, lam, causal=True)
    unfused = torch.nn.functional.rms_norm(z.float(), (64,), weight, 1e-5).to(dtype)
    unfused_grads = torch.autograd.grad(unfused, (q, k, v, lam, weight), dy)
    assert y.dtype == dtype and y.stride() == z.stride()
    for name, got, want in zip(("y", "dq", "dk", "dv", "dlam", "dweight"), (y, *grads), (unfused, *unfused_grads)):
        err = max_rel_err(got, want.detach().cpu().double())
        assert err <= tol, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("with_norm", [False, True])
def test_ops_read_operands_in_any_layout(with_norm):
    """The ops are tagged flexible_layout, so Inductor may hand them any strides: the backward op given
    out / O2n as slices of a wider buffer, a strided weight, and LSEs and 1 / rms that are not
    contiguous returns what it returns for the dense ones; O2n with strides other than out's is refused."""
    q, k, v, _ = make_inputs(1, 2, 1, 24, 24, 16, torch.float32, seed=14, strided=True)
    q, k, v = q.detach(), k.detach(), v.detach()
    lam = torch.tensor(0.6, device=DEVICE)
    wide_w = (torch.rand(64, generator=torch.Generator().manual_seed(5)) + 0.5).to(DEVICE)
    weight = wide_w[::2] if with_norm else None
    ops = torch.ops.difftransformer
    out, o2, lse1, lse2, y, rstd = ops.diff_flash_fwd(q, k, v, lam, weight, True, 0.25, 1e-5)
    if with_norm:
        dense_y = ops.diff_flash_fwd(q, k, v, lam, weight.contiguous(), True, 0.25, 1e-5)[4]
        assert torch.equal(y, dense_y)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    want = ops.diff_flash_bwd(do, q, k, v, lam, out, o2, lse1, lse2, weight, rstd, True, 0.25, True)

    def widen(t):  # the same values as a slice of a (B, T, h, 4d) buffer: strides with gaps
        buf = torch.full((t.shape[0], t.shape[2], t.shape[1], 2 * t.shape[3]), float("nan"), device=DEVICE)
        view = buf[..., : t.shape[3]].transpose(1, 2)
        view.copy_(t)
        return view

    def spread(t):  # the same values, not contiguous
        return torch.stack((t, torch.full_like(t, float("nan"))), -1)[..., 0]

    got = ops.diff_flash_bwd(do, q, k, v, lam, widen(out), widen(o2), spread(lse1), spread(lse2),
                             weight, spread(rstd) if with_norm else rstd, True, 0.25, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="o2 must share out's strides"):
        ops.diff_flash_bwd(do, q, k, v, lam, out, o2.contiguous(), lse1, lse2, weight, rstd, True, 0.25, True)


def test_token_offsets_past_32_bits_are_refused_by_the_ops_check():
    """The check the ops run on every operand (dO included), on a meta tensor whose token stride
    puts its last token 2^31 elements into its head."""
    do = torch.empty(0, device="meta").as_strided((1, 2, 3, 64), (0, 64, 2**30, 1))
    diff_flash._check_token_offsets(("do", do[:, :, :2]))  # 2^30: fine
    with pytest.raises(ValueError, match="do's last token sits 2147483648 elements into its head"):
        diff_flash._check_token_offsets(("q", do[:, :, :1]), ("do", do))


def test_fused_head_norm_rejects_a_bad_weight():
    q, k, v, _ = make_inputs(1, 2, 1, 8, 8, 32, torch.float32, seed=9)
    lam = torch.tensor(0.5, device=DEVICE)
    with pytest.raises(ValueError, match=r"out_norm's weight must be a floating \(2d,\) = \(64,\) tensor"):
        diff_flash_attention(q, k, v, lam, out_norm=(torch.ones(32, device=DEVICE), 1e-5))


def test_rejects_bad_shapes():
    q, k, v, _ = make_inputs(1, 2, 1, 8, 8, 32, torch.float32, seed=9)
    lam = torch.tensor(0.5, device=DEVICE)
    with pytest.raises(ValueError):
        diff_flash_attention(q, k, v[..., :32], lam)
    with pytest.raises(ValueError):
        diff_flash_attention(q[:, :3], k, v, lam)
    with pytest.raises(ValueError):
        diff_flash_attention(q, k, v, torch.ones(2, device=DEVICE))
    # A token 2^31 elements into its head is refused before any launch (meta tensors hold no
    # memory): through the output's token stride h * 2d, or through an input's own stride.
    big = dict(device="meta", dtype=torch.float32)
    T = 2**31 // (2 * 64) + 2
    with pytest.raises(ValueError, match="out's last token .* 32-bit offsets"):
        diff_flash_attention(torch.empty(1, 4, T, 32, **big), torch.empty(1, 2, T, 32, **big),
                             torch.empty(1, 1, T, 64, **big), torch.tensor(0.5))
    k_far = torch.empty(1, 2, 3, 32, **big).as_strided((1, 2, 3, 32), (2**32, 32, 2**30, 1))
    with pytest.raises(ValueError, match="k's last token sits 2147483648 elements"):
        diff_flash_attention(torch.empty(1, 4, 3, 32, **big), k_far, torch.empty(1, 1, 3, 64, **big),
                             torch.tensor(0.5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_long_sequence_bf16(d, deterministic):
    """At training-like lengths (several tuned blocks) bf16 agrees with an fp32 explicit map."""
    B, h, h_kv, T = 1, 4, 2, 1000
    q, k, v, do = make_inputs(B, h, h_kv, T, T, d, torch.bfloat16, seed=10)
    lam = torch.tensor(0.7, device=DEVICE, requires_grad=True)
    out = diff_flash_attention(q, k, v, lam, causal=True, deterministic=deterministic)
    grads = torch.autograd.grad(out, (q, k, v, lam), do)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    lf = lam.detach().clone().requires_grad_()
    qc, kc = qf.view(B, h, 2, T, d), kf.view(B, h_kv, 2, T, d).repeat_interleave(h // h_kv, 1)
    mask = torch.ones(T, T, dtype=torch.bool, device=DEVICE).tril()
    a = torch.softmax((qc @ kc.transpose(-1, -2) * d ** -0.5).masked_fill(~mask, float("-inf")), -1)
    o2 = a[:, :, 1] @ vf.repeat_interleave(h // h_kv, 1)
    ref = (a[:, :, 0] - lf * a[:, :, 1]) @ vf.repeat_interleave(h // h_kv, 1)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf, lf), do.float())
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        err = ((got.float() - want).abs().max() / want.abs().max().clamp_min(1.0)).item()
        assert err < 3e-2, f"{name}: error {err:.1e}"
    # dlam = -sum(dO * A2 V) over B*h*T*2d terms cancels to a small fraction of their size (held to its own
    # size, it fails on an H100): measure it against the terms'.
    terms = (do.float() * o2.detach()).abs().sum()
    err = ((grads[3].float() - ref_grads[3]).abs() / terms).item()
    assert err < 1e-3, f"dlam: error {err:.1e} of the terms' magnitude"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_fused_head_norm_bf16(d):
    """At a training-like length in bf16, the fused head norm equals the unfused one (the kernel's
    output through F.rms_norm in fp32), gradients of q, k, v, lam and the weight included."""
    q, k, v, _ = make_inputs(2, 4, 4, 1024, 1024, d, torch.bfloat16, seed=11, strided=True)
    weight = (torch.rand(2 * d, device=DEVICE) + 0.5).requires_grad_()
    lam = torch.tensor(0.7, device=DEVICE, requires_grad=True)
    y = diff_flash_attention(q, k, v, lam, causal=True, out_norm=(weight, 1e-5))
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (q, k, v, lam, weight), dy)
    z = diff_flash_attention(q, k, v, lam, causal=True)
    unfused = torch.nn.functional.rms_norm(z.float(), (2 * d,), weight, 1e-5).to(torch.bfloat16)
    unfused_grads = torch.autograd.grad(unfused, (q, k, v, lam, weight), dy)
    for name, got, want in zip(("y", "dq", "dk", "dv", "dlam", "dweight"), (y, *grads), (unfused, *unfused_grads)):
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1.0)).item()
        assert err < 2e-2, f"{name}: error {err:.1e}"


@pytest.mark.parametrize("with_norm", [False, True])
def test_no_grad_calls_skip_the_op_dispatch_unless_something_observes_them(with_norm, monkeypatch):
    """Without a gradient the forward runs its Python body directly (host time per decoding step), with
    the same result bit for bit; a torch dispatch mode (fake tensors, FLOP counters) or a compile trace
    still sees the custom op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    q, k, v, _ = make_inputs(1, 2, 1, 7, 30, 16, torch.float32, seed=15)
    lam = torch.tensor(0.3, device=DEVICE)
    norm = ((torch.rand(32, generator=torch.Generator().manual_seed(7)) + 0.5).to(DEVICE), 1e-5) if with_norm else None
    want = diff_flash_attention(q, k, v, lam, out_norm=norm)  # q requires grad: the autograd path
    calls = []
    body = diff_flash._fwd_impl
    monkeypatch.setattr(diff_flash, "_fwd_impl", lambda *a: calls.append("direct") or body(*a))
    with torch.no_grad():
        got = diff_flash_attention(q, k, v, lam, out_norm=norm)
    assert calls == ["direct"] and torch.equal(got, want)

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(str(func))
            return func(*args, **(kwargs or {}))

    calls.clear()
    with torch.no_grad(), Seen():
        seen = diff_flash_attention(q, k, v, lam, out_norm=norm)
    assert "difftransformer.diff_flash_fwd.default" in calls and "direct" not in calls
    assert torch.equal(seen, want)

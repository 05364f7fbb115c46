"""The fused decoding-step kernel against a float64 explicit-map reference, the eager backend and its contract.

Without CUDA the kernels run on CPU through the Triton interpreter (TRITON_INTERPRET=1, set in conftest.py),
where key blocks hold 32 keys: S = 300 spans 10 blocks (the last one ragged), and 3 splits cover 4, 4 and 2.
"""

import itertools

import pytest
import torch

pytest.importorskip("triton")

from difftransformer.kernels import triton_runs  # noqa: E402

if not triton_runs():
    pytest.skip("Triton cannot run here (no CUDA and TRITON_INTERPRET is not 1)", allow_module_level=True)

from difftransformer.attention.functional import differential_attention  # noqa: E402
from difftransformer.kernels import diff_decode  # noqa: E402
from difftransformer.kernels.diff_decode import diff_decode_attention, split_plan  # noqa: E402

DEVICE = "cpu" if diff_decode._INTERPRET else "cuda"
EPS = 1e-5
# Relative rounding step of each output dtype (one unit in the last place at most); fp32 computes exactly
# up to its own rounding, so it gets a fixed relative tolerance instead.
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-5}


def make_inputs(B, h, n_rep, S, d, dtype, mask_kind, seed, norm=False):
    g = torch.Generator().manual_seed(seed)
    h_kv = h // n_rep
    q = torch.randn(B, 2 * h, 1, d, generator=g)
    k = torch.randn(B, 2 * h_kv, S, d, generator=g)
    v = torch.randn(B, h_kv, S, 2 * d, generator=g)
    mask = None
    if mask_kind != "none":
        mask = torch.rand(B, S, generator=g) < 0.7
        if mask_kind == "empty_row":
            mask[B // 2] = False
        mask = mask.to(DEVICE)
    weight = (torch.rand(2 * d, generator=g) + 0.5).to(DEVICE) if norm else None
    q, k, v = (t.to(DEVICE, dtype) for t in (q, k, v))
    return q, k, v, mask, weight


def reference(q, k, v, lam, mask=None, scale=None, weight=None):
    """float64 explicit maps from the given (possibly rounded) inputs: (out, y); y = the head norm of out rounded
    to q's dtype (as the unfused path computes it), None without a weight."""
    B, two_h, _, d = q.shape
    h, h_kv, S = two_h // 2, k.shape[1] // 2, k.shape[2]
    n_rep = h // h_kv
    scale = d ** -0.5 if scale is None else scale
    qc = q.double().cpu().view(B, h, 2, 1, d)
    kc = k.double().cpu().view(B, h_kv, 2, S, d).repeat_interleave(n_rep, dim=1)
    vc = v.double().cpu().repeat_interleave(n_rep, dim=1)
    scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale  # (B, h, 2, 1, S)
    visible = torch.ones(B, S, dtype=torch.bool) if mask is None else mask.cpu()
    scores = scores.masked_fill(~visible[:, None, None, None, :], float("-inf"))
    top = scores.amax(-1, keepdim=True)
    e = torch.exp(scores - torch.where(torch.isinf(top), 0.0, top))
    total = e.sum(-1, keepdim=True)
    probs = e / torch.where(total == 0, 1.0, total)
    out = torch.matmul(probs[:, :, 0] - lam * probs[:, :, 1], vc)  # (B, h, 1, 2d)
    if weight is None:
        return out, None
    o = out.to(q.dtype).double()
    y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + EPS) * weight.double().cpu()
    return out, y


def assert_close(got, want, dtype, ulps=1.0):
    """Elementwise |got - want| <= ulps * ULP * |want| + 1e-5 * max|want|: one rounding to the output dtype
    (a flipped last bit allowed), plus fp32 arithmetic on sums that may cancel."""
    got = got.detach().cpu().double()
    assert got.shape == want.shape
    bound = ulps * ULP[dtype] * want.abs() + 1e-5 * want.abs().max().clamp_min(1.0)
    excess = (got - want).abs() - bound
    worst = excess.argmax()
    assert excess.max() <= 0, (f"off by {(got - want).abs().flatten()[worst]:.3g} at {worst.item()} "
                               f"(want {want.flatten()[worst]:.6g}, got {got.flatten()[worst]:.6g})")


# Every (S, d, mask, dtype, splits) with the other axes cycled through their combinations, so that each value of
# every axis meets many values of the others while the module stays small enough for the interpreter.
_PRIMARY = list(itertools.product([1, 7, 64, 300], [16, 32, 48], ["none", "random", "empty_row"],
                                  [torch.float32, torch.bfloat16], [1, 3, None]))
_SECONDARY = list(itertools.product([1, 3], [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)], [False, True], [-0.4, 0.3, 1.2]))
CASES = [(*p, *_SECONDARY[(7 * i) % len(_SECONDARY)]) for i, p in enumerate(_PRIMARY)]


def _case_id(case):
    S, d, mask, dtype, splits, B, (h, n_rep), norm, lam = case
    dt = "fp32" if dtype == torch.float32 else "bf16"
    return f"S{S}-d{d}-{mask}-{dt}-split{splits or 'auto'}-B{B}-h{h}r{n_rep}-{'norm' if norm else 'raw'}-lam{lam}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_float64_reference(case):
    S, d, mask_kind, dtype, splits, B, (h, n_rep), norm, lam = case
    q, k, v, mask, weight = make_inputs(B, h, n_rep, S, d, dtype, mask_kind, seed=CASES.index(case), norm=norm)
    lam_t = torch.tensor(lam, dtype=torch.float32, device=DEVICE)
    out_norm = None if weight is None else (weight, EPS)
    got = diff_decode_attention(q, k, v, lam_t, key_padding_mask=mask, out_norm=out_norm, splits=splits)
    assert got.shape == (B, h, 1, 2 * d) and got.dtype == dtype and got.device == q.device
    out, y = reference(q, k, v, lam, mask, weight=weight)
    assert_close(got, out if y is None else y, dtype, ulps=2.0 if norm else 1.0)
    if mask_kind == "empty_row":
        assert torch.all(got[B // 2] == 0)


def test_reference_can_fail():
    """The tolerance catches a wrong lambda, a dropped mask and a key read twice at bf16 and fp32."""
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, mask, _ = make_inputs(2, 2, 1, 40, 32, dtype, "random", seed=1)
        got = diff_decode_attention(q, k, v, torch.tensor(0.5, device=DEVICE), key_padding_mask=mask)
        for wrong in (reference(q, k, v, 0.51, mask)[0], reference(q, k, v, 0.5)[0],
                      reference(q, k.repeat_interleave(2, 2)[:, :, :40], v, 0.5, mask)[0]):
            with pytest.raises(AssertionError):
                assert_close(got, wrong, dtype)


def test_explicit_scale():
    q, k, v, mask, _ = make_inputs(1, 2, 2, 50, 24, torch.float32, "random", seed=2)
    got = diff_decode_attention(q, k, v, torch.tensor(0.8, device=DEVICE), key_padding_mask=mask, scale=0.3)
    assert_close(got, reference(q, k, v, 0.8, mask, scale=0.3)[0], torch.float32)


def test_fp16():
    q, k, v, mask, weight = make_inputs(2, 4, 2, 45, 16, torch.float16, "random", seed=3, norm=True)
    lam = torch.tensor(0.6, device=DEVICE)
    got = diff_decode_attention(q, k, v, lam, key_padding_mask=mask, out_norm=(weight, EPS), splits=2)
    assert got.dtype == torch.float16
    assert_close(got, reference(q, k, v, 0.6, mask, weight=weight)[1], torch.float16, ulps=2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_views_equal_contiguous_copies(dtype):
    """k, v (and q, and the mask) as views of longer, token-major buffers, as a static KV cache holds them."""
    B, h, h_kv, S, S_max, d = 2, 4, 2, 37, 80, 24
    g = torch.Generator().manual_seed(4)
    k_buf = torch.randn(B, S_max, 2 * h_kv, d, generator=g).to(DEVICE, dtype)
    v_buf = torch.randn(B, h_kv, S_max, 2 * d, generator=g).to(DEVICE, dtype)
    q = torch.randn(B, 1, 2 * h, d, generator=g).to(DEVICE, dtype).transpose(1, 2)
    mask_buf = (torch.rand(B, S_max + 5, generator=g) < 0.8).to(DEVICE)
    k, v, mask = k_buf.transpose(1, 2)[:, :, :S], v_buf[:, :, :S], mask_buf[:, 2:S + 2]
    assert not (k.is_contiguous() or v.is_contiguous() or mask.is_contiguous())
    lam = torch.tensor(0.7, device=DEVICE)
    weight = torch.rand(2 * d, generator=g).to(DEVICE) + 0.5
    for out_norm in (None, (weight, EPS)):
        got = diff_decode_attention(q, k, v, lam, key_padding_mask=mask, out_norm=out_norm, splits=2)
        want = diff_decode_attention(q.contiguous(), k.contiguous(), v.contiguous(), lam,
                                     key_padding_mask=mask.contiguous(), out_norm=out_norm, splits=2)
        assert torch.equal(got, want)


@pytest.mark.parametrize("B,h,n_rep,S,d,dtype,mask_kind,norm", [
    (2, 2, 1, 33, 16, torch.float32, "none", False),
    (3, 4, 2, 70, 32, torch.float32, "empty_row", True),
    (1, 2, 2, 20, 48, torch.bfloat16, "random", False),
    (2, 4, 1, 90, 32, torch.bfloat16, "random", True),
])
def test_equals_eager_backend(B, h, n_rep, S, d, dtype, mask_kind, norm):
    q, k, v, mask, weight = make_inputs(B, h, n_rep, S, d, dtype, mask_kind, seed=5, norm=norm)
    lam = torch.tensor(0.45, device=DEVICE)
    out_norm = None if weight is None else (weight, EPS)
    got = diff_decode_attention(q, k, v, lam, key_padding_mask=mask, out_norm=out_norm)
    want = differential_attention(q, k, v, lam, key_padding_mask=mask, backend="eager", out_norm=out_norm)
    assert got.dtype == want.dtype == dtype
    assert_close(got, want.double().cpu(), dtype, ulps=2.0 if norm else 1.0)


def test_no_keys_and_no_rows():
    """S = 0: every row sees no key and outputs zeros (normalised too); B = 0: an empty output."""
    q, k, v, _, weight = make_inputs(2, 2, 1, 0, 16, torch.float32, "none", seed=6, norm=True)
    lam = torch.tensor(0.5, device=DEVICE)
    assert torch.equal(diff_decode_attention(q, k, v, lam), torch.zeros(2, 2, 1, 32, device=DEVICE))
    assert torch.equal(diff_decode_attention(q, k, v, lam, out_norm=(weight, EPS)), torch.zeros(2, 2, 1, 32,
                                                                                                 device=DEVICE))
    q, k, v, _, _ = make_inputs(0, 2, 1, 5, 16, torch.float32, "none", seed=6)
    assert diff_decode_attention(q, k, v, lam).shape == (0, 2, 1, 32)


@pytest.mark.parametrize("S", [0, 1, 15, 16, 17, 300, 5000])
@pytest.mark.parametrize("rows", [1, 3, 48])
@pytest.mark.parametrize("splits", [None, 1, 3, 64, 1000])
def test_split_plan(S, rows, splits):
    """Whole blocks per split, no empty split, at most one split per block and MAX_SPLITS."""
    n_split, per_split = split_plan(S, rows, 64, torch.bfloat16, torch.device(DEVICE), splits)
    block_n = diff_decode.tile_for(64, torch.bfloat16)[0]
    assert per_split % block_n == 0 and 1 <= n_split <= diff_decode.MAX_SPLITS
    assert (n_split - 1) * per_split < max(S, 1) <= n_split * per_split
    if splits is not None:
        assert n_split <= splits


def _good(B=2, h=2, n_rep=1, S=9, d=16):
    q, k, v, mask, weight = make_inputs(B, h, n_rep, S, d, torch.float32, "random", seed=7, norm=True)
    return dict(q=q, k=k, v=v, lam=torch.tensor(0.5, device=DEVICE), key_padding_mask=mask, out_norm=(weight, EPS))


def _bad_cases():
    good = _good()
    q, k, v, mask, (w, _) = good["q"], good["k"], good["v"], good["key_padding_mask"], good["out_norm"]
    return [
        (dict(q=q[:, :, 0]), "4-D"),
        (dict(q=q.expand(2, 4, 3, 16)), "T = 3"),
        (dict(q=q[:, :3]), "even"),
        (dict(k=k[:, :3]), "even"),
        (dict(k=k[:1]), "k must be"),
        (dict(k=torch.cat([k, k], -1)), "k must be"),
        (dict(v=v[:, :, :4]), "v must be"),
        (dict(v=v[..., :16]), "v must be"),
        (dict(q=_good(h=3)["q"], k=_good(h=2)["k"][:, :, :9]), "split evenly"),
        (dict(k=k.to(torch.bfloat16)), "one dtype"),
        (dict(q=q.double(), k=k.double(), v=v.double()), "one dtype"),
        (dict(q=torch.randn(2, 4, 1, 32, device=DEVICE)[..., ::2]), "last dim"),
        (dict(v=torch.randn(2, 2, 9, 64, device=DEVICE)[..., ::2]), "last dim"),
        (dict(lam=0.5), "lam must be"),
        (dict(lam=torch.tensor([0.5], device=DEVICE)), "lam must be"),
        (dict(lam=torch.tensor(0.5, dtype=torch.float64, device=DEVICE)), "lam must be"),
        (dict(key_padding_mask=mask.float()), "bool"),
        (dict(key_padding_mask=mask[:, :5]), r"\(B, S\)"),
        (dict(key_padding_mask=mask[:1]), r"\(B, S\)"),
        (dict(out_norm=(w[:5], EPS)), "weight"),
        (dict(out_norm=(w.double(), EPS)), "weight"),
        (dict(out_norm=(torch.rand(64, device=DEVICE)[::2], EPS)), "weight"),
        (dict(out_norm=w), "out_norm"),
        (dict(out_norm=(w, -1.0)), "eps"),
        (dict(splits=0), "splits"),
        (dict(splits=2.0), "splits"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_cases())))
def test_bad_input_gives_one_line_error(index):
    change, pattern = _bad_cases()[index]
    kwargs = dict(_good(), **change)
    with pytest.raises(ValueError, match=pattern) as info:
        diff_decode_attention(kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v"), kwargs.pop("lam"), **kwargs)
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------------
# GPU: decode sizes, and a step captured in a CUDA graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_rep,norm", [(1, False), (2, True)])
def test_decode_sizes_on_gpu(dtype, n_rep, norm):
    B, h, d, S = 8, 6, 64, 2304
    q, k, v, _, weight = make_inputs(B, h, n_rep, S, d, dtype, "none", seed=8, norm=norm)
    mask = torch.ones(B, S, dtype=torch.bool, device=q.device)
    mask[:, -100:] = False
    lam = torch.tensor(0.35, device=q.device)
    out_norm = None if weight is None else (weight, EPS)
    got = diff_decode_attention(q, k, v, lam, key_padding_mask=mask, out_norm=out_norm)
    out, y = reference(q, k, v, 0.35, mask, weight=weight)
    assert_close(got, out if y is None else y, dtype, ulps=2.0 if norm else 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_reads_lambda_and_mask():
    """Captured once on a cache buffer longer than what is written; replays see new lambda, mask and keys."""
    B, h, n_rep, S, d, dtype = 4, 6, 2, 512, 64, torch.bfloat16
    q, k, v, _, weight = make_inputs(B, h, n_rep, S, d, dtype, "none", seed=9, norm=True)
    mask = torch.zeros(B, S, dtype=torch.bool, device=q.device)
    mask[:, :100] = True
    lam = torch.tensor(0.2, device=q.device)
    run = lambda: diff_decode_attention(q, k, v, lam, key_padding_mask=mask, out_norm=(weight, EPS))  # noqa: E731
    run()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for step, lam_value in enumerate((0.2, 0.9, -0.3)):
        lam.fill_(lam_value)
        mask[:, 100 + step] = True
        k[:, :, 100 + step].normal_()
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, reference(q, k, v, lam_value, mask, weight=weight)[1], dtype, ulps=2.0)

"""The fused CPU kernel's decode path (few queries, keys split across threads) and what decoding relies on.

Checked against the independent float64 reference (tests/reference.py) with the tolerances of
tests/kernels/test_flash_cpu.py: key lengths that do and do not fill the kernel's 128-key splits,
bottom-right causal offsets, padding, MHA and GQA, DIFF and ordinary attention; the dispatch rule
(decode only without gradients); the head norm fused into it; the DIFF layer's λ held by a KV cache
staying right after parameter changes; and greedy generation: cached = uncached = batched one by one.
"""

import pytest
import torch
import torch.nn.functional as F

from difftransformer import DiffTransformerLM, differential_attention
from difftransformer.attention import multihead_attention
from difftransformer.attention.cache import KVCache
from difftransformer.attention.decode import layer_constants
from difftransformer.attention.layers import MultiheadDiffAttention
from difftransformer.kernels import flash_cpu
from tests.helpers import count_op_calls, padding_mask, random_inputs, rel_err, shape_id, tiny
from tests.reference import diff_attention_reference, mha_reference

pytestmark = pytest.mark.usefixtures("cpp_extension")


@pytest.fixture
def decode_calls(monkeypatch):
    return count_op_calls(monkeypatch, diff="diff_flash_decode", ordinary="flash_decode")


# (B, h, h_kv, T, S): S of one partial split, exactly one and two splits, and splits plus a rest;
# T > S (causal rows that see no key); MHA and GQA (n_rep 2 and 4).
SHAPES = [(1, 2, 2, 1, 5), (3, 4, 2, 2, 128), (1, 4, 1, 4, 256), (3, 2, 1, 3, 300), (1, 2, 2, 4, 2),
          (3, 4, 4, 1, 513)]


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_diff_decode_matches_reference(shape, causal, padded, decode_calls):
    B, h, h_kv, T, S = shape
    q, k, v = random_inputs(B, h, h_kv, T, S, 16, seed=S + T)
    mask = padding_mask(B, S, S) if padded else None
    with torch.no_grad():
        out = differential_attention(q, k, v, torch.tensor(0.7), causal=causal, key_padding_mask=mask, backend="cpp")
    assert decode_calls["diff"] == 1
    ref = diff_attention_reference(q, k, v, 0.7, causal=causal, key_padding_mask=mask)
    assert out.shape == (B, h, T, 32) and rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_ordinary_decode_matches_reference(shape, causal, padded, decode_calls):
    B, h, h_kv, T, S = shape
    g = torch.Generator().manual_seed(S * 7 + T)
    q = torch.randn(B, 2 * h, T, 16, generator=g)  # the baseline has twice DIFF's heads
    k, v = (torch.randn(B, 2 * h_kv, S, 16, generator=g) for _ in range(2))
    mask = padding_mask(B, S, S + 1) if padded else None
    with torch.no_grad():
        out = multihead_attention(q, k, v, causal=causal, key_padding_mask=mask, backend="cpp")
    assert decode_calls["ordinary"] == 1
    assert rel_err(out, mha_reference(q, k, v, causal=causal, key_padding_mask=mask)) <= 1e-5


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("S", [3, 6, 7, 133, 517])
def test_one_query_row_at_the_head_dims_with_register_loops(S, d, padded, decode_calls):
    """One query row per head (MHA, T = 1: what decoding is) at the head dims the kernel's one-row loops
    keep in registers (four keys per pass, the rest one by one: S = 3, 6, 7, 133 and 517 leave 3, 2, 3, 1
    and 1 keys after the last group of four in some split), for both kinds, against the float64 reference."""
    B, h = 2, 2
    q, k, v = random_inputs(B, h, h, 1, S, d, seed=S + d)
    mask = padding_mask(B, S, S + d) if padded else None
    with torch.no_grad():
        out = differential_attention(q, k, v, torch.tensor(0.6), causal=True, key_padding_mask=mask, backend="cpp")
        ordinary = multihead_attention(q, k, k, causal=True, key_padding_mask=mask, backend="cpp")
    assert decode_calls["diff"] == 1 and decode_calls["ordinary"] == 1
    ref = diff_attention_reference(q, k, v, 0.6, causal=True, key_padding_mask=mask)
    assert rel_err(out, ref) <= 1e-5
    assert rel_err(ordinary, mha_reference(q, k, k, causal=True, key_padding_mask=mask)) <= 1e-5


def test_a_decoding_step_with_odd_strides_is_read_right(decode_calls):
    """Without gradients the decode ops get the operands as they are (no Python stride checks) and copy rows
    they cannot read in place themselves: expanded (stride-0) key rows, T = 1 with stride(-2) = 1 < d
    ("contiguous" to PyTorch) and d = 1 with stride(-2) = 2 all match the float64 reference."""
    q, k, v = random_inputs(2, 2, 1, 1, 9, 32, seed=11)
    k_row, v_row = k[:, :, :1].expand(2, 2, 9, 32), v[:, :, :1].expand(2, 1, 9, 64)  # every key the same
    q1 = torch.randn(2, 4, 32, 1).transpose(-1, -2)
    assert q1.is_contiguous() and q1.stride(-2) < q1.shape[-1]
    d1 = [torch.randn(2, 3, n, 2)[..., :1] for n in (1, 5, 5)]  # d = 1 with stride(-1) = 1, stride(-2) = 2
    with torch.no_grad():
        out = differential_attention(q, k_row, v_row, torch.tensor(0.3), backend="cpp")
        out1 = differential_attention(q1, k, v, torch.tensor(0.3), backend="cpp")
        out_d1 = multihead_attention(*d1, backend="cpp")
    assert decode_calls["diff"] == 2 and decode_calls["ordinary"] == 1
    assert rel_err(out, diff_attention_reference(q, k_row.contiguous(), v_row.contiguous(), 0.3)) <= 1e-5
    assert rel_err(out1, diff_attention_reference(q1, k, v, 0.3)) <= 1e-5
    assert rel_err(out_d1, mha_reference(*d1)) <= 1e-5


@pytest.mark.parametrize("T", [1, 100], ids=["decode", "infer"])
def test_no_cached_key_at_all_gives_zeros(T):
    """S = 0 (an empty cache, full attention): every row sees no key, so the output is zeros, with the fused head
    norm too, where the DIFF decode path must not write through a buffer it never allocated."""
    q, k, v = random_inputs(2, 2, 1, T, 0, 32, seed=T)
    with torch.no_grad():
        diff = differential_attention(q, k, v, torch.tensor(0.5), causal=False, backend="cpp")
        normed = differential_attention(q, k, v, torch.tensor(0.5), causal=False, backend="cpp",
                                        out_norm=(torch.rand(64) + 0.5, 1e-5))
        ordinary = multihead_attention(q, k, k, causal=False, backend="cpp")
    assert diff.shape == normed.shape == (2, 2, T, 64) and ordinary.shape == (2, 4, T, 32)
    assert not diff.any() and not normed.any() and not ordinary.any()


def test_modes_and_traces_see_the_decode_op():
    """A decoding step skips the dispatcher only when nothing must see the op: under a dispatch mode (here
    one that records op names) the call goes through torch.ops and the mode sees it, with the same result."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = random_inputs(1, 2, 2, 1, 40, 32, seed=4)
    with torch.no_grad():
        plain = differential_attention(q, k, v, torch.tensor(0.4), backend="cpp")
        with Names() as names:
            seen = differential_attention(q, k, v, torch.tensor(0.4), backend="cpp")
    assert any("diff_flash_decode" in n for n in names.seen), names.seen
    assert torch.equal(plain, seen)


def test_a_plain_decoding_step_goes_straight_to_the_kernel_and_anything_else_takes_the_general_route(
        monkeypatch, decode_calls):
    """The public functions' short route for a decoding step (fp32 CPU, 'cpp' or 'auto', no grad, no padding, no
    maps) reaches the kernel's decode function without resolving a backend, with the general route's result and its
    errors; any call the rule leaves out (float λ, a strided norm weight, float64, padding, grad, a backend other
    than cpp/auto) resolves a backend on the general route."""
    from difftransformer.attention import functional

    resolved = []
    real = functional.resolve_backend
    monkeypatch.setattr(functional, "resolve_backend", lambda *a, **kw: resolved.append(a[0]) or real(*a, **kw))
    q, k, v = random_inputs(2, 4, 2, 1, 70, 16, seed=21)
    lam, w = torch.tensor(0.4), torch.rand(32) + 0.5
    ref = diff_attention_reference(q, k, v, 0.4)
    ref_normed = ref / torch.sqrt(ref.square().mean(-1, keepdim=True) + 1e-5) * w.double()
    with torch.no_grad():
        for backend in ("cpp", "auto"):
            assert rel_err(differential_attention(q, k, v, lam, backend=backend), ref) <= 1e-5
            got = differential_attention(q, k, v, lam, backend=backend, out_norm=(w, 1e-5))
            assert rel_err(got, ref_normed) <= 1e-5
            assert rel_err(multihead_attention(q, k, k, backend=backend), mha_reference(q, k, k)) <= 1e-5
        assert resolved == [] and decode_calls == {"diff": 4, "ordinary": 2}
        # the general route, same results
        assert rel_err(differential_attention(q, k, v, 0.4, backend="cpp"), ref) <= 1e-5  # λ a float
        strided = torch.stack([w, w], 1)[:, 0]
        assert not strided.is_contiguous()
        got = differential_attention(q, k, v, lam, backend="cpp", out_norm=(strided, 1e-5))
        assert rel_err(got, ref_normed) <= 1e-5
        differential_attention(q.double(), k.double(), v.double(), lam.double(), backend="auto")
        differential_attention(q, k, v, lam, backend="cpp", key_padding_mask=torch.ones(2, 70, dtype=torch.bool))
        multihead_attention(q, k, k, backend="sdpa")
        assert resolved == ["cpp", "cpp", "auto", "cpp", "sdpa"]
        # the short route keeps the general route's errors
        with pytest.raises(ValueError, match=r"k must be \(batch=2, 2\*h_kv, S, d=16\)"):
            differential_attention(q, k[..., :8], v, lam, backend="cpp")
        with pytest.raises(ValueError, match="the same batch B and q/k dim d"):
            multihead_attention(q, k[:1], k[:1], backend="cpp")
        with pytest.raises(ValueError, match="q, k, v must be on one device"):
            differential_attention(q, k.to("meta"), v, lam, backend="cpp")
        with pytest.raises(ValueError, match=r"out_norm's weight must have shape \(2d,\) = \(32,\)"):
            differential_attention(q, k, v, lam, backend="cpp", out_norm=(w[:16], 1e-5))
    q.requires_grad_(True)
    differential_attention(q, k, v, lam, backend="cpp").sum().backward()  # under grad: the training path
    # 3 decode calls above took the general route
    assert q.grad is not None and decode_calls["diff"] == 7 and resolved[-1] == "cpp"


def test_decode_result_does_not_depend_on_the_thread_count():
    """With 3 (batch, kv group) pairs and several splits, one thread runs each pair's splits in one task and
    two threads share the splits (fewer pairs than twice the threads): the same computations in the same
    order, so the outputs are bitwise equal, for DIFF (with its merged statistics) and ordinary attention."""
    q, k, v = random_inputs(3, 2, 1, 1, 300, 32, seed=21)
    saved = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.no_grad():
                outs.append((differential_attention(q, k, v, torch.tensor(0.45), backend="cpp"),
                             multihead_attention(q, k, k, backend="cpp")))
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert rel_err(outs[0][0], diff_attention_reference(q, k, v, 0.45)) <= 1e-5


def test_decode_equals_the_training_path():
    """Same inputs through both paths (the training path is forced by asking for a gradient)."""
    q, k, v = random_inputs(2, 4, 2, 3, 700, 32, seed=11)
    with torch.no_grad():
        fast = differential_attention(q, k, v, torch.tensor(-0.4), backend="cpp")
    slow = differential_attention(q.requires_grad_(), k, v, torch.tensor(-0.4), backend="cpp")
    assert slow.requires_grad
    torch.testing.assert_close(fast, slow.detach(), rtol=1e-5, atol=1e-6)


def test_bf16_is_computed_in_fp32_and_cast_back(decode_calls):
    q, k, v = random_inputs(1, 2, 1, 1, 300, 16, dtype=torch.bfloat16, seed=2)
    with torch.no_grad():
        out = differential_attention(q, k, v, torch.tensor(0.5), backend="cpp")
        full = differential_attention(q.float(), k.float(), v.float(), torch.tensor(0.5), backend="cpp")
    assert out.dtype == torch.bfloat16 and torch.equal(out, full.to(torch.bfloat16))
    assert decode_calls["diff"] == 2


def test_nan_and_rows_that_see_nothing_behave_as_softmax():
    q, k, v = random_inputs(1, 2, 1, 4, 300, 16, seed=8)
    q[0, 1, 2, 3] = float("nan")
    mask = torch.ones(1, 300, dtype=torch.bool)
    mask[0, :298] = False  # causal row 0 sees keys up to 296: all padded, so it sees nothing
    with torch.no_grad():
        out = differential_attention(q, k, v, torch.tensor(0.5), key_padding_mask=mask, backend="cpp")
        eager = differential_attention(q, k, v, torch.tensor(0.5), key_padding_mask=mask, backend="eager")
    assert torch.equal(out.isnan(), eager.isnan()) and out.isnan().any()
    assert torch.equal(out[0, :, 0], torch.zeros_like(out[0, :, 0]))
    ok = ~eager.isnan()
    torch.testing.assert_close(out[ok], eager[ok], rtol=1e-5, atol=1e-6)


def test_dispatch_rule():
    q, k, v = random_inputs(1, 4, 2, 1, 50, 8)
    lam = torch.tensor(0.5)
    assert flash_cpu.decode_path_applies(q, k, q, k, v, lam)  # grad enabled, but nothing requires it
    q_long = torch.randn(1, 8, 33, 8)  # n_rep 2 x 33 queries = 66 rows > 64
    assert not flash_cpu.decode_path_applies(q_long, k, q_long, k, v, lam)
    assert flash_cpu.decode_path_applies(q_long[:, :, :32], k, q_long, k, v, lam)  # 64 rows
    for needs_grad in (q, k, v, lam):
        needs_grad.requires_grad_(True)
        assert not flash_cpu.decode_path_applies(q, k, q, k, v, lam)  # never under grad
        with torch.no_grad():
            assert flash_cpu.decode_path_applies(q, k, q, k, v, lam)
        needs_grad.requires_grad_(False)
    w = torch.ones(16, requires_grad=True)  # a head-norm weight that wants a gradient counts too
    assert not flash_cpu.decode_path_applies(q, k, q, k, v, lam, w)


def test_one_query_under_grad_takes_the_training_path_and_gets_gradients(decode_calls):
    q, k, v = random_inputs(1, 2, 2, 1, 200, 16, seed=3, grad=True)
    lam = torch.tensor(0.3, requires_grad=True)
    out = differential_attention(q, k, v, lam, backend="cpp")
    out.square().sum().backward()
    assert decode_calls["diff"] == 0 and q.grad is not None and lam.grad is not None
    ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v, lam)]
    diff_attention_reference(*ref_in).square().sum().backward()
    for got, want in zip((q, k, v), ref_in):
        assert rel_err(got.grad, want.grad) <= 1e-5


@pytest.mark.parametrize("backend", ["cpp", "eager", "sdpa"])
def test_out_norm_is_the_head_rmsnorm(backend, decode_calls):
    q, k, v = random_inputs(3, 4, 2, 2, 300, 16, seed=5)
    w, eps = torch.rand(32) + 0.5, 1e-5
    with torch.no_grad():
        normed = differential_attention(q, k, v, torch.tensor(0.6), backend=backend, out_norm=(w, eps))
    ref = diff_attention_reference(q, k, v, 0.6)
    ref = ref / torch.sqrt(ref.square().mean(-1, keepdim=True) + eps) * w.double()
    assert rel_err(normed, ref) <= 1e-5
    assert decode_calls["diff"] == (backend == "cpp")
    with pytest.raises(ValueError, match=r"out_norm's weight must have shape \(2d,\) = \(32,\)"):
        differential_attention(q, k, v, 0.6, backend=backend, out_norm=(torch.ones(16), eps))


def test_bf16_out_norm_rounds_before_the_norm_as_the_unfused_path():
    q, k, v = random_inputs(1, 2, 1, 1, 40, 16, dtype=torch.bfloat16, seed=6)
    w = torch.rand(32) + 0.5
    with torch.no_grad():
        fused = differential_attention(q, k, v, torch.tensor(0.5), backend="cpp", out_norm=(w, 1e-5))
        plain = differential_attention(q, k, v, torch.tensor(0.5), backend="cpp")
    assert torch.equal(fused, F.rms_norm(plain.float(), (32,), w, 1e-5).to(torch.bfloat16))


# ---------------------------------------------------------------- the DIFF layer's λ and head norm held by a KV cache


def _layer_outputs(layer, x):
    with torch.no_grad():
        cached = layer(x, kv_cache=KVCache())  # λ and the folded weight derived for a new cache, and held
    fresh = layer(x).detach()  # grad enabled, no cache: λ and the folded weight computed afresh
    return cached, fresh


def _in_place(fn, *args):
    with torch.no_grad():
        fn(*args)


def test_layer_cache_follows_parameter_changes():
    """Each new KV cache derives λ and the head norm from the parameters as they are then, whatever changed
    them in between (an optimizer step, load_state_dict, an in-place write, a new Parameter object)."""
    torch.manual_seed(0)
    layer = MultiheadDiffAttention(64, 3, 2, backend="cpp")
    x = torch.randn(2, 5, 64)
    cached, fresh = _layer_outputs(layer, x)
    assert rel_err(cached, fresh) <= 1e-5
    cache = KVCache()
    lam_before = layer_constants(layer, x, cache)[0]
    with torch.no_grad():
        assert layer_constants(layer, x, cache)[0] is layer_constants(layer, x, cache)[0]  # held while in use
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)  # an optimizer step changes every vector in place
    layer(x).square().sum().backward()
    opt.step()
    changes = [(lambda: None, True),  # the optimizer step above
               (lambda: layer.load_state_dict({**layer.state_dict(), "lambda_q2": torch.full((16,), 0.3)}), True),
               (lambda: _in_place(layer.subln.weight.mul_, 2.0), False),  # only the head norm
               (lambda: setattr(layer, "lambda_k1", torch.nn.Parameter(torch.full((16,), -0.2))), True)]
    for change, moves_lambda in changes:
        change()
        cached, fresh = _layer_outputs(layer, x)
        assert rel_err(cached, fresh) <= 1e-5
        with torch.no_grad():
            lam_now = layer_constants(layer, x, KVCache())[0]
        torch.testing.assert_close(lam_now, layer.lambda_full().detach())
        assert torch.equal(lam_now, lam_before) != moves_lambda
        lam_before = lam_now


def test_layer_under_grad_gets_lambda_and_norm_gradients():
    """λ and the head norm held in a cache filled without gradients are not reused by a step that needs them."""
    torch.manual_seed(1)
    layer, cache = MultiheadDiffAttention(64, 0, 2, backend="cpp"), KVCache()
    with torch.no_grad():
        layer(torch.randn(1, 3, 64), kv_cache=cache)  # fills the cache and its held constants
    assert layer.depth in cache.constants
    layer(torch.randn(1, 1, 64), kv_cache=cache).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for p in (layer.lambda_q1, layer.lambda_k2, layer.subln.weight))


# ---------------------------------------------------------------- generated tokens unchanged


@pytest.mark.parametrize("kind", ["diff", "transformer"])
def test_greedy_generation_cached_equals_uncached_across_both_kernel_paths(kind, decode_calls):
    """A 70-token prompt: the uncached forwards (70+ queries) run the training path, the cached
    steps the decode path; the tokens must be the same."""
    torch.manual_seed(5)
    model = DiffTransformerLM(tiny(kind, attn_backend="cpp")).eval()
    prompt = torch.randint(0, 512, (2, 70))
    cached = model.generate(prompt, 6, temperature=0)
    assert decode_calls["diff" if kind == "diff" else "ordinary"] > 0
    assert torch.equal(cached, model.generate(prompt, 6, temperature=0, use_cache=False))
    a, b = prompt[:1], prompt[1:, 30:]  # batched left-padded = one by one, on the decode path
    batch = torch.cat([a, torch.cat([torch.zeros(1, 30, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :30] = 0
    out = model.generate(batch, 6, temperature=0, attention_mask=mask)
    assert torch.equal(out[0, 70:], cached[0, 70:])
    assert torch.equal(out[1, 70:], model.generate(b, 6, temperature=0)[0, 40:])


def test_layer_cache_is_reused_only_where_it_is_safe():
    torch.manual_seed(2)
    layer = MultiheadDiffAttention(64, 1, 2, backend="cpp")
    x, cache = torch.randn(1, 2, 64), KVCache()
    with torch.no_grad():
        assert layer_constants(layer, x, cache)[0] is layer_constants(layer, x, cache)[0]
    assert layer_constants(layer, x, cache)[0].requires_grad  # grad on, parameters want it: afresh, with a graph
    with torch.inference_mode():
        lam_inf = layer_constants(layer, x, cache)[0]
    for p in layer.parameters():
        p.requires_grad_(False)
    lam = layer_constants(layer, x, cache)[0]  # grad on, nothing wants it: held, but not the inference tensor
    assert lam is not lam_inf and not lam.is_inference() and lam is layer_constants(layer, x, cache)[0]
    q = torch.randn(1, 4, 2, 16, requires_grad=True)
    k, v = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 2, 32)
    differential_attention(q, k, v, lam, backend="cpp", out_norm=layer_constants(layer, x, cache)[1]).sum().backward()
    assert q.grad is not None


def _count_constants(monkeypatch) -> list[int]:
    """Depths of every derivation of (λ, folded norm weight), in order."""
    calls = []
    compute = MultiheadDiffAttention.attention_constants
    monkeypatch.setattr(MultiheadDiffAttention, "attention_constants",
                        lambda self, *a: calls.append(self.depth) or compute(self, *a))
    return calls


def test_a_generation_derives_lambda_once_per_layer_and_follows_new_parameters(monkeypatch):
    """The KV cache holds each layer's (λ, norm weight) for its life, so decoding n tokens derives them
    once per layer, not n times; a new generation (a new cache) sees parameters changed in between,
    and its tokens equal a fresh model's with those parameters."""
    torch.manual_seed(6)
    model = DiffTransformerLM(tiny("diff", attn_backend="cpp")).eval()
    prompt = torch.randint(0, 512, (1, 9))
    calls = _count_constants(monkeypatch)
    model.generate(prompt, 7, temperature=0)
    layers = model.config.num_hidden_layers
    assert sorted(calls) == list(range(layers))
    with torch.no_grad():  # change λ and the head norm of every layer in place (no new objects)
        for layer in model.modules():
            if isinstance(layer, MultiheadDiffAttention):
                layer.lambda_q1.add_(0.5)
                layer.subln.weight.mul_(-1.5)
    calls.clear()
    again = model.generate(prompt, 7, temperature=0)
    assert sorted(calls) == list(range(layers))
    fresh = DiffTransformerLM(tiny("diff", attn_backend="cpp")).eval()
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(again, fresh.generate(prompt, 7, temperature=0, use_cache=False))


def test_a_cache_held_without_grad_never_feeds_a_backward():
    """Constants held by a cache under no_grad are not used when gradients flow: λ and the norm weight
    still get their gradients through the same cache."""
    torch.manual_seed(7)
    layer = MultiheadDiffAttention(64, 0, 2, backend="cpp")
    cache = KVCache()
    with torch.no_grad():
        layer(torch.randn(1, 3, 64), kv_cache=cache)
    assert 0 in cache.constants
    layer(torch.randn(1, 1, 64), kv_cache=cache).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for p in (layer.lambda_q1, layer.lambda_k2, layer.subln.weight))
    with torch.inference_mode():  # an inference-mode step does not take the no_grad pair (nor the reverse)
        lam_inf = layer_constants(layer, torch.randn(1, 1, 64), cache)[0]
    assert lam_inf.is_inference()
    with torch.no_grad():
        assert not layer_constants(layer, torch.randn(1, 1, 64), cache)[0].is_inference()


def _under_function_mode(check):
    from torch.overrides import TorchFunctionMode

    class Passthrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        return check()


def _under_dispatch_mode(check):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        return check()


def _under_jit_trace(check):
    seen = []

    def fn(x):
        seen.append(check())
        return x + 1

    torch.jit.trace(fn, torch.ones(2), check_trace=False)
    return seen[0]


def _decode_step_direct(monkeypatch) -> bool:
    """Whether a plain decoding step (fp32 CPU, backend 'cpp', no grad) reaches the extension's plain function
    rather than torch.ops' op: the op is wrapped here to count its calls."""
    module = flash_cpu.loaded_module()
    plain = module.flash_decode
    ops = count_op_calls(monkeypatch, op="flash_decode")
    monkeypatch.setattr(module, "flash_decode", plain)  # the plain function is not counted
    q, k, v = random_inputs(1, 2, 2, 1, 9, 16, seed=3)
    with torch.no_grad():
        out = multihead_attention(q, k, k, backend="cpp")
    assert rel_err(out, mha_reference(q, k, k)) <= 1e-5
    return ops["op"] == 0


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("observe", [_under_function_mode, _under_dispatch_mode, _under_jit_trace])
def test_the_decode_route_and_ops_observed_see_the_same_observers(observe):
    """Under each observer `ops_observed` says the op has to be called and the decoding route declines (the call
    takes the general route, which calls the op); with none, both let the direct call through."""
    from difftransformer.attention.decode import cpu_decode_ordinary
    from difftransformer.kernels import ops_observed

    assert flash_cpu.is_available()  # loads the extension
    q, k, v = random_inputs(1, 2, 2, 1, 9, 16, seed=3)

    def check():
        with torch.no_grad():
            return ops_observed(), cpu_decode_ordinary(q, k, k, True, 0.25, "cpp")

    observed, direct = check()
    assert not observed and rel_err(direct, mha_reference(q, k, k, scale=0.25)) <= 1e-5
    assert observe(check) == (True, None)


def test_the_observer_hooks_are_used_on_this_torch():
    """`ops_observed` reads private hooks of torch._C on the torch releases they were checked with; this fails
    the day torch drops one or a newer release is installed: run this module's observer tests there, then raise
    kernels.OBSERVER_HOOKS_CHECKED_UP_TO."""
    from difftransformer import kernels

    assert kernels.OBSERVER_HOOKS_USED, (torch.__version__, kernels.OBSERVER_HOOKS_CHECKED_UP_TO)


def test_without_the_observer_hooks_every_call_goes_through_the_ops(monkeypatch):
    """A torch newer than the hooks were checked with, or one without a hook, gets no hooks; then every call
    counts as observed, and decoding steps reach the kernel through torch.ops, with the same result."""
    from difftransformer import kernels

    major, minor = kernels.OBSERVER_HOOKS_CHECKED_UP_TO
    monkeypatch.setattr(torch, "__version__", f"{major}.{minor + 1}.0+cpu")
    assert kernels._observer_hooks() is None
    monkeypatch.setattr(torch, "__version__", f"{major}.{minor}.1+cpu")
    assert kernels._observer_hooks() is not None
    monkeypatch.delattr(torch._C, "_len_torch_dispatch_stack")
    assert kernels._observer_hooks() is None
    monkeypatch.undo()
    assert _decode_step_direct(monkeypatch)
    monkeypatch.setattr(kernels, "_is_tracing", None)  # as _observer_hooks() None leaves it
    assert kernels.ops_observed() and not _decode_step_direct(monkeypatch)

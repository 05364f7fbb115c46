"""Decoding on a static KV cache (and, on CUDA, from a CUDA graph) equals decoding on the growing cache.

The contract of `model/static_decode.py`: the same greedy tokens as `generate(decoder='dynamic')` for every
attention kind, with and without left padding, when a decoder is reused for a new prompt and after the
parameters change in place; a step that reads no device value on the host and runs the same ops on the same
shapes every time (what a CUDA graph replays); and one-line errors for what cannot run.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from difftransformer import DiffTransformerLM
from difftransformer.attention import StaticKVCache
from difftransformer.model.static_decode import StaticDecoder, capacity_for, decoder_for, release_decoders
from tests.helpers import tiny

KINDS = ["diff", "transformer", "diff_v2", "diff_no_headnorm", "transformer_gated", "transformer_ssmax"]


def _prompt(B: int = 3, T: int = 7, padded: bool = True):
    ids = torch.randint(1, 512, (B, T))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0
        mask[2, :1] = 0
    return ids, (mask if padded else None)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("padded", [False, True])
def test_static_decoding_gives_the_growing_caches_greedy_tokens(kind, padded):
    torch.manual_seed(11)
    model = DiffTransformerLM(tiny(kind)).eval()
    ids, mask = _prompt(padded=padded)
    dynamic = model.generate(ids, 20, temperature=0, attention_mask=mask, decoder="dynamic")
    assert torch.equal(model.generate(ids, 20, temperature=0, attention_mask=mask, decoder="static"), dynamic)
    other, other_mask = _prompt(padded=padded)  # the decoder is reused: its cache and step state restart
    assert torch.equal(model.generate(other, 20, temperature=0, attention_mask=other_mask, decoder="static"),
                       model.generate(other, 20, temperature=0, attention_mask=other_mask, decoder="dynamic"))
    release_decoders(model)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_static_step_logits_equal_the_growing_caches_step_by_step(backend):
    """Logits, not only argmaxes: every step of a static decoder against a growing-cache forward."""
    torch.manual_seed(12)
    model = DiffTransformerLM(tiny("diff", attn_backend=backend)).eval()
    ids, mask = _prompt()
    decoder = StaticDecoder(model, 3, 32, torch.device("cpu"), graph=False)
    with torch.no_grad():
        got = decoder.start(ids, mask)
        seq, full = ids, mask
        for _ in range(8):
            positions = (full.cumsum(-1) - 1).clamp(min=0)
            want = model(seq, attention_mask=full.bool(), position_ids=positions).logits[:, -1]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            token = torch.randint(1, 512, (3,))
            seq, full = torch.cat((seq, token[:, None]), 1), torch.cat((full, torch.ones(3, 1).long()), 1)
            got = decoder.step(token)


def test_a_reused_decoder_sees_parameters_changed_in_place():
    """λ and the head norm are held for a cache's life; a decoder used again must derive them anew."""
    torch.manual_seed(13)
    model = DiffTransformerLM(tiny("diff")).eval()
    ids, mask = _prompt()
    model.generate(ids, 6, temperature=0, attention_mask=mask, decoder="static")
    with torch.no_grad():
        for block in model.layers:
            block.self_attn.lambda_q1.add_(0.7)
            block.self_attn.subln.weight.mul_(1.5)
            block.self_attn.v_proj.weight.mul_(-1.0)
    assert torch.equal(model.generate(ids, 12, temperature=0, attention_mask=mask, decoder="static"),
                       model.generate(ids, 12, temperature=0, attention_mask=mask, decoder="dynamic"))


def test_static_decoding_samples_like_the_growing_cache_and_stops_at_eos():
    torch.manual_seed(14)
    model = DiffTransformerLM(tiny("diff")).eval()
    ids, mask = _prompt()
    kw = dict(temperature=0.8, top_k=40, top_p=0.9, attention_mask=mask)
    a = model.generate(ids, 15, generator=torch.Generator().manual_seed(3), decoder="static", **kw)
    b = model.generate(ids, 15, generator=torch.Generator().manual_seed(3), decoder="dynamic", **kw)
    assert torch.equal(a, b)
    greedy = model.generate(ids, 12, temperature=0, decoder="dynamic")
    eos = int(greedy[0, 9])  # the third new token of row 0 (or an earlier one, where it came before)
    out = model.generate(ids, 12, temperature=0, eos_token_id=eos, decoder="static")
    assert torch.equal(out, model.generate(ids, 12, temperature=0, eos_token_id=eos, decoder="dynamic"))
    first = int((out[0, 7:] == eos).nonzero()[0])
    assert first <= 2 and bool((out[0, 7 + first:] == eos).all())  # a finished row keeps emitting eos


class _Recorder(TorchDispatchMode):
    """Every aten op of a region with its output shapes; fails on an op that reads a device value on the host."""

    HOST_READS = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.equal", "aten.is_nonzero")

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        assert not name.startswith(self.HOST_READS), f"{name} reads a device value on the host: not capturable"
        out = func(*args, **(kwargs or {}))
        shapes = tuple(tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                       if isinstance(t, torch.Tensor))
        self.ops.append((str(func), shapes))
        return out


@pytest.mark.parametrize("kind", ["diff", "transformer", "diff_v2", "transformer_ssmax"])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_a_static_step_is_capturable_the_same_ops_on_the_same_shapes_and_no_host_reads(kind, backend):
    """What a CUDA graph needs of the step, checked on the CPU with the routes CUDA takes (sdpa, eager)."""
    torch.manual_seed(15)
    model = DiffTransformerLM(tiny(kind, attn_backend=backend)).eval()
    ids, mask = _prompt()
    decoder = StaticDecoder(model, 3, 32, torch.device("cpu"), graph=False)
    with torch.no_grad():
        decoder.start(ids, mask)
        decoder.step(torch.randint(1, 512, (3,)))  # builds what a first call builds (RoPE table)
        runs = []
        for _ in range(2):
            with _Recorder() as rec:
                decoder._run()  # the region a graph captures (step() adds the host-side count)
            decoder.cache.advance(1)
            runs.append(rec.ops)
    assert runs[0] == runs[1] and len(runs[0]) > 20


def test_a_static_cache_writes_the_prompt_in_place_and_a_step_at_its_slot():
    cache = StaticKVCache(8)
    k, v = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 6)
    keys, values = cache.update(0, k, v)
    assert keys.shape == (2, 3, 4, 5) and torch.equal(keys, k) and torch.equal(values, v)
    cache.advance(4)
    cache.step_index = torch.tensor([4])
    k1, v1 = torch.randn(2, 3, 1, 5), torch.randn(2, 3, 1, 6)
    keys, values = cache.update(0, k1, v1)
    assert keys.shape == (2, 3, 8, 5)  # the whole buffer: the caller masks slots not yet written
    assert torch.equal(keys[:, :, :4], k) and torch.equal(keys[:, :, 4:5], k1) and torch.equal(values[:, :, 4:5], v1)
    assert not keys[:, :, 5:].any()


def test_static_cache_and_decoder_errors_name_the_problem_and_the_fix():
    cache = StaticKVCache(4)
    cache.update(0, torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    cache.advance(3)
    with pytest.raises(ValueError, match="holds 4 positions; 3 are written and 2 more do not fit"):
        cache.advance(2)
    with pytest.raises(ValueError, match="a cache belongs to the model, batch and dtype"):
        cache.update(0, torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    with pytest.raises(ValueError, match="capacity must be a positive"):
        StaticKVCache(0)
    model = DiffTransformerLM(tiny("diff")).eval()
    ids = torch.randint(0, 512, (1, 4))
    with pytest.raises(ValueError, match="decoder='graph' cannot run here: CUDA graphs need a CUDA device"):
        model.generate(ids, 2, decoder="graph")
    with pytest.raises(ValueError, match="use_cache=False asks for none"):
        model.generate(ids, 2, decoder="static", use_cache=False)
    with pytest.raises(ValueError, match="unknown decoder 'fast'"):
        model.generate(ids, 2, decoder="fast")


def test_decoders_are_reused_per_size_and_rebuilt_for_new_parameters():
    model = DiffTransformerLM(tiny("diff")).eval()
    cpu = torch.device("cpu")
    first = decoder_for(model, 2, 256, cpu, graph=False)
    assert decoder_for(model, 2, 256, cpu, graph=False) is first
    assert decoder_for(model, 3, 256, cpu, graph=False) is not first
    model.double()  # new parameter storage: a captured graph would read the old
    assert decoder_for(model, 2, 256, cpu, graph=False) is not first
    assert capacity_for(7, 10_000) == 256 and capacity_for(257, 10_000) == 512 and capacity_for(300, 300) == 300
    release_decoders(model)


def test_a_models_held_decoders_do_not_keep_it_alive():
    import gc
    import weakref

    model = DiffTransformerLM(tiny("diff")).eval()
    model.generate(torch.randint(0, 512, (1, 5)), 3, decoder="static")
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["diff", "transformer", "diff_v2", "transformer_ssmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decoding_gives_the_eager_greedy_tokens(kind, dtype):
    torch.manual_seed(16)
    model = DiffTransformerLM(tiny(kind), device="cuda", dtype=dtype).eval()
    ids, mask = _prompt(B=4, T=24)
    ids, mask = ids.cuda(), mask.cuda()
    for padded in (None, mask):
        eager = model.generate(ids, 40, temperature=0, attention_mask=padded, decoder="dynamic")
        graph = model.generate(ids, 40, temperature=0, attention_mask=padded, decoder="graph")
        again = model.generate(ids, 40, temperature=0, attention_mask=padded, decoder="graph")  # replayed only
        if dtype is torch.float32:
            assert torch.equal(graph, eager) and torch.equal(again, eager)
        else:  # bf16: the masked kernel rounds differently; a near tie may flip late, never the first tokens
            assert torch.equal(graph[:, :32], eager[:, :32]) and torch.equal(again, graph)


def test_what_keeps_a_step_out_of_a_cuda_graph_is_named():
    from difftransformer.attention.decode import graph_refusal

    model = DiffTransformerLM(tiny("diff")).eval()
    assert graph_refusal(model) is None
    model.layers[1].self_attn.score_hook = lambda scores, visible: None
    assert "score hook" in graph_refusal(model)
    model.layers[1].self_attn.score_hook = None
    with _Recorder():
        assert "observing the calls" in graph_refusal(model)


@pytest.mark.skipif(not __import__("difftransformer.kernels", fromlist=["triton_runs"]).triton_runs(),
                    reason="needs Triton (a CUDA device or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("kind", ["diff", "diff_no_headnorm"])
def test_on_the_triton_backend_a_static_step_takes_the_decoding_kernel_with_the_eager_logits(kind):
    """A one-row step with the cache's key mask runs the Triton decoding kernel; its logits match the eager
    backend's step by step, and greedy decoding gives the same tokens."""
    torch.manual_seed(17)
    fused = DiffTransformerLM(tiny(kind, attn_backend="triton")).eval()
    eager = DiffTransformerLM(tiny(kind, attn_backend="eager")).eval()
    eager.load_state_dict(fused.state_dict())
    ids, mask = _prompt(T=9, padded=False)  # (the Triton prefill takes no padding; the steps' key mask it does)
    decoders = [StaticDecoder(m, 3, 40, torch.device("cpu"), graph=False) for m in (fused, eager)]
    with torch.no_grad():
        got, want = (dec.start(ids, mask) for dec in decoders)
        for _ in range(4):
            token = torch.randint(1, 512, (3,))
            got, want = (dec.step(token) for dec in decoders)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(fused.generate(ids, 6, temperature=0, attention_mask=mask, decoder="static"),
                       eager.generate(ids, 6, temperature=0, attention_mask=mask, decoder="dynamic"))

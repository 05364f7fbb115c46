"""The wrapper's lean decoding loop (difftransformer.hf.generation) against transformers' own `_sample`.

transformers' loop is the reference: each case runs `generate()` twice from the same seed, once through
`lean_sample` and once with it switched off, and the tokens must be equal: greedy and sampling, EOS stops
with finished rows padded, a batch where every row stops early, left padding, logits processors that
write into their input, max_length instead of max_new_tokens. The calls the lean loop leaves out
(streamer, returned scores, custom stopping criteria, embeddings) must run transformers' loop. The lean loop
is switched on here whatever transformers is installed (the `fast` fixture), so these tests fail the day a
release changes what it copies; with a release it was not tested with, generate() runs transformers' loop.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from transformers import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList, TextStreamer  # noqa: E402

from difftransformer.hf import DiffTransformerForCausalLM, compat, generation, modeling  # noqa: E402
from difftransformer.model import DiffTransformerConfig, DiffTransformerLM, static_decode  # noqa: E402

VOCAB = 64


def wrapper(seed: int = 0, **config_kwargs) -> DiffTransformerForCausalLM:
    torch.manual_seed(seed)
    cfg = DiffTransformerConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=1, attention="diff", max_position_embeddings=64,
                                initializer_range=0.2)
    return DiffTransformerForCausalLM.from_native(DiffTransformerLM(cfg).eval(), **config_kwargs).eval()


@pytest.fixture
def lean_calls(monkeypatch, fast) -> list:
    """One entry per run of lean_sample."""
    calls = []
    real = modeling.lean_sample
    monkeypatch.setattr(modeling, "lean_sample", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def both(hf, lean_calls, monkeypatch, seed: int = 0, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """generate(**kwargs) through the lean loop and through transformers' loop, each from torch seed `seed`."""
    real = modeling.lean_sample_applies
    lean_calls.clear()
    torch.manual_seed(seed)
    lean = hf.generate(**kwargs)
    ran = len(lean_calls)
    monkeypatch.setattr(modeling, "lean_sample_applies", lambda *a, **kw: False)
    torch.manual_seed(seed)
    theirs = hf.generate(**kwargs)
    monkeypatch.setattr(modeling, "lean_sample_applies", real)
    assert ran == 1 and len(lean_calls) == 1, "the lean loop did not run (or ran for the reference)"
    return lean, theirs


def _eos_of(hf, ids: torch.Tensor, after: int) -> int:
    """A token greedy decoding emits for row 0 at step `after` or later, and not before (so an EOS there stops
    that row early, and no earlier)."""
    new = hf.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    fresh = [t for i, t in enumerate(new) if i >= after and t not in new[:i]]
    assert fresh, f"pick another prompt: row 0 emits only {new}"
    return fresh[0]


CASES = {
    "greedy": dict(do_sample=False, max_new_tokens=9),
    "greedy_max_length": dict(do_sample=False, max_length=15),
    "sampling": dict(do_sample=True, max_new_tokens=9, temperature=0.9, top_k=20, top_p=0.95),
    "processors": dict(do_sample=False, max_new_tokens=9, repetition_penalty=1.3, no_repeat_ngram_size=2),
}


STEPS = ["transformers_steps", "static_cache_steps"]


def _steps(request, which: str) -> None:
    """Run the lean loop's forward passes as transformers does, or on a static KV cache (`static_steps`)."""
    if which == "static_cache_steps":
        request.getfixturevalue("static_steps")


@pytest.mark.parametrize("which", STEPS)
@pytest.mark.parametrize("case", list(CASES))
def test_lean_loop_gives_transformers_tokens(case, which, lean_calls, monkeypatch, request):
    _steps(request, which)
    hf = wrapper()
    ids = torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(5))
    lean, theirs = both(hf, lean_calls, monkeypatch, seed=11, input_ids=ids, **CASES[case])
    assert lean.shape == theirs.shape and torch.equal(lean, theirs)


@pytest.mark.parametrize("which", STEPS)
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
def test_eos_stops_rows_and_pads_them_as_transformers_does(sample, which, lean_calls, monkeypatch, request):
    """An EOS that row 0 emits early: that row is padded with the pad id afterwards while the others go on,
    with left-padded prompts (attention mask) and a processor that needs the EOS (min_new_tokens)."""
    _steps(request, which)
    hf = wrapper()
    ids = torch.randint(1, VOCAB, (3, 7), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[2, :3] = 0
    eos = _eos_of(hf, ids, 2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=0,
                  do_sample=sample, min_new_tokens=2)
    lean, theirs = both(hf, lean_calls, monkeypatch, seed=3, **kwargs)
    assert torch.equal(lean, theirs)
    if not sample:  # the stop really happened: row 0 emits EOS before the end, then only pads
        new = lean[0, 7:].tolist()
        assert eos in new[:-1] and set(new[new.index(eos) + 1:]) == {0}, new


def test_a_batch_where_every_row_stops_ends_early(lean_calls, monkeypatch):
    hf = wrapper()
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    eos = _eos_of(hf, ids, 1)
    lean, theirs = both(hf, lean_calls, monkeypatch, input_ids=ids, max_new_tokens=10, eos_token_id=eos,
                        pad_token_id=0, do_sample=False)
    assert torch.equal(lean, theirs) and lean.shape == (1, 5 + 2)


@pytest.fixture
def static_path(monkeypatch):
    """generate() as on CUDA: the calls that `generation.graph_decoder_for` gives a static KV cache decode on one
    (what CUDA replays from a graph), run eagerly here; one entry per decoder handed out."""
    made = []

    def eager(*args, graph, **kwargs):
        made.append(static_decode.decoder_for(*args, graph=False, **kwargs))
        return made[-1]

    monkeypatch.setattr(generation, "graph_unsupported", lambda *a: None)
    monkeypatch.setattr(generation, "decoder_for", eager)
    return made


@pytest.fixture
def static_steps(static_path):
    """The lean loop's forward passes on a static KV cache, asserting that the call did decode on one."""
    yield static_path
    assert static_path, "the lean loop never asked for a static-cache decoder"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_wrapper_decodes_from_a_graph_with_the_eager_tokens(lean_calls, monkeypatch):
    hf = wrapper().cuda()
    ids = torch.randint(1, VOCAB, (3, 7), generator=torch.Generator().manual_seed(8)).cuda()
    mask = torch.ones_like(ids)
    mask[2, :3] = 0
    made = []
    real = modeling.graph_decoder_for
    monkeypatch.setattr(modeling, "graph_decoder_for", lambda *a: made.append(real(*a)) or made[-1])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    graph = hf.generate(**kwargs)
    assert made[0] is not None and made[0].graph and made[0]._graph is not None  # it captured and replayed
    monkeypatch.setattr(modeling, "graph_decoder_for", lambda *a: None)
    assert torch.equal(graph, hf.generate(**kwargs))


def _reference(hf, ids: torch.Tensor, positions: torch.Tensor, new: int) -> list[int]:
    """Greedy tokens from full forwards without a cache, the positions going on by one per new token."""
    ids, positions = ids.clone(), positions.clone()
    for _ in range(new):
        logits = hf(ids, position_ids=positions, use_cache=False).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
        positions = torch.cat([positions, positions[:, -1:] + 1], 1)
    return ids[0].tolist()


def test_the_cuda_path_keeps_the_callers_position_ids(static_path, lean_calls):
    """A static decoder places the prompt at the mask's positions: given position_ids of the caller's, generate()
    decodes on transformers' steps instead, with the tokens of full forwards at those positions."""
    hf = wrapper()
    ids = torch.tensor([[5, 9, 3, 17, 40, 2, 8]])
    positions = torch.arange(0, 14, 2)[None]
    out = hf.generate(ids, position_ids=positions, max_new_tokens=6, do_sample=False)
    assert lean_calls and not static_path
    assert out[0].tolist() == _reference(hf, ids, positions, 6)
    assert out[0].tolist() != hf.generate(ids, max_new_tokens=6, do_sample=False)[0].tolist()  # the positions matter
    assert static_path  # and a call without them decodes on a static cache


def test_the_cuda_path_continues_a_filled_cache(static_path, lean_calls):
    """A static decoder starts from an empty cache: a call that continues a cache already holding a prefix (the
    new tokens alone, with the full mask) decodes on transformers' steps, with a one-shot call's tokens; without
    the mask, transformers reads the new tokens as already cached and the call fails, as it does for Llama."""
    from transformers.cache_utils import DynamicCache

    hf = wrapper()
    ids = torch.tensor([[5, 9, 3, 17, 40, 2, 8, 11, 30, 4]])
    want = hf.generate(ids, max_new_tokens=6, do_sample=False)
    made = len(static_path)

    def continued(**kwargs) -> torch.Tensor:
        cache = DynamicCache()
        hf(ids[:, :7], **{compat.CACHE_KEY: cache})
        return hf.generate(ids[:, 7:], max_new_tokens=6, do_sample=False, **{compat.CACHE_KEY: cache}, **kwargs)

    assert continued(attention_mask=torch.ones_like(ids))[0, -6:].tolist() == want[0, -6:].tolist()
    with pytest.raises(ValueError, match="input_ids is empty"):
        continued()
    assert len(static_path) == made  # neither continuation made a static decoder


def test_the_cuda_path_past_the_position_limit_fails_with_the_models_error(static_path, lean_calls):
    hf = wrapper()  # max_position_embeddings 64
    ids = torch.randint(1, VOCAB, (1, 60), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="exceeds max_position_embeddings 64"):
        hf.generate(ids, max_new_tokens=10, do_sample=False)
    assert not static_path


class _Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("case", ["streamer", "scores", "criteria", "two_limits", "embeds", "no_cache"])
def test_other_calls_run_transformers_loop(case, lean_calls):
    hf = wrapper()
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    kwargs = dict(input_ids=ids, max_new_tokens=3, do_sample=False)
    if case == "streamer":
        class _Tok:
            def decode(self, tokens, **kw):
                return ""
        kwargs["streamer"] = TextStreamer(_Tok())
    elif case == "scores":
        kwargs.update(return_dict_in_generate=True, output_scores=True)
    elif case == "criteria":
        kwargs["stopping_criteria"] = StoppingCriteriaList([_Never()])
    elif case == "two_limits":  # two length limits of the caller's: transformers stops at the first one reached
        kwargs.update(max_new_tokens=6, stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(5 + 6),
                                                                                MaxLengthCriteria(5 + 3)]))
    elif case == "embeds":
        kwargs = dict(inputs_embeds=hf.embed_tokens(ids).detach(), max_new_tokens=3, do_sample=False)
    elif case == "no_cache":
        kwargs["use_cache"] = False
    out = hf.generate(**kwargs)
    assert len(lean_calls) == 0
    plain = hf.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    assert len(lean_calls) == 1
    got = out.sequences if case == "scores" else out
    want = plain[:, 5:] if case == "embeds" else plain
    assert torch.equal(got, want)


def test_a_transformers_without_the_internals_it_uses_runs_transformers_loop(monkeypatch):
    """lean_sample uses transformers 5's generation internals; where one is missing (another version) the call
    is left to transformers' own loop rather than failing."""
    from types import SimpleNamespace

    from transformers import GenerationConfig
    from transformers.cache_utils import DynamicCache

    from difftransformer.hf.generation import lean_sample_applies

    hf = wrapper()
    config = GenerationConfig(max_new_tokens=3)
    config._pad_token_tensor = None
    kwargs = {compat.CACHE_KEY: DynamicCache(), "use_cache": True, "attention_mask": None}
    criteria = StoppingCriteriaList([MaxLengthCriteria(9)])
    assert lean_sample_applies(hf, config, False, None, criteria, kwargs)
    assert not lean_sample_applies(SimpleNamespace(), config, False, None, criteria, kwargs)  # no _prefill
    del config._pad_token_tensor
    assert not lean_sample_applies(hf, config, False, None, criteria, kwargs)


def test_the_internals_lean_sample_uses_have_the_tested_signatures():
    """The private GenerationMixin methods the fast paths override or call, with the parameters they were tested
    with: a release that renames one fails here (and lean_sample_applies / compat.FAST keep it off meanwhile)."""
    import inspect

    from transformers import GenerationMixin

    from difftransformer.hf.generation import sample_arguments

    def params(f) -> list[str]:
        return [p for p in inspect.signature(f).parameters if p != "self"]

    assert params(GenerationMixin._sample) == params(sample_arguments)
    assert params(GenerationMixin._prefill) == ["input_ids", "generation_config", "model_kwargs", "is_first_iteration"]
    assert params(GenerationMixin._update_model_kwargs_for_generation)[:3] == ["outputs", "model_kwargs",
                                                                              "is_encoder_decoder"]
    assert params(GenerationMixin._prepare_position_ids_for_generation) == ["inputs_tensor", "model_kwargs"]
    assert callable(GenerationMixin._optimize_model_for_decode)


def test_fast_paths_are_chosen_for_the_tested_releases_only():
    import transformers

    assert compat.tested("5.23.0") and compat.tested("5.24.2") and compat.tested("5.24.0.dev0")
    assert not compat.tested("5.25.0") and not compat.tested("5.2.0") and not compat.tested("6.0.0")
    assert compat.FAST == compat.tested(transformers.__version__)
    from packaging.version import Version

    newer = Version(transformers.__version__) >= Version("5.24.0.dev0")
    assert compat.CACHE_KEY == ("cache" if newer else "past_key_values")  # the output class says which


def test_a_release_not_tested_runs_transformers_public_loop(monkeypatch):
    """compat.FAST False (any release not in compat.TESTED_MINORS): generate() never enters the lean loop, the lean
    step inputs or the in-place cache layers, and still gives the tokens of transformers' loop."""
    from transformers.cache_utils import DynamicLayer

    hf = wrapper()
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    monkeypatch.setattr(compat, "FAST", True)
    want = hf.generate(ids, **kwargs)
    monkeypatch.setattr(compat, "FAST", False)
    monkeypatch.setattr(modeling, "lean_sample", lambda *a, **kw: pytest.fail("the lean loop ran"))
    seen = []
    forward = type(hf).forward

    @functools.wraps(forward)  # its signature stays forward's: transformers reads it
    def recording(self, *args, **kw):
        seen.append(kw)
        return forward(self, *args, **kw)

    monkeypatch.setattr(type(hf), "forward", recording)
    assert torch.equal(hf.generate(ids, **kwargs), want)
    assert all(kw.get("position_ids") is not None for kw in seen)  # transformers' positions from the mask
    cache = seen[-1][compat.CACHE_KEY]
    assert cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers)

"""The transformers integration (difftransformer.hf): the wrapper computes what our model computes.

Logits equal the native model's for every attention kind (MHA and GQA, tied and untied), greedy
`generate()` gives our `generate`'s tokens (left-padded batches included), beam search scores match
the native model's log-probabilities (so the cache is reordered correctly), attention maps are the
differential maps, checkpointing changes nothing, PEFT LoRA trains only its adapters, and folders
load both ways, in a fresh process too, while a file that is not safetensors is refused unread.
"""

from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: E402

from difftransformer import KVCache  # noqa: E402
from difftransformer.hf import DiffTransformerForCausalLM, DiffTransformerHFConfig  # noqa: E402
from difftransformer.hf.compat import CACHE_KEY  # noqa: E402
from difftransformer.model import ATTENTION_KINDS, DiffTransformerConfig, DiffTransformerLM  # noqa: E402
from difftransformer.model.serialization import load_weights  # noqa: E402
from tests.hf import loads_both_ways  # noqa: E402

VOCAB = 128
PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 4, 6], [11], [3, 3, 90, 41]]


def small(attention: str = "diff", gqa: bool = False, **overrides) -> DiffTransformerConfig:
    """A 2-layer, width-32 model of `attention` (heads in that kind's units), GQA with 2 queries per kv head."""
    heads = 2 if ATTENTION_KINDS[attention].diff_heads else 4
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=heads,
                  num_key_value_heads=heads // 2 if gqa else heads, attention=attention, max_position_embeddings=64,
                  initializer_range=0.1)  # wider than 0.02 so greedy choices are clear-cut
    return DiffTransformerConfig(**{**fields, **overrides})


def pair(attention: str = "diff", seed: int = 0, **overrides) -> tuple[DiffTransformerLM, DiffTransformerForCausalLM]:
    """A random native model and the wrapper around the same modules, both in eval mode."""
    torch.manual_seed(seed)
    lm = DiffTransformerLM(small(attention, **overrides)).eval()
    return lm, DiffTransformerForCausalLM.from_native(lm).eval()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def ids_of(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows)


def left_pad(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


# ------------------------------------------------------------------------------ config


def test_config_defaults_and_fields_are_ours():
    hf, native = DiffTransformerHFConfig(), DiffTransformerConfig()
    assert hf.model_type == "difftransformer"
    assert hf.to_native() == native  # same defaults, resolved the same way (kv heads, FFN width)
    cfg = small("diff", gqa=True, lambda_init=0.5, tie_word_embeddings=False)
    assert DiffTransformerHFConfig.from_native(cfg).to_native() == cfg


def test_a_new_model_is_initialised_as_ours():
    """transformers initialises a new model through `_init_weights` (its hook for custom models): our init,
    N(0, initializer_range) matrices, unit norms, λ vectors N(0, 0.1)."""
    from difftransformer.norm import RMSNorm

    torch.manual_seed(0)
    hf = DiffTransformerForCausalLM(DiffTransformerHFConfig.from_native(small("diff", initializer_range=0.05)))
    assert hf.embed_tokens.weight.std().item() == pytest.approx(0.05, rel=0.1)
    assert hf.layers[0].self_attn.q_proj.weight.std().item() == pytest.approx(0.05, rel=0.1)
    norms = [m.weight for m in hf.modules() if isinstance(m, RMSNorm) and m.weight is not None]
    assert norms and all(torch.equal(w, torch.ones_like(w)) for w in norms)
    assert hf.layers[0].self_attn.lambda_q1.std().item() == pytest.approx(0.1, rel=0.5)


def test_config_errors_name_the_value_and_the_rule():
    with pytest.raises(ValueError, match=r"invalid difftransformer config: hidden_size \(30\) must be divisible"):
        DiffTransformerHFConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="unknown attention kind 'dif'.*did you mean 'diff'"):
        DiffTransformerHFConfig(attention="dif")
    with pytest.raises(ValueError, match="model_type 'llama'.*reads only 'difftransformer'"):
        DiffTransformerHFConfig(model_type="llama")
    with pytest.raises(ValueError, match="format_version 2 .*upgrade difftransformer"):
        DiffTransformerHFConfig(format_version=2)


# ------------------------------------------------------------------------------ numerics


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("attention", list(ATTENTION_KINDS))
def test_logits_equal_the_native_model(attention, gqa, tied):
    lm, hf = pair(attention, gqa=gqa, tie_word_embeddings=tied)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel(hf(ids).logits, lm(ids).logits) <= 1e-5
        # Cached decoding: a 6-token prefix, then 3 tokens through the transformers cache vs our KVCache; the cache
        # under either of its names (`past_key_values` up to transformers 5.23, `cache` from 5.24).
        cache, ours = DynamicCache(), KVCache()
        hf(ids[:, :6], past_key_values=cache, use_cache=True)
        lm(ids[:, :6], kv_cache=ours)
        step = hf(ids[:, 6:], cache=cache, use_cache=True)
        assert step[CACHE_KEY] is cache and cache.get_seq_length() == 9
        assert rel(step.logits, lm(ids[:, 6:], kv_cache=ours).logits) <= 1e-5


def test_loss_inputs_embeds_and_logits_to_keep():
    lm, hf = pair()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[0, :3] = -100
    targets = torch.cat((labels[:, 1:], torch.full((2, 1), -100)), dim=1)  # ours are already shifted
    with torch.no_grad():
        out = hf(ids, labels=labels)
        assert rel(out.loss, lm(ids, targets).loss) <= 1e-6
        assert torch.equal(hf(inputs_embeds=hf.embed_tokens(ids)).logits, out.logits)
        # The head on one position is another matrix shape than on all: BLAS may sum in another order
        # (bit-equal on some CPUs, not on others), so equal up to fp32 rounding, as the native test holds it.
        torch.testing.assert_close(hf(ids, logits_to_keep=1).logits, out.logits[:, -1:], rtol=1e-5, atol=1e-6)
        assert isinstance(hf(ids, return_dict=False), tuple)


def test_the_loss_keywords_of_transformers_causal_lms_are_honoured():
    """forward's keywords reach the loss as they reach a transformers causal LM's: ignore_index, shift_labels (what
    transformers' Trainer passes under context parallelism, the labels already shifted) and num_items_in_batch
    (gradient accumulation: a sum over the batch's tokens divided by the accumulated count)."""
    lm, hf = pair()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = lm(ids).logits.flatten(0, 1)
        labels = ids.clone()
        labels[:, :3] = 0  # a caller whose "ignored" id is 0
        shifted = torch.cat((labels[:, 1:], torch.zeros(2, 1, dtype=labels.dtype)), dim=1)
        want = torch.nn.functional.cross_entropy(logits, shifted.flatten(), ignore_index=0)
        assert rel(hf(ids, labels=labels, ignore_index=0).loss, want) <= 1e-6
        shift = torch.roll(ids, -1, 1)
        shift[:, -1] = -100
        shift[0, :5] = -100
        want = torch.nn.functional.cross_entropy(logits, shift.flatten())
        assert rel(hf(ids, labels=ids, shift_labels=shift).loss, want) <= 1e-6
        total = torch.nn.functional.cross_entropy(logits, shift.flatten(), reduction="sum")
        got = hf(ids, labels=ids, shift_labels=shift, num_items_in_batch=torch.tensor(40)).loss
        assert rel(got, total / 40) <= 1e-6


@pytest.mark.parametrize("attention", ["diff", "transformer", "diff_v2"])
def test_logits_to_keep_cuts_the_last_block_to_the_kept_rows(attention):
    """logits_to_keep = n: the last block computes the last n rows only (generate's prefill asks for 1), and the
    logits equal the full forward's last n, with left padding and through the cache's next step; asked for
    every hidden state, the block computes every row. float64, so any row mixed up shows."""
    lm, hf = pair(attention)
    hf.double()
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10, 11], [3, 4, 5]])
    rows = []
    handle = hf.layers[-1].mlp.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    with torch.no_grad():
        full = hf(ids, attention_mask=mask).logits
        for n in (1, 3, 7, 9):
            kept = hf(ids, attention_mask=mask, logits_to_keep=n).logits
            torch.testing.assert_close(kept, full[:, -n:], rtol=1e-10, atol=1e-12)
        assert rows == [7, 1, 3, 7, 7]
        hidden = hf(ids, attention_mask=mask, logits_to_keep=1, output_hidden_states=True)
        assert rows[-1] == 7 and hidden.hidden_states[-1].shape[1] == 7
        torch.testing.assert_close(hidden.logits, full[:, -1:], rtol=1e-10, atol=1e-12)
        cache = DynamicCache()
        hf(ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
        step = torch.tensor([[12], [6]])
        both = torch.cat([ids, step], 1)
        mask2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        after = hf(step, attention_mask=mask2, past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(after, hf(both, attention_mask=mask2).logits[:, -1:], rtol=1e-10, atol=1e-12)
    handle.remove()


def test_attention_maps_and_hidden_states():
    lm, hf = pair("diff", gqa=True, attn_backend="sdpa")  # sdpa has no maps: the call must switch to eager
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = hf(ids, output_attentions=True, output_hidden_states=True)
        lm_eager, _ = pair("diff", gqa=True, attn_backend="eager")
        ref = lm_eager(ids, return_attention=True)
    assert [layer.self_attn.backend for layer in hf.layers] == ["sdpa", "sdpa"]  # restored after the call
    assert len(out.attentions) == 2
    for got, want, lam in zip(out.attentions, ref.attentions, hf.native().lambdas()):
        assert got.shape == (2, 2, 7, 7)  # (B, DIFF heads, T, S)
        assert torch.allclose(got, want.diff, atol=1e-6)
        assert torch.allclose(got.sum(-1), torch.full((2, 2, 7), 1 - lam.value), atol=1e-5)  # A1 - λ A2, not a softmax
    assert len(out.hidden_states) == 3
    assert torch.equal(out.hidden_states[0], hf.embed_tokens(ids))
    assert torch.allclose(hf.lm_head(out.hidden_states[-1]), out.logits)


def test_attention_maps_while_decoding_with_padding():
    _, hf = pair("transformer")
    ids, mask = left_pad([[4, 5, 6, 7], [8, 9]])
    cache = DynamicCache()
    with torch.no_grad():
        hf(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        mask = torch.cat((mask, torch.ones(2, 1, dtype=mask.dtype)), dim=1)
        step = hf(ids[:, -1:], attention_mask=mask, past_key_values=cache, use_cache=True, output_attentions=True)
    maps = step.attentions[0]
    assert maps.shape == (2, 4, 1, 5)
    assert torch.allclose(maps.sum(-1), torch.ones(2, 4, 1))  # ordinary attention: a softmax map
    assert torch.equal(maps[1, :, :, :2], torch.zeros(4, 1, 2))  # padding gets no attention


# ------------------------------------------------------------------------------ generation


@pytest.mark.parametrize("attention", ["diff", "diff_v2"])
def test_greedy_generate_equals_native_generate(attention, path):
    lm, hf = pair(attention, gqa=True)
    alone = []
    for prompt in PROMPTS:
        ids = ids_of(prompt)
        ours = lm.generate(ids, 8, temperature=0)
        theirs = hf.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(theirs, ours), prompt
        alone.append(ours[0, len(prompt):])
    ids, mask = left_pad(PROMPTS)
    batched = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(batched[:, ids.shape[1]:], torch.stack(alone))  # each row as if alone
    assert torch.equal(batched, lm.generate(ids, 8, temperature=0, attention_mask=mask))


# The wrapper's generate() against ours: both paths (`path`: the fast paths of tested transformers releases and
# transformers' public ones), DIFF and Transformer, MHA and GQA, tied and untied heads, several seeds of tiny
# models, prompts of 1 token and up to the position limit (64), left-padded batches, with and without the cache.
KINDS = [("diff", False, True), ("diff", True, False), ("transformer", False, False), ("transformer", True, True)]
KIND_IDS = ["diff-mha-tied", "diff-gqa-untied", "transformer-mha-untied", "transformer-gqa-tied"]


def step_logits(lm: DiffTransformerLM, seq: torch.Tensor, prompt: int, mask: torch.Tensor | None = None):
    """(B, n, V) logits the native model gives each generated position from the whole sequence, uncached."""
    with torch.no_grad():
        if mask is None:
            return lm(seq).logits[:, prompt - 1:-1]
        full = torch.cat((mask, mask.new_ones(mask.shape[0], seq.shape[1] - mask.shape[1])), dim=1)
        positions = (full.cumsum(-1) - 1).clamp(min=0)
        return lm(seq, attention_mask=full.bool(), position_ids=positions).logits[:, prompt - 1:-1]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("attention", "gqa", "tied"), KINDS, ids=KIND_IDS)
def test_generate_equals_ours_in_tokens_and_logits(attention, gqa, tied, seed, path):
    lm, hf = pair(attention, seed=seed, gqa=gqa, tie_word_embeddings=tied)
    rng = torch.Generator().manual_seed(seed)
    for T in (1, 5, 58):  # 58 + 6 new tokens: every position up to max_position_embeddings (64)
        ids = torch.randint(0, VOCAB, (1, T), generator=rng)
        ours = lm.generate(ids, 6, temperature=0)
        assert torch.equal(hf.generate(ids, max_new_tokens=6, do_sample=False), ours), T
        out = hf.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ours), T
        torch.testing.assert_close(torch.stack(out.logits, 1), step_logits(lm, ours, T), rtol=1e-5, atol=1e-5)
    ids, mask = left_pad([torch.randint(0, VOCAB, (n,), generator=rng).tolist() for n in (3, 7, 1)])
    ours = lm.generate(ids, 6, temperature=0, attention_mask=mask)
    for use_cache in (True, False):
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                          use_cache=use_cache, output_logits=True, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ours), use_cache
        logits = torch.stack(out.logits, 1)
        torch.testing.assert_close(logits, step_logits(lm, ours, 7, mask), rtol=1e-5, atol=1e-5)
    assert torch.equal(hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0), ours)


@pytest.mark.parametrize(("attention", "gqa", "tied"), KINDS, ids=KIND_IDS)
def test_sampling_from_a_seed_equals_ours(attention, gqa, tied, path):
    """transformers samples softmax(logits / temperature) with torch's global generator, as our generate does
    without a generator: from the same seed, the same tokens (top_k=0: transformers' default would keep 50)."""
    lm, hf = pair(attention, gqa=gqa, tie_word_embeddings=tied)
    ids, mask = left_pad(PROMPTS)
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        ours = lm.generate(ids, 8, temperature=0.9, attention_mask=mask)
        torch.manual_seed(seed)
        theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, temperature=0.9, top_k=0,
                             pad_token_id=0)
        assert torch.equal(theirs, ours), seed
    assert not torch.equal(theirs[:, ids.shape[1]:], lm.generate(ids, 8, temperature=0, attention_mask=mask)[:, 6:])


def test_generate_passes_positions_only_when_the_caller_gives_them(monkeypatch, fast):
    """Without position_ids the forward derives positions itself (RoPE from the shared table when there is
    no padding); position_ids given to generate() are used, extended by one per step as transformers does."""
    _, hf = pair("diff")
    seen = []
    forward = type(hf).forward
    monkeypatch.setattr(type(hf), "forward", lambda self, *a, **kw: seen.append(kw.get("position_ids")) or
                        forward(self, *a, **kw))
    ids = ids_of(PROMPTS[1])
    hf.generate(ids, max_new_tokens=4, do_sample=False)
    assert len(seen) == 4 and all(p is None for p in seen)
    seen.clear()
    start = torch.tensor([[0, 2, 4, 6, 8, 10]])  # not a shift of 0..5: RoPE sees other relative positions
    out = hf.generate(ids, position_ids=start, max_new_tokens=4, do_sample=False)
    assert all(p is not None for p in seen)
    seq, pos = ids, start
    with torch.no_grad():  # the same positions by hand, without a cache: each new token at the last + 1
        for _ in range(4):
            nxt = hf(seq, position_ids=pos, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq, pos = torch.cat([seq, nxt], 1), torch.cat([pos, pos[:, -1:] + 1], 1)
    assert torch.equal(out, seq)
    assert not torch.equal(out, hf.generate(ids, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("case", ["decode", "no_cache", "positions", "embeds_first", "embeds_later", "extras"])
def test_step_inputs_equal_transformers_generic_method(case, fast):
    """The wrapper's lean prepare_inputs_for_generation gives the model what transformers' generic method gives
    it (that method is the reference: same keys, same tensors), for every input a decoder-only model gets."""
    from transformers import GenerationMixin

    _, hf = pair("diff")
    torch.manual_seed(1)
    ids, cache = torch.randint(0, VOCAB, (2, 7)), DynamicCache()
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :2] = 0
    kwargs = {"input_ids": ids, "next_sequence_length": 1, CACHE_KEY: cache, "attention_mask": mask, "use_cache": True}
    if case == "no_cache":
        kwargs.update({"next_sequence_length": None, CACHE_KEY: None, "use_cache": False})
    elif case == "positions":
        kwargs["position_ids"] = torch.arange(7).expand(2, 7) * 2
    elif case.startswith("embeds"):
        kwargs.update(inputs_embeds=torch.randn(2, 7, 32), next_sequence_length=None if case == "embeds_first" else 1,
                      is_first_iteration=case == "embeds_first")
    elif case == "extras":
        kwargs.update(labels=ids, logits_to_keep=1, output_attentions=True, some_future_kwarg="kept")
    ours = hf.prepare_inputs_for_generation(**{k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()})
    theirs = GenerationMixin.prepare_inputs_for_generation(hf, **kwargs)
    assert ours.keys() == theirs.keys()
    for key, want in theirs.items():
        got = ours[key]
        assert (torch.equal(got, want) if torch.is_tensor(want) else got is want or got == want), key


def test_outputs_are_transformers_causal_lm_outputs(fast):
    """forward's output class only builds faster: an instance of CausalLMOutputWithPast with the same keys,
    tuple, indexing, pickling and pytree flattening as one built by transformers from the same fields."""
    import torch.utils._pytree as pytree
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from difftransformer.hf.modeling import DiffTransformerCausalLMOutput

    _, hf = pair("diff")
    ids = ids_of(PROMPTS[1])
    for kwargs in (dict(use_cache=True), dict(labels=ids, use_cache=False), dict(output_hidden_states=True)):
        with torch.no_grad():
            out = hf(ids, **kwargs)
        ref = CausalLMOutputWithPast(**{k: getattr(out, k) for k in ("loss", "logits", CACHE_KEY,
                                                                     "hidden_states", "attentions")})
        assert type(out) is DiffTransformerCausalLMOutput  # the fast class (compat.FAST), held to transformers' own
        assert isinstance(out, CausalLMOutputWithPast) and list(out.keys()) == list(ref.keys())
        assert all(a is b for a, b in zip(out.to_tuple(), ref.to_tuple())) and out[0] is ref[0]
        assert out["logits"] is out.logits and hf(ids, return_dict=False, **kwargs)[0].shape == out[0].shape
        assert pytree.tree_flatten(out)[1].context == pytree.tree_flatten(ref)[1].context
        assert list(pickle.loads(pickle.dumps(out)).keys()) == list(out.keys())
    out.attentions = torch.zeros(1)  # a field set afterwards becomes a key, as in ModelOutput
    assert "attentions" in out.keys() and out["attentions"] is out.attentions
    # ModelOutput's other forms (accelerate's send_to_device / convert_to_fp32 and DataParallel's gather rebuild
    # outputs from a dict or from (key, value) pairs)
    cls, t = type(out), torch.randn(3)
    for made, ref in ((cls({"loss": t, "logits": t}), CausalLMOutputWithPast({"loss": t, "logits": t})),
                      (cls(iter([("logits", t), ("attentions", (t,))])),
                       CausalLMOutputWithPast(iter([("logits", t), ("attentions", (t,))])))):
        assert list(made.keys()) == list(ref.keys()) and made.logits is t and made[0] is ref[0]
        assert (made.loss is None) == (ref.loss is None) and (made.attentions is None) == (ref.attentions is None)


def test_generate_from_inputs_embeds_equals_generate_from_ids():
    _, hf = pair("diff")
    ids = ids_of(PROMPTS[1])
    from_ids = hf.generate(ids, max_new_tokens=5, do_sample=False)
    with torch.no_grad():
        from_embeds = hf.generate(inputs_embeds=hf.embed_tokens(ids), max_new_tokens=5, do_sample=False)
    assert torch.equal(from_embeds, from_ids[:, ids.shape[1]:])  # transformers returns only the new tokens


def test_generate_derives_lambda_once_per_layer(monkeypatch):
    """transformers' cache holds each layer's (λ, norm weight) across the steps of one generate, as
    our KVCache does; a new generate after the parameters change uses the new ones."""
    from difftransformer.attention.layers import MultiheadDiffAttention

    lm, hf = pair("diff")
    calls = []
    compute = MultiheadDiffAttention.attention_constants
    monkeypatch.setattr(MultiheadDiffAttention, "attention_constants",
                        lambda self, *a: calls.append(self.depth) or compute(self, *a))
    ids = ids_of(PROMPTS[1])
    hf.generate(ids, max_new_tokens=5, do_sample=False)
    assert sorted(calls) == list(range(lm.config.num_hidden_layers))
    with torch.no_grad():
        for layer in lm.modules():
            if isinstance(layer, MultiheadDiffAttention):
                layer.lambda_k2.mul_(-3.0)
                layer.subln.weight.add_(1.0)
    assert torch.equal(hf.generate(ids, max_new_tokens=5, do_sample=False), lm.generate(ids, 5, temperature=0))


@pytest.mark.parametrize("attention", ["diff", "transformer"])
def test_sampling_and_beam_search(attention, path):
    lm, hf = pair(attention, gqa=True)
    ids = ids_of(PROMPTS[1])
    greedy = hf.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(hf.generate(ids, max_new_tokens=6, do_sample=True, top_k=1), greedy)
    torch.manual_seed(0)
    sampled = hf.generate(ids, max_new_tokens=6, do_sample=True, temperature=1.5)
    assert sampled.shape == (1, 12) and int(sampled.max()) < VOCAB
    beams = hf.generate(ids, max_new_tokens=6, num_beams=3, num_return_sequences=3, do_sample=False,
                        length_penalty=0.0, output_scores=True, return_dict_in_generate=True)
    assert beams.sequences.shape == (3, 12)
    with torch.no_grad():  # each beam's score is its log-probability under the native model (cache reordered right)
        logp = torch.log_softmax(lm(beams.sequences).logits[:, 5:-1].float(), -1)
        native = logp.gather(-1, beams.sequences[:, 6:, None]).sum((1, 2))
    assert torch.allclose(beams.sequences_scores, native, atol=1e-4)


# ------------------------------------------------------------------------------ training


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    torch.manual_seed(0)
    hf = DiffTransformerForCausalLM.from_native(DiffTransformerLM(small("diff", gqa=True))).train()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))

    def loss_and_grads():
        hf.zero_grad()
        loss = hf(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in hf.named_parameters()}

    loss, grads = loss_and_grads()
    calls = []
    hooks = [block.register_forward_pre_hook(lambda *a: calls.append(1)) for block in hf.layers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames it activation_checkpointing_enable
        hf.gradient_checkpointing_enable()
    assert hf.gradient_checkpointing
    loss_gc, grads_gc = loss_and_grads()
    assert len(calls) == 2 * len(hf.layers)  # each block started again in the backward: checkpointing is on
    for h in hooks:
        h.remove()
    assert torch.allclose(loss_gc, loss, rtol=1e-6)
    for name, g in grads.items():
        assert torch.allclose(grads_gc[name], g, rtol=1e-5, atol=1e-7), name


def test_peft_lora_trains_only_the_adapters():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    hf = DiffTransformerForCausalLM.from_native(DiffTransformerLM(small("diff"))).train()
    model = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"], r=4,
                                                    lora_alpha=8))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and ("q_proj" in n or "v_proj" in n) for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable
    assert model.generate(input_ids=ids[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)


# ------------------------------------------------------------------------------ folders


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_folders_load_both_ways(tmp_path, tied):
    lm, _ = pair("diff", gqa=True, tie_word_embeddings=tied)
    ids = ids_of(PROMPTS[1])
    hf, again = loads_both_ways(lm, tmp_path, ids)
    assert type(AutoConfig.from_pretrained(tmp_path / "ours")) is DiffTransformerHFConfig
    assert (hf.lm_head.weight is hf.embed_tokens.weight) == tied
    assert (again.lm_head.weight is again.embed_tokens.weight) == tied
    with torch.no_grad():
        want = lm(ids).logits
        # The weights transformers wrote are ours, key for key: our loader reads them strictly.
        native = DiffTransformerLM(DiffTransformerHFConfig.from_pretrained(tmp_path / "theirs").to_native()).eval()
        load_weights(native, tmp_path / "theirs" / "model.safetensors")
        assert torch.equal(native(ids).logits, want)
        assert torch.equal(hf.native()(ids).logits, want)


def save_tokenizer_with_eos_at(folder: Path, eos: int) -> None:
    """A word-level tokenizer.json of VOCAB tokens whose EOS token has id `eos`, into `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from difftransformer.data.tokenizer import EOS_TOKEN

    words = [f"w{i}" for i in range(VOCAB - 1)]
    vocab = {w: i + (i >= eos) for i, w in enumerate(words)} | {EOS_TOKEN: eos}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


def test_a_final_folder_gives_generate_its_tokenizers_eos(tmp_path):
    """A run's final/ holds config.json (no EOS: our config has none), the weights and the tokenizer: loaded through
    transformers, generate() stops at that tokenizer's EOS rather than running to max_new_tokens."""
    lm, _ = pair("diff")
    ids = ids_of(PROMPTS[0])
    new = lm.generate(ids, 8, temperature=0)[0, 3:].tolist()
    eos = next(t for i, t in enumerate(new) if i >= 2 and t not in new[:i])  # emitted at step >= 2, not before
    lm.save_pretrained(tmp_path)
    save_tokenizer_with_eos_at(tmp_path, eos)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.eos_token_id == hf.generation_config.eos_token_id == eos
    assert hf.generation_config.pad_token_id == hf.generation_config.bos_token_id == eos
    out = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, 3:].tolist()
    assert out == new[:new.index(eos) + 1]  # our tokens up to and including EOS, then stopped
    (tmp_path / "tokenizer.json").write_text("{}")  # not a tokenizer of ours: the model loads without an EOS
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.eos_token_id is None
    save_tokenizer_with_eos_at(tmp_path, eos)
    # an EOS of the caller's (here a generation_config.json) is kept
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert AutoModelForCausalLM.from_pretrained(tmp_path).generation_config.eos_token_id == 1


def test_a_run_folder_loads_its_final_model(tmp_path):
    """Every CLI command takes a run folder; so does from_pretrained (its final/ folder)."""
    from difftransformer.train.run_dir import FINAL_DIR, REPLACED_DIR, RunDir

    lm, _ = pair("diff")
    lm.save_pretrained(tmp_path / "run" / FINAL_DIR)
    lm.save_pretrained(tmp_path / "run" / REPLACED_DIR / FINAL_DIR)  # deeper folders do not count
    (tmp_path / "run" / "checkpoints").mkdir()
    assert RunDir(tmp_path / "run").final == tmp_path / "run" / FINAL_DIR
    save_tokenizer_with_eos_at(tmp_path / "run" / FINAL_DIR, 7)
    ids = ids_of(PROMPTS[1])
    for hf in (DiffTransformerForCausalLM.from_pretrained(tmp_path / "run"),
               AutoModelForCausalLM.from_pretrained(tmp_path / "run", subfolder=FINAL_DIR)):  # the auto classes' way
        assert hf.generation_config.eos_token_id == 7  # final/'s tokenizer
        with torch.no_grad():
            assert torch.equal(hf.eval()(ids).logits, lm(ids).logits)


def test_a_fresh_process_loads_our_folder_after_importing_difftransformer_hf(tmp_path):
    lm, _ = pair("diff")
    lm.save_pretrained(tmp_path)
    ids = ids_of(PROMPTS[0])
    code = ("import json, sys, torch\n"
            "from transformers import AutoModelForCausalLM\n"
            "try:\n"
            "    AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
            "except ValueError as e:\n"
            "    print(str(e).splitlines()[0])\n"
            "import difftransformer.hf\n"
            "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], use_safetensors=True)\n"
            "ids = torch.tensor(json.loads(sys.argv[2]))\n"
            "print(type(m).__name__, json.dumps(m.generate(ids, max_new_tokens=6, do_sample=False).tolist()))\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path), json.dumps(ids.tolist())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # without the import, transformers' message, which docs/interop.md quotes with the fix
    unknown = done.stdout.strip().splitlines()[0]
    assert "model type `difftransformer` but Transformers does not recognize this architecture" in unknown
    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "interop.md").read_text().split())
    assert "Forgetting `import difftransformer.hf`" in doc and "does not recognize this architecture" in doc
    name, tokens = done.stdout.strip().splitlines()[-1].split(" ", 1)
    assert name == "DiffTransformerForCausalLM"
    assert json.loads(tokens) == lm.generate(ids, 6, temperature=0).tolist()


class _Marker:
    """Unpickling this creates a file: proof that a loader ran pickle."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def test_files_that_are_not_safetensors_are_refused_unread(tmp_path):
    lm, _ = pair("diff")
    lm.save_pretrained(tmp_path)
    weights, marker = tmp_path / "model.safetensors", tmp_path / "unpickled"
    weights.write_text("not a checkpoint\n")
    with pytest.raises(ValueError, match=r"^model.safetensors of '.*' is not a readable safetensors file") as e:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "\n" not in str(e.value)
    weights.write_bytes(pickle.dumps({"embed_tokens.weight": _Marker(marker)}))
    with pytest.raises(ValueError, match="not a readable safetensors file.*a pickle is never loaded"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    weights.rename(tmp_path / "pytorch_model.bin")  # only a pickle checkpoint left
    with pytest.raises(OSError, match="model.safetensors"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="use_safetensors=False asks to unpickle"):
        AutoModelForCausalLM.from_pretrained(tmp_path, use_safetensors=False)
    assert not marker.exists()


@pytest.mark.parametrize("other", [dict(attention="transformer"), dict(hidden_size=64)], ids=["kind", "width"])
def test_weights_of_another_model_are_refused(tmp_path, other):
    """transformers alone would initialise the missing weights at random (or stop on a multi-line error)."""
    pair("diff")[0].save_pretrained(tmp_path / "diff")
    pair(**other)[0].save_pretrained(tmp_path / "other")
    (tmp_path / "other" / "model.safetensors").replace(tmp_path / "diff" / "model.safetensors")
    with pytest.raises(ValueError, match=r"^the weights of '.*' do not match the model its config describes \(") as e:
        AutoModelForCausalLM.from_pretrained(tmp_path / "diff")
    assert "\n" not in str(e.value)


def test_inputs_the_wrapper_cannot_serve_are_refused():
    _, hf = pair("diff")
    ids = ids_of(PROMPTS[1])
    with pytest.raises(ValueError, match=r"attention_mask must be the 2-D \(batch, cached \+ new tokens\)"):
        hf(ids, attention_mask=torch.ones(1, 1, 6, 6))
    with pytest.raises(TypeError, match=r"the cache \(past_key_values\) must be a transformers Cache"):
        hf(ids, past_key_values=((torch.zeros(1), torch.zeros(1)),))
    with pytest.raises(ValueError, match="both cache and past_key_values were given, two different caches"):
        hf(ids, cache=DynamicCache(), past_key_values=DynamicCache())
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        hf()
    with pytest.raises(ValueError, match=f"token id {VOCAB} is outside the vocabulary"):
        hf(ids_of([1, VOCAB]))
    with pytest.raises(ValueError, match="exceeds max_position_embeddings 64"):
        hf(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="values .B, h_kv, S, 2d., which it cannot hold. Use DynamicCache"):
        hf.generate(ids, max_new_tokens=2, cache_implementation="static")
    with pytest.raises(ValueError, match="the wrapper takes growing caches only. Use DynamicCache"):
        pair("transformer")[1].generate(ids, max_new_tokens=2, cache_implementation="static")


def _import_hf_after(setup: str) -> str:
    """What `import difftransformer.hf` prints as its ImportError in a fresh process after `setup` ran ('' if none)."""
    code = setup + "try:\n    import difftransformer.hf\nexcept ImportError as e:\n    print(e)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_core_package_imports_without_transformers():
    printed = _import_hf_after(
        "import importlib, pkgutil, sys\n"
        "sys.modules['transformers'] = None  # import transformers now fails\n"
        "import difftransformer\n"
        "for m in pkgutil.walk_packages(difftransformer.__path__, 'difftransformer.'):\n"
        "    if not m.name.startswith(('difftransformer.hf', 'difftransformer.__main__')):\n"
        "        importlib.import_module(m.name)\n")
    assert "pip install 'difftransformer[hf]'" in printed


def test_transformers_4_is_refused_on_import_with_the_fix():
    printed = _import_hf_after("import transformers\ntransformers.__version__ = '4.57.3'\n")
    assert printed.startswith("difftransformer.hf needs transformers >= 5, found 4.57.3")
    assert printed.endswith("pip install 'difftransformer[hf]'")


def test_the_in_place_cache_layer_behaves_as_transformers_own():
    """Updates, crop, beam reordering and batch repetition in random order: same keys/values as DynamicLayer."""
    import random

    from transformers.cache_utils import DynamicLayer

    from difftransformer.hf.modeling import _InPlaceLayer

    rng = random.Random(0)
    for trial in range(5):
        torch.manual_seed(trial)
        ours, theirs = _InPlaceLayer(), DynamicLayer()
        B = 2
        for _ in range(30):
            op = rng.choice(["update", "update", "update", "crop", "select", "repeat"])
            if op == "update" or not theirs.is_initialized:
                T = rng.choice([1, 1, 3, 70])
                k, v = torch.randn(B, 2, T, 4), torch.randn(B, 1, T, 8)
                got, want = ours.update(k, v), theirs.update(k, v)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            elif op == "crop" and theirs.get_seq_length() > 2:
                ours.crop(-2)
                theirs.crop(-2)
            elif op == "select":
                idx = torch.tensor([rng.randrange(B) for _ in range(B)])
                ours.batch_select_indices(idx)
                theirs.batch_select_indices(idx)
            elif op == "repeat" and B < 8:
                ours.batch_repeat_interleave(2)
                theirs.batch_repeat_interleave(2)
                B *= 2
            assert ours.get_seq_length() == theirs.get_seq_length()
        k, v = torch.randn(B, 2, 1, 4), torch.randn(B, 1, 1, 8)
        assert torch.equal(ours.update(k, v)[0], theirs.update(k, v)[0])
        assert ours.keys.data_ptr() == ours._kbuf.data_ptr()  # a view of its buffer: written in place


@pytest.mark.parametrize("use", [True, False], ids=["fast", "public"])
def test_generate_caches_in_place_on_the_fast_path_only(use, monkeypatch):
    """With the fast paths a DynamicCache's layers become _InPlaceLayer on the first forward (a release that stops
    replicating `layer_class_to_replicate` would silently lose it: this fails then); without them, transformers'."""
    from transformers.cache_utils import DynamicLayer

    from difftransformer.hf import compat
    from difftransformer.hf.modeling import _InPlaceLayer

    monkeypatch.setattr(compat, "FAST", use)
    _, hf = pair("diff")
    cache = DynamicCache()
    with torch.no_grad():
        hf(ids_of(PROMPTS[1]), cache=cache, use_cache=True)
    assert len(cache.layers) == 2 and all(type(layer) is (_InPlaceLayer if use else DynamicLayer)
                                          for layer in cache.layers)


def test_the_in_place_cache_layer_refuses_another_batch():
    """A write in place would broadcast a batch of 1 into a cache of 2 without a word; transformers' own layer
    fails on its torch.cat. Ours refuses in one line naming both shapes."""
    from difftransformer.hf.modeling import _InPlaceLayer

    layer = _InPlaceLayer()
    layer.update(torch.randn(2, 2, 3, 4), torch.randn(2, 1, 3, 8))
    layer.update(torch.randn(2, 2, 1, 4), torch.randn(2, 1, 1, 8))  # the fast path, untouched views
    with pytest.raises(ValueError, match=r"\(2, 2, 4, 4\).*\(1, 2, 1, 4\).*use a new one per batch"):
        layer.update(torch.randn(1, 2, 1, 4), torch.randn(1, 1, 1, 8))
    with pytest.raises(ValueError, match="batch, heads and dim must match"):
        layer.update(torch.randn(2, 2, 1, 4), torch.randn(2, 1, 1, 6))
    assert layer.get_seq_length() == 4  # nothing written by the refused updates
    empty_first = _InPlaceLayer()  # an empty first update leaves no cached length to compare with
    empty_first.update(torch.randn(2, 2, 0, 4), torch.randn(2, 1, 0, 8))
    k1, v1 = torch.randn(1, 2, 1, 4), torch.randn(1, 1, 1, 8)
    keys, values = empty_first.update(k1, v1)
    assert keys.shape == (1, 2, 1, 4) and torch.equal(keys, k1) and torch.equal(values, v1)  # not broadcast


def test_the_config_takes_position_encoding_and_ssmax_settings_and_checks_them_at_once():
    from difftransformer.hf import DiffTransformerForCausalLM, DiffTransformerHFConfig

    cfg = DiffTransformerHFConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  attention="transformer_ssmax", position_encoding="none", ssmax_init_length=32)
    assert cfg.to_native().position_encoding == "none" and cfg.to_native().ssmax_init_length == 32
    with pytest.raises(ValueError, match="position_encoding"):
        DiffTransformerHFConfig(position_encoding="alibi")
    model = DiffTransformerForCausalLM(cfg)
    attn = model.layers[0].self_attn
    with torch.no_grad():
        attn.ssmax_scale.fill_(7.0)
    model._init_weights(attn)  # transformers' per-module initialisation gives s = 1 / log(ssmax_init_length)
    assert torch.allclose(attn.ssmax_scale, torch.full_like(attn.ssmax_scale, 1 / math.log(32)))


def _retrofit_trained_by_transformers(tmp_path, steps: int, callbacks: list) -> DiffTransformerForCausalLM:
    """A diff_retrofit wrapper (α stored 0, as `retrofit` writes it; a ramp over 8 steps) after `steps` optimizer
    steps of transformers' Trainer."""
    pytest.importorskip("accelerate")  # transformers' Trainer runs on it
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    lm = DiffTransformerLM(small("diff_retrofit", attention_head_dim=8, head_norm_ramp_steps=8)).train()
    assert all(float(block.self_attn.head_norm_mix) == 0 for block in lm.layers)
    hf = DiffTransformerForCausalLM.from_native(lm).train()
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, VOCAB, (4 * steps, 12))]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=steps,
                             learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    Trainer(model=hf, args=args, train_dataset=data, callbacks=callbacks).train()
    return hf


def test_transformers_trainer_ramps_the_retrofit_head_norm_with_the_callback(tmp_path, monkeypatch):
    """HeadNormRampCallback: after 4 of the ramp's 8 steps, α = 4 / 8 in every layer, as our trainer leaves it;
    without it α stays 0, and the first training forward says so (once)."""
    from types import SimpleNamespace

    from difftransformer.hf import HeadNormRampCallback, modeling

    hf = _retrofit_trained_by_transformers(tmp_path / "ramped", 4, [HeadNormRampCallback()])
    assert [float(block.self_attn.head_norm_mix) for block in hf.layers] == [0.5, 0.5]
    warned = []
    monkeypatch.setattr(modeling.log, "warning", lambda message, *a: warned.append(message))
    hf = _retrofit_trained_by_transformers(tmp_path / "not", 4, [])
    assert [float(block.self_attn.head_norm_mix) for block in hf.layers] == [0.0, 0.0]
    assert len(warned) == 1 and "HeadNormRampCallback" in warned[0]
    with pytest.raises(TypeError, match="trains a Linear holding none"):
        HeadNormRampCallback().on_step_begin(None, SimpleNamespace(global_step=0), None, model=torch.nn.Linear(2, 2))

"""The LM's forward: loss, input errors, learning, and cached decoding equal to full recomputation."""

import pytest
import torch

from difftransformer import ATTENTION_KINDS, DiffTransformerLM, KVCache
from difftransformer.eval.probes.hooks import rescale_queries
from difftransformer.eval.probes.ood import adaptive_temperature_queries
from tests.helpers import CPP_KERNEL_DISABLED, tiny


def test_forward_loss_and_errors():
    torch.manual_seed(0)
    model = DiffTransformerLM(tiny())
    ids = torch.randint(0, 512, (2, 16))
    out = model(ids, ids)
    assert out.logits.shape == (2, 16, 512)
    assert abs(out.loss.item() - torch.log(torch.tensor(512.0)).item()) < 0.5  # near-uniform at init
    with pytest.raises(ValueError, match="token id 512 is outside the vocabulary"):
        model(torch.tensor([[1, 512]]))
    with pytest.raises(ValueError, match="token id -1 is outside"):
        model(torch.tensor([[-1, 5]]))
    with pytest.raises(ValueError, match="exceeds max_position_embeddings 256"):
        model(torch.zeros(1, 257, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq_len\)"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="integer tensor"):
        model(torch.zeros(1, 5))
    with pytest.raises(ValueError, match="targets must match"):
        model(ids, ids[:, :3])


@pytest.mark.parametrize("kind", sorted(ATTENTION_KINDS))
def test_training_reduces_loss(kind):
    """A few AdamW steps on one batch must fit it: gradients flow through every kind."""
    torch.manual_seed(0)
    model = DiffTransformerLM(tiny(kind))
    ids = torch.randint(0, 512, (4, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(15):
        loss = model(ids[:, :-1], ids[:, 1:]).loss
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first - 1.0
    if kind.startswith("diff") and kind != "diff_v2":
        assert model.layers[0].self_attn.lambda_q1.grad is not None


@pytest.mark.parametrize("kind", sorted(ATTENTION_KINDS))
@pytest.mark.parametrize("backend", ["eager", "sdpa"] + ([] if CPP_KERNEL_DISABLED else ["cpp"]))
def test_cached_decoding_equals_full_recompute(kind, backend):
    torch.manual_seed(1)
    model = DiffTransformerLM(tiny(kind, num_key_value_heads=1, attn_backend=backend)).eval()
    ids = torch.randint(0, 512, (2, 21))
    full = model(ids).logits
    cache = KVCache()
    chunks = [ids[:, :7], ids[:, 7:8], ids[:, 8:15], ids[:, 15:16], ids[:, 16:]]  # prefill, steps, chunks
    got = torch.cat([model(c, kv_cache=cache).logits for c in chunks], dim=1)
    assert len(cache) == 21
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


def test_cache_length_limit():
    model = DiffTransformerLM(tiny()).eval()
    cache = KVCache()
    model(torch.zeros(1, 250, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="sequence length 257 exceeds max_position_embeddings 256"):
        model(torch.zeros(1, 7, dtype=torch.long), kv_cache=cache)


@pytest.mark.parametrize("position_encoding", ["rope", "none"])
@pytest.mark.parametrize("kind", sorted(ATTENTION_KINDS))
def test_logits_to_keep_gives_the_last_positions_logits(kind, position_encoding):
    """The last n positions' logits equal the full forward's, though the last block then computes only
    those n rows (queries, attention, MLP): with padding, explicit positions, a query hook and a KV cache
    (whose next step must see every prefilled key). float64, so any row mixed up shows."""
    model = DiffTransformerLM(tiny(attention=kind, position_encoding=position_encoding),
                              dtype=torch.float64).eval()
    B, T = 3, 13
    ids = torch.randint(0, model.config.vocab_size, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask, "position_ids": positions}):
            full = model(ids, **kwargs).logits
            for n in (1, 3, T, T + 4):
                kept = model(ids, logits_to_keep=n, **kwargs).logits
                assert kept.shape == (B, min(n, T), model.config.vocab_size)
                torch.testing.assert_close(kept, full[:, -n:], rtol=1e-10, atol=1e-12)
        seen = []
        handle = model.layers[-1].mlp.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
        model(ids, logits_to_keep=3)
        handle.remove()
        assert seen == [3]  # the last block's MLP ran on the kept rows only
        assert torch.equal(model(ids, logits_to_keep=0).logits, model(ids).logits)
        picked = model(ids, logits_to_keep=torch.tensor([0, 5])).logits
        torch.testing.assert_close(picked, model(ids).logits[:, [0, 5]], rtol=1e-10, atol=1e-12)
        with rescale_queries(model, adaptive_temperature_queries):  # each row's β from the keys that row sees
            hooked = model(ids, attention_mask=mask, position_ids=positions).logits
            rows = model(ids, attention_mask=mask, position_ids=positions, logits_to_keep=3).logits
        torch.testing.assert_close(rows, hooked[:, -3:], rtol=1e-10, atol=1e-12)
        cache = KVCache()
        model(ids, logits_to_keep=1, kv_cache=cache)
        step = torch.randint(0, model.config.vocab_size, (B, 1))
        after = model(step, kv_cache=cache).logits
        torch.testing.assert_close(after, model(torch.cat([ids, step], 1)).logits[:, -1:], rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="targets need every position's"):
        model(ids, ids, logits_to_keep=1)
    with pytest.raises(ValueError, match="logits_to_keep must be >= 0"):
        model(ids, logits_to_keep=-1)


# ---------------------------------------------------------------- no position encoding (NoPE)


def _nope(kind: str, **overrides) -> DiffTransformerLM:
    torch.manual_seed(6)
    return DiffTransformerLM(tiny(kind, position_encoding="none", initializer_range=0.1, **overrides)).eval()


@pytest.mark.parametrize("kind", sorted(ATTENTION_KINDS))
def test_a_nope_model_has_no_rotation_and_its_cache_and_generation_are_exact(kind):
    model = _nope(kind, num_key_value_heads=1)
    assert all(block.self_attn.rotary is None for block in model.layers)
    assert all(block.self_attn.rotary is not None for block in DiffTransformerLM(tiny(kind)).layers)
    ids = torch.randint(0, 512, (2, 15))
    with torch.no_grad():
        full = model(ids).logits
        cache = KVCache()
        got = torch.cat([model(c, kv_cache=cache).logits for c in (ids[:, :6], ids[:, 6:7], ids[:, 7:])], dim=1)
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
        shifted = model(ids, position_ids=torch.arange(100, 115)).logits  # no position reaches the layers
        torch.testing.assert_close(shifted, full, rtol=1e-5, atol=1e-5)
    prompt = ids[:, :4]
    assert torch.equal(model.generate(prompt, 8, temperature=0.0, use_cache=True),
                       model.generate(prompt, 8, temperature=0.0, use_cache=False))


def test_nope_is_saved_in_config_json_and_old_configs_load_as_rope(tmp_path):
    import json

    from difftransformer import DiffTransformerConfig

    model = _nope("diff")
    model.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["position_encoding"] == "none"
    loaded = DiffTransformerLM.from_pretrained(tmp_path).eval()
    assert loaded.config == model.config and loaded.layers[0].self_attn.rotary is None
    ids = torch.randint(0, 512, (1, 9))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    del data["position_encoding"]  # a config.json written before the field existed
    assert DiffTransformerConfig.from_dict(data).position_encoding == "rope"


@pytest.mark.parametrize("to, kind", [("llama", "transformer"), ("diffllama", "diff"), ("unilm", "diff")])
def test_converters_refuse_nope(to, kind):
    from difftransformer.convert import ConversionError, convert

    cfg = tiny(kind, vocab_size=64, hidden_size=32, num_hidden_layers=1, position_encoding="none")
    state = DiffTransformerLM(cfg).state_dict()
    with pytest.raises(ConversionError, match="position_encoding='none'.*always applies RoPE") as e:
        convert(state, cfg.to_dict(), "ours", to)
    assert "\n" not in str(e.value)
    assert convert(state, cfg.to_dict(), "ours", "ours")[1] == cfg
    convert(DiffTransformerLM(tiny(kind, vocab_size=64, hidden_size=32, num_hidden_layers=1)).state_dict(),
            tiny(kind, vocab_size=64, hidden_size=32, num_hidden_layers=1).to_dict(), "ours", to)  # RoPE converts

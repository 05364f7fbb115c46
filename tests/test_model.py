"""The LM: configs and presets, parameter matching, cached decoding, generation, serialisation."""

import json

import pytest
import torch
from conftest import CPP_KERNEL_DISABLED

from difftransformer import ATTENTION_KINDS, DiffTransformerConfig, DiffTransformerLM, KVCache, get_preset
from difftransformer.model import filter_logits, sample_next_token
from difftransformer.model.config import PRESETS


def tiny(attention="diff", **kw):
    return get_preset("tiny").config(attention, **kw)


# ---------------------------------------------------------------- configs and parameter counts
@pytest.mark.parametrize("name,target", [("830M", 830e6), ("1.4B", 1.4e9), ("2.8B", 2.8e9), ("6.8B", 6.8e9),
                                         ("13.1B", 13.1e9)])
def test_paper_preset_parameter_counts_within_one_percent(name, target):
    cfg = get_preset(name).config()
    assert cfg.vocab_size == 100_288
    n = DiffTransformerLM(cfg, device="meta").num_parameters(count_embedding_once=True)
    assert abs(n - target) / target < 0.01, n


def test_paper_3b_configuration():
    cfg = get_preset("3B").config()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim,
            cfg.intermediate_size) == (3072, 28, 12, 128, 8192)
    assert cfg.matched("transformer").num_attention_heads == 24


@pytest.mark.parametrize("name", ["830M", "1.4B", "2.8B", "6.8B", "13.1B"])
def test_paper_head_dims(name):
    want = {"830M": 96, "1.4B": 128, "2.8B": 128, "6.8B": 128, "13.1B": 128}[name]
    diff, base = get_preset(name).config("diff"), get_preset(name).config("transformer")
    assert diff.head_dim == base.head_dim == want
    assert base.num_attention_heads == 2 * diff.num_attention_heads


@pytest.mark.parametrize("preset", ["tiny", "cpu-small", "1.4B"])
@pytest.mark.parametrize("kv", [None, 2])
def test_matched_models_differ_by_6d_per_layer(preset, kv):
    p = get_preset(preset)
    cfg = p.config("diff", num_key_value_heads=kv) if kv else p.config("diff")
    diff = DiffTransformerLM(cfg, device="meta").num_parameters()
    base_cfg = cfg.matched("transformer")
    base = DiffTransformerLM(base_cfg, device="meta").num_parameters()
    assert diff - base == 6 * cfg.head_dim * cfg.num_hidden_layers
    assert base_cfg.matched("diff") == cfg


def test_config_round_trip_and_unknown_keys(tmp_path):
    cfg = tiny(num_key_value_heads=1, lambda_init=0.8)
    cfg.save(tmp_path / "c.json")
    assert DiffTransformerConfig.load(tmp_path / "c.json") == cfg
    data = cfg.to_dict() | {"num_heads": 3}
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['num_heads'\]"):
        DiffTransformerConfig.from_dict(data)


def test_config_errors():
    with pytest.raises(ValueError, match="unknown attention kind"):
        DiffTransformerConfig(attention="softmax2")
    with pytest.raises(ValueError, match="divisible by 2 \\* num_attention_heads"):
        DiffTransformerConfig(hidden_size=100, num_attention_heads=4)
    with pytest.raises(ValueError, match="divisible by num_key_value_heads"):
        DiffTransformerConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="attn_deterministic must be true or false"):
        DiffTransformerConfig(attn_deterministic="no")
    with pytest.raises(KeyError, match="unknown preset 'huge'"):
        get_preset("huge")
    with pytest.raises(ValueError, match="must be even"):
        DiffTransformerConfig(num_attention_heads=3, hidden_size=96, attention="transformer").matched("diff")


def test_every_preset_builds():
    for name, p in PRESETS.items():
        for kind in ATTENTION_KINDS:
            cfg = p.config(kind)
            assert cfg.attention == kind, name


# ---------------------------------------------------------------- forward, errors
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


# ---------------------------------------------------------------- cached decoding
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


# ---------------------------------------------------------------- generation
def test_greedy_generation_matches_stepwise_argmax():
    torch.manual_seed(2)
    model = DiffTransformerLM(tiny()).eval()
    prompt = torch.randint(0, 512, (2, 6))
    out = model.generate(prompt, 12, temperature=0)
    seq = prompt
    for _ in range(12):  # no cache: recompute everything, take the argmax
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    assert torch.equal(model.generate(prompt, 12, temperature=0, use_cache=False), seq)


@pytest.mark.parametrize("kind", ["diff", "transformer", "diff_v2"])
def test_left_padded_batch_generation_equals_one_by_one(kind):
    torch.manual_seed(3)
    model = DiffTransformerLM(tiny(kind)).eval()
    a, b = torch.randint(1, 512, (1, 9)), torch.randint(1, 512, (1, 4))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :5] = 0
    out = model.generate(batch, 8, temperature=0, attention_mask=mask)
    assert torch.equal(out[0, 9:], model.generate(a, 8, temperature=0)[0, 9:])
    assert torch.equal(out[1, 9:], model.generate(b, 8, temperature=0)[0, 4:])


def test_sampling_is_seeded_and_eos_stops():
    torch.manual_seed(4)
    model = DiffTransformerLM(tiny()).eval()
    prompt = torch.randint(0, 512, (3, 5))
    kw = dict(temperature=0.9, top_k=50, top_p=0.9)
    a = model.generate(prompt, 10, generator=torch.Generator().manual_seed(7), **kw)
    b = model.generate(prompt, 10, generator=torch.Generator().manual_seed(7), **kw)
    assert torch.equal(a, b)
    first = model.generate(prompt[:1], 1, temperature=0)[0, -1].item()
    out = model.generate(prompt[:1], 10, temperature=0, eos_token_id=first)
    assert out.shape[1] == 6  # stopped right after emitting eos


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2)[0, 2:]).all()
    assert torch.isfinite(filter_logits(logits, top_k=2)[0, :2]).all()
    kept = torch.isfinite(filter_logits(logits, top_p=0.7))[0].tolist()
    assert kept == [True, True, False, False]  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    assert torch.isfinite(filter_logits(logits, top_p=0.01))[0].tolist() == [True, False, False, False]
    g = torch.Generator().manual_seed(0)
    draws = [sample_next_token(logits, top_k=1, generator=g).item() for _ in range(20)]
    assert set(draws) == {0}
    with pytest.raises(ValueError, match="top_p must be in"):
        filter_logits(logits, top_p=1.5)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        sample_next_token(logits, temperature=-1)


# ---------------------------------------------------------------- serialisation
@pytest.mark.parametrize("tied", [True, False])
def test_save_load_round_trip(tmp_path, tied):
    torch.manual_seed(5)
    model = DiffTransformerLM(tiny(tie_word_embeddings=tied)).eval()
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text())["attention"] == "diff"
    loaded = DiffTransformerLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 512, (1, 10))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert (loaded.lm_head.weight is loaded.embed_tokens.weight) == tied


def test_load_errors(tmp_path):
    model = DiffTransformerLM(tiny())
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    other = tmp_path / "other"
    DiffTransformerLM(tiny("transformer")).save_pretrained(other)
    (other / "model.safetensors").replace(tmp_path / "base.safetensors")
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        DiffTransformerLM.from_pretrained(tmp_path)
    (tmp_path / "base.safetensors").replace(weights)  # weights of another attention kind
    with pytest.raises(ValueError, match="do not match the model described by config.json"):
        DiffTransformerLM.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no model config"):
        DiffTransformerLM.from_pretrained(tmp_path / "nowhere")

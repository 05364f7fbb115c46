"""Hostile pass 9 (issue 13), the Python API: errors that name the value, the rule and the fix, and
attention that refuses inputs it would read wrongly (docs/hostile-pass.md, "# Hostile pass 9")."""

from __future__ import annotations

import pytest
import torch

from difftransformer import DiffTransformerConfig, DiffTransformerLM, KVCache
from difftransformer.attention import differential_attention, multihead_attention
from tests.helpers import BACKENDS


def _config(**kw) -> DiffTransformerConfig:
    return DiffTransformerConfig(**{**dict(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, max_position_embeddings=64), **kw})


@pytest.fixture(scope="module")
def model() -> DiffTransformerLM:
    torch.manual_seed(0)
    return DiffTransformerLM(_config()).eval()


def _diff_inputs(B=2, h=2, T=8, d=4):
    torch.manual_seed(0)
    return torch.randn(B, 2 * h, T, d), torch.randn(B, 2 * h, T, d), torch.randn(B, h, T, 2 * d)


def _mha_inputs(B=2, T=8, d=4):
    torch.manual_seed(0)
    return torch.randn(B, 4, T, d), torch.randn(B, 2, T, d), torch.randn(B, 2, T, d)


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
@pytest.mark.parametrize("which", [1, 2])
def test_p68_diff_attention_refuses_k_or_v_on_another_device(backend, which):
    """P68: k or v on another device than q ('meta' here) gave finite garbage under 'auto' and 'cpp'
    (the C++ kernel read their data pointers as CPU memory); now one error names the devices."""
    q, k, v = _diff_inputs()
    args = [q, k, v]
    args[which] = args[which].to("meta")
    devices = ", ".join(str(t.device) for t in args)
    with pytest.raises(ValueError, match=rf"q, k, v must be on one device; got {devices}.*\.to\(q\.device\)"):
        differential_attention(*args, 0.5, backend=backend)


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_p68m_multihead_attention_refuses_k_on_another_device(backend):
    """P68m: multihead_attention with k on 'meta' and backend 'cpp' returned garbage (off by 3.7)."""
    q, k, v = _mha_inputs()
    with pytest.raises(ValueError, match=r"q, k, v must be on one device; got cpu, meta, cpu"):
        multihead_attention(q, k.to("meta"), v, backend=backend)


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_p68_key_padding_mask_on_another_device(backend):
    """P68 (the mask): a key_padding_mask on 'meta' with q on CPU was read as garbage by the C++ kernel
    (off by 1.9e34 under 'auto'); now the same one-device error, naming the mask."""
    q, k, v = _diff_inputs()
    mask = torch.ones(2, 8, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"q, k, v and key_padding_mask must be on one device; got cpu, cpu, cpu, meta"):
        differential_attention(q, k, v, 0.5, key_padding_mask=mask, backend=backend)
    q, k, v = _mha_inputs()
    with pytest.raises(ValueError, match=r"q, k, v and key_padding_mask must be on one device"):
        multihead_attention(q, k, v, key_padding_mask=mask, backend=backend)


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_p67_attention_refuses_integer_tensors(backend):
    """P67: int64 q, k, v gave torch's "expected m1 and m2 to have the same dtype" from inside the
    backend; now the error names the dtypes and asks for floating point."""
    q, k, v = _diff_inputs()
    with pytest.raises(TypeError, match=r"q, k, v must be floating point; got torch.int64, torch.int64, "
                                        r"torch.int64.*\.float\(\)"):
        differential_attention(q.long(), k.long(), v.long(), 0.5, backend=backend)
    q, k, v = _mha_inputs()
    with pytest.raises(TypeError, match=r"q, k, v must be floating point; got torch.float32, torch.int64"):
        multihead_attention(q, k.long(), v, backend=backend)


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_p82_multihead_attention_batch_mismatch_names_the_shapes(backend):
    """P82: k, v of batch 1 with q of batch 2 gave the kernel's "flash_cpu: expected k (B, C h_kv, S, d)"
    without shapes; now the error names the three shapes."""
    q, k, v = _mha_inputs()
    with pytest.raises(ValueError, match=r"same batch.*\(2, 4, 8, 4\), \(1, 2, 8, 4\), \(1, 2, 8, 4\)"):
        multihead_attention(q, k[:1], v[:1], backend=backend)


def test_p42_generate_with_a_1d_prompt_says_add_a_batch_axis(model):
    """P42: `generate(ids[0], 2)` raised IndexError: tuple index out of range; now forward's message."""
    ids = torch.randint(0, 300, (2, 10))
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq_len\); got shape \(10,\) .*input_ids\[None\]"):
        model.generate(ids[0], 2)


def test_p41_generate_with_a_wrong_shape_attention_mask_names_it(model):
    """P41: an attention_mask of shape (2, 3) for (2, 10) prompts blamed position_ids, which the
    caller never gave; now the error names attention_mask, both shapes and the rule."""
    ids = torch.randint(0, 300, (2, 10))
    with pytest.raises(ValueError, match=r"attention_mask must have input_ids' shape \(2, 10\).*got \(2, 3\)"):
        model.generate(ids, 2, attention_mask=torch.ones(2, 3))


@pytest.mark.parametrize("bad", [2.5, "2", True])
def test_p32_generate_max_new_tokens_must_be_an_int(model, bad):
    """P32: max_new_tokens=2.5 gave "'float' object cannot be interpreted as an integer"; now the
    error names max_new_tokens, its value and type."""
    ids = torch.randint(0, 300, (2, 10))
    with pytest.raises(TypeError, match=rf"max_new_tokens must be an int .*got {bad!r} \({type(bad).__name__}\)"):
        model.generate(ids, bad)


def test_generate_still_takes_numpy_and_tensor_integers(model):
    """The P32 check accepts any integer (numpy, a 0-d integer tensor), as range() did before."""
    import numpy as np

    ids = torch.randint(0, 300, (2, 10))
    assert model.generate(ids, np.int64(2), temperature=0).shape == (2, 12)
    assert model.generate(ids, torch.tensor(2), temperature=0).shape == (2, 12)


def test_k01_kv_cache_used_with_a_model_of_other_head_sizes(model):
    """K01: a KVCache filled by one model, then used by a model with 4 heads, gave torch's "The expanded
    size of the tensor (16) must match the existing size (8)"; now the error names the layer, both shapes
    and the fix."""
    other = DiffTransformerLM(_config(num_attention_heads=4)).eval()
    ids = torch.randint(0, 300, (2, 10))
    with torch.no_grad():
        cache = KVCache()
        model(ids, kv_cache=cache)
        with pytest.raises(ValueError, match=r"this KVCache holds \(2, 4, ·, 16\) keys for layer 0; the new ones "
                                             r"are \(2, 8, ·, 8\).*a new KVCache per model and batch"):
            other(ids[:, :1], kv_cache=cache)


def test_k02_kv_cache_used_with_another_batch_size(model):
    """K02's kin: a cache of batch 2 fed a batch of 1 was broadcast into it, and the error came later
    from attention about k's batch; now the cache says so itself, also when gradients flow."""
    ids = torch.randint(0, 300, (2, 10))
    for grad in (False, True):
        cache = KVCache()
        with torch.set_grad_enabled(grad):
            model(ids, kv_cache=cache)
            with pytest.raises(ValueError, match=r"holds \(2, 4, ·, 16\) keys for layer 0; the new ones are "
                                                 r"\(1, 4, ·, 16\)"):
                model(ids[:1, :1], kv_cache=cache)


def test_l08_from_pretrained_given_the_config_file(tmp_path, model):
    """L08: from_pretrained("dir/config.json") said "no model config at dir/config.json/config.json";
    now it says the path is a file and names the folder to give."""
    model.save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=rf"{tmp_path}/m/config.json is a file; give the folder that holds "
                                         rf"config.json and model.safetensors \(this file's folder is {tmp_path}/m\)"):
        DiffTransformerLM.from_pretrained(tmp_path / "m" / "config.json")


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, "float16"])
def test_l14_from_pretrained_with_a_non_floating_dtype(tmp_path, model, dtype):
    """L14: from_pretrained(d, dtype=torch.int64) gave torch's "Only Tensors of floating point and complex
    dtype can require gradients"; now the model names the dtype and the ones it takes."""
    model.save_pretrained(tmp_path / "m")
    with pytest.raises(TypeError, match=rf"dtype must be a floating-point torch.dtype .*got {dtype!r}"):
        DiffTransformerLM.from_pretrained(tmp_path / "m", dtype=dtype)
    assert DiffTransformerLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16

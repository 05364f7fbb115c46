"""What the model's Python API refuses: `generate`, a KVCache of another model or batch, and `from_pretrained`
given a file or a dtype it cannot load, each in one error naming the value, the rule and the fix."""

from __future__ import annotations

import pytest
import torch

from difftransformer import DiffTransformerConfig, DiffTransformerLM, KVCache


def _config(**kw) -> DiffTransformerConfig:
    return DiffTransformerConfig(**{**dict(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, max_position_embeddings=64), **kw})


@pytest.fixture(scope="module")
def model() -> DiffTransformerLM:
    torch.manual_seed(0)
    return DiffTransformerLM(_config()).eval()


def test_generate_with_a_1d_prompt_says_add_a_batch_axis(model):
    """A 1-d prompt (`generate(ids[0], 2)`) gets forward's error: input_ids must be (batch, seq_len), with the fix
    `input_ids[None]`."""
    ids = torch.randint(0, 300, (2, 10))
    with pytest.raises(ValueError,
                       match=r"input_ids must be \(batch, seq_len\); got shape \(10,\) .*input_ids\[None\]"):
        model.generate(ids[0], 2)


def test_generate_with_a_wrong_shape_attention_mask_names_it(model):
    """An attention_mask of shape (2, 3) for (2, 10) prompts is refused naming attention_mask, both shapes and the
    rule, not position_ids, which the caller never gave."""
    ids = torch.randint(0, 300, (2, 10))
    with pytest.raises(ValueError, match=r"attention_mask must have input_ids' shape \(2, 10\).*got \(2, 3\)"):
        model.generate(ids, 2, attention_mask=torch.ones(2, 3))


@pytest.mark.parametrize("bad", [2.5, "2", True])
def test_generate_max_new_tokens_must_be_an_int(model, bad):
    """A float, a string or a bool as max_new_tokens (2.5, "2", True) is a TypeError naming max_new_tokens, its value
    and its type."""
    ids = torch.randint(0, 300, (2, 10))
    with pytest.raises(TypeError, match=rf"max_new_tokens must be an int .*got {bad!r} \({type(bad).__name__}\)"):
        model.generate(ids, bad)


def test_generate_still_takes_numpy_and_tensor_integers(model):
    """The max_new_tokens check accepts any integer (a numpy integer, a 0-d integer tensor), as range() does."""
    import numpy as np

    ids = torch.randint(0, 300, (2, 10))
    assert model.generate(ids, np.int64(2), temperature=0).shape == (2, 12)
    assert model.generate(ids, torch.tensor(2), temperature=0).shape == (2, 12)


def test_kv_cache_used_with_a_model_of_other_head_sizes_names_both_shapes(model):
    """A KVCache filled by one model and then given to a model with other head sizes (4 heads) is refused by the
    cache itself, naming the layer, both key shapes and the fix: a new KVCache per model and batch."""
    other = DiffTransformerLM(_config(num_attention_heads=4)).eval()
    ids = torch.randint(0, 300, (2, 10))
    with torch.no_grad():
        cache = KVCache()
        model(ids, kv_cache=cache)
        with pytest.raises(ValueError, match=r"this KVCache holds \(2, 4, ·, 16\) keys for layer 0; the new ones "
                                             r"are \(2, 8, ·, 8\).*a new KVCache per model and batch"):
            other(ids[:, :1], kv_cache=cache)


def test_kv_cache_used_with_another_batch_size_names_both_shapes(model):
    """A cache of batch 2 fed a batch of 1 is refused by the cache itself, naming both key shapes, with and without
    gradients: the new keys are never broadcast into it."""
    ids = torch.randint(0, 300, (2, 10))
    for grad in (False, True):
        cache = KVCache()
        with torch.set_grad_enabled(grad):
            model(ids, kv_cache=cache)
            with pytest.raises(ValueError, match=r"holds \(2, 4, ·, 16\) keys for layer 0; the new ones are "
                                                 r"\(1, 4, ·, 16\)"):
                model(ids[:1, :1], kv_cache=cache)


def test_from_pretrained_given_the_config_file_names_its_folder(tmp_path, model):
    """from_pretrained("dir/config.json") says the path is a file and names the folder to give."""
    model.save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=rf"{tmp_path}/m/config.json is a file; give the folder that holds "
                                         rf"config.json and model.safetensors \(this file's folder is {tmp_path}/m\)"):
        DiffTransformerLM.from_pretrained(tmp_path / "m" / "config.json")


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, "float16"])
def test_from_pretrained_refuses_a_non_floating_dtype(tmp_path, model, dtype):
    """A dtype that is not a floating-point torch.dtype (torch.int64, torch.bool, the string "float16") is a
    TypeError naming it and the dtypes the model takes; a floating dtype loads."""
    model.save_pretrained(tmp_path / "m")
    with pytest.raises(TypeError, match=rf"dtype must be a floating-point torch.dtype .*got {dtype!r}"):
        DiffTransformerLM.from_pretrained(tmp_path / "m", dtype=dtype)
    loaded = DiffTransformerLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16)
    assert loaded.lm_head.weight.dtype == torch.bfloat16

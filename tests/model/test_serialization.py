"""save_pretrained / from_pretrained: exact round trips (tied and untied) and one-line errors."""

import json

import pytest
import torch

from difftransformer import DiffTransformerLM
from tests.helpers import tiny


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


@pytest.mark.parametrize("dtype, name", [(torch.bool, "BOOL"), (torch.int64, "I64")])
def test_weights_that_are_not_floating_point_are_refused_not_cast(tmp_path, dtype, name):
    from safetensors.torch import load_file, save_file

    DiffTransformerLM(tiny()).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(str(weights))
    state["layers.0.mlp.up_proj.weight"] = state["layers.0.mlp.up_proj.weight"].to(dtype)
    save_file(state, str(weights))
    with pytest.raises(ValueError, match=rf"tensor 'layers.0.mlp.up_proj.weight' is stored as {name}, not as floating"):
        DiffTransformerLM.from_pretrained(tmp_path)

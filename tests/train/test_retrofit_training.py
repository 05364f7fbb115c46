"""Continued training of a `diff_retrofit` model: the trainer ramps the head norm in (α = step / ramp
steps, saved with the weights) and `trainable = "attention"` moves the attention tensors only."""

from __future__ import annotations

import pytest
import torch

from difftransformer.model import DiffTransformerLM
from difftransformer.train import load_checkpoint, train
from difftransformer.train.config import TrainConfig
from tests.helpers import make_cfg, tiny


def test_the_ramp_and_attention_only_training(data_dir, tmp_path):
    cfg = tiny("diff_retrofit", lambda_init=0.0, head_norm_ramp_steps=4)
    torch.manual_seed(0)
    start = {k: v.clone() for k, v in DiffTransformerLM(cfg).state_dict().items()}
    r = train(cfg, make_cfg(data_dir, tmp_path, trainable="attention"), init_state=start)
    mid = load_checkpoint(tmp_path)  # the latest, step 6
    assert float(mid["model"]["layers.0.self_attn.head_norm_mix"]) == 1.0
    end = r.model.state_dict()
    moved = {k for k in start if not torch.equal(start[k], end[k])}
    assert moved and all(".self_attn." in k for k in moved)
    assert any(k.endswith("q_proj.weight") for k in moved) and any("lambda_q" in k for k in moved)
    assert {k for k in moved if k.endswith("head_norm_mix")} == {f"layers.{i}.self_attn.head_norm_mix" for i in (0, 1)}


def test_the_ramp_value_at_an_intermediate_checkpoint(data_dir, tmp_path):
    cfg = tiny("diff_retrofit", lambda_init=0.0, head_norm_ramp_steps=4)
    train(cfg, make_cfg(data_dir, tmp_path, max_steps=3, ckpt_interval=3, eval_interval=3))
    ck = load_checkpoint(tmp_path)
    assert ck["step"] == 3 and float(ck["model"]["layers.1.self_attn.head_norm_mix"]) == 0.75


def test_trainable_is_validated():
    with pytest.raises(ValueError, match="trainable must be one of"):
        TrainConfig(trainable="mlp")

"""TrainConfig validation, the learning-rate schedule and the weight-decay parameter groups."""

import json
import math

import pytest

from difftransformer.model import DiffTransformerLM
from difftransformer.train import TrainConfig, classify_parameters, lr_at, train
from tests.helpers import make_cfg, tiny


def test_train_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match=r"unknown TrainConfig key\(s\) \['lr_schedul'\].*valid keys.*lr_schedule"):
        TrainConfig.from_dict({"lr_schedul": "cosine"})
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        TrainConfig(lr_schedule="exp")
    with pytest.raises(ValueError, match="precision must be one of"):
        TrainConfig(precision="fp8")
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match=r"batch_size \(10\) must be divisible by grad_accum_steps \(4\)"):
        TrainConfig(batch_size=10, grad_accum_steps=4)
    with pytest.raises(TypeError, match="lr must be a float, got '1e-3'"):
        TrainConfig.from_dict({"lr": "1e-3"})
    with pytest.raises(TypeError, match="max_steps must be an int"):
        TrainConfig(max_steps=True)
    with pytest.raises(ValueError, match="device must be"):
        TrainConfig(device="gpu")
    with pytest.raises(ValueError, match=r"dist_timeout_min must be in \(0, 10080\] minutes, got 0"):
        TrainConfig(dist_timeout_min=0)
    cfg = TrainConfig(lr=1, seed=3)
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_seq_len_above_max_positions_names_both(data_dir, tmp_path):
    cfg = make_cfg(data_dir, tmp_path, seq_len=300)
    with pytest.raises(ValueError, match=r"train.seq_len 300 exceeds the model's max_position_embeddings 256; lower"):
        train(tiny(), cfg)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_lr_schedule_values(schedule):
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110, lr_schedule=schedule)
    assert lr_at(0, cfg) == pytest.approx(0.1)  # warmup: a line from 0
    assert lr_at(4, cfg) == pytest.approx(0.5)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)  # decay starts at the peak
    mid, end = lr_at(60, cfg), lr_at(110, cfg)
    if schedule == "cosine":
        assert mid == pytest.approx(0.55) and end == pytest.approx(0.1)
        assert lr_at(35, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    elif schedule == "linear":
        assert mid == pytest.approx(0.55) and end == pytest.approx(0.1)
        assert lr_at(35, cfg) == pytest.approx(1.0 - 0.9 * 0.25)
    else:
        assert mid == end == 1.0
    lrs = [lr_at(s, cfg) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # non-increasing after warmup


def test_weight_decay_groups():
    model = DiffTransformerLM(tiny())
    decay, no_decay = classify_parameters(model, TrainConfig())
    assert "embed_tokens.weight" in no_decay  # tied with lm_head: listed once
    assert "lm_head.weight" not in decay + no_decay
    for n in no_decay:
        assert n == "embed_tokens.weight" or n.endswith("layernorm.weight") or ".lambda_" in n \
            or n.endswith("subln.weight") or n == "norm.weight", n
    assert any(".lambda_q1" in n for n in no_decay) and any("subln" in n for n in no_decay)
    assert all(n.endswith("proj.weight") for n in decay) and len(decay) == 2 * 7
    decay2, no_decay2 = classify_parameters(model, TrainConfig(decay_norms_and_lambdas=True, decay_embeddings=True))
    assert no_decay2 == [] and len(decay2) == len(decay) + len(no_decay)

"""TrainConfig validation, the learning-rate schedule and the weight-decay parameter groups."""

import json
import logging
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


def test_a_weight_guard_factor_of_one_or_less_is_refused():
    """Healthy weights' norm grows; a factor in (0, 1] would stop every run as diverged at its first checkpoint."""
    for growth in (0.5, 1.0):
        with pytest.raises(ValueError, match=r"max_weight_growth must be 0 \(no check\) or a factor > 1"):
            TrainConfig(max_weight_growth=growth)
    assert TrainConfig(max_weight_growth=0.0).max_weight_growth == 0.0 and TrainConfig(max_weight_growth=1.5)


def test_a_warm_up_longer_than_the_run_is_named(data_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="difftransformer.train"):
        train(tiny(), make_cfg(data_dir, tmp_path, max_steps=2, warmup_steps=8, lr=1e-3))
    assert "warmup_steps 8 > max_steps 2: the warm-up is longer than the run" in caplog.text
    assert "at most 0.00025" in caplog.text  # lr 1e-3 x 2 / 8


def test_the_last_step_runs_a_little_above_min_lr():
    """The decay reaches min_lr at step max_steps (not run): the last step is above it by at most 1 / span of it."""
    for schedule in ("cosine", "linear"):
        cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=2, max_steps=6, lr_schedule=schedule)
        last = lr_at(cfg.max_steps - 1, cfg)
        assert 0.1 < last <= 0.1 + 0.9 / 4 + 1e-12

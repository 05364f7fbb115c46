"""The task interface: registry, settings, provenance, and the held-out loss task on known answers."""

from __future__ import annotations

import math

import pytest
import torch

from difftransformer.data import PreparedData
from difftransformer.eval import EvalConfig, get_task, run_task
from difftransformer.eval.task import TASKS, weights_hash
from difftransformer.model import DiffTransformerLM
from difftransformer.train import read_metrics, train
from tests.helpers import UniformLM, make_cfg, tiny


def test_heldout_loss_of_a_uniform_model_is_log_vocab(data_dir):
    vocab = PreparedData.load(data_dir).vocab_size
    result = run_task("heldout-loss", UniformLM(vocab), None, EvalConfig(data_dir=data_dir, seq_len=32, max_windows=5))
    assert result.metrics["loss"] == pytest.approx(math.log(vocab))
    assert result.metrics["perplexity"] == pytest.approx(vocab)
    assert result.metrics["bits_per_token"] == pytest.approx(math.log2(vocab))
    assert (
        result.settings["windows"] == 5 and result.settings["tokens"] == 5 * 32 and result.settings["split"] == "test"
    )


def test_heldout_loss_on_val_equals_the_trainers_validation_loss(data_dir, tmp_path):
    cfg = make_cfg(data_dir, tmp_path, max_steps=3, ckpt_interval=3, eval_interval=3)
    res = train(tiny(), cfg)
    logged = [r["loss"] for r in read_metrics(res.metrics_path, "val")][-1]
    windows = cfg.eval_batches * cfg.batch_size
    got = run_task("heldout-loss", res.model, None, EvalConfig(data_dir=data_dir, split="val", seq_len=cfg.seq_len,
                                                               max_windows=windows, batch_size=3))
    assert got.metrics["loss"] == pytest.approx(logged, rel=1e-5)


def test_results_carry_provenance_and_are_json(data_dir):
    torch.manual_seed(0)
    model = DiffTransformerLM(tiny(vocab_size=300))
    result = run_task(get_task("heldout-loss"), model, None, EvalConfig(data_dir=data_dir, seq_len=16, max_windows=2))
    record = result.to_dict()
    assert record["task"] == "heldout-loss" and set(record["provenance"]) == {"weights_sha256", "package_version",
                                                                             "started", "seconds"}
    assert record["provenance"]["weights_sha256"] == weights_hash(model)
    twin = DiffTransformerLM(tiny(vocab_size=300))
    twin.load_state_dict(model.state_dict())
    assert weights_hash(twin) == weights_hash(model)
    with torch.no_grad():
        twin.norm.weight[0] += 1e-3
    assert weights_hash(twin) != weights_hash(model)
    scalar = torch.nn.Module()
    scalar.register_buffer("x", torch.tensor(1.5))  # 0-d tensors hash too
    assert len(weights_hash(scalar)) == 64
    assert model.training  # run_task restores the mode it found


BAD_REQUESTS = {  # what is asked -> the start of the one-line error
    "an unknown task": (lambda d, m: get_task("heldout_los"),
                        "unknown evaluation task 'heldout_los' \\(did you mean 'heldout-loss'\\?\\)"),
    "no data": (lambda d, m: run_task("heldout-loss", m, None, EvalConfig()), "set EvalConfig.data_dir"),
    "too long": (lambda d, m: run_task("heldout-loss", m, None, EvalConfig(data_dir=d, seq_len=32)),
                 "seq_len 32 is beyond the model's context of 16"),
    "the train split": (lambda d, m: EvalConfig(split="train"), "split='train' would evaluate on the text the model"),
    "an unknown split": (lambda d, m: EvalConfig(split="validation"), "split must be 'val' or 'test'"),
    "no batch": (lambda d, m: EvalConfig(batch_size=0), "batch_size must be a positive integer"),
}


@pytest.mark.parametrize("request_name", sorted(BAD_REQUESTS))
def test_bad_requests_are_one_line_errors(data_dir, request_name):
    ask, needle = BAD_REQUESTS[request_name]
    with pytest.raises(ValueError, match=needle):
        ask(data_dir, UniformLM(300, context=16))
    assert "heldout-loss" in TASKS

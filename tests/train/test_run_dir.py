"""The one definition of a run folder: where things are, trained or finished, loading final-or-latest."""

from __future__ import annotations

import json

import pytest

from difftransformer.train import CheckpointError, RunDir, load_model, train
from tests.helpers import assert_same_weights, make_cfg, tiny


def _log(run: RunDir, steps: list[int], max_steps: int) -> None:
    run.path.mkdir(parents=True, exist_ok=True)
    run.train_config.write_text(json.dumps({"max_steps": max_steps, "seed": 4}))
    run.metrics.write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 1.0}) + "\n" for s in steps))


def test_paths_and_the_two_questions(tmp_path):
    run = RunDir(tmp_path / "r")
    assert [p.name for p in (run.metrics, run.model_config, run.train_config, run.checkpoints, run.final,
                             run.tensorboard, run.done, run.samples)] == \
        ["metrics.jsonl", "model_config.json", "train_config.json", "checkpoints", "final", "tb", "done.json",
         "samples.json"]
    assert not run.has_metrics() and run.last_step() == 0 and not run.trained_to(1) and run.max_steps() is None
    _log(run, [5, 10], max_steps=10)
    assert run.has_metrics() and run.seed() == 4 and run.max_steps() == 10 and run.last_step() == 10
    assert run.trained_to() and run.trained_to(10) and not run.trained_to(11)
    assert not run.is_finished()  # trained, but no train() call has completed: no final/, no done.json
    run.final.mkdir()
    (run.final / "config.json").write_text("{}")
    (run.final / "model.safetensors").write_bytes(b"")
    assert not run.is_finished()  # final/ from a call that was killed before done.json: not finished
    run.write_done({"final_step": 10})
    assert run.is_finished() and not run.is_finished(max_steps=20)  # a final/ from a shorter run does not count
    _log(run, [5, 10, 15, 20], max_steps=20)  # re-run to 20, killed after logging step 20 but before final/
    assert run.trained_to() and not run.is_finished()
    run.write_done({"final_step": 20})
    assert run.last_step() == 20 and run.is_finished(max_steps=20)
    (run.metrics).write_text('{"kind": "train", "step": 3')  # torn: read as nothing logged
    assert run.metric_series().train == []


def test_load_model_prefers_final_then_the_newest_checkpoint(data_dir, tmp_path):
    res = train(tiny(), make_cfg(data_dir, tmp_path / "run", max_steps=3, ckpt_interval=3))
    run = RunDir(res.out_dir)
    assert run.read_json(run.done)["final_step"] == 3 and run.is_finished() and run.is_finished(3)
    done_written = run.done.stat().st_mtime_ns
    assert done_written >= run.final_weights.stat().st_mtime_ns  # written after final/
    for where in (run.path, run.final):
        loaded = load_model(where)
        assert loaded.checkpoint_step is None and loaded.tokenizer_path == run.final_tokenizer
        assert_same_weights(loaded.model, res.model)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (run.final / name).unlink()
    for where in (run.path, run.checkpoints):
        loaded = load_model(where)
        assert loaded.checkpoint_step == 3 and "step 3" in loaded.source
        assert loaded.tokenizer_path is not None and loaded.tokenizer_path.is_file()  # the run's prepared data
        assert_same_weights(loaded.model, res.model)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_model(tmp_path / "nothing-here")
    train(tiny(), make_cfg(data_dir, tmp_path / "run", max_steps=4, ckpt_interval=4, lr_schedule="constant"),
          resume=False)  # a new call: done.json is rewritten at its end, for 4 steps
    assert run.done_step() == 4


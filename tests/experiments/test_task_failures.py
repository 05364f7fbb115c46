"""A study's evaluation when a task fails: only a task that does not apply to a model is left out of its result
file; any other failure stops the study naming the task and the unit, and the next run evaluates it again. A
unit evaluated again never loses a result its file holds. probe_batch: free memory short for a batch is no
error, and a window that does not fit says whether it ever can and which setting shortens it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from difftransformer.data import DataConfig, PreparedData
from difftransformer.eval import EvalConfig, Task, TaskResult
from difftransformer.eval.probes import hooks
from difftransformer.eval.task import run_task
from difftransformer.experiments import Study, StudyConfig, StudyDir, StudyMismatchError, run_study
from difftransformer.experiments.evaluate import TaskFailedError
from difftransformer.model import DiffTransformerLM
from difftransformer.train import TrainConfig
from tests.helpers import tiny

RECIPE = TrainConfig(seq_len=12, batch_size=4, max_steps=2, warmup_steps=1, eval_interval=2, eval_batches=1,
                     log_interval=1, ckpt_interval=2, progress=False, tensorboard=False, device="cpu")
OOD = {"lengths": [1, 2], "densities": [], "min_queries": 20, "attention_sequences": 2,
       "adaptive_temperature": False}


def _ood_study(tmp_path: Path, **ood) -> Study:
    """One arm trained 2 steps on maxret, evaluated with ood."""
    data = DataConfig(task={"family": "maxret", "min_items": 2, "max_items": 3, "min_context": 8, "max_context": 10},
                      data_dir=str(tmp_path / "data"))
    compare = StudyConfig(arms=["diff"], seeds=[0], sample_tokens=2, prompts=["k3 v1 max"], eval_tasks=["ood"],
                          eval_options={"ood": {**OOD, **ood}})
    return Study(tiny(vocab_size=120, max_position_embeddings=64), RECIPE, data, compare)


def _text_study(data_dir: str, tasks: list[str]) -> Study:
    """One arm trained 2 steps on the test corpus, evaluated with `tasks`."""
    prepared = PreparedData.load(data_dir)
    data = DataConfig(corpus=prepared.corpus, data_dir=data_dir, vocab_size=prepared.vocab_size)
    recipe = TrainConfig(seq_len=32, batch_size=4, max_steps=2, warmup_steps=1, eval_interval=2, eval_batches=1,
                         log_interval=1, ckpt_interval=2, progress=False, tensorboard=False, device="cpu")
    return Study(tiny(vocab_size=prepared.vocab_size), recipe, data,
                 StudyConfig(arms=["diff"], sample_tokens=2, prompts=["a"], eval_tasks=tasks))


def _memory_held_elsewhere(monkeypatch) -> None:
    """The machine busy for a moment: 1 KiB free, far less than one window's attention maps."""
    monkeypatch.setattr(hooks, "_free_bytes", lambda device: 1024)


def test_a_task_failing_while_it_runs_stops_the_study_and_the_next_run_evaluates_it(data_dir, tmp_path, monkeypatch,
                                                                                    caplog):
    """A task that applies but fails while it runs (memory held elsewhere) stops the study, naming unit, task and
    cause; no result file is written without the task, and the next run reuses the finished tasks and evaluates it."""
    study = _text_study(data_dir, ["heldout-loss", "outliers"])
    _memory_held_elsewhere(monkeypatch)
    with pytest.raises(TaskFailedError, match=r"^seed 0, arm diff \(.*diff\): task outliers failed: one window of "
                                              r"\d+ tokens .* free now .*run again once they free it.*; no result is "
                                              r"written without it.*\(heldout-loss: done, kept in .*eval\)$"):
        run_study(study, tmp_path / "study", report=False)
    folder = StudyDir(tmp_path / "study")
    assert not (folder.results_dir() / "diff.json").exists()
    assert (tmp_path / "study" / "diff" / "eval" / "heldout-loss.json").is_file()
    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level("INFO", logger="difftransformer.experiments"):
        run_study(study, tmp_path / "study", report=False)
    assert "heldout-loss reused" in caplog.text and "outliers evaluated" in caplog.text
    assert "training into" not in caplog.text
    record = json.loads((folder.results_dir() / "diff.json").read_text())
    assert sorted(record["evals"]) == ["heldout-loss", "outliers"]


def test_a_unit_evaluated_again_keeps_its_result_file_when_a_task_fails(tmp_path, monkeypatch):
    """--replace-results with new ood options under memory pressure: the failure leaves the stored file as it was."""
    run_study(_ood_study(tmp_path), tmp_path / "study", report=False)
    path = StudyDir(tmp_path / "study").results_dir() / "diff.json"
    before = path.read_bytes()
    _memory_held_elsewhere(monkeypatch)
    with pytest.raises(TaskFailedError, match=r"task ood failed: .*ood takes its window lengths from its own "
                                              r"options, not --seq-len\); no result is written without it"):
        run_study(_ood_study(tmp_path, min_queries=30), tmp_path / "study", report=False, replace_results=True)
    assert path.read_bytes() == before
    monkeypatch.undo()
    run_study(_ood_study(tmp_path, min_queries=30), tmp_path / "study", report=False, replace_results=True)
    assert json.loads(path.read_text())["evals"]["ood"]["settings"]["options"]["min_queries"] == 30


def test_only_a_task_that_does_not_apply_is_left_out_and_never_from_a_file_that_holds_it(data_dir, tmp_path,
                                                                                         monkeypatch, caplog):
    """ood on a model trained on text does not apply: logged, left out, the study goes on. A task the result file
    holds that does not apply when its unit is evaluated again (a new task version here) is refused, the file left
    as it was, and one the study no longer runs is left out with a warning: neither goes without a word."""
    from difftransformer.eval.task import TaskNotApplicable
    from difftransformer.eval.tasks.heldout_loss import HeldOutLoss

    study = _text_study(data_dir, ["heldout-loss", "ood"])
    out = run_study(study, tmp_path / "study", report=False)
    assert "ood does not apply to this model: " in caplog.text and "holds a corpus, not a synthetic task" in caplog.text
    path = StudyDir(out).results_dir() / "diff.json"
    assert sorted(json.loads(path.read_text())["evals"]) == ["heldout-loss"]
    before = path.read_bytes()

    def does_not_apply(self, model, tokenizer, cfg):
        raise TaskNotApplicable("planted")

    monkeypatch.setattr(HeldOutLoss, "version", 2)
    monkeypatch.setattr(HeldOutLoss, "run", does_not_apply)
    with pytest.raises(StudyMismatchError, match=r"diff\.json holds the result of heldout-loss, which evaluating "
                                                 r"seed 0, arm diff again left out as not applying.*remove "
                                                 r"heldout-loss from compare.eval_tasks"):
        run_study(study, out, report=False)
    assert path.read_bytes() == before
    monkeypatch.undo()
    caplog.clear()
    run_study(dataclasses.replace(study, compare=dataclasses.replace(study.compare, eval_tasks=["ood"])), out,
              report=False)  # ood, missing from the file, is tried again; heldout-loss has left the study
    assert f"seed 0, arm diff: heldout-loss left out of {path}, rewritten with the study's tasks" in caplog.text
    assert json.loads(path.read_text())["evals"] == {}


class _Probe(Task):
    """A probe whose one window is `length` tokens (not registered: run through run_task only)."""

    name = "probe-test"
    description = "probe_batch inside a task"
    reads_seq_len = False
    length = 64

    def run(self, model, tokenizer, cfg: EvalConfig) -> TaskResult:
        hooks.probe_batch(model, self.length, 8, cfg.device)
        return TaskResult(self.name, {}, {})


def test_probe_batch_takes_one_window_when_a_batch_does_not_fit_and_says_when_one_never_can(monkeypatch):
    """Room for one window but not for a batch's headroom: one window at a time (not an error that a study reads
    as "cannot run on this model"). No room for one: a one-line error saying whether the memory is held elsewhere
    (run again) or the window is larger than the device (a shorter one), offering --seq-len only to tasks that
    read it."""
    model = DiffTransformerLM(tiny())
    maps = 2 * model.config.num_attention_heads
    need = 4 * maps * 64 * 64 * hooks._EAGER_COPIES
    monkeypatch.setattr(hooks, "_free_bytes", lambda device: need * 4 // 3 + 1)  # one window in 3/4 of it
    assert hooks.probe_batch(model, 64, 8, "cpu") == 1
    monkeypatch.setattr(hooks, "_free_bytes", lambda device: 4 * need)
    assert hooks.probe_batch(model, 64, 8, "cpu") == 2
    monkeypatch.setattr(hooks, "_total_bytes", lambda device: 1000 * need)
    monkeypatch.setattr(hooks, "_free_bytes", lambda device: need // 2)
    with pytest.raises(ValueError, match=r"one window of 64 tokens needs ~\S+ \S+ of explicit attention maps .*, more "
                                         r"than 3/4 of the \S+ \S+ free now \(of \S+ \S+\): other processes hold "
                                         r"the rest; run again once they free it, or use a shorter window, e.g. "
                                         r"--seq-len 32$"):
        hooks.probe_batch(model, 64, 8, "cpu")
    with pytest.raises(ValueError, match=r"free now .* use shorter windows \(32 tokens fit; probe-test takes its "
                                         r"window lengths from its own options, not --seq-len\)$") as caught:
        run_task(_Probe(), model, None, EvalConfig())
    assert "--seq-len 32" not in str(caught.value)
    monkeypatch.setattr(hooks, "_total_bytes", lambda device: need // 2)
    with pytest.raises(ValueError, match=r"more than 3/4 of all \S+ \S+ of cpu memory, so it never fits on this "
                                         r"machine; use a shorter window, e.g. --seq-len 32$"):
        hooks.probe_batch(model, 64, 8, "cpu")


def test_a_result_file_and_an_evaluation_result_are_flushed_to_disk(tmp_path, monkeypatch):
    """What hours of training stand behind survives a power loss: the file and its folder are fsynced."""
    from difftransformer import _io
    from difftransformer.experiments.units import Unit, write_result
    from tests.helpers import unit_record

    synced = []
    monkeypatch.setattr(_io, "fsync_file", lambda path: synced.append(("file", path.name)))
    monkeypatch.setattr(_io, "fsync_dir", lambda path: synced.append(("dir", path)))
    write_result(tmp_path / "r" / "diff.json", unit_record(Unit(None, None, 0, "diff"), 3.0))
    assert ("dir", tmp_path / "r") in synced and any(kind == "file" for kind, _ in synced)

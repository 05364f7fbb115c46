"""Task options, the results folder and its reuse rule, and the side-by-side comparison table."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from difftransformer.eval import EvalConfig, Task, TaskResult, get_task, run_task
from difftransformer.eval.compare import compare_table
from difftransformer.eval.results import ResultsDir
from difftransformer.eval.task import TASKS, register_task, weights_hash
from difftransformer.model import DiffTransformerLM
from tests.helpers import tiny


@dataclass
class _EchoOptions:
    scale: float = field(default=1.0, metadata={"help": "multiplies the answer"})
    lengths: tuple[int, ...] = field(default=(4, 8), metadata={"help": "lengths"})
    mode: str = field(default="a", metadata={"help": "a or b"})


class _Echo(Task):
    """Reports the sum of its lengths times scale: a task whose answer is known by hand."""

    name = "test-echo"
    description = "test task"
    Options = _EchoOptions

    def check_options(self) -> None:
        if self.options.mode not in ("a", "b"):
            raise ValueError(f"test-echo mode must be 'a' or 'b', got {self.options.mode!r}")

    def run(self, model, tokenizer, cfg):
        return TaskResult(self.name, {"value": self.options.scale * sum(self.options.lengths)}, {})

    def plot(self, result, path) -> bool:
        from matplotlib.figure import Figure

        fig = Figure()
        fig.add_subplot().plot([0, 1], [0, result.metrics["value"]])
        fig.savefig(path)
        return True


@pytest.fixture(autouse=True)
def _registered():
    register_task(_Echo)
    yield
    TASKS.pop(_Echo.name, None)


def test_options_are_typed_checked_and_recorded():
    task = get_task("test-echo", scale=2, lengths=[1, 2, 3])
    assert task.options.scale == 2.0 and isinstance(task.options.scale, float) and task.options.lengths == (1, 2, 3)
    model = DiffTransformerLM(tiny())
    result = run_task(task, model, None, EvalConfig(eval_seed=5))
    assert result.metrics["value"] == 12.0
    assert result.settings["options"] == {"scale": 2.0, "lengths": [1, 2, 3], "mode": "a"}
    assert result.settings["eval_config"]["eval_seed"] == 5
    with pytest.raises(ValueError, match="did you mean 'scale'"):
        get_task("test-echo", scal=2)
    with pytest.raises(ValueError, match="takes int values"):
        get_task("test-echo", lengths=[1.5])
    with pytest.raises(ValueError, match="takes a list"):
        get_task("test-echo", lengths=3)
    with pytest.raises(ValueError, match="mode must be"):
        get_task("test-echo", mode="c")
    with pytest.raises(ValueError, match="unknown evaluation task"):
        get_task("neddle")


def test_results_are_reused_only_for_the_same_weights_and_settings(tmp_path):
    torch.manual_seed(0)
    model = DiffTransformerLM(tiny())
    task, cfg = get_task("test-echo"), EvalConfig()
    results = ResultsDir(tmp_path / "eval")
    result = run_task(task, model, None, cfg)
    written = results.save(result, task.plot)
    assert [p.name for p in written] == ["test-echo.json", "test-echo.png"]
    assert written[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in results.path.iterdir() if p.name.startswith(".")]  # no temporary left
    h = weights_hash(model)
    assert results.cached("test-echo", h, result.settings)["metrics"]["value"] == 12.0
    other = dict(result.settings, options={**result.settings["options"], "scale": 3.0})
    assert results.cached("test-echo", h, other) is None
    assert results.cached("test-echo", "0" * 64, result.settings) is None
    moved = dict(result.settings, eval_config={**result.settings["eval_config"], "device": "cuda", "batch_size": 1})
    assert results.cached("test-echo", h, moved) is not None  # where and how it was batched: same numbers
    results.json_path("test-echo").write_text("{not json")
    assert results.cached("test-echo", h, result.settings) is None and results.all() == {}
    # a task without a figure removes a stale one
    results.save(result, None)
    assert not results.png_path("test-echo").exists()


def _record(task, metrics, options=None):
    return {"task": task, "metrics": metrics, "settings": {"eval_config": {"split": "test"}, "options": options or {}}}


def test_compare_table_puts_metrics_side_by_side():
    a = {"x": _record("x", {"acc": 0.5, "loss": 2.0}), "only-a": _record("only-a", {"v": 1.0}),
         "y": _record("y", {"m": 1.0}, {"n": 1})}
    b = {"x": _record("x", {"acc": 0.75, "loss": 1.5}), "y": _record("y", {"m": 2.0}, {"n": 2})}
    table = compare_table(a, b, ("runs/t", "runs/d"), ("transformer", "diff"))
    assert "| x | acc | 0.5 | 0.75 | 0.25 |" in table and "| x | loss | 2 | 1.5 | -0.5 |" in table
    assert "y: not compared, the two results differ in n" in table and "only one model has: only-a" in table
    assert "| y |" not in table
    other_text = {"x": {**b["x"], "settings": {**b["x"]["settings"], "corpus_hash": "b"}}}
    mine = {"x": {**a["x"], "settings": {**a["x"]["settings"], "corpus_hash": "a"}}}
    assert "x: not compared, the two results differ in corpus_hash" in compare_table(mine, other_text, ("a", "b"),
                                                                                       ("t", "d"))

"""Task options, the results folder and its reuse rule, and the side-by-side comparison table."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from difftransformer.eval import EvalConfig, Task, TaskResult, get_task, run_task
from difftransformer.eval.comparison import compare_table
from difftransformer.eval.results import ResultsDir, StoredResultError, evaluate_cached
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


def _saved(tmp_path, scale: float = 1.0):
    torch.manual_seed(0)
    model = DiffTransformerLM(tiny())
    task, cfg = get_task("test-echo", scale=scale), EvalConfig()
    results = ResultsDir(tmp_path / "eval")
    record, reused = evaluate_cached(task, model, None, cfg, results)
    return model, cfg, results, record


def test_a_figure_and_its_json_are_one_result(tmp_path, monkeypatch):
    """The JSON is written last and records the figure's sha256: a figure of another run beside it (a kill
    between the two files, two writers) means the result is computed again, never reused as "the same"."""
    import hashlib

    import difftransformer.eval.results as results_module

    model, cfg, results, record = _saved(tmp_path)
    png = results.png_path("test-echo")
    assert record["provenance"]["figure_sha256"] == hashlib.sha256(png.read_bytes()).hexdigest()
    settings = record["settings"]
    assert results.cached("test-echo", weights_hash(model), settings) is not None

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the process dies after the figure, before the JSON

    monkeypatch.setattr(results_module, "atomic_write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        evaluate_cached(get_task("test-echo", scale=3.0), model, None, cfg, results, force=True)
    monkeypatch.undo()
    assert json.loads(results.json_path("test-echo").read_text()) == record  # the old JSON, a new figure
    assert results.cached("test-echo", weights_hash(model), settings) is None
    again, reused = evaluate_cached(get_task("test-echo"), model, None, cfg, results)
    assert not reused and again["provenance"]["figure_sha256"] == hashlib.sha256(png.read_bytes()).hexdigest()
    png.unlink()  # a result whose figure is gone is not whole either
    assert results.cached("test-echo", weights_hash(model), settings) is None


def test_a_killed_figure_leaves_no_temporary_and_the_next_writer_sweeps_old_ones(tmp_path, monkeypatch):
    model, cfg, results, record = _saved(tmp_path)
    left = results.path / "test-echo.png.0123abcd.tmp.png"
    left.write_bytes(b"\x89PNG half")  # what a SIGKILL mid-plot leaves

    def killed_plot(self, result, path):
        Path(path).write_bytes(b"\x89PNG")
        raise KeyboardInterrupt

    monkeypatch.setattr(_Echo, "plot", killed_plot)
    with pytest.raises(KeyboardInterrupt):
        evaluate_cached(get_task("test-echo"), model, None, cfg, results, force=True)
    assert sorted(p.name for p in results.path.iterdir()) == [".lock", "test-echo.json", "test-echo.png"]


def test_a_stored_result_with_other_settings_is_not_replaced_without_force(tmp_path):
    model, cfg, results, record = _saved(tmp_path)
    before = results.json_path("test-echo").read_bytes()
    with pytest.raises(StoredResultError, match=r"test-echo.json holds test-echo's result for these weights with "
                                                r"other settings \(options.scale: 1.0 before, 3.0 now\).*--force"):
        evaluate_cached(get_task("test-echo", scale=3.0), model, None, cfg, results)
    assert results.json_path("test-echo").read_bytes() == before
    record, reused = evaluate_cached(get_task("test-echo", scale=3.0), model, None, cfg, results, force=True)
    assert not reused and record["metrics"]["value"] == 36.0
    other = DiffTransformerLM(tiny())  # other weights: the stored result measured a model that is gone
    assert evaluate_cached(get_task("test-echo"), other, None, cfg, results)[0]["metrics"]["value"] == 12.0


def test_one_writer_at_a_time_per_results_folder(tmp_path):
    import subprocess
    import sys

    from difftransformer._io import FolderInUseError

    results = ResultsDir(tmp_path / "eval")
    hold = ("import sys, time\nfrom difftransformer._io import folder_lock\n"
            "with folder_lock(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", hold, str(results.path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(FolderInUseError, match=f"pid {proc.pid}.*; wait for it to finish, or keep these results "
                                                  f"in another folder \\(eval --out-dir DIR\\)$"):
            evaluate_cached(get_task("test-echo"), DiffTransformerLM(tiny()), None, EvalConfig(), results)
    finally:
        proc.kill()
        proc.wait()
    assert not results.json_path("test-echo").exists()


def test_numeric_options_are_bounded():
    for value, shown in ((99999999999999999999, "999999999999... (20 digits)"), (float("inf"), "inf")):
        with pytest.raises(ValueError, match=re.escape(f"test-echo.scale is {shown}, beyond")):
            get_task("test-echo", scale=value)
    with pytest.raises(ValueError, match=re.escape("test-echo.lengths is 1e+20, beyond")):
        get_task("test-echo", lengths=[4, 1e20])
    with pytest.raises(ValueError, match="EvalConfig.batch_size must be a positive integer up to"):
        EvalConfig(batch_size=10**20)


def test_a_result_of_an_older_task_version_is_computed_again_and_replaced(tmp_path, monkeypatch):
    """A metric fixed in a new task version must reach stored results: the old one is neither reused nor refused
    as the user's work (it measured with code that is gone); a result stored before versions were recorded is
    version 1, and the same version is reused."""
    model, cfg, results, record = _saved(tmp_path)
    assert record["settings"]["task_version"] == 1
    legacy = json.loads(results.json_path("test-echo").read_text())
    del legacy["settings"]["task_version"]  # written before versions were recorded: version 1
    results.json_path("test-echo").write_text(json.dumps(legacy))
    assert evaluate_cached(get_task("test-echo"), model, None, cfg, results)[1]  # reused: same version
    monkeypatch.setattr(_Echo, "version", 2)
    monkeypatch.setattr(_Echo, "run", lambda self, m, t, c: TaskResult(self.name, {"value": -1.0}, {}))
    record, reused = evaluate_cached(get_task("test-echo"), model, None, cfg, results)
    assert not reused and record["metrics"]["value"] == -1.0 and record["settings"]["task_version"] == 2
    assert json.loads(results.json_path("test-echo").read_text())["settings"]["task_version"] == 2
    assert evaluate_cached(get_task("test-echo"), model, None, cfg, results)[1]
    monkeypatch.setattr(_Echo, "version", 1)  # an older checkout never overwrites a newer version's result
    with pytest.raises(StoredResultError, match="result of version 2 of the task, newer than this package's \\(1\\)"):
        evaluate_cached(get_task("test-echo"), model, None, cfg, results)
    assert json.loads(results.json_path("test-echo").read_text())["settings"]["task_version"] == 2


def test_a_task_that_refuses_reuse_runs_again(tmp_path, monkeypatch):
    model, cfg, results, record = _saved(tmp_path)
    monkeypatch.setattr(_Echo, "reusable", lambda self: "its judge may have changed")
    logged = []
    record, reused = evaluate_cached(get_task("test-echo"), model, None, cfg, results, log=logged.append)
    assert not reused and any("not reusing" in line and "its judge may have changed" in line for line in logged)


def test_compare_table_names_results_of_other_task_versions_and_skipped_tasks():
    a = {"x": _record("x", {"acc": 0.5})}
    b = {"x": {**_record("x", {"acc": 0.75}), "settings": {**_record("x", {})["settings"], "task_version": 2}}}
    table = compare_table(a, b, ("a", "b"), ("t", "d"), skipped={"z": "runs/b: no held-out data"})
    assert "x: not compared, the two results differ in task_version" in table and "| x | acc" not in table
    assert "- z: could not run, runs/b: no held-out data" in table and "only one model has" not in table


def test_the_same_tensors_under_another_configuration_are_evaluated_again(data_dir, tmp_path):
    """A result is reused only for the model configuration it measured: a copy of the weights with a longer context
    (the task's default length follows it), another RoPE base, no position encoding or another λ_init gives other
    numbers; how attention is computed (the backend) does not, and reuses it. A result stored without the model's
    configuration is computed again, and replaced without --force (it is not the user's choice of settings)."""
    import dataclasses

    from difftransformer.data import PreparedData

    tok = PreparedData.load(data_dir).tokenizer()
    cfg, results = EvalConfig(data_dir=data_dir), ResultsDir(tmp_path / "eval")
    task = get_task("long-context", documents=2)
    torch.manual_seed(0)
    base = tiny(vocab_size=tok.vocab_size, max_position_embeddings=32)
    model = DiffTransformerLM(base)
    first, reused = evaluate_cached(task, model, tok, cfg, results)
    assert not reused and first["settings"]["length"] == 32
    for change in (dict(max_position_embeddings=64), dict(rope_theta=500.0), dict(position_encoding="none"),
                   dict(lambda_init=0.5), dict(attn_backend="eager")):
        other = DiffTransformerLM(dataclasses.replace(base, **change))
        other.load_state_dict(model.state_dict())
        record, reused = evaluate_cached(task, other, tok, cfg, results)
        fresh = run_task(task, other, tok, cfg)
        assert reused == ("attn_backend" in change), change
        assert record["metrics"] == pytest.approx(fresh.metrics) and record["settings"]["length"] == (
            64 if "max_position_embeddings" in change else 32), change
        evaluate_cached(task, model, tok, cfg, results)  # back to the first configuration for the next change
    stored = json.loads(results.json_path("long-context").read_text())
    del stored["settings"]["model"]  # as a result saved before the configuration was recorded
    results.json_path("long-context").write_text(json.dumps(stored))
    assert evaluate_cached(task, model, tok, cfg, results)[1] is False


def test_a_chosen_folder_keeps_a_result_of_the_same_weights_under_another_configuration(data_dir, tmp_path):
    """In a folder that is not one model's own (eval --out-dir), the result of these tensors under another model
    configuration is another model's: refused without --force, as a result of other weights is."""
    import dataclasses

    from difftransformer.data import PreparedData

    tok = PreparedData.load(data_dir).tokenizer()
    cfg, results = EvalConfig(data_dir=data_dir), ResultsDir(tmp_path / "chosen", own=False)
    task = get_task("long-context", documents=2)
    torch.manual_seed(0)
    base = tiny(vocab_size=tok.vocab_size, max_position_embeddings=32)
    model = DiffTransformerLM(base)
    evaluate_cached(task, model, tok, cfg, results)
    other = DiffTransformerLM(dataclasses.replace(base, rope_theta=500.0))
    other.load_state_dict(model.state_dict())
    with pytest.raises(StoredResultError, match="under another model configuration"):
        evaluate_cached(task, other, tok, cfg, results)
    assert not evaluate_cached(task, other, tok, cfg, results, force=True)[1]

"""`difftransformer eval`: one task, reuse of stored results, all, compare, and bad inputs in one line."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from difftransformer.cli import main
from difftransformer.eval import TASKS
from tests.helpers import cli_fails


def test_one_task_writes_json_and_png_and_is_reused(compared, capsys):
    run = compared / "diff"
    argv = ["eval", "logit-quant", str(run), "--windows", "2", "--needle-samples", "0", "--bits", "16,4"]
    assert main(argv) == 0
    out = capsys.readouterr()
    record = json.loads((run / "eval" / "logit-quant.json").read_text())
    assert (run / "eval" / "logit-quant.png").read_bytes()[:4] == b"\x89PNG"
    assert record["settings"]["options"]["bits"] == [16, 4] and record["settings"]["options"]["windows"] == 2
    assert record["settings"]["eval_config"]["data_dir"]  # the run's own prepared data, found by itself
    assert record["metrics"]["loss_increase@tensor/16"] == 0.0 and record["metrics"]["loss@tensor/4"] > 0
    assert "loss@row/4" in out.out
    assert main(argv) == 0
    assert "reusing" in capsys.readouterr().err
    assert main(argv[:-2] + ["--bits", "16,6"]) == 2  # other settings: the stored result is not replaced
    err = capsys.readouterr().err.strip()
    assert "options.bits: [16, 4] before, [16, 6] now" in err and "--force" in err and len(err.splitlines()) == 2
    assert json.loads((run / "eval" / "logit-quant.json").read_text()) == record
    assert main(argv[:-2] + ["--bits", "16,6", "--force"]) == 0  # on purpose: computed again
    assert "wrote" in capsys.readouterr().err


def test_seq_len_sets_the_window_of_held_out_text(compared, capsys, tmp_path):
    run = compared / "diff"
    assert main(["eval", "outliers", str(run), "--seq-len", "16", "--tokens", "64", "--out-dir", str(tmp_path)]) == 0
    settings = json.loads((tmp_path / "outliers.json").read_text())["settings"]
    assert settings["seq_len"] == 16 and settings["windows"] == 4 and settings["eval_config"]["seq_len"] == 16


def test_compare_puts_both_arms_in_one_table(compared, capsys, tmp_path):
    out = tmp_path / "cmp.md"
    assert main(["eval", "compare", str(compared / "transformer"), str(compared / "diff"), "--tasks",
                 "heldout-loss", "--out", str(out)]) == 0
    table = out.read_text()
    assert "| heldout-loss | loss |" in table and "A: transformer | B: diff" in table
    a = json.loads((compared / "transformer" / "eval" / "heldout-loss.json").read_text())["metrics"]["loss"]
    b = json.loads((compared / "diff" / "eval" / "heldout-loss.json").read_text())["metrics"]["loss"]
    assert f"| {b - a:.4g} |" in table


def test_a_task_that_could_not_run_in_all_or_compare_is_named_and_exits_3(compared, capsys, tmp_path, monkeypatch):
    """`eval all` and `eval compare` go on past a task that cannot run on a model, but such a run has not measured
    what it was asked to: the output names the skipped task and why, and the exit code is 1."""
    from difftransformer.eval.tasks.heldout_loss import HeldOutLoss

    def cannot(self, model, tokenizer, cfg):
        raise ValueError("no held-out text here")

    monkeypatch.setattr(HeldOutLoss, "run", cannot)
    assert main(["eval", "all", str(compared / "diff"), "--tasks", "heldout-loss", "--out-dir", str(tmp_path)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert "heldout-loss: skipped: no held-out text here" in err[-2]
    assert "could not run 1 task(s): heldout-loss" in err[-1]
    out = tmp_path / "cmp.md"
    assert main(["eval", "compare", str(compared / "transformer"), str(compared / "diff"), "--tasks", "heldout-loss",
                 "--force", "--out", str(out)]) == 3
    table = out.read_text()
    assert "- heldout-loss: could not run, " in table and "no held-out text here" in table
    assert str(compared / "transformer") in table.split("- heldout-loss: could not run, ")[1]


def test_a_task_that_does_not_apply_to_a_model_is_named_and_no_failure(compared, capsys, tmp_path):
    """`ood` measures models trained on a synthetic task: on a model trained on text it does not apply, so
    `eval all` and `eval compare` with it in their list name it and still succeed (the default list holds it)."""
    argv = ["eval", "all", str(compared / "diff"), "--tasks", "ood,heldout-loss", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "ood: does not apply to this model: " in err and "holds a corpus, not a synthetic task" in err
    assert "could not run" not in err
    out = tmp_path / "cmp.md"
    assert main(["eval", "compare", str(compared / "transformer"), str(compared / "diff"), "--tasks",
                 "ood,heldout-loss", "--out", str(out)]) == 0
    table = out.read_text()
    assert "- ood: does not apply, " in table and "| heldout-loss | loss |" in table and "only one model" not in table
    assert main(["eval", "ood", str(compared / "diff")]) == 2  # asked for alone, it is an error


def test_no_run_names_a_result_of_another_task_version_and_leaves_it_out(compared, capsys, tmp_path, monkeypatch):
    from difftransformer.eval.tasks.heldout_loss import HeldOutLoss

    argv = ["eval", "compare", str(compared / "transformer"), str(compared / "diff"), "--tasks", "heldout-loss"]
    assert main(argv) == 0
    capsys.readouterr()
    monkeypatch.setattr(HeldOutLoss, "version", HeldOutLoss.version + 1)
    assert main([*argv, "--no-run", "--out", str(tmp_path / "t.md")]) == 0
    err = capsys.readouterr().err
    assert err.count(f"was computed by version {HeldOutLoss.version - 1} of the task, this package's is "
                     f"{HeldOutLoss.version}") == 2 and "run without --no-run to compute it again" in err
    assert "| heldout-loss |" not in (tmp_path / "t.md").read_text()


def test_every_task_has_help_with_its_options(capsys):
    for name in TASKS:
        with pytest.raises(SystemExit) as e:
            main(["eval", name, "--help"])
        assert e.value.code == 0
    assert "--bits LIST" in capsys.readouterr().out  # the last one printed includes logit-quant's options


def test_bad_inputs_are_one_line(compared, capsys, tmp_path):
    run = str(compared / "diff")
    cli_fails(capsys, ["eval", "logit-quant", run, "--bits", "1"], "bits must each lie in 2..16")
    cli_fails(capsys, ["eval", "logit-quant", run, "--bits", "24"], "bits must each lie in 2..16")
    cli_fails(capsys, ["eval", "heldout-loss", str(tmp_path / "nope")], "does not exist")
    cli_fails(capsys, ["eval", "all", run, "--tasks", "neddle,heldout-loss"], "unknown evaluation task 'neddle'")
    cli_fails(capsys, ["eval", "heldout-loss", run, "--batch-size", "0"], "--batch-size must be a positive")
    cli_fails(capsys, ["eval", "outliers", run, "--seq-len", "0"], "--seq-len must be a positive integer")
    cli_fails(capsys, ["eval", "outliers", run, "--seq-len", "100000"], "--seq-len 100000 is beyond the context of")
    cli_fails(capsys, ["eval", "all", run, "--tasks", ","], "names no task")
    cli_fails(capsys, ["eval", "heldout-loss", str(compared)], "is a comparison folder")
    cli_fails(capsys, ["eval", "icl", run, "--draws", "99999999999999999999"],
              "icl.draws is 999999999999... (20 digits), beyond what an evaluation can run")
    cli_fails(capsys, ["eval", "heldout-loss", run, "--batch-size", "10000000000"],
              "--batch-size 10000000000 is beyond")
    for flag in ("--out-dir", "--data-dir", "--tokenizer"):
        cli_fails(capsys, ["eval", "heldout-loss", run, flag, ""], f"{flag} is empty")


def _copies(compared, tmp_path):
    """Both arms of the shared study without their stored results, free to evaluate."""
    return [shutil.copytree(compared / arm, tmp_path / arm, ignore=shutil.ignore_patterns("eval"))
            for arm in ("transformer", "diff")]


def test_compare_never_replaces_results_run_with_chosen_options(compared, capsys, tmp_path):
    """`eval compare` never replaces a result the user ran with chosen options by one with the defaults: it refuses
    before anything runs, naming the file, the option and --no-run, and --no-run leaves that result as it is."""
    a, b = _copies(compared, tmp_path)
    assert main(["eval", "outliers", str(b), "--tokens", "64"]) == 0
    chosen = (b / "eval" / "outliers.json").read_bytes()
    capsys.readouterr()
    argv = ["eval", "compare", str(a), str(b), "--tasks", "heldout-loss,outliers"]
    cli_fails(capsys, argv, "outliers.json holds outliers's result for these weights with other settings",
              "options.tokens: 64 before, 32768 now", "--no-run", "--force")
    assert (b / "eval" / "outliers.json").read_bytes() == chosen and not (a / "eval" / "heldout-loss.json").exists()
    assert main([*argv, "--no-run"]) == 0 and "| outliers |" not in capsys.readouterr().out  # only one model has it
    assert (b / "eval" / "outliers.json").read_bytes() == chosen


def test_compare_out_on_a_full_disk_keeps_the_old_table(compared, capsys, tmp_path, monkeypatch):
    a, b = _copies(compared, tmp_path)
    argv = ["eval", "compare", str(a), str(b), "--tasks", "heldout-loss", "--out", str(tmp_path / "t.md")]
    assert main(argv) == 0
    table = (tmp_path / "t.md").read_text()

    def full_disk(self, text, *args, **kwargs):
        with open(self, "w") as fh:
            fh.write(text[:10])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full_disk)
    assert main([*argv, "--no-run"]) == 2
    monkeypatch.undo()
    assert (tmp_path / "t.md").read_text() == table and not list(tmp_path.glob("t.md*.tmp"))

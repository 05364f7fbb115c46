"""`compare`: a study is continued only with its own recipe and seeds; bad arguments and study settings are
refused before anything is written."""

from __future__ import annotations

import json
import shutil

import pytest

from difftransformer.cli import main
from tests.cli.conftest import last_error_line
from tests.helpers import cli_fails


def test_a_study_is_not_continued_with_another_recipe(workdir, compared, capsys):
    cli_fails(capsys, ["compare", "--config", str(workdir / "tiny.toml"), "--out-dir", str(compared),
                    "--set", "train.lr=5e-4"], "trained with another recipe", "lr: 0.001 before, 0.0005 now")


@pytest.mark.parametrize("argv_tail, needles", [
    (["--seeds", "0,0"], ["--seeds lists a seed twice"]),
    (["--seeds", ","], ["names no seed"]),
    (["--seeds", "-1"], ["--seeds must be a list of integers"]),
    (["--out-dir", ""], ["--out-dir is empty"]),
])
def test_bad_compare_arguments_leave_nothing_behind(workdir, tmp_path, capsys, argv_tail, needles):
    argv = ["compare", "--config", str(workdir / "tiny.toml")]
    if "--out-dir" not in argv_tail:
        argv += ["--out-dir", str(tmp_path / "study")]
    cli_fails(capsys, argv + argv_tail, *needles)
    assert not (tmp_path / "study").exists()


@pytest.mark.parametrize("extra, needles", [
    ("seeds = []\n", ["compare.seeds is empty"]),
    ('sizes = [{name = "../escape", hidden_size = 64, num_hidden_layers = 1, diff_heads = 2}]\n',
     ["size name '../escape' must be a non-empty folder name"]),
    ('sizes = [{name = "", hidden_size = 64, num_hidden_layers = 1, diff_heads = 2}]\n', ["size name ''"]),
    ('sizes = [{name = "a/b", hidden_size = 64, num_hidden_layers = 1, diff_heads = 2}]\n', ["size name 'a/b'"]),
    ('reuse = ["{tmp}/no-such-results"]\n', ["compare.reuse:", "no-such-results is not a folder"]),
    ('results_dir = "{tmp}/study"\n', ["holds the study folder", "JSON files would be read as result files"]),
    ('results_dir = "{tmp}"\n', ["holds the study folder"]),
])
def test_study_settings_refused_before_anything_is_written(workdir, tmp_path, capsys, extra, needles):
    """An empty seed list, a size name that is no plain folder name ('../escape' would put its runs outside the
    study, '' would mix them into the no-size layout), a reuse folder that does not exist, and a results folder that
    holds the study (its JSON files would be read as result files): each is refused before anything is written, not
    after training."""
    config = tmp_path / "study.toml"
    config.write_text((workdir / "tiny.toml").read_text() + extra.replace("{tmp}", str(tmp_path)))
    cli_fails(capsys, ["compare", "--config", str(config), "--out-dir", str(tmp_path / "study")], *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.toml"]


def test_seeds_added_to_a_one_seed_study_are_trained_and_seed_0_is_not(workdir, compared, tmp_path, capsys):
    """Seeds added to a one-seed study are trained, and its seed 0 is not trained again (hours on a real study):
    `--seeds 0,1` keeps seed 0's result where it is and trains seed 1 into the seed layout; `--seeds 5` trains seed 5
    rather than reading seed 0's <arm>.json as its result, and the report counts 3 seeds."""
    study = tmp_path / "study"
    shutil.copytree(compared, study)
    argv = ["compare", "--config", str(workdir / "tiny.toml"), "--out-dir", str(study)]
    assert main(argv + ["--seeds", "0,1"]) == 0
    assert (study / "results" / "seed1" / "diff.json").is_file()
    assert not (study / "seed0").exists() and not (study / "results" / "seed0").exists()
    assert main(argv + ["--seeds", "5"]) == 0
    assert json.loads((study / "results" / "seed5" / "diff.json").read_text())["unit"]["seed"] == 5
    assert "over 3 seeds" in capsys.readouterr().out


def test_a_recipe_recorded_before_a_setting_existed_is_the_same_experiment():
    """A recipe recorded before a training setting existed (trainable, init_from) lacks that key: at the setting's
    default it is the same experiment, so `compare` continues the study and compare.reuse takes its units rather than
    training them again. A real difference (lr) still counts."""
    from difftransformer.experiments.units import identity_differences
    from difftransformer.train import TrainConfig

    recipe = TrainConfig().to_dict()
    new = {"model": {"m": 1}, "train": recipe, "data": {"d": 1}}
    for key in ("trainable", "init_from"):
        if key in recipe:
            old = {**new, "train": {k: v for k, v in recipe.items() if k != key}}
            assert identity_differences(old, new) == []
    assert identity_differences({**new, "train": {**recipe, "lr": 1.0}}, new) == ["train"]


def test_arms_named_on_the_command_line_may_be_the_configs_own_tables():
    from difftransformer.cli.compare import _arm_names
    from difftransformer.experiments import StudyConfig

    compare = StudyConfig(arms=["transformer", {"name": "transformer_nope", "attention": "transformer",
                                                "overrides": {"position_encoding": "none"}}])
    got = _arm_names("transformer_nope, diff_v2,transformer", compare)
    assert got == ["transformer_nope", "diff_v2", "transformer"]
    with pytest.raises(ValueError, match="unknown arm 'diff_nope'.*this config's arms: transformer, transformer_nope"):
        _arm_names("diff_nope", compare)
    with pytest.raises(ValueError, match="twice"):
        _arm_names("transformer_nope,transformer_nope", compare)


def test_a_task_that_fails_while_it_runs_exits_3_with_one_line(workdir, tmp_path, monkeypatch, capsys):
    """A task that applies but could not run is neither a crash (1) nor bad input (2): exit status 3, as `eval all`
    gives it, with the study's one line."""
    from difftransformer.cli import compare as compare_cli
    from difftransformer.experiments.evaluate import TaskFailedError

    def failing(*args, **kwargs):
        raise TaskFailedError("seed 0, arm diff (runs/x): task needle failed: a needle prompt of 300 tokens ...")

    monkeypatch.setattr(compare_cli, "run_study", failing)
    capsys.readouterr()
    assert main(["compare", "--config", str(workdir / "tiny.toml"), "--out-dir", str(tmp_path / "c")]) == 3
    assert last_error_line(capsys) == ("difftransformer compare: error: seed 0, arm diff (runs/x): task needle "
                                       "failed: a needle prompt of 300 tokens ...")

"""Regressions from the fourth hostile pass (issue 13, docs/hostile-pass.md): each case was a traceback,
a silent wrong result, a write outside the folder asked for, or something half-written left behind;
each is now refused in one line naming the value, the rule and the fix, or handled."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal

import pytest

from difftransformer.cli import main, os_error_message
from tests.helpers import cli_fails


def _eval_fails(capsys, argv: list[str], *needles: str) -> str:
    """An eval that fails: exit 2, no traceback, its last stderr line (after the progress lines) naming
    every needle."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]
    for needle in needles:
        assert needle in last, (needle, last)
    return last


def _corpus(folder, words, seed: int, docs: int = 10):
    folder.mkdir()
    rng = random.Random(seed)
    for i in range(docs):
        (folder / f"d{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(900)) + ".\n")
    return folder


def _prepare(corpus, out, tokenizer, *extra: str) -> None:
    assert main(["prepare", str(corpus), "--out-dir", str(out), "--tokenizer", str(tokenizer), *extra]) == 0


# ---------------------------------------------------------------- the command itself


def test_version_and_a_debug_variable_set_to_zero(capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("difftransformer ")
    monkeypatch.setenv("DIFFTRANSFORMER_DEBUG", "0")  # was read as "on": a traceback for a user mistake
    cli_fails(capsys, ["report", "/nonexistent/study"], "is not a folder")


def test_a_relative_default_path_is_named_in_full(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = os_error_message(FileNotFoundError(2, "No such file or directory", "cache"))
    assert str(tmp_path / "cache") in message


@pytest.mark.skipif(signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, reason="SIGTERM is handled here")
def test_sigterm_during_convert_leaves_nothing_half_written(compared, tmp_path, capsys, monkeypatch):
    """SIGTERM once killed the process where it stood: `.DST.converting-PID` (the model's size) stayed."""
    import difftransformer.cli.convert as convert

    def write_then_get_killed(fmt, folder, *args):
        (folder / "model.safetensors").write_bytes(b"half")
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not interrupt the command")

    monkeypatch.setattr(convert, "_write", write_then_get_killed)
    out = tmp_path / "out"
    assert main(["convert", str(compared / "diff" / "final"), str(out), "--to", "diffllama"]) == 128 + signal.SIGTERM
    assert "terminated (SIGTERM); nothing half-written was kept" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler lives only while a command runs


def test_an_empty_prepare_out_dir_is_not_the_default(workdir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli_fails(capsys, ["prepare", str(workdir / "corpus"), "--out-dir", "", "--vocab-size", "300"],
              "--out-dir is empty")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- eval


def test_two_models_never_share_one_results_folder(compared, tmp_path, capsys):
    """`eval compare A B --out-dir X` wrote both models' results into X, each replacing the other's;
    a later --no-run showed B's numbers in both columns, B - A = 0."""
    a, b = str(compared / "transformer"), str(compared / "diff")
    _eval_fails(capsys, ["eval", "compare", a, b, "--tasks", "heldout-loss", "--out-dir", str(tmp_path / "x")],
                "would hold the results of both models")
    assert not (tmp_path / "x").exists()


def test_no_run_shows_no_result_of_other_weights(compared, tmp_path, capsys):
    """A result left in a model's eval/ folder by other weights (an earlier final/, another model) was
    shown by --no-run as this model's."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(compared / "transformer", a, ignore=shutil.ignore_patterns("eval"))
    shutil.copytree(compared / "diff", b, ignore=shutil.ignore_patterns("eval"))
    assert main(["eval", "heldout-loss", str(a)]) == 0
    (b / "eval").mkdir()
    shutil.copy(a / "eval" / "heldout-loss.json", b / "eval" / "heldout-loss.json")
    capsys.readouterr()
    assert main(["eval", "compare", str(a), str(b), "--tasks", "heldout-loss", "--no-run"]) == 0
    out, err = capsys.readouterr()
    assert "computed from other weights" in err and str(b) in err
    assert "heldout-loss | loss" not in out  # no row: B has no result of its own


def test_a_result_for_a_data_folder_prepared_again_is_not_reused(workdir, compared, tmp_path, capsys):
    model = compared / "diff"
    tokenizer = model / "final" / "tokenizer.json"
    data, results = tmp_path / "data", tmp_path / "results"
    _prepare(workdir / "corpus", data, tokenizer, "--test-fraction", "0.2")
    argv = ["eval", "heldout-loss", str(model), "--data-dir", str(data), "--out-dir", str(results)]
    assert main(argv) == 0
    first = json.loads((results / "heldout-loss.json").read_text())["metrics"]["loss"]
    other = _corpus(tmp_path / "other", ["zebra", "quantum", "fjord", "kiwi", "jazz"], seed=5)
    _prepare(other, data, tokenizer, "--test-fraction", "0.2", "--force")  # same folder, other text
    capsys.readouterr()
    assert main(argv) == 0
    assert "reusing" not in capsys.readouterr().err
    assert json.loads((results / "heldout-loss.json").read_text())["metrics"]["loss"] != first


@pytest.mark.parametrize("edit", [
    lambda d: d.update(settings=[]),
    lambda d: d.update(provenance="x"),
    lambda d: d["settings"].update(eval_config=[1]),
    lambda d: d.update(metrics=[1, 2]),
    lambda d: d.update(metrics=None),
    lambda d: d["metrics"].update(loss="abc"),
], ids=["settings-list", "provenance-str", "eval_config-list", "metrics-list", "metrics-null", "loss-str"])
def test_a_hand_edited_eval_result_is_computed_again(compared, tmp_path, capsys, edit):
    model, results = str(compared / "diff"), tmp_path / "results"
    argv = ["eval", "heldout-loss", model, "--out-dir", str(results)]
    assert main(argv) == 0
    record = json.loads((results / "heldout-loss.json").read_text())
    edit(record)
    (results / "heldout-loss.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert main(["eval", "compare", model, model, "--no-run", "--tasks", "heldout-loss", "--out-dir",
                 str(results)]) == 0
    assert main(argv) == 0
    assert "wrote" in capsys.readouterr().err
    assert isinstance(json.loads((results / "heldout-loss.json").read_text())["metrics"]["loss"], float)


@pytest.mark.parametrize("task, extra", [("heldout-loss", []), ("long-context", []), ("outliers", []),
                                         ("logit-quant", ["--needle-samples", "0"])])
def test_an_empty_split_is_named_with_a_fix_the_command_offers(workdir, compared, tmp_path, capsys, task, extra):
    """The advice was 'lower seq_len' (no such flag) or 'use length <= 0'."""
    model = compared / "diff"
    data = tmp_path / "data"
    _prepare(workdir / "corpus", data, model / "final" / "tokenizer.json", "--test-fraction", "0")
    capsys.readouterr()
    _eval_fails(capsys, ["eval", task, str(model), "--data-dir", str(data), "--out-dir", str(tmp_path / "r"),
                         *extra], "test split", "has 0 tokens", "prepared without a test split", "--split val")


def test_logit_quant_names_its_own_option_when_needles_do_not_fit(compared, capsys):
    """The needle task's advice ('fewer needles') named an option logit-quant does not have."""
    last = _eval_fails(capsys, ["eval", "logit-quant", str(compared / "diff"), "--out-dir", "/nonexistent/never"],
                       "--needle-samples 0")
    assert "fewer needles" not in last


# ---------------------------------------------------------------- generate


def test_a_prompt_that_fills_the_context_is_counted_with_its_start_token(compared, capsys):
    """'the prompt is 255 tokens; the model's context is 256. Shorten the prompt' did not say why."""
    from difftransformer.data import Tokenizer

    run = compared / "diff"
    tok = Tokenizer.from_file(run / "final" / "tokenizer.json")
    prompt = tok.decode(tok.encode("the union " * 200)[:255])
    assert len(tok.encode(prompt)) == 255
    cli_fails(capsys, ["generate", str(run), prompt, "-n", "5"], "256 in all", "at most 254 tokens")
    assert main(["generate", str(run), prompt, "-n", "0"]) == 0  # nothing asked, nothing refused


def test_generate_on_a_transformers_folder_names_it(compared, tmp_path, capsys):
    pytest.importorskip("transformers")
    folder = tmp_path / "exported"
    shutil.copytree(compared / "diff" / "final", folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "diffllama", "hidden_size": 64}))
    cli_fails(capsys, ["generate", str(folder), "the"], "holds a transformers model (diffllama)", "--to ours")


# ---------------------------------------------------------------- compare and report


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
    """Each was accepted: an empty seed list, a size name that wrote its runs outside the study
    ('../escape') or into the no-size layout, a mistyped reuse folder skipped without a word, and a
    results folder holding the study, refused only after training, naming a checkpoint's JSON file."""
    config = tmp_path / "study.toml"
    config.write_text((workdir / "tiny.toml").read_text() + extra.replace("{tmp}", str(tmp_path)))
    cli_fails(capsys, ["compare", "--config", str(config), "--out-dir", str(tmp_path / "study")], *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.toml"]


@pytest.mark.parametrize("field, value, needle", [
    ("unit", "x", "is not a difftransformer-unit-v1 result file"),
    ("val", "x", "val is not a list"),
    ("val", [{"step": 1, "loss": "abc"}], "val is not a list"),
    ("train", [5], "train is not a list"),
    ("last_step", "x", "last_step is not an integer"),
    ("finished", "no", "finished is not true or false"),  # was read as finished (bool("no"))
    ("evals", {"heldout-loss": 5}, "evals is not a table of task results"),
])
def test_report_on_a_hand_edited_result_file(compared, tmp_path, capsys, field, value, needle):
    study = tmp_path / "study"
    shutil.copytree(compared, study)
    path = study / "results" / "diff.json"
    record = json.loads(path.read_text())
    record[field] = value
    path.write_text(json.dumps(record))
    cli_fails(capsys, ["report", str(study), "--no-samples"], str(path), needle)


def test_a_result_file_in_another_units_place_is_refused(compared, tmp_path, capsys):
    """diff.json holding the transformer arm's unit was read as the transformer's result: the report
    showed one arm's numbers under the other's name, without a word."""
    study = tmp_path / "study"
    shutil.copytree(compared, study)
    path = study / "results" / "diff.json"
    record = json.loads(path.read_text())
    record["unit"]["arm"] = "transformer"
    path.write_text(json.dumps(record))
    cli_fails(capsys, ["report", str(study), "--no-samples"], str(path), "holds the result of seed 0, arm transformer",
              "transformer.json")


# ---------------------------------------------------------------- the Python API behind the flags


@pytest.mark.parametrize("kwargs, needle", [
    ({"eval_seed": -1}, "EvalConfig.eval_seed must be in [0, 2**63)"),  # the flag refused it; the API did not
    ({"device": "tpu"}, "EvalConfig.device must be 'cpu', 'cuda' or 'cuda:N'"),  # torch's error came at run time
])
def test_eval_config_refuses_what_the_command_line_refuses(kwargs, needle):
    from difftransformer.eval import EvalConfig

    with pytest.raises(ValueError) as e:
        EvalConfig(**kwargs)
    assert needle in str(e.value)


def test_run_task_names_a_task_of_the_wrong_type():
    from difftransformer.eval import run_task

    with pytest.raises(TypeError, match=r"run_task takes a task name or a Task, got 5 \(int\)"):
        run_task(5, None, None)  # was AttributeError: 'int' object has no attribute 'run'


# ---------------------------------------------------------------- a study continued with other seeds


def test_seeds_added_to_a_one_seed_study_are_trained_and_seed_0_is_not(workdir, compared, tmp_path, capsys):
    """`--seeds 5` on a one-seed study found <arm>.json (seed 0's) and skipped seed 5 without training it,
    while the manifest claimed seeds [0, 5]; `--seeds 0,1` trained seed 0 a second time (hours on a
    real study) because its result was in the one-seed layout."""
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
    """A training setting added later (init_from) made every committed result "another experiment":
    `compare` refused to continue the study, and compare.reuse silently retrained the shared units."""
    from difftransformer.experiments.units import identity_differences
    from difftransformer.train import TrainConfig

    recipe = TrainConfig().to_dict()
    new = {"model": {"m": 1}, "train": recipe, "data": {"d": 1}}
    for key in ("trainable", "init_from"):
        if key in recipe:
            old = {**new, "train": {k: v for k, v in recipe.items() if k != key}}
            assert identity_differences(old, new) == []
    assert identity_differences({**new, "train": {**recipe, "lr": 1.0}}, new) == ["train"]


def test_load_model_names_a_device_it_cannot_use(compared):
    from difftransformer.train import load_model

    with pytest.raises(ValueError, match=r"device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        load_model(compared / "diff", "tpu")  # was torch's RuntimeError listing twenty device types

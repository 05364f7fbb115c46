"""Regressions from the second hostile pass (issue 13): each case was a traceback, a silent wrong
result or a loss of data; each is now refused in one line, or handled, and nothing is lost."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from difftransformer.cli import main
from tests.helpers import cli_fails


def _train(workdir, out, *sets):
    argv = ["train", "--config", str(workdir / "tiny.toml"), "--out-dir", str(out)]
    for item in sets:
        argv += ["--set", item]
    return argv


def test_a_study_is_not_continued_with_another_recipe(workdir, compared, capsys):
    cli_fails(capsys, ["compare", "--config", str(workdir / "tiny.toml"), "--out-dir", str(compared),
                    "--set", "train.lr=5e-4"], "trained with another recipe", "lr: 0.001 before, 0.0005 now")


def test_a_run_whose_checkpoints_were_deleted_is_not_overwritten_by_another_config(workdir, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_train(workdir, run, "train.max_steps=4")) == 0
    shutil.rmtree(run / "checkpoints")
    before = (run / "final" / "model.safetensors").read_bytes()
    cli_fails(capsys, _train(workdir, run, "train.max_steps=4", "model.hidden_size=32"), "holds another run",
           "hidden_size: 64 there vs 32 requested", "--no-resume")
    assert (run / "final" / "model.safetensors").read_bytes() == before
    # the same model and recipe is the same run: trained again from the start (a kill before its first
    # checkpoint leaves just this), not refused for the bookkeeping keys of its saved config
    assert main(_train(workdir, run, "train.max_steps=4")) == 0
    assert json.loads((run / "done.json").read_text())["final_step"] == 4


def test_a_checkpoint_is_never_decoded_with_a_tokenizer_it_was_not_trained_with(workdir, tmp_path, capsys):
    data, run = tmp_path / "data", tmp_path / "run"
    assert main(_train(workdir, run, "train.max_steps=4", f'data.data_dir="{data}"')) == 0
    shutil.rmtree(run / "final")
    assert main(["prepare", str(workdir / "corpus"), "--out-dir", str(data), "--vocab-size", "280", "--force"]) == 0
    capsys.readouterr()
    cli_fails(capsys, ["generate", str(run), "the union", "-n", "3"], "no tokenizer found", "--tokenizer")
    other = next(data.glob("tokenizer-280*.json"))
    cli_fails(capsys, ["generate", str(run), "the union", "--tokenizer", str(other)], "is not the tokenizer",
           "was trained with")


def test_a_lock_file_that_is_a_link_is_never_followed(workdir, tmp_path, capsys):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    (tmp_path / "run").mkdir()
    os.symlink(precious, tmp_path / "run" / ".lock")
    cli_fails(capsys, _train(workdir, tmp_path / "run"), "cannot be opened as a lock file")
    assert precious.read_text() == "keep me"


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


@pytest.mark.parametrize("sets, needles", [
    (["train.adam_eps=inf"], ["adam_eps must be a positive number"]),
    (["train.seed=4294967296"], ["seed must be below 2**32"]),
])
def test_more_bad_train_settings(workdir, tmp_path, capsys, sets, needles):
    cli_fails(capsys, _train(workdir, tmp_path / "run", *sets), *needles)
    assert not (tmp_path / "run").exists()


def test_triton_without_cuda_fails_before_anything_is_written(workdir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cli_fails(capsys, _train(workdir, tmp_path / "run", "model.attn_backend=triton"), "runs on CUDA", "'auto'")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra, needle", [
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
    (["--sample-seed", "99999999999999999999"], "--sample-seed must be in"),
])
def test_more_bad_generation_arguments(compared, capsys, extra, needle):
    cli_fails(capsys, ["generate", str(compared / "diff"), "the", *extra], needle)


def test_a_prompt_that_is_not_utf8(compared, capsys):
    cli_fails(capsys, ["generate", str(compared / "diff"), b"\xff\xfe".decode("utf-8", "surrogateescape")],
           "not valid UTF-8")


def test_a_tokenizer_that_is_not_json_while_preparing(workdir, tmp_path, capsys):
    cli_fails(capsys, ["prepare", str(workdir / "corpus"), "--out-dir", str(tmp_path / "d"), "--tokenizer",
                    str(next((workdir / "corpus").iterdir()))], "is not a tokenizer.json file")


def test_config_files_that_are_not_text_or_too_deep(workdir, tmp_path, capsys):
    (tmp_path / "bin.toml").write_bytes(b"[train]\nlr = \xff\n")
    cli_fails(capsys, ["train", "--config", str(tmp_path / "bin.toml")], "is not UTF-8 text")
    (tmp_path / "deep.toml").write_text("[train]\nx = " + "[" * 5000 + "]" * 5000 + "\n")
    cli_fails(capsys, ["train", "--config", str(tmp_path / "deep.toml")], "deep.toml")
    bomb = ["train:", "  a0: &a0 [x]"] + [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    (tmp_path / "bomb.yaml").write_text("\n".join(bomb) + "\n")
    t0 = time.monotonic()
    cli_fails(capsys, ["train", "--config", str(tmp_path / "bomb.yaml")], "unknown key 'a0' in [train]")
    assert time.monotonic() - t0 < 10


def test_report_on_edited_study_files(compared, tmp_path, capsys):
    study = tmp_path / "study"
    shutil.copytree(compared, study)
    (study / "compare.json").write_text('{"format": "difftransformer-compare-v1"}')
    cli_fails(capsys, ["report", str(study), "--no-samples"], "compare.json lacks its list of arms")
    (study / "compare.json").write_text("{not json")
    cli_fails(capsys, ["report", str(study), "--no-samples"], "compare.json is not readable JSON")
    (study / "compare.json").unlink()
    with (study / "diff" / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps({"kind": "train", "step": 9, "loss": 1.0}) + "\n")  # no tokens
        fh.write(json.dumps({"kind": "train", "step": "x", "loss": 1.0}) + "\n")  # no usable step
    assert main(["report", str(study), "--no-samples"]) == 0


def test_an_edited_state_file_is_called_corrupt(workdir, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_train(workdir, run, "train.max_steps=4")) == 0
    from difftransformer.train.checkpoint import _json_digest

    state_path = next((run / "checkpoints").glob("step_*")) / "state.json"
    state = json.loads(state_path.read_text())
    state.pop("files")
    state.pop("state_sha256")
    state["state_sha256"] = _json_digest(state)
    state_path.write_text(json.dumps(state))
    cli_fails(capsys, _train(workdir, run, "train.max_steps=8"), "lacks its list of files")


def test_a_model_config_that_does_not_fit_its_weights_is_one_line(compared, tmp_path, capsys):
    final = tmp_path / "final"
    shutil.copytree(compared / "diff" / "final", final)
    (final / "config.json").write_text("{}")
    cli_fails(capsys, ["generate", str(final), "x"], "do not match the model described by config.json",
              "more)", "edited")

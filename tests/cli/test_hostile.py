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
    """Started again in its own folder, a run ends bitwise equal to the first time: same seed, same
    batches, nothing read from the metrics, lock or config files it finds there.

    The final weights were once compared as whole files and failed now and then: not the weights but
    the header of model.safetensors differed, because safetensors writes its metadata map in the
    order of a randomly seeded Rust HashMap (`safetensors.torch.save(t, metadata={"a": "1", "b": "2",
    "c": "3"})` gives 6 distinct byte strings over 50 calls in one process). Checkpoints and final/
    are now written canonical (_io.canonical_safetensors), so whole files are compared."""
    run = tmp_path / "run"
    assert main(_train(workdir, run, "train.max_steps=4")) == 0
    first_ckpt = tmp_path / "first_checkpoint"
    shutil.copytree(run / "checkpoints" / "step_00000004", first_ckpt)
    shutil.rmtree(run / "checkpoints")
    before = (run / "final" / "model.safetensors").read_bytes()
    cli_fails(capsys, _train(workdir, run, "train.max_steps=4", "model.hidden_size=32"), "holds another run",
           "hidden_size: 64 there vs 32 requested", "--no-resume")
    assert (run / "final" / "model.safetensors").read_bytes() == before
    # the same model and recipe is the same run: trained again from the start (a kill before its first
    # checkpoint leaves just this), not refused for the bookkeeping keys of its saved config
    assert main(_train(workdir, run, "train.max_steps=4")) == 0
    again = run / "checkpoints" / "step_00000004"
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert (again / name).read_bytes() == (first_ckpt / name).read_bytes(), name
    assert (run / "final" / "model.safetensors").read_bytes() == before


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


# ---------------------------------------------------------------- third hostile pass (session 8)


@pytest.mark.parametrize("sets, needle", [
    (["train.lr=inf"], "lr must be a finite number > 0, got inf"),  # was reported as divergence, "lower the lr"
    (["train.lr=1e300"], "lr must be a finite number > 0"),  # was a traceback from the optimizer's float32
    (["train.weight_decay=1e300"], "weight_decay must be a finite number >= 0"),
    (["data.vocab_size=1000000000"], "vocab_size must be at most 1,048,576"),  # the BPE trainer aborted the process
])
def test_numbers_out_of_range(workdir, tmp_path, capsys, sets, needle):
    cli_fails(capsys, _train(workdir, tmp_path / "run", *sets), needle)
    assert not (tmp_path / "run").exists()


def _wrong_kind(run, entry):
    """Put a file where a run keeps a folder, or a folder where it keeps a file."""
    path = run / entry
    if path.is_dir():
        shutil.rmtree(path)
        path.write_text("not a folder")
    else:
        path.unlink()
        path.mkdir()


@pytest.mark.parametrize("entry, needle", [
    ("checkpoints", "checkpoints is not a folder"),  # was found at the first checkpoint, after training
    ("checkpoints/latest", "latest is a folder"),  # idem, at the `latest` pointer
    ("metrics.jsonl", "metrics.jsonl is a folder"),  # was "[Errno 21] Is a directory"
])
def test_a_run_folder_with_an_entry_of_the_wrong_kind_is_refused_before_training(workdir, tmp_path, capsys, entry,
                                                                                    needle):
    run = tmp_path / "run"
    assert main(_train(workdir, run, "train.max_steps=4")) == 0
    _wrong_kind(run, entry)
    before = sorted(p.name for p in run.iterdir())
    cli_fails(capsys, _train(workdir, run, "train.max_steps=8"), needle, "move it away")
    assert sorted(p.name for p in run.iterdir()) == before


def test_out_dirs_that_are_links_to_nothing_or_lie_under_files(workdir, tmp_path, capsys):
    (tmp_path / "dangling").symlink_to(tmp_path / "missing")
    cli_fails(capsys, _train(workdir, tmp_path / "dangling"), "dangling is a symbolic link (to ", "that leads nowhere", "remove it")
    (tmp_path / "file").write_text("x")
    cli_fails(capsys, ["prepare", str(workdir / "corpus"), "--out-dir", str(tmp_path / "file" / "data")],
              "file is a file, not a folder", "choose another path")
    assert not (tmp_path / "missing").exists() and (tmp_path / "file").read_text() == "x"


def test_the_machine_refusing_is_one_line_naming_the_path_and_the_fix():
    """Root writes into read-only folders and a full disk is hard to stage: the message of each refusal
    is checked on the error the operating system raises."""
    import errno

    from difftransformer.cli import os_error_message

    for code, needle in [(errno.ENOSPC, "no space left on the device while writing /r/x; free some space"),
                         (errno.EROFS, "/r/x is on a read-only file system"),
                         (errno.EACCES, "no permission to use /r/x"),
                         (errno.EISDIR, "/r/x is a folder where a file is expected")]:
        assert needle in os_error_message(OSError(code, os.strerror(code), "/r/x"))
    assert os_error_message(OSError("our own words")) == "our own words"


def test_one_folder_holds_one_kind_of_output(workdir, compared, tmp_path, capsys):
    """Training into a prepared-data folder, preparing into a run, comparing into a run or training into a
    study were accepted: the folders mixed, and a later `prepare --force` or --no-resume would replace
    the other's files."""
    run = tmp_path / "run"
    assert main(_train(workdir, run, "train.max_steps=4")) == 0
    before = sorted(p.name for p in run.iterdir())
    data = workdir / "data"
    cli_fails(capsys, _train(workdir, data), f"{data} holds prepared data", "choose another folder")
    cli_fails(capsys, ["prepare", str(workdir / "corpus"), "--out-dir", str(run), "--force"],
              f"{run} holds a training run")
    cli_fails(capsys, ["compare", "--config", str(workdir / "tiny.toml"), "--out-dir", str(run)],
              f"{run} holds a training run")
    cli_fails(capsys, _train(workdir, compared), f"{compared} holds a study")
    assert sorted(p.name for p in run.iterdir()) == before
    assert not (data / "checkpoints").exists() and not (compared / "checkpoints").exists()


def test_a_run_whose_saved_config_is_unreadable_is_not_trained_over(workdir, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_train(workdir, run, "train.max_steps=4")) == 0
    shutil.rmtree(run / "checkpoints")
    (run / "model_config.json").write_text('{"hidden_si')
    before = (run / "final" / "model.safetensors").read_bytes()
    cli_fails(capsys, _train(workdir, run, "train.max_steps=4"), "model_config.json is unreadable", "--no-resume")
    assert (run / "final" / "model.safetensors").read_bytes() == before
    assert main(_train(workdir, run, "train.max_steps=4") + ["--no-resume"]) == 0


def test_a_metrics_log_with_undecodable_or_foreign_rows_still_resumes(workdir, tmp_path):
    run = tmp_path / "run"
    assert main(_train(workdir, run, "train.max_steps=4")) == 0
    with (run / "metrics.jsonl").open("ab") as fh:
        fh.write(b'{"kind": "train", "step": "x", "loss": 1.0}\n\xff\xfe torn {\n')
    assert main(_train(workdir, run, "train.max_steps=6")) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert max(r["step"] for r in rows) == 6 and all(isinstance(r["step"], int) for r in rows)


@pytest.mark.parametrize("argv, needle", [  # the comment says what each was before
    (["train", "--config", "{workdir}"], "is a folder; give the .toml or .yaml file in it"),  # "does not exist"
    (["train", "--config", "/dev/null"], "/dev/null is not a regular file"),  # "does not exist"
    (["prepare", "/dev/zero", "--out-dir", "{tmp}/d"], "is not a regular file or folder"),  # "does not exist"
    (["generate", "{compared}/diff", "x", "--tokenizer", "{workdir}"], "is a folder; give the tokenizer.json"),  # idem
    (["generate", "{tmp}/final", "x"], "holds model.safetensors but no config.json"),  # "no checkpoint at"
    (["eval", "heldout-loss", "{compared}/diff", "--device", "tpu"], "--device must be cpu, cuda"),  # traceback
    (["prepare", "{workdir}/corpus#text_field=body", "--out-dir", "{tmp}/d"], "text_field applies only to"),  # ignored
])
def test_arguments_of_the_wrong_kind(workdir, compared, tmp_path, capsys, argv, needle):
    """Each was accepted without a word, a traceback, or an error that named the wrong cause."""
    (tmp_path / "final").mkdir()
    shutil.copyfile(compared / "diff" / "final" / "model.safetensors", tmp_path / "final" / "model.safetensors")
    cli_fails(capsys, [a.format(workdir=workdir, compared=compared, tmp=tmp_path) for a in argv], needle)


def test_a_config_with_a_byte_order_mark_and_greedy_samples_named(workdir, compared, tmp_path, capsys):
    """A BOM (some Windows editors write one) was a parse error at line 1, column 1; several greedy
    samples were printed identical without a word."""
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf" + (workdir / "tiny.toml").read_bytes())
    assert main(["train", "--config", str(bom), "--out-dir", str(tmp_path / "run"), "--set", "train.max_steps=2"]) == 0
    capsys.readouterr()
    assert main(["generate", str(compared / "diff"), "the", "-n", "2", "--num-samples", "2", "--temperature", "0"]) == 0
    assert "the 2 samples will be identical" in capsys.readouterr().err

"""`train` refuses bad settings, paths and folders before it writes, keeps what a run already holds, and
resumes from what it can read: each refusal is one line naming the value, the rule and the fix."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time

import pytest

from difftransformer.cli import main
from tests.cli.conftest import TINY_TRAIN, _toml, last_error_line, tiny_run_config, train_argv, trained_model
from tests.helpers import cli_fails


def _wrong_kind(run, entry):
    """Put a file where a run keeps a folder, or a folder where it keeps a file."""
    path = run / entry
    if path.is_dir():
        shutil.rmtree(path)
        path.write_text("not a folder")
    else:
        path.unlink()
        path.mkdir()


def _init_config(workdir, tmp_path) -> str:
    """A run config without [model] (the model comes from --init-from), on the workdir's tiny data."""
    data = {"corpus": str(workdir / "corpus"), "vocab_size": 300, "data_dir": str(workdir / "data"),
            "val_fraction": 0.2, "test_fraction": 0.1}
    path = tmp_path / "init.toml"
    path.write_text(_toml({"train": {**TINY_TRAIN, "max_steps": 4, "ckpt_interval": 2}, "data": data}))
    return str(path)


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_run_whose_checkpoints_were_deleted_is_not_overwritten_by_another_config(workdir, tmp_path, capsys):
    """Started again in its own folder, a run ends bitwise equal to the first time: same seed, same batches, nothing
    read from the metrics, lock or config files it finds there.

    Whole files are compared: checkpoints and final/ are written canonical (_io.canonical_safetensors). safetensors
    alone writes its metadata map in the order of a randomly seeded Rust HashMap, so the header of model.safetensors
    can differ between equal weights (`safetensors.torch.save(t, metadata={"a": "1", "b": "2", "c": "3"})` gives 6
    distinct byte strings over 50 calls in one process)."""
    run = tmp_path / "run"
    assert main(train_argv(workdir, run, "train.max_steps=4")) == 0
    first_ckpt = tmp_path / "first_checkpoint"
    shutil.copytree(run / "checkpoints" / "step_00000004", first_ckpt)
    shutil.rmtree(run / "checkpoints")
    before = (run / "final" / "model.safetensors").read_bytes()
    cli_fails(capsys, train_argv(workdir, run, "train.max_steps=4", "model.hidden_size=32"), "holds another run",
           "hidden_size: 64 there vs 32 requested", "--no-resume")
    assert (run / "final" / "model.safetensors").read_bytes() == before
    # the same model and recipe is the same run: trained again from the start (a kill before its first
    # checkpoint leaves just this), not refused for the bookkeeping keys of its saved config
    assert main(train_argv(workdir, run, "train.max_steps=4")) == 0
    again = run / "checkpoints" / "step_00000004"
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert (again / name).read_bytes() == (first_ckpt / name).read_bytes(), name
    assert (run / "final" / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("sets, needles", [
    (["train.adam_eps=inf"], ["adam_eps must be a positive number"]),
    (["train.seed=4294967296"], ["seed must be below 2**32"]),
])
def test_bad_train_settings_leave_nothing_behind(workdir, tmp_path, capsys, sets, needles):
    cli_fails(capsys, train_argv(workdir, tmp_path / "run", *sets), *needles)
    assert not (tmp_path / "run").exists()


def test_triton_without_cuda_fails_before_anything_is_written(workdir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cli_fails(capsys, train_argv(workdir, tmp_path / "run", "model.attn_backend=triton"), "runs on CUDA", "'auto'")
    assert not (tmp_path / "run").exists()


def test_config_files_that_are_not_text_too_deep_or_aliased_are_refused(workdir, tmp_path, capsys):
    (tmp_path / "bin.toml").write_bytes(b"[train]\nlr = \xff\n")
    cli_fails(capsys, ["train", "--config", str(tmp_path / "bin.toml")], "is not UTF-8 text")
    (tmp_path / "deep.toml").write_text("[train]\nx = " + "[" * 5000 + "]" * 5000 + "\n")
    cli_fails(capsys, ["train", "--config", str(tmp_path / "deep.toml")], "deep.toml")
    bomb = ["train:", "  a0: &a0 [x]"] + [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    (tmp_path / "bomb.yaml").write_text("\n".join(bomb) + "\n")
    t0 = time.monotonic()
    cli_fails(capsys, ["train", "--config", str(tmp_path / "bomb.yaml")], "unknown key 'a0' in [train]")
    assert time.monotonic() - t0 < 10


def test_an_edited_state_file_is_called_corrupt(workdir, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(train_argv(workdir, run, "train.max_steps=4")) == 0
    from difftransformer.train.checkpoint import _json_digest

    state_path = next((run / "checkpoints").glob("step_*")) / "state.json"
    state = json.loads(state_path.read_text())
    state.pop("files")
    state.pop("state_sha256")
    state["state_sha256"] = _json_digest(state)
    state_path.write_text(json.dumps(state))
    cli_fails(capsys, train_argv(workdir, run, "train.max_steps=8"), "lacks its list of files")


@pytest.mark.parametrize("sets, needle", [
    (["train.lr=inf"], "lr must be a finite number > 0, got inf"),  # a setting error, not a divergence ("lower the lr")
    (["train.lr=1e300"], "lr must be a finite number > 0"),  # past float32: refused before the optimizer sees it
    (["train.weight_decay=1e300"], "weight_decay must be a finite number >= 0"),
    (["data.vocab_size=1000000000"], "vocab_size must be at most 1,048,576"),  # the BPE trainer would abort the process
])
def test_train_numbers_out_of_range_are_refused(workdir, tmp_path, capsys, sets, needle):
    cli_fails(capsys, train_argv(workdir, tmp_path / "run", *sets), needle)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("entry, needle", [
    ("checkpoints", "checkpoints is not a folder"),  # found before training, not at the first checkpoint
    ("checkpoints/latest", "latest is a folder"),  # idem, at the `latest` pointer
    ("metrics.jsonl", "metrics.jsonl is a folder"),  # named with the fix, not a bare errno
])
def test_a_run_folder_with_an_entry_of_the_wrong_kind_is_refused_before_training(workdir, tmp_path, capsys, entry,
                                                                                    needle):
    run = tmp_path / "run"
    assert main(train_argv(workdir, run, "train.max_steps=4")) == 0
    _wrong_kind(run, entry)
    before = sorted(p.name for p in run.iterdir())
    cli_fails(capsys, train_argv(workdir, run, "train.max_steps=8"), needle, "move it away")
    assert sorted(p.name for p in run.iterdir()) == before


def test_a_run_whose_saved_config_is_unreadable_is_not_trained_over(workdir, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(train_argv(workdir, run, "train.max_steps=4")) == 0
    shutil.rmtree(run / "checkpoints")
    (run / "model_config.json").write_text('{"hidden_si')
    before = (run / "final" / "model.safetensors").read_bytes()
    cli_fails(capsys, train_argv(workdir, run, "train.max_steps=4"), "model_config.json is unreadable", "--no-resume")
    assert (run / "final" / "model.safetensors").read_bytes() == before
    assert main(train_argv(workdir, run, "train.max_steps=4") + ["--no-resume"]) == 0


def test_a_metrics_log_with_undecodable_or_foreign_rows_still_resumes(workdir, tmp_path):
    run = tmp_path / "run"
    assert main(train_argv(workdir, run, "train.max_steps=4")) == 0
    with (run / "metrics.jsonl").open("ab") as fh:
        fh.write(b'{"kind": "train", "step": "x", "loss": 1.0}\n\xff\xfe torn {\n')
    assert main(train_argv(workdir, run, "train.max_steps=6")) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert max(r["step"] for r in rows) == 6 and all(isinstance(r["step"], int) for r in rows)


def test_a_byte_order_mark_is_read_and_identical_greedy_samples_named(workdir, compared, tmp_path, capsys):
    """A config file starting with a BOM (some Windows editors write one) is read, not a parse error at line 1,
    column 1. Several greedy samples are identical, and generate says so."""
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf" + (workdir / "tiny.toml").read_bytes())
    assert main(["train", "--config", str(bom), "--out-dir", str(tmp_path / "run"), "--set", "train.max_steps=2"]) == 0
    capsys.readouterr()
    assert main(["generate", str(compared / "diff"), "the", "-n", "2", "--num-samples", "2", "--temperature", "0"]) == 0
    assert "the 2 samples will be identical" in capsys.readouterr().err


def test_init_from_the_runs_own_final_folder_is_refused_and_kept(compared, workdir, tmp_path, capsys):
    """`train --init-from rf/final --out-dir rf` is refused before training: its final weights would replace
    rf/final, the model it starts from (a retrofit, a conversion). Nothing is written beside rf/final."""
    run = tmp_path / "rf"
    shutil.copytree(compared / "diff" / "final", run / "final")
    before = _sha(run / "final" / "model.safetensors")
    cli_fails(capsys, ["train", "--config", _init_config(workdir, tmp_path), "--init-from", str(run / "final"),
                       "--out-dir", str(run)], "lies in the run's own final/ folder", "choose another --out-dir")
    assert _sha(run / "final" / "model.safetensors") == before
    assert sorted(p.name for p in run.iterdir()) == ["final"]  # nothing written beside it


def test_resuming_an_init_from_run_without_it_names_the_flag(compared, workdir, tmp_path, capsys):
    """Continuing a run started with --init-from, without the flag, names the flag and its folder, not `--no-resume`,
    which would start over."""
    config, out = _init_config(workdir, tmp_path), str(tmp_path / "run")
    source = str(compared / "diff" / "final")
    assert main(["train", "--config", config, "--init-from", source, "--out-dir", out]) == 0
    capsys.readouterr()
    err = cli_fails(capsys, ["train", "--config", config, "--out-dir", out,
                             "--set", "train.max_steps=6"], f"pass --init-from {source}")
    assert "--no-resume" not in err


def test_init_from_given_twice_is_refused(compared, workdir, tmp_path, capsys):
    """--init-from A with --set train.init_from=B is refused: both name the model folder, which is given once.
    Nothing is written."""
    cli_fails(capsys, ["train", "--config", _init_config(workdir, tmp_path),
                       "--init-from", str(compared / "diff" / "final"),
                       "--set", f"train.init_from={json.dumps(str(compared / 'transformer' / 'final'))}",
                       "--out-dir", str(tmp_path / "run")], "both name the model folder", "give it once")
    assert not (tmp_path / "run").exists()


def test_init_from_a_folder_without_a_tokenizer_says_the_data_is_unchecked(compared, workdir, tmp_path, capsys,
                                                                          caplog):
    """A model folder without tokenizer.json trains, and says that the data's tokenizer cannot be checked against it:
    data of any tokenizer of a fitting size would be taken."""
    source = tmp_path / "model"
    shutil.copytree(compared / "diff" / "final", source)
    (source / "tokenizer.json").unlink()
    assert main(["train", "--config", _init_config(workdir, tmp_path), "--init-from", str(source),
                 "--out-dir", str(tmp_path / "run")]) == 0
    said = capsys.readouterr().err + caplog.text  # the CLI's log lines reach pytest's log capture
    assert f"init_from {source} has no tokenizer.json" in said and "cannot be checked" in said, said


def test_running_a_finished_run_again_keeps_its_done_record(workdir, tmp_path, capsys):
    """`train` run again on a finished run (the advice after any interruption) keeps done.json as it is, with the
    run's throughput (and on CUDA its peak memory), and says there is nothing left to train, not a no-op's tokens/s.
    Training further writes a new record."""
    config, out = tiny_run_config(workdir, tmp_path, max_steps=4, ckpt_interval=2), tmp_path / "run"
    assert main(["train", "--config", config, "--out-dir", str(out)]) == 0
    before = json.loads((out / "done.json").read_text())
    assert before["tokens_per_s"] > 0
    capsys.readouterr()
    assert main(["train", "--config", config, "--out-dir", str(out)]) == 0
    assert json.loads((out / "done.json").read_text()) == before
    said = capsys.readouterr().out  # the no-op says so, not "0 train tokens/s"
    assert "nothing left to train" in said and "tokens/s" not in said, said
    # training further writes a new record
    assert main(["train", "--config", config, "--out-dir", str(out), "--set", "train.max_steps=6"]) == 0
    after = json.loads((out / "done.json").read_text())
    assert after["final_step"] == 6 and after["tokens_per_s"] > 0


def test_an_unreadable_manifest_does_not_advise_preparing_the_default_corpus(workdir, tmp_path, capsys):
    config, data = tiny_run_config(workdir, tmp_path, max_steps=4, ckpt_interval=2), tmp_path / "data"
    assert main(["prepare", "--config", config]) == 0
    (data / "prepared.json").write_text("garbage{")
    capsys.readouterr()
    assert main(["train", "--config", config, "--out-dir", str(tmp_path / "run")]) == 2
    err = last_error_line(capsys)
    assert "CORPUS" in err and "default corpus" in err, err


def test_a_lock_file_on_a_read_only_file_system_is_named_as_such(workdir, tmp_path, capsys, monkeypatch):
    """`train --out-dir D` on a read-only file system names the read-only file system, with no advice to remove
    D/.lock: that advice is for a lock that is a link or not a file, not for a file that is fine."""

    from difftransformer import _io

    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if str(path).endswith(_io.LOCK_FILE):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    config, out = tiny_run_config(workdir, tmp_path, max_steps=4, ckpt_interval=2), tmp_path / "run"
    assert main(["train", "--config", config, "--out-dir", str(tmp_path / "warm")]) == 0  # data prepared first
    capsys.readouterr()
    monkeypatch.setattr(_io.os, "open", read_only)
    assert main(["train", "--config", config, "--out-dir", str(out)]) == 2
    line = last_error_line(capsys)
    assert "read-only file system" in line and "remove it" not in line, line


def test_training_into_a_study_is_refused(workdir, tmp_path, capsys):
    """`train --out-dir` inside a study (an arm's folder, a new arm's, a folder below one) is refused naming the
    study and `difftransformer compare`: arms, seeds and cells are compare's, and a run trained there would replace
    an arm's final/ behind the back of compare and report. Outside the study, train runs."""
    config = tiny_run_config(workdir, tmp_path, max_steps=2, eval_interval=2)
    study = tmp_path / "study"
    assert main(["compare", "--config", config, "--out-dir", str(study)]) == 0
    final = study / "diff" / "final" / "model.safetensors"
    before = final.read_bytes()
    capsys.readouterr()
    for inside in (study / "diff", study / "new-arm", study / "diff" / "sub"):
        assert main(["train", "--config", config, "--out-dir", str(inside), "--set", "train.max_steps=3"]) == 2
        line = last_error_line(capsys)
        assert f"inside the study {study.resolve()}" in line and "difftransformer compare" in line, line
    assert final.read_bytes() == before
    assert main(["train", "--config", config, "--out-dir", str(tmp_path / "elsewhere")]) == 0  # outside: fine


def test_an_unreadable_init_from_folder_is_not_blamed_on_the_run_config(workdir, tmp_path, capsys):
    """An unreadable --init-from folder: the message names its config.json without the run config's name in front, as
    if that file were at fault."""
    model = trained_model(workdir, tmp_path, max_steps=2, eval_interval=2)
    (model / "config.json").write_bytes(b"\xff\xfe\x00")
    init = tmp_path / "init.toml"
    init.write_text(_toml({"train": {**TINY_TRAIN, "max_steps": 2}, "data": {"data_dir": str(tmp_path / "data")}}))
    capsys.readouterr()
    assert main(["train", "--config", str(init), "--init-from", str(model), "--out-dir", str(tmp_path / "r2")]) == 2
    line = last_error_line(capsys)
    assert "config.json" in line and f"{init}:" not in line, line

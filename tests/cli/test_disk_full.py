"""A full disk: each command names what it was writing and where to free space, and keeps the files it
would have replaced.

A full disk is staged by making the write itself fail with ENOSPC, as the operating system does: the
start of the file is written, then write() raises an OSError that carries no file name."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import matplotlib.figure
import pytest
import safetensors.torch
from safetensors import SafetensorError

from difftransformer.cli import main, os_error_message
from tests.cli.conftest import last_error_line, tiny_run_config

NO_SPACE = os.strerror(errno.ENOSPC)


def _mount_point(path: Path) -> str:
    path = Path(os.path.realpath(path))
    while not os.path.ismount(path):
        path = path.parent
    return str(path)


def _full_disk_savefig(self, fname, *args, **kwargs):
    """Figure.savefig on a full disk: the file is opened (truncated), its first bytes land, then ENOSPC."""
    with open(fname, "wb") as fh:
        fh.write(b"\x89PNG\r\n\x1a\n")
    raise OSError(errno.ENOSPC, NO_SPACE)


def _full_disk_serialize(*args, **kwargs):
    """safetensors on a full disk: its own error type, the operating system's error only in its text."""
    raise SafetensorError(f"Error while serializing: I/O error: {NO_SPACE} (os error 28)")


@pytest.fixture()
def study(compared, tmp_path) -> Path:
    """A copy of the shared study, free to damage."""
    return Path(shutil.copytree(compared, tmp_path / "study"))


def test_a_failed_plot_write_leaves_the_old_plot_byte_identical(study, monkeypatch, capsys):
    """`report STUDY` on a full disk names the plot it was writing and the file system to free space on. A plot is
    written to a temporary file beside it and renamed: the existing loss_curves.png survives byte for byte, a plot
    that did not exist (lambda.png) is not left as a truncated file, and no temporary file stays."""
    old = study / "loss_curves.png"
    before = old.read_bytes()
    (study / "lambda.png").unlink()  # a plot that did not exist must not appear half-written
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", _full_disk_savefig)
    capsys.readouterr()
    assert main(["report", str(study), "--no-samples"]) == 2
    line = last_error_line(capsys)
    assert old.read_bytes() == before
    assert not (study / "lambda.png").exists()
    assert sorted(p.name for p in study.iterdir() if p.name.endswith((".tmp", ".png"))) == ["loss_curves.png"]
    assert f"no space left on the device while writing {old};" in line, line
    assert f"free some space on the file system mounted at {_mount_point(study)}" in line, line


def test_a_full_disk_without_a_file_name_names_the_output_folder_and_the_fix(study, monkeypatch, capsys):
    """`report` on a full disk: a failed write() raises an OSError without a file name, yet the line names the file
    being written (atomic writes attach it) and the file system to free space on, with no "[Errno" text. The old
    report.md is kept."""
    real_write_text = Path.write_text

    def full(self, *args, **kwargs):
        if self.parent == study:
            raise OSError(errno.ENOSPC, NO_SPACE)
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    report_before = (study / "report.md").read_bytes()
    capsys.readouterr()
    assert main(["report", str(study), "--no-samples"]) == 2
    line = last_error_line(capsys)
    assert f"while writing {study / 'report.md'};" in line, line
    assert "free some space on the file system mounted at" in line, line
    assert "[Errno" not in line
    assert (study / "report.md").read_bytes() == report_before


def test_os_error_message_names_the_commands_output_when_the_error_names_no_file(tmp_path):
    """An OSError(ENOSPC) without a file name (a write() deep in a library) is a line naming the command's output
    folder, the file system to free space on, and the option that chooses another folder, never a bare "[Errno 28] No
    space left on device"; with no output folder on the command line, it still names the option."""
    import argparse

    e = OSError(errno.ENOSPC, NO_SPACE)
    out = tmp_path / "out"
    for command, attr, option in [("convert", "dst", "DST"), ("retrofit", "dst", "OUT_DIR"),
                                  ("compare", "out_dir", "--out-dir"), ("eval", "out_dir", "--out-dir")]:
        line = os_error_message(e, argparse.Namespace(command=command, **{attr: str(out)}))
        assert f"no space left on the device while writing {out};" in line, line
        assert f"free some space on the file system mounted at {_mount_point(tmp_path)}" in line, line
        assert f"or choose another {option}" in line, line
    line = os_error_message(e, argparse.Namespace(command="train", out_dir=None))  # out dir from a config file
    assert line.startswith("no space left on the device;") and "choose another --out-dir" in line, line
    assert "[Errno" not in os_error_message(e)


def test_convert_on_a_full_disk_names_the_destination(compared, tmp_path, monkeypatch, capsys):
    """`convert RUN DST --to diffllama` on a full disk (safetensors' own error, whose text names no path) is one line
    naming DST and the fix: free some space or choose another DST. Neither DST nor its temporary folder is left."""
    monkeypatch.setattr(safetensors.torch, "serialize_file", _full_disk_serialize)
    dst = tmp_path / "hf"
    capsys.readouterr()
    assert main(["convert", str(compared / "diff" / "final"), str(dst), "--to", "diffllama"]) == 2
    line = last_error_line(capsys)
    assert f"no space left on the device while writing {dst};" in line and "or choose another DST" in line, line
    assert not dst.exists() and not any(p.name.startswith(".hf") for p in tmp_path.iterdir())


def test_eval_on_a_full_disk_names_its_out_dir(compared, tmp_path, monkeypatch, capsys):
    """`eval outliers RUN --out-dir OUT` on a full disk names the figure being written and --out-dir. A task's plot
    is drawn into a temporary file that eval/results.py renames, so an earlier plot stays intact and no temporary
    file is left."""
    out = tmp_path / "ev"
    out.mkdir()
    (out / "outliers.png").write_bytes(b"an earlier plot")
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", _full_disk_savefig)
    capsys.readouterr()
    assert main(["eval", "outliers", str(compared / "diff"), "--out-dir", str(out), "--tokens", "64"]) == 2
    line = last_error_line(capsys)
    assert f"no space left on the device while writing {out / 'outliers.png'};" in line, line  # the figure
    assert "or choose another --out-dir" in line, line
    assert (out / "outliers.png").read_bytes() == b"an earlier plot"
    assert [p.name for p in out.iterdir() if p.name != ".lock"] == ["outliers.png"]


def test_train_on_a_full_disk_at_a_checkpoint_names_it_and_keeps_the_last(workdir, tmp_path, monkeypatch, capsys):
    """`train` on a full disk at a checkpoint (safetensors' error names no path and no fix) is one line naming the
    checkpoint, the file system to free space on, and that the run continues from its last checkpoint. The failed
    checkpoint's temporary folder is removed (its space given back), the previous checkpoint stays, and the run
    resumes from it."""
    run = tmp_path / "run"
    config = tiny_run_config(workdir, tmp_path, max_steps=4, eval_interval=2, ckpt_interval=2)
    real = safetensors.torch.serialize_file
    calls = []

    def full_after_the_first_checkpoint(tensors, filename, *args, **kwargs):
        calls.append(filename)
        if len(calls) > 2:  # the first checkpoint (weights, optimizer) fits; the second does not
            _full_disk_serialize()
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "serialize_file", full_after_the_first_checkpoint)
    capsys.readouterr()
    assert main(["train", "--config", config, "--out-dir", str(run)]) == 2
    line = last_error_line(capsys)
    checkpoints = run / "checkpoints"
    assert f"no space left on the device while writing {checkpoints / 'step_00000004'};" in line, line
    assert "continues from its last checkpoint" in line, line
    assert "free some space on the file system mounted at" in line, line
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000002"]
    monkeypatch.setattr(safetensors.torch, "serialize_file", real)
    assert main(["train", "--config", config, "--out-dir", str(run)]) == 0
    assert (run / "final" / "model.safetensors").is_file()


def test_the_lock_file_on_a_full_disk_is_named(workdir, tmp_path, monkeypatch, capsys):
    """`compare` (and `train`) on a full disk fail first at the folder lock's holder line (os.pwrite, an error with
    no file name): the line names the lock file and --out-dir. The data are prepared first, so the first lock
    taken is the study folder's whichever test of the module ran before."""
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, NO_SPACE)

    assert main(["prepare", "--config", str(workdir / "tiny.toml")]) == 0
    monkeypatch.setattr(os, "pwrite", full)
    out = tmp_path / "c"
    capsys.readouterr()
    assert main(["compare", "--config", str(workdir / "tiny.toml"), "--out-dir", str(out)]) == 2
    line = last_error_line(capsys)
    assert f"no space left on the device while writing {out / '.lock'};" in line, line
    assert "or choose another --out-dir" in line, line

"""Output and input paths of every command: symbolic links (dangling, to an empty folder, a loop), entries of
the wrong kind and folders holding another kind of output are refused in one line naming the path and the fix."""

from __future__ import annotations

import os
import shutil

import pytest

from difftransformer.cli import main
from tests.cli.conftest import last_error_line, tiny_run_config, train_argv
from tests.helpers import cli_fails


def test_a_lock_file_that_is_a_link_is_never_followed(workdir, tmp_path, capsys):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    (tmp_path / "run").mkdir()
    os.symlink(precious, tmp_path / "run" / ".lock")
    cli_fails(capsys, train_argv(workdir, tmp_path / "run"), "cannot be opened as a lock file")
    assert precious.read_text() == "keep me"


def test_out_dirs_that_are_dangling_links_or_lie_under_files_are_refused(workdir, tmp_path, capsys):
    (tmp_path / "dangling").symlink_to(tmp_path / "missing")
    cli_fails(capsys, train_argv(workdir, tmp_path / "dangling"), "dangling is a symbolic link (to ",
              "that leads nowhere", "remove it")
    (tmp_path / "file").write_text("x")
    cli_fails(capsys, ["prepare", str(workdir / "corpus"), "--out-dir", str(tmp_path / "file" / "data")],
              "file is a file, not a folder", "choose another path")
    assert not (tmp_path / "missing").exists() and (tmp_path / "file").read_text() == "x"


def test_one_folder_holds_one_kind_of_output(workdir, compared, tmp_path, capsys):
    """Training into a prepared-data folder, preparing into a run, comparing into a run or training into a
    study were accepted: the folders mixed, and a later `prepare --force` or --no-resume would replace
    the other's files."""
    run = tmp_path / "run"
    assert main(train_argv(workdir, run, "train.max_steps=4")) == 0
    before = sorted(p.name for p in run.iterdir())
    data = workdir / "data"
    cli_fails(capsys, train_argv(workdir, data), f"{data} holds prepared data", "choose another folder")
    cli_fails(capsys, ["prepare", str(workdir / "corpus"), "--out-dir", str(run), "--force"],
              f"{run} holds a training run")
    cli_fails(capsys, ["compare", "--config", str(workdir / "tiny.toml"), "--out-dir", str(run)],
              f"{run} holds a training run")
    cli_fails(capsys, train_argv(workdir, compared), f"{compared} holds a study")
    assert sorted(p.name for p in run.iterdir()) == before
    assert not (data / "checkpoints").exists() and not (compared / "checkpoints").exists()


@pytest.mark.parametrize("argv, needle", [  # the comment says what each was before
    (["train", "--config", "{workdir}"], "is a folder; give the .toml or .yaml file in it"),  # "does not exist"
    (["train", "--config", "/dev/null"], "/dev/null is not a regular file"),  # "does not exist"
    (["prepare", "/dev/zero", "--out-dir", "{tmp}/d"], "is not a regular file or folder"),  # "does not exist"
    (["generate", "{compared}/diff", "x", "--tokenizer", "{workdir}"], "is a folder; give the tokenizer.json"),  # idem
    (["generate", "{tmp}/final", "x"], "holds model.safetensors but no config.json"),  # "no checkpoint at"
    (["eval", "heldout-loss", "{compared}/diff", "--device", "tpu"], "--device must be cpu, cuda"),  # traceback
    (["prepare", "{workdir}/corpus#text_field=body", "--out-dir", "{tmp}/d"], "text_field applies only to"),  # ignored
])
def test_paths_of_the_wrong_kind_are_named(workdir, compared, tmp_path, capsys, argv, needle):
    """Each was accepted without a word, a traceback, or an error that named the wrong cause."""
    (tmp_path / "final").mkdir()
    shutil.copyfile(compared / "diff" / "final" / "model.safetensors", tmp_path / "final" / "model.safetensors")
    cli_fails(capsys, [a.format(workdir=workdir, compared=compared, tmp=tmp_path) for a in argv], needle)


def test_train_out_dir_a_symlink_loop_is_one_line(workdir, tmp_path, links, capsys):
    """`train --out-dir LOOP`: an OSError/RuntimeError traceback from refuse_inside_study (Path.resolve);
    eval, prepare and compare refused the same path in one line."""
    config = tiny_run_config(workdir, tmp_path, max_steps=2, eval_interval=2)
    assert main(["train", "--config", config, "--out-dir", str(links / "loopA")]) == 2
    line = last_error_line(capsys)
    assert str(links / "loopA") in line and "not a folder" in line, line


def test_train_data_dir_a_symlink_loop_names_it(workdir, tmp_path, links, capsys):
    """`train --set data.data_dir=LOOP`: 'LOOP/prepare-failed.txt: Too many levels of symbolic links'
    (a file the user never named, no fix); now the message `prepare --out-dir LOOP` gives."""
    config = tiny_run_config(workdir, tmp_path, max_steps=2, eval_interval=2)
    assert main(["train", "--config", config, "--out-dir", str(tmp_path / "run"),
                 "--set", f"data.data_dir=\"{links / 'loopA'}\""]) == 2
    line = last_error_line(capsys)
    assert "prepare-failed" not in line and f"{links / 'loopA'} is a symbolic link (to " in line, line
    assert "that is a loop" in line and "choose another" in line, line


def test_a_corpus_spec_that_is_a_symlink_loop_is_compared_without_raising(workdir, links):
    """With data already prepared, `data.corpus=LOOP` was compared to the recorded corpus with
    Path.resolve, a RuntimeError traceback on a loop; now it is just another corpus (a one-line mismatch)."""
    from difftransformer.data.prepare import _same_corpus

    assert not _same_corpus(str(workdir / "corpus"), str(links / "loopA"))
    assert _same_corpus(str(workdir / "corpus"), f"{workdir}/./corpus")

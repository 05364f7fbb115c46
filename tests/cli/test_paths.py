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
    """A folder holds one kind of output: training into a prepared-data folder, preparing into a run, comparing into
    a run and training into a study are refused, naming what the folder holds, and nothing in it changes. Mixed
    folders would let a later `prepare --force` or --no-resume replace the other's files."""
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


@pytest.mark.parametrize("argv, needle", [  # a comment says what is wrong with the argument
    (["train", "--config", "{workdir}"], "is a folder; give the .toml or .yaml file in it"),  # folder
    (["train", "--config", "/dev/null"], "/dev/null is not a regular file"),  # device
    (["prepare", "/dev/zero", "--out-dir", "{tmp}/d"], "is not a regular file or folder"),  # device
    (["generate", "{compared}/diff", "x", "--tokenizer", "{workdir}"], "is a folder; give the tokenizer.json"),
    (["generate", "{tmp}/final", "x"], "holds model.safetensors but no config.json"),  # weights alone
    (["eval", "heldout-loss", "{compared}/diff", "--device", "tpu"], "--device must be cpu, cuda"),  # no such device
    (["prepare", "{workdir}/corpus#text_field=body", "--out-dir", "{tmp}/d"], "text_field applies only to"),  # not read
])
def test_paths_of_the_wrong_kind_are_named(workdir, compared, tmp_path, capsys, argv, needle):
    """Each path or value of the wrong kind is one line naming what is wrong with it, never accepted without a word,
    a traceback, or an error that names another cause."""
    (tmp_path / "final").mkdir()
    shutil.copyfile(compared / "diff" / "final" / "model.safetensors", tmp_path / "final" / "model.safetensors")
    cli_fails(capsys, [a.format(workdir=workdir, compared=compared, tmp=tmp_path) for a in argv], needle)


def test_train_out_dir_a_symlink_loop_is_one_line(workdir, tmp_path, links, capsys):
    """`train --out-dir LOOP` is one line naming LOOP as not a folder, as eval, prepare and compare refuse the same
    path, not a traceback from Path.resolve."""
    config = tiny_run_config(workdir, tmp_path, max_steps=2, eval_interval=2)
    assert main(["train", "--config", config, "--out-dir", str(links / "loopA")]) == 2
    line = last_error_line(capsys)
    assert str(links / "loopA") in line and "not a folder" in line, line


def test_train_data_dir_a_symlink_loop_names_it(workdir, tmp_path, links, capsys):
    """`train --set data.data_dir=LOOP` gives the message `prepare --out-dir LOOP` gives: LOOP is a symbolic link
    that is a loop, and the fix; no file inside it that the user never named (prepare-failed.txt)."""
    config = tiny_run_config(workdir, tmp_path, max_steps=2, eval_interval=2)
    assert main(["train", "--config", config, "--out-dir", str(tmp_path / "run"),
                 "--set", f"data.data_dir=\"{links / 'loopA'}\""]) == 2
    line = last_error_line(capsys)
    assert "prepare-failed" not in line and f"{links / 'loopA'} is a symbolic link (to " in line, line
    assert "that is a loop" in line and "choose another" in line, line


def test_a_corpus_spec_that_is_a_symlink_loop_is_compared_without_raising(workdir, links):
    """With data already prepared, `data.corpus=LOOP` is compared to the recorded corpus without raising
    (Path.resolve raises on a loop): it is just another corpus, a one-line mismatch. Two spellings of one path are
    the same corpus."""
    from difftransformer.data.prepare import _same_corpus

    assert not _same_corpus(str(workdir / "corpus"), str(links / "loopA"))
    assert _same_corpus(str(workdir / "corpus"), f"{workdir}/./corpus")

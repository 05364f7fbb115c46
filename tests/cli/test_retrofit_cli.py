"""`retrofit`: flags out of range, damaged source tokenizers, a calibration folder and a symbolic-link
destination are refused in one line before anything is written."""

from __future__ import annotations

import shutil

import pytest

from tests.cli.conftest import no_work_left
from tests.helpers import cli_fails


def _damaged(llama, tmp_path, content: bytes):
    folder = tmp_path / "llama"
    shutil.copytree(llama[0], folder)
    (folder / "tokenizer.json").write_bytes(content)
    return folder


@pytest.mark.parametrize("flags, needles", [
    (["--check", "-1"], ["--check must be >= 0", "got -1"]),  # refused before torch runs or OUT is written
    (["--check", "100000"], ["--check 100000 is longer than the model's context", "--check <= 128"]),
    (["--calibrate-tokens", "0"], ["--calibrate-tokens must be a positive number", "got 0"]),
    (["--calibrate-tokens", "100"], ["--calibrate-tokens 100 is less than one calibration window of 128",
                                     "--calibrate-tokens >= 128"]),  # the rule is one window, whatever the file holds
])
def test_retrofit_flags_out_of_range_are_refused(llama, tmp_path, capsys, flags, needles):
    folder, text = llama
    if flags[0] == "--calibrate-tokens":
        flags = [*flags, "--calibrate", str(text)]
    cli_fails(capsys, ["retrofit", str(folder), str(tmp_path / "out"), *flags], *needles)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["dangling", "to_empty", "loopA"])
def test_retrofit_into_a_symlink_is_refused_up_front(llama, links, capsys, name):
    """`retrofit LLAMA DST` with DST a dangling symlink, a symlink to an empty folder or a symlink loop is refused up
    front, in one line naming DST, and leaves nothing behind."""
    folder, _ = llama
    cli_fails(capsys, ["retrofit", str(folder), str(links / name)], f"DST {links / name}", "is a symbolic link")
    no_work_left(links)


@pytest.mark.parametrize("content, calibrate, needle", [
    (b'{"not":"a tokenizer"}\n', True, "line 1 column"),  # with --calibrate: one line, no traceback
    (b'{"not":"a tokenizer"}\n', False, "line 1 column"),  # without it: refused, not copied into OUT
    (b"\xff\xfe\x00\x81", False, "not UTF-8"),  # the line names the file
])
def test_a_damaged_source_tokenizer_is_refused_by_name(llama, tmp_path, capsys, content, calibrate, needle):
    """LLAMA/tokenizer.json that is not a tokenizer (or not UTF-8) is refused by name before anything is written,
    with or without --calibrate: copied into OUT, it would surface only at a later `train --init-from OUT`."""
    folder = _damaged(llama, tmp_path, content)
    flags = ["--calibrate", str(llama[1]), "--calibrate-tokens", "256"] if calibrate else []
    cli_fails(capsys, ["retrofit", str(folder), str(tmp_path / "out"), *flags],
              f"{folder / 'tokenizer.json'} is not a tokenizer.json file", needle)
    assert not (tmp_path / "out").exists()


def test_calibrate_given_a_folder_says_so(llama, tmp_path, capsys):
    """`retrofit LLAMA OUT --calibrate CORPUS_DIR` says the path is a folder and that --calibrate takes one text
    file."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "doc.txt").write_text(llama[1].read_text())
    cli_fails(capsys, ["retrofit", str(llama[0]), str(tmp_path / "out"), "--calibrate", str(corpus)],
              f"--calibrate {corpus} is a folder", "one text file")
    assert not (tmp_path / "out").exists()

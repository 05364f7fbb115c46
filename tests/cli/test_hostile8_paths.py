"""Regressions from the eighth hostile pass (issue 13, docs/hostile-pass.md) on odd paths and damaged inputs:
a destination that is a symbolic link (dangling, to an empty folder, a loop), a corpus file whose name is not
UTF-8, a Llama folder with a damaged tokenizer.json, a judge that raises and lm-eval on a folder without a
tokenizer. Each was a traceback, an error naming no path, or a damaged file copied silently; each is now one
line naming the path, the rule and the fix, refused before any work, or handled."""

from __future__ import annotations

import os
import sys

import pytest

from difftransformer.cli import main
from tests.cli.conftest import last_error_line, tiny_run_config
from tests.helpers import cli_fails


@pytest.fixture
def links(tmp_path):
    """tmp_path/links with `dangling` (to a missing path), `to_empty` (to an empty folder) and `loopA`/`loopB`
    (each to the other)."""
    root = tmp_path / "links"
    (root / "empty").mkdir(parents=True)
    (root / "dangling").symlink_to(root / "missing")
    (root / "to_empty").symlink_to(root / "empty")
    (root / "loopA").symlink_to(root / "loopB")
    (root / "loopB").symlink_to(root / "loopA")
    return root


def _no_work_left(root) -> None:
    """Nothing was written beside the links (no `.DST.converting-PID`), and the empty target stayed empty."""
    assert sorted(p.name for p in root.iterdir()) == ["dangling", "empty", "loopA", "loopB", "to_empty"]
    assert not any((root / "empty").iterdir())


# ---------------------------------------------------------------- convert / retrofit into a symlink


@pytest.mark.parametrize("name, needles", [
    ("dangling", ["is a symbolic link", "does not exist"]),  # V13: "…/.dangling.converting-PID: Not a directory"
    ("to_empty", ["is a symbolic link", "empty"]),  # V14: "…/to_empty: Not a directory" after the conversion ran
    ("loopA", ["is a symbolic link", "loop"]),  # V15: RuntimeError: Symlink loop (Path.resolve)
])
def test_convert_into_a_symlink_is_refused_up_front(compared, links, capsys, name, needles):
    """V13, V14, V15: `convert RUN DST --to diffllama` with DST a dangling symlink, a symlink to an empty folder,
    or a symlink loop: a late 'Not a directory' naming a temporary folder, or a RuntimeError traceback."""
    dst = links / name
    line = cli_fails(capsys, ["convert", str(compared / "diff" / "final"), str(dst), "--to", "diffllama"],
                     f"DST {dst}", *needles)
    assert "converted" not in line
    _no_work_left(links)


def test_convert_under_a_looping_folder_is_refused_up_front(compared, links, capsys):
    """V15 (a variant): DST inside a symlink loop (LOOP/out): Path.resolve raised RuntimeError."""
    cli_fails(capsys, ["convert", str(compared / "diff" / "final"), str(links / "loopA" / "out"), "--to", "llama"],
              str(links / "loopA"), "loop")
    _no_work_left(links)


@pytest.mark.parametrize("name", ["dangling", "to_empty", "loopA"])
def test_retrofit_into_a_symlink_is_refused_up_front(llama, links, capsys, name):
    """Y04 (and V13/V14 for retrofit): `retrofit LLAMA LOOP` was a RuntimeError traceback (Path.resolve)."""
    folder, _ = llama
    cli_fails(capsys, ["retrofit", str(folder), str(links / name)], f"DST {links / name}", "is a symbolic link")
    _no_work_left(links)


# ---------------------------------------------------------------- train into a symlink loop


def test_train_out_dir_a_symlink_loop_is_one_line(workdir, tmp_path, links, capsys):
    """Y01: `train --out-dir LOOP`: an OSError/RuntimeError traceback from refuse_inside_study (Path.resolve);
    eval, prepare and compare refused the same path in one line."""
    config = tiny_run_config(workdir, tmp_path, max_steps=2, eval_interval=2)
    assert main(["train", "--config", config, "--out-dir", str(links / "loopA")]) == 2
    line = last_error_line(capsys)
    assert str(links / "loopA") in line and "not a folder" in line, line


def test_train_data_dir_a_symlink_loop_names_it(workdir, tmp_path, links, capsys):
    """Y11: `train --set data.data_dir=LOOP`: 'LOOP/prepare-failed.txt: Too many levels of symbolic links'
    (a file the user never named, no fix); now the message `prepare --out-dir LOOP` gives."""
    config = tiny_run_config(workdir, tmp_path, max_steps=2, eval_interval=2)
    assert main(["train", "--config", config, "--out-dir", str(tmp_path / "run"),
                 "--set", f"data.data_dir=\"{links / 'loopA'}\""]) == 2
    line = last_error_line(capsys)
    assert "prepare-failed" not in line and f"{links / 'loopA'} is a symbolic link (to " in line, line
    assert "that is a loop" in line and "choose another" in line, line


# ---------------------------------------------------------------- a corpus file whose name is not UTF-8


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS file systems refuse names that are not UTF-8")
def test_a_corpus_file_name_that_is_not_utf8_is_read(workdir, tmp_path, capsys):
    """FL03: `prepare CORPUS_DIR` with a file named b'n\\xe9\\xff.txt': "'utf-8' codec can't encode characters
    in position 1-2: surrogates not allowed" (no file named). The file is a document like the others; its id
    writes the bytes that are not UTF-8 as \\xNN."""
    from difftransformer.data import load_corpus

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in sorted((workdir / "corpus").iterdir())[:6]:
        (corpus / f.name).write_bytes(f.read_bytes())
    with open(os.path.join(os.fsencode(corpus), b"n\xe9\xff.txt"), "wb") as fh:
        fh.write(b"the union and the people of the nation.\n" * 50)
    assert main(["prepare", str(corpus), "--vocab-size", "300", "--val-fraction", "0.2", "--test-fraction", "0.2",
                 "--out-dir", str(tmp_path / "data")]) == 0, capsys.readouterr().err
    assert "n\\xe9\\xff.txt" in {d.id for d in load_corpus(str(corpus))}


# ---------------------------------------------------------------- retrofit: a damaged tokenizer.json


def _damaged(llama, tmp_path, content: bytes):
    import shutil

    folder = tmp_path / "llama"
    shutil.copytree(llama[0], folder)
    (folder / "tokenizer.json").write_bytes(content)
    return folder


@pytest.mark.parametrize("content, calibrate, needle", [
    (b'{"not":"a tokenizer"}\n', True, "line 1 column"),  # RF05: tokenizers' bare Exception, a traceback
    (b'{"not":"a tokenizer"}\n', False, "line 1 column"),  # RF22: copied into OUT silently
    (b"\xff\xfe\x00\x81", False, "not UTF-8"),  # RF21: "'utf-8' codec can't decode byte 0xff" (no file)
])
def test_a_damaged_source_tokenizer_is_refused_by_name(llama, tmp_path, capsys, content, calibrate, needle):
    """RF05, RF21, RF22: LLAMA/tokenizer.json that is not a tokenizer (or not UTF-8) was a bare tokenizers
    Exception with --calibrate, a codec error naming no file, or copied into OUT, where only a later
    `train --init-from OUT` found it."""
    folder = _damaged(llama, tmp_path, content)
    flags = ["--calibrate", str(llama[1]), "--calibrate-tokens", "256"] if calibrate else []
    cli_fails(capsys, ["retrofit", str(folder), str(tmp_path / "out"), *flags],
              f"{folder / 'tokenizer.json'} is not a tokenizer.json file", needle)
    assert not (tmp_path / "out").exists()


def test_calibrate_given_a_folder_says_so(llama, tmp_path, capsys):
    """RF20: `retrofit LLAMA OUT --calibrate CORPUS_DIR` said "no such text file" of a folder that exists."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "doc.txt").write_text(llama[1].read_text())
    cli_fails(capsys, ["retrofit", str(llama[0]), str(tmp_path / "out"), "--calibrate", str(corpus)],
              f"--calibrate {corpus} is a folder", "one text file")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- eval: a judge that raises


def test_a_judge_that_raises_is_one_line_naming_it(compared, tmp_path, capsys):
    """E25: `eval hallucination RUN --judge python:os:getcwd` (a function that does not take the records) was a
    TypeError traceback, while every other bad judge is one line."""
    assert main(["eval", "hallucination", str(compared / "diff"), "--samples", "1", "--subtasks", "qa",
                 "--judge", "python:os:getcwd", "--out-dir", str(tmp_path / "ev")]) == 2
    line = last_error_line(capsys)  # after the task's own progress line
    assert "judge python:os:getcwd raised TypeError" in line and "takes no arguments" in line, line
    assert "fn(records)" in line, line


# ---------------------------------------------------------------- lm-eval on a folder without tokenizer.json


def test_lm_eval_on_a_folder_without_tokenizer_is_one_line(compared, tmp_path, monkeypatch, capsys):
    """LM02: `python -m difftransformer.hf.lm_eval run --model hf --model_args pretrained=DIR` with DIR a folder
    without tokenizer.json: a 40-line traceback through lm-eval before our own message."""
    pytest.importorskip("lm_eval")
    from difftransformer.hf.lm_eval import main as lm_eval_main

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((compared / "diff" / "final" / name).read_bytes())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("DIFFTRANSFORMER_DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", [sys.argv[0]])  # main() sets sys.argv for lm-eval's CLI
    with pytest.raises(SystemExit) as exit_:
        lm_eval_main(["run", "--model", "hf", "--model_args", f"pretrained={bare},backend=causal", "--tasks",
                      "arc_easy", "--device", "cpu", "--output_path", str(tmp_path / "out")])
    assert exit_.value.code == 2
    line = last_error_line(capsys)
    assert f"{bare} has no tokenizer.json" in line and "Copy that file" in line, line


def test_a_corpus_spec_that_is_a_symlink_loop_is_compared_without_raising(workdir, links):
    """Y11 (a variant): with data already prepared, `data.corpus=LOOP` was compared to the recorded corpus with
    Path.resolve, a RuntimeError traceback on a loop; now it is just another corpus (a one-line mismatch)."""
    from difftransformer.data.prepare import _same_corpus

    assert not _same_corpus(str(workdir / "corpus"), str(links / "loopA"))
    assert _same_corpus(str(workdir / "corpus"), f"{workdir}/./corpus")

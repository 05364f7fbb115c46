"""`prepare`: bad tokenizers, output folders and mixture fractions are refused in one line; odd corpus file
names are read."""

from __future__ import annotations

import os
import re
import sys

import pytest

from difftransformer.cli import main
from tests.cli.conftest import last_error_line
from tests.helpers import cli_fails


def test_a_tokenizer_that_is_not_json_is_refused(workdir, tmp_path, capsys):
    cli_fails(capsys, ["prepare", str(workdir / "corpus"), "--out-dir", str(tmp_path / "d"), "--tokenizer",
                    str(next((workdir / "corpus").iterdir()))], "is not a tokenizer.json file")


def test_an_empty_prepare_out_dir_is_not_the_default(workdir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli_fails(capsys, ["prepare", str(workdir / "corpus"), "--out-dir", "", "--vocab-size", "300"],
              "--out-dir is empty")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS file systems refuse names that are not UTF-8")
def test_a_corpus_file_name_that_is_not_utf8_is_read(workdir, tmp_path, capsys):
    """`prepare CORPUS_DIR` with a file named b'n\\xe9\\xff.txt' (bytes that are not UTF-8) reads it as a document
    like the others; its id writes those bytes as \\xNN."""
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


def test_a_mixture_fraction_under_half_a_document_is_refused(workdir, tmp_path, capsys):
    """A mixture fraction under half a document (needle 0.1 of a few thousand tokens, with length 100000) would make
    no needle document: it is refused, naming the fraction's tokens, the document length and the fix."""
    assert main(["prepare", str(workdir / "corpus"), "--out-dir", str(tmp_path / "data"), "--vocab-size", "300",
                 "--set", "data.mixture.needle=0.1", "--set", "data.mixture.length=100000"]) == 2
    line = last_error_line(capsys)
    assert re.search(r"data\.mixture\.needle = 0\.1 is [\d,]+ tokens, less than half of one 100,000-token "
                     r"document", line) and "lower data.mixture.length" in line, line

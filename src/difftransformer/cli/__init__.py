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
import errno
import logging
import os
import sys
from pathlib import Path

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


def _file_in_path(path: Path) -> Path | None:
    """The first part of `path` that exists and is not a folder (what makes 'Not a directory')."""
    for part in reversed([path, *path.parents]):
        if part.exists() and not part.is_dir():
            return part
    return None


def os_error_message(e: OSError) -> str:
    """The machine refusing, as one line that names the path and what to do: Python's own text
    ("[Errno 17] File exists: 'runs/x'") names neither the cause nor the fix."""
    if e.filename is None:
        return str(e)  # raised by the package with its own message
    path = Path(os.fsdecode(e.filename2 if e.filename2 is not None and e.errno == errno.EISDIR else e.filename))
    if e.errno == errno.EEXIST and not path.is_dir():
        what = "a link to a missing path" if path.is_symlink() and not path.exists() else "a file"
        return f"{path} is {what}, not a folder; remove it or choose another path"
    if e.errno == errno.ENOTDIR:
        blocker = _file_in_path(path)
        if blocker is not None:
            return f"{blocker} is a file, not a folder, so {path} cannot be used; choose another path"
    if e.errno == errno.EISDIR:
        return f"{path} is a folder where a file is expected; move it away or choose another path"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"no permission to use {path}; choose a folder you can write, or change its permissions"
    if e.errno == errno.EROFS:
        return f"{path} is on a read-only file system; choose a folder on a writable one"
    if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return (f"no space left on the device while writing {path}; free some space and run the same command "
                f"again (a training run continues from its last checkpoint, which is intact)")
    if e.errno == errno.ENOENT:
        return f"{path}: no such file or folder; check the path"
    return f"{path}: {e.strerror or e}"


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
        message = os_error_message(e) if isinstance(e, OSError) else str(e)
        print(f"difftransformer {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted; re-run the same command to continue from the last checkpoint", file=sys.stderr)
        return 130


__all__ = ["COMMANDS", "SECTIONS", "build_parser", "main", "os_error_message"]

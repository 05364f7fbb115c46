"""The `difftransformer` command: prepare data, train one model, compare arms side by side, generate, report,
evaluate, convert.

    difftransformer compare --config configs/demo.toml --out-dir runs/demo
    python -m difftransformer train --preset cpu-small --attention diff --set train.max_steps=500

One module per subcommand, each declaring HELP, DESCRIPTION and EXAMPLES and defining
add_arguments(parser) and run(args). Every subcommand has --help with examples. Works unchanged
under `torchrun` (train, compare). A user mistake is one line on stderr and exit code 2. Ctrl-C
(exit 130) and SIGTERM (exit 143) stop a command through its cleanup: nothing half-written is left,
and the same command continues (train, compare) or starts over.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from safetensors import SafetensorError

from difftransformer import dist
from difftransformer._config import debugging
from difftransformer._io import FolderInUseError, broken_link, os_error_of
from difftransformer._version import __version__
from difftransformer.cli import compare, convert, generate, prepare, report, retrofit, train
from difftransformer.cli import eval as eval_cmd
from difftransformer.cli.common import Formatter, epilog
from difftransformer.data import CorpusError
from difftransformer.numerics import denormals_flushed
from difftransformer.run_config import SECTIONS, ConfigError
from difftransformer.train import CheckpointError, TrainingDivergedError

RESUMABLE = ("train", "compare")  # commands that continue from their last checkpoint when run again
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


def _shown(path: Path) -> Path:
    """`path` as the user can find it: a relative one (a default such as cache/data/...) is only
    meaningful beside the folder it was resolved in, so it is shown absolute."""
    if path.is_absolute():
        return path
    try:
        return Path.cwd() / path
    except OSError:  # the current folder was deleted
        return path


# What each command writes into, for errors that name no file (a write() deep in a library on a full
# disk): the argument holding it and how the user names it on the command line.
OUTPUTS = {"prepare": ("out_dir", "--out-dir"), "train": ("out_dir", "--out-dir"), "compare": ("out_dir", "--out-dir"),
           "eval": ("out_dir", "--out-dir"), "convert": ("dst", "DST"), "retrofit": ("dst", "OUT_DIR"),
           "report": ("dir", None)}
NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def _mount_point(path: Path) -> Path:
    """The mount point of the file system that holds `path` (or would: its nearest existing parent)."""
    path = Path(os.path.realpath(path))
    while not path.exists() or not os.path.ismount(path):
        if path.parent == path:
            break
        path = path.parent
    return path


def _no_space_message(path: Path | None, args: argparse.Namespace | None) -> str:
    """A full disk (or quota): what was being written, the file system to free space on, how to write
    elsewhere, and for a resumable command that its last checkpoint is intact. `path`: the file being
    written, or None, when the command's output folder (OUTPUTS) stands in for it."""
    command = getattr(args, "command", None)
    attr, option = OUTPUTS.get(command, (None, None))
    if path is None and attr is not None and getattr(args, attr, None) is not None:
        path = _shown(Path(getattr(args, attr)))
    if path is None:
        what, fix = "", "free some space"
    else:
        what, fix = f" while writing {path}", f"free some space on the file system mounted at {_mount_point(path)}"
    fix += " and run the same command again" + (f", or choose another {option}" if option else "")
    if command in RESUMABLE or command is None:
        fix += " (a training run continues from its last checkpoint, which is intact)"
    return f"no space left on the device{what}; {fix}"


def os_error_message(e: OSError, args: argparse.Namespace | None = None) -> str:
    """The machine refusing, as one line that names the path and what to do: Python's own text
    ("[Errno 17] File exists: 'runs/x'") names neither the cause nor the fix. args: the command line,
    whose output folder names what was written when the error names no file (a full disk)."""
    if e.filename is None:
        if e.errno in NO_SPACE:
            return _no_space_message(None, args)
        return str(e)  # raised by the package with its own message
    path = _shown(Path(os.fsdecode(e.filename2 if e.filename2 is not None and e.errno == errno.EISDIR else e.filename)))
    if e.errno == errno.EEXIST and not path.is_dir():
        what = ("a file" if not path.is_symlink() or path.exists() else
                f"a symbolic link (to {os.readlink(path)}) that "
                f"{'is a loop' if broken_link(path) == 'loop' else 'leads nowhere'}")
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
    if e.errno in NO_SPACE:
        return _no_space_message(path, args)
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
    parser.add_argument("--version", action="version", version=f"difftransformer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parser.commands = {}  # name -> the command's own parser (see _parse)
    for name, module in COMMANDS.items():
        parser.commands[name] = sub.add_parser(name, formatter_class=Formatter, help=module.HELP,
                                               description=module.DESCRIPTION, epilog=epilog(module.EXAMPLES))
        module.add_arguments(parser.commands[name])
    return parser


# Commands whose optional positional may come after their options: `generate RUN --prompt a b` left "b"
# over ("unrecognized arguments: b"), as argparse gives the positional its empty
# value before it reaches the options; these commands' own arguments are parsed again intermixed, so the
# command sees both prompts and says which rule they break. (`eval` cannot be: it has subcommands.)
INTERMIXED = ("generate",)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command in INTERMIXED:
        own = argv[argv.index(args.command) + 1:]
        return parser.commands[args.command].parse_intermixed_args(own, argparse.Namespace(command=args.command))
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, `kill`, a closed session) turned into an exception, so that cleanup runs as
    for Ctrl-C: temporary files and folders (a half-written conversion, a result being saved) are
    removed by their `finally` blocks instead of being left behind by an abrupt exit."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def _sigterm_as_exception():
    """SIGTERM raises Terminated while a command runs (main thread only, and only where nobody else has
    installed a handler); the previous handler is restored after, so callers embedding main() keep theirs."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _interrupted(command: str, e: KeyboardInterrupt) -> int:
    again = ("run the same command again to continue from the last checkpoint" if command in RESUMABLE else
             "nothing half-written was kept; run the same command again")
    what = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
    print(f"\n{what}; {again}", file=sys.stderr)
    return 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    # First, before torch starts its threads, so that they inherit it (difftransformer.numerics).
    with denormals_flushed():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO if dist.is_main() else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        with _sigterm_as_exception():
            return COMMANDS[args.command].run(args)
    except USER_ERRORS as e:
        if debugging():
            raise
        if isinstance(e, SafetensorError):  # its I/O failures carry the system's error only in their text
            e = os_error_of(e) or e
        message = os_error_message(e, args) if isinstance(e, OSError) else str(e)
        print(f"difftransformer {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        return _interrupted(args.command, e)


__all__ = ["COMMANDS", "SECTIONS", "build_parser", "main", "os_error_message"]

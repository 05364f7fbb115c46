"""Atomic file writes: readers (and a crash at any moment) see the old content or the new, never a torn file."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename durable; directories cannot be opened on Windows, where this is a no-op."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _new_tmp(path: Path) -> Path:
    """A fresh file beside `path` (same filesystem, so os.replace is atomic), unique so that concurrent
    writers never share one, and created with the umask's permissions (mkstemp would force 0600)."""
    while True:
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


@contextlib.contextmanager
def atomic_path(path: str | Path, *, fsync: bool = False) -> Iterator[Path]:
    """Yield a temp path to write; on success it replaces `path`, on failure it is removed.

    fsync=True also flushes the file and the rename to disk, for files that must survive power loss.
    """
    path = Path(path)
    tmp = _new_tmp(path)
    try:
        yield tmp
        if fsync:
            fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if fsync:
        fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str, *, fsync: bool = False) -> None:
    with atomic_path(path, fsync=fsync) as tmp:
        tmp.write_text(text, encoding="utf-8")


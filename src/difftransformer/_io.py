"""Atomic file writes: readers (and a crash at any moment) see the old content or the new, never a torn file."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError


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


_TMP_TOKEN_BYTES = 4  # _new_tmp's random part: 8 hex digits
# what _new_tmp names its files: <name>.<8 hex>.tmp, and .tmp.<ext> for writers that pick a format by suffix
_TMP_NAME = re.compile(rf".+\.[0-9a-f]{{{2 * _TMP_TOKEN_BYTES}}}\.tmp(\.[A-Za-z0-9]{{1,8}})?")


def _new_tmp(path: Path, suffix: str = "") -> Path:
    """A fresh file beside `path` (same filesystem, so os.replace is atomic), unique so that concurrent
    writers never share one, and created with the umask's permissions (mkstemp would force 0600).
    suffix: appended after '.tmp' (".png": a plotting library reads the format from the name)."""
    while True:
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(_TMP_TOKEN_BYTES)}.tmp{suffix}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def os_error_of(e: SafetensorError) -> OSError | None:
    """The operating system's error that a safetensors failure reports in its text ("Error while
    serializing: I/O error: No space left on device (os error 28)"), as an OSError without a file name;
    None when the failure is not the system's (a bad header, a wrong dtype)."""
    found = re.search(r"\(os error (\d+)\)", str(e))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Name `path` in the system errors of the block that writes it.

    A write() or close() that fails (a full disk, a quota) raises an OSError with no file name, and
    safetensors gives the system's error only in its own text: both leave the user with "[Errno 28] No
    space left on device" and nothing to act on. Here they become OSErrors whose filename is `path`
    (an error that already names a file keeps it), which the command line turns into one line naming
    the file, the file system to free and the option that chooses another folder.
    """
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            e.filename = os.fspath(path)
        raise
    except SafetensorError as e:
        system = os_error_of(e)
        if system is None:
            raise
        raise OSError(system.errno, system.strerror, os.fspath(path)) from e


def broken_link(link: str | Path) -> str | None:
    """What is wrong with a symbolic link, for messages: "loop" (it leads back to itself), "missing" (its
    target does not exist), or None when it resolves (or `link` is no link)."""
    try:
        os.stat(link)
    except OSError as e:
        return "loop" if e.errno == errno.ELOOP else "missing"
    return None


@contextlib.contextmanager
def atomic_path(path: str | Path, *, fsync: bool = False, suffix: str = "") -> Iterator[Path]:
    """Yield a temp path to write; on success it replaces `path`, on failure it is removed.

    fsync=True also flushes the file and the rename to disk, for files that must survive power loss.
    suffix: the temporary name's ending after '.tmp' (for writers that choose a format by the name).
    A killed writer's temporary is swept by the next holder of the folder's lock (folder_lock).
    """
    path = Path(path)
    tmp = _new_tmp(path, suffix)
    try:
        with writing(path):
            yield tmp
            if fsync:
                fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if fsync:
        fsync_dir(path.parent)


def canonical_safetensors(path: str | Path) -> None:
    """Rewrite a safetensors file's header so that equal tensors and metadata give equal bytes.

    safetensors (0.8 at least) writes its `__metadata__` map in the order of a Rust HashMap, which
    is seeded at random for every map: two saves of the same tensors with two or more metadata keys
    differ in their first bytes (`save(t, metadata={"a": "1", "b": "2"})` 50 times gives 2 distinct
    files), which defeats byte comparison and content hashes of runs that are bitwise equal. The
    header is written again with its metadata keys sorted, padded with spaces (as the format allows)
    to its former length; the tensor data are not touched. Call it on a file no reader sees yet (a
    temp file before its rename): the rewrite is in place.
    """
    import json
    import struct

    with open(path, "r+b") as fh:
        raw = fh.read(8)
        (size,) = struct.unpack("<Q", raw) if len(raw) == 8 else (0,)
        header = json.loads(fh.read(size)) if size else {}
        if not isinstance(header.get("__metadata__"), dict):
            return  # no metadata map: nothing whose order could vary
        ordered = {"__metadata__": dict(sorted(header.pop("__metadata__").items())), **header}
        text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(text) > size:  # not a header this function knows how to lay out: leave it as written
            return
        fh.seek(8)
        fh.write(text.ljust(size, b" "))


def default_permissions(path: str | Path) -> None:
    """Give a file the permissions a plain `open()` would (0666 less the umask): some writers, such as
    safetensors, create their files 0600 whatever the umask, which hides results from a group."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


class Folder:
    """A folder the package writes (a run, a study): its path, and its entries declared with
    `folder_entry`. Equal when the paths are; immutable."""

    __slots__ = ("path",)

    def __init__(self, path: str | Path):
        object.__setattr__(self, "path", Path(path))

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.path == self.path

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.path))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"


def folder_entry(*names: str) -> property:
    """A read-only property giving `self.path / names...`: how a Folder names what it holds."""
    return property(lambda self: self.path.joinpath(*names), doc=f"<folder>/{'/'.join(names)}")


def atomic_write_text(path: str | Path, text: str, *, fsync: bool = False) -> None:
    with atomic_path(path, fsync=fsync) as tmp:
        tmp.write_text(text, encoding="utf-8")


def atomic_copy(src: str | Path, dst: str | Path) -> None:
    """Copy a file to `dst` whole or not at all: a full disk or a kill leaves the old `dst` (or none)."""
    import shutil

    with atomic_path(dst) as tmp:
        with writing(dst):
            shutil.copyfile(src, tmp)


def atomic_savefig(fig, path: str | Path, **savefig_kwargs) -> None:
    """Save a matplotlib figure to `path` atomically: `fig.savefig(path)` truncates the old file first, so
    a full disk or a kill mid-write left a torn plot where a good one was; here the old plot stays
    until the new one is complete. The format comes from `path`'s suffix (the temporary name's is .tmp)."""
    path = Path(path)
    savefig_kwargs.setdefault("format", path.suffix.lstrip(".").lower() or "png")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, **savefig_kwargs)


# ----------------------------------------------------------------------------------------------
# folder locks: one writer per run folder, study folder or data folder

LOCK_FILE = ".lock"
_held: dict[str, tuple[int, int]] = {}  # resolved folder -> (fd, depth): re-entrant within a process


class FolderInUseError(RuntimeError):
    """Another process is writing the folder (it holds its lock)."""


def _holder(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError:
        text = ""
    return text or "a process that has not written its name yet"


class ForeignFolderError(ValueError):
    """A command was asked to write its output into a folder that holds another command's output."""


# Which command's output a folder holds, told by files only that command writes there: each owner
# registers its kind and marker names when imported (data/prepare.py, train/run_dir.py,
# experiments/study_dir.py), since _io sits below them. The command line imports all three.
FOLDER_MARKERS: dict[str, tuple[str, ...]] = {}


def register_folder_kind(kind: str, *markers: str) -> None:
    """Declare that a folder holding any of `markers` (file names) holds `kind` of output."""
    FOLDER_MARKERS[kind] = markers


def check_folder_kind(folder: str | Path, kind: str) -> None:
    """ForeignFolderError when `folder` holds the output of another command than the one writing `kind`
    (prepared data, a training run, a study: the kinds registered so far): mixed into one folder, a later
    `prepare --force` or `--no-resume` would replace or set aside the other's files, and readers could
    take one for the other."""
    folder = Path(folder)
    for other, markers in FOLDER_MARKERS.items():
        if other != kind and folder.is_dir() and any((folder / m).is_file() for m in markers):
            raise ForeignFolderError(f"{folder} holds {other}; {kind} is not written into it: choose another folder")


def _remove_stale_temporaries(folder: Path, recursive: bool = False) -> None:
    """Delete `_new_tmp`'s files in `folder` (below it too when `recursive`, but not inside a subfolder with a lock
    of its own, whose holder may be writing them now): none of them is a complete file, and with the folder's lock
    held nobody is writing them (see folder_lock)."""
    if not folder.is_dir():
        return
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if recursive and not (Path(root) / d / LOCK_FILE).exists()]
        for name in files:
            tmp = Path(root) / name
            if _TMP_NAME.fullmatch(name) and tmp.is_file() and not tmp.is_symlink():
                tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def folder_lock(folder: str | Path, *, purpose: str = "write elsewhere", kind: str | None = None,
                owns: tuple[str, ...] = (), sweep_all: bool = False) -> Iterator[None]:
    """Hold the exclusive lock of `folder` (created if missing) while the block runs.

    On taking it, the temporary files `atomic_path` leaves when its writer is killed between creating one
    and renaming it into place are deleted from `folder` and from its subfolders named in `owns` (those
    the holder alone writes), or from the whole tree below it with `sweep_all` (a folder of result files
    meant to be committed): with the lock held nobody else can be writing them.

    A second process that asks for it fails at once with FolderInUseError naming the holder (pid,
    host, command, start time). The lock is an advisory flock on `folder/.lock`: the operating
    system releases it when the holder exits or is killed, so a lock is never stale, whatever the
    file says. Re-entrant within one process. Where flock is missing (Windows) nothing is locked.
    purpose: the way out besides waiting, as an imperative that ends the refusal ("wait for it to finish, or
    {purpose}"). kind: what the holder writes ("prepared data", "a training run", "a study"): a folder that
    holds another kind is refused first (check_folder_kind).
    """
    if kind is not None:
        check_folder_kind(folder, kind)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not a POSIX system
        yield
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = str(folder.resolve())
    if key in _held:
        fd, depth = _held[key]
        _held[key] = (fd, depth + 1)
        try:
            yield
        finally:
            fd, depth = _held[key]
            _held[key] = (fd, depth - 1)
        return
    path = folder / LOCK_FILE
    try:  # never through a symlink: truncating the lock file must not truncate anything else
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO):
            raise  # a read-only or full file system, no permission: the caller's own message names it
        raise FolderInUseError(f"{path} cannot be opened as a lock file ({e.strerror}); remove it if it is a "
                               f"link or not a file") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise FolderInUseError(f"{folder} is in use by another process ({_holder(path)}); wait for it to finish, "
                               f"or {purpose}") from None
    _held[key] = (fd, 1)
    try:
        for place in (folder, *(folder / sub for sub in owns)):
            _remove_stale_temporaries(place, recursive=sweep_all)
        import datetime as dt
        import socket
        import sys

        os.ftruncate(fd, 0)
        with writing(path):  # a full disk fails here first: name the file
            os.pwrite(fd, (f"pid {os.getpid()} on {socket.gethostname()}, since "
                           f"{dt.datetime.now().astimezone().isoformat(timespec='seconds')}: "
                           f"{' '.join(sys.argv) or 'python'}\n").encode(), 0)
        yield
    finally:
        del _held[key]
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the descriptor releases the flock

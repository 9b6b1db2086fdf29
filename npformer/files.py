"""Files a user names: read with the path in every error, written whole or not at all.

    text = read_text(path, "--config")          # missing, a directory, unreadable, not UTF-8: one error
    data = read_json(path, "--config")          # ... or not JSON
    check_output_dir("runs/x", "--out-dir")     # before the work: a directory that can be made and written
    with written_atomically(path, "report") as f:     # binary file object of a temporary beside path
        f.write(data)
    with staged_directory("export", "export") as stage:   # every file written there, then moved in at once
        ...
    append_whole(path, line)                    # a line added to a log whole, or the log left as it was

Reading: each problem is one error naming what the file is for and its path, so the command line
turns it into its one-line usage error: a missing file is a ``FileNotFoundError``; a directory, a
file that cannot be opened, bytes that are not UTF-8, JSON that does not parse are a
:class:`~npformer.errors.RangeError`.

Writing: the content goes to ``.<name>.<pid>.tmp`` beside its path, is flushed to the disk, and is
renamed over the path (``os.replace``, atomic on POSIX), so a failure (a full disk, a read-only
directory, an interrupt) leaves the earlier file as it was and no temporary behind; the error, a
:class:`~npformer.errors.WriteError` (or the caller's error type, as checkpoints' CheckpointError),
names the path and the reason and says whether an earlier file was kept. A directory of several
files (an export) is written whole into a hidden folder inside it, then its files are renamed into
place, so a failure leaves the directory as it was. A record appended to a log (a run's metrics)
is written whole or cut off again. A file's permissions follow the umask.

Host-only code: the standard library alone.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator

from npformer.errors import RangeError, WriteError

__all__ = ["read_text", "read_json", "json_kind", "check_output_dir", "written_atomically", "write_text_atomically",
           "append_whole", "staged_directory", "remove_files", "os_reason", "temporary_path", "try_creating"]


def os_reason(exc: OSError) -> str:
    """Why an operating-system call failed, in words: ``the disk is full (...)``, ``Permission denied
    (EACCES)``."""
    if exc.errno == errno.ENOSPC:
        return f"the disk is full ({exc.strerror or exc})"
    if exc.errno is not None and exc.strerror:
        return f"{exc.strerror} ({errno.errorcode.get(exc.errno, exc.errno)})"
    return str(exc) or type(exc).__name__


# -- reading ------------------------------------------------------------------------------------------
def read_text(path: str | os.PathLike, where: str) -> str:
    """The UTF-8 text of the file ``path``; ``where`` says what it is for in every error
    (``"--config bin.json"``)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{where}: no such file")
    if p.is_dir():
        raise RangeError(f"{where}: is a directory; expected a file")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise RangeError(f"{where}: cannot be read: {os_reason(exc)}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RangeError(f"{where}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); expected a "
                         "text file") from None


def read_json(path: str | os.PathLike, where: str, *, expect: type = dict) -> Any:
    """The JSON value of the file ``path``, which must be an ``expect`` (a JSON object by default)."""
    text = read_text(path, where)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RangeError(f"{where}: not valid JSON ({exc.msg}, line {exc.lineno} column {exc.colno})") from None
    if not isinstance(value, expect):
        kinds = {dict: "a JSON object", list: "a JSON array"}
        raise RangeError(f"{where}: expected {kinds.get(expect, expect.__name__)}, got {json_kind(value)}")
    return value


def json_kind(value: Any) -> str:
    """What a JSON value is, in words ("an object", "an array", "a string", "null", ...)."""
    return {dict: "an object", list: "an array", str: "a string", bool: "true or false", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


# -- where output goes --------------------------------------------------------------------------------
def check_output_dir(path: str | os.PathLike, name: str) -> Path:
    """``path`` as a directory output can go to, checked before the work: not empty, not a file, not
    under a file, and writable where it exists (or where it would be created). It is not created
    here; ``name`` (the flag) is in every error."""
    if str(path) == "":
        raise RangeError(f"{name}: expected a directory, got an empty path")
    p = Path(path)
    for q in (p, *p.parents):
        if not q.exists():
            continue
        if not q.is_dir():
            where = "is a file" if q == p else f"is under {q}, a file"
            raise RangeError(f"{name} {path} {where}; expected a directory (created if needed)")
        if not os.access(q, os.W_OK | os.X_OK):
            raise RangeError(f"{name} {path}: cannot write in {q} (permission denied, or a read-only file system)")
        break
    return p


# -- writing ------------------------------------------------------------------------------------------
def temporary_path(path: Path, pid: int | None = None) -> Path:
    """The temporary a process writes ``path`` through: ``.<name>.<pid>.tmp`` beside it."""
    return path.with_name(f".{path.name}.{os.getpid() if pid is None else pid}.tmp")


def _create(tmp: Path) -> int:
    """Open ``tmp`` for writing, new, with mode 0666 less the umask (what ``open()`` gives)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        return os.open(tmp, flags, 0o666)
    except FileExistsError:          # our pid's name, left by a dead process that had our pid
        os.unlink(tmp)
        return os.open(tmp, flags, 0o666)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def try_creating(path: Path) -> None:
    """Create the temporary :func:`written_atomically` would write ``path`` through, and remove it:
    an ``OSError`` says a file cannot be written there (no permission, a read-only file system)."""
    tmp = temporary_path(path)
    os.close(_create(tmp))
    _unlink_quietly(tmp)


def _sync_directory(path: Path) -> None:
    """Make a rename in ``path`` durable (where the system allows opening a directory)."""
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


@contextlib.contextmanager
def written_atomically(path: str | os.PathLike, what: str = "file",
                       error: type[Exception] = WriteError) -> Iterator[BinaryIO]:
    """A binary file object whose content replaces ``path`` when the block ends without an error.

    On any failure the temporary is removed and ``path`` is as it was; an ``OSError`` becomes
    ``error`` ("could not write {what} PATH: the disk is full (...); the previous {what} PATH is
    intact"), anything else (an interrupt) propagates as it is."""
    path = Path(path)
    had_one = path.is_file()
    tmp = temporary_path(path)
    try:
        with os.fdopen(_create(tmp), "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        _unlink_quietly(tmp)
        before = f"the previous {what} {str(path)!r} is intact" if had_one else f"no {what} was written"
        raise error(f"could not write {what} {str(path)!r}: {os_reason(exc)}; {before}") from exc
    except BaseException:
        _unlink_quietly(tmp)
        raise
    _sync_directory(path.parent)


def write_text_atomically(path: str | os.PathLike, text: str, what: str = "file") -> Path:
    """``text`` (UTF-8) as the file ``path``, through :func:`written_atomically`."""
    with written_atomically(path, what) as f:
        f.write(text.encode("utf-8"))
    return Path(path)


def append_whole(path: str | os.PathLike, data: bytes) -> None:
    """``data`` appended to the file ``path`` (created if need be) whole or not at all: a write that
    fails part way (a full disk, an interrupt) is undone, the file cut back to its length before, so
    a log of one record a line never ends in half a line (which its reader would refuse). The error
    propagates as it came, an ``OSError`` for the caller to word."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        before = os.fstat(fd).st_size
        try:
            written = 0
            while written < len(data):                   # os.write may write part of it and return
                written += os.write(fd, data[written:])
        except BaseException:
            try:
                os.ftruncate(fd, before)
            except OSError:
                pass                                     # the first error is the one to report
            raise
    finally:
        os.close(fd)


def remove_files(paths: Iterable[Path], what: str) -> None:
    """Remove each file of ``paths``; one that cannot be removed is a :class:`WriteError` naming it
    as ``what`` (``"a file of the earlier run"``)."""
    for path in paths:
        try:
            Path(path).unlink(missing_ok=True)
        except OSError as exc:
            raise WriteError(f"could not remove {what}, {str(path)!r}: {os_reason(exc)}") from exc


@contextlib.contextmanager
def staged_directory(target: str | os.PathLike, what: str) -> Iterator[Path]:
    """A hidden folder inside ``target`` (created if needed) to write every file of ``what`` (an
    export) into; when the block ends without an error each file is flushed to the disk and renamed
    into ``target``, replacing a file of the same name. On a failure the folder is removed, and
    ``target`` with it when this call created it: nothing is half-written. An ``OSError`` becomes a
    :class:`WriteError` naming ``target`` and the reason."""
    target = Path(target)
    created = not target.exists()
    stage = None
    try:
        target.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{what}.", suffix=".tmp", dir=target))
        yield stage
        files = sorted(stage.iterdir())
        for file in files:
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        for file in files:
            os.replace(file, target / file.name)
    except OSError as exc:
        cause = exc.__cause__ if isinstance(exc, WriteError) and isinstance(exc.__cause__, OSError) else exc
        kept = "nothing was written" if created else f"the files in {str(target)!r} are as they were"
        raise WriteError(f"could not write {what} {str(target)!r}: {os_reason(cause)}; {kept}") from exc
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        if created and target.is_dir() and not any(target.iterdir()):
            target.rmdir()                                   # a new directory left empty by a failure
    _sync_directory(target)

"""Checkpoints as ``.npz`` files with no pickle inside, written atomically, read with every size checked.

Layout: ``model/<state_dict key>`` arrays, ``optim/<key>`` optimiser state (arrays and numbers),
and ``meta``, a uint8 array holding UTF-8 JSON (model config, vocabularies, step, options); each is
an uncompressed ``.npy`` member of a zip archive (``np.savez``).

Writing (:func:`npformer.files.written_atomically`): the file is written to ``.<name>.<pid>.tmp`` in
the same directory, flushed to disk, then renamed over the old one (``os.replace`` is atomic on
POSIX), so a crash mid-write leaves the previous checkpoint intact; the next save removes the
temporaries of processes that no longer exist. The file follows the process umask. A failed write
(a full disk included) removes its temporary and raises :class:`~npformer.errors.CheckpointError`
saying the previous checkpoint is intact. :func:`check_checkpoint_path` tries the path before
training starts, so a path that cannot be written fails at step 0, not after the run.

Reading (:func:`load_checkpoint`) opens the zip with the standard library and checks, before
allocating any array: that it is a zip at all; its members, the meta keys and the values of those a
trainer reads back (:data:`META_KEYS`, :data:`OPTIONAL_META_KEYS`); each member's
``.npy`` header (dtype: numbers and bools only, never pickle; shape) against the size the zip
declares for it and, when the caller passes them, against the model's names, shapes and dtypes;
and that the declared sizes fit in the file (members are stored uncompressed, so nothing can
inflate). CRCs are checked as the data is read, and non-finite weights are refused by name. Every
problem is one :class:`~npformer.errors.CheckpointError` naming the file and what is wrong.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from npformer.backend import to_numpy
from npformer.checks import NUMBER_KINDS     # bool, int, uint, float: the dtypes a checkpoint may hold
from npformer.errors import CheckpointError, InputTypeError
from npformer.files import os_reason, try_creating, written_atomically

__all__ = ["save_checkpoint", "load_checkpoint", "check_checkpoint_path", "check_model_state",
           "remove_stale_temporaries", "Checkpoint", "META_KEYS", "OPTIONAL_META_KEYS"]

# the meta keys every checkpoint of npformer's trainers has, and their types
META_KEYS: dict[str, type] = {"kind": str, "step": int, "train_config": dict, "model_config": dict}
# the meta keys some trainers write beside them: what each must be where it is present
OPTIONAL_META_KEYS = {"ranks": "an int >= 1", "best_valid_loss": "a finite number or null",
                      "mask_id": "an int >= 0", "sample_prompt": "a string",
                      "loss_scaler": 'an object {"scale": a number > 0, "growth_tracker": an int >= 0, '
                                     '"skipped": an int >= 0}'}
LEGACY_TMP_AGE = 3600.0          # seconds: a mkstemp temporary of an older npformer this old is stale


class Checkpoint(dict):
    """``{"model": {...}, "optim": {...}, "meta": {...}}`` as loaded back."""

    @property
    def model(self) -> dict:
        return self["model"]

    @property
    def optim(self) -> dict:
        return self["optim"]

    @property
    def meta(self) -> dict:
        return self["meta"]


# -- writing -----------------------------------------------------------------------------------------
def _check_target(path: Path, create: bool = True) -> None:
    """Refuse a path that names no file, is a directory or other non-file, or lies under a file;
    create its missing directories (``create``), else check that they could be created."""
    try:
        _check_target_unguarded(path, create)
    except CheckpointError:
        raise
    except OSError as exc:           # a parent that cannot be searched, and the like
        raise CheckpointError(f"checkpoint path {str(path)!r} cannot be used: {os_reason(exc)}") from exc


def _check_target_unguarded(path: Path, create: bool) -> None:
    if path.name in ("", ".", ".."):
        raise CheckpointError(f"checkpoint path {str(path)!r} names no file; give one such as 'run.npz'")
    if path.is_dir():
        raise CheckpointError(f"checkpoint path {str(path)!r} is a directory; give a file in it, such as "
                              f"{str(path / 'checkpoint.npz')!r}")
    if path.exists() and not path.is_file():
        raise CheckpointError(f"checkpoint path {str(path)!r} exists and is not a regular file")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise CheckpointError(f"checkpoint path {str(path)!r} lies under {str(ancestor)!r}, which is a file, "
                              "not a directory")
    if not create:
        if ancestor != path.parent and not os.access(ancestor, os.W_OK | os.X_OK):
            raise CheckpointError(f"cannot write checkpoint {str(path)!r}: its directory cannot be created in "
                                  f"{str(ancestor)!r} (permission denied, or a read-only file system)")
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create the directory {str(path.parent)!r} for checkpoint "
                              f"{str(path)!r}: {os_reason(exc)}") from exc


def check_checkpoint_path(path: str | Path, *, create: bool = True) -> Path:
    """Check that a checkpoint can be written at ``path`` before any work is done: it is not a
    directory, no parent is a file, its directory exists (it is created if missing) and a file can
    be created in it (tried with the temporary's name, then removed). With ``create=False`` (the
    command line's check, before it removes anything) no directory is made: a missing one must be
    one that can be made (its nearest existing ancestor writable). Raises :class:`CheckpointError`
    with one line saying what is wrong; returns the path."""
    path = Path(path)
    _check_target(path, create)
    if not path.parent.is_dir():              # (create=False: checked above, where it would be made)
        return path
    try:
        try_creating(path)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {str(path)!r}: creating a file in "
                              f"{str(path.parent)!r} failed: {os_reason(exc)}") from exc
    return path


def _alive(pid: int) -> bool:
    if os.name != "posix":
        return True                  # no cheap, safe probe: keep the file
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:                  # EPERM: it exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Remove the temporaries that processes writing checkpoint ``path`` left when they were killed
    mid-write: ``.<name>.<pid>.tmp`` whose process no longer exists, and ``<name>.XXXXXXXX.tmp``
    (older npformer's ``mkstemp`` names) untouched for an hour. Returns the paths removed."""
    path = Path(path)
    ours = re.compile(r"\." + re.escape(path.name) + r"\.(\d+)\.tmp")
    legacy = re.compile(re.escape(path.name) + r"\.[a-z0-9_]{8}\.tmp")
    removed = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed
    for entry in entries:
        m = ours.fullmatch(entry.name)
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            stale = (m is not None and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1)))) or (
                legacy.fullmatch(entry.name) is not None
                and time.time() - entry.stat(follow_symlinks=False).st_mtime > LEGACY_TMP_AGE)
            if stale:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:
            continue
    return removed


def save_checkpoint(path: str | Path, model_state: dict, meta: dict, optim_state: dict | None = None) -> Path:
    """Write a checkpoint atomically; returns the path. Any failure to write (a full disk, a
    read-only directory) removes the temporary and raises :class:`CheckpointError`; the previous
    checkpoint at ``path``, if any, is left as it was."""
    path = Path(path)
    arrays: dict[str, Any] = {f"model/{k}": to_numpy(v) for k, v in model_state.items()}
    for k, v in (optim_state or {}).items():
        arrays[f"optim/{k}"] = to_numpy(v) if hasattr(v, "shape") else np.asarray(v)
    for k, a in arrays.items():
        if a.dtype.kind not in NUMBER_KINDS or a.dtype.fields is not None:
            raise InputTypeError(f"checkpoint {str(path)!r}: {k} has dtype {a.dtype}; a checkpoint holds "
                                 "numbers and bools only (no pickle)")
    arrays["meta"] = np.frombuffer(json.dumps(meta, sort_keys=True).encode("utf-8"), dtype=np.uint8)
    _check_target(path)
    remove_stale_temporaries(path)
    with written_atomically(path, "checkpoint", error=CheckpointError) as f:
        np.savez(f, **arrays)
    return path


# -- reading -----------------------------------------------------------------------------------------
def _spec(value) -> tuple[tuple[int, ...], np.dtype | None]:
    """(shape, dtype or None) of an expected entry: an array, or a shape."""
    if hasattr(value, "shape"):
        return tuple(int(n) for n in value.shape), np.dtype(value.dtype) if hasattr(value, "dtype") else None
    return tuple(int(n) for n in value), None


def _header(zf: zipfile.ZipFile, info: zipfile.ZipInfo, fail) -> tuple[tuple[int, ...], bool, np.dtype]:
    """Read one member's ``.npy`` header (no data): (shape, fortran_order, dtype), checked against the
    member's declared size."""
    key = info.filename[:-4]
    try:
        with zf.open(info) as m:
            version = np.lib.format.read_magic(m)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(m)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(m)
            else:
                raise ValueError(f".npy format version {version[0]}.{version[1]} is not one npformer writes")
            header_len = m.tell()
    except (ValueError, OSError, EOFError, SyntaxError, TypeError, RuntimeError, NotImplementedError,
            zipfile.BadZipFile, zlib.error) as exc:
        raise fail(f"member {key!r} has no readable .npy header ({exc})") from exc
    if dtype.hasobject or dtype.kind not in NUMBER_KINDS or dtype.fields is not None or dtype.subdtype:
        raise fail(f"member {key!r} has dtype {dtype}; a checkpoint holds numbers and bools only (no pickle)")
    if any(n < 0 for n in shape):
        raise fail(f"member {key!r} has a negative dimension in its shape {shape}")
    needed = header_len + math.prod(shape) * dtype.itemsize
    if info.file_size != needed:
        what = ("more than" if info.file_size > needed else "less than")
        raise fail(f"member {key!r} declares {info.file_size:,} bytes, {what} the {needed:,} its header "
                   f"needs (shape {shape}, dtype {dtype}): damaged or forged")
    return shape, fortran, dtype


def _read(zf: zipfile.ZipFile, info: zipfile.ZipInfo, shape, fortran: bool, dtype: np.dtype, fail) -> np.ndarray:
    """Read one member's data into a fresh array of exactly its declared size; the CRC is checked."""
    key = info.filename[:-4]
    nbytes = math.prod(shape) * dtype.itemsize
    buf = bytearray(nbytes)
    view = memoryview(buf)
    try:
        with zf.open(info) as m:
            m.seek(info.file_size - nbytes)
            got = 0
            while got < nbytes:
                n = m.readinto(view[got:])
                if not n:
                    raise EOFError(f"{got:,} of {nbytes:,} bytes")
                got += n
            m.read(1)                # reach the end: the CRC is checked there
    except (OSError, EOFError, ValueError, RuntimeError, NotImplementedError, zipfile.BadZipFile, zlib.error) as exc:
        raise fail(f"member {key!r} could not be read: {exc} (truncated or damaged)") from exc
    arr = np.frombuffer(buf, dtype=dtype).reshape(shape, order="F" if fortran else "C")
    return arr if dtype.isnative else arr.astype(dtype.newbyteorder("="))


def _meta(raw: np.ndarray, require_meta: Mapping[str, type], fail) -> dict:
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise fail(f"member 'meta' is {raw.dtype} of shape {raw.shape}, not the uint8 bytes of a JSON object")
    try:
        meta = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise fail(f"member 'meta' is not UTF-8 JSON ({exc})") from exc
    if not isinstance(meta, dict):
        raise fail(f"member 'meta' holds a JSON {type(meta).__name__}, not an object")
    missing = sorted(k for k in require_meta if k not in meta)
    if missing:
        raise fail(f"meta lacks the keys {missing} (it has {sorted(meta)}); a checkpoint of npformer train "
                   f"has {sorted(require_meta)}")
    for k, t in require_meta.items():
        v = meta[k]
        if not isinstance(v, t) or isinstance(v, bool) or (t is int and v < 0):
            raise fail(f"meta[{k!r}] is {v!r}; expected {'a non-negative int' if t is int else 'a ' + t.__name__}")
    for k, expected in OPTIONAL_META_KEYS.items():
        if k in meta and not _optional_fits(k, meta[k]):
            raise fail(f"meta[{k!r}] is {json.dumps(meta[k])[:60]}; expected {expected}")
    return meta


def _optional_fits(key: str, v: Any) -> bool:
    """Whether ``v`` is what :data:`OPTIONAL_META_KEYS` says the meta key ``key`` holds."""
    def is_int(x, low):
        return isinstance(x, int) and not isinstance(x, bool) and x >= low

    def is_number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    if key == "ranks":
        return is_int(v, 1)
    if key == "best_valid_loss":
        return v is None or is_number(v)
    if key == "mask_id":
        return is_int(v, 0)
    if key == "sample_prompt":
        return isinstance(v, str)
    return (isinstance(v, dict) and is_number(v.get("scale")) and v["scale"] > 0           # loss_scaler
            and is_int(v.get("growth_tracker"), 0) and is_int(v.get("skipped"), 0))


def _finite(key: str, arr: np.ndarray, fail) -> None:
    if arr.dtype.kind != "f" or arr.size == 0:
        return
    ok = np.isfinite(arr)
    if not ok.all():
        nan = int(np.isnan(arr).sum())
        raise fail(f"tensor {key!r} holds {nan:,} NaN and {int(arr.size - ok.sum()) - nan:,} infinite values "
                   f"out of {arr.size:,}; refusing non-finite weights (allow_nonfinite=True loads them)")


def load_checkpoint(path: str | Path, *, expected: Mapping[str, Any] | None = None, kind: str | None = None,
                    require_meta: Mapping[str, type] | None = None, allow_nonfinite: bool = False,
                    check_meta: Callable[[dict], None] | None = None) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint` (host arrays; no pickle, ever).

    ``expected``: the model's state dict (or ``{name: shape}``); the ``model/`` members must have
    exactly its names, shapes and (for arrays) dtypes, checked before any data is read.
    ``kind``: the model kind ``meta["kind"]`` must name (checked before ``expected``, so a checkpoint of
    another model kind is reported as such rather than as a list of missing tensors).
    ``check_meta``: called with the meta after ``kind``, before ``expected`` and before any tensor is
    read; it raises to refuse the checkpoint for what its meta says (a trainer's vocabulary that is
    not the checkpoint's, which would also show as tensors of other sizes).
    ``require_meta``: the meta keys and their types that must be present (default
    :data:`META_KEYS`, what every checkpoint of ``npformer train`` has; ``{}`` for none). The keys of
    :data:`OPTIONAL_META_KEYS` are checked where present, whatever ``require_meta`` says.
    ``allow_nonfinite``: load NaN or infinite values instead of refusing them (for debugging).
    Raises ``FileNotFoundError`` for a missing file and :class:`CheckpointError` for anything else.
    """
    path = Path(path)
    require_meta = META_KEYS if require_meta is None else require_meta

    def fail(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {str(path)!r}: {what}")

    try:
        if path.is_dir():
            raise fail("is a directory, not a checkpoint file")
        if not path.exists():
            raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
        f = open(path, "rb")
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise fail(f"cannot be opened: {os_reason(exc)}") from exc
    with f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise fail("is empty (0 bytes), not an npformer checkpoint (.npz)")
        try:
            zf = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, NotImplementedError) as exc:
            raise fail(f"is not an npformer checkpoint (.npz, a zip archive): {exc}; truncated or damaged?") from exc
        with zf:
            members = _check_members(zf, size, fail)
            headers = {"meta": _header(zf, members["meta"], fail)}
            meta = _meta(_read(zf, members["meta"], *headers["meta"], fail), require_meta, fail)
            if kind is not None and meta.get("kind") != kind:
                raise fail(f"holds a {meta.get('kind')!r} checkpoint, not a {kind} one")
            if check_meta is not None:
                check_meta(meta)
            if expected is not None:
                _check_names({k[len("model/"):] for k in members if k.startswith("model/")}, expected, fail)
            headers.update({key: _header(zf, info, fail) for key, info in members.items() if key != "meta"})
            if expected is not None:
                for name, value in expected.items():
                    got_shape, _, got_dtype = headers[f"model/{name}"]
                    _check_tensor(name, got_shape, got_dtype, value, fail)
            model, optim = {}, {}
            for key, info in members.items():
                if key == "meta":
                    continue
                arr = _read(zf, info, *headers[key], fail)
                if not allow_nonfinite:
                    _finite(key, arr, fail)
                if key.startswith("model/"):
                    model[key[len("model/"):]] = arr
                else:
                    optim[key[len("optim/"):]] = arr.item() if arr.ndim == 0 else arr
    return Checkpoint(model=model, optim=optim, meta=meta)


def _check_members(zf: zipfile.ZipFile, size: int, fail) -> dict[str, zipfile.ZipInfo]:
    """``{key: ZipInfo}``; the names, compression and declared sizes checked against the file."""
    members: dict[str, zipfile.ZipInfo] = {}
    total = 0
    for info in zf.infolist():
        name = info.filename
        key = name[:-4] if name.endswith(".npy") else name
        if not name.endswith(".npy") or not (key == "meta" or key.startswith(("model/", "optim/"))):
            raise fail(f"has a member {name!r} that is not meta.npy, model/*.npy or optim/*.npy")
        if key in members:
            raise fail(f"has the member {name!r} twice")
        if info.flag_bits & 0x41:      # encrypted, strong encryption
            raise fail(f"member {key!r} is encrypted")
        if info.compress_type != zipfile.ZIP_STORED:
            raise fail(f"member {key!r} is compressed (zip method {info.compress_type}); npformer checkpoints "
                       "store arrays uncompressed (np.savez), so no member can inflate beyond the file")
        if info.compress_size != info.file_size:
            raise fail(f"member {key!r} declares {info.file_size:,} bytes but stores {info.compress_size:,}")
        total += info.file_size
        if total > size:
            raise fail(f"member {key!r} declares {info.file_size:,} bytes; the members' sizes add up to more "
                       f"than the whole file ({size:,} bytes): truncated or forged")
        members[key] = info
    if "meta" not in members:
        raise fail(f"has no 'meta' member (it has {sorted(members)[:5]}{' ...' if len(members) > 5 else ''}): "
                   "not an npformer checkpoint")
    return members


def check_model_state(path: str | Path, model_state: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """The tensors of a checkpoint read without ``expected`` (``load_checkpoint(path).model``) against a
    model built since (from its meta): the names, shapes and dtypes of ``expected``, checked and worded
    as ``load_checkpoint(path, expected=...)`` checks them, a :class:`CheckpointError` naming the file."""
    def fail(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {str(path)!r}: {what}")

    _check_names(set(model_state), expected, fail)
    for name, value in expected.items():
        arr = model_state[name]
        _check_tensor(name, tuple(int(n) for n in arr.shape), np.dtype(arr.dtype), value, fail)


def _check_tensor(name: str, shape: tuple[int, ...], dtype: np.dtype, value, fail) -> None:
    """The checkpoint's tensor ``model/name``, of ``shape`` and ``dtype``, against the model's ``value``."""
    want_shape, want_dtype = _spec(value)
    if shape != want_shape or (want_dtype is not None and dtype != want_dtype):
        raise fail(f"tensor 'model/{name}' is {dtype} {shape}; the model has "
                   f"{'any dtype' if want_dtype is None else want_dtype} {want_shape}")


def _check_names(have: set[str], expected: Mapping[str, Any], fail) -> None:
    missing, unexpected = sorted(set(expected) - have), sorted(have - set(expected))
    if missing or unexpected:
        raise fail("does not fit the model: " + "; ".join(
            part for part in (f"missing tensors {missing[:8]}" if missing else "",
                              f"unexpected tensors {unexpected[:8]}" if unexpected else "") if part))

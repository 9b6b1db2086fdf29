"""Checkpoints as ``.npz`` files with no pickle inside, written atomically.

Layout: ``model/<state_dict key>`` arrays, ``optim/<key>`` optimiser state (arrays and numbers),
and ``meta``, a uint8 array holding UTF-8 JSON (model config, vocabularies, step, options).
The file is written to a temporary name in the same directory, flushed to disk, then renamed over
the old one (``os.replace`` is atomic on POSIX), so a crash mid-write leaves the previous
checkpoint intact. Loading uses ``allow_pickle=False``.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from npformer.backend import to_numpy

__all__ = ["save_checkpoint", "load_checkpoint", "Checkpoint"]


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


def save_checkpoint(path: str | Path, model_state: dict, meta: dict, optim_state: dict | None = None) -> Path:
    """Write a checkpoint atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, Any] = {f"model/{k}": to_numpy(v) for k, v in model_state.items()}
    for k, v in (optim_state or {}).items():
        arrays[f"optim/{k}"] = to_numpy(v) if hasattr(v, "shape") else np.asarray(v)
    arrays["meta"] = np.frombuffer(json.dumps(meta, sort_keys=True).encode("utf-8"), dtype=np.uint8)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint` (host arrays; no pickle)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as data:
            files = {k: data[k] for k in data.files}
    except (ValueError, OSError) as exc:
        raise ValueError(f"{str(path)!r} is not an npformer checkpoint (.npz without pickle): {exc}") from exc
    if "meta" not in files:
        raise ValueError(f"{str(path)!r} has no 'meta' entry: not an npformer checkpoint")
    meta = json.loads(files.pop("meta").tobytes().decode("utf-8"))
    model = {k[len("model/"):]: v for k, v in files.items() if k.startswith("model/")}
    optim = {k[len("optim/"):]: (v.item() if v.ndim == 0 else v) for k, v in files.items()
             if k.startswith("optim/")}
    return Checkpoint(model=model, optim=optim, meta=meta)

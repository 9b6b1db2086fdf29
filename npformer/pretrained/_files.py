"""Host-side file handling shared by the pretrained loaders: checking a model directory and reading
its safetensors weights (one ``model.safetensors``, or shards listed in ``model.safetensors.index.json``).

``safetensors`` is imported only when weights are read, so ``import npformer.pretrained`` works
without the optional extra.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np   # host side only: arrays read from files

INSTALL = 'pip install "npformer[pretrained]"'
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _present(root: Path, name: str) -> bool:
    # a sharded checkpoint (save_pretrained with max_shard_size) replaces the one file by an index
    return (root / name).is_file() or (name == WEIGHTS and (root / INDEX).is_file())


def check_directory(path, required: tuple[str, ...]) -> Path:
    """``Path(path)`` after checking that it is a directory holding every file in ``required``
    (``model.safetensors`` may be a sharded ``model.safetensors.index.json``)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {str(root)!r} does not exist (expected a directory with "
                                f"{', '.join(required)})")
    absent = [f for f in required if not _present(root, f)]
    if absent:
        raise FileNotFoundError(f"model directory {str(root)!r} is missing {', '.join(absent)} "
                                f"(expected {', '.join(required)})")
    return root


def read_config(root: Path) -> dict:
    try:
        cfg = json.loads((root / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{root / 'config.json'} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ValueError(f"{root / 'config.json'}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def load_safetensors(root: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint in ``root`` as host NumPy arrays, by name."""
    try:
        from safetensors.numpy import load_file
    except ImportError as exc:
        raise ImportError(f"reading safetensors weights needs the safetensors package: {INSTALL}") from exc
    if (root / WEIGHTS).is_file():
        return load_file(str(root / WEIGHTS))
    index = json.loads((root / INDEX).read_text())
    shards = sorted(set(index.get("weight_map", {}).values()))
    absent = [s for s in shards if not (root / s).is_file()]
    if not shards or absent:
        raise FileNotFoundError(f"{root / INDEX} lists shards that are not in the directory: {absent}"
                                if absent else f"{root / INDEX} lists no shards (empty weight_map)")
    tensors: dict[str, np.ndarray] = {}
    for s in shards:
        tensors.update(load_file(str(root / s)))
    return tensors

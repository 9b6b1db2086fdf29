"""Weights in and out of npformer without importing PyTorch.

npformer's modules use PyTorch's parameter names, so a ``torch.nn`` module's ``state_dict`` loads
unchanged and npformer's exported arrays load back into PyTorch:

    ours.load_state_dict(from_arrays(theirs.state_dict()))
    theirs.load_state_dict({k: torch.from_numpy(v) for k, v in to_numpy_state_dict(ours).items()})

Anything array-like is accepted: NumPy or CuPy arrays, and tensors (converted through
``.detach().cpu().numpy()`` by duck typing, so torch is never imported here; bfloat16 tensors,
which NumPy has no dtype of its own for, become float32, exactly). Every ``torch.nn`` module npformer mirrors
round-trips this way: MultiheadAttention, TransformerEncoderLayer/DecoderLayer,
TransformerEncoder/Decoder and Transformer (tests/parity/test_torch_layers.py).

Hugging Face model directories (``config.json`` and ``model.safetensors``, or shards listed in
``model.safetensors.index.json``) are read and written here with NumPy alone, for the models'
``save_pretrained``/``from_pretrained`` and :mod:`npformer.pretrained`. A safetensors file is::

    8 bytes     N, the header's length (unsigned, little-endian)
    N bytes     a JSON object: {name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
                "__metadata__": {str: str}}, offsets into the data that follows
    the data    each tensor's bytes, C order, little-endian, back to back

bfloat16 tensors (``BF16``), which NumPy has no dtype of its own for (ml_dtypes' is optional), are
widened to float32 exactly on reading.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy

from npformer.backend import to_numpy
from npformer.errors import CheckpointError, RangeError
from npformer.files import json_kind, read_json, write_text_atomically, written_atomically

__all__ = ["from_arrays", "to_numpy_state_dict", "save_safetensors", "load_safetensors_file",
           "check_directory", "read_config", "load_weights", "save_directory", "WEIGHTS", "INDEX"]

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# safetensors dtype names <-> NumPy dtypes (little-endian); BF16 is read only (widened to float32)
_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
           "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}
_NAMES = {numpy.dtype(v): k for k, v in _DTYPES.items()}


def _host(v: Any) -> numpy.ndarray:
    if hasattr(v, "detach") and hasattr(v, "cpu"):          # a torch tensor, without importing torch
        v = v.detach().cpu()
        if str(v.dtype) == "torch.bfloat16":                 # NumPy has no bfloat16: widen exactly
            v = v.float()
        v = v.numpy()
    return to_numpy(v)


def from_arrays(state: Mapping[str, Any]) -> dict[str, numpy.ndarray]:
    """``{name: host array}`` from any mapping of names to array-likes (e.g. a torch state_dict)."""
    return {k: _host(v) for k, v in state.items()}


def to_numpy_state_dict(module) -> dict[str, numpy.ndarray]:
    """Host copies of a module's parameters under their (PyTorch) names, tied weights under each name."""
    return {k: to_numpy(v).copy() for k, v in module.state_dict().items()}


# -- safetensors files -----------------------------------------------------------------------------
def save_safetensors(path, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` (name -> array-like) to ``path`` in the safetensors format, names sorted,
    the header padded with spaces to a multiple of 8 bytes (so every tensor starts 8-byte aligned).
    The file is written whole or not at all (:func:`npformer.files.written_atomically`)."""
    arrays = {k: numpy.asarray(_host(v), order="C") for k, v in sorted(tensors.items())}   # 0-d stays 0-d
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, a in arrays.items():
        if a.dtype.newbyteorder("<") not in _NAMES:
            raise CheckpointError(f"{name}: safetensors has no dtype for {a.dtype} (expected one of "
                                  f"{sorted(str(d) for d in _NAMES)})")
        header[name] = {"dtype": _NAMES[a.dtype.newbyteorder("<")], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = Path(path)
    with written_atomically(path, "safetensors file") as f:           # whole or not at all
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for a in arrays.values():
            f.write(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
    return path


def load_safetensors_file(path) -> dict[str, numpy.ndarray]:
    """Every tensor of the safetensors file ``path`` as a host NumPy array, by name. A file whose
    header or offsets do not fit its size is one :class:`CheckpointError` naming it."""
    data = Path(path).read_bytes()
    where = f"{str(path)!r} is not a safetensors file"
    if len(data) < 8:
        raise CheckpointError(f"{where}: {len(data)} bytes, fewer than the 8 of the header's length")
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        raise CheckpointError(f"{where}: its header of {n} bytes is longer than the file ({len(data)} bytes)")
    try:
        header = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where}: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: its header is {json_kind(header)}, not a JSON object")
    body = memoryview(data)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise CheckpointError(f"{str(path)!r}: its __metadata__ is not a JSON object of strings")
            continue
        dtype, shape, (begin, end) = _entry(path, name, info, len(body))
        raw = body[begin:end]
        if dtype == "BF16":      # the upper half of a float32: widen exactly
            a = (numpy.frombuffer(raw, "<u2").astype(numpy.uint32) << 16).view(numpy.float32)
        else:
            a = numpy.frombuffer(raw, _DTYPES[dtype]).astype(numpy.dtype(_DTYPES[dtype]).newbyteorder("="))
        out[name] = a.reshape(shape)
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry(path, name: str, info: Any, size: int) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """``(dtype, shape, (begin, end))`` of the header entry ``name``, checked: an object with a dtype
    NumPy can hold, a shape of non-negative ints and offsets of two ints that fit the ``size`` bytes of
    data and the tensor's size; a :class:`CheckpointError` naming the file and the entry otherwise."""
    where = f"{str(path)!r}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: its header entry is {json_kind(info)}, not a JSON object with "
                              "dtype, shape and data_offsets")
    absent = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if absent:
        raise CheckpointError(f"{where}: its header entry has no {', '.join(absent)}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or (dtype not in _DTYPES and dtype != "BF16"):
        raise CheckpointError(f"{where} has dtype {dtype!r}, which NumPy cannot hold (expected one of "
                              f"{', '.join([*_DTYPES, 'BF16'])})")
    if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d < 2**63 for d in shape):
        raise CheckpointError(f"{where} has shape {shape!r}; expected a list of non-negative ints")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise CheckpointError(f"{where} has data_offsets {offsets!r}; expected two ints [begin, end]")
    begin, end = offsets
    width = 2 if dtype == "BF16" else numpy.dtype(_DTYPES[dtype]).itemsize
    if not 0 <= begin <= end <= size or end - begin != width * math.prod(shape):
        raise CheckpointError(f"{where} of shape {tuple(shape)} and dtype {dtype} does not "
                              f"fit its offsets [{begin}, {end}) in {size} bytes of data")
    return dtype, tuple(shape), (begin, end)


# -- Hugging Face model directories ---------------------------------------------------------------
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
    """The JSON object in ``root / "config.json"`` (an error naming the file when it is not one)."""
    return read_json(root / "config.json", str(root / "config.json"))


def load_weights(root: Path) -> dict[str, numpy.ndarray]:
    """Every tensor of the checkpoint in ``root`` (one file, or the shards its index lists) by name."""
    if (root / WEIGHTS).is_file():
        return load_safetensors_file(root / WEIGHTS)
    index = read_json(root / INDEX, str(root / INDEX))
    weight_map = index.get("weight_map", {})
    if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
        raise RangeError(f"{root / INDEX}: weight_map must be a JSON object of tensor name -> shard file name")
    shards = sorted(set(weight_map.values()))
    absent = [s for s in shards if not (root / s).is_file()]
    if not shards or absent:
        raise FileNotFoundError(f"{root / INDEX} lists shards that are not in the directory: {absent}"
                                if absent else f"{root / INDEX} lists no shards (empty weight_map)")
    tensors: dict[str, numpy.ndarray] = {}
    for s in shards:
        tensors.update(load_safetensors_file(root / s))
    return tensors


def save_directory(path, config: Mapping[str, Any], tensors: Mapping[str, Any]) -> Path:
    """Write a Hugging Face model directory: ``config.json`` (keys sorted) and ``model.safetensors``
    (``{"format": "pt"}`` metadata, as transformers writes), each file whole or not at all. The
    directory is created if needed."""
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise FileExistsError(f"{str(root)!r} is a file; expected a directory to write the model into")
    root.mkdir(parents=True, exist_ok=True)
    write_text_atomically(root / "config.json", json.dumps(dict(config), indent=2, sort_keys=True) + "\n", "config")
    save_safetensors(root / WEIGHTS, tensors, {"format": "pt"})
    return root

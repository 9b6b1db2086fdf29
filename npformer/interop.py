"""Weights in and out of npformer without importing PyTorch.

npformer's modules use PyTorch's parameter names, so a ``torch.nn`` module's ``state_dict`` loads
unchanged and npformer's exported arrays load back into PyTorch:

    ours.load_state_dict(from_arrays(theirs.state_dict()))
    theirs.load_state_dict({k: torch.from_numpy(v) for k, v in to_numpy_state_dict(ours).items()})

Anything array-like is accepted: NumPy or CuPy arrays, and tensors (converted through
``.detach().cpu().numpy()`` by duck typing, so torch is never imported here; bfloat16 tensors,
which NumPy cannot hold, become float32, exactly). Every ``torch.nn`` module npformer mirrors
round-trips this way: MultiheadAttention, TransformerEncoderLayer/DecoderLayer,
TransformerEncoder/Decoder and Transformer (tests/parity/test_torch_layers.py).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy

from npformer.backend import to_numpy

__all__ = ["from_arrays", "to_numpy_state_dict"]


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

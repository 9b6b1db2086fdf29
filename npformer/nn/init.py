"""Parameter initialisation, drawn on the host so a seed gives the same weights on every backend.

The schemes are PyTorch's defaults, so a fresh npformer module is distributed like its PyTorch
counterpart (the values differ: the generators differ):

* ``linear_uniform``: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), what ``nn.Linear`` gets from
  ``kaiming_uniform_(a=sqrt(5))`` for its weight and the same bound for its bias;
* ``xavier_uniform``: U(-a, a), a = sqrt(6 / (fan_in + fan_out)) (Glorot and Bengio, 2010);
* ``normal``: N(0, std^2) (``nn.Embedding`` uses std 1; GPT-2 uses 0.02);
* ``ones``/``zeros``: layer norm gains and biases.

Every array is made in ``dtype`` (None: float32), which must be a floating-point dtype: every
module draws its parameters here, so an integer or complex model is refused when it is built.

``rng`` is a host ``numpy.random.Generator`` (from ``npformer.backend.default_rng(seed, "numpy")``)
or an int seed; ``None`` draws from fresh OS entropy (as ``numpy.random.default_rng()``): pass a
seed for reproducible weights. Nothing here keeps state between calls.

:data:`DEFERRED` in place of ``rng`` draws nothing: the arrays come out as zeros, for a model that
initialises its layers by its own scheme right after building them (GPT), so no weight is drawn
twice.
"""
from __future__ import annotations

import math
from typing import Any

from npformer.backend import default_rng, get_backend, to_device
from npformer.checks import float_dtype
from npformer.errors import InputTypeError

__all__ = ["DEFERRED", "host_generator", "stream_seed", "linear_uniform", "xavier_uniform", "normal", "uniform",
           "ones", "zeros"]


class _Deferred:
    """``rng=DEFERRED``: allocate without drawing; the enclosing model draws the values itself."""

    def __repr__(self) -> str:
        return "npformer.nn.init.DEFERRED"


DEFERRED = _Deferred()


def host_generator(rng: Any = None):
    """A host Generator from ``None`` (fresh OS entropy), an int seed, or a Generator (returned as
    is); :data:`DEFERRED` passes through."""
    if rng is DEFERRED:
        return rng
    if rng is None or (isinstance(rng, int) and not isinstance(rng, bool)):
        return default_rng(rng, "numpy")
    if not hasattr(rng, "uniform") or type(rng).__module__.split(".")[0] != "numpy":
        raise InputTypeError(f"rng: expected None, an int seed or a numpy Generator, got {type(rng).__name__}")
    return rng


def stream_seed(rng: Any = None) -> int | None:
    """The seed of the dropout stream (:meth:`npformer.nn.Module.manual_seed`) of a module built with
    ``rng``, spawned from the generator's seed sequence so that no draw of the weights is used up:
    the same ``rng`` gives the same weights and the same masks. None for ``rng=None`` (OS entropy)."""
    if rng is None or rng is DEFERRED:
        return None
    seq = getattr(host_generator(rng).bit_generator, "seed_seq", None)
    if not hasattr(seq, "spawn"):            # a bit generator built without a seed sequence
        return None
    return int(seq.spawn(1)[0].generate_state(1)[0])


def _place(host, dtype, backend):
    xp = get_backend(backend)
    return to_device(host, backend).astype(float_dtype(xp, dtype), copy=False)


def uniform(shape: tuple, bound: float, *, rng=None, dtype=None, backend=None):
    """U(-bound, bound) of ``shape``."""
    if rng is DEFERRED:
        return zeros(shape, dtype=dtype, backend=backend)
    return _place(host_generator(rng).uniform(-bound, bound, size=shape), dtype, backend)


def linear_uniform(shape: tuple, fan_in: int, *, rng=None, dtype=None, backend=None):
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)): ``nn.Linear``'s default for weight and bias."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return uniform(shape, bound, rng=rng, dtype=dtype, backend=backend)


def xavier_uniform(shape: tuple, *, gain: float = 1.0, rng=None, dtype=None, backend=None):
    """U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)) for a (fan_out, fan_in) matrix."""
    fan_out, fan_in = shape[0], shape[1]
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform(shape, bound, rng=rng, dtype=dtype, backend=backend)


def normal(shape: tuple, std: float = 1.0, *, rng=None, dtype=None, backend=None):
    """N(0, std^2) of ``shape``."""
    if rng is DEFERRED:
        return zeros(shape, dtype=dtype, backend=backend)
    return _place(host_generator(rng).standard_normal(size=shape) * std, dtype, backend)


def ones(shape: tuple, *, dtype=None, backend=None):
    xp = get_backend(backend)
    return xp.ones(shape, dtype=float_dtype(xp, dtype))


def zeros(shape: tuple, *, dtype=None, backend=None):
    xp = get_backend(backend)
    return xp.zeros(shape, dtype=float_dtype(xp, dtype))

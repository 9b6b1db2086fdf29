"""Input checks shared by every op and module: each failure names what was expected and what came.

They only read their arguments; a failed check raises before any output is computed, so nothing is
ever half-written.
"""
from __future__ import annotations

from typing import Any, Sequence

from npformer.backend import get_array_module, is_cupy_array

__all__ = ["describe", "expect_array", "expect_float", "expect_int", "expect_ndim",
           "expect_shape", "expect_same_dtype", "expect_bool_or_float"]


def describe(x: Any) -> str:
    """A short description such as ``numpy float32 array of shape (2, 3)``."""
    if x is None:
        return "None"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        backend = "cupy" if is_cupy_array(x) else "numpy"
        return f"{backend} {x.dtype} array of shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}"[:120]


def expect_array(x: Any, name: str) -> None:
    """``x`` must be a NumPy or CuPy ndarray (lists and scalars are not converted silently)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "ndim")):
        raise TypeError(f"{name}: expected a numpy or cupy array, got {describe(x)}")
    get_array_module(x)


def expect_float(x: Any, name: str) -> None:
    """``x`` must be an array of a floating dtype."""
    expect_array(x, name)
    if x.dtype.kind != "f" and str(x.dtype) != "bfloat16":
        raise TypeError(f"{name}: expected a floating-point array (float16/32/64), got {describe(x)}")


def expect_int(x: Any, name: str) -> None:
    """``x`` must be an array of an integer dtype (token ids, class targets)."""
    expect_array(x, name)
    if x.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array, got {describe(x)}")


def expect_bool_or_float(x: Any, name: str) -> None:
    """A mask: boolean (True = blocked) or floating (added to the scores)."""
    expect_array(x, name)
    if x.dtype.kind not in "bf":
        raise TypeError(f"{name}: expected a bool mask (True = may not attend) or a float mask "
                        f"(added to the scores), got {describe(x)}")


def expect_ndim(x: Any, name: str, ndim: int | Sequence[int], layout: str = "") -> None:
    """``x.ndim`` must be ``ndim`` (or one of them); ``layout`` such as "(B, T, C)" goes in the message."""
    expect_array(x, name)
    allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if x.ndim not in allowed:
        want = " or ".join(str(n) for n in allowed)
        lay = f" {layout}" if layout else ""
        raise ValueError(f"{name}: expected a {want}-d array{lay}, got {describe(x)}")


def expect_shape(x: Any, name: str, shape: Sequence[int | None], layout: str = "") -> None:
    """``x.shape`` must equal ``shape``; ``None`` entries match any size."""
    expect_array(x, name)
    ok = x.ndim == len(shape) and all(w is None or w == s for w, s in zip(shape, x.shape))
    if not ok:
        want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ("," if len(shape) == 1 else "") + ")"
        lay = f" {layout}" if layout else ""
        raise ValueError(f"{name}: expected shape {want}{lay}, got {describe(x)}")


def expect_same_dtype(**arrays: Any) -> None:
    """All non-None arrays share one dtype (float32 in gives float32 out; nothing is promoted silently)."""
    named = [(k, v) for k, v in arrays.items() if v is not None]
    if not named:
        return
    first_name, first = named[0]
    for k, v in named[1:]:
        if v.dtype != first.dtype:
            raise TypeError(f"dtype mismatch: {first_name} is {first.dtype} but {k} is {v.dtype}; "
                            "cast them to one dtype first")

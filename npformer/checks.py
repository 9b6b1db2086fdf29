"""The input checks of every layer (ops, modules, models, trainers, the command line), in one place.

Each check names what was expected and what came, and raises the one exception type of its kind of
mistake (:mod:`npformer.errors`): :class:`InputTypeError` for a wrong type or dtype,
:class:`ShapeError` for a wrong rank or shape, :class:`RangeError` for a value outside its range.
They only read their arguments; a failed check raises before any output is computed, so nothing is
ever half-written. The scalar checks return the value converted (``positive_int`` returns an
``int``, ``real`` a ``float``), so a caller keeps what was checked.

Checks of array *values* (token ids within the vocabulary, class ids within the logits) read the
data back to the host. Inside a CUDA graph capture (:mod:`npformer.training.cuda_graph`) that is
not possible, so the capture runs under :func:`values_unchecked` and those checks
(:func:`ids_below`, :func:`class_ids`, :func:`token_ids`) skip themselves: the ops call them as any
other check, with nothing of the capture in their code; the eager calls before the capture check
them as usual. Types, ranks
and shapes are always checked.

Arrays are checked once per public call. An op called by another op (both ``@dispatched``,
:mod:`npformer.dispatch`, which counts the ops running in this thread) trusts its caller: the outer
op checked what the user gave it and made the rest itself, so the ``expect_*`` checks of the ops
below it return at once (:func:`checked_by_caller`), as Chainer type-checks each call of a function
and never the functions inside it. The scalar checks, which also convert, always run. Every
dispatched op that hands a user's array to another op checks it at its own top. An op that is not
dispatched but calls ops (multi-head attention) checks its inputs, then calls them inside
:func:`inputs_checked`, as a dispatched op runs its body.

:func:`arrays_unchecked` switches the ``expect_*`` array checks off for a block (Chainer's
``config.type_check = False``): a model known to be fed well-formed arrays then skips them, and a
malformed array fails wherever NumPy or CuPy notices, with their message, or not at all (mixed
dtypes pass). The comparisons an op makes itself (one shape against another) and the scalar
checks still run.
"""
from __future__ import annotations

import contextvars
import math
from contextlib import contextmanager
from numbers import Integral, Real
from typing import Any, Iterator, Sequence

from npformer.backend import get_array_module, is_array, is_cupy_array, is_float_dtype, resolve_dtype
from npformer.errors import InputTypeError, RangeError, ShapeError

__all__ = ["describe", "expect_array", "expect_float", "expect_int", "expect_bool_or_float", "expect_ndim",
           "expect_shape", "expect_rows", "expect_same_dtype", "expect_same_float", "expect_grad", "expect_row_buffer",
           "token_ids", "ids_below", "class_ids", "integer", "boolean", "positive_int", "non_negative_int", "real",
           "positive_in_dtype", "probability", "one_of", "values_checked", "values_unchecked", "float_dtype",
           "OP_DEPTH", "checked_by_caller", "inputs_checked", "arrays_unchecked", "NUMBER_KINDS"]

NUMBER_KINDS = "biuf"    # bool, int, uint, float: the dtype kinds a checkpoint or a state dict may hold

_VALUES = contextvars.ContextVar("npformer_value_checks", default=True)
_ARRAYS = contextvars.ContextVar("npformer_array_checks", default=True)
# how many ops that checked their inputs are running in this thread (see inputs_checked)
OP_DEPTH = contextvars.ContextVar("npformer_op_depth", default=0)


def checked_by_caller() -> bool:
    """True inside an op that another op called (its arrays were checked by that op, module
    docstring), and everywhere inside :func:`arrays_unchecked`."""
    return OP_DEPTH.get() > 1 or not _ARRAYS.get()


class inputs_checked:
    """``with inputs_checked():`` the ops called in the block trust the checks made before it
    (:mod:`npformer.dispatch` runs every op's body so; a composite op that is not dispatched does
    it after checking its inputs). A class rather than a generator: it runs around every op."""

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = OP_DEPTH.set(OP_DEPTH.get() + 1)

    def __exit__(self, *exc_info) -> None:
        OP_DEPTH.reset(self._token)


@contextmanager
def arrays_unchecked() -> Iterator[None]:
    """Skip the ``expect_*`` array checks (types, backends, dtypes, ranks, shapes) inside the block,
    in this thread; an op's own shape comparisons and the scalar checks, which also convert, still
    run. For a model whose inputs are known to be well formed: a malformed array then fails with
    NumPy's or CuPy's error, or silently (mixed dtypes pass), so keep the checks on while developing."""
    token = _ARRAYS.set(False)
    try:
        yield
    finally:
        _ARRAYS.reset(token)


def values_checked() -> bool:
    """Whether checks of array values (ids in range) run here: True except inside
    :func:`values_unchecked` (a CUDA graph capture)."""
    return _VALUES.get()


@contextmanager
def values_unchecked() -> Iterator[None]:
    """Skip the checks of array values inside the block (this thread); types and shapes are still
    checked. For a CUDA graph capture, where reading data back to the host is impossible."""
    token = _VALUES.set(False)
    try:
        yield
    finally:
        _VALUES.reset(token)


def describe(x: Any) -> str:
    """A short description such as ``numpy float32 array of shape (2, 3)``."""
    if x is None:
        return "None"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        backend = "cupy" if is_cupy_array(x) else "numpy"
        return f"{backend} {x.dtype} array of shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}"[:120]


# -- arrays ------------------------------------------------------------------------------------------

def expect_array(x: Any, name: str) -> None:
    """``x`` must be a NumPy or CuPy ndarray (lists, scalars and other libraries' tensors are not
    converted silently)."""
    if checked_by_caller():
        return
    if not is_array(x):
        raise InputTypeError(f"{name}: expected a numpy or cupy array, got {describe(x)}")


def expect_float(x: Any, name: str) -> None:
    """``x`` must be an array of a floating dtype."""
    if checked_by_caller():
        return
    expect_array(x, name)
    if not is_float_dtype(x.dtype):
        _not_float(x, name)


def _not_float(x: Any, name: str) -> None:
    raise InputTypeError(f"{name}: expected a floating-point array (float16/32/64, bfloat16), got {describe(x)}")


def float_dtype(xp: Any, dtype: Any, name: str = "dtype") -> Any:
    """``xp``'s dtype for ``dtype`` (None: float32), which must be floating-point: the dtype of a
    module's parameters, checked when the module is built (an integer or complex model would fail
    only at its first forward, or train wrongly)."""
    from npformer.backend import DEFAULT_DTYPE
    try:
        resolved = resolve_dtype(xp, DEFAULT_DTYPE if dtype is None else dtype)
    except TypeError:
        raise InputTypeError(f"{name}: expected a floating-point dtype (float16, float32, float64, bfloat16), "
                             f"got {dtype!r}, which {xp.__name__} does not know") from None
    if not is_float_dtype(resolved):
        raise InputTypeError(f"{name}: expected a floating-point dtype (float16, float32, float64, bfloat16), "
                             f"got {resolved}")
    return resolved


def expect_int(x: Any, name: str) -> None:
    """``x`` must be an array of an integer dtype (token ids, class targets)."""
    if checked_by_caller():
        return
    expect_array(x, name)
    if x.dtype.kind not in "iu":
        raise InputTypeError(f"{name}: expected an integer array, got {describe(x)}")


def expect_bool_or_float(x: Any, name: str) -> None:
    """A mask: boolean (True = blocked) or floating (added to the scores)."""
    if checked_by_caller():
        return
    expect_array(x, name)
    if x.dtype.kind not in "bf":
        raise InputTypeError(f"{name}: expected a bool mask (True = may not attend) or a float mask "
                             f"(added to the scores), got {describe(x)}")


def expect_ndim(x: Any, name: str, ndim: int | Sequence[int], layout: str = "") -> None:
    """``x.ndim`` must be ``ndim`` (or one of them); ``layout`` such as "(B, T, C)" goes in the message."""
    if checked_by_caller():
        return
    expect_array(x, name)
    allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if x.ndim not in allowed:
        want = " or ".join(str(n) for n in allowed)
        lay = f" {layout}" if layout else ""
        raise ShapeError(f"{name}: expected a {want}-d array{lay}, got {describe(x)}")


def expect_shape(x: Any, name: str, shape: Sequence[int | None], layout: str = "") -> None:
    """``x.shape`` must equal ``shape``; ``None`` entries match any size."""
    if checked_by_caller():
        return
    expect_array(x, name)
    if x.ndim != len(shape) or not all(want is None or want == size for want, size in zip(shape, x.shape)):
        want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ("," if len(shape) == 1 else "") + ")"
        lay = f" {layout}" if layout else ""
        raise ShapeError(f"{name}: expected shape {want}{lay}, got {describe(x)}")


def expect_rows(x: Any, name: str, layout: str = "(..., N)") -> None:
    """``x`` must have at least one axis and a non-empty last one: rows for an op that reduces
    along the last axis (softmax, layer norm)."""
    if checked_by_caller():
        return
    expect_array(x, name)
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ShapeError(f"{name}: expected rows {layout} with at least one value each (the op "
                         f"reduces along the last axis), got {describe(x)}")


def expect_same_dtype(**arrays: Any) -> None:
    """All non-None arrays share one dtype (float32 in gives float32 out; nothing is promoted silently)."""
    if checked_by_caller():
        return
    first_name = first = None
    for k, v in arrays.items():
        if v is None:
            continue
        if first is None:
            first_name, first = k, v
        elif v.dtype != first.dtype:
            _dtype_mismatch(first_name, first, k, v)


def _dtype_mismatch(first_name: str, first: Any, name: str, x: Any) -> None:
    raise InputTypeError(f"dtype mismatch: {first_name} is {first.dtype} but {name} is {x.dtype}; "
                         "cast them to one dtype first")


def expect_same_float(**arrays: Any) -> None:
    """An op's array inputs, checked together (None entries skipped): each a floating-point array,
    all of one dtype (float32 in gives float32 out; nothing is promoted silently) and of one backend
    (NumPy and CuPy are not mixed). The errors of :func:`expect_float` on each, then
    :func:`expect_same_dtype` and ``get_array_module``, in one call for the whole set."""
    if checked_by_caller():
        return
    given = {name: a for name, a in arrays.items() if a is not None}
    for name, a in given.items():
        expect_float(a, name)
    if not given:
        return
    first_name, first = next(iter(given.items()))
    for name, a in given.items():
        if a.dtype != first.dtype:
            _dtype_mismatch(first_name, first, name, a)
    get_array_module(*given.values())           # raises on NumPy arrays mixed with CuPy ones


def expect_grad(d: Any, name: str, shape: Sequence[int], dtype: Any, what: str = "the forward's output") -> None:
    """An upstream gradient must have exactly the shape and the dtype of what it is the gradient of:
    no broadcasting, and no promotion (a float64 gradient for a float32 forward is a mistake)."""
    if checked_by_caller():
        return
    expect_array(d, name)
    if tuple(d.shape) != tuple(shape):
        raise ShapeError(f"{name}: expected the shape of {what}, {tuple(shape)}, got {describe(d)}")
    if d.dtype != dtype:
        raise InputTypeError(f"{name}: expected the dtype of {what}, {dtype}, got {describe(d)}; "
                             "cast it first (nothing is promoted silently)")


def expect_row_buffer(g: Any, name: str, like: Any) -> None:
    """An output array a kernel writes whole rows into (``dq`` for ``q``, say; a view of a larger
    array allowed): ``like``'s shape and dtype, its last axis contiguous and no axis running backwards."""
    if checked_by_caller():
        return
    expect_grad(g, name, like.shape, like.dtype, what=name[1:] if name.startswith("d") else name)
    if g.size and (g.strides[-1] != g.itemsize or min(g.strides, default=0) < 0):   # (empty: no rows)
        raise ShapeError(f"{name}: expected a contiguous last axis to write rows into (and no negative "
                         f"stride), got strides {g.strides}")


def token_ids(ids: Any, name: str, vocab_size: int | None = None, ndim: int = 2) -> None:
    """``ids`` must be an integer array of ``ndim`` axes ((B, T) by default) with every id in
    [0, ``vocab_size``) when a vocabulary size is given."""
    expect_int(ids, name)
    expect_ndim(ids, name, ndim, "(B, T) of token ids" if ndim == 2 else "of token ids")
    if vocab_size is not None:
        ids_below(ids, name, vocab_size, f"a vocabulary of {vocab_size}")


def ids_below(ids: Any, name: str, n: int, of: str) -> None:
    """Every entry of the integer array ``ids`` in [0, n) (``of`` says what n counts, for the message).
    A check of values: skipped under :func:`values_unchecked`, as every such check here."""
    if ids.size and values_checked():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= n:
            raise RangeError(f"{name}: token ids must be in [0, {n}) for {of}, got values from {lo} to {hi}")


def class_ids(targets: Any, valid: Any, n: int, ignore_index: int) -> None:
    """Every ``targets`` entry where ``valid`` (not ``ignore_index``) is a class id in [0, n). A check of
    values: skipped under :func:`values_unchecked`."""
    if not values_checked():
        return
    bad = valid & ((targets < 0) | (targets >= n))                               # (...)
    if bool(bad.any()):
        raise RangeError(f"targets: class ids must be in [0, {n}) or ignore_index={ignore_index}, "
                         f"got {int(targets[bad].reshape(-1)[0])} (V={n})")


# -- scalars -----------------------------------------------------------------------------------------

def integer(v: Any, name: str) -> int:
    """``v`` as an ``int`` (any sign: an ignore index, an offset); bools and floats are refused,
    so 0.5 never truncates to 0."""
    if isinstance(v, bool) or not isinstance(v, Integral):
        raise InputTypeError(f"{name}: expected an int, got {describe(v)}")
    return int(v)


def boolean(v: Any, name: str) -> bool:
    """``v``, which must be a ``bool`` (a flag read from a file: the string "false" or the number 0
    are not flags, where ``bool()`` would make "false" True)."""
    if not isinstance(v, bool):
        raise InputTypeError(f"{name}: expected true or false, got {describe(v)}")
    return v


def positive_int(v: Any, name: str) -> int:
    """``v`` as an ``int`` >= 1 (a size, a count of layers or heads); bools are not ints here."""
    n = integer(v, name)
    if n < 1:
        raise RangeError(f"{name}: expected an int >= 1, got {n}")
    return n


def non_negative_int(v: Any, name: str) -> int:
    """``v`` as an ``int`` >= 0 (a length that may be empty, a memory size)."""
    n = integer(v, name)
    if n < 0:
        raise RangeError(f"{name}: expected an int >= 0, got {n}")
    return n


def _span(low: float, high: float, low_open: bool, high_open: bool) -> str:
    """"in [0, 1]", "> 0", "<= 5" or "" for the bounds of :func:`real`."""
    if math.isinf(low) and math.isinf(high):
        return ""
    if math.isinf(high):
        return f" {'>' if low_open else '>='} {low:g}"
    if math.isinf(low):
        return f" {'<' if high_open else '<='} {high:g}"
    return f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def real(v: Any, name: str, low: float = -math.inf, high: float = math.inf, *, low_open: bool = False,
         high_open: bool = False, what: str = "a finite number") -> float:
    """``v`` as a finite ``float`` in [low, high] (an end excluded with ``low_open``/``high_open``).

    NaN and infinities are never accepted, whatever the bounds (a learning rate of inf is a mistake).
    """
    if isinstance(v, (bool, str)) or not isinstance(v, Real) and not (hasattr(v, "__float__")
                                                                     and getattr(v, "ndim", 0) == 0):
        raise InputTypeError(f"{name}: expected a real number, got {describe(v)}")
    f = float(v)
    inside = (low < f if low_open else low <= f) and (f < high if high_open else f <= high)
    if not math.isfinite(f) or not inside:
        raise RangeError(f"{name}: expected {what}{_span(low, high, low_open, high_open)}, got {v!r}")
    return f


def positive_in_dtype(v: Any, name: str, dtype: Any) -> float:
    """``v`` as a finite ``float`` > 0 that stays > 0 rounded to ``dtype``, the dtype it is added in
    (an eps: 1e-50 > 0, but float32 rounds it to 0, and a constant row's 0 / sqrt(0 + 0) is NaN)."""
    f = real(v, name, 0.0, low_open=True)
    if not dtype.type(f) > 0:
        raise RangeError(f"{name}: expected a number that stays > 0 in {dtype}, the dtype it is added in, "
                         f"got {v!r}, which {dtype} rounds to 0")
    return f


def probability(v: Any, name: str) -> float:
    """``v`` as a ``float`` in [0, 1] (a dropout rate, label smoothing)."""
    return real(v, name, 0.0, 1.0, what="a probability")


def one_of(v: Any, name: str, choices: Sequence[Any]) -> Any:
    """``v`` must be one of ``choices`` (an activation, a reduction, a mode); returns it."""
    try:
        ok = v in choices
    except TypeError:                      # an unhashable value against a dict's keys
        ok = False
    if not ok:
        raise RangeError(f"{name}: expected one of {', '.join(repr(c) for c in choices)}, got {v!r}")
    return v

"""Which implementation of an op runs: the reference in :mod:`npformer.ops`, or a fast path.

A reference op is the math written plainly. Where a faster implementation exists (CPU blocks, a
fused CUDA kernel: :mod:`npformer.kernels`), the reference op is marked ``@dispatched``::

    @dispatched
    def softmax_forward(x):
        ...                                   # the reference: what a reader reads

and the fast path is registered against it (``register(softmax_forward, "cpu", fast_fn, accepts)``)
with the same signature and cache types. A call runs the first registered fast path whose
``accepts(*args, **kwargs)`` says yes, or the reference when none does or fast paths are switched
off. Either backward accepts either forward's cache. ``accepts`` is usually :func:`takes`: a test
of some of the op's arguments, named, which register() looks up in the reference's signature once
(so the test never restates the op's defaults, and a keyword added to the op changes nothing)::

    register(layer_norm_forward, "cpu", fast_fn, takes(numpy_floats, "x", "weight", "bias"))
    register(softmax_backward, "cpu", fast_fn, takes(numpy_floats, "dy", "cache.y"))   # a cache field

The switch::

    with npformer.kernels.disabled():       # the reference ops alone, everywhere inside
        ...

is per thread (a ``contextvars`` variable), defaults to on, and is never read from the
environment. Named, it switches off only the fast paths of those names, the others still run::

    with npformer.kernels.disabled("numba"):  # the NumPy fast paths (and the reference elsewhere)
        ...
 :func:`implementation` tells which one a call would run.

Every reference op passes through here, fast path or not, which makes this also where an op nested
in another learns that its caller checked its arrays (:func:`npformer.checks.checked_by_caller`: each
array is checked once per public call), and the place of the opt-in anomaly mode (as ``torch.autograd.detect_anomaly``)::

    with npformer.detect_anomaly():           # off by default: NaN in gives NaN out, silently
        loss = ...; model.backward(...)

Inside it, the first op (forward or backward) whose result holds a NaN, or an infinity that none of
its inputs held (masked scores and log-probabilities carry -inf on purpose), raises
:class:`~npformer.errors.NonFiniteError` naming the op and the output, and saying whether its inputs
were already non-finite. Ops nested in others are checked first, so the innermost op is named.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple

from npformer.backend import get_array_module, is_float_dtype
from npformer.checks import inputs_checked
from npformer.errors import NonFiniteError

__all__ = ["FastPath", "Takes", "takes", "dispatched", "register", "enabled", "set_enabled", "disabled",
           "implementation", "registered", "dispatched_ops", "detect_anomaly", "anomaly_detection_enabled"]

_ON = contextvars.ContextVar("npformer_fast_paths", default=True)
_OFF_NAMES = contextvars.ContextVar("npformer_fast_paths_off", default=frozenset())
_ANOMALY = contextvars.ContextVar("npformer_detect_anomaly", default=False)
_OPS: dict[str, Callable] = {}        # "module.name" -> the dispatched op, in definition order


class FastPath(NamedTuple):
    """One implementation standing in for a reference op on the inputs ``accepts`` says yes to."""

    name: str                          # "cpu", "cuda": shown by implementation() and the benchmarks
    run: Callable[..., Any]
    accepts: Callable[..., bool]


class Takes(NamedTuple):
    """``check(*values)`` over the op's arguments ``names`` (a name, or ``name.field`` for a field of
    that argument, None where it has none), as :func:`takes` makes it."""

    check: Callable[..., bool]
    names: tuple[str, ...]


def takes(check: Callable[..., bool], *names: str) -> Takes:
    """A fast path's acceptance test: ``check`` of the values of the op's arguments ``names``, each as
    the call gave it or the reference's default (see the module docstring)."""
    return Takes(check, names)


_MISSING = object()


def _argument_test(reference: Callable, spec: Takes) -> Callable[..., bool]:
    """``spec`` as ``accepts(*args, **kwargs)``: where each named argument sits in ``reference``'s
    signature (found once, here: a name the op lacks is a TypeError now, not at a call). A required
    argument left out gives False, and the reference then raises its own error."""
    parameters = inspect.signature(reference).parameters
    positional = [n for n, p in parameters.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    plan = []
    for name in spec.names:
        arg, *fields = name.split(".")
        if arg not in parameters:
            raise TypeError(f"{reference.__module__}.{reference.__name__} has no argument {arg!r} "
                            f"(a fast path's takes(..., {name!r}))")
        p = parameters[arg]
        plan.append((positional.index(arg) if arg in positional else len(parameters), arg,
                     _MISSING if p.default is p.empty else p.default, tuple(fields)))
    check = spec.check

    def accepts(*args, **kwargs) -> bool:
        values = []
        for position, arg, default, fields in plan:
            value = args[position] if position < len(args) else kwargs.get(arg, default)
            if value is _MISSING:
                return False
            for field in fields:
                value = getattr(value, field, None)
            values.append(value)
        return check(*values)

    accepts.__qualname__ = f"takes({getattr(check, '__qualname__', check)}, {', '.join(map(repr, spec.names))})"
    return accepts


def dispatched(reference: Callable) -> Callable:
    """Mark ``reference`` as an op that registered fast paths may stand in for.

    The returned function keeps the reference's name, docstring and signature, and has two more
    attributes: ``reference`` (the plain function) and ``fast_paths`` (the registered ones, in order).
    """
    paths: list[FastPath] = []

    name = f"{reference.__module__}.{reference.__name__}"

    @functools.wraps(reference)
    def op(*args, **kwargs):
        run = reference
        if paths and _ON.get():
            off = _OFF_NAMES.get()
            for path in paths:
                if path.name not in off and path.accepts(*args, **kwargs):
                    run = path.run
                    break
        with inputs_checked():                       # the ops this one calls trust its checks (npformer.checks)
            result = run(*args, **kwargs)
        if _ANOMALY.get():
            _check_finite(name, (*args, *kwargs.values()), result)
        return result

    op.reference = reference
    op.fast_paths = paths
    _OPS[name] = op
    return op


def register(op: Callable, name: str, run: Callable, accepts: Callable[..., bool] | Takes) -> None:
    """Add a fast path ``run`` for the dispatched ``op``, tried after those registered before it;
    ``accepts`` a function of the op's arguments, or :func:`takes`."""
    if not hasattr(op, "fast_paths"):
        raise TypeError(f"{getattr(op, '__qualname__', op)!r} is not marked @dispatched: a fast path "
                        "can only stand in for a dispatched reference op")
    if any(p.name == name for p in op.fast_paths):
        raise ValueError(f"{op.__module__}.{op.__name__} already has a fast path named {name!r}")
    if isinstance(accepts, Takes):
        accepts = _argument_test(op.reference, accepts)
    op.fast_paths.append(FastPath(name, run, accepts))


def enabled() -> bool:
    """Whether fast paths may run in this thread (True unless switched off)."""
    return _ON.get()


def set_enabled(flag: bool) -> None:
    """Switch the fast paths on or off for this thread from now on (``disabled()`` for a block)."""
    if not isinstance(flag, bool):
        raise TypeError(f"expected True or False, got {flag!r}")
    _ON.set(flag)


@contextmanager
def disabled(*names: str) -> Iterator[None]:
    """Run only the reference ops inside the block (in this thread), or with ``names`` ("numba",
    "cpu", "cuda"), every fast path but those; restores the switch after."""
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"disabled: expected fast-path names (str), got {name!r}")
    var, value = (_OFF_NAMES, _OFF_NAMES.get() | frozenset(names)) if names else (_ON, False)
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def implementation(op: Callable, *args, **kwargs) -> str:
    """The name of what ``op(*args, **kwargs)`` would run: a fast path's name or ``"reference"``."""
    if _ON.get():
        off = _OFF_NAMES.get()
        for path in getattr(op, "fast_paths", ()):
            if path.name not in off and path.accepts(*args, **kwargs):
                return path.name
    return "reference"


def registered() -> dict[str, list[str]]:
    """Every dispatched op by ``module.name``, with the names of its fast paths in order."""
    return {name: [p.name for p in op.fast_paths] for name, op in _OPS.items()}


def dispatched_ops() -> dict[str, Callable]:
    """Every dispatched op by ``module.name`` (each with its ``reference`` and ``fast_paths`` list)."""
    return dict(_OPS)


@contextmanager
def detect_anomaly() -> Iterator[None]:
    """Inside the block (this thread), the first op with a non-finite result raises
    :class:`~npformer.errors.NonFiniteError` naming it (see the module docstring)."""
    token = _ANOMALY.set(True)
    try:
        yield
    finally:
        _ANOMALY.reset(token)


def anomaly_detection_enabled() -> bool:
    return _ANOMALY.get()


def _arrays(values) -> list:
    """The arrays among ``values``, and those one level inside a cache (a NamedTuple)."""
    found = []
    for v in values:
        if hasattr(v, "dtype") and hasattr(v, "shape"):
            found.append(v)
        elif isinstance(v, tuple) and hasattr(v, "_fields"):
            found += [f for f in v if hasattr(f, "dtype") and hasattr(f, "shape")]
    return [a for a in found if is_float_dtype(a.dtype)]


def _check_finite(name: str, inputs: tuple, result) -> None:
    outputs = result if isinstance(result, tuple) and not hasattr(result, "_fields") else (result,)
    ins = _arrays(inputs)
    for i, out in enumerate(outputs):
        if not (hasattr(out, "dtype") and hasattr(out, "shape")) or not is_float_dtype(out.dtype):
            continue                                     # a cache, None, an integer array
        xp = get_array_module(out)
        nan, inf = bool(xp.isnan(out).any()), bool(xp.isinf(out).any())
        had_nan = any(bool(xp.isnan(a).any()) for a in ins)
        had_inf = any(bool(xp.isinf(a).any()) for a in ins)
        if nan or (inf and not had_inf):
            what = "NaN" if nan else "an infinity"
            came = ("its inputs already held NaN: look at what produced them" if had_nan else
                    "its inputs held none: this op produced it")
            raise NonFiniteError(f"detect_anomaly: {name} returned {what} in output {i} "
                                 f"({out.dtype} array of shape {tuple(out.shape)}); {came}")

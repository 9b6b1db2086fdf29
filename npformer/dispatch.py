"""Which implementation of an op runs: the reference in :mod:`npformer.ops`, or a fast path.

A reference op is the math written plainly. Where a faster implementation exists (CPU blocks, a
fused CUDA kernel: :mod:`npformer.kernels`), the reference op is marked ``@dispatched``::

    @dispatched
    def softmax_forward(x):
        ...                                   # the reference: what a reader reads

and the fast path is registered against it (``register(softmax_forward, "cpu", fast_fn, accepts)``)
with the same signature and cache types. A call runs the first registered fast path whose
``accepts(*args, **kwargs)`` says yes, or the reference when none does or fast paths are switched
off. Either backward accepts either forward's cache. The switch::

    with npformer.kernels.disabled():       # the reference ops alone, everywhere inside
        ...

is per thread (a ``contextvars`` variable), defaults to on, and is never read from the
environment. :func:`implementation` tells which one a call would run.
"""
from __future__ import annotations

import contextvars
import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple

__all__ = ["FastPath", "dispatched", "register", "enabled", "set_enabled", "disabled", "implementation",
           "registered"]

_ON = contextvars.ContextVar("npformer_fast_paths", default=True)
_OPS: dict[str, Callable] = {}        # "module.name" -> the dispatched op, in definition order


class FastPath(NamedTuple):
    """One implementation standing in for a reference op on the inputs ``accepts`` says yes to."""

    name: str                          # "cpu", "cuda": shown by implementation() and the benchmarks
    run: Callable[..., Any]
    accepts: Callable[..., bool]


def dispatched(reference: Callable) -> Callable:
    """Mark ``reference`` as an op that registered fast paths may stand in for.

    The returned function keeps the reference's name, docstring and signature, and has two more
    attributes: ``reference`` (the plain function) and ``fast_paths`` (the registered ones, in order).
    """
    paths: list[FastPath] = []

    @functools.wraps(reference)
    def op(*args, **kwargs):
        if paths and _ON.get():
            for path in paths:
                if path.accepts(*args, **kwargs):
                    return path.run(*args, **kwargs)
        return reference(*args, **kwargs)

    op.reference = reference
    op.fast_paths = paths
    _OPS[f"{reference.__module__}.{reference.__name__}"] = op
    return op


def register(op: Callable, name: str, run: Callable, accepts: Callable[..., bool]) -> None:
    """Add a fast path ``run`` for the dispatched ``op``, tried after those registered before it."""
    if not hasattr(op, "fast_paths"):
        raise TypeError(f"{getattr(op, '__qualname__', op)!r} is not marked @dispatched: a fast path "
                        "can only stand in for a dispatched reference op")
    if any(p.name == name for p in op.fast_paths):
        raise ValueError(f"{op.__module__}.{op.__name__} already has a fast path named {name!r}")
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
def disabled() -> Iterator[None]:
    """Run only the reference ops inside the block (in this thread); restores the switch after."""
    token = _ON.set(False)
    try:
        yield
    finally:
        _ON.reset(token)


def implementation(op: Callable, *args, **kwargs) -> str:
    """The name of what ``op(*args, **kwargs)`` would run: a fast path's name or ``"reference"``."""
    if _ON.get():
        for path in getattr(op, "fast_paths", ()):
            if path.accepts(*args, **kwargs):
                return path.name
    return "reference"


def registered() -> dict[str, list[str]]:
    """Every dispatched op by ``module.name``, with the names of its fast paths in order."""
    return {name: [p.name for p in op.fast_paths] for name, op in _OPS.items()}

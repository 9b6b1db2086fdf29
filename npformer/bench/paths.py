"""The npformer paths a case runs on, and which fast paths a call actually ran.

* ``"fast"``: every registered fast path that accepts its arguments (:data:`npformer.kernels.FAST_PATHS`);
* ``"numpy"``: the fast paths without numba's (``npformer.kernels.disabled("numba")``): what the
  README's install, NumPy alone, runs; asked for with ``--paths``;
* ``"reference"``: the plain ops alone, inside ``npformer.kernels.disabled()``.

:data:`PATHS` are the ones a run times unless ``--paths`` says otherwise (:data:`KNOWN` all of them).

:func:`fast_paths_run` calls a function once and names the fast paths that ran inside it, so
composite ops (an FFN calling GELU) and whole training steps are labelled as truthfully as a
single op, for which it agrees with ``npformer.kernels.implementation`` (tests/test_bench.py).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, ContextManager

__all__ = ["PATHS", "KNOWN", "switch", "fast_paths_run", "label"]

PATHS = ("fast", "reference")
KNOWN = ("fast", "numpy", "reference")


def switch(path: str) -> ContextManager:
    """The context a call of ``path`` runs in (this thread only, as the switch itself)."""
    from npformer import kernels
    if path == "fast":
        return contextlib.nullcontext()
    if path == "numpy":
        return kernels.disabled("numba")
    if path == "reference":
        return kernels.disabled()
    raise ValueError(f"unknown path {path!r}; expected one of {', '.join(KNOWN)}")


def fast_paths_run(fn: Callable[[], Any]) -> list[str] | None:
    """Call ``fn`` once (in this thread) and return ``"<name>:<op>"`` for each fast path that ran,
    sorted; a profile hook watches for the code objects of the functions in the table. Under a
    profiler (which owns the hook: cProfile) ``fn`` runs untraced and the answer is None."""
    from npformer.kernels import FAST_PATHS
    codes = {run.__code__: f"{name}:{op.__name__}" for op, name, run, _ in FAST_PATHS}
    seen: set[str] = set()

    def hook(frame, event, _arg):
        if event == "call" and frame.f_code in codes:
            seen.add(codes[frame.f_code])
    if sys.getprofile() is not None:
        fn()
        return None
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return sorted(seen)


def label(ran: list[str] | None) -> str | None:
    """``"cpu"``, ``"cuda"`` (``"cpu+cuda"`` if both) from :func:`fast_paths_run`'s list,
    ``"reference"`` when no fast path ran, None when it was not traced."""
    if ran is None:
        return None
    return "+".join(sorted({r.split(":")[0] for r in ran})) or "reference"

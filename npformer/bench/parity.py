"""Parity before timing: npformer's results against PyTorch's on the same inputs and weights.

Before a case is timed on an npformer backend and path, its ``outputs`` (forward output and
gradients of an op; logits, loss and gradient norms of a model step, see :mod:`npformer.bench.steps`)
are compared with PyTorch's on the CPU, float32, computed once per case in the same run. A case
that fails is reported as failed and not timed.

The rule, for every compared array ``a`` against its reference ``r``::

    max|a - r| <= RTOL * max|r|              (and the same shape, and every value finite)

RTOL = 2**10 float32 epsilons (1.2e-4). Both sides compute in float32 (eps 1.2e-7) but add in
different orders and use different exp/erf approximations; over the reductions here (up to a few
thousand terms, and a step's dozen layers) that moves results by a few to a few hundred epsilons
of the largest magnitude (measured: at most 2e-6 on every case, full and quick sizes, both paths).
A mistake (a missing term, a wrong scale, a transposed weight) moves them by a good fraction of it.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy

__all__ = ["RTOL", "Parity", "compare", "check", "skipped"]

RTOL = 2 ** 10 * float(numpy.finfo(numpy.float32).eps)


class Parity(NamedTuple):
    status: str            # "pass", "fail", "skipped" (--skip-parity) or "unchecked" (no reference)
    error: float | None    # worst max|a - r| / max|r| over the compared arrays
    detail: str            # the worst array and its figures; the reason of a failure

    @property
    def failed(self) -> bool:
        return self.status == "fail"


def skipped(reason: str, status: str = "skipped") -> Parity:
    return Parity(status, None, reason)


def compare(actual: dict[str, numpy.ndarray], expected: dict[str, numpy.ndarray]) -> Parity:
    """Every array of ``expected`` against the same name in ``actual``, under the rule above."""
    if set(actual) != set(expected):
        return Parity("fail", None, f"compared outputs differ: missing {sorted(set(expected) - set(actual))}, "
                                    f"unexpected {sorted(set(actual) - set(expected))}")
    worst, detail = 0.0, ""
    for name, ref in expected.items():
        a = numpy.asarray(actual[name])
        if a.shape != ref.shape:
            return Parity("fail", None, f"{name}: shape {a.shape}, reference {ref.shape}")
        if not numpy.isfinite(a).all():
            return Parity("fail", None, f"{name}: {int((~numpy.isfinite(a)).sum())} values not finite")
        scale = float(numpy.abs(ref).max(initial=0.0)) or 1.0
        diff = float(numpy.abs(a.astype(numpy.float64) - ref.astype(numpy.float64)).max(initial=0.0))
        if diff / scale >= worst:
            worst = diff / scale
            detail = f"{name}: max abs diff {diff:.3g} = {worst:.2g} of max abs ref {scale:.3g}"
    ok = worst <= RTOL
    return Parity("pass" if ok else "fail", worst, detail + ("" if ok else f" > tolerance {RTOL:.2g}"))


def check(case, b, expected: dict[str, numpy.ndarray]) -> Parity:
    """``case``'s outputs on backend ``b`` (in the current path) against ``expected``; an exception
    raised by npformer is a failure too, reported with its message."""
    try:
        actual = case.outputs(b)
    except Exception as exc:                              # noqa: BLE001 - reported, never hidden
        return Parity("fail", None, f"raised {type(exc).__name__}: {exc}")
    return compare(actual, expected)

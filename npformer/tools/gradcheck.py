"""Finite-difference gradient checks for hand-written backward passes.

The fake loss is ``L = sum(out * dout)`` with a random, non-uniform ``dout`` (an all-ones ``dout``
hides terms such as layer norm's ``sum(dout * xhat)``). Its derivative along one input element is
estimated in float64 by the fourth-order central difference (the five-point stencil)::

    dL/dx_i ~ sum((8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) * dout) / (12 h),   h = EPS e_i

Differencing the outputs element by element before the dot product keeps round-off at the level of
each output element instead of the whole sum.

Error measure (CS231n's relative error, with a floor): for each checked element
``rel = |a - n| / max(|a| + |n|, FLOOR)``, and a tensor passes when its worst ``rel`` is below
``TOL``. With ``EPS = 1e-4`` the stencil's truncation error is ``h^4 f^(5) / 30 ~ 1e-17`` and its
round-off about ``2.2e-16 / 1e-4 ~ 2e-12`` times the output scale, summed over the outputs with
random signs (about 1e-11 for tens of O(1) outputs; the plain two-point difference with ``h = 1e-6``
has 1e-10 per output and reached 1e-9 on the multi-head checks, the size of the absolute tolerance).
Elements whose gradient is below ``FLOOR = 1e-3`` are judged by their absolute error
(``TOL * FLOOR = 1e-9``, about a hundred times that noise) instead of a ratio of two noise-sized
numbers. These three constants are stated here once and used by every test; they are never
loosened to make a check pass. Inputs are kept at least ``2 EPS`` away from kinks (ReLU at 0).

Kinks: at a point where the function is not differentiable within reach of the stencil (a ReLU
input within 2 EPS of 0, somewhere inside a model), no finite difference means anything. The two
central differences at h and 2h, or the second differences at h and 2h (times h), then disagree by
more than ``KINK = 1e-2`` of the slope (for a smooth function the gaps are h^2 f^(3) / 2 and
h^3 f^(4) / 4, about 5e-9 f^(3) and 2.5e-13 f^(4)). A kink can also hide from that test when its
jump is small beside the slope (a ReLU input crossing 0 between h and 2h somewhere inside a model
shifts the estimate by far more than TOL while the differences still agree to KINK); so an
estimate that disagrees with the analytic gradient is taken again with a step ten times smaller,
which such a kink is out of reach of, and only an agreeing estimate there makes it a kink.

A kink found at EPS is measured again with steps ``EPS / 10`` and ``EPS / 100`` (a kink at a
distance d from the point is out of reach once 2 h |slope| < d; round-off grows to about 2e-10 of
the output scale at h = 1e-6, still far below TOL), and the first smooth estimate is compared.
Only an element (or direction) that meets a kink at every step is reported "at a kink" and not
compared (a ReLU input at exactly 0); a direction that does is redrawn (up to 4 times). A real error
disagrees at every step, so it is never hidden. The report counts kinks, and a tensor whose every
checked element (or direction) is at a kink fails. (A tiny model's ReLU input 1e-5 from 0 put
every direction of every parameter before it within reach of EPS: seen on a GPU, whose generator
drew other weights than the CPU's.)

Two modes:

* ``elements``: every element of each tensor (ops on small shapes), or a seeded random sample of
  ``max_elements`` per tensor (CS231n's ``grad_check_sparse``);
* ``direction``: one random direction ``v`` per tensor, comparing ``<grad, v>`` with the same
  stencil along ``v`` (chainer's ``check_backward``): four forward calls per tensor, for whole models.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy  # host side only: sampling indices and the upstream gradient

from npformer.backend import get_array_module, is_array
from npformer.checks import describe, expect_grad, non_negative_int, one_of, positive_int, real
from npformer.errors import InputTypeError
from npformer.nn.module import Module, no_grad

EPS = 1e-4
TOL = 1e-6
FLOOR = 1e-3
KINK = 1e-2

__all__ = ["EPS", "TOL", "FLOOR", "KINK", "TensorCheck", "GradcheckReport", "GradcheckError",
           "check_gradients", "gradcheck", "gradcheck_module"]


class GradcheckError(AssertionError):
    """A hand-written gradient disagrees with finite differences (or has the wrong shape/dtype)."""


@dataclass(frozen=True)
class TensorCheck:
    """The result for one differentiable tensor."""

    name: str
    shape: tuple
    worst_rel_error: float
    worst_index: tuple | None   # element index, or None in direction mode
    analytic: float             # the hand-written value at the worst index (or <grad, v>)
    numeric: float              # the finite-difference value there
    n_checked: int
    problem: str = ""           # shape/dtype/mutation failure, empty when none
    n_kinks: int = 0            # elements at a non-differentiable point, not compared

    @property
    def passed(self) -> bool:
        return not self.problem and self.worst_rel_error < TOL


@dataclass
class GradcheckReport:
    """All tensors of one check, with the settings needed to reproduce it."""

    label: str
    checks: list[TensorCheck]
    eps: float = EPS
    tol: float = TOL
    floor: float = FLOOR
    seed: int = 0
    mode: str = "elements"
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems and all(c.passed for c in self.checks)

    @property
    def worst(self) -> float:
        """The worst relative error over all tensors (0.0 when nothing was checked)."""
        return max((c.worst_rel_error for c in self.checks), default=0.0)

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        """(label, tensor, shape, worst relative error, PASS/FAIL) per tensor, for tables."""
        return [(self.label, c.name, str(c.shape), f"{c.worst_rel_error:.2e}",
                 "PASS" if c.passed and not self.problems else "FAIL") for c in self.checks]

    def __str__(self) -> str:
        lines = [f"gradcheck {self.label} (mode={self.mode}, eps={self.eps:g}, tol={self.tol:g}, "
                 f"floor={self.floor:g}, seed={self.seed})"]
        for c in self.checks:
            where = "" if c.worst_index is None else f" at {c.worst_index}"
            status = "ok" if c.passed else "FAIL"
            lines.append(f"  {status:4} {c.name:16} {str(c.shape):18} rel={c.worst_rel_error:.3e}{where} "
                         f"analytic={c.analytic:.12g} numeric={c.numeric:.12g} ({c.n_checked} checked"
                         + (f", {c.n_kinks} at a kink, not compared" if c.n_kinks else "") + ")"
                         + (f" [{c.problem}]" if c.problem else ""))
        lines.extend(f"  FAIL {p}" for p in self.problems)
        return "\n".join(lines)

    def raise_if_failed(self) -> "GradcheckReport":
        if not self.passed:
            raise GradcheckError(str(self))
        return self


def _settings(mode: Any, eps: Any, max_elements: Any, seed: Any) -> tuple[str, float, int | None, int]:
    """The checks' settings, checked (npformer errors) and converted: ``mode`` one of the two modes,
    ``eps`` a finite number > 0 (0 divides by zero, NaN made every element a kink), ``max_elements``
    None or an int >= 1, ``seed`` an int >= 0 (NumPy's generator takes no negative seed)."""
    mode = one_of(mode, "mode", ("elements", "direction"))
    eps = real(eps, "eps", 0.0, low_open=True)
    max_elements = None if max_elements is None else positive_int(max_elements, "max_elements")
    return mode, eps, max_elements, non_negative_int(seed, "seed")


def _arrays(inputs: Any, name: str) -> dict:
    """``inputs`` as a dict of name -> array (lists and other containers are not converted)."""
    if not isinstance(inputs, Mapping):
        raise InputTypeError(f"{name}: expected a dict of name -> float64 array, got {describe(inputs)}")
    for k, v in inputs.items():
        if not is_array(v):
            raise InputTypeError(f"{name}[{k!r}]: expected a numpy or cupy array (float64 to be checked), "
                                 f"got {describe(v)}")
    return dict(inputs)


def _relative_error(a, n, xp):
    return xp.abs(a - n) / xp.maximum(xp.abs(a) + xp.abs(n), FLOOR)


def _stencil(run, set_offset, dout, eps, base):
    """Five-point central difference of ``sum(run() * dout)`` along ``set_offset``, and whether the
    function looked smooth there. ``base`` is the unperturbed output. Smooth means: the central
    differences at h and 2h agree, and so do the second differences at h and 2h (a kink exactly at
    the point makes them 1/h and 1/2h: a jump J in the slope shows as h |S1 - S2| = J / 2)."""
    outs = {}
    for k in (1, -1, 2, -2):
        set_offset(k * eps)
        outs[k] = run()
    set_offset(0.0)

    def dot(a):
        return float((a * dout).sum())
    d1 = dot(outs[1] - outs[-1]) / (2 * eps)
    d2 = dot(outs[2] - outs[-2]) / (4 * eps)
    s1 = dot(outs[1] - 2 * base + outs[-1]) / eps ** 2
    s2 = dot(outs[2] - 2 * base + outs[-2]) / (4 * eps ** 2)
    estimate = dot(8 * (outs[1] - outs[-1]) - (outs[2] - outs[-2])) / (12 * eps)
    scale = KINK * max(abs(d1), abs(d2), FLOOR)
    smooth = abs(d1 - d2) <= scale and eps * abs(s1 - s2) <= scale
    return estimate, smooth


SMALLER_STEPS = (10, 100)     # a kink met at eps is measured again at eps / 10 and eps / 100


def _measured(estimate_at, analytic: float, eps: float) -> tuple[float, bool]:
    """The estimate to compare with ``analytic`` and whether there is one (module docstring: a
    disagreement at ``eps`` that agrees at ``eps / 10`` is a hidden kink; a kink is measured again
    at the smaller steps, and the first smooth estimate counts)."""
    n, smooth = estimate_at(eps)
    if smooth and _relative_error(analytic, n, numpy) > TOL:
        finer, finer_smooth = estimate_at(eps / SMALLER_STEPS[0])
        if finer_smooth and _relative_error(analytic, finer, numpy) <= TOL:
            return finer, True                           # a hidden kink, out of reach at eps / 10
    if smooth:
        return n, True
    for k in SMALLER_STEPS:
        finer, finer_smooth = estimate_at(eps / k)
        if finer_smooth:
            return finer, True
    return n, False


def _numeric_element(run, x, idx, dout, eps, base):
    saved = x[idx].copy()

    def set_offset(h):
        x[idx] = saved + h if h else saved
    return _stencil(run, set_offset, dout, eps, base)


def _numeric_direction(run, x, v, dout, eps, base):
    saved = x.copy()

    def set_offset(h):
        x[...] = saved + h * v if h else saved
    return _stencil(run, set_offset, dout, eps, base)


def check_gradients(run: Callable[[], Any], arrays: Mapping[str, Any], analytic: Mapping[str, Any],
                    dout: Any, *, mode: str = "elements", max_elements: int | None = None,
                    eps: float = EPS, seed: int = 0, label: str = "") -> GradcheckReport:
    """Compare ``analytic`` gradients with finite differences of ``sum(run() * dout)``.

    ``run()`` computes the output from the float64 ``arrays`` (which it reads in place: inputs of an
    op, or a module's parameters); each array is perturbed in place and restored bit for bit.
    ``analytic[name]`` is the hand-written gradient of ``arrays[name]``. ``eps`` is a finite number > 0,
    ``max_elements`` None or an int >= 1, ``seed`` an int >= 0 (npformer errors otherwise).
    """
    mode, eps, max_elements, seed = _settings(mode, eps, max_elements, seed)
    arrays = _arrays(arrays, "arrays")
    host_rng = numpy.random.default_rng(seed)
    base = run()                                         # the unperturbed output, for kink detection
    checks = []
    for name, x in arrays.items():
        xp = get_array_module(x)
        if x.dtype != xp.float64:
            raise InputTypeError(f"gradcheck needs float64 arrays; {name} is {x.dtype}")
        g = analytic.get(name)
        if g is None:
            checks.append(TensorCheck(name, tuple(x.shape), float("inf"), None, float("nan"),
                                      float("nan"), 0, "backward returned no gradient"))
            continue
        problem = ""
        if not is_array(g):
            problem = f"backward returned {describe(g)}, not an array"
        elif tuple(g.shape) != tuple(x.shape):
            problem = f"gradient shape {tuple(g.shape)} != input shape {tuple(x.shape)}"
        elif g.dtype != x.dtype:
            problem = f"gradient dtype {g.dtype} != input dtype {x.dtype}"
        if problem:
            checks.append(TensorCheck(name, tuple(x.shape), float("inf"), None, float("nan"),
                                      float("nan"), 0, problem))
            continue
        if mode == "direction":
            kinks = 0
            for _ in range(5):                           # a direction at a kink at every step is redrawn
                v = xp.asarray(host_rng.standard_normal(x.shape))
                a = float((g * v).sum())
                n, smooth = _measured(lambda e, v=v: _numeric_direction(run, x, v, dout, e, base), a, eps)
                if smooth:
                    break
                kinks += 1
            rel = abs(a - n) / max(abs(a) + abs(n), FLOOR)
            checks.append(TensorCheck(name, tuple(x.shape), rel, None, a, n, 1,
                                      "" if smooth else "every direction tried met a kink", kinks))
            continue
        size = int(x.size)
        flat = range(size) if max_elements is None or size <= max_elements else \
            sorted(host_rng.choice(size, size=max_elements, replace=False).tolist())
        idxs = [tuple(int(i) for i in numpy.unravel_index(k, x.shape)) for k in flat]
        ana = numpy.array([float(g[idx]) for idx in idxs])
        results = [_measured(lambda e, idx=idx: _numeric_element(run, x, idx, dout, e, base), a, eps)
                   for idx, a in zip(idxs, ana)]
        smooth = numpy.array([ok for _, ok in results], dtype=bool)
        numeric = numpy.array([n for n, _ in results])
        rel = numpy.where(smooth, _relative_error(ana, numeric, numpy), -1.0)   # kinks not compared
        worst = int(numpy.argmax(rel)) if rel.size else 0
        kinks = int((~smooth).sum())
        problem = "every checked element is at a kink" if idxs and kinks == len(idxs) else ""
        checks.append(TensorCheck(name, tuple(x.shape), max(float(rel[worst]), 0.0) if rel.size else 0.0,
                                  idxs[worst] if idxs else None,
                                  float(ana[worst]) if rel.size else 0.0,
                                  float(numeric[worst]) if rel.size else 0.0, len(idxs), problem, kinks))
    return GradcheckReport(label, checks, eps=eps, seed=seed, mode=mode)


def _array_fields(obj: Any) -> dict:
    """The arrays reachable from a cache (NamedTuple, tuple, list, dict), keyed by their path."""
    found = {}

    def walk(o, path):
        if hasattr(o, "shape") and hasattr(o, "dtype") and hasattr(o, "copy"):
            found[path] = o
        elif isinstance(o, tuple) and hasattr(o, "_fields"):
            for k, v in zip(o._fields, o):
                walk(v, f"{path}.{k}")
        elif isinstance(o, (tuple, list)):
            for i, v in enumerate(o):
                walk(v, f"{path}[{i}]")
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{path}[{k!r}]")

    walk(obj, "cache")
    return found


def _same(a, b) -> bool:
    xp = get_array_module(a, b)
    return a.shape == b.shape and a.dtype == b.dtype and bool(xp.array_equal(a, b, equal_nan=True))


def gradcheck(forward: Callable[..., tuple], backward: Callable[[Any, Any], Any],
              inputs: Mapping[str, Any], *, kwargs: Mapping[str, Any] | None = None,
              dout: Any = None, mode: str = "elements", max_elements: int | None = None,
              eps: float = EPS, seed: int = 0, label: str | None = None) -> GradcheckReport:
    """Check an op pair ``forward(**inputs, **kwargs) -> (out, ..., cache)``, ``backward(dout, cache)``.

    Every floating array in ``inputs`` is differentiable; ``backward`` returns their gradients in
    the order of ``inputs`` (a bare array when there is one; trailing ``None`` entries, such as the
    gradient of an absent bias, are allowed). Integer arrays in ``inputs`` (token ids, targets) and
    everything in ``kwargs`` (masks, flags, generators factories) are held fixed. The check also
    fails when forward or backward mutates an input or backward mutates the cache.

    ``inputs`` is a dict of name -> array; ``forward`` must return a tuple of at least two, the output
    first and the cache last; ``dout`` (None: random, from ``seed``) an array of the output's shape and
    dtype. Those, and the settings (:func:`check_gradients`), raise npformer errors before ``backward``
    is called, so a mistake in them is never reported as the backward's.
    """
    mode, eps, max_elements, seed = _settings(mode, eps, max_elements, seed)
    kwargs = dict(kwargs or {})
    arrays = {k: v.copy() for k, v in _arrays(inputs, "inputs").items()}
    originals = {k: v.copy() for k, v in arrays.items()}
    wrt = [k for k, v in arrays.items() if v.dtype.kind == "f"]
    xp = get_array_module(*arrays.values())
    for k in wrt:
        if arrays[k].dtype != xp.float64:
            raise InputTypeError(f"gradcheck needs float64 arrays; {k} is {arrays[k].dtype}")

    result = forward(**arrays, **kwargs)
    if not isinstance(result, tuple) or len(result) < 2 or not is_array(result[0]):
        raise InputTypeError(f"forward: expected a tuple (out, ..., cache) of at least two, the output array "
                             f"first, got {describe(result)}")
    out, cache = result[0], result[-1]
    if dout is None:
        dout = xp.asarray(numpy.random.default_rng(seed + 7919).standard_normal(out.shape))
    expect_grad(dout, "dout", out.shape, out.dtype)
    cache_before = {k: v.copy() for k, v in _array_fields(cache).items()}
    grads = backward(dout, cache)
    if not isinstance(grads, (tuple, list)):
        grads = (grads,)

    problems = []
    extra = list(grads[len(wrt):])
    if len(grads) < len(wrt) or any(g is not None for g in extra):
        problems.append(f"backward returned {len(grads)} gradients for the {len(wrt)} differentiable "
                        f"inputs {wrt}")
    for k, v in originals.items():
        if not _same(v, arrays[k]):
            problems.append(f"input {k} was mutated by forward or backward")
    for k, v in cache_before.items():
        now = _array_fields(cache)[k]
        if not _same(v, now):
            problems.append(f"{k} was mutated by backward")

    def run():
        return forward(**arrays, **kwargs)[0]

    report = check_gradients(run, {k: arrays[k] for k in wrt}, dict(zip(wrt, grads)), dout,
                             mode=mode, max_elements=max_elements, eps=eps, seed=seed,
                             label=label or getattr(forward, "__name__", "op"))
    report.problems.extend(problems)
    return report


def gradcheck_module(module: Any, inputs: Mapping[str, Any], *,
                     forward: Callable[..., Any] | None = None,
                     backward: Callable[[Any, Any], Any] | None = None,
                     dropout_seed: int | None = None, mode: str = "elements",
                     max_elements: int | None = None, eps: float = EPS, seed: int = 0,
                     label: str | None = None) -> GradcheckReport:
    """Check a module's ``backward``: the gradients of its float ``inputs`` and of every parameter.

    ``forward(module, **inputs) -> out`` defaults to ``module(*inputs.values())``; ``backward(module,
    dout)`` defaults to ``module.backward(dout)`` and returns the input gradients in the order of
    ``inputs`` (a bare array when there is one; None for an input with no gradient, such as token ids).
    The module must hold float64 parameters. With ``dropout_seed`` the dropout generator is reset
    before every forward, so each finite-difference evaluation draws the same masks. Also fails when
    backward leaves saved caches behind (a forward that was not back-propagated).
    """
    if not isinstance(module, Module):
        raise InputTypeError(f"module: expected an npformer Module, got {describe(module)}")
    mode, eps, max_elements, seed = _settings(mode, eps, max_elements, seed)
    forward = forward or (lambda m, **kw: m(*kw.values()))
    backward = backward or (lambda m, d: m.backward(d))
    arrays = _arrays(inputs, "inputs")
    wrt = [k for k, v in arrays.items() if v.dtype.kind == "f"]
    xp = get_array_module(*arrays.values())

    def run_once():
        if dropout_seed is not None:
            module.manual_seed(dropout_seed)
        return forward(module, **arrays)

    module.zero_grad()
    module.clear_saved()
    out = run_once()
    dout = xp.asarray(numpy.random.default_rng(seed + 7919).standard_normal(out.shape))
    grads = backward(module, dout)
    if not isinstance(grads, (tuple, list)):
        grads = (grads,)
    problems = []
    left = sum(len(m._saved) for m in module.modules())
    if left:
        problems.append(f"{left} saved caches left after backward (forward and backward calls unbalanced)")
    analytic = {k: g for k, g in zip(arrays, grads) if k in wrt}
    params = dict(module.named_parameters())
    analytic.update({f"param {k}": v for k, v in module.grads().items()})
    checked = {k: arrays[k] for k in wrt}
    checked.update({f"param {k}": p.data for k, p in params.items()})

    def run():
        with no_grad():
            return run_once()

    report = check_gradients(run, checked, analytic, dout, mode=mode, max_elements=max_elements,
                             eps=eps, seed=seed, label=label or type(module).__name__)
    report.problems.extend(problems)
    module.zero_grad()
    return report

"""Reproduce the coefficients of npformer's float32 erfs: the NumPy fast path's
(npformer/kernels/cpu/activations.py) and the compiled GELU's (npformer/kernels/numba_cpu/vector_math.py).

    NumPy:     erf(x) = tanh(u(x)),  u(x) = atanh(erf(x)) = x N(x^2) / D(x^2),  N, D of degree 5, D(0) = 1
    compiled:  erf(x) = x P(x^2) / Q(x^2) on |x| <= 3.92 (erf rounds to +-1 in float32 beyond),
               P, Q of degree 5, Q(0) = 1: no exp, one division (the compiled loops' cheapest form)

A rational least-squares fit of f(s) = atanh(erf(x)) / x, s = x^2, on x in (0, 4.25], linearised
as N(s) - f(s) (D(s) - 1) = f(s) and divided by f(s) D_prev(s) so that the residual is the
relative error (an iteration in the style of Loeb / Sanathanan-Koerner), then reweighted by the
error (Lawson) to push the largest relative error down towards the minimax one. The reference
is math.erfc in float64 (atanh(erf) = log((2 - erfc) / erfc) / 2 keeps full precision near 1).

    python benchmarks/fit_erf_float32.py      # prints the coefficients and the worst errors

The coefficients in npformer/kernels/cpu/activations.py are this script's output; npformer uses their float32 roundings,
which do not change if the last float64 digits of a refit differ (another LAPACK).
"""
import math
import os
import sys

import numpy as np

HI, DEG = 4.25, 5
HI_DIRECT = 3.92                                                     # erf(3.92) = 1 - 2.4e-8: 1 in float32


def fit(x, iterations=80, direct=False):
    """The fit of atanh(erf(x)) / x (or, ``direct``, of erf(x) / x) on ``x``; returns (coefficients, worst error)."""
    s = x * x
    erfc = np.array([math.erfc(v) for v in x])
    f = (1.0 - erfc) / x if direct else 0.5 * np.log((2.0 - erfc) / erfc) / x
    vn = np.vander(s, DEG + 1, increasing=True)                     # 1, s, ..., s^5
    vd = vn[:, 1:]                                                   # s, ..., s^5 (D(0) = 1)
    scale = np.concatenate([np.abs(vn).max(0), np.abs(vd).max(0)])  # column scaling
    d_prev, w, best = np.ones_like(s), np.ones_like(s), None
    for it in range(iterations):
        a = np.hstack([vn, -f[:, None] * vd]) / (d_prev * f)[:, None] / scale
        sw = np.sqrt(w)
        c = np.linalg.lstsq(a * sw[:, None], sw / d_prev, rcond=None)[0] / scale
        num, den = vn @ c[:DEG + 1], 1.0 + vd @ c[DEG + 1:]
        err = np.abs(num / den / f - 1.0)
        if best is None or err.max() < best[1]:
            best = (c, err.max())
        d_prev = den
        if it > 8:                                                   # Lawson reweighting
            w *= err / err.mean() + 1e-30
            w /= w.sum()
    return best


def main():
    x = np.linspace(0.0, HI, 80001)[1:]
    c, rel = fit(x)
    print("N:", ", ".join(repr(float(v)) for v in c[:DEG + 1]))
    print("D: 1.0,", ", ".join(repr(float(v)) for v in c[DEG + 1:]))
    print(f"worst relative error of u on (0, {HI}]: {rel:.2e}; all coefficients positive: {bool((c > 0).all())}")
    x32 = np.linspace(-6, 6, 1_200_001).astype(np.float32)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from npformer.kernels.cpu.activations import erf_float32
    ref = np.array([math.erf(v) for v in x32.astype(np.float64)])
    spacing = np.maximum(np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64), 2.0 ** -149)
    ulp = np.abs(erf_float32(x32).astype(np.float64) - ref) / spacing
    print(f"npformer float32 erf on [-6, 6]: worst {ulp.max():.2f} ulp, {np.mean(ulp <= 1):.1%} within one ulp")

    xd = np.linspace(0.0, HI_DIRECT, 40001)[1:]
    c, rel = fit(xd, iterations=60, direct=True)
    print("\ncompiled GELU's erf = x P(x^2) / Q(x^2):")
    print("P:", ", ".join(repr(float(v)) for v in c[:DEG + 1]))
    print("Q: 1.0,", ", ".join(repr(float(v)) for v in c[DEG + 1:]))
    print(f"worst relative error on (0, {HI_DIRECT}]: {rel:.2e}; all coefficients positive: {bool((c > 0).all())}")
    p32, q32 = [np.float32(v) for v in c[:DEG + 1]], [np.float32(1.0)] + [np.float32(v) for v in c[DEG + 1:]]
    z = np.clip(x32, -np.float32(HI_DIRECT), np.float32(HI_DIRECT))
    s32, num, den = z * z, np.zeros_like(z), np.zeros_like(z)
    for a in p32[::-1]:
        num = num * s32 + a
    for a in q32[::-1]:
        den = den * s32 + a
    got = (z * num / den).astype(np.float64)
    print(f"in float32 on [-6, 6]: worst {(np.abs(got - ref) / spacing).max():.2f} ulp, "
          f"absolute {np.abs(got - ref).max():.2e}")


if __name__ == "__main__":
    main()

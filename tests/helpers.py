"""Helpers shared by the tests: seeded arrays on a backend, hypothesis strategies, assertions."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from npformer.backend import to_numpy

# Sizes the issue asks the op checks to cover.
batch = st.integers(1, 3)
seq = st.integers(1, 7)
heads = st.integers(1, 3)
head_size = st.integers(1, 4)
seeds = st.integers(0, 2**16)


def randn(xp, shape, seed=0, dtype="float64", scale=1.0):
    """Seeded standard-normal array on backend ``xp`` (drawn on the host, so equal across backends)."""
    a = np.random.default_rng(seed).standard_normal(shape) * scale
    return xp.asarray(a.astype(dtype))


def away_from_zero(xp, shape, seed=0, margin=1e-2, dtype="float64"):
    """Like :func:`randn` but every |value| >= margin (keeps ReLU-like kinks out of reach of eps)."""
    a = np.random.default_rng(seed).standard_normal(shape)
    a = np.where(np.abs(a) < margin, np.copysign(margin, a) + a, a)
    return xp.asarray(a.astype(dtype))


@st.composite
def padding_masks(draw, b, tk):
    """Bool (B, Tk) key-padding masks, True = padding, with at least one free key per row."""
    rows = []
    for _ in range(b):
        row = draw(st.lists(st.booleans(), min_size=tk, max_size=tk))
        row[draw(st.integers(0, tk - 1))] = False
        rows.append(row)
    return np.array(rows, dtype=bool).reshape(b, tk)


def assert_gradcheck(report):
    """Fail with the full report (tensor, worst index, both values, eps, tolerances, seed)."""
    assert report.passed, "\n" + str(report)


def host(a):
    return to_numpy(a)

"""Residual add + dropout (+ layer norm) as one kernel (reference: :mod:`npformer.ops.residual`).

    s = x + branch m  (m = keep / (1 - p), the dropout op's mask of one seed)     one elementwise kernel
    s as above, then y = LN(s)                one block per row: s, y, mu, rstd written
    backward: dx = ds + LN'(dy), dbranch = dx m     one block per row; dweight, dbias in the layer-norm
                                                    kernels' column pass

The caches are the reference's (``DropoutCache``, ``ResidualNormCache`` of a ``DropoutCache`` and a
``LayerNormCache``), so either backward takes either forward's cache. The kernels store no mask: the
dropout's cache keeps the seed's draws (``DropoutCache.of_seed``), and the backward kernel (or the
dropout op's backward, for the sum without layer norm) hashes each bit again. ``p = 1`` (nothing
drawn, everything dropped) runs the reference.
"""
from __future__ import annotations

import numpy

from npformer.backend import accumulation_dtype
from npformer.checks import expect_grad
from npformer.kernels.cuda.dropout import keep_arguments, keep_draws, no_keep_draws
from npformer.kernels.cuda.layernorm import layer_norm_param_grads, statistics_of
from npformer.kernels.cuda.runtime import contiguous, device_floats, device_xp, launch_elements, launch_rows, rows_of
from npformer.ops import residual
from npformer.ops.dropout import DropoutCache, dropout_active
from npformer.ops.layernorm import LayerNormCache, check_layer_norm_inputs

__all__ = ["accepts_norm_backward", "residual_dropout_forward", "residual_dropout_layer_norm_forward",
           "residual_dropout_layer_norm_backward"]


def accepts_norm_backward(ds, dy, cache) -> bool:
    norm = getattr(cache, "norm", None)
    return device_floats(ds, dy, getattr(norm, "weight", None), dtype=getattr(norm, "dtype", None))


def _draws(xp, branch, p, rng, active):
    """(draws, keep_min, scale, drop flag): the dropout op's seed draws for ``branch``, or stand-ins never read."""
    if active:
        return (*keep_draws(branch, p, rng), numpy.int32(1))
    return (*no_keep_draws(xp, branch.dtype), numpy.int32(0))


def _cache(draws, p: float, x, active: bool) -> DropoutCache:
    """The dropout op's cache of the kernels' mask, kept as its seed (the identity's when nothing was dropped)."""
    return DropoutCache.of_seed(draws, p, x) if active else DropoutCache.identity(x)


def residual_dropout_forward(x, branch, *, p: float = 0.0, rng=None, training: bool = True):
    """Returns ``(s, DropoutCache)``."""
    residual.check_residual_inputs(x, branch)
    active = dropout_active(branch, p, rng, training)
    if active and p == 1.0:
        return residual.residual_dropout_forward.reference(x, branch, p=p, rng=rng, training=training)
    xp = device_xp(x, branch)
    x, branch = contiguous(xp, x), contiguous(xp, branch)
    draws, keep_min, scale, drop = _draws(xp, branch, p, rng, active)
    s = xp.empty(x.shape, dtype=x.dtype)                 # (..., C)
    if x.size:
        # s = x + branch * m: one kernel
        launch_elements("add_dropout_fwd", x.dtype, x.size,
                        (x, branch, draws, s, numpy.int64(x.size), keep_min, scale, drop))
    return s, _cache(draws, p, x, active)


def residual_dropout_layer_norm_forward(x, branch, weight=None, bias=None, *, p: float = 0.0, rng=None,
                                        training: bool = True, eps: float = 1e-5):
    """Returns ``(s, y, ResidualNormCache(DropoutCache, LayerNormCache))``."""
    residual.check_residual_inputs(x, branch)
    active = dropout_active(branch, p, rng, training)
    check_layer_norm_inputs(x, weight, bias, eps)
    if active and p == 1.0:
        return residual.residual_dropout_layer_norm_forward.reference(x, branch, weight, bias, p=p, rng=rng,
                                                                      training=training, eps=eps)
    xp = device_xp(x, branch, weight, bias)
    rows, n = rows_of(x)
    acc = accumulation_dtype(x.dtype)
    x, branch = contiguous(xp, x), contiguous(xp, branch)
    w = contiguous(xp, weight) if weight is not None else x   # x stands in for an absent w or b:
    b = contiguous(xp, bias) if bias is not None else x        # never read (has_w, has_b = 0)
    draws, keep_min, scale, drop = _draws(xp, branch, p, rng, active)
    s = xp.empty(x.shape, dtype=x.dtype)                 # (..., C)
    y = xp.empty(x.shape, dtype=x.dtype)                 # (..., C)
    mean = xp.empty(x.shape[:-1] + (1,), dtype=acc)      # (..., 1)
    rstd = xp.empty(x.shape[:-1] + (1,), dtype=acc)      # (..., 1)
    if rows:
        # s = x + branch * m;  y = LN(s): one block per row
        launch_rows("add_dropout_ln_fwd", x.dtype, rows, n,
                    (x, branch, draws, w, b, s, y, mean, rstd, numpy.int64(rows), numpy.int32(n),
                     keep_min, scale, drop, acc.type(eps), numpy.int32(weight is not None),
                     numpy.int32(bias is not None)))
    return s, y, residual.ResidualNormCache(_cache(draws, p, x, active),
                                            LayerNormCache(s, mean, rstd, weight, bias is not None, x.dtype))


def residual_dropout_layer_norm_backward(ds, dy, cache):
    """Returns ``(dx, dbranch, dweight, dbias)``."""
    drop, norm = cache
    _, _, _, weight, has_bias, dtype = norm
    if ds is not None:
        expect_grad(ds, "ds", norm.x.shape, dtype)
    expect_grad(dy, "dy", norm.x.shape, dtype)
    xp = device_xp(ds, dy, weight)
    s, mean, rstd = statistics_of(xp, norm)
    rows, n = rows_of(s)
    dy = contiguous(xp, dy)
    dsc = contiguous(xp, ds) if ds is not None else dy         # stand-ins, never read
    w = contiguous(xp, weight) if weight is not None else dy
    keep, draws, keep_min, scale, drop_flag = keep_arguments(xp, drop, dtype)
    dx = xp.empty(dy.shape, dtype=dtype)                 # (..., C)
    dbranch = xp.empty(dy.shape, dtype=dtype)            # (..., C)
    if rows:
        # fwd: y = LN(s), s = x + dropout(branch)  ->  dx = ds + LN'(dy),  dbranch = dx * m / (1 - p)
        launch_rows("add_dropout_ln_bwd", dtype, rows, n,
                    (dy, dsc, s, mean, rstd, w, keep, draws, keep_min, scale, dx, dbranch, numpy.int64(rows),
                     numpy.int32(n), numpy.int32(weight is not None), numpy.int32(ds is not None), drop_flag))
    return (dx, dbranch, *layer_norm_param_grads(dy, (s, mean, rstd), weight, has_bias, dtype))

"""The CUDA C of the fused blocks: residual add + dropout (+ layer norm), and cross-entropy over the
vocabulary in one pass. :mod:`npformer.kernels.cuda.source` compiles it with the other kernels into
the one module (it uses that source's helpers: ``npf_load``/``npf_store``, ``npf_round``, the block
reductions), so the conventions are those: ``T`` storage, ``A`` arithmetic, ``extern "C"`` entry
points ``npf_<name>_<f16|f32|f64>``.

Every kernel rounds to ``T`` where the composed reference ops round (a product or sum each op
returns in the input's dtype), so float32 and float64 results differ from the reference only in the
order of a reduction's additions.
"""
from __future__ import annotations

from npformer.kernels.cuda.files import read_source

__all__ = ["FUSED_KERNELS", "FUSED_ENTRY_POINTS"]

FUSED_KERNELS = read_source("fused.cu")

# extern "C" entry points: (name, parameters, call, shared memory kind), as in source.py
FUSED_ENTRY_POINTS = (
    ("add_dropout_fwd", "const T* x, const T* br, const double* draws, T* s, "
     "long long total, int keep_min, A scale, int drop",
     "npf_add_dropout_fwd<T, A>(x, br, draws, s, total, keep_min, scale, drop)", ""),
    ("add_dropout_ln_fwd", "const T* x, const T* br, const double* draws, const T* w, const T* b, T* s, "
     "T* y, A* mean, A* rstd, long long rows, int n, int keep_min, A scale, int drop, A eps, "
     "int has_w, int has_b",
     "npf_add_dropout_ln_fwd<T, A>(x, br, draws, w, b, s, y, mean, rstd, rows, n, keep_min, scale, drop, eps, "
     "has_w, has_b, buf)", "row"),
    ("add_dropout_ln_bwd", "const T* dy, const T* ds, const T* s, const A* mean, const A* rstd, const T* w, "
     "const bool* keep, const double* draws, int keep_min, A scale, T* dx, T* dbr, long long rows, int n, "
     "int has_w, int has_ds, int drop",
     "npf_add_dropout_ln_bwd<T, A>(dy, ds, s, mean, rstd, w, keep, draws, keep_min, scale, dx, dbr, rows, n, "
     "has_w, has_ds, drop, buf)", "row"),
    ("cross_entropy_fwd", "const T* z, const long long* t, const bool* valid, A* loss, A* shift, A* log_sum, "
     "long long rows, int n, A one_minus_ls, A ls_over_n, int smooth",
     "npf_cross_entropy_fwd<T, A>(z, t, valid, loss, shift, log_sum, rows, n, one_minus_ls, ls_over_n, smooth, "
     "buf)", "row"),
    ("cross_entropy_bwd", "const T* z, const A* shift, const A* log_sum, const long long* t, const A* scale, "
     "T* dz, long long rows, int n, A one_minus_ls, A ls_over_n, int smooth",
     "npf_cross_entropy_bwd<T, A>(z, shift, log_sum, t, scale, dz, rows, n, one_minus_ls, ls_over_n, smooth)",
     ""),                                                 # one block per row, no reduction: no shared buffer
)

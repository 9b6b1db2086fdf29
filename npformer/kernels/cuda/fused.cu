// The fused blocks: residual add + dropout (+ layer norm), cross-entropy in one pass
// (npformer/kernels/cuda/fused_source.py; compiled after elementwise.cu, whose helpers they use).
// +infinity (the emulator, where __CUDACC__ is undefined, takes the compiler's builtin)
#ifdef __CUDACC__
__device__ __forceinline__ float npf_inf(float) { return __int_as_float(0x7f800000); }
__device__ __forceinline__ double npf_inf(double) { return __longlong_as_double(0x7ff0000000000000LL); }
#else
inline float npf_inf(float) { return __builtin_huge_valf(); }
inline double npf_inf(double) { return __builtin_huge_val(); }
#endif

// Residual add and dropout of each element (grid-stride):
//   d = branch m  (drop = 1: m = keep ? scale : 0, keep = npf_keep(seed, k), not stored: the
//                  backward hashes it again; drop = 0: d = branch)
//   s = x + d     (d and s each rounded to T, as the plain dropout then add)
template <typename T, typename A>
__device__ void npf_add_dropout_fwd(const T* x, const T* br, const double* draws, T* s,
                                    long long total, int keep_min, A scale, int drop) {
    const unsigned long long sd = drop ? npf_seed(draws) : 0ULL;
    NPF_FOR_EACH(k, total) {
        A d = npf_load(br[k]);
        if (drop) d = npf_round<T, A>(d * (npf_keep(sd, (unsigned long long)k, keep_min) ? scale : A(0)));
        npf_store(s + k, npf_load(x[k]) + d);
    }
}

// Residual add, dropout and layer norm of each row of n values; one block per row.
//   s = x + branch m  (as npf_add_dropout_fwd; written: the residual stream)
//   y = LN(s) with w, b optional: mu, var in two passes over s, mu and rstd kept (as npf_layer_norm_fwd)
// Each thread reads back only the entries of s it wrote itself (the same i), so no barrier is needed.
template <typename T, typename A>
__device__ void npf_add_dropout_ln_fwd(const T* x, const T* br, const double* draws, const T* w,
                                       const T* b, T* s, T* y, A* mean, A* rstd, long long rows, int n,
                                       int keep_min, A scale, int drop, A eps, int has_w, int has_b, A* buf) {
    const unsigned long long sd = drop ? npf_seed(draws) : 0ULL;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        long long o = row * n;
        A sum = A(0);
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            A d = npf_load(br[o + i]);
            if (drop) d = npf_round<T, A>(d * (npf_keep(sd, (unsigned long long)(o + i), keep_min) ? scale : A(0)));
            A sv = npf_round<T, A>(npf_load(x[o + i]) + d);
            npf_store(s + o + i, sv);
            sum += sv;
        }
        A mu = npf_block_sum(sum, buf) / A(n);
        A v = A(0);
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            A c = npf_load(s[o + i]) - mu;
            v += c * c;
        }
        A r = A(1) / npf_sqrt(npf_block_sum(v, buf) / A(n) + eps);
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            A h = (npf_load(s[o + i]) - mu) * r;
            A out = has_w ? h * npf_load(w[i]) : h;
            if (has_b) out += npf_load(b[i]);
            npf_store(y + o + i, out);
        }
        if (threadIdx.x == 0) {
            mean[row] = mu;
            rstd[row] = r;
        }
    }
}

// Its backward for each row; one block per row.  g = dy w (w optional), xhat = (s - mu) rstd recomputed,
//   dsn = rstd (g - mean g - xhat mean(g xhat))   (rounded to T: layer norm's dx)
//   dx = ds + dsn  (has_ds; rounded to T; the gradient of s, which is also x's),
//   dbranch = dx m  (drop: the keep bits stored or hashed again, npf_kept; m = keep ? scale : 0)
template <typename T, typename A>
__device__ void npf_add_dropout_ln_bwd(const T* dy, const T* ds, const T* s, const A* mean, const A* rstd,
                                       const T* w, const bool* keep, const double* draws, int keep_min, A scale,
                                       T* dx, T* dbr, long long rows, int n, int has_w, int has_ds, int drop,
                                       A* buf) {
    const unsigned long long sd = npf_backward_seed(draws, drop);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        long long o = row * n;
        A mu = mean[row], r = rstd[row];
        A sg = A(0), sgh = A(0);
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            A g = has_w ? npf_load(dy[o + i]) * npf_load(w[i]) : npf_load(dy[o + i]);
            sg += g;
            sgh += g * ((npf_load(s[o + i]) - mu) * r);
        }
        A mean_g = npf_block_sum(sg, buf) / A(n);
        A mean_gh = npf_block_sum(sgh, buf) / A(n);
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            A g = has_w ? npf_load(dy[o + i]) * npf_load(w[i]) : npf_load(dy[o + i]);
            A h = (npf_load(s[o + i]) - mu) * r;
            A d = npf_round<T, A>(((g - mean_g) - h * mean_gh) * r);
            if (has_ds) d = npf_round<T, A>(npf_load(ds[o + i]) + d);
            npf_store(dx + o + i, d);
            npf_store(dbr + o + i, drop ? d * (npf_kept(keep, sd, o + i, keep_min, drop) ? scale : A(0)) : d);
        }
    }
}

// Cross-entropy of each row of n logits z against its target t, in one read of the row; one block
// per row. Each thread keeps, over its entries, a running max m, s = sum exp(z - m), c = sum (z - m)
// and their count k, rescaling s and c when m grows; the block then combines them at
//   shift = max z (0 when not finite),  log_sum = log sum exp(z - shift) (log 1 for a zero sum)
// so that log p_j = (z_j - shift) - log_sum and sum_j log p_j = sum_j (z_j - shift) - n log_sum.
//   loss = -log p_t  (smoothing ls = 0),  -(1 - ls) log p_t - ls/n sum_j log p_j  (ls > 0);  0 where not valid
// -inf logits (masked classes) count as exp(-inf) = 0; a NaN or +inf logit makes its row's loss NaN
// (the reference gives NaN or +inf there).
template <typename T, typename A>
__device__ void npf_cross_entropy_fwd(const T* z, const long long* t, const bool* valid, A* loss, A* shift,
                                      A* log_sum, long long rows, int n, A one_minus_ls, A ls_over_n, int smooth,
                                      A* buf) {
    const A NEG_INF = -npf_inf(A(0));
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* zr = z + row * n;
        A m = NEG_INF, s = A(0), c = A(0), k = A(0);
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            A v = npf_load(zr[i]);
            if (v > m) {                                  // a new running max (never for NaN)
                if (k > A(0)) {
                    s = s * npf_exp(m - v);
                    c += k * (m - v);
                }
                m = v;
            }
            if (v == NEG_INF) {
                c = NEG_INF;                              // exp(-inf) = 0 adds nothing to s
            } else {
                s += npf_exp(v - m);
                c += v - m;
            }
            k += A(1);
        }
        A mx = npf_block_max(m, buf);
        A sh = npf_isfinite(mx) ? mx : A(0);
        A total = npf_block_sum(k > A(0) && m != NEG_INF ? s * npf_exp(m - sh) : A(0), buf);
        A ls = npf_log(total > A(0) ? total : A(1));
        if (threadIdx.x == 0) {
            shift[row] = sh;
            log_sum[row] = ls;
        }
        A csum = smooth ? npf_block_sum(k > A(0) ? c + k * (m - sh) : A(0), buf) : A(0);
        if (threadIdx.x == 0) {
            A out = A(0);
            if (valid[row]) {
                A picked = (npf_load(zr[t[row]]) - sh) - ls;
                out = smooth ? -one_minus_ls * picked - ls_over_n * (csum - A(n) * ls) : -picked;
            }
            loss[row] = out;
        }
    }
}

// Cross-entropy backward of each row, written straight into dz; one block per row:
//   dz_j = (p_j - ls/n - (1 - ls) [j = t]) scale,  p_j = exp((z_j - shift) - log_sum)
// with scale = dloss / N (0 for an ignored row) computed by the caller per row.
template <typename T, typename A>
__device__ void npf_cross_entropy_bwd(const T* z, const A* shift, const A* log_sum, const long long* t,
                                      const A* scale, T* dz, long long rows, int n, A one_minus_ls, A ls_over_n,
                                      int smooth) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* zr = z + row * n;
        T* dr = dz + row * n;
        A sh = shift[row], ls = log_sum[row], sc = scale[row];
        long long target = t[row];
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            A g = npf_exp((npf_load(zr[i]) - sh) - ls);
            if (smooth) g -= ls_over_n;
            if (i == target) g -= one_minus_ls;
            npf_store(dr + i, g * sc);
        }
    }
}

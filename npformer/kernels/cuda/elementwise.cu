// The row, column and elementwise kernels and their helpers (npformer/kernels/cuda/source.py,
// which fills in the constants named in it and writes the extern "C" entry points).
#define NPF_MAX_THREADS @MAX_THREADS@
#define NPF_COL_X @COL_X@
#define NPF_COL_Y @COL_Y@


__device__ __forceinline__ float npf_sqrt(float v) { return sqrtf(v); }
__device__ __forceinline__ double npf_sqrt(double v) { return sqrt(v); }
__device__ __forceinline__ float npf_erf(float v) { return erff(v); }
__device__ __forceinline__ double npf_erf(double v) { return erf(v); }
__device__ __forceinline__ float npf_tanh(float v) { return tanhf(v); }
__device__ __forceinline__ double npf_tanh(double v) { return tanh(v); }
// v rounded to the storage type T and read back (what storing and reloading it does)
template <typename T, typename A> __device__ __forceinline__ A npf_round(A v) {
    T t;
    npf_store(&t, v);
    return npf_load(t);
}
// finite: |v| <= the largest finite value (false for +-inf and NaN)
__device__ __forceinline__ bool npf_isfinite(float v) { return fabsf(v) <= 3.402823466e+38f; }
__device__ __forceinline__ bool npf_isfinite(double v) { return fabs(v) <= 1.7976931348623157e+308; }

// Block-wide sum and max of one value per thread, through shared memory (blockDim.x is a power
// of two <= NPF_MAX_THREADS; every thread of the block must call, and gets the result).
template <typename A> __device__ A npf_block_sum(A v, A* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s /= 2) {
        if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
        __syncthreads();
    }
    A total = buf[0];
    __syncthreads();                       // buf is reused by the next reduction
    return total;
}
template <typename A> __device__ A npf_block_max(A v, A* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s /= 2) {
        if (threadIdx.x < s) buf[threadIdx.x] = npf_max(buf[threadIdx.x], buf[threadIdx.x + s]);
        __syncthreads();
    }
    A total = buf[0];
    __syncthreads();
    return total;
}

// softmax (log_out = 0) or log-softmax (log_out = 1) of each row of n values; one block per row.
//   m = max x (taken as 0 when it is not finite: an all -inf row),  s = sum exp(x - m)
//   softmax y = exp(x - m) / s (s = 0 -> 1: zeros),  log-softmax y = (x - m) - log s (s = 0 -> 1)
template <typename T, typename A>
__device__ void npf_softmax_fwd(const T* x, T* y, long long rows, int n, int log_out, A* buf) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * n;
        T* yr = y + row * n;
        A m = npf_load(xr[0]);
        for (int i = threadIdx.x; i < n; i += blockDim.x) m = npf_max(m, npf_load(xr[i]));
        m = npf_block_max(m, buf);
        if (!npf_isfinite(m)) m = A(0);
        A s = A(0);
        for (int i = threadIdx.x; i < n; i += blockDim.x) s += npf_exp(npf_load(xr[i]) - m);
        s = npf_block_sum(s, buf);
        if (log_out) {
            A lse = npf_log(s > A(0) ? s : A(1));
            for (int i = threadIdx.x; i < n; i += blockDim.x) npf_store(yr + i, (npf_load(xr[i]) - m) - lse);
        } else {
            if (s == A(0)) s = A(1);
            for (int i = threadIdx.x; i < n; i += blockDim.x) npf_store(yr + i, npf_exp(npf_load(xr[i]) - m) / s);
        }
    }
}

// backward from the output y (log_out = 0: softmax, 1: log-softmax, y = log p); one block per row.
//   softmax:      dx = (dy - sum(dy * y)) * y
//   log-softmax:  dx = dy - exp(y) * sum(dy)
template <typename T, typename A>
__device__ void npf_softmax_bwd(const T* dy, const T* y, T* dx, long long rows, int n, int log_out, A* buf) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* gr = dy + row * n;
        const T* yr = y + row * n;
        T* dr = dx + row * n;
        A dot = A(0);
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            dot += log_out ? npf_load(gr[i]) : npf_load(gr[i]) * npf_load(yr[i]);
        dot = npf_block_sum(dot, buf);
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            A g = npf_load(gr[i]), p = npf_load(yr[i]);
            npf_store(dr + i, log_out ? g - npf_exp(p) * dot : (g - dot) * p);
        }
    }
}

// layer norm of each row of n values; one block per row. Two passes over the row (mean, then the
// variance of x - mean), as the reference op, never E[x^2] - E[x]^2.
//   mu = sum x / n,  var = sum (x - mu)^2 / n,  rstd = 1 / sqrt(var + eps)  (mu and rstd kept, in A)
//   xhat = (x - mu) rstd,   y = xhat w + b  (w, b optional)
template <typename T, typename A>
__device__ void npf_layer_norm_fwd(const T* x, const T* w, const T* b, T* y, A* mean, A* rstd,
                                   long long rows, int n, A eps, int has_w, int has_b, A* buf) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * n;
        T* yr = y + row * n;
        A s = A(0);
        for (int i = threadIdx.x; i < n; i += blockDim.x) s += npf_load(xr[i]);
        A mu = npf_block_sum(s, buf) / A(n);
        A v = A(0);
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            A d = npf_load(xr[i]) - mu;
            v += d * d;
        }
        A var = npf_block_sum(v, buf) / A(n);
        A r = A(1) / npf_sqrt(var + eps);
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            A h = (npf_load(xr[i]) - mu) * r;
            A o = has_w ? h * npf_load(w[i]) : h;
            if (has_b) o += npf_load(b[i]);
            npf_store(yr + i, o);
        }
        if (threadIdx.x == 0) {
            mean[row] = mu;
            rstd[row] = r;
        }
    }
}

// layer-norm dx of each row; one block per row.  g = dy w (w optional),
//   xhat = (x - mu) rstd  (recomputed as the forward computed it),
//   dx = rstd (g - mean(g) - xhat mean(g xhat))
template <typename T, typename A>
__device__ void npf_layer_norm_bwd(const T* dy, const T* x, const A* mean, const A* rstd, const T* w, T* dx,
                                   long long rows, int n, int has_w, A* buf) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* gr = dy + row * n;
        const T* xr = x + row * n;
        T* dr = dx + row * n;
        A mu = mean[row], r = rstd[row];
        A sg = A(0), sgh = A(0);
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            A g = has_w ? npf_load(gr[i]) * npf_load(w[i]) : npf_load(gr[i]);
            sg += g;
            sgh += g * ((npf_load(xr[i]) - mu) * r);
        }
        A mean_g = npf_block_sum(sg, buf) / A(n);
        A mean_gh = npf_block_sum(sgh, buf) / A(n);
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            A g = has_w ? npf_load(gr[i]) * npf_load(w[i]) : npf_load(gr[i]);
            A h = (npf_load(xr[i]) - mu) * r;
            npf_store(dr + i, ((g - mean_g) - h * mean_gh) * r);
        }
    }
}

// GELU and its derivative in the accumulation type (formulas in npformer.ops.activations).
//   erf form:   gelu = x (1 + erf(x / sqrt 2)) / 2,  gelu' = (1 + erf(x / sqrt 2)) / 2 + x phi(x)
//   tanh form:  u = sqrt(2/pi) xc (1 + 0.044715 xc^2), xc = clip(x, -100, 100), t = tanh(u)
//               gelu = x/2 (1 + t),  gelu' = xc/2 (1 - t^2) sqrt(2/pi) (1 + 3 0.044715 xc^2) + (1 + t)/2
template <typename A> __device__ __forceinline__ A npf_clip100(A x) {
    return x < A(-100) ? A(-100) : (x > A(100) ? A(100) : x);   // NaN stays NaN
}
template <typename A> __device__ __forceinline__ A npf_gelu(A x, int tanh_form) {
    if (tanh_form) {
        A xc = npf_clip100(x);
        A t = npf_tanh((A(@SQRT_2_OVER_PI@) * xc) * (A(1) + A(@C@) * (xc * xc)));
        return (A(0.5) * x) * (t + A(1));
    }
    return x * ((npf_erf(x * A(@INV_SQRT_2@)) + A(1)) * A(0.5));
}
template <typename A> __device__ __forceinline__ A npf_gelu_grad(A x, int tanh_form) {
    if (tanh_form) {
        A xc = npf_clip100(x);
        A t = npf_tanh((A(@SQRT_2_OVER_PI@) * xc) * (A(1) + A(@C@) * (xc * xc)));
        A d = ((A(0.5) * xc) * (A(1) - t * t)) * (A(@SQRT_2_OVER_PI@) * (A(1) + A(@C3@) * (xc * xc)));
        return d + A(0.5) * (A(1) + t);
    }
    A d = (npf_erf(x * A(@INV_SQRT_2@)) + A(1)) * A(0.5);
    return d + (x * npf_exp((A(-0.5) * x) * x)) * A(@INV_SQRT_2PI@);
}


template <typename T, typename A>
__device__ void npf_gelu_fwd(const T* x, T* y, long long total, int tanh_form) {
    NPF_FOR_EACH(k, total) npf_store(y + k, npf_gelu(npf_load(x[k]), tanh_form));
}
template <typename T, typename A>
__device__ void npf_gelu_bwd(const T* dy, const T* x, T* dx, long long total, int tanh_form) {
    NPF_FOR_EACH(k, total) npf_store(dx + k, npf_gelu_grad(npf_load(x[k]), tanh_form) * npf_load(dy[k]));
}
// h = z + b (b broadcast over the last axis of n values, h rounded to T as the plain linear's
// output is), then a = gelu(h); with dropout (drop = 1) a is rounded to T and the output is a m,
// m = keep ? scale : 0, keep = npf_keep(seed, k) (the seed made of the dropout op's two draws; the
// plain gelu then dropout). The mask is not stored: the backward hashes it again.
template <typename T, typename A>
__device__ void npf_bias_gelu_fwd(const T* z, const T* b, const double* draws, T* h, T* y,
                                  long long total, int n, int tanh_form, int keep_min, A scale, int drop) {
    const unsigned long long s = drop ? npf_seed(draws) : 0ULL;
    NPF_FOR_EACH(k, total) {
        const bool kk = drop && npf_keep(s, (unsigned long long)k, keep_min);   // first: its registers are
        A hk = npf_round<T, A>(npf_load(z[k]) + npf_load(b[k % n]));          // free before gelu's (32 on sm_90)
        npf_store(h + k, hk);
        A a = npf_gelu(hk, tanh_form);
        if (drop) a = npf_round<T, A>(a) * (kk ? scale : A(0));
        npf_store(y + k, a);
    }
}
template <typename T, typename A>
__device__ void npf_bias_add(const T* x, const T* b, T* y, long long total, int n) {
    NPF_FOR_EACH(k, total) npf_store(y + k, npf_load(x[k]) + npf_load(b[k % n]));
}
// inverted dropout: keep = npf_keep(seed, k) written as the mask, out = x m, m = keep ? scale : 0
// (scale = 1 / (1 - p) in A, as ops.dropout.keep_scale; the product rounded to T once)
template <typename T, typename A>
__device__ void npf_dropout_fwd(const T* x, const double* draws, T* y, bool* keep, long long total,
                                int keep_min, A scale) {
    const unsigned long long s = npf_seed(draws);
    NPF_FOR_EACH(k, total) {
        bool kk = npf_keep(s, (unsigned long long)k, keep_min);
        keep[k] = kk;
        npf_store(y + k, npf_load(x[k]) * (kk ? scale : A(0)));
    }
}
// its backward: dx = dy m, the keep bits stored or hashed again (drop: NPF_DROP_STORED or _HASHED)
template <typename T, typename A>
__device__ void npf_dropout_bwd(const T* dy, const bool* keep, const double* draws, T* dx, long long total,
                                int keep_min, A scale, int drop) {
    const unsigned long long s = npf_backward_seed(draws, drop);
    NPF_FOR_EACH(k, total) npf_store(dx + k, npf_load(dy[k]) * (npf_kept(keep, s, k, keep_min, drop) ? scale : A(0)));
}

// Column sums over the rows of an (rows, n) array, coalesced: block (NPF_COL_X, NPF_COL_Y) covers
// NPF_COL_X columns of one chunk of `chunk` rows; the block's lanes are added in shared memory and
// written as row blockIdx.y of the partial sums (n_chunks, n), which the host adds up.
template <typename A>
__device__ void npf_column_partials(A a1, A a2, int want2, A* part1, A* part2, int n, int c, A* s1, A* s2) {
    int t = threadIdx.y * NPF_COL_X + threadIdx.x;
    s1[t] = a1;
    s2[t] = a2;
    __syncthreads();
    if (threadIdx.y == 0 && c < n) {
        A t1 = A(0), t2 = A(0);
        for (unsigned j = 0; j < blockDim.y; ++j) {
            t1 += s1[j * NPF_COL_X + threadIdx.x];
            t2 += s2[j * NPF_COL_X + threadIdx.x];
        }
        part1[(long long)blockIdx.y * n + c] = t1;
        if (want2) part2[(long long)blockIdx.y * n + c] = t2;
    }
}
#define NPF_CHUNK_END(rows, chunk) \
    (((long long)blockIdx.y + 1) * (chunk) < (rows) ? ((long long)blockIdx.y + 1) * (chunk) : (rows))
#define NPF_FOR_CHUNK(r, rows, chunk) \
    for (long long r = (long long)blockIdx.y * (chunk) + threadIdx.y, r##_end = NPF_CHUNK_END(rows, chunk); \
         r < r##_end; r += blockDim.y)

// layer-norm parameter gradients: dweight = sum dy xhat, dbias = sum dy (partials), with
// xhat = (x - mu) rstd recomputed as the forward computed it
template <typename T, typename A>
__device__ void npf_ln_param_grads(const T* dy, const T* x, const A* mean, const A* rstd, A* part_dw, A* part_db,
                                   long long rows, int n, long long chunk, A* s1, A* s2) {
    int c = blockIdx.x * NPF_COL_X + threadIdx.x;
    A dw = A(0), db = A(0);
    if (c < n) {
#pragma unroll 2   // two rows in flight: unrolled by 4, the three loads a row take 40 registers (75% occupancy)
        NPF_FOR_CHUNK(r, rows, chunk) {
            A g = npf_load(dy[r * n + c]);
            dw += g * ((npf_load(x[r * n + c]) - mean[r]) * rstd[r]);
            db += g;
        }
    }
    npf_column_partials(dw, db, 1, part_dw, part_db, n, c, s1, s2);
}
// bias gradient: dbias = sum dy (partials)
template <typename T, typename A>
__device__ void npf_bias_grad(const T* dy, A* part_db, long long rows, int n, long long chunk, A* s1, A* s2) {
    int c = blockIdx.x * NPF_COL_X + threadIdx.x;
    A db = A(0);
    if (c < n) {
        NPF_FOR_CHUNK(r, rows, chunk) db += npf_load(dy[r * n + c]);
    }
    npf_column_partials(db, A(0), 0, part_db, part_db, n, c, s1, s2);
}
// bias + GELU backward: with dropout (drop: the keep bits stored or hashed again, npf_kept) first
// da = dy m (m = keep ? scale : 0, rounded to T), else da = dy; dh = da gelu'(h) (written, rounded to
// T), dbias = sum dh (partials)
template <typename T, typename A>
__device__ void npf_bias_gelu_bwd(const T* dy, const bool* keep, const double* draws, int keep_min, A scale,
                                  const T* h, T* dh, A* part_db, long long rows, int n, long long chunk,
                                  int tanh_form, int drop, A* s1, A* s2) {
    int c = blockIdx.x * NPF_COL_X + threadIdx.x;
    const unsigned long long s = npf_backward_seed(draws, drop);
    A db = A(0);
    if (c < n) {
        NPF_FOR_CHUNK(r, rows, chunk) {
            long long k = r * n + c;
            const bool kk = drop && npf_kept(keep, s, k, keep_min, drop);   // first, as in the forward
            A da = npf_load(dy[k]);
            if (drop) da = npf_round<T, A>(da * (kk ? scale : A(0)));
            npf_store(dh + k, npf_gelu_grad(npf_load(h[k]), tanh_form) * da);
            db += npf_load(dh[k]);
        }
    }
    npf_column_partials(db, A(0), 0, part_db, part_db, n, c, s1, s2);
}

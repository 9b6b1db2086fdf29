// Flash attention's kernels, SIMT and tensor-core (npformer/kernels/cuda/flash_source.py documents
// them and fills in the constants named in it); their configuration, kernel traits and the one
// __global__ template npf_fa_kernel<K>, is the last section.
#define NPF_FA_THREADS 128
#define NPF_FA_TR 16
#define NPF_FA_TC 8

#ifdef __CUDACC__
#define NPF_FA_SHARED(name, bytes) extern __shared__ __align__(16) unsigned char name[]
__device__ __forceinline__ float npf_fa_inf(float) { return __int_as_float(0x7f800000); }
__device__ __forceinline__ double npf_fa_inf(double) { return __longlong_as_double(0x7ff0000000000000LL); }
#else
// the CPU emulator runs one block at a time: a static buffer of the kernel's size is its shared memory
// (its size kept where the emulator checks it against the launch's dynamic shared memory), filled with
// 0xff bytes at each block's start
extern "C" { long long npf_fa_shared_declared = 0; }
#define NPF_FA_SHARED(name, bytes)                                                                           \
    alignas(16) static unsigned char name[bytes];                                                          \
    npf_fa_shared_declared = (bytes);                                                                      \
    npf_shared_at_block_start(name, bytes)
inline float npf_fa_inf(float) { return __builtin_huge_valf(); }
inline double npf_fa_inf(double) { return __builtin_huge_val(); }
#endif

template <typename A> __device__ __forceinline__ bool npf_fa_isinf(A x) {
    return x == npf_fa_inf(x) || x == -npf_fa_inf(x);
}
__device__ __forceinline__ int npf_fa_min(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int npf_fa_max(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ int npf_fa_max0(int a) { return a > 0 ? a : 0; }

// Shared-memory carving per kernel (elements of A; shared_bytes() in flash_source.py says the same).
template <typename A, int D, int BR, int BC> struct NpfFaShape {
    static constexpr int DP = D + 4;                        // row stride of a (rows, D) tile
    static constexpr int FWD = (BR + 2 * BC) * DP + BR * (BC + 4) + 2 * BR * NPF_FA_TC;
    static constexpr int DQ = (2 * BR + 2 * BC) * DP + BR * (BC + 4);
    static constexpr int DKDV = (2 * BC + 2 * BR) * DP + 2 * BC * (BR + 4) + 2 * BR;
};

// The masks, dropout and sizes every kernel reads (a member of NpfFaParams, below).
template <typename A> struct NpfFaArgs {
    // attn_mask: kind 0 none, 1 bool, 2 float. A bool mask comes as bytes (mask_b: the SIMT kernels) or as
    // bits (mask_bits, 32 keys a word: the tensor-core kernels), the other pointer a placeholder. A row of
    // the mask is mask_ld elements (Tk bytes or floats, or ceil(Tk / 32) words), a head's mask_bh (0 for a
    // (Tq, Tk) mask, Tq mask_ld for (B, H, Tq, Tk)).
    const bool* mask_b; const unsigned* mask_bits; const A* mask_f; long long mask_bh; int mask_ld; int mask_kind;
    // key_padding_mask (B, Tk), kinds and forms as above, pad_ld elements a row; for bool padding key_end[b]
    // is one past batch b's last key that is not padding (0 if none): key tiles at and past it are skipped
    const bool* pad_b; const unsigned* pad_bits; const A* pad_f; const int* key_end; int pad_ld; int pad_kind;
    const double* seed_draws; int keep_min; A keep_scale;                    // dropout (keep_min 0: none), 1 / (1 - p)
    long long bh_count; int H, Tq, Tk, hs, hv; A scale; int causal, shift;   // causal: key j visible to i when j <= i + shift
};

// Where one tensor's (B, H, T, D) elements are: element (b, h, t, d) at b sb + h sh + t st + d (a strided
// view: the heads of a packed (B, T, 3, H, hs) projection, or (B, T, H, hs) merged heads, need no copy).
struct NpfFaLayout { long long sb, sh, st; };

// Everything a flash kernel reads, one struct passed by value (it lands in the kernel's parameter space,
// as separate arguments would): the tensors, their layouts, then NpfFaArgs. T is the storage type, A the
// arithmetic's. Python fills it field by field by name (flash_source.params_dtype mirrors it; a test
// compares that dtype's offsets with this struct's, compiled). A kernel reads the fields it needs:
//   forward: q, k, v -> out, lse;  bwd_pre: dout, out -> dvec;
//   bwd_dkdv: q, k, v, dout, lse, dvec -> dk, dv;  bwd_dq: q, k, v, dout, lse, dvec -> dq
template <typename T, typename A> struct NpfFaParams {
    const T* q; const T* k; const T* v;      // (B, H, Tq or Tk, hs or hv), each through its layout below
    T* out; const T* dout;                   // (B, H, Tq, hv)
    T* dq; T* dk; T* dv;
    A* lse; A* dvec;                         // (B, H, Tq) contiguous: the forward's log-sum-exp, D = rowsum(dO O)
    NpfFaLayout ql, kl, vl, ol, gl, dql, dkl, dvl;   // of q, k, v, out, dout, dq, dk, dv
    NpfFaArgs<A> a;
};

// The offset of head bh = b H + h
__device__ __forceinline__ long long npf_fa_head(const NpfFaLayout& l, long long bh, int H) {
    return (bh / H) * l.sb + (bh % H) * l.sh;
}

// _keep's flat index n of (bh, i, j) is ((bh Tq + i) Tk + j): row i of head bh starts at (bh Tq + i) Tk
template <typename A>
__device__ __forceinline__ unsigned long long npf_fa_keep_row(const NpfFaArgs<A>& a, long long bh, int i) {
    return ((unsigned long long)bh * (unsigned long long)a.Tq + (unsigned long long)i) * (unsigned long long)a.Tk;
}

// Whether _keep keeps key j of the row that starts at keep_row (npf_fa_keep_row), and its scaled mask
// value there: 1 / (1 - p) or 0
template <typename A>
__device__ __forceinline__ bool npf_fa_kept(const NpfFaArgs<A>& a, unsigned long long seed, unsigned long long keep_row,
                                            int j) {
    return npf_keep(seed, keep_row + (unsigned long long)j, a.keep_min);
}
template <typename A>
__device__ __forceinline__ A npf_fa_keep_value(const NpfFaArgs<A>& a, unsigned long long seed,
                                               unsigned long long keep_row, int j) {
    return npf_fa_kept(a, seed, keep_row, j) ? a.keep_scale : A(0);
}

// Where row i of head bh's attn mask starts, and head bh's padding row (in the masks' elements)
template <typename A> __device__ __forceinline__ long long npf_fa_mask_row(const NpfFaArgs<A>& a, long long bh, int i) {
    return bh * a.mask_bh + (long long)i * a.mask_ld;
}
template <typename A> __device__ __forceinline__ long long npf_fa_pad_row(const NpfFaArgs<A>& a, long long bh) {
    return (bh / a.H) * a.pad_ld;
}

// One past the last key of head bh that bool padding leaves visible (Tk without it)
template <typename A> __device__ __forceinline__ int npf_fa_key_end(const NpfFaArgs<A>& a, long long bh) {
    return a.pad_kind == 1 ? a.key_end[bh / a.H] : a.Tk;
}

// Bit j of a packed bool mask row (32 keys a word, key j at bit j % 32 of word j / 32)
__device__ __forceinline__ bool npf_fa_bit(const unsigned* row, int j) {
    return (row[j >> 5] >> (j & 31)) & 1u;
}

// _scores for one element, from dot = q_i . k_j:  s = dot * scale; s += attn bias; s += padding bias;
// s += -inf where j > i + shift (causal). A key past Tk is -inf; a query row past Tq (the ragged end of
// the last tile) is never stored and gets no mask. BITS: bool masks as bits (the tensor-core kernels)
// or as bytes (the SIMT kernels: a bit test there costs them 30-70 registers in ptxas 12.9, below their
// occupancy).
// (mask_row = npf_fa_mask_row(a, bh, i) and pad_row = npf_fa_pad_row(a, bh): where row i's attn mask and
// head bh's padding start, which a caller scoring many elements of one row computes once)
template <typename A, bool BITS = false>
__device__ __forceinline__ A npf_fa_score_at(A dot, const NpfFaArgs<A>& a, int i, int j, long long mask_row,
                                             long long pad_row) {
    const A inf = npf_fa_inf(dot);
    if (j >= a.Tk) return -inf;
    A s = dot * a.scale;
    if (i >= a.Tq) return s;
    if (a.mask_kind) {
        const bool blocked = BITS ? npf_fa_bit(a.mask_bits + mask_row, j) : a.mask_b[mask_row + j];
        s += a.mask_kind == 1 ? (blocked ? -inf : A(0)) : a.mask_f[mask_row + j];
    }
    if (a.pad_kind) {
        const bool blocked = BITS ? npf_fa_bit(a.pad_bits + pad_row, j) : a.pad_b[pad_row + j];
        s += a.pad_kind == 1 ? (blocked ? -inf : A(0)) : a.pad_f[pad_row + j];
    }
    if (a.causal && j > i + a.shift) s += -inf;
    return s;
}
template <typename A>
__device__ __forceinline__ A npf_fa_score(A dot, const NpfFaArgs<A>& a, long long bh, int i, int j) {
    return npf_fa_score_at(dot, a, i, j, npf_fa_mask_row(a, bh, i), npf_fa_pad_row(a, bh));
}

// Rows [r0, r0 + N) of one head's (rows, width) matrix x (rows `stride` apart) into s (N, D + 4), zeros
// past rows and width.
template <typename T, typename A, int N, int D>
__device__ __forceinline__ void npf_fa_load(const T* x, int r0, int rows, int width, long long stride, A* s) {
    for (int e = threadIdx.x; e < N * D; e += NPF_FA_THREADS) {
        int r = e / D, d = e % D;
        A value = A(0);
        if (r0 + r < rows && d < width) value = npf_load(x[(long long)(r0 + r) * stride + d]);
        s[r * (D + 4) + d] = value;
    }
}

// s[a][b] = X[tr + 16 a] . Y[tc + 8 b] over D (X, Y: (.., D + 4) tiles)
template <typename A, int R, int C, int D>
__device__ __forceinline__ void npf_fa_dot(const A* X, const A* Y, A (&s)[R][C]) {
    const int tr = threadIdx.x / NPF_FA_TC, tc = threadIdx.x % NPF_FA_TC;
#pragma unroll
    for (int a = 0; a < R; ++a)
#pragma unroll
        for (int b = 0; b < C; ++b) s[a][b] = A(0);
#pragma unroll 4
    for (int d = 0; d < D; ++d) {
        A x[R], y[C];
#pragma unroll
        for (int a = 0; a < R; ++a) x[a] = X[(tr + NPF_FA_TR * a) * (D + 4) + d];
#pragma unroll
        for (int b = 0; b < C; ++b) y[b] = Y[(tc + NPF_FA_TC * b) * (D + 4) + d];
#pragma unroll
        for (int a = 0; a < R; ++a)
#pragma unroll
            for (int b = 0; b < C; ++b) s[a][b] += x[a] * y[b];
    }
}

// The head column of a thread's accumulator column c: runs of 4 (one 16-byte load), the 8 column lanes'
// runs side by side: (c / 4) 32 + 4 tc + c % 4
__device__ __forceinline__ int npf_fa_col(int tc, int c) { return (c >> 2) * (4 * NPF_FA_TC) + tc * 4 + (c & 3); }

// A thread's accumulator rows r0 + tr + 16 a (its head columns npf_fa_col(tc, c)) times `scale` into rows of x
// (`st` values apart): the rows below `rows`, the columns below `width`
template <typename T, typename A, int R, int DC>
__device__ __forceinline__ void npf_fa_store_rows(T* x, long long st, int r0, int rows, int width,
                                                  const A (&acc)[R][DC], A scale) {
    const int tr = threadIdx.x / NPF_FA_TC, tc = threadIdx.x % NPF_FA_TC;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int i = r0 + tr + NPF_FA_TR * r;
        if (i >= rows) continue;
#pragma unroll
        for (int c = 0; c < DC; ++c) {
            const int d = npf_fa_col(tc, c);
            if (d < width) npf_store(x + i * st + d, acc[r][c] * scale);
        }
    }
}

// acc[a][c] += sum_j P[tr + 16 a][j] W[j][npf_fa_col(tc, c)] over N (P: (.., PS) with row stride PS,
// W: (N, D + 4))
template <typename A, int R, int DC, int N, int PS, int D>
__device__ __forceinline__ void npf_fa_acc(const A* P, const A* W, A (&acc)[R][DC]) {
    const int tr = threadIdx.x / NPF_FA_TC, tc = threadIdx.x % NPF_FA_TC;
#pragma unroll 4
    for (int j = 0; j < N; ++j) {
        A p[R], w[DC];
#pragma unroll
        for (int a = 0; a < R; ++a) p[a] = P[(tr + NPF_FA_TR * a) * PS + j];
#pragma unroll
        for (int c = 0; c < DC; ++c) w[c] = W[j * (D + 4) + npf_fa_col(tc, c)];
#pragma unroll
        for (int a = 0; a < R; ++a)
#pragma unroll
            for (int c = 0; c < DC; ++c) acc[a][c] += p[a] * w[c];
    }
}

// The number of key tiles query rows [i0, i1) see: all, or up to the last one holding a key
// j <= i1 - 1 + shift (_visible); 0 when even that is negative.
template <int BC>
__device__ __forceinline__ int npf_fa_key_tiles(int i1, int Tk, int causal, int shift) {
    int n = (Tk + BC - 1) / BC;
    if (!causal) return n;
    int last = i1 - 1 + shift;
    return last < 0 ? 0 : npf_fa_min(n, last / BC + 1);
}

// The first key tile of tiles of BC keys that holds a key one of query rows [i0, ...) must not see: past row
// i0's diagonal (causal), or past Tk (a ragged last tile); the n_kt tiles before it need no masks
template <int BC>
__device__ __forceinline__ int npf_fa_masked_from(int i0, int n_kt, bool causal, const NpfFaArgs<float>& a) {
    return npf_fa_min(causal ? npf_fa_min(npf_fa_max0(i0 + a.shift + 1) / BC, a.Tk / BC) : a.Tk / BC, n_kt);
}

// For keys [j0, j0 + BC) over n_qt tiles of BQ query rows: the first tile with a row that sees one of the
// keys (causal; else 0), and the first from which every row sees every key: the tiles between need the
// causal mask
template <int BQ>
__device__ __forceinline__ int npf_fa_first_query_tile(int j0, int n_qt, bool causal, const NpfFaArgs<float>& a) {
    return causal ? npf_fa_min(npf_fa_max0(j0 - a.shift) / BQ, n_qt) : 0;
}
template <int BC, int BQ>
__device__ __forceinline__ int npf_fa_unmasked_query_tile(int j0, int qt0, int n_qt, bool causal,
                                                          const NpfFaArgs<float>& a) {
    return causal ? npf_fa_min(npf_fa_max(qt0, (npf_fa_max0(j0 + BC - 1 - a.shift) + BQ - 1) / BQ), n_qt) : 0;
}

// A query tile's lse and D (rows [i0, i0 + BR)) into ld_s (BR lse, then BR D), THREADS threads: rows past Tq
// get lse +inf, so that P = exp(S - inf) = 0, and D 0. NEG_LOG2: -lse log2(e) instead of lse (-inf past Tq),
// the offset of P = 2^(S scale log2(e) - lse log2(e)) in a kernel that works in base 2.
template <int BR, int THREADS, bool NEG_LOG2 = false>
__device__ __forceinline__ void npf_fa_query_stats(const float* lse, const float* dvec, long long bh, int i0,
                                                   const NpfFaArgs<float>& a, float* ld_s) {
    for (int e = threadIdx.x; e < BR; e += THREADS) {
        const bool in = i0 + e < a.Tq;
        const float x = in ? lse[bh * a.Tq + i0 + e] : npf_fa_inf(0.0f);
        ld_s[e] = NEG_LOG2 ? -x * 1.4426950408889634f : x;
        ld_s[BR + e] = in ? dvec[bh * a.Tq + i0 + e] : 0.0f;
    }
}

// npf_fa_key_tiles for head bh: none at or past its padding's key end (those tiles are all -inf)
template <int BC, typename A>
__device__ __forceinline__ int npf_fa_head_key_tiles(const NpfFaArgs<A>& a, long long bh, int n_kt) {
    return npf_fa_min(n_kt, (npf_fa_key_end(a, bh) + BC - 1) / BC);
}

// Forward: block (x: query tile, last first so the longest causal rows start first; y: b H + h).
//   per key tile:  S = score(q_i k_j^T);  m_new = max(m, rowmax S);  shift = m_new, or 0 if infinite
//                  P = exp(S - shift);  alpha = exp(m - shift);  l = alpha l + rowsum P
//                  acc = alpha acc + dropout(P) v_j;  m = m_new
//   then  out = acc / l (l = 0 -> 1: zeros),  lse = m + log l (l = 0 -> +inf)
template <typename T, typename A, int D, int BR, int BC>
__device__ void npf_fa_forward(const T* q, const T* k, const T* v, T* out, A* lse, const NpfFaArgs<A>& a,
                               NpfFaLayout ql, NpfFaLayout kl, NpfFaLayout vl, NpfFaLayout ol) {
    typedef NpfFaShape<A, D, BR, BC> S;
    constexpr int R = BR / NPF_FA_TR, C = BC / NPF_FA_TC, DC = D / NPF_FA_TC, CP = BC + 4;
    NPF_FA_SHARED(smem, S::FWD * sizeof(A));
    A* Qs = reinterpret_cast<A*>(smem);      // (BR, DP)
    A* Ks = Qs + BR * S::DP;                 // (BC, DP)
    A* Vs = Ks + BC * S::DP;                 // (BC, DP)
    A* Ps = Vs + BC * S::DP;                 // (BR, CP) dropout(P)
    A* red_m = Ps + BR * CP;                 // (BR, 8) the row lanes' partial max
    A* red_l = red_m + BR * NPF_FA_TC;       // (BR, 8) and partial sums
    const int tr = threadIdx.x / NPF_FA_TC, tc = threadIdx.x % NPF_FA_TC;
    const int i0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * BR;
    const int n_kt_all = npf_fa_key_tiles<BC>(npf_fa_min(i0 + BR, a.Tq), a.Tk, a.causal, a.shift);
    const unsigned long long seed = a.keep_min ? npf_seed(a.seed_draws) : 0ULL;
    const A inf = npf_fa_inf(A(0));
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        const int n_kt = npf_fa_head_key_tiles<BC>(a, bh, n_kt_all);
        __syncthreads();                                     // the previous head's readers are done
        npf_fa_load<T, A, BR, D>(q + npf_fa_head(ql, bh, a.H), i0, a.Tq, a.hs, ql.st, Qs);
        A m[R], l[R], acc[R][DC];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            m[r] = -inf;
            l[r] = A(0);
#pragma unroll
            for (int c = 0; c < DC; ++c) acc[r][c] = A(0);
        }
        for (int kt = 0; kt < n_kt; ++kt) {
            const int j0 = kt * BC;
            __syncthreads();                                 // done with the last tile's K, V, P
            npf_fa_load<T, A, BC, D>(k + npf_fa_head(kl, bh, a.H), j0, a.Tk, a.hs, kl.st, Ks);
            npf_fa_load<T, A, BC, D>(v + npf_fa_head(vl, bh, a.H), j0, a.Tk, a.hv, vl.st, Vs);
            __syncthreads();
            A s[R][C];
            npf_fa_dot<A, R, C, D>(Qs, Ks, s);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = tr + NPF_FA_TR * r;
                A mx = -inf;
#pragma unroll
                for (int c = 0; c < C; ++c) {
                    s[r][c] = npf_fa_score(s[r][c], a, bh, i0 + row, j0 + tc + NPF_FA_TC * c);
                    mx = npf_max(mx, s[r][c]);
                }
                red_m[row * NPF_FA_TC + tc] = mx;
            }
            __syncthreads();
            A alpha[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = tr + NPF_FA_TR * r;
                A m_new = m[r];
#pragma unroll
                for (int t = 0; t < NPF_FA_TC; ++t) m_new = npf_max(m_new, red_m[row * NPF_FA_TC + t]);
                const A shift = npf_fa_isinf(m_new) ? A(0) : m_new;   // all -inf so far: no inf - inf
                alpha[r] = npf_exp(m[r] - shift);
                A sum = A(0);
#pragma unroll
                for (int c = 0; c < C; ++c) {
                    A p = npf_exp(s[r][c] - shift);
                    sum += p;
                    if (a.keep_min)
                        p *= npf_fa_keep_value(a, seed, npf_fa_keep_row(a, bh, i0 + row), j0 + tc + NPF_FA_TC * c);
                    Ps[row * CP + tc + NPF_FA_TC * c] = p;
                }
                red_l[row * NPF_FA_TC + tc] = sum;
                m[r] = m_new;
            }
            __syncthreads();
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = tr + NPF_FA_TR * r;
                A sum = A(0);
#pragma unroll
                for (int t = 0; t < NPF_FA_TC; ++t) sum += red_l[row * NPF_FA_TC + t];
                l[r] = l[r] * alpha[r] + sum;
#pragma unroll
                for (int c = 0; c < DC; ++c) acc[r][c] *= alpha[r];
            }
            npf_fa_acc<A, R, DC, BC, CP, D>(Ps, Vs, acc);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int i = i0 + tr + NPF_FA_TR * r;
            if (i >= a.Tq) continue;
            const bool empty = l[r] == A(0);                 // a fully masked row: zeros, lse +inf
            const A den = empty ? A(1) : l[r];
            const long long at = bh * a.Tq + i;
            T* out_row = out + npf_fa_head(ol, bh, a.H) + i * ol.st;
#pragma unroll
            for (int c = 0; c < DC; ++c) {
                const int d = npf_fa_col(tc, c);
                if (d < a.hv) npf_store(out_row + d, acc[r][c] / den);
            }
            if (tc == 0) lse[at] = empty ? inf : m[r] + npf_log(l[r]);
        }
    }
}

// D_i = rowsum(dO_i * O_i) for each of `rows` = B H Tq rows of hv values (row = bh Tq + i): a warp per row
// (blockDim.x a multiple of 32), lane l adding the values l, l + 32, ... (a warp's loads are consecutive:
// coalesced), then the 32 partial sums by a butterfly of shuffles
template <typename T, typename A>
__device__ void npf_fa_bwd_pre(const T* dout, const T* out, A* dvec, long long rows, int hv, int Tq, int H,
                               NpfFaLayout gl, NpfFaLayout ol) {
    const long long warps = (long long)gridDim.x * blockDim.x / 32;
    const int lane = threadIdx.x % 32;
    for (long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; row < rows; row += warps) {
        const long long bh = row / Tq, i = row % Tq;
        const T* g = dout + npf_fa_head(gl, bh, H) + i * gl.st;
        const T* o = out + npf_fa_head(ol, bh, H) + i * ol.st;
        A s = A(0);
        for (int d = lane; d < hv; d += 32) s += npf_load(g[d]) * npf_load(o[d]);
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
        if (lane == 0) dvec[row] = s;
    }
}

// The recomputed probability and score gradient of one element (the backward's inner step), query i and
// key j of head bh from dot = q_i . k_j and dp = dO_i . v_j:
//   P = exp(S - lse_i);  g = dP keep;  dS = ((g - D_i) P) scale;  P_drop = P keep
// (mask_row, pad_row: npf_fa_score_at's; BITS: bool masks as bits)
template <typename A, bool BITS = false>
__device__ __forceinline__ void npf_fa_grad(A dot, A dp, A lse_i, A d_i, const NpfFaArgs<A>& a, unsigned long long seed,
                                            long long bh, int i, int j, long long mask_row, long long pad_row,
                                            A& p_drop, A& ds) {
    const A p = npf_exp(npf_fa_score_at<A, BITS>(dot, a, i, j, mask_row, pad_row) - lse_i);
    A g = dp;
    p_drop = p;
    if (a.keep_min) {
        const A keep = npf_fa_keep_value(a, seed, npf_fa_keep_row(a, bh, i), j);
        p_drop = p * keep;
        g *= keep;
    }
    g -= d_i;
    g *= p;
    ds = g * a.scale;
}

// dK, dV: block (x: key tile, y: b H + h), looping over the query tiles that see the key tile.
// Thread rows are keys, columns queries:  dv_j += P_drop^T dO_i,  dk_j += dS^T q_i
template <typename T, typename A, int D, int BR, int BC>
__device__ void npf_fa_bwd_dkdv(const T* q, const T* k, const T* v, const T* dout, const A* lse, const A* dvec,
                                T* dk, T* dv, const NpfFaArgs<A>& a, NpfFaLayout ql, NpfFaLayout kl,
                                NpfFaLayout vl, NpfFaLayout gl, NpfFaLayout dkl, NpfFaLayout dvl) {
    typedef NpfFaShape<A, D, BR, BC> S;
    constexpr int R = BC / NPF_FA_TR, C = BR / NPF_FA_TC, DC = D / NPF_FA_TC, RP = BR + 4;
    NPF_FA_SHARED(smem, S::DKDV * sizeof(A));
    A* Ks = reinterpret_cast<A*>(smem);      // (BC, DP)
    A* Vs = Ks + BC * S::DP;                 // (BC, DP)
    A* Qs = Vs + BC * S::DP;                 // (BR, DP)
    A* dOs = Qs + BR * S::DP;                // (BR, DP)
    A* Pt = dOs + BR * S::DP;                // (BC, RP) P_drop^T
    A* St = Pt + BC * RP;                    // (BC, RP) dS^T
    A* lse_s = St + BC * RP;                 // (BR)
    A* d_s = lse_s + BR;                     // (BR)
    const int tr = threadIdx.x / NPF_FA_TC, tc = threadIdx.x % NPF_FA_TC;
    const int j0 = blockIdx.x * BC;
    const int n_qt = (a.Tq + BR - 1) / BR;
    const unsigned long long seed = a.keep_min ? npf_seed(a.seed_draws) : 0ULL;
    const A inf = npf_fa_inf(A(0));
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        const int n_qt_head = j0 < npf_fa_key_end(a, bh) ? n_qt : 0;   // keys all padding: zeros
        __syncthreads();
        npf_fa_load<T, A, BC, D>(k + npf_fa_head(kl, bh, a.H), j0, a.Tk, a.hs, kl.st, Ks);
        npf_fa_load<T, A, BC, D>(v + npf_fa_head(vl, bh, a.H), j0, a.Tk, a.hv, vl.st, Vs);
        A dka[R][DC], dva[R][DC];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int c = 0; c < DC; ++c) dka[r][c] = dva[r][c] = A(0);
        for (int qt = 0; qt < n_qt_head; ++qt) {
            const int i0 = qt * BR;
            if (a.causal && j0 > npf_fa_min(i0 + BR, a.Tq) - 1 + a.shift) continue;   // wholly in the future
            __syncthreads();                                 // done with the last query tile
            npf_fa_load<T, A, BR, D>(q + npf_fa_head(ql, bh, a.H), i0, a.Tq, a.hs, ql.st, Qs);
            npf_fa_load<T, A, BR, D>(dout + npf_fa_head(gl, bh, a.H), i0, a.Tq, a.hv, gl.st, dOs);
            for (int e = threadIdx.x; e < BR; e += NPF_FA_THREADS) {
                const bool in = i0 + e < a.Tq;               // rows past Tq: P = exp(S - inf) = 0
                lse_s[e] = in ? lse[bh * a.Tq + i0 + e] : inf;
                d_s[e] = in ? dvec[bh * a.Tq + i0 + e] : A(0);
            }
            __syncthreads();
            A st[R][C], dpt[R][C];
            npf_fa_dot<A, R, C, D>(Ks, Qs, st);              // S^T: keys x queries
            npf_fa_dot<A, R, C, D>(Vs, dOs, dpt);            // dP^T = (dO v^T)^T
            A lse_c[C], d_c[C];                              // this thread's queries' lse and D
#pragma unroll
            for (int c = 0; c < C; ++c) {
                lse_c[c] = lse_s[tc + NPF_FA_TC * c];
                d_c[c] = d_s[tc + NPF_FA_TC * c];
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = tr + NPF_FA_TR * r;
#pragma unroll
                for (int c = 0; c < C; ++c) {
                    const int col = tc + NPF_FA_TC * c;
                    A p_drop, ds;
                    const int i = i0 + col;
                    npf_fa_grad(st[r][c], dpt[r][c], lse_c[c], d_c[c], a, seed, bh, i, j0 + row,
                                npf_fa_mask_row(a, bh, i), npf_fa_pad_row(a, bh), p_drop, ds);
                    Pt[row * RP + col] = p_drop;
                    St[row * RP + col] = ds;
                }
            }
            __syncthreads();
            npf_fa_acc<A, R, DC, BR, RP, D>(Pt, dOs, dva);   // dv_j += P_drop^T dO_i
            npf_fa_acc<A, R, DC, BR, RP, D>(St, Qs, dka);    // dk_j += dS^T q_i
        }
        npf_fa_store_rows(dk + npf_fa_head(dkl, bh, a.H), dkl.st, j0, a.Tk, a.hs, dka, A(1));
        npf_fa_store_rows(dv + npf_fa_head(dvl, bh, a.H), dvl.st, j0, a.Tk, a.hv, dva, A(1));
    }
}

// dQ: block (x: query tile, last first; y: b H + h) over its visible key tiles:  dq_i += dS k_j
template <typename T, typename A, int D, int BR, int BC>
__device__ void npf_fa_bwd_dq(const T* q, const T* k, const T* v, const T* dout, const A* lse, const A* dvec,
                              T* dq, const NpfFaArgs<A>& a, NpfFaLayout ql, NpfFaLayout kl, NpfFaLayout vl,
                              NpfFaLayout gl, NpfFaLayout dql) {
    typedef NpfFaShape<A, D, BR, BC> S;
    constexpr int R = BR / NPF_FA_TR, C = BC / NPF_FA_TC, DC = D / NPF_FA_TC, CP = BC + 4;
    NPF_FA_SHARED(smem, S::DQ * sizeof(A));
    A* Qs = reinterpret_cast<A*>(smem);      // (BR, DP)
    A* dOs = Qs + BR * S::DP;                // (BR, DP)
    A* Ks = dOs + BR * S::DP;                // (BC, DP)
    A* Vs = Ks + BC * S::DP;                 // (BC, DP)
    A* Ss = Vs + BC * S::DP;                 // (BR, CP) dS
    const int tr = threadIdx.x / NPF_FA_TC, tc = threadIdx.x % NPF_FA_TC;
    const int i0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * BR;
    const int n_kt_all = npf_fa_key_tiles<BC>(npf_fa_min(i0 + BR, a.Tq), a.Tk, a.causal, a.shift);
    const unsigned long long seed = a.keep_min ? npf_seed(a.seed_draws) : 0ULL;
    const A inf = npf_fa_inf(A(0));
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        const int n_kt = npf_fa_head_key_tiles<BC>(a, bh, n_kt_all);
        __syncthreads();
        npf_fa_load<T, A, BR, D>(q + npf_fa_head(ql, bh, a.H), i0, a.Tq, a.hs, ql.st, Qs);
        npf_fa_load<T, A, BR, D>(dout + npf_fa_head(gl, bh, a.H), i0, a.Tq, a.hv, gl.st, dOs);
        A lse_r[R], d_r[R], dqa[R][DC];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int i = i0 + tr + NPF_FA_TR * r;
            lse_r[r] = i < a.Tq ? lse[bh * a.Tq + i] : inf;
            d_r[r] = i < a.Tq ? dvec[bh * a.Tq + i] : A(0);
#pragma unroll
            for (int c = 0; c < DC; ++c) dqa[r][c] = A(0);
        }
        for (int kt = 0; kt < n_kt; ++kt) {
            const int j0 = kt * BC;
            __syncthreads();
            npf_fa_load<T, A, BC, D>(k + npf_fa_head(kl, bh, a.H), j0, a.Tk, a.hs, kl.st, Ks);
            npf_fa_load<T, A, BC, D>(v + npf_fa_head(vl, bh, a.H), j0, a.Tk, a.hv, vl.st, Vs);
            __syncthreads();
            A s[R][C], dp[R][C];
            npf_fa_dot<A, R, C, D>(Qs, Ks, s);
            npf_fa_dot<A, R, C, D>(dOs, Vs, dp);             // dP = dO v^T
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = tr + NPF_FA_TR * r;
#pragma unroll
                for (int c = 0; c < C; ++c) {
                    const int col = tc + NPF_FA_TC * c;
                    A p_drop, ds;
                    const int i = i0 + row;
                    npf_fa_grad(s[r][c], dp[r][c], lse_r[r], d_r[r], a, seed, bh, i, j0 + col,
                                npf_fa_mask_row(a, bh, i), npf_fa_pad_row(a, bh), p_drop, ds);
                    Ss[row * CP + col] = ds;
                }
            }
            __syncthreads();
            npf_fa_acc<A, R, DC, BC, CP, D>(Ss, Ks, dqa);    // dq_i += dS k_j
        }
        npf_fa_store_rows(dq + npf_fa_head(dql, bh, a.H), dql.st, i0, a.Tq, a.hs, dqa, A(1));
    }
}

// ---- tensor cores (warp_source.py's primitives): FlashAttention-2's work split ----
// A block of 4 warps takes BR = 64 query rows, a warp its own 16; per key tile of BC keys (K and V in
// shared memory) the warp computes S = Q K^T with mma.sync, scores and the online softmax in registers
// (a row lives in the 4 lanes of a quad: its max and sum are two shuffles), P rounded to the operand type
// as the A fragments of O += P V. The same arithmetic as npf_fa_forward, with the products on tensor
// cores (float32 accumulators); masks, causal tiles, dropout and the outputs are its. The operands come
// through an Ops policy: NpfHalfOps<T> (float16 or bfloat16 tiles, m16n8k16, ldmatrix) or NpfTf32Ops (float32 tiles,
// TF32 m16n8k8: each operand rounded by cvt.rna as it is read, the float32 opt-in).
#define NPF_FA_TC_BR 64

// Rows [r0, r0 + N) of one head's (rows, width) matrix x of T into s (N, D + E), E = 16 / sizeof(T) (rows
// 16 bytes longer: 16-byte aligned, no bank conflicts), zeros past rows and width: 16 bytes (E values) a
// load when every row starts 16-byte aligned and width is a multiple of E (the heads of a packed
// projection with hs % E == 0), else a value a load
struct __align__(16) NpfU4 { unsigned x, y, z, w; };
template <typename T, int N, int D>
__device__ __noinline__ void npf_fa_load_tile(const T* x, int r0, int rows, int width, long long stride, T* s) {
    constexpr int E = 16 / sizeof(T), LD = D + E;       // (not inlined: fewer registers in the loops)
    if (width % E == 0 && stride % E == 0 && ((unsigned long long)(size_t)x & 15) == 0) {
        constexpr int C = D / E;
        for (int e = threadIdx.x; e < N * C; e += NPF_FA_THREADS) {
            int r = e / C, c = e % C;
            NpfU4 value = {0u, 0u, 0u, 0u};
            if (r0 + r < rows && c * E < width)
                value = *reinterpret_cast<const NpfU4*>(x + (long long)(r0 + r) * stride + c * E);
            *reinterpret_cast<NpfU4*>(s + r * LD + c * E) = value;
        }
        return;
    }
    for (int e = threadIdx.x; e < N * D; e += NPF_FA_THREADS) {
        int r = e / D, d = e % D;
        T value{};
        if (r0 + r < rows && d < width) value = x[(long long)(r0 + r) * stride + d];
        s[r * LD + d] = value;
    }
}

// npf_fa_load_tile through cp.async (16 bytes a copy, zeros past rows and width) where rows are 16-byte
// aligned and width a multiple of E: the copies land while the block computes (npf_cp_async_wait before
// the tile is read); elsewhere the synchronous loads
// A thread copies one 16-byte column chunk c of every PASS-th row (PASS = THREADS / C rows a pass of the
// block), so its source and destination advance by constants; a whole tile (every row there, the thread's
// chunk within the width: the common case) needs no bounds check a copy, only its source address.
template <typename T, int N, int D>
__device__ __noinline__ void npf_fa_load_tile_async(const T* x, int r0, int rows, int width, long long stride, T* s) {
    constexpr int E = 16 / sizeof(T), LD = D + E, C = D / E, PASS = NPF_FA_THREADS / C;
    static_assert(NPF_FA_THREADS % C == 0, "a pass of the block covers whole rows");
    if (!(width % E == 0 && stride % E == 0 && ((unsigned long long)(size_t)x & 15) == 0)) {
        npf_fa_load_tile<T, N, D>(x, r0, rows, width, stride, s);
        return;
    }
    const int c = threadIdx.x % C, first = threadIdx.x / C;
    const bool column = c * E < width;
    const T* from = x + (long long)(r0 + first) * stride + c * E;
    T* to = s + first * LD + c * E;
    if (column && r0 + N <= rows) {                      // every row of the tile, the thread's column: no checks
#pragma unroll
        for (int pass = 0; pass < (N + PASS - 1) / PASS; ++pass)
            if (N % PASS == 0 || first + pass * PASS < N)
                npf_cp_async_16(to + pass * PASS * LD, from + pass * PASS * stride);
        return;
    }
#pragma unroll
    for (int pass = 0; pass < (N + PASS - 1) / PASS; ++pass) {
        const int r = first + pass * PASS;
        if (N % PASS == 0 || r < N) {
            const bool in = column && r0 + r < rows;
            npf_cp_async_16_zfill(to, in ? from : x, in ? 16 : 0);
        }
        from += PASS * stride;
        to += PASS * LD;
    }
}

// Rows [r0, r0 + N) of x and of y into s, (N, LD) then (N, LD), through npf_fa_load_tile_async: one call
// where NpfFaTilePair's tile is not whole (fewer instructions in its callers' loops than two)
template <typename T, int N, int D>
__device__ __noinline__ void npf_fa_load_pair_async(const T* x, long long x_stride, int x_width, const T* y,
                                                    long long y_stride, int y_width, int r0, int rows, T* s) {
    npf_fa_load_tile_async<T, N, D>(x, r0, rows, x_width, x_stride, s);
    npf_fa_load_tile_async<T, N, D>(y, r0, rows, y_width, y_stride, s + N * (D + 16 / (int)sizeof(T)));
}

// Key tile [j0, j0 + BC) of K and of V into one buffer, (BC, LD) K then (BC, LD) V, through cp.async
template <typename T, int BC, int D>
__device__ __forceinline__ void npf_fa_load_kv_async(const T* k_head, const T* v_head, int j0,
                                                     const NpfFaArgs<float>& a, long long k_st, long long v_st, T* kv) {
    npf_fa_load_pair_async<T, BC, D>(k_head, k_st, a.hs, v_head, v_st, a.hv, j0, a.Tk, kv);
}

// The tiles of N rows of two matrices of one head with the same rows (K and V, or Q and dO), from row r0 on:
// rows [r0, r0 + N) of each, then [r0 + N, r0 + 2 N), ..., each tile of the pair into s as (N, LD) of the first
// then (N, LD) of the second, through cp.async as npf_fa_load_tile_async copies them. Where both are whole (the
// tile's N rows there, both heads' rows 16-byte aligned, the thread's 16-byte column inside both widths, a tile
// under 2^31 elements: the common case) the copies are made in line: the thread's two sources advance by N rows
// a tile and its copies are fixed offsets of PASS rows from there, so that a tile costs little more than its
// copies. The rest (a ragged last tile, unaligned rows) goes to npf_fa_load_pair_async, out of line, as every
// tile does without IN_LINE (for a kernel with no registers to spare for the sources: there the copies'
// addresses are worked out from the heads' starts, a tile at a time).
template <typename T, int N, int D, bool IN_LINE = true> struct NpfFaTilePair {
    static constexpr int E = 16 / sizeof(T), LD = D + E, C = D / E, PASS = NPF_FA_THREADS / C;
    const T *x, *y;
    const T *x_from, *y_from;                            // the thread's first copy of the next tile, each
    long long x_stride, y_stride;
    int rows, x_width, y_width, r0;                      // r0: the next tile's first row
    int room;                                            // rows past the next tile's end; < 0: not whole
    __device__ __forceinline__ NpfFaTilePair(const T* x_, long long x_stride_, int x_width_, const T* y_,
                                             long long y_stride_, int y_width_, int rows_, int r0_)
        : x(x_), y(y_), x_stride(x_stride_), y_stride(y_stride_), rows(rows_), x_width(x_width_),
          y_width(y_width_), r0(r0_) {
        const int first = r0 + (int)threadIdx.x / C;
        x_from = x + first * x_stride + column();
        y_from = y + first * y_stride + column();
        room = whole(x, x_stride, x_width) && whole(y, y_stride, y_width) ? rows - r0 - N : -1;
    }
    // the thread's 16 bytes of a row: its first column (C threads a row)
    static __device__ __forceinline__ int column() { return (int)threadIdx.x * E % D; }
    static __device__ __forceinline__ bool whole(const T* m, long long stride, int width) {
        return width % E == 0 && stride % E == 0 && ((unsigned long long)(size_t)m & 15) == 0 && column() < width
               && N * stride < (1LL << 31);
    }
    // the next tile of each into s: (N, LD) then (N, LD)
    __device__ __forceinline__ void next(T* s) {
        if (IN_LINE && room >= 0) {
            T* to = s + threadIdx.x / C * LD + threadIdx.x % C * E;    // (column(): so written, dQ at D 128 spills)
            const int x_step = (int)(PASS * x_stride), y_step = (int)(PASS * y_stride);
#pragma unroll
            for (int pass = 0; pass < (N + PASS - 1) / PASS; ++pass)
                if (N % PASS == 0 || (int)threadIdx.x / C + pass * PASS < N) {
                    npf_cp_async_16(to + pass * PASS * LD, x_from + pass * x_step);
                    npf_cp_async_16(to + N * LD + pass * PASS * LD, y_from + pass * y_step);
                }
        } else {
            npf_fa_load_pair_async<T, N, D>(x, x_stride, x_width, y, y_stride, y_width, r0, rows, s);
        }
        r0 += N;
        room = room >= N ? room - N : -1;
        x_from += N * x_stride;
        y_from += N * y_stride;
    }
};

// The two 16-bit operand types of m16n8k16, float16 (unsigned short) and bfloat16 (npf_bf16): the same
// fragment layouts (the PTX ISA's tables for .f16 and .bf16 are one), each its own mma.sync and its own
// conversion of two floats to a pair, lo in the low 16 bits (the A fragment's order): one
// cvt.rn.{f16x2,bf16x2}.f32 on sm_80 and later (its first source goes to the upper half), two
// conversions (npf_store) before and in the emulator.
template <typename T> struct Npf16;
template <> struct Npf16<unsigned short> {
    static constexpr bool BF16 = false;
    static __device__ __forceinline__ unsigned short bits(unsigned short h) { return h; }
};
template <> struct Npf16<npf_bf16> {
    static constexpr bool BF16 = true;
    static __device__ __forceinline__ unsigned short bits(npf_bf16 h) { return h.bits; }
};
template <typename T> __device__ __forceinline__ unsigned npf_pack2(float lo, float hi) {
#if defined(__CUDACC__) && __CUDA_ARCH__ >= 800
    unsigned r;
    if (Npf16<T>::BF16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    T l, h;
    npf_store(&l, lo);
    npf_store(&h, hi);
    return (unsigned)Npf16<T>::bits(l) | ((unsigned)Npf16<T>::bits(h) << 16);
#endif
}

// The operands of a warp's tile products, by type. Tiles are (rows, LD) in shared memory, LD = D + PAD.
//   a_rows: the A fragment of rows r0 .. r0 + 15 and columns k0 .. k0 + K - 1 of X (for X Y^T)
//   b_rows: the B fragments of two 8-column blocks of Y^T: rows n0 .. n0 + 15 of Y (b[0..1] the first
//           block, b[2..3] the second), columns k0 .. k0 + K - 1 (for X Y^T)
//   b_cols: the B fragments of rows k0 .. k0 + K - 1 of Y and two 8-column blocks from n0 (for C Y)
//   a_from_c: the A fragment of keys k0 .. k0 + K - 1 from the C fragments c[0], ... of those keys (the
//           scores' registers, rounded: P and dS as operands of the second product)
//   mma: D = A B + C over K
template <typename T_> struct NpfHalfOps {      // T_: unsigned short (float16) or npf_bf16 (bfloat16)
    typedef T_ T;
    static constexpr int K = 16, PAD = 16 / sizeof(T);  // npf_fa_load_tile's rows: D + 16 bytes
    static __device__ __forceinline__ void a_rows(unsigned* a, const T* X, int LD, int r0, int k0, int lane) {
        npf_ldmatrix_x4(a, X + (r0 + (lane / 8) % 2 * 8 + lane % 8) * LD + k0 + lane / 16 * 8);
    }
    static __device__ __forceinline__ void b_rows(unsigned* b, const T* Y, int LD, int n0, int k0, int lane) {
        npf_ldmatrix_x4(b, Y + (n0 + lane / 16 * 8 + lane % 8) * LD + k0 + (lane / 8) % 2 * 8);
    }
    static __device__ __forceinline__ void b_cols(unsigned* b, const T* Y, int LD, int k0, int n0, int lane) {
        npf_ldmatrix_x4_trans(b, Y + (k0 + (lane / 8) % 2 * 8 + lane % 8) * LD + n0 + lane / 16 * 8);
    }
    // the lane's part of a_rows's (and b_cols's) address and of b_rows's: a_rows reads X + a_lane + r0 LD + k0,
    // for a kernel that works it out once, outside its loops
    static __device__ __forceinline__ int a_lane(int LD, int lane) {
        return ((lane / 8) % 2 * 8 + lane % 8) * LD + lane / 16 * 8;
    }
    static __device__ __forceinline__ int b_lane(int LD, int lane) {
        return (lane / 16 * 8 + lane % 8) * LD + (lane / 8) % 2 * 8;
    }
    // the C fragments of key blocks 2 ks and 2 ks + 1 are the A fragment's registers (rows g and g + 8,
    // columns 2 t and 2 t + 1 of each), as pairs of T
    static __device__ __forceinline__ void a_from_c(unsigned* a, const float (*c)[4]) {
        a[0] = npf_pack2<T>(c[0][0], c[0][1]);
        a[1] = npf_pack2<T>(c[0][2], c[0][3]);
        a[2] = npf_pack2<T>(c[1][0], c[1][1]);
        a[3] = npf_pack2<T>(c[1][2], c[1][3]);
    }
    static __device__ __forceinline__ void mma(float* d, const unsigned* a, const unsigned* b, const float* c) {
        if (Npf16<T>::BF16) npf_mma_16816_bf16(d, a, b, c);
        else npf_mma_16816(d, a, b, c);
    }
};

// TF32 (m16n8k8): A (row g, columns t and t + 4; rows g + 8), B (rows t and t + 4 of column g). The
// lane holds scores of keys 2 t and 2 t + 1 of a block, so the second product takes the keys of a block in
// the order 0, 2, 4, 6, 1, 3, 5, 7 (A's column t is key 2 t, column t + 4 key 2 t + 1) and b_cols reads
// V's (or K's, dO's, Q's) rows in the same order: a sum over keys, in another order, and no shuffles.
// Rows D + 4 floats apart: the 32 lanes' reads fall in 32 distinct banks in each function.
struct NpfTf32Ops {
    typedef float T;
    static constexpr int K = 8, PAD = 16 / sizeof(T);   // npf_fa_load_tile's rows: D + 16 bytes
    static __device__ __forceinline__ void a_rows(unsigned* a, const T* X, int LD, int r0, int k0, int lane) {
        const T* x = X + (r0 + lane / 4) * LD + k0 + lane % 4;
        a[0] = npf_tf32(x[0]);
        a[1] = npf_tf32(x[8 * LD]);
        a[2] = npf_tf32(x[4]);
        a[3] = npf_tf32(x[8 * LD + 4]);
    }
    static __device__ __forceinline__ void b_rows(unsigned* b, const T* Y, int LD, int n0, int k0, int lane) {
        const T* y = Y + (n0 + lane / 4) * LD + k0 + lane % 4;
        b[0] = npf_tf32(y[0]);
        b[1] = npf_tf32(y[4]);
        b[2] = npf_tf32(y[8 * LD]);
        b[3] = npf_tf32(y[8 * LD + 4]);
    }
    static __device__ __forceinline__ void b_cols(unsigned* b, const T* Y, int LD, int k0, int n0, int lane) {
        const T* y = Y + (k0 + 2 * (lane % 4)) * LD + n0 + lane / 4;
        b[0] = npf_tf32(y[0]);
        b[1] = npf_tf32(y[LD]);
        b[2] = npf_tf32(y[8]);
        b[3] = npf_tf32(y[LD + 8]);
    }
    static __device__ __forceinline__ void a_from_c(unsigned* a, const float (*c)[4]) {
        a[0] = npf_tf32(c[0][0]);
        a[1] = npf_tf32(c[0][2]);
        a[2] = npf_tf32(c[0][1]);
        a[3] = npf_tf32(c[0][3]);
    }
    static __device__ __forceinline__ void mma(float* d, const unsigned* a, const unsigned* b, const float* c) {
        npf_mma_1688_tf32(d, a, b, c);
    }
};

// The prologue of the three tensor-core kernels below: a block of 4 warps takes NPF_FA_TC_BR = 64 rows
// (queries; keys for dK and dV), a warp 16 of them, against tiles of N columns (keys; queries for dK and
// dV). W's shapes: shared-memory rows of D values and 16 bytes (LD), the tile's and D's 8-column blocks
// (NB, DN), the K-steps of a product over D and over the tile (KD, KB); a lane's place in the PTX ISA's
// fragment layouts (group g: rows g and g + 8 of a fragment; t: columns 2 t and 2 t + 1); dropout's seed.
// SHARED_*: each kernel's dynamic shared memory, its ROWS rows of Q (forward), Q and dO (dQ) or K and V (dK,
// dV), then NBUF buffers of two N-row tiles (K and V; Q and dO) and, for dK and dV, each buffer's lse and D.
template <typename Ops, int D, int N, int NBUF = 2> struct NpfFaTcWarp {
    typedef typename Ops::T T;
    static constexpr int ROWS = NPF_FA_TC_BR, LD = D + Ops::PAD, NB = N / 8, DN = D / 8, KD = D / Ops::K,
                         KB = N / Ops::K;
    static constexpr int SHARED_FWD = (ROWS + 2 * NBUF * N) * LD * (int)sizeof(T),
                         SHARED_DQ = (2 * ROWS + 2 * NBUF * N) * LD * (int)sizeof(T),
                         SHARED_DKDV = SHARED_DQ + 2 * NBUF * N * 4;
    const int warp, lane, g, t;
    const unsigned long long seed;
    __device__ __forceinline__ explicit NpfFaTcWarp(const NpfFaArgs<float>& a)
        : warp(threadIdx.x / 32), lane(threadIdx.x % 32), g(lane / 4), t(lane % 4),
          seed(a.keep_min ? npf_seed(a.seed_draws) : 0ULL) {}
    // the lane's row r (0: g, 1: g + 8) of the warp's 16, counted in the block's 64
    __device__ __forceinline__ int row(int r) const { return warp * 16 + g + 8 * r; }
};

template <typename Ops, int D, int BC>
__device__ void npf_fa_forward_tc(const typename Ops::T* q, const typename Ops::T* k, const typename Ops::T* v,
                                  typename Ops::T* out, float* lse, const NpfFaArgs<float>& a, NpfFaLayout ql,
                                  NpfFaLayout kl, NpfFaLayout vl, NpfFaLayout ol) {
    typedef NpfFaTcWarp<Ops, D, BC> W;
    typedef typename W::T T;
    constexpr int BR = W::ROWS;
    const W w(a);
    NPF_FA_SHARED(smem, W::SHARED_FWD);
    T* Qs = reinterpret_cast<T*>(smem);                  // (BR, LD)
    T* KVs = Qs + BR * W::LD;                            // 2 x ((BC, LD) K, (BC, LD) V): double buffer
    const int i0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * BR;
    const int n_kt_all = npf_fa_key_tiles<BC>(npf_fa_min(i0 + BR, a.Tq), a.Tk, a.causal, a.shift);
    const float inf = npf_fa_inf(0.0f);
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        const int n_kt = npf_fa_head_key_tiles<BC>(a, bh, n_kt_all);
        __syncthreads();                                     // the previous head's readers are done
        npf_fa_load_tile<T, BR, D>(q + npf_fa_head(ql, bh, a.H), i0, a.Tq, a.hs, ql.st, Qs);
        const long long pad_row = npf_fa_pad_row(a, bh);
        int row[2];                                          // this lane's two query rows
        long long mask_row[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row[r] = i0 + w.row(r);
            mask_row[r] = npf_fa_mask_row(a, bh, row[r]);
        }
        float o[W::DN][4], m[2] = {-inf, -inf}, l[2] = {0.0f, 0.0f};
#pragma unroll
        for (int dn = 0; dn < W::DN; ++dn)
#pragma unroll
            for (int c = 0; c < 4; ++c) o[dn][c] = 0.0f;
        const T* k_head = k + npf_fa_head(kl, bh, a.H);
        const T* v_head = v + npf_fa_head(vl, bh, a.H);
        if (n_kt > 0)                                        // tile 0's copies: in flight from here
            npf_fa_load_kv_async<T, BC, D>(k_head, v_head, 0, a, kl.st, vl.st, KVs);
        npf_cp_async_commit();
        for (int kt = 0; kt < n_kt; ++kt) {
            const int j0 = kt * BC;
            T* Ks = KVs + (kt % 2) * 2 * BC * W::LD;
            T* Vs = Ks + BC * W::LD;
            if (kt + 1 < n_kt)                               // the next tile into the other buffer, meanwhile
                npf_fa_load_kv_async<T, BC, D>(k_head, v_head, j0 + BC, a, kl.st, vl.st,
                                               KVs + (kt + 1) % 2 * 2 * BC * W::LD);
            npf_cp_async_commit();
            npf_cp_async_wait<1>();                          // this tile's copies have landed
            __syncthreads();                                 // (everyone's), and Q's
            float s[W::NB][4];                               // S: rows g, g + 8; columns 8 nb + 2 t, + 1
#pragma unroll
            for (int nb = 0; nb < W::NB; ++nb)
#pragma unroll
                for (int c = 0; c < 4; ++c) s[nb][c] = 0.0f;
#pragma unroll
            for (int kd = 0; kd < W::KD; ++kd) {
                unsigned aq[4];                              // this warp's 16 rows of Q, as an A fragment
                Ops::a_rows(aq, Qs, W::LD, w.warp * 16, kd * Ops::K, w.lane);
#pragma unroll
                for (int nb2 = 0; nb2 < W::NB / 2; ++nb2) {
                    unsigned bk[4];                          // K rows as B fragments of two key blocks
                    Ops::b_rows(bk, Ks, W::LD, nb2 * 16, kd * Ops::K, w.lane);
                    Ops::mma(s[2 * nb2], aq, bk, s[2 * nb2]);
                    Ops::mma(s[2 * nb2 + 1], aq, bk + 2, s[2 * nb2 + 1]);
                }
            }
            float mx[2] = {-inf, -inf};
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int nb = 0; nb < W::NB; ++nb)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        float& x = s[nb][2 * r + c];
                        x = npf_fa_score_at<float, true>(x, a, row[r], j0 + nb * 8 + 2 * w.t + c, mask_row[r], pad_row);
                        mx[r] = npf_max(mx[r], x);
                    }
            float shift[2], alpha[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
            for (int r = 0; r < 2; ++r) {                    // the row's max over its quad, then m_new
                mx[r] = npf_max(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = npf_max(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                const float m_new = npf_max(m[r], mx[r]);
                shift[r] = npf_fa_isinf(m_new) ? 0.0f : m_new;    // all -inf so far: no inf - inf
                alpha[r] = npf_exp(m[r] - shift[r]);
                m[r] = m_new;
            }
#pragma unroll
            for (int nb = 0; nb < W::NB; ++nb)               // s becomes dropout(P)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    float p = npf_exp(s[nb][c] - shift[c / 2]);
                    sum[c / 2] += p;
                    if (a.keep_min)                          // _keep at n = (bh Tq + i) Tk + j
                        p = npf_fa_kept(a, w.seed, npf_fa_keep_row(a, bh, row[c / 2]), j0 + nb * 8 + 2 * w.t + c % 2)
                                ? p * a.keep_scale : 0.0f;
                    s[nb][c] = p;
                }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
                sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
                l[r] = l[r] * alpha[r] + sum[r];
            }
#pragma unroll
            for (int dn = 0; dn < W::DN; ++dn)
#pragma unroll
                for (int c = 0; c < 4; ++c) o[dn][c] *= alpha[c / 2];
#pragma unroll
            for (int kb = 0; kb < W::KB; ++kb) {
                unsigned ap[4];                              // keys K kb .. of dropout(P) as an A fragment
                Ops::a_from_c(ap, s + kb * Ops::K / 8);
#pragma unroll
                for (int dn2 = 0; dn2 < W::DN / 2; ++dn2) {
                    unsigned bv[4];                          // V rows as B fragments of two column blocks
                    Ops::b_cols(bv, Vs, W::LD, kb * Ops::K, dn2 * 16, w.lane);
                    Ops::mma(o[2 * dn2], ap, bv, o[2 * dn2]);
                    Ops::mma(o[2 * dn2 + 1], ap, bv + 2, o[2 * dn2 + 1]);
                }
            }
            __syncthreads();                                 // done with this buffer before it is refilled
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = row[r];
            if (i >= a.Tq) continue;
            const bool empty = l[r] == 0.0f;                 // a fully masked row: zeros, lse +inf
            const float den = empty ? 1.0f : l[r];
            T* out_row = out + npf_fa_head(ol, bh, a.H) + i * ol.st;
#pragma unroll
            for (int dn = 0; dn < W::DN; ++dn)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int d = dn * 8 + 2 * w.t + c;
                    if (d < a.hv) npf_store(out_row + d, o[dn][2 * r + c] / den);
                }
            if (w.t == 0) lse[bh * a.Tq + i] = empty ? inf : m[r] + npf_log(l[r]);
        }
    }
}

// dQ on tensor cores: a block of 4 warps takes 64 query rows (a warp its 16) over the visible key tiles:
//   S = Q K^T, dP = dO V^T (A fragments of Q and dO by ldmatrix, B of K and V by ldmatrix),
//   dS per element (npf_fa_grad), dQ += dS K (dS as float16 A fragments, K by ldmatrix.trans).
// K and V through cp.async into NBUF buffers: with 2, the next tile's copies land while this one is
// computed (the forward's pipeline); with 1 (where 2 would cost occupancy) they are issued after it.
template <typename Ops, int D, int BC, int NBUF>
__device__ void npf_fa_bwd_dq_tc(const typename Ops::T* q, const typename Ops::T* k, const typename Ops::T* v,
                                 const typename Ops::T* dout, const float* lse, const float* dvec, typename Ops::T* dq,
                                 const NpfFaArgs<float>& a, NpfFaLayout ql, NpfFaLayout kl, NpfFaLayout vl,
                                 NpfFaLayout gl, NpfFaLayout dql) {
    typedef NpfFaTcWarp<Ops, D, BC, NBUF> W;
    typedef typename W::T T;
    constexpr int BR = W::ROWS;
    const W w(a);
    NPF_FA_SHARED(smem, W::SHARED_DQ);
    T* Qs = reinterpret_cast<T*>(smem);                  // (BR, LD)
    T* dOs = Qs + BR * W::LD;                            // (BR, LD)
    T* KVs = dOs + BR * W::LD;                           // NBUF x ((BC, LD) K, (BC, LD) V)
    const int i0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * BR;
    const int n_kt_all = npf_fa_key_tiles<BC>(npf_fa_min(i0 + BR, a.Tq), a.Tk, a.causal, a.shift);
    const float inf = npf_fa_inf(0.0f);
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        const int n_kt = npf_fa_head_key_tiles<BC>(a, bh, n_kt_all);
        __syncthreads();
        npf_fa_load_tile<T, BR, D>(q + npf_fa_head(ql, bh, a.H), i0, a.Tq, a.hs, ql.st, Qs);
        npf_fa_load_tile<T, BR, D>(dout + npf_fa_head(gl, bh, a.H), i0, a.Tq, a.hv, gl.st, dOs);
        const long long pad_row = npf_fa_pad_row(a, bh);
        int row[2];
        long long mask_row[2];
        float lse_r[2], d_r[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row[r] = i0 + w.row(r);
            mask_row[r] = npf_fa_mask_row(a, bh, row[r]);
            lse_r[r] = row[r] < a.Tq ? lse[bh * a.Tq + row[r]] : inf;      // rows past Tq: P = 0
            d_r[r] = row[r] < a.Tq ? dvec[bh * a.Tq + row[r]] : 0.0f;
        }
        float dqa[W::DN][4];
#pragma unroll
        for (int dn = 0; dn < W::DN; ++dn)
#pragma unroll
            for (int c = 0; c < 4; ++c) dqa[dn][c] = 0.0f;
        const T* k_head = k + npf_fa_head(kl, bh, a.H);
        const T* v_head = v + npf_fa_head(vl, bh, a.H);
        if (n_kt > 0)                                        // tile 0's copies: in flight from here
            npf_fa_load_kv_async<T, BC, D>(k_head, v_head, 0, a, kl.st, vl.st, KVs);
        npf_cp_async_commit();
        for (int kt = 0; kt < n_kt; ++kt) {
            const int j0 = kt * BC;
            T* Ks = KVs + (kt % NBUF) * 2 * BC * W::LD;
            T* Vs = Ks + BC * W::LD;
            if (NBUF == 2 && kt + 1 < n_kt)                  // the next tile into the other buffer, meanwhile
                npf_fa_load_kv_async<T, BC, D>(k_head, v_head, j0 + BC, a, kl.st, vl.st,
                                               KVs + (kt + 1) % 2 * 2 * BC * W::LD);
            npf_cp_async_commit();
            npf_cp_async_wait<NBUF - 1>();                   // this tile's copies have landed (1: the next's
            __syncthreads();                                 // may be in flight), everyone's; Q's and dO's
            float s[W::NB][4], dp[W::NB][4];
#pragma unroll
            for (int nb = 0; nb < W::NB; ++nb)
#pragma unroll
                for (int c = 0; c < 4; ++c) s[nb][c] = dp[nb][c] = 0.0f;
#pragma unroll
            for (int kd = 0; kd < W::KD; ++kd) {
                unsigned aq[4], ag[4];                       // 16 rows of Q and of dO, d block kd
                Ops::a_rows(aq, Qs, W::LD, w.warp * 16, kd * Ops::K, w.lane);
                Ops::a_rows(ag, dOs, W::LD, w.warp * 16, kd * Ops::K, w.lane);
#pragma unroll
                for (int nb2 = 0; nb2 < W::NB / 2; ++nb2) {
                    unsigned bk[4], bv[4];
                    Ops::b_rows(bk, Ks, W::LD, nb2 * 16, kd * Ops::K, w.lane);
                    Ops::b_rows(bv, Vs, W::LD, nb2 * 16, kd * Ops::K, w.lane);
                    Ops::mma(s[2 * nb2], aq, bk, s[2 * nb2]);
                    Ops::mma(s[2 * nb2 + 1], aq, bk + 2, s[2 * nb2 + 1]);
                    Ops::mma(dp[2 * nb2], ag, bv, dp[2 * nb2]);
                    Ops::mma(dp[2 * nb2 + 1], ag, bv + 2, dp[2 * nb2 + 1]);
                }
            }
#pragma unroll
            for (int nb = 0; nb < W::NB; ++nb)               // s becomes dS
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    float p_drop, ds;
                    npf_fa_grad<float, true>(s[nb][c], dp[nb][c], lse_r[c / 2], d_r[c / 2], a, w.seed, bh, row[c / 2],
                                             j0 + nb * 8 + 2 * w.t + c % 2, mask_row[c / 2], pad_row, p_drop, ds);
                    s[nb][c] = ds;
                }
#pragma unroll
            for (int kb = 0; kb < W::KB; ++kb) {
                unsigned as[4];                              // keys K kb .. of dS as an A fragment
                Ops::a_from_c(as, s + kb * Ops::K / 8);
#pragma unroll
                for (int dn2 = 0; dn2 < W::DN / 2; ++dn2) {
                    unsigned bk[4];                          // K rows, transposed: keys are the k axis here
                    Ops::b_cols(bk, Ks, W::LD, kb * Ops::K, dn2 * 16, w.lane);
                    Ops::mma(dqa[2 * dn2], as, bk, dqa[2 * dn2]);
                    Ops::mma(dqa[2 * dn2 + 1], as, bk + 2, dqa[2 * dn2 + 1]);
                }
            }
            __syncthreads();                                 // done with this buffer before it is refilled
            if (NBUF == 1 && kt + 1 < n_kt)                  // one buffer: the next tile's copies now
                npf_fa_load_kv_async<T, BC, D>(k_head, v_head, j0 + BC, a, kl.st, vl.st, KVs);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (row[r] >= a.Tq) continue;
            T* dq_row = dq + npf_fa_head(dql, bh, a.H) + row[r] * dql.st;
#pragma unroll
            for (int dn = 0; dn < W::DN; ++dn)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int d = dn * 8 + 2 * w.t + c;
                    if (d < a.hs) npf_store(dq_row + d, dqa[dn][2 * r + c]);
                }
        }
    }
}

// One query tile of npf_fa_bwd_dkdv_tc into a buffer: Q and dO rows [i0, i0 + BR) through cp.async (or
// synchronous loads, npf_fa_load_tile_async), then lse and D (rows past Tq: lse +inf, so that P =
// exp(S - inf) = 0, and D 0)
template <typename T, int D, int BR>
__device__ __forceinline__ void npf_fa_bwd_query_tile(const T* q_head, const T* g_head, const float* lse,
                                                      const float* dvec, long long bh, int i0,
                                                      const NpfFaArgs<float>& a, long long q_st, long long g_st,
                                                      T* qg_s, float* ld_s) {
    npf_fa_load_pair_async<T, BR, D>(q_head, q_st, a.hs, g_head, g_st, a.hv, i0, a.Tq, qg_s);
    npf_fa_query_stats<BR, NPF_FA_THREADS>(lse, dvec, bh, i0, a, ld_s);
}

// The same from a pair of the head's Q and dO tiles (NpfFaTilePair): its next tile, rows [i0, i0 + BR)
template <typename T, int D, int BR>
__device__ __forceinline__ void npf_fa_bwd_query_tile(NpfFaTilePair<T, BR, D>& qg_copy, const float* lse,
                                                      const float* dvec, long long bh, int i0,
                                                      const NpfFaArgs<float>& a, T* qg_s, float* ld_s) {
    qg_copy.next(qg_s);
    npf_fa_query_stats<BR, NPF_FA_THREADS>(lse, dvec, bh, i0, a, ld_s);
}

// dK, dV on tensor cores: a block of 4 warps takes 64 keys (a warp its 16) over the query tiles that
// see them: S^T = K Q^T, dP^T = V dO^T, the inner step per element (rows keys, columns queries), then
// dV += P_drop^T dO and dK += dS^T Q (P_drop^T and dS^T as float16 A fragments; dO and Q by
// ldmatrix.trans). lse and D of the query tile are in shared memory (a lane's columns change per element).
// Q, dO, lse and D double-buffered: the next query tile's copies (cp.async) land while this one is computed;
// the query tiles wholly in the causal future (the first ones) are never visited.
template <typename Ops, int D, int BR>
__device__ void npf_fa_bwd_dkdv_tc(const typename Ops::T* q, const typename Ops::T* k, const typename Ops::T* v,
                                   const typename Ops::T* dout, const float* lse, const float* dvec,
                                   typename Ops::T* dk, typename Ops::T* dv, const NpfFaArgs<float>& a,
                                   NpfFaLayout ql, NpfFaLayout kl, NpfFaLayout vl, NpfFaLayout gl, NpfFaLayout dkl,
                                   NpfFaLayout dvl) {
    typedef NpfFaTcWarp<Ops, D, BR> W;
    typedef typename W::T T;
    constexpr int BC = W::ROWS;
    const W w(a);
    NPF_FA_SHARED(smem, W::SHARED_DKDV);
    T* Ks = reinterpret_cast<T*>(smem);                  // (BC, LD)
    T* Vs = Ks + BC * W::LD;                             // (BC, LD)
    T* QGs = Vs + BC * W::LD;                            // 2 x ((BR, LD) Q, (BR, LD) dO)
    float* LDs = reinterpret_cast<float*>(QGs + 4 * BR * W::LD);      // 2 x ((BR) lse, (BR) D)
    const int j0 = blockIdx.x * BC;
    const int n_qt = (a.Tq + BR - 1) / BR;
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        const int n_qt_head = j0 < npf_fa_key_end(a, bh) ? n_qt : 0;   // keys all padding: zeros
        __syncthreads();
        npf_fa_load_tile<T, BC, D>(k + npf_fa_head(kl, bh, a.H), j0, a.Tk, a.hs, kl.st, Ks);
        npf_fa_load_tile<T, BC, D>(v + npf_fa_head(vl, bh, a.H), j0, a.Tk, a.hv, vl.st, Vs);
        const long long pad_row = npf_fa_pad_row(a, bh);
        int key[2];                                          // this lane's two keys (rows of dK, dV)
#pragma unroll
        for (int r = 0; r < 2; ++r) key[r] = j0 + w.row(r);
        float dka[W::DN][4], dva[W::DN][4];
#pragma unroll
        for (int dn = 0; dn < W::DN; ++dn)
#pragma unroll
            for (int c = 0; c < 4; ++c) dka[dn][c] = dva[dn][c] = 0.0f;
        int qt0 = 0;                                         // the first query tile that sees one of the keys
        if (a.causal)
            while (qt0 < n_qt_head && j0 > npf_fa_min(qt0 * BR + BR, a.Tq) - 1 + a.shift) ++qt0;
        const T* q_head = q + npf_fa_head(ql, bh, a.H);
        const T* g_head = dout + npf_fa_head(gl, bh, a.H);
        if (qt0 < n_qt_head)                                 // its copies: in flight from here
            npf_fa_bwd_query_tile<T, D, BR>(q_head, g_head, lse, dvec, bh, qt0 * BR, a, ql.st, gl.st, QGs, LDs);
        npf_cp_async_commit();
        for (int qt = qt0; qt < n_qt_head; ++qt) {
            const int i0 = qt * BR, buf = (qt - qt0) % 2;
            T* Qs = QGs + buf * 2 * BR * W::LD;
            T* dOs = Qs + BR * W::LD;
            const float* lse_s = LDs + buf * 2 * BR;
            const float* d_s = lse_s + BR;
            if (qt + 1 < n_qt_head)                          // the next tile into the other buffer, meanwhile
                npf_fa_bwd_query_tile<T, D, BR>(q_head, g_head, lse, dvec, bh, i0 + BR, a, ql.st, gl.st,
                                             QGs + (1 - buf) * 2 * BR * W::LD, LDs + (1 - buf) * 2 * BR);
            npf_cp_async_commit();
            npf_cp_async_wait<1>();                          // this tile's copies have landed
            __syncthreads();                                 // (everyone's, and its lse and D), and K's and V's
            float st[W::NB][4], dpt[W::NB][4];               // S^T, dP^T: rows keys g, g + 8; columns queries
#pragma unroll
            for (int nb = 0; nb < W::NB; ++nb)
#pragma unroll
                for (int c = 0; c < 4; ++c) st[nb][c] = dpt[nb][c] = 0.0f;
#pragma unroll
            for (int kd = 0; kd < W::KD; ++kd) {
                unsigned ak[4], av[4];                       // this warp's 16 keys of K and of V, d block kd
                Ops::a_rows(ak, Ks, W::LD, w.warp * 16, kd * Ops::K, w.lane);
                Ops::a_rows(av, Vs, W::LD, w.warp * 16, kd * Ops::K, w.lane);
#pragma unroll
                for (int nb2 = 0; nb2 < W::NB / 2; ++nb2) {
                    unsigned bq[4], bg[4];                   // Q rows and dO rows as B fragments (n: queries)
                    Ops::b_rows(bq, Qs, W::LD, nb2 * 16, kd * Ops::K, w.lane);
                    Ops::b_rows(bg, dOs, W::LD, nb2 * 16, kd * Ops::K, w.lane);
                    Ops::mma(st[2 * nb2], ak, bq, st[2 * nb2]);
                    Ops::mma(st[2 * nb2 + 1], ak, bq + 2, st[2 * nb2 + 1]);
                    Ops::mma(dpt[2 * nb2], av, bg, dpt[2 * nb2]);
                    Ops::mma(dpt[2 * nb2 + 1], av, bg + 2, dpt[2 * nb2 + 1]);
                }
            }
#pragma unroll
            for (int nb = 0; nb < W::NB; ++nb)               // st becomes P_drop^T, dpt dS^T
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int col = nb * 8 + 2 * w.t + c % 2, i = i0 + col;
                    float p_drop, ds;
                    npf_fa_grad<float, true>(st[nb][c], dpt[nb][c], lse_s[col], d_s[col], a, w.seed, bh, i, key[c / 2],
                                             npf_fa_mask_row(a, bh, i), pad_row, p_drop, ds);
                    st[nb][c] = p_drop;
                    dpt[nb][c] = ds;
                }
#pragma unroll
            for (int kb = 0; kb < W::KB; ++kb) {
                unsigned ap[4], as[4];                       // queries K kb .. of P_drop^T and dS^T as A fragments
                Ops::a_from_c(ap, st + kb * Ops::K / 8);
                Ops::a_from_c(as, dpt + kb * Ops::K / 8);
#pragma unroll
                for (int dn2 = 0; dn2 < W::DN / 2; ++dn2) {
                    unsigned bg[4], bq[4];                   // dO and Q rows, transposed (k: queries, n: d)
                    Ops::b_cols(bg, dOs, W::LD, kb * Ops::K, dn2 * 16, w.lane);
                    Ops::b_cols(bq, Qs, W::LD, kb * Ops::K, dn2 * 16, w.lane);
                    Ops::mma(dva[2 * dn2], ap, bg, dva[2 * dn2]);
                    Ops::mma(dva[2 * dn2 + 1], ap, bg + 2, dva[2 * dn2 + 1]);
                    Ops::mma(dka[2 * dn2], as, bq, dka[2 * dn2]);
                    Ops::mma(dka[2 * dn2 + 1], as, bq + 2, dka[2 * dn2 + 1]);
                }
            }
            __syncthreads();                                 // done with this buffer before it is refilled
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (key[r] >= a.Tk) continue;
            T* dk_row = dk + npf_fa_head(dkl, bh, a.H) + key[r] * dkl.st;
            T* dv_row = dv + npf_fa_head(dvl, bh, a.H) + key[r] * dvl.st;
#pragma unroll
            for (int dn = 0; dn < W::DN; ++dn)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int d = dn * 8 + 2 * w.t + c;
                    if (d < a.hs) npf_store(dk_row + d, dka[dn][2 * r + c]);
                    if (d < a.hv) npf_store(dv_row + d, dva[dn][2 * r + c]);
                }
        }
    }
}

// ---- the dense kernels: the common case's own loops (FlashAttention-2's design) ----
// No attention mask, no key padding, no dropout, a positive scale (the row max is taken before the scale,
// c > 0 keeps it the max), causal or not: what a GPT's attention runs. float16
// on tensor cores like the _tc kernels above, but none of their run-time branches: a block of 4 warps,
// a warp FRAGS 16-row A fragments of query rows (up to D = 64 two: each K and V fragment ldmatrix reads
// feeds two mma.sync); scores go straight to exp2 with the softmax scale and log2(e) folded into one
// FFMA (P = 2^(s c - m c), c = scale log2 e); the causal and ragged-end masks are applied to the tiles
// that cross the block's diagonal or the last key only (a loop of their own after the main loop),
// never per element elsewhere; a lane keeps its part of a row's sum (the quad's four parts are
// added once, at the end); the output accumulator is rescaled only where a row's maximum moved. The
// row max, P as float16 A fragments and the outputs are as in npf_fa_forward_tc.
// Traits (benchmarks/cuda_kernels.py, sm_90): the S and O accumulators take FRAGS (BC + D) floats a
// lane: 2 fragments and 64 keys a tile up to D = 64 (249-255 registers at D 64: 2 blocks an SM, 12.5%;
// 5.3 instructions per HMMA in the main loop, the next tile's copies included), 1 fragment and 32 keys at
// D = 128 (160-161 registers, 3 blocks, 18.75%; 5.8 per HMMA, of which the output's rescale, counted though
// it runs only where a row's maximum moved, is 1: 2 fragments spilled at 32 keys, at 16 keys the rescale
// made 7.7 per HMMA, and 64 keys took 85 KiB of shared memory, one block on an A100); rows of D + 8
// halves in shared memory (16-byte aligned, no bank conflicts); Q loaded once per head, K and V
// double-buffered through cp.async, the copies in line (NpfFaTilePair) but at D 32, where the causal
// kernel's 168 registers spilled with them; MIN_BLOCKS: __launch_bounds__'s blocks an SM, what the
// registers allow.
template <int D_> struct NpfFaDenseTraits {
    static constexpr int D = D_, WARPS = 4, THREADS = 32 * WARPS, FRAGS = D <= 64 ? 2 : 1;
    static constexpr int WARP_ROWS = 16 * FRAGS, BR = WARPS * WARP_ROWS, BC = D <= 64 ? 64 : 32, LD = D + 8;
    static constexpr int MIN_BLOCKS = D <= 32 ? 3 : D <= 64 ? 2 : 3;
    static constexpr int SHARED = (BR + 4 * BC) * LD * 2;
    static constexpr bool COPIES_IN_LINE = D > 32;
};

// One key tile of npf_fa_forward_dense for one warp: S = Q K^T for its rows, (MASKED: the causal
// and ragged-end masks), the online softmax, O += P V. Ql, Kl, Vl: the lane's first row for ldmatrix in the
// warp's rows of Q and in the tile's K and V (NpfHalfOps::a_lane, b_lane).
template <typename T, int D, bool CAUSAL, bool MASKED>
__device__ __forceinline__ void npf_fa_dense_tile(const T* Ql, const T* Kl,
                                                  const T* Vl, int j0, int w0, const NpfFaArgs<float>& a,
                                                  float c, float (&o)[NpfFaDenseTraits<D>::FRAGS][D / 8][4],
                                                  float (&m)[NpfFaDenseTraits<D>::FRAGS][2],
                                                  float (&l)[NpfFaDenseTraits<D>::FRAGS][2]) {
    typedef NpfFaDenseTraits<D> Tr;
    typedef NpfHalfOps<T> Ops;                               // float16 or bfloat16 operands
    constexpr int F = Tr::FRAGS, LD = Tr::LD, NB = Tr::BC / 8, DN = D / 8, KD = D / 16, KB = Tr::BC / 16;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const float inf = npf_fa_inf(0.0f);
    float s[F][NB][4];                                       // S of the warp's fragments
#pragma unroll
    for (int f = 0; f < F; ++f)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[f][nb][e] = 0.0f;
#pragma unroll
    for (int kd = 0; kd < KD; ++kd) {
        unsigned aq[F][4];                                   // the warp's rows of Q, d block kd
#pragma unroll
        for (int f = 0; f < F; ++f) npf_ldmatrix_x4(aq[f], Ql + 16 * f * LD + kd * 16);
#pragma unroll
        for (int nb2 = 0; nb2 < NB / 2; ++nb2) {
            unsigned bk[4];                                  // two key blocks of K: each feeds every fragment
            npf_ldmatrix_x4(bk, Kl + nb2 * 16 * LD + kd * 16);
#pragma unroll
            for (int f = 0; f < F; ++f) {
                Ops::mma(s[f][2 * nb2], aq[f], bk, s[f][2 * nb2]);
                Ops::mma(s[f][2 * nb2 + 1], aq[f], bk + 2, s[f][2 * nb2 + 1]);
            }
        }
    }
    if (MASKED)                                              // keys past a row's diagonal or past Tk: -inf
#pragma unroll
        for (int f = 0; f < F; ++f)
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = w0 + 16 * f + g + 8 * (e / 2), j = j0 + nb * 8 + 2 * t + e % 2;
                    if ((CAUSAL && j > i + a.shift) || j >= a.Tk) s[f][nb][e] = -inf;
                }
    float neg[F][2];                                         // -m_new c, the exponent's offset per row
#pragma unroll
    for (int f = 0; f < F; ++f)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = fmaxf(s[f][0][2 * r], s[f][0][2 * r + 1]);
#pragma unroll
            for (int nb = 1; nb < NB; ++nb) mx = fmaxf(mx, fmaxf(s[f][nb][2 * r], s[f][nb][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m[f][r], mx);
            // all -inf so far: the largest float, not inf, so that a masked score's 2^(-inf c + neg) is 0, not
            // NaN (c > 0: the launcher runs these kernels for a positive scale only)
            neg[f][r] = fminf(-m_new * c, 3.40282347e38f);
            if (m_new != m[f][r]) {                          // the row's maximum moved: rescale by 2^(m c - m_new c)
                const float alpha = exp2f(fmaf(m[f][r], c, neg[f][r]));
                l[f][r] *= alpha;
#pragma unroll
                for (int dn = 0; dn < DN; ++dn) {
                    o[f][dn][2 * r] *= alpha;
                    o[f][dn][2 * r + 1] *= alpha;
                }
                m[f][r] = m_new;
            }
        }
#pragma unroll
    for (int f = 0; f < F; ++f)                              // s becomes P; the lane's part of each row sum
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = exp2f(fmaf(s[f][nb][e], c, neg[f][e / 2]));
                l[f][e / 2] += p;
                s[f][nb][e] = p;
            }
#pragma unroll
    for (int kb = 0; kb < KB; ++kb) {
        unsigned ap[F][4];                                   // keys 16 kb .. of P as float16 A fragments
#pragma unroll
        for (int f = 0; f < F; ++f) Ops::a_from_c(ap[f], s[f] + 2 * kb);
#pragma unroll
        for (int dn2 = 0; dn2 < DN / 2; ++dn2) {
            unsigned bv[4];                                  // V rows as B fragments: each feeds every fragment
            npf_ldmatrix_x4_trans(bv, Vl + kb * 16 * LD + dn2 * 16);
#pragma unroll
            for (int f = 0; f < F; ++f) {
                Ops::mma(o[f][2 * dn2], ap[f], bv, o[f][2 * dn2]);
                Ops::mma(o[f][2 * dn2 + 1], ap[f], bv + 2, o[f][2 * dn2 + 1]);
            }
        }
    }
}

// Key tile kt of a head into its buffer: the next tile's copies are issued first (into the other
// buffer), then this one's awaited, block-wide; returns the buffer (K, then V)
template <typename T, int D, int BC, bool IN_LINE>
__device__ __forceinline__ T* npf_fa_dense_next(int kt, int n_kt, NpfFaTilePair<T, BC, D, IN_LINE>& kv_copy, T* KVs) {
    constexpr int LD = D + 8;
    if (kt + 1 < n_kt)
        kv_copy.next(KVs + (kt + 1) % 2 * 2 * BC * LD);
    npf_cp_async_commit();
    npf_cp_async_wait<1>();                                  // this tile's copies have landed
    __syncthreads();                                         // (everyone's), and Q's
    return KVs + kt % 2 * 2 * BC * LD;
}

template <typename T, int D, bool CAUSAL>
__device__ void npf_fa_forward_dense(const T* q, const T* k, const T* v,
                                     T* out, float* lse, const NpfFaArgs<float>& a, NpfFaLayout ql,
                                     NpfFaLayout kl, NpfFaLayout vl, NpfFaLayout ol) {
    typedef NpfFaDenseTraits<D> Tr;
    constexpr int F = Tr::FRAGS, BR = Tr::BR, BC = Tr::BC, LD = Tr::LD, DN = D / 8;
    NPF_FA_SHARED(smem, Tr::SHARED);
    T* Qs = reinterpret_cast<T*>(smem);                  // (BR, LD)
    T* KVs = Qs + BR * LD;                               // 2 x ((BC, LD) K, (BC, LD) V): double buffer
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int i0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * BR;
    const int w0 = i0 + warp * Tr::WARP_ROWS;            // this warp's first query row
    const int n_kt = npf_fa_key_tiles<BC>(npf_fa_min(i0 + BR, a.Tq), a.Tk, CAUSAL, a.shift);
    // the block's first tile with a key one of its rows must not see: past its first row's diagonal
    // (causal), or past Tk (a ragged last tile); the tiles before it run without masks (one count for
    // the block: its warps meet the same barriers in the same loop)
    const int masked_from = npf_fa_masked_from<BC>(i0, n_kt, CAUSAL, a);
    const float c = a.scale * 1.4426950408889634f;       // the scale and log2(e): P = 2^(s c - m c)
    const float inf = npf_fa_inf(0.0f);
    // the row each operand's ldmatrix reads for the lane, from the warp's first (K and V: of buffer 0), worked
    // out once: in the loops a fixed offset from these (ptxas kept recomputing them from the lane a tile)
    typedef NpfHalfOps<T> Ops;
    const T* Ql = Qs + warp * Tr::WARP_ROWS * LD + Ops::a_lane(LD, lane);
    const T* Kl = KVs + Ops::b_lane(LD, lane);
    const T* Vl = KVs + BC * LD + Ops::a_lane(LD, lane);
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        __syncthreads();                                     // the previous head's readers are done
        npf_fa_load_tile<T, BR, D>(q + npf_fa_head(ql, bh, a.H), i0, a.Tq, a.hs, ql.st, Qs);
        float o[F][DN][4], m[F][2], l[F][2];                 // [fragment][..]: rows 16 f + g, 16 f + g + 8
#pragma unroll
        for (int f = 0; f < F; ++f) {
            m[f][0] = m[f][1] = -inf;
            l[f][0] = l[f][1] = 0.0f;
#pragma unroll
            for (int dn = 0; dn < DN; ++dn)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[f][dn][e] = 0.0f;
        }
        NpfFaTilePair<T, BC, D, Tr::COPIES_IN_LINE> kv_copy(k + npf_fa_head(kl, bh, a.H), kl.st, a.hs,
                                                            v + npf_fa_head(vl, bh, a.H), vl.st, a.hv, a.Tk, 0);
        if (n_kt > 0)                                        // tile 0's copies: in flight from here
            kv_copy.next(KVs);
        npf_cp_async_commit();
        // the main loop: tiles every row of the warp sees whole; then those that need masks (the block's
        // warps take each tile together: the barriers in npf_fa_dense_next are block-wide)
        int kt = 0;
        for (; kt < masked_from; ++kt) {
            const int buf = (int)(npf_fa_dense_next(kt, n_kt, kv_copy, KVs) - KVs);   // the buffer's offset
            npf_fa_dense_tile<T, D, CAUSAL, false>(Ql, Kl + buf, Vl + buf, kt * BC, w0, a, c, o, m, l);
            __syncthreads();                                 // done with this buffer before it is refilled
        }
        for (; kt < n_kt; ++kt) {
            const int buf = (int)(npf_fa_dense_next(kt, n_kt, kv_copy, KVs) - KVs);   // the buffer's offset
            npf_fa_dense_tile<T, D, CAUSAL, true>(Ql, Kl + buf, Vl + buf, kt * BC, w0, a, c, o, m, l);
            __syncthreads();
        }
#pragma unroll
        for (int f = 0; f < F; ++f)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float sum = l[f][r];                         // the quad's four parts of the row sum
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                const int i = w0 + 16 * f + g + 8 * r;
                if (i >= a.Tq) continue;
                const bool empty = sum == 0.0f;              // a row that sees no key: zeros, lse +inf
                const float den = empty ? 1.0f : sum;
                T* out_row = out + npf_fa_head(ol, bh, a.H) + i * ol.st;
#pragma unroll
                for (int dn = 0; dn < DN; ++dn)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int d = dn * 8 + 2 * t + e;
                        if (d < a.hv) npf_store(out_row + d, o[f][dn][2 * r + e] / den);
                    }
                if (t == 0) lse[bh * a.Tq + i] = empty ? inf : m[f][r] * a.scale + npf_log(sum);
            }
    }
}

// ---- the dense backward: dQ, then dK and dV, each its own pass (no two blocks add into one element) ----
// The same design as the dense forward: P recomputed as 2^(S c - lse log2 e) with the scale folded into
// one FFMA, dS = P (dP - D) (the scale multiplies dQ and dK once, at the end), masks in a loop of their
// own over the tiles that cross the block's diagonal (and, for dQ, the ragged last key tile), P and dS
// as float16 A fragments. Rows past Tq or that see no key have lse = +inf: P = 0 there. Traits:
//   dQ: a warp FRAGS fragments of 16 query rows, key tiles of BC keys; S, dP (BC floats a lane each and
//       fragment) and the dQ accumulator (D): 2 fragments and 32 keys at D 64, 64 keys at D 32, 1 fragment
//       and 32 keys at D 128; Q and dO once per head, K and V double-buffered;
//   dK, dV: a warp FRAGS fragments of 16 keys over query tiles of BQ rows; the two accumulators take 2 D
//       floats a lane and fragment: 2 fragments at D 32, 1 above (64 queries a tile at D 64, 32 at 128);
//       K and V once per head, Q, dO and the tile's lse and D double-buffered; 2 blocks an SM (3, with
//       170 registers a lane, spilled the causal kernels at D 32 and 64).
// The next tile's copies in line (NpfFaTilePair). dK, dV work out the lane's rows for ldmatrix once (as the
// forward does); dQ those of Q and dO, and K's and V's from the lane a tile (worked out once too, they spilled
// 8 bytes at D 128). Main loops on sm_90 (benchmarks/cuda_kernels.py, the copies counted): dQ 3.9-4.1
// instructions per HMMA at D 64 and 128, dK dV 4.2-5.1 (the _tc kernels: 34.7 and 28.7 at D 64, and their tile
// loader's call besides).
template <int D_> struct NpfFaDenseDqTraits {
    static constexpr int D = D_, WARPS = 4, THREADS = 32 * WARPS, FRAGS = D <= 64 ? 2 : 1;
    static constexpr int WARP_ROWS = 16 * FRAGS, BR = WARPS * WARP_ROWS, BC = D <= 32 ? 64 : 32, LD = D + 8;
    static constexpr int MIN_BLOCKS = D <= 64 ? 2 : 3;
    static constexpr int SHARED = (2 * BR + 4 * BC) * LD * 2;
};
template <int D_> struct NpfFaDenseDkdvTraits {
    static constexpr int D = D_, WARPS = 4, THREADS = 32 * WARPS, FRAGS = D <= 32 ? 2 : 1;
    static constexpr int WARP_KEYS = 16 * FRAGS, BC = WARPS * WARP_KEYS, BQ = D == 64 ? 64 : 32, LD = D + 8;
    static constexpr int MIN_BLOCKS = 2;
    static constexpr int SHARED = (2 * BC + 4 * BQ) * LD * 2 + 4 * BQ * 4;
};

// One key tile of the dense dQ for one warp: S = Q K^T, dP = dO V^T for its rows, (MASKED: the causal
// and ragged-end masks), dS = P (dP - D), dQ += dS K. nl: -lse log2 e per row, dd: D per row. Ql: the lane's
// first row for ldmatrix in the warp's rows of Q (NpfHalfOps::a_lane), its dO's BR rows after.
template <typename T, int D, bool CAUSAL, bool MASKED>
__device__ __forceinline__ void npf_fa_dense_dq_tile(const T* Ql, const T* Ks, const T* Vs, int j0, int w0,
                                                     const NpfFaArgs<float>& a, float c,
                                                     const float (&nl)[NpfFaDenseDqTraits<D>::FRAGS][2],
                                                     const float (&dd)[NpfFaDenseDqTraits<D>::FRAGS][2],
                                                     float (&dq)[NpfFaDenseDqTraits<D>::FRAGS][D / 8][4]) {
    typedef NpfFaDenseDqTraits<D> Tr;
    typedef NpfHalfOps<T> Ops;                               // float16 or bfloat16 operands
    constexpr int F = Tr::FRAGS, LD = Tr::LD, NB = Tr::BC / 8, DN = D / 8, KD = D / 16, KB = Tr::BC / 16;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float s[F][NB][4], dp[F][NB][4];
#pragma unroll
    for (int f = 0; f < F; ++f)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[f][nb][e] = dp[f][nb][e] = 0.0f;
#pragma unroll
    for (int kd = 0; kd < KD; ++kd) {
        unsigned aq[F][4], ag[F][4];                         // the warp's rows of Q and of dO, d block kd
#pragma unroll
        for (int f = 0; f < F; ++f) {
            npf_ldmatrix_x4(aq[f], Ql + 16 * f * LD + kd * 16);
            npf_ldmatrix_x4(ag[f], Ql + Tr::BR * LD + 16 * f * LD + kd * 16);
        }
#pragma unroll
        for (int nb2 = 0; nb2 < NB / 2; ++nb2) {
            unsigned bk[4], bv[4];                           // two key blocks of K and of V
            Ops::b_rows(bk, Ks, LD, nb2 * 16, kd * 16, lane);
            Ops::b_rows(bv, Vs, LD, nb2 * 16, kd * 16, lane);
#pragma unroll
            for (int f = 0; f < F; ++f) {
                Ops::mma(s[f][2 * nb2], aq[f], bk, s[f][2 * nb2]);
                Ops::mma(s[f][2 * nb2 + 1], aq[f], bk + 2, s[f][2 * nb2 + 1]);
                Ops::mma(dp[f][2 * nb2], ag[f], bv, dp[f][2 * nb2]);
                Ops::mma(dp[f][2 * nb2 + 1], ag[f], bv + 2, dp[f][2 * nb2 + 1]);
            }
        }
    }
#pragma unroll
    for (int f = 0; f < F; ++f)                              // s becomes dS / scale
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[f][nb][e];
                if (MASKED) {
                    const int i = w0 + 16 * f + g + 8 * (e / 2), j = j0 + nb * 8 + 2 * t + e % 2;
                    if ((CAUSAL && j > i + a.shift) || j >= a.Tk) x = -npf_fa_inf(0.0f);
                }
                const float p = exp2f(fmaf(x, c, nl[f][e / 2]));
                s[f][nb][e] = p * (dp[f][nb][e] - dd[f][e / 2]);
            }
#pragma unroll
    for (int kb = 0; kb < KB; ++kb) {
        unsigned as[F][4];                                   // keys 16 kb .. of dS as float16 A fragments
#pragma unroll
        for (int f = 0; f < F; ++f) Ops::a_from_c(as[f], s[f] + 2 * kb);
#pragma unroll
        for (int dn2 = 0; dn2 < DN / 2; ++dn2) {
            unsigned bk[4];                                  // K rows, transposed: keys are the k axis here
            Ops::b_cols(bk, Ks, LD, kb * 16, dn2 * 16, lane);
#pragma unroll
            for (int f = 0; f < F; ++f) {
                Ops::mma(dq[f][2 * dn2], as[f], bk, dq[f][2 * dn2]);
                Ops::mma(dq[f][2 * dn2 + 1], as[f], bk + 2, dq[f][2 * dn2 + 1]);
            }
        }
    }
}

template <typename T, int D, bool CAUSAL>
__device__ void npf_fa_bwd_dq_dense(const T* q, const T* k, const T* v,
                                    const T* dout, const float* lse, const float* dvec, T* dq,
                                    const NpfFaArgs<float>& a, NpfFaLayout ql, NpfFaLayout kl, NpfFaLayout vl,
                                    NpfFaLayout gl, NpfFaLayout dql) {
    typedef NpfFaDenseDqTraits<D> Tr;
    constexpr int F = Tr::FRAGS, BR = Tr::BR, BC = Tr::BC, LD = Tr::LD, DN = D / 8;
    NPF_FA_SHARED(smem, Tr::SHARED);
    T* Qs = reinterpret_cast<T*>(smem);                  // (BR, LD)
    T* dOs = Qs + BR * LD;                               // (BR, LD)
    T* KVs = dOs + BR * LD;                              // 2 x ((BC, LD) K, (BC, LD) V): double buffer
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int i0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * BR;
    const int w0 = i0 + warp * Tr::WARP_ROWS;
    const int n_kt = npf_fa_key_tiles<BC>(npf_fa_min(i0 + BR, a.Tq), a.Tk, CAUSAL, a.shift);
    const int masked_from = npf_fa_masked_from<BC>(i0, n_kt, CAUSAL, a);
    const float c = a.scale * 1.4426950408889634f;
    const float inf = npf_fa_inf(0.0f);
    const T* Ql = Qs + warp * Tr::WARP_ROWS * LD + NpfHalfOps<T>::a_lane(LD, lane);   // dO's: BR rows on
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        __syncthreads();
        npf_fa_load_tile<T, BR, D>(q + npf_fa_head(ql, bh, a.H), i0, a.Tq, a.hs, ql.st, Qs);
        npf_fa_load_tile<T, BR, D>(dout + npf_fa_head(gl, bh, a.H), i0, a.Tq, a.hv, gl.st, dOs);
        float nl[F][2], dd[F][2], dqa[F][DN][4];
#pragma unroll
        for (int f = 0; f < F; ++f) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = w0 + 16 * f + g + 8 * r;
                nl[f][r] = i < a.Tq ? -lse[bh * a.Tq + i] * 1.4426950408889634f : -inf;   // rows past Tq: P = 0
                dd[f][r] = i < a.Tq ? dvec[bh * a.Tq + i] : 0.0f;
            }
#pragma unroll
            for (int dn = 0; dn < DN; ++dn)
#pragma unroll
                for (int e = 0; e < 4; ++e) dqa[f][dn][e] = 0.0f;
        }
        NpfFaTilePair<T, BC, D> kv_copy(k + npf_fa_head(kl, bh, a.H), kl.st, a.hs, v + npf_fa_head(vl, bh, a.H),
                                        vl.st, a.hv, a.Tk, 0);
        if (n_kt > 0)
            kv_copy.next(KVs);
        npf_cp_async_commit();
        int kt = 0;
        for (; kt < masked_from; ++kt) {                     // the main loop: no masks
            const T* Ks = npf_fa_dense_next(kt, n_kt, kv_copy, KVs);
            npf_fa_dense_dq_tile<T, D, CAUSAL, false>(Ql, Ks, Ks + BC * LD, kt * BC, w0, a, c, nl, dd, dqa);
            __syncthreads();
        }
        for (; kt < n_kt; ++kt) {
            const T* Ks = npf_fa_dense_next(kt, n_kt, kv_copy, KVs);
            npf_fa_dense_dq_tile<T, D, CAUSAL, true>(Ql, Ks, Ks + BC * LD, kt * BC, w0, a, c, nl, dd, dqa);
            __syncthreads();
        }
#pragma unroll
        for (int f = 0; f < F; ++f)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = w0 + 16 * f + g + 8 * r;
                if (i >= a.Tq) continue;
                T* dq_row = dq + npf_fa_head(dql, bh, a.H) + i * dql.st;
#pragma unroll
                for (int dn = 0; dn < DN; ++dn)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int d = dn * 8 + 2 * t + e;
                        if (d < a.hs) npf_store(dq_row + d, dqa[f][dn][2 * r + e] * a.scale);
                    }
            }
    }
}

// One query tile of the dense dK, dV for one warp: S^T = K Q^T, dP^T = V dO^T for its keys, (MASKED: the
// causal mask), P^T, dS^T = P^T (dP^T - D), dV += P^T dO, dK += dS^T Q. lse_s, d_s: the tile's lse and D.
// Kl, Vl: the lane's first row for ldmatrix in the warp's keys of K and V; Qr, Qc: in the tile's Q as B
// fragments of rows and of columns (NpfHalfOps::b_lane, a_lane), its dO BQ rows after each.
template <typename T, int D, bool CAUSAL, bool MASKED>
__device__ __forceinline__ void npf_fa_dense_dkdv_tile(const T* Kl, const T* Vl, const T* Qr, const T* Qc,
                                                       const float* lse_s, const float* d_s, int i0, int k0,
                                                       const NpfFaArgs<float>& a, float c,
                                                       float (&dk)[NpfFaDenseDkdvTraits<D>::FRAGS][D / 8][4],
                                                       float (&dv)[NpfFaDenseDkdvTraits<D>::FRAGS][D / 8][4]) {
    typedef NpfFaDenseDkdvTraits<D> Tr;
    typedef NpfHalfOps<T> Ops;                               // float16 or bfloat16 operands
    constexpr int F = Tr::FRAGS, LD = Tr::LD, NB = Tr::BQ / 8, DN = D / 8, KD = D / 16, KB = Tr::BQ / 16;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const T *dOr = Qr + Tr::BQ * LD, *dOc = Qc + Tr::BQ * LD;
    float st[F][NB][4], dpt[F][NB][4];                       // rows: the warp's keys; columns: the tile's queries
#pragma unroll
    for (int f = 0; f < F; ++f)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[f][nb][e] = dpt[f][nb][e] = 0.0f;
#pragma unroll
    for (int kd = 0; kd < KD; ++kd) {
        unsigned ak[F][4], av[F][4];                         // the warp's keys of K and of V, d block kd
#pragma unroll
        for (int f = 0; f < F; ++f) {
            npf_ldmatrix_x4(ak[f], Kl + 16 * f * LD + kd * 16);
            npf_ldmatrix_x4(av[f], Vl + 16 * f * LD + kd * 16);
        }
#pragma unroll
        for (int nb2 = 0; nb2 < NB / 2; ++nb2) {
            unsigned bq[4], bg[4];                           // Q rows and dO rows as B fragments (n: queries)
            npf_ldmatrix_x4(bq, Qr + nb2 * 16 * LD + kd * 16);
            npf_ldmatrix_x4(bg, dOr + nb2 * 16 * LD + kd * 16);
#pragma unroll
            for (int f = 0; f < F; ++f) {
                Ops::mma(st[f][2 * nb2], ak[f], bq, st[f][2 * nb2]);
                Ops::mma(st[f][2 * nb2 + 1], ak[f], bq + 2, st[f][2 * nb2 + 1]);
                Ops::mma(dpt[f][2 * nb2], av[f], bg, dpt[f][2 * nb2]);
                Ops::mma(dpt[f][2 * nb2 + 1], av[f], bg + 2, dpt[f][2 * nb2 + 1]);
            }
        }
    }
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {                        // this lane's two queries of the block
        const int col = nb * 8 + 2 * t;
        const float nl[2] = {-lse_s[col] * 1.4426950408889634f, -lse_s[col + 1] * 1.4426950408889634f};
        const float dd[2] = {d_s[col], d_s[col + 1]};
#pragma unroll
        for (int f = 0; f < F; ++f)                          // st becomes P^T, dpt dS^T / scale
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = st[f][nb][e];
                if (MASKED && CAUSAL && k0 + 16 * f + g + 8 * (e / 2) > i0 + col + e % 2 + a.shift)
                    x = -npf_fa_inf(0.0f);
                const float p = exp2f(fmaf(x, c, nl[e % 2]));
                st[f][nb][e] = p;
                dpt[f][nb][e] = p * (dpt[f][nb][e] - dd[e % 2]);
            }
    }
#pragma unroll
    for (int kb = 0; kb < KB; ++kb) {
        unsigned ap[F][4], as[F][4];                         // queries 16 kb .. of P^T and dS^T as A fragments
#pragma unroll
        for (int f = 0; f < F; ++f) {
            Ops::a_from_c(ap[f], st[f] + 2 * kb);
            Ops::a_from_c(as[f], dpt[f] + 2 * kb);
        }
#pragma unroll
        for (int dn2 = 0; dn2 < DN / 2; ++dn2) {
            unsigned bg[4], bq[4];                           // dO and Q rows, transposed (k: queries, n: d)
            npf_ldmatrix_x4_trans(bg, dOc + kb * 16 * LD + dn2 * 16);
            npf_ldmatrix_x4_trans(bq, Qc + kb * 16 * LD + dn2 * 16);
#pragma unroll
            for (int f = 0; f < F; ++f) {
                Ops::mma(dv[f][2 * dn2], ap[f], bg, dv[f][2 * dn2]);
                Ops::mma(dv[f][2 * dn2 + 1], ap[f], bg + 2, dv[f][2 * dn2 + 1]);
                Ops::mma(dk[f][2 * dn2], as[f], bq, dk[f][2 * dn2]);
                Ops::mma(dk[f][2 * dn2 + 1], as[f], bq + 2, dk[f][2 * dn2 + 1]);
            }
        }
    }
}

// Query tile qt of the dense dK, dV into its buffer ((qt - qt0) % 2, returned): the next tile's copies
// are issued first (into the other buffer), then this one's awaited, block-wide
template <typename T, int D, int BQ>
__device__ __forceinline__ int npf_fa_dense_next_queries(int qt, int qt0, int n_qt, NpfFaTilePair<T, BQ, D>& qg_copy,
                                                         const float* lse, const float* dvec, long long bh,
                                                         const NpfFaArgs<float>& a, T* QGs, float* LDs) {
    constexpr int LD = D + 8;
    const int buf = (qt - qt0) % 2;
    if (qt + 1 < n_qt)
        npf_fa_bwd_query_tile<T, D, BQ>(qg_copy, lse, dvec, bh, (qt + 1) * BQ, a, QGs + (1 - buf) * 2 * BQ * LD,
                                        LDs + (1 - buf) * 2 * BQ);
    npf_cp_async_commit();
    npf_cp_async_wait<1>();                                  // this tile's copies have landed
    __syncthreads();                                         // (everyone's, its lse and D), and K's and V's
    return buf;
}

template <typename T, int D, bool CAUSAL>
__device__ void npf_fa_bwd_dkdv_dense(const T* q, const T* k, const T* v,
                                      const T* dout, const float* lse, const float* dvec,
                                      T* dk, T* dv, const NpfFaArgs<float>& a, NpfFaLayout ql,
                                      NpfFaLayout kl, NpfFaLayout vl, NpfFaLayout gl, NpfFaLayout dkl,
                                      NpfFaLayout dvl) {
    typedef NpfFaDenseDkdvTraits<D> Tr;
    constexpr int F = Tr::FRAGS, BC = Tr::BC, BQ = Tr::BQ, LD = Tr::LD, DN = D / 8;
    NPF_FA_SHARED(smem, Tr::SHARED);
    T* Ks = reinterpret_cast<T*>(smem);                  // (BC, LD)
    T* Vs = Ks + BC * LD;                                // (BC, LD)
    T* QGs = Vs + BC * LD;                               // 2 x ((BQ, LD) Q, (BQ, LD) dO)
    float* LDs = reinterpret_cast<float*>(QGs + 4 * BQ * LD);         // 2 x ((BQ) lse, (BQ) D)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int j0 = blockIdx.x * BC, k0 = j0 + warp * Tr::WARP_KEYS;
    const int n_qt = (a.Tq + BQ - 1) / BQ;
    // the query tiles: from the first with a row that sees one of the block's keys; those before the one
    // whose every row sees every key of the block need the causal mask (one count for the block)
    const int qt0 = npf_fa_first_query_tile<BQ>(j0, n_qt, CAUSAL, a);
    const int unmasked_from = npf_fa_unmasked_query_tile<BC, BQ>(j0, qt0, n_qt, CAUSAL, a);
    const float c = a.scale * 1.4426950408889634f;
    typedef NpfHalfOps<T> Ops;                           // the lane's rows for ldmatrix, worked out once
    const T* Kl = Ks + warp * Tr::WARP_KEYS * LD + Ops::a_lane(LD, lane);
    const T* Vl = Vs + warp * Tr::WARP_KEYS * LD + Ops::a_lane(LD, lane);
    const T *Qr = QGs + Ops::b_lane(LD, lane), *Qc = QGs + Ops::a_lane(LD, lane);   // buffer 0's
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        __syncthreads();
        npf_fa_load_tile<T, BC, D>(k + npf_fa_head(kl, bh, a.H), j0, a.Tk, a.hs, kl.st, Ks);
        npf_fa_load_tile<T, BC, D>(v + npf_fa_head(vl, bh, a.H), j0, a.Tk, a.hv, vl.st, Vs);
        float dka[F][DN][4], dva[F][DN][4];
#pragma unroll
        for (int f = 0; f < F; ++f)
#pragma unroll
            for (int dn = 0; dn < DN; ++dn)
#pragma unroll
                for (int e = 0; e < 4; ++e) dka[f][dn][e] = dva[f][dn][e] = 0.0f;
        NpfFaTilePair<T, BQ, D> qg_copy(q + npf_fa_head(ql, bh, a.H), ql.st, a.hs, dout + npf_fa_head(gl, bh, a.H),
                                        gl.st, a.hv, a.Tq, qt0 * BQ);
        if (qt0 < n_qt)                                      // its copies: in flight from here
            npf_fa_bwd_query_tile<T, D, BQ>(qg_copy, lse, dvec, bh, qt0 * BQ, a, QGs, LDs);
        npf_cp_async_commit();
        int qt = qt0;
        for (; qt < unmasked_from; ++qt) {                   // the tiles across the diagonal
            const int buf = npf_fa_dense_next_queries<T, D, BQ>(qt, qt0, n_qt, qg_copy, lse, dvec, bh, a, QGs, LDs);
            const int qg = buf * 2 * BQ * LD;                // the buffer's offset
            const float* lse_s = LDs + buf * 2 * BQ;
            npf_fa_dense_dkdv_tile<T, D, CAUSAL, true>(Kl, Vl, Qr + qg, Qc + qg, lse_s, lse_s + BQ, qt * BQ, k0, a, c,
                                                    dka, dva);
            __syncthreads();                                 // done with this buffer before it is refilled
        }
        for (; qt < n_qt; ++qt) {                            // the main loop: no masks
            const int buf = npf_fa_dense_next_queries<T, D, BQ>(qt, qt0, n_qt, qg_copy, lse, dvec, bh, a, QGs, LDs);
            const int qg = buf * 2 * BQ * LD;                // the buffer's offset
            const float* lse_s = LDs + buf * 2 * BQ;
            npf_fa_dense_dkdv_tile<T, D, CAUSAL, false>(Kl, Vl, Qr + qg, Qc + qg, lse_s, lse_s + BQ, qt * BQ, k0, a, c,
                                                     dka, dva);
            __syncthreads();
        }
#pragma unroll
        for (int f = 0; f < F; ++f)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int j = k0 + 16 * f + g + 8 * r;
                if (j >= a.Tk) continue;
                T* dk_row = dk + npf_fa_head(dkl, bh, a.H) + j * dkl.st;
                T* dv_row = dv + npf_fa_head(dvl, bh, a.H) + j * dvl.st;
#pragma unroll
                for (int dn = 0; dn < DN; ++dn)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int d = dn * 8 + 2 * t + e;
                        if (d < a.hs) npf_store(dk_row + d, dka[f][dn][2 * r + e] * a.scale);
                        if (d < a.hv) npf_store(dv_row + d, dva[f][dn][2 * r + e]);
                    }
            }
    }
}

// ---- the dense SIMT kernels (float32): the common case without masks or dropout, on FFMA ----
// Float32 without the TF32 opt-in is SIMT arithmetic (npf_fa_forward's tile products, npf_fa_dot and
// npf_fa_acc: 16 row lanes x 8 column lanes, 128 FFMA to 12 16-byte shared loads in their loops). Those
// kernels carry every feature behind run-time branches; these, one per feature set as the tensor-core dense
// kernels, keep around the products only what a tile without masks needs: scores scaled into base 2 by one
// FFMA (P = 2^(S c - m c), c = scale log2(e)), the causal and ragged-end masks in a loop of their own over
// the tiles that cross the block's diagonal or the last key, a row's max and sum by shuffles among its 8
// column lanes (consecutive lanes of one warp), tiles copied 16 bytes at a time by cp.async and overlapped
// with the products (sm_80 and later). Tiles as npf_fa_forward's: BR x BC = 64 x 64 up to D = 64, 32 x 32
// at D = 128, rows D + 4 floats apart.
template <int D_> struct NpfFaSimtDenseTraits {
    static constexpr int D = D_, THREADS = NPF_FA_THREADS, BR = D <= 64 ? 64 : 32, BC = BR, DP = D + 4, CP = BC + 4;
    static constexpr int R = BR / NPF_FA_TR, C = BC / NPF_FA_TC, DC = D / NPF_FA_TC;
    typedef float Rows[R];                  // a value for each of a thread's rows
    typedef float Acc[R][DC];               // a thread's accumulator: its rows by its head columns
};

// The forward's shared memory: Q (BR, DP), K and V (BC, DP) each, P (BR, CP); one buffer each: K's next
// tile is copied during this tile's P V, V's during Q K^T (double buffers would hold an A100 to one block).
// MIN_BLOCKS (benchmarks/cuda_kernels.py, sm_90): 3 up to D 64 (128-168 registers; shared memory allows 3 at D
// 64: 18.75%, 4 at D 32: 25%), 4 at D 128 (102-106 registers, 25%)
template <int D_> struct NpfFaSimtDenseFwdTraits : NpfFaSimtDenseTraits<D_> {
    typedef NpfFaSimtDenseTraits<D_> B;
    static constexpr int SHARED = ((B::BR + 2 * B::BC) * B::DP + B::BR * B::CP) * 4;
    static constexpr int MIN_BLOCKS = D_ <= 64 ? 3 : 4;
};

// One key tile's scores and softmax (npf_fa_forward_simt_dense): S = Q K^T, (MASKED: keys past a row's
// diagonal or past Tk -inf), the row max m (raw scores) by shuffles, P = 2^(S c - m c) into Ps, the lane's
// part of each row sum l, and the accumulator rescaled where a row's maximum moved
template <int D, bool CAUSAL, bool MASKED>
__device__ __forceinline__ void npf_fa_simt_dense_p(const float* Qs, const float* Ks, float* Ps, int i0, int j0,
                                                    const NpfFaArgs<float>& a, float cs,
                                                    typename NpfFaSimtDenseTraits<D>::Acc& acc,
                                                    typename NpfFaSimtDenseTraits<D>::Rows& m,
                                                    typename NpfFaSimtDenseTraits<D>::Rows& l) {
    typedef NpfFaSimtDenseTraits<D> Tr;
    constexpr int R = Tr::R, C = Tr::C, DC = Tr::DC;
    const int tr = threadIdx.x / NPF_FA_TC, tc = threadIdx.x % NPF_FA_TC;
    const float inf = npf_fa_inf(0.0f);
    float s[R][C];
    npf_fa_dot<float, R, C, D>(Qs, Ks, s);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int row = tr + NPF_FA_TR * r;
        if (MASKED)
#pragma unroll
            for (int c = 0; c < C; ++c) {
                const int j = j0 + tc + NPF_FA_TC * c;
                if ((CAUSAL && j > i0 + row + a.shift) || j >= a.Tk) s[r][c] = -inf;
            }
        float mx = -inf;
#pragma unroll
        for (int c = 0; c < C; ++c) mx = fmaxf(mx, s[r][c]);
#pragma unroll
        for (int lanes = 1; lanes < NPF_FA_TC; lanes *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, lanes));
        const float m_new = fmaxf(m[r], mx);
        const float neg = m_new == -inf ? 0.0f : -m_new * cs;    // all -inf so far: no inf - inf
        const float alpha = m_new == m[r] ? 1.0f : exp2f((m[r] - m_new) * cs);
        m[r] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const float p = exp2f(fmaf(s[r][c], cs, neg));
            sum += p;
            Ps[row * Tr::CP + tc + NPF_FA_TC * c] = p;
        }
        l[r] = l[r] * alpha + sum;
        if (alpha != 1.0f)                                   // the row's maximum moved
#pragma unroll
            for (int c = 0; c < DC; ++c) acc[r][c] *= alpha;
    }
}

// One key tile kt of npf_fa_forward_simt_dense: on entry K's copies for it are in flight (V's buffer and P
// free once every thread is past the first barrier); V's copies are issued, the scores computed, then K's
// buffer takes the next tile's copies while P V is accumulated
template <int D, bool CAUSAL, bool MASKED>
__device__ __forceinline__ void npf_fa_simt_dense_fwd_tile(int kt, int n_kt, const float* k_head,
                                                           const float* v_head, const NpfFaArgs<float>& a,
                                                           long long k_st, long long v_st, const float* Qs,
                                                           float* Ks, float* Vs, float* Ps, int i0, float cs,
                                                           typename NpfFaSimtDenseTraits<D>::Acc& acc,
                                                           typename NpfFaSimtDenseTraits<D>::Rows& m,
                                                           typename NpfFaSimtDenseTraits<D>::Rows& l) {
    typedef NpfFaSimtDenseTraits<D> Tr;
    const int j0 = kt * Tr::BC;
    npf_cp_async_wait<0>();                                  // this tile's K has landed (the thread's copies)
    __syncthreads();                                         // everyone's; everyone is done with V and P
    npf_fa_load_tile_async<float, Tr::BC, D>(v_head, j0, a.Tk, a.hv, v_st, Vs);
    npf_cp_async_commit();
    npf_fa_simt_dense_p<D, CAUSAL, MASKED>(Qs, Ks, Ps, i0, j0, a, cs, acc, m, l);
    npf_cp_async_wait<0>();                                  // V has landed
    __syncthreads();                                         // everyone's, and P; everyone is done with K
    if (kt + 1 < n_kt) npf_fa_load_tile_async<float, Tr::BC, D>(k_head, j0 + Tr::BC, a.Tk, a.hs, k_st, Ks);
    npf_cp_async_commit();
    npf_fa_acc<float, Tr::R, Tr::DC, Tr::BC, Tr::CP, D>(Ps, Vs, acc);
}

// Forward: block (x: query tile, last first; y: b H + h), as npf_fa_forward; out = acc / l, lse = m scale +
// log l (a row that sees no key: zeros and +inf)
template <int D, bool CAUSAL>
__device__ void npf_fa_forward_simt_dense(const float* q, const float* k, const float* v, float* out, float* lse,
                                          const NpfFaArgs<float>& a, NpfFaLayout ql, NpfFaLayout kl, NpfFaLayout vl,
                                          NpfFaLayout ol) {
    typedef NpfFaSimtDenseFwdTraits<D> Tr;
    constexpr int R = Tr::R, DC = Tr::DC, BR = Tr::BR, BC = Tr::BC, DP = Tr::DP;
    NPF_FA_SHARED(smem, Tr::SHARED);
    float* Qs = reinterpret_cast<float*>(smem);          // (BR, DP)
    float* Ks = Qs + BR * DP;                            // (BC, DP)
    float* Vs = Ks + BC * DP;                            // (BC, DP)
    float* Ps = Vs + BC * DP;                            // (BR, CP)
    const int tr = threadIdx.x / NPF_FA_TC, tc = threadIdx.x % NPF_FA_TC;
    const int i0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * BR;
    const int n_kt = npf_fa_key_tiles<BC>(npf_fa_min(i0 + BR, a.Tq), a.Tk, CAUSAL, a.shift);
    const int masked_from = npf_fa_masked_from<BC>(i0, n_kt, CAUSAL, a);   // the tiles from it need masks
    const float cs = a.scale * 1.4426950408889634f;      // the scale and log2(e): P = 2^(s cs - m cs)
    const float inf = npf_fa_inf(0.0f);
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        __syncthreads();                                     // the previous head's readers are done
        const float* k_head = k + npf_fa_head(kl, bh, a.H);
        const float* v_head = v + npf_fa_head(vl, bh, a.H);
        npf_fa_load_tile<float, BR, D>(q + npf_fa_head(ql, bh, a.H), i0, a.Tq, a.hs, ql.st, Qs);
        if (n_kt > 0) npf_fa_load_tile_async<float, BC, D>(k_head, 0, a.Tk, a.hs, kl.st, Ks);
        npf_cp_async_commit();
        float m[R], l[R], acc[R][DC];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            m[r] = -inf;
            l[r] = 0.0f;
#pragma unroll
            for (int c = 0; c < DC; ++c) acc[r][c] = 0.0f;
        }
        int kt = 0;
        for (; kt < masked_from; ++kt)                       // the main loop: no masks
            npf_fa_simt_dense_fwd_tile<D, CAUSAL, false>(kt, n_kt, k_head, v_head, a, kl.st, vl.st, Qs, Ks, Vs, Ps,
                                                         i0, cs, acc, m, l);
        for (; kt < n_kt; ++kt)                              // the tiles across the diagonal or the end
            npf_fa_simt_dense_fwd_tile<D, CAUSAL, true>(kt, n_kt, k_head, v_head, a, kl.st, vl.st, Qs, Ks, Vs, Ps,
                                                        i0, cs, acc, m, l);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float sum = l[r];                                // the 8 column lanes' parts of the row sum
#pragma unroll
            for (int lanes = 1; lanes < NPF_FA_TC; lanes *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, lanes);
            const int i = i0 + tr + NPF_FA_TR * r;
            if (i >= a.Tq) continue;
            const bool empty = sum == 0.0f;                  // a row that sees no key: zeros, lse +inf
            const float den = empty ? 1.0f : sum;
            float* out_row = out + npf_fa_head(ol, bh, a.H) + i * ol.st;
#pragma unroll
            for (int c = 0; c < DC; ++c) {
                const int d = npf_fa_col(tc, c);
                if (d < a.hv) out_row[d] = acc[r][c] / den;
            }
            if (tc == 0) lse[bh * a.Tq + i] = empty ? inf : m[r] * a.scale + npf_log(sum);
        }
    }
}

// The dense SIMT backward, dQ then dK and dV, each its own pass as npf_fa_bwd_dq and npf_fa_bwd_dkdv (no
// two blocks add into one element): P = 2^(S c - lse log2(e)) (one FFMA and an exp2 a score), dS = P (dP -
// D) with the scale applied to dQ and dK once, at the end; the causal mask (dQ: and the ragged end) only on
// the tiles that cross the block's diagonal.
// dQ's shared memory: Q, dO (BR, DP) once per head, K_BUFFERS K and a V (BC, DP), dS (BR, CP). The next key
// tile's V is copied during this tile's dS K, and so is its K up to D = 64, into K's other buffer; at D = 128
// K has one buffer (a second held sm_90 to 2 blocks an SM, sm_80 to 1: 89 KiB) and its next tile is copied
// after dS K, behind a third barrier. MIN_BLOCKS: 2 (sm_90: 168 registers at D 32 and 64, 106 at D 128;
// shared memory holds D 64 to 2 blocks)
template <int D_> struct NpfFaSimtDenseDqTraits : NpfFaSimtDenseTraits<D_> {
    typedef NpfFaSimtDenseTraits<D_> B;
    static constexpr int K_BUFFERS = D_ <= 64 ? 2 : 1;
    static constexpr int SHARED = ((2 * B::BR + (K_BUFFERS + 1) * B::BC) * B::DP + B::BR * B::CP) * 4;
    static constexpr int MIN_BLOCKS = 2;
};

// One key tile kt of npf_fa_bwd_dq_simt_dense: S = Q K^T, dP = dO V^T, dS into Ss, dq += dS K (nl: the
// thread's rows' -lse log2(e), -inf past Tq or for a row that sees no key: P = 0 there; dd: their D)
template <int D, bool CAUSAL, bool MASKED>
__device__ __forceinline__ void npf_fa_simt_dense_dq_tile(int kt, int n_kt, const float* k_head, const float* v_head,
                                                          const NpfFaArgs<float>& a, long long k_st, long long v_st,
                                                          const float* Qs, const float* dOs, float* Kb, float* Vs,
                                                          float* Ss, int i0, float cs,
                                                          const typename NpfFaSimtDenseTraits<D>::Rows& nl,
                                                          const typename NpfFaSimtDenseTraits<D>::Rows& dd,
                                                          typename NpfFaSimtDenseTraits<D>::Acc& dqa) {
    typedef NpfFaSimtDenseDqTraits<D> Tr;
    constexpr int R = Tr::R, C = Tr::C, BC = Tr::BC, KB = Tr::K_BUFFERS;
    const int tr = threadIdx.x / NPF_FA_TC, tc = threadIdx.x % NPF_FA_TC;
    const int j0 = kt * BC;
    float* Ks = Kb + kt % KB * BC * Tr::DP;
    npf_cp_async_wait<0>();                                  // this tile's K and V have landed (the thread's)
    __syncthreads();                                         // everyone's; everyone is done with dS and the other K
    float s[R][C], dp[R][C];
    npf_fa_dot<float, R, C, D>(Qs, Ks, s);
    npf_fa_dot<float, R, C, D>(dOs, Vs, dp);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int row = tr + NPF_FA_TR * r;
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int j = j0 + tc + NPF_FA_TC * c;
            float p = exp2f(fmaf(s[r][c], cs, nl[r]));
            if (MASKED && ((CAUSAL && j > i0 + row + a.shift) || j >= a.Tk)) p = 0.0f;
            Ss[row * Tr::CP + tc + NPF_FA_TC * c] = p * (dp[r][c] - dd[r]);
        }
    }
    __syncthreads();                                         // dS everyone's; everyone is done with V
    if (kt + 1 < n_kt) {
        if (KB == 2)
            npf_fa_load_tile_async<float, BC, D>(k_head, j0 + BC, a.Tk, a.hs, k_st, Kb + (kt + 1) % KB * BC * Tr::DP);
        npf_fa_load_tile_async<float, BC, D>(v_head, j0 + BC, a.Tk, a.hv, v_st, Vs);
    }
    npf_cp_async_commit();
    npf_fa_acc<float, R, Tr::DC, BC, Tr::CP, D>(Ss, Ks, dqa);
    if (KB == 1) {
        __syncthreads();                                     // everyone is done with K
        if (kt + 1 < n_kt) npf_fa_load_tile_async<float, BC, D>(k_head, j0 + BC, a.Tk, a.hs, k_st, Kb);
        npf_cp_async_commit();
    }
}

// dQ: block (x: query tile, last first; y: b H + h) over its visible key tiles:  dq_i = scale sum_j dS k_j
template <int D, bool CAUSAL>
__device__ void npf_fa_bwd_dq_simt_dense(const float* q, const float* k, const float* v, const float* dout,
                                         const float* lse, const float* dvec, float* dq, const NpfFaArgs<float>& a,
                                         NpfFaLayout ql, NpfFaLayout kl, NpfFaLayout vl, NpfFaLayout gl,
                                         NpfFaLayout dql) {
    typedef NpfFaSimtDenseDqTraits<D> Tr;
    constexpr int R = Tr::R, DC = Tr::DC, BR = Tr::BR, BC = Tr::BC, DP = Tr::DP;
    NPF_FA_SHARED(smem, Tr::SHARED);
    float* Qs = reinterpret_cast<float*>(smem);          // (BR, DP)
    float* dOs = Qs + BR * DP;                           // (BR, DP)
    float* Kb = dOs + BR * DP;                           // K_BUFFERS x (BC, DP)
    float* Vs = Kb + Tr::K_BUFFERS * BC * DP;            // (BC, DP)
    float* Ss = Vs + BC * DP;                            // (BR, CP)
    const int tr = threadIdx.x / NPF_FA_TC;
    const int i0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * BR;
    const int n_kt = npf_fa_key_tiles<BC>(npf_fa_min(i0 + BR, a.Tq), a.Tk, CAUSAL, a.shift);
    const int masked_from = npf_fa_masked_from<BC>(i0, n_kt, CAUSAL, a);
    const float cs = a.scale * 1.4426950408889634f;
    const float inf = npf_fa_inf(0.0f);
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        __syncthreads();                                     // the previous head's readers are done
        const float* k_head = k + npf_fa_head(kl, bh, a.H);
        const float* v_head = v + npf_fa_head(vl, bh, a.H);
        if (n_kt > 0) {                                      // (rows that see no key: dq = 0, no copy left in flight)
            npf_fa_load_tile_async<float, BR, D>(q + npf_fa_head(ql, bh, a.H), i0, a.Tq, a.hs, ql.st, Qs);
            npf_fa_load_tile_async<float, BR, D>(dout + npf_fa_head(gl, bh, a.H), i0, a.Tq, a.hv, gl.st, dOs);
            npf_fa_load_tile_async<float, BC, D>(k_head, 0, a.Tk, a.hs, kl.st, Kb);
            npf_fa_load_tile_async<float, BC, D>(v_head, 0, a.Tk, a.hv, vl.st, Vs);
        }
        npf_cp_async_commit();
        float nl[R], dd[R], dqa[R][DC];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int i = i0 + tr + NPF_FA_TR * r;
            nl[r] = i < a.Tq ? -lse[bh * a.Tq + i] * 1.4426950408889634f : -inf;
            dd[r] = i < a.Tq ? dvec[bh * a.Tq + i] : 0.0f;
#pragma unroll
            for (int c = 0; c < DC; ++c) dqa[r][c] = 0.0f;
        }
        int kt = 0;
        for (; kt < masked_from; ++kt)                       // the main loop: no masks
            npf_fa_simt_dense_dq_tile<D, CAUSAL, false>(kt, n_kt, k_head, v_head, a, kl.st, vl.st, Qs, dOs, Kb, Vs,
                                                        Ss, i0, cs, nl, dd, dqa);
        for (; kt < n_kt; ++kt)                              // the tiles across the diagonal or the end
            npf_fa_simt_dense_dq_tile<D, CAUSAL, true>(kt, n_kt, k_head, v_head, a, kl.st, vl.st, Qs, dOs, Kb, Vs,
                                                       Ss, i0, cs, nl, dd, dqa);
        npf_fa_store_rows(dq + npf_fa_head(dql, bh, a.H), dql.st, i0, a.Tq, a.hs, dqa, a.scale);
    }
}

// dK, dV's shared memory: K, V (BC, DP) once per head, Q and dO (BR, DP), P^T and dS^T (BC, RP), the query
// tile's -lse log2(e) and D (2 BR): the next query tile's dO is copied during this tile's dS^T Q, its Q during
// the next tile's dP^T. MIN_BLOCKS (sm_90): 2 (168 registers at D 32: 18.75%; 238-242 at D 64, 128 at D 128:
// 12.5%, as npf_fa_bwd_dkdv's)
template <int D_> struct NpfFaSimtDenseDkdvTraits : NpfFaSimtDenseTraits<D_> {
    typedef NpfFaSimtDenseTraits<D_> B;
    static constexpr int RP = B::BR + 4;
    static constexpr int SHARED = ((2 * B::BC + 2 * B::BR) * B::DP + 2 * B::BC * RP + 2 * B::BR) * 4;
    static constexpr int MIN_BLOCKS = 2;
};

// One query tile qt of npf_fa_bwd_dkdv_simt_dense (thread rows keys, columns queries): dP^T = V dO^T, S^T =
// K Q^T, P^T and dS^T into Pt and St, dv += P^T dO, dk += dS^T Q. On entry dO's copies (and, on a head's
// first tile, K's and V's) are in one group, Q's in the next; ld_s holds the tile's -lse log2(e) and D.
template <int D, bool CAUSAL, bool MASKED>
__device__ __forceinline__ void npf_fa_simt_dense_dkdv_tile(int qt, int n_qt, const float* q_head, const float* g_head,
                                                            const float* lse, const float* dvec, long long bh,
                                                            const NpfFaArgs<float>& a, long long q_st, long long g_st,
                                                            const float* Ks, const float* Vs, float* Qs, float* dOs,
                                                            float* Pt, float* St, float* ld_s, int j0, float cs,
                                                            typename NpfFaSimtDenseTraits<D>::Acc& dka,
                                                            typename NpfFaSimtDenseTraits<D>::Acc& dva) {
    typedef NpfFaSimtDenseDkdvTraits<D> Tr;
    constexpr int R = Tr::R, C = Tr::C, BR = Tr::BR, RP = Tr::RP;
    const int tr = threadIdx.x / NPF_FA_TC, tc = threadIdx.x % NPF_FA_TC;
    const int i0 = qt * BR;
    npf_cp_async_wait<1>();                                  // dO has landed (the thread's); Q may be in flight
    __syncthreads();                                         // everyone's, and ld_s
    float dpt[R][C];
    npf_fa_dot<float, R, C, D>(Vs, dOs, dpt);                // dP^T = (dO V^T)^T
    npf_cp_async_wait<0>();                                  // Q has landed
    __syncthreads();
    float st[R][C];
    npf_fa_dot<float, R, C, D>(Ks, Qs, st);                  // S^T: keys x queries
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int row = tr + NPF_FA_TR * r;
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int col = tc + NPF_FA_TC * c;
            float p = exp2f(fmaf(st[r][c], cs, ld_s[col]));
            if (MASKED && CAUSAL && j0 + row > i0 + col + a.shift) p = 0.0f;
            Pt[row * RP + col] = p;
            St[row * RP + col] = p * (dpt[r][c] - ld_s[BR + col]);
        }
    }
    __syncthreads();                                         // P^T and dS^T everyone's
    npf_fa_acc<float, R, Tr::DC, BR, RP, D>(Pt, dOs, dva);   // dv_j += P^T dO_i
    __syncthreads();                                         // everyone is done with dO and ld_s
    if (qt + 1 < n_qt) {
        npf_fa_load_tile_async<float, BR, D>(g_head, i0 + BR, a.Tq, a.hv, g_st, dOs);
        npf_fa_query_stats<BR, NPF_FA_THREADS, true>(lse, dvec, bh, i0 + BR, a, ld_s);
    }
    npf_cp_async_commit();
    npf_fa_acc<float, R, Tr::DC, BR, RP, D>(St, Qs, dka);    // dk_j += dS^T q_i
    __syncthreads();                                         // everyone is done with Q
    if (qt + 1 < n_qt) npf_fa_load_tile_async<float, BR, D>(q_head, i0 + BR, a.Tq, a.hs, q_st, Qs);
    npf_cp_async_commit();
}

// dK, dV: block (x: key tile, y: b H + h) over the query tiles that see the key tile (the causal future's
// first ones skipped, those across the diagonal masked):  dk_j = scale sum_i dS^T q_i,  dv_j = sum_i P^T dO_i
template <int D, bool CAUSAL>
__device__ void npf_fa_bwd_dkdv_simt_dense(const float* q, const float* k, const float* v, const float* dout,
                                           const float* lse, const float* dvec, float* dk, float* dv,
                                           const NpfFaArgs<float>& a, NpfFaLayout ql, NpfFaLayout kl, NpfFaLayout vl,
                                           NpfFaLayout gl, NpfFaLayout dkl, NpfFaLayout dvl) {
    typedef NpfFaSimtDenseDkdvTraits<D> Tr;
    constexpr int R = Tr::R, DC = Tr::DC, BR = Tr::BR, BC = Tr::BC, DP = Tr::DP, RP = Tr::RP;
    NPF_FA_SHARED(smem, Tr::SHARED);
    float* Ks = reinterpret_cast<float*>(smem);          // (BC, DP)
    float* Vs = Ks + BC * DP;                            // (BC, DP)
    float* Qs = Vs + BC * DP;                            // (BR, DP)
    float* dOs = Qs + BR * DP;                           // (BR, DP)
    float* Pt = dOs + BR * DP;                           // (BC, RP) P^T
    float* St = Pt + BC * RP;                            // (BC, RP) dS^T
    float* ld_s = St + BC * RP;                          // (2 BR) -lse log2(e), D
    const int j0 = blockIdx.x * BC;
    const int n_qt = (a.Tq + BR - 1) / BR;
    const int qt0 = npf_fa_first_query_tile<BR>(j0, n_qt, CAUSAL, a);
    const int unmasked_from = npf_fa_unmasked_query_tile<BC, BR>(j0, qt0, n_qt, CAUSAL, a);
    const float cs = a.scale * 1.4426950408889634f;
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        __syncthreads();                                     // the previous head's readers are done
        const float* q_head = q + npf_fa_head(ql, bh, a.H);
        const float* g_head = dout + npf_fa_head(gl, bh, a.H);
        if (qt0 < n_qt) {                                    // (keys no query sees: dk = dv = 0, no copy)
            npf_fa_load_tile_async<float, BC, D>(k + npf_fa_head(kl, bh, a.H), j0, a.Tk, a.hs, kl.st, Ks);
            npf_fa_load_tile_async<float, BC, D>(v + npf_fa_head(vl, bh, a.H), j0, a.Tk, a.hv, vl.st, Vs);
            npf_fa_load_tile_async<float, BR, D>(g_head, qt0 * BR, a.Tq, a.hv, gl.st, dOs);
            npf_fa_query_stats<BR, NPF_FA_THREADS, true>(lse, dvec, bh, qt0 * BR, a, ld_s);
        }
        npf_cp_async_commit();
        if (qt0 < n_qt) npf_fa_load_tile_async<float, BR, D>(q_head, qt0 * BR, a.Tq, a.hs, ql.st, Qs);
        npf_cp_async_commit();
        float dka[R][DC], dva[R][DC];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int c = 0; c < DC; ++c) dka[r][c] = dva[r][c] = 0.0f;
        int qt = qt0;
        for (; qt < unmasked_from; ++qt)                     // the tiles across the diagonal
            npf_fa_simt_dense_dkdv_tile<D, CAUSAL, true>(qt, n_qt, q_head, g_head, lse, dvec, bh, a, ql.st, gl.st, Ks,
                                                         Vs, Qs, dOs, Pt, St, ld_s, j0, cs, dka, dva);
        for (; qt < n_qt; ++qt)                              // the main loop: no masks
            npf_fa_simt_dense_dkdv_tile<D, CAUSAL, false>(qt, n_qt, q_head, g_head, lse, dvec, bh, a, ql.st, gl.st, Ks,
                                                          Vs, Qs, dOs, Pt, St, ld_s, j0, cs, dka, dva);
        npf_fa_store_rows(dk + npf_fa_head(dkl, bh, a.H), dkl.st, j0, a.Tk, a.hs, dka, a.scale);
        npf_fa_store_rows(dv + npf_fa_head(dvl, bh, a.H), dvl.st, j0, a.Tk, a.hv, dva, 1.0f);
    }
}

// ---- the Hopper forward (sm_90a): the dense forward on wgmma, FlashAttention-3's products ----
// The dense forward's algorithm (no mask, padding or dropout; causal or not; float16 or bfloat16), its tile
// products on warpgroup MMAs (warpgroup.cuh) instead of mma.sync: a block of WARPGROUPS warpgroups takes 64
// query rows each, against key tiles of BC keys it shares. Per tile and warpgroup: S = Q K^T as D / 16
// wgmmas m64nBCk16 with Q and K from shared memory; the masks (the tiles that cross the block's diagonal, or
// the ragged end), the online softmax with the scale folded into one FFMA per score (exp2), the output
// rescaled where a row's maximum moved; P rounded to 16 bits in registers, the A operand of O += P V (BC /
// 16 wgmmas m64nDk16, V from shared memory N-major). A wgmma reads its whole B tile once for the 64 rows
// (mma.sync re-reads K and V per 16-row fragment through ldmatrix) and runs while the warpgroup goes on, so
// few instructions are issued per product. Tiles in shared memory are 128-byte swizzled (rows of 64
// values, a tile of D > 64 in regions of 64 columns: the layouts of warp_source.py), filled by cp.async
// (16 bytes a copy), K and V double-buffered. FlashAttention-3's intra-warpgroup pipelining: a tile's S is
// issued with the previous tile's P V behind it, so that P V runs on the tensor cores while the softmax
// runs on the others (V's copies a tile behind K's). Not yet: TMA loads, warp specialization, ping-pong
// between the warpgroups. The backward's two kernels on wgmma follow it.
// Traits: 2 warpgroups (128 query rows a block), 128 keys a tile; the accumulators S (64 floats a thread)
// and O (D / 2) and the previous P's registers (32), all live at once, hold one block of 256 threads an SM
// (MIN_BLOCKS 1).
template <int D_> struct NpfFaWgmmaTraits {
    static constexpr int D = D_, WARPGROUPS = 2, THREADS = 128 * WARPGROUPS, BR = 64 * WARPGROUPS, BC = 128;
    static constexpr int MIN_BLOCKS = 1;
    static constexpr int Q_BYTES = BR * D * 2, KV_BYTES = BC * D * 2;     // 16-bit values
    static constexpr int SHARED = 1024 + Q_BYTES + 4 * KV_BYTES;          // 1024: room to align the tiles
};

// Tiles of N rows of one head's (rows, width) matrix x, each into a 128-byte-swizzled tile of N rows and D
// columns (regions of 64 columns, N 128-byte rows each), zeros past rows and width: the 16-byte chunk c of
// row r lands in chunk (c % 8) ^ (r % 8) of its row. By cp.async, so rows start 16-byte aligned and width is a
// multiple of 8 (flash_attention.wgmma_applies sends other tensors to the dense kernels): each thread copies
// one chunk of every STEP-th row, its source and its place in the tile worked out once a head, not a tile.
template <typename T, int N, int D, int THREADS> struct NpfFaSwizzledRows {
    static constexpr int C = D / 8, STEP = THREADS / C;      // 16-byte chunks a row; rows a pass
    static_assert(THREADS % C == 0 && N % STEP == 0 && STEP % 8 == 0, "whole rows a pass, passes a tile");
    const T* x;
    const T* src;                                            // this thread's chunk of row 0
    long long stride, step;                                  // step: STEP rows
    int left, offset;                                        // left: rows from this thread's first one
    bool columns;                                            // its chunk is within width
    __device__ __forceinline__ NpfFaSwizzledRows(const T* x_, int rows, int width, long long stride_)
        : x(x_), stride(stride_), step(STEP * stride_) {
        const int c = threadIdx.x % C, r = threadIdx.x / C;   // r % 8 is the same in every pass
        columns = c * 8 < width;
        src = x + (long long)r * stride + c * 8;
        left = rows - r;
        offset = (c / 8) * (N * 128) + r * 128 + ((c % 8) ^ (r % 8)) * 16;
    }
    // rows [r0, r0 + N) into tile
    __device__ __forceinline__ void load(int r0, unsigned char* tile) const {
        const T* from = src + (long long)r0 * stride;
        unsigned char* to = tile + offset;
#pragma unroll
        for (int pass = 0; pass < N / STEP; ++pass) {
            const bool in = columns && r0 + pass * STEP < left;
            npf_cp_async_16_zfill(to, in ? from : x, in ? 16 : 0);
            from += step;
            to += STEP * 128;
        }
    }
};

// acc = X Y^T over the D head columns for one warpgroup: D / 16 wgmmas m64nNk16 issued (the caller fences,
// commits and waits), X's 64 rows from Xw (a tile whose regions of 64 columns are XR rows apart), Y's N rows
// from Y (regions N rows apart), both K-major; 16 columns a step, 32 bytes along the rows
template <int D, int N, int XR, bool BF16>
__device__ __forceinline__ void npf_fa_wgmma_rows_dot(float* acc, const unsigned char* Xw, const unsigned char* Y) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int at = kk / 4 * 128, by = kk % 4 * 32;       // (region of 64 columns, bytes into the row)
        NpfWgmma<N, BF16>::ss(acc, npf_wgmma_desc(Xw + at * XR + by, 16, 1024),
                              npf_wgmma_desc(Y + at * N + by, 16, 1024), kk > 0);
    }
}

// The copies just issued committed as a group, those committed before it awaited (they have landed),
// fenced for wgmma's reads, and the same for every thread of the block: the tile they hold is ready
__device__ __forceinline__ void npf_fa_wgmma_landed() {
    npf_cp_async_commit();
    npf_cp_async_wait<1>();
    npf_fence_async_shared();                                // where wgmma reads them
    __syncthreads();                                         // (everyone's)
}

// The forward's steps for one warpgroup (its 64 rows; its warp's 16 from wr). Accumulators in wgmma's
// fragments: s[4 i + e] and o[4 i + e] are row wr + g + 8 (e / 2), column 8 i + 2 t + e % 2.
// S = Q K^T of a key tile, issued and committed (the caller waits). Qw: the warpgroup's rows of the Q tile
// (regions BR rows apart); Ks: the tile's keys.
template <typename T, int D>
__device__ __forceinline__ void npf_fa_wgmma_scores(float (&s)[NpfFaWgmmaTraits<D>::BC / 2], const unsigned char* Qw,
                                                    const unsigned char* Ks) {
    typedef NpfFaWgmmaTraits<D> Tr;
    npf_wgmma_fence();
    npf_fa_wgmma_rows_dot<D, Tr::BC, Tr::BR, Npf16<T>::BF16>(s, Qw, Ks);   // written whole by the first wgmma
    npf_wgmma_commit();
}

// The online softmax of key tile j0.., in place: (MASKED: the causal and ragged-end masks), each row's
// maximum m moved on, l scaled to it and the tile's P added; s becomes P = 2^(s c - m c) (float32), alpha
// the factor O still needs (1 where the maximum did not move).
template <int D, bool CAUSAL, bool MASKED>
__device__ __forceinline__ void npf_fa_wgmma_softmax(float (&s)[NpfFaWgmmaTraits<D>::BC / 2], int j0, int wr,
                                                     const NpfFaArgs<float>& a, float c, float (&m)[2],
                                                     float (&l)[2], float (&alpha)[2]) {
    constexpr int BC = NpfFaWgmmaTraits<D>::BC;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const float inf = npf_fa_inf(0.0f);
    if (MASKED)                                              // keys past a row's diagonal or past Tk: -inf
#pragma unroll
        for (int j = 0; j < BC / 2; ++j) {
            const int i = wr + g + 8 * (j % 4 / 2), key = j0 + 8 * (j / 4) + 2 * t + j % 2;
            if ((CAUSAL && key > i + a.shift) || key >= a.Tk) s[j] = -inf;
        }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = fmaxf(s[2 * r], s[2 * r + 1]);
#pragma unroll
        for (int i = 1; i < BC / 8; ++i) mx = fmaxf(mx, fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[r], mx);
        // the exponent's offset; all -inf so far: the largest float, so that a masked -inf gives 2^-inf = 0, not NaN
        const float neg = fminf(-m_new * c, 3.40282347e38f);
        alpha[r] = m_new == m[r] ? 1.0f : exp2f(fmaf(m[r], c, neg));
        m[r] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < BC / 8; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float& x = s[4 * i + 2 * r + e];
                x = exp2f(fmaf(x, c, neg));
                sum += x;
            }
        l[r] = l[r] * alpha[r] + sum;
    }
}

// P (float32, as npf_fa_wgmma_softmax leaves it in s) rounded to 16 bits as wgmma's A registers, 16 keys a step
template <typename T, int BC>
__device__ __forceinline__ void npf_fa_wgmma_pack(const float (&s)[BC / 2], unsigned (&pa)[BC / 16][4]) {
#pragma unroll
    for (int kb = 0; kb < BC / 16; ++kb)
#pragma unroll
        for (int h = 0; h < 4; ++h)                          // rows g, g + 8 of keys 2 t, 2 t + 1; then 2 t + 8, ..
            pa[kb][h] = npf_pack2<T>(s[8 * kb + 2 * h], s[8 * kb + 2 * h + 1]);
}

// O = alpha O + P V of a key tile, issued and committed (the caller waits): the rescale where a row's maximum
// moved, then BC / 16 wgmmas m64nDk16 with P from the registers pa and V's rows (Vs) N-major
template <typename T, int D>
__device__ __forceinline__ void npf_fa_wgmma_add_pv(float (&o)[D / 2], const float (&alpha)[2],
                                                    const unsigned (&pa)[NpfFaWgmmaTraits<D>::BC / 16][4],
                                                    const unsigned char* Vs) {
    constexpr int BC = NpfFaWgmmaTraits<D>::BC;
#pragma unroll
    for (int r = 0; r < 2; ++r)
        if (alpha[r] != 1.0f)
#pragma unroll
            for (int i = 0; i < D / 8; ++i) {
                o[4 * i + 2 * r] *= alpha[r];
                o[4 * i + 2 * r + 1] *= alpha[r];
            }
    npf_wgmma_fence();                                       // o and pa were written since the last wgmma
#pragma unroll
    for (int kb = 0; kb < BC / 16; ++kb)                     // V's rows 16 kb ..: 16 rows of 128 bytes further
        NpfWgmma<D, Npf16<T>::BF16>::template rs<1>(o, pa[kb], npf_wgmma_desc(Vs + kb * 16 * 128, BC * 128, 1024), 1);
    npf_wgmma_commit();
}

// Key tile j0.., FlashAttention-3's intra-warpgroup pipelining: S of this tile issued, then (unless FIRST)
// O = alpha O + P V of the tile before (its P in pa, its V in Vp), so the tensor cores run P V while this
// tile's softmax does; then this tile's P into pa once P V is done with it.
template <typename T, int D, bool CAUSAL, bool MASKED, bool FIRST>
__device__ __forceinline__ void npf_fa_wgmma_tile(const unsigned char* Qw, const unsigned char* Ks,
                                                  const unsigned char* Vp, int j0, int wr,
                                                  const NpfFaArgs<float>& a, float c, float (&o)[D / 2],
                                                  float (&m)[2], float (&l)[2], float (&alpha)[2],
                                                  unsigned (&pa)[NpfFaWgmmaTraits<D>::BC / 16][4]) {
    constexpr int BC = NpfFaWgmmaTraits<D>::BC;
    float s[BC / 2];
    npf_fa_wgmma_scores<T, D>(s, Qw, Ks);
    if (FIRST) {
        npf_wgmma_wait<0>();
    } else {
        npf_fa_wgmma_add_pv<T, D>(o, alpha, pa, Vp);
        npf_wgmma_wait<1>();                                 // S is done; P V may still run
    }
    npf_wgmma_hold<BC / 2>(s);
    npf_fa_wgmma_softmax<D, CAUSAL, MASKED>(s, j0, wr, a, c, m, l, alpha);
    npf_wgmma_wait<0>();
    npf_wgmma_hold<D / 2>(o);
    npf_wgmma_hold<BC / 4>(&pa[0][0]);
    npf_fa_wgmma_pack<T, BC>(s, pa);
}

// The forward's copies at key tile kt of a head (0 <= kt <= n_kt): K of tile kt + 1 and V of tile kt issued
// into their buffers (kt % 2; V a tile behind K, as P V is), then K of tile kt and V of tile kt - 1
// awaited and fenced for wgmma's reads, block-wide
template <typename T, int D, int BC, int THREADS>
__device__ __forceinline__ void npf_fa_wgmma_next_kv(int kt, int n_kt, const NpfFaSwizzledRows<T, BC, D, THREADS>& ks,
                                                     const NpfFaSwizzledRows<T, BC, D, THREADS>& vs,
                                                     unsigned char* Kb, unsigned char* Vb) {
    constexpr int KV_BYTES = BC * D * 2;
    if (kt + 1 < n_kt) ks.load((kt + 1) * BC, Kb + (kt + 1) % 2 * KV_BYTES);
    if (kt < n_kt) vs.load(kt * BC, Vb + kt % 2 * KV_BYTES);
    npf_fa_wgmma_landed();
}

template <typename T, int D, bool CAUSAL>
__device__ void npf_fa_forward_wgmma(const T* q, const T* k, const T* v, T* out, float* lse,
                                     const NpfFaArgs<float>& a, NpfFaLayout ql, NpfFaLayout kl, NpfFaLayout vl,
                                     NpfFaLayout ol) {
    typedef NpfFaWgmmaTraits<D> Tr;
    constexpr int BR = Tr::BR, BC = Tr::BC, THREADS = Tr::THREADS;
    NPF_FA_SHARED(smem, Tr::SHARED);
    unsigned char* Qs = npf_align_1024(smem);               // (BR, D) swizzled, then 2 x K, 2 x V of (BC, D)
    unsigned char* Kb = Qs + Tr::Q_BYTES;
    unsigned char* Vb = Kb + 2 * Tr::KV_BYTES;
    const int wg = threadIdx.x / 128, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int i0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * BR;
    const int wr = i0 + 64 * wg + 16 * (threadIdx.x % 128 / 32);        // this warp's first query row
    const unsigned char* Qw = Qs + 64 * wg * 128;                       // the warpgroup's 64 rows
    const int n_kt = npf_fa_key_tiles<BC>(npf_fa_min(i0 + BR, a.Tq), a.Tk, CAUSAL, a.shift);
    const int masked_from = npf_fa_masked_from<BC>(i0, n_kt, CAUSAL, a);
    const float c = a.scale * 1.4426950408889634f;           // the scale and log2(e): P = 2^(s c - m c)
    const float inf = npf_fa_inf(0.0f);
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        __syncthreads();                                     // the previous head's readers are done
        const NpfFaSwizzledRows<T, BC, D, THREADS> ks(k + npf_fa_head(kl, bh, a.H), a.Tk, a.hs, kl.st);
        const NpfFaSwizzledRows<T, BC, D, THREADS> vs(v + npf_fa_head(vl, bh, a.H), a.Tk, a.hv, vl.st);
        float o[D / 2], m[2] = {-inf, -inf}, l[2] = {0.0f, 0.0f}, alpha[2];
        unsigned pa[BC / 16][4];                             // the last tile's P, as wgmma's A registers
#pragma unroll
        for (int j = 0; j < D / 2; ++j) o[j] = 0.0f;
        if (n_kt > 0) {                                      // rows that see no key copy nothing (none left in flight)
            NpfFaSwizzledRows<T, BR, D, THREADS>(q + npf_fa_head(ql, bh, a.H), a.Tq, a.hs, ql.st).load(i0, Qs);
            ks.load(0, Kb);                                  // with Q: tile 0's keys, in flight from here
            npf_cp_async_commit();
            npf_fa_wgmma_next_kv<T, D, BC, THREADS>(0, n_kt, ks, vs, Kb, Vb);
            if (masked_from > 0)                             // the first tile: S, its softmax (P V waits)
                npf_fa_wgmma_tile<T, D, CAUSAL, false, true>(Qw, Kb, nullptr, 0, wr, a, c, o, m, l, alpha, pa);
            else
                npf_fa_wgmma_tile<T, D, CAUSAL, true, true>(Qw, Kb, nullptr, 0, wr, a, c, o, m, l, alpha, pa);
            __syncthreads();                                 // done with K's buffer before it is refilled
            // the main loop: tiles every row of the block sees whole; then those that need masks
            int kt = 1;
            for (; kt < masked_from; ++kt) {
                npf_fa_wgmma_next_kv<T, D, BC, THREADS>(kt, n_kt, ks, vs, Kb, Vb);
                npf_fa_wgmma_tile<T, D, CAUSAL, false, false>(Qw, Kb + kt % 2 * Tr::KV_BYTES,
                                                              Vb + (kt - 1) % 2 * Tr::KV_BYTES, kt * BC, wr, a, c, o,
                                                              m, l, alpha, pa);
                __syncthreads();                             // done with these buffers before they are refilled
            }
            for (; kt < n_kt; ++kt) {
                npf_fa_wgmma_next_kv<T, D, BC, THREADS>(kt, n_kt, ks, vs, Kb, Vb);
                npf_fa_wgmma_tile<T, D, CAUSAL, true, false>(Qw, Kb + kt % 2 * Tr::KV_BYTES,
                                                             Vb + (kt - 1) % 2 * Tr::KV_BYTES, kt * BC, wr, a, c, o,
                                                             m, l, alpha, pa);
                __syncthreads();
            }
            npf_fa_wgmma_next_kv<T, D, BC, THREADS>(n_kt, n_kt, ks, vs, Kb, Vb);    // the last tile's V
            npf_fa_wgmma_add_pv<T, D>(o, alpha, pa, Vb + (n_kt - 1) % 2 * Tr::KV_BYTES);
            npf_wgmma_wait<0>();
            npf_wgmma_hold<D / 2>(o);
            npf_wgmma_hold<BC / 4>(&pa[0][0]);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float sum = l[r];                                // the quad's four parts of the row sum
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int i = wr + g + 8 * r;
            if (i >= a.Tq) continue;
            const bool empty = sum == 0.0f;                  // a row that sees no key: zeros, lse +inf
            const float den = empty ? 1.0f : sum;
            T* out_row = out + npf_fa_head(ol, bh, a.H) + i * ol.st;
#pragma unroll
            for (int j = 0; j < D / 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int d = 8 * j + 2 * t + e;
                    if (d < a.hv) npf_store(out_row + d, o[4 * j + 2 * r + e] / den);
                }
            if (t == 0) lse[bh * a.Tq + i] = empty ? inf : m[r] * a.scale + npf_log(sum);
        }
    }
}

// dQ on wgmma (sm_90a): the dense dQ's algorithm (P recomputed from lse, dS = P (dP - D), the scale once at
// the end), its products as the Hopper forward's: a warpgroup per 64 query rows, key tiles of BC = 64 keys;
// S = Q K^T and dP = dO V^T as D / 16 wgmmas each (m64n64k16, all four operands from shared memory, one
// group), P and dS in registers, dQ += dS K (m64nDk16, K N-major), pipelined as the forward: a tile's S and
// dP issued with the previous tile's dQ += dS K behind them, so that the tensor cores run it while this
// tile's dS is worked out. Q and dO loaded once a head; K in three buffers (a tile's, the previous one's
// for dQ, the next one's in flight), V in two. Traits: 2 warpgroups, 128 rows a block; S, dP (32 floats
// a thread each), dQ (D / 2) and the previous dS's registers (16): one block of 256 threads an SM.
template <int D_> struct NpfFaWgmmaDqTraits {
    static constexpr int D = D_, WARPGROUPS = 2, THREADS = 128 * WARPGROUPS, BR = 64 * WARPGROUPS, BC = 64;
    static constexpr int MIN_BLOCKS = 1;
    static constexpr int Q_BYTES = BR * D * 2, KV_BYTES = BC * D * 2;     // 16-bit values
    static constexpr int SHARED = 1024 + 2 * Q_BYTES + 5 * KV_BYTES;      // Q, dO; 3 x K, 2 x V
};

// npf_fa_bwd_dq_wgmma's steps for one warpgroup (its rows as the forward's). S = Q K^T and dP = dO V^T of a
// key tile, issued and committed (the caller waits).
template <typename T, int D>
__device__ __forceinline__ void npf_fa_wgmma_dq_scores(float (&s)[NpfFaWgmmaDqTraits<D>::BC / 2],
                                                       float (&dp)[NpfFaWgmmaDqTraits<D>::BC / 2],
                                                       const unsigned char* Qw, const unsigned char* dOw,
                                                       const unsigned char* Ks, const unsigned char* Vs) {
    typedef NpfFaWgmmaDqTraits<D> Tr;
    npf_wgmma_fence();
    npf_fa_wgmma_rows_dot<D, Tr::BC, Tr::BR, Npf16<T>::BF16>(s, Qw, Ks);   // written whole by their first wgmmas
    npf_fa_wgmma_rows_dot<D, Tr::BC, Tr::BR, Npf16<T>::BF16>(dp, dOw, Vs);
    npf_wgmma_commit();
}

// dS / scale = P (dP - D) of key tile j0.., in place in s: P recomputed from lse (MASKED: the causal and
// ragged-end masks). nl: -lse log2(e) of the thread's two rows; dd: their D.
template <int D, bool CAUSAL, bool MASKED>
__device__ __forceinline__ void npf_fa_wgmma_dq_ds(float (&s)[NpfFaWgmmaDqTraits<D>::BC / 2],
                                                   const float (&dp)[NpfFaWgmmaDqTraits<D>::BC / 2], int j0, int wr,
                                                   const NpfFaArgs<float>& a, float c, const float (&nl)[2],
                                                   const float (&dd)[2]) {
    constexpr int BC = NpfFaWgmmaDqTraits<D>::BC;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < BC / 2; ++j) {
        float x = s[j];
        if (MASKED) {
            const int i = wr + g + 8 * (j % 4 / 2), key = j0 + 8 * (j / 4) + 2 * t + j % 2;
            if ((CAUSAL && key > i + a.shift) || key >= a.Tk) x = -npf_fa_inf(0.0f);
        }
        s[j] = exp2f(fmaf(x, c, nl[j % 4 / 2])) * (dp[j] - dd[j % 4 / 2]);
    }
}

// dQ += dS K of a key tile, issued and committed (the caller waits): dS from the registers ds, K's rows
// (Ks) N-major: the keys are dQ's k axis
template <typename T, int D>
__device__ __forceinline__ void npf_fa_wgmma_dq_add(float (&dq)[D / 2],
                                                    const unsigned (&ds)[NpfFaWgmmaDqTraits<D>::BC / 16][4],
                                                    const unsigned char* Ks) {
    constexpr int BC = NpfFaWgmmaDqTraits<D>::BC;
    npf_wgmma_fence();                                       // ds was written since the last wgmma
#pragma unroll
    for (int kb = 0; kb < BC / 16; ++kb)                     // K's rows 16 kb ..
        NpfWgmma<D, Npf16<T>::BF16>::template rs<1>(dq, ds[kb], npf_wgmma_desc(Ks + kb * 16 * 128, BC * 128, 1024), 1);
    npf_wgmma_commit();
}

// Key tile j0.. of npf_fa_bwd_dq_wgmma: its S and dP issued, then (unless FIRST) dQ += dS K of the tile before
// (its dS in ds, its K in Kp); dS worked out while that runs, then into ds once it is done.
template <typename T, int D, bool CAUSAL, bool MASKED, bool FIRST>
__device__ __forceinline__ void npf_fa_wgmma_dq_tile(const unsigned char* Qw, const unsigned char* dOw,
                                                     const unsigned char* Ks, const unsigned char* Vs,
                                                     const unsigned char* Kp, int j0, int wr,
                                                     const NpfFaArgs<float>& a, float c, const float (&nl)[2],
                                                     const float (&dd)[2], float (&dq)[D / 2],
                                                     unsigned (&ds)[NpfFaWgmmaDqTraits<D>::BC / 16][4]) {
    constexpr int BC = NpfFaWgmmaDqTraits<D>::BC;
    float s[BC / 2], dp[BC / 2];
    npf_fa_wgmma_dq_scores<T, D>(s, dp, Qw, dOw, Ks, Vs);
    if (FIRST) {
        npf_wgmma_wait<0>();
    } else {
        npf_fa_wgmma_dq_add<T, D>(dq, ds, Kp);
        npf_wgmma_wait<1>();                                 // S and dP are done; dQ += dS K may still run
    }
    npf_wgmma_hold<BC / 2>(s);
    npf_wgmma_hold<BC / 2>(dp);
    npf_fa_wgmma_dq_ds<D, CAUSAL, MASKED>(s, dp, j0, wr, a, c, nl, dd);
    npf_wgmma_wait<0>();
    npf_wgmma_hold<D / 2>(dq);
    npf_wgmma_hold<BC / 4>(&ds[0][0]);
    npf_fa_wgmma_pack<T, BC>(s, ds);
}

// dQ's copies at key tile kt of a head: K and V of tile kt + 1 issued (K into buffer (kt + 1) % 3, V into
// (kt + 1) % 2), then those of tile kt awaited and fenced for wgmma's reads, block-wide
template <typename T, int D, int BC, int THREADS>
__device__ __forceinline__ void npf_fa_wgmma_dq_next(int kt, int n_kt, const NpfFaSwizzledRows<T, BC, D, THREADS>& ks,
                                                     const NpfFaSwizzledRows<T, BC, D, THREADS>& vs,
                                                     unsigned char* Kb, unsigned char* Vb) {
    constexpr int KV_BYTES = BC * D * 2;
    if (kt + 1 < n_kt) {
        ks.load((kt + 1) * BC, Kb + (kt + 1) % 3 * KV_BYTES);
        vs.load((kt + 1) * BC, Vb + (kt + 1) % 2 * KV_BYTES);
    }
    npf_fa_wgmma_landed();
}

template <typename T, int D, bool CAUSAL>
__device__ void npf_fa_bwd_dq_wgmma(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                                    const float* dvec, T* dq, const NpfFaArgs<float>& a, NpfFaLayout ql,
                                    NpfFaLayout kl, NpfFaLayout vl, NpfFaLayout gl, NpfFaLayout dql) {
    typedef NpfFaWgmmaDqTraits<D> Tr;
    constexpr int BR = Tr::BR, BC = Tr::BC, THREADS = Tr::THREADS;
    NPF_FA_SHARED(smem, Tr::SHARED);
    unsigned char* Qs = npf_align_1024(smem);               // (BR, D) Q, (BR, D) dO, then 3 x K, 2 x V of (BC, D)
    unsigned char* dOs = Qs + Tr::Q_BYTES;
    unsigned char* Kb = dOs + Tr::Q_BYTES;
    unsigned char* Vb = Kb + 3 * Tr::KV_BYTES;
    const int wg = threadIdx.x / 128, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int i0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * BR;
    const int wr = i0 + 64 * wg + 16 * (threadIdx.x % 128 / 32);        // this warp's first query row
    const int n_kt = npf_fa_key_tiles<BC>(npf_fa_min(i0 + BR, a.Tq), a.Tk, CAUSAL, a.shift);
    const int masked_from = npf_fa_masked_from<BC>(i0, n_kt, CAUSAL, a);
    const float c = a.scale * 1.4426950408889634f;
    const float inf = npf_fa_inf(0.0f);
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        __syncthreads();                                     // the previous head's readers are done
        const NpfFaSwizzledRows<T, BC, D, THREADS> ks(k + npf_fa_head(kl, bh, a.H), a.Tk, a.hs, kl.st);
        const NpfFaSwizzledRows<T, BC, D, THREADS> vs(v + npf_fa_head(vl, bh, a.H), a.Tk, a.hv, vl.st);
        if (n_kt > 0) {                                      // rows that see no key copy nothing (none left in flight)
            NpfFaSwizzledRows<T, BR, D, THREADS>(q + npf_fa_head(ql, bh, a.H), a.Tq, a.hs, ql.st).load(i0, Qs);
            NpfFaSwizzledRows<T, BR, D, THREADS>(dout + npf_fa_head(gl, bh, a.H), a.Tq, a.hv, gl.st).load(i0, dOs);
            ks.load(0, Kb);                                  // with Q and dO: tile 0's copies
            vs.load(0, Vb);
            npf_cp_async_commit();
        }
        float nl[2], dd[2], dqa[D / 2];
        unsigned ds[BC / 16][4];                             // the last tile's dS / scale, as wgmma's A registers
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = wr + g + 8 * r;
            nl[r] = i < a.Tq ? -lse[bh * a.Tq + i] * 1.4426950408889634f : -inf;  // rows past Tq: P = 0
            dd[r] = i < a.Tq ? dvec[bh * a.Tq + i] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < D / 2; ++j) dqa[j] = 0.0f;
        const unsigned char* Qw = Qs + 64 * wg * 128;
        const unsigned char* dOw = dOs + 64 * wg * 128;
        if (n_kt > 0) {
            npf_fa_wgmma_dq_next<T, D, BC, THREADS>(0, n_kt, ks, vs, Kb, Vb);
            if (masked_from > 0)                             // the first tile: S, dP, dS (dQ waits for the next)
                npf_fa_wgmma_dq_tile<T, D, CAUSAL, false, true>(Qw, dOw, Kb, Vb, nullptr, 0, wr, a, c, nl, dd, dqa,
                                                                ds);
            else
                npf_fa_wgmma_dq_tile<T, D, CAUSAL, true, true>(Qw, dOw, Kb, Vb, nullptr, 0, wr, a, c, nl, dd, dqa,
                                                               ds);
            __syncthreads();                                 // done with these buffers before they are refilled
            int kt = 1;
            for (; kt < masked_from; ++kt) {                 // the main loop: no masks
                npf_fa_wgmma_dq_next<T, D, BC, THREADS>(kt, n_kt, ks, vs, Kb, Vb);
                npf_fa_wgmma_dq_tile<T, D, CAUSAL, false, false>(
                    Qw, dOw, Kb + kt % 3 * Tr::KV_BYTES, Vb + kt % 2 * Tr::KV_BYTES, Kb + (kt - 1) % 3 * Tr::KV_BYTES,
                    kt * BC, wr, a, c, nl, dd, dqa, ds);
                __syncthreads();
            }
            for (; kt < n_kt; ++kt) {
                npf_fa_wgmma_dq_next<T, D, BC, THREADS>(kt, n_kt, ks, vs, Kb, Vb);
                npf_fa_wgmma_dq_tile<T, D, CAUSAL, true, false>(
                    Qw, dOw, Kb + kt % 3 * Tr::KV_BYTES, Vb + kt % 2 * Tr::KV_BYTES, Kb + (kt - 1) % 3 * Tr::KV_BYTES,
                    kt * BC, wr, a, c, nl, dd, dqa, ds);
                __syncthreads();
            }
            npf_fa_wgmma_dq_add<T, D>(dqa, ds, Kb + (n_kt - 1) % 3 * Tr::KV_BYTES);     // the last tile's
            npf_wgmma_wait<0>();
            npf_wgmma_hold<D / 2>(dqa);
            npf_wgmma_hold<BC / 4>(&ds[0][0]);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = wr + g + 8 * r;
            if (i >= a.Tq) continue;
            T* dq_row = dq + npf_fa_head(dql, bh, a.H) + i * dql.st;
#pragma unroll
            for (int j = 0; j < D / 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int d = 8 * j + 2 * t + e;
                    if (d < a.hs) npf_store(dq_row + d, dqa[4 * j + 2 * r + e] * a.scale);
                }
        }
    }
}

// dK, dV on wgmma (sm_90a): the dense dK, dV's algorithm, its products as the Hopper forward's: a warpgroup
// per 64 keys (K and V loaded once a head), query tiles of BQ = 64; S^T = K Q^T and dP^T = V dO^T as D / 16
// wgmmas each (m64n64k16, from shared memory, one group); P^T and dS^T in registers; dV += P^T dO and
// dK += dS^T Q (m64nDk16, dO and Q N-major: the queries are their k axis). PIPELINED (head size 64), as the
// forward and dQ: a tile's S^T and dP^T issued with the previous tile's dV and dK products behind them, so
// that the tensor cores run those while this tile's P^T and dS^T are worked out; Q and dO in three buffers
// (a tile's, the previous one's for dK and dV, the next one's in flight). At head size 128 a tile's products
// run one after the other, Q and dO in two buffers: the previous tile's P^T and dS^T beside S^T, dP^T, dK
// and dV would not fit in a thread's 255 registers (ptxas spilled 28). -lse log2(e) and D in two buffers.
// Traits: 2 warpgroups, 128 keys a block; S^T, dP^T (32 floats a thread each), dK and dV (D / 2 each), P^T
// and dS^T as wgmma's A registers (16 each): one block of 256 threads an SM.
template <int D_> struct NpfFaWgmmaDkdvTraits {
    static constexpr int D = D_, WARPGROUPS = 2, THREADS = 128 * WARPGROUPS, BC = 64 * WARPGROUPS, BQ = 64;
    static constexpr int MIN_BLOCKS = 1;
    static constexpr bool PIPELINED = D <= 64;
    static constexpr int K_BYTES = BC * D * 2, Q_BYTES = BQ * D * 2;      // 16-bit values
    static constexpr int Q_BUFFERS = PIPELINED ? 3 : 2;
    static constexpr int SHARED = 1024 + 2 * K_BYTES + Q_BUFFERS * 2 * Q_BYTES + 4 * BQ * 4;   // K, V; Q, dO; lse, D
};

struct __align__(8) NpfF2 { float x, y; };                 // two floats in one 8-byte load

// npf_fa_bwd_dkdv_wgmma's steps for one warpgroup (its 64 keys; its warp's 16 from kr). The accumulators'
// columns are the tile's queries: st[4 i + e] is key kr + g + 8 (e / 2), query i0 + 8 i + 2 t + e % 2.
// S^T = K Q^T and dP^T = V dO^T of a query tile, issued and committed (the caller waits): Kw, Vw the
// warpgroup's keys (regions BC rows apart), Qs, dOs the tile's (regions BQ rows apart).
template <typename T, int D>
__device__ __forceinline__ void npf_fa_wgmma_dkdv_scores(float (&st)[NpfFaWgmmaDkdvTraits<D>::BQ / 2],
                                                         float (&dpt)[NpfFaWgmmaDkdvTraits<D>::BQ / 2],
                                                         const unsigned char* Kw, const unsigned char* Vw,
                                                         const unsigned char* Qs, const unsigned char* dOs) {
    typedef NpfFaWgmmaDkdvTraits<D> Tr;
    npf_wgmma_fence();
    npf_fa_wgmma_rows_dot<D, Tr::BQ, Tr::BC, Npf16<T>::BF16>(st, Kw, Qs);    // written whole by their first wgmmas
    npf_fa_wgmma_rows_dot<D, Tr::BQ, Tr::BC, Npf16<T>::BF16>(dpt, Vw, dOs);
    npf_wgmma_commit();
}

// P^T and dS^T / scale = P^T (dP^T - D) of query tile i0.. (MASKED: the causal mask; queries past Tq have
// -lse = -inf, so P 0): PACK, rounded into wgmma's A registers ap and as, 16 queries a step; else in place
// in st and dpt (while a wgmma reads ap and as). nl_s, d_s: the tile's -lse log2(e) and D, a thread's two
// queries read as one pair.
template <typename T, int D, bool CAUSAL, bool MASKED, bool PACK>
__device__ __forceinline__ void npf_fa_wgmma_dkdv_ds(float (&st)[NpfFaWgmmaDkdvTraits<D>::BQ / 2],
                                                     float (&dpt)[NpfFaWgmmaDkdvTraits<D>::BQ / 2],
                                                     const float* nl_s, const float* d_s, int i0, int kr,
                                                     const NpfFaArgs<float>& a, float c,
                                                     unsigned (&ap)[NpfFaWgmmaDkdvTraits<D>::BQ / 16][4],
                                                     unsigned (&as)[NpfFaWgmmaDkdvTraits<D>::BQ / 16][4]) {
    constexpr int BQ = NpfFaWgmmaDkdvTraits<D>::BQ;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int kb = 0; kb < BQ / 16; ++kb) {
        NpfF2 nl[2], dd[2];                                  // this thread's queries 16 kb + 8 h + 2 t, + 1
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            nl[h] = *reinterpret_cast<const NpfF2*>(nl_s + 16 * kb + 8 * h + 2 * t);
            dd[h] = *reinterpret_cast<const NpfF2*>(d_s + 16 * kb + 8 * h + 2 * t);
        }
        float p[8], ds[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int j = 8 * kb + e, col = 8 * (j / 4) + 2 * t + j % 2;
            float x = st[j];
            if (MASKED && CAUSAL && kr + g + 8 * (j % 4 / 2) > i0 + col + a.shift) x = -npf_fa_inf(0.0f);
            p[e] = exp2f(fmaf(x, c, e % 2 ? nl[e / 4].y : nl[e / 4].x));
            ds[e] = p[e] * (dpt[j] - (e % 2 ? dd[e / 4].y : dd[e / 4].x));
        }
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            if (PACK) {
                ap[kb][h] = npf_pack2<T>(p[2 * h], p[2 * h + 1]);
                as[kb][h] = npf_pack2<T>(ds[2 * h], ds[2 * h + 1]);
            } else {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    st[8 * kb + 2 * h + e] = p[2 * h + e];
                    dpt[8 * kb + 2 * h + e] = ds[2 * h + e];
                }
            }
        }
    }
}

// dV += P^T dO and dK += dS^T Q of a query tile, issued and committed (the caller waits): P^T and dS^T from
// the registers ap and as, dO's and Q's rows (dOs, Qs) N-major
template <typename T, int D>
__device__ __forceinline__ void npf_fa_wgmma_dkdv_add(float (&dk)[D / 2], float (&dv)[D / 2],
                                                      const unsigned (&ap)[NpfFaWgmmaDkdvTraits<D>::BQ / 16][4],
                                                      const unsigned (&as)[NpfFaWgmmaDkdvTraits<D>::BQ / 16][4],
                                                      const unsigned char* Qs, const unsigned char* dOs) {
    constexpr int BQ = NpfFaWgmmaDkdvTraits<D>::BQ;
    constexpr bool BF16 = Npf16<T>::BF16;
    npf_wgmma_fence();                                       // ap and as were written since the last wgmma
#pragma unroll
    for (int kb = 0; kb < BQ / 16; ++kb) {                   // dO's and Q's rows 16 kb ..
        NpfWgmma<D, BF16>::template rs<1>(dv, ap[kb], npf_wgmma_desc(dOs + kb * 16 * 128, BQ * 128, 1024), 1);
        NpfWgmma<D, BF16>::template rs<1>(dk, as[kb], npf_wgmma_desc(Qs + kb * 16 * 128, BQ * 128, 1024), 1);
    }
    npf_wgmma_commit();
}

// Waits for the dV and dK products in flight (the registers they read and write are the thread's again)
template <int D>
__device__ __forceinline__ void npf_fa_wgmma_dkdv_wait(float (&dk)[D / 2], float (&dv)[D / 2],
                                                       unsigned (&ap)[NpfFaWgmmaDkdvTraits<D>::BQ / 16][4],
                                                       unsigned (&as)[NpfFaWgmmaDkdvTraits<D>::BQ / 16][4]) {
    constexpr int BQ = NpfFaWgmmaDkdvTraits<D>::BQ;
    npf_wgmma_wait<0>();
    npf_wgmma_hold<D / 2>(dv);
    npf_wgmma_hold<D / 2>(dk);
    npf_wgmma_hold<BQ / 4>(&ap[0][0]);
    npf_wgmma_hold<BQ / 4>(&as[0][0]);
}

// Query tile i0.. of npf_fa_bwd_dkdv_wgmma: its S^T and dP^T issued, then (PIPELINED, unless FIRST) dV and
// dK's products of the tile before (its P^T and dS^T in ap and as, its Q and dO in Qp, dOp); P^T and dS^T
// worked out while those run, then into ap and as once they are done. Not PIPELINED: P^T and dS^T worked
// out once S^T and dP^T are done, then this tile's dV and dK products, awaited.
template <typename T, int D, bool CAUSAL, bool MASKED, bool FIRST>
__device__ __forceinline__ void npf_fa_wgmma_dkdv_tile(const unsigned char* Kw, const unsigned char* Vw,
                                                       const unsigned char* Qs, const unsigned char* dOs,
                                                       const unsigned char* Qp, const unsigned char* dOp,
                                                       const float* nl_s, const float* d_s, int i0, int kr,
                                                       const NpfFaArgs<float>& a, float c, float (&dk)[D / 2],
                                                       float (&dv)[D / 2],
                                                       unsigned (&ap)[NpfFaWgmmaDkdvTraits<D>::BQ / 16][4],
                                                       unsigned (&as)[NpfFaWgmmaDkdvTraits<D>::BQ / 16][4]) {
    typedef NpfFaWgmmaDkdvTraits<D> Tr;
    constexpr int BQ = Tr::BQ;
    float st[BQ / 2], dpt[BQ / 2];
    npf_fa_wgmma_dkdv_scores<T, D>(st, dpt, Kw, Vw, Qs, dOs);
    if (FIRST || !Tr::PIPELINED) {
        npf_wgmma_wait<0>();
    } else {
        npf_fa_wgmma_dkdv_add<T, D>(dk, dv, ap, as, Qp, dOp);
        npf_wgmma_wait<1>();                                 // S^T and dP^T are done; dV and dK may still run
    }
    npf_wgmma_hold<BQ / 2>(st);
    npf_wgmma_hold<BQ / 2>(dpt);
    npf_fa_wgmma_dkdv_ds<T, D, CAUSAL, MASKED, !Tr::PIPELINED>(st, dpt, nl_s, d_s, i0, kr, a, c, ap, as);
    if (Tr::PIPELINED) {
        npf_fa_wgmma_dkdv_wait<D>(dk, dv, ap, as);
        npf_fa_wgmma_pack<T, BQ>(st, ap);
        npf_fa_wgmma_pack<T, BQ>(dpt, as);
    } else {
        npf_fa_wgmma_dkdv_add<T, D>(dk, dv, ap, as, Qs, dOs);
        npf_fa_wgmma_dkdv_wait<D>(dk, dv, ap, as);
    }
}

// The shared-memory buffers of npf_fa_bwd_dkdv_wgmma's query tiles, by number: the current tile's Q and dO,
// the previous one's (PIPELINED: read by its dV and dK products) and the next one's (in flight), and two
// of -lse log2(e) and D. With two Q buffers (not PIPELINED) prev is the one next refills.
template <int D>
struct NpfFaDkdvBuffers {
    typedef NpfFaWgmmaDkdvTraits<D> Tr;
    unsigned char* qg;                                       // Q_BUFFERS x ((BQ, D) Q, (BQ, D) dO)
    float* ld;                                               // 2 x ((BQ) -lse log2(e), (BQ) D)
    int prev = Tr::Q_BUFFERS - 1, cur = 0, next = 1, stat = 0;
    __device__ __forceinline__ unsigned char* q(int n) const { return qg + n * 2 * Tr::Q_BYTES; }
    __device__ __forceinline__ unsigned char* dout(int n) const { return q(n) + Tr::Q_BYTES; }
    __device__ __forceinline__ float* nl(int s) const { return ld + s * 2 * Tr::BQ; }
    __device__ __forceinline__ float* d(int s) const { return nl(s) + Tr::BQ; }
    __device__ __forceinline__ void advance() {        // (prev, cur, next) <- (cur, next, prev), or (cur, next, cur)
        const int p = Tr::Q_BUFFERS == 3 ? prev : cur;
        prev = cur;
        cur = next;
        next = p;
        stat ^= 1;
    }
};

// dK, dV's copies at query tile qt of a head: Q and dO of tile qt + 1 issued into buffer b.next, its
// -lse log2(e) and D staged into the other stats buffer; then those of tile qt awaited and fenced for
// wgmma's reads, block-wide
template <typename T, int D>
__device__ __forceinline__ void npf_fa_wgmma_next_queries(
        int qt, int n_qt,
        const NpfFaSwizzledRows<T, NpfFaWgmmaDkdvTraits<D>::BQ, D, NpfFaWgmmaDkdvTraits<D>::THREADS>& qs,
        const NpfFaSwizzledRows<T, NpfFaWgmmaDkdvTraits<D>::BQ, D, NpfFaWgmmaDkdvTraits<D>::THREADS>& gs,
        const float* lse, const float* dvec, long long bh, const NpfFaArgs<float>& a,
        const NpfFaDkdvBuffers<D>& b) {
    typedef NpfFaWgmmaDkdvTraits<D> Tr;
    if (qt + 1 < n_qt) {
        const int i0 = (qt + 1) * Tr::BQ;
        qs.load(i0, b.q(b.next));
        gs.load(i0, b.dout(b.next));
        npf_fa_query_stats<Tr::BQ, Tr::THREADS, true>(lse, dvec, bh, i0, a, b.nl(b.stat ^ 1));
    }
    npf_fa_wgmma_landed();                                   // (and its lse and D, and K's and V's)
}

template <typename T, int D, bool CAUSAL>
__device__ void npf_fa_bwd_dkdv_wgmma(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                                      const float* dvec, T* dk, T* dv, const NpfFaArgs<float>& a, NpfFaLayout ql,
                                      NpfFaLayout kl, NpfFaLayout vl, NpfFaLayout gl, NpfFaLayout dkl,
                                      NpfFaLayout dvl) {
    typedef NpfFaWgmmaDkdvTraits<D> Tr;
    constexpr int BC = Tr::BC, BQ = Tr::BQ, THREADS = Tr::THREADS;
    NPF_FA_SHARED(smem, Tr::SHARED);
    unsigned char* Ks = npf_align_1024(smem);               // (BC, D) K, (BC, D) V, Q_BUFFERS x ((BQ, D) Q, dO)
    unsigned char* Vs = Ks + Tr::K_BYTES;
    unsigned char* QGs = Vs + Tr::K_BYTES;
    float* LDs = reinterpret_cast<float*>(QGs + Tr::Q_BUFFERS * 2 * Tr::Q_BYTES);   // 2 x ((BQ) -lse log2(e), (BQ) D)
    const int wg = threadIdx.x / 128, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int j0 = blockIdx.x * BC, kr = j0 + 64 * wg + 16 * (threadIdx.x % 128 / 32);   // this warp's first key
    const unsigned char* Kw = Ks + 64 * wg * 128;
    const unsigned char* Vw = Vs + 64 * wg * 128;
    const int n_qt = (a.Tq + BQ - 1) / BQ;
    const int qt0 = npf_fa_first_query_tile<BQ>(j0, n_qt, CAUSAL, a);
    const int unmasked_from = npf_fa_unmasked_query_tile<BC, BQ>(j0, qt0, n_qt, CAUSAL, a);
    const float c = a.scale * 1.4426950408889634f;
    for (long long bh = blockIdx.y; bh < a.bh_count; bh += gridDim.y) {
        __syncthreads();                                     // the previous head's readers are done
        const NpfFaSwizzledRows<T, BQ, D, THREADS> qs(q + npf_fa_head(ql, bh, a.H), a.Tq, a.hs, ql.st);
        const NpfFaSwizzledRows<T, BQ, D, THREADS> gs(dout + npf_fa_head(gl, bh, a.H), a.Tq, a.hv, gl.st);
        NpfFaDkdvBuffers<D> b{QGs, LDs};
        // K, V and the first query tile's copies; keys that no query sees copy nothing (none left in flight)
        if (qt0 < n_qt) {
            NpfFaSwizzledRows<T, BC, D, THREADS>(k + npf_fa_head(kl, bh, a.H), a.Tk, a.hs, kl.st).load(j0, Ks);
            NpfFaSwizzledRows<T, BC, D, THREADS>(v + npf_fa_head(vl, bh, a.H), a.Tk, a.hv, vl.st).load(j0, Vs);
            qs.load(qt0 * BQ, b.q(b.cur));
            gs.load(qt0 * BQ, b.dout(b.cur));
            npf_fa_query_stats<BQ, THREADS, true>(lse, dvec, bh, qt0 * BQ, a, b.nl(b.stat));
            npf_cp_async_commit();
        }
        float dka[D / 2], dva[D / 2];
        unsigned ap[BQ / 16][4], as[BQ / 16][4];             // the last tile's P^T and dS^T / scale (A registers)
#pragma unroll
        for (int j = 0; j < D / 2; ++j) dka[j] = dva[j] = 0.0f;
        int qt = qt0;
        // PIPELINED: the first tile's S^T, dP^T, P^T and dS^T (its dV and dK products go with the next tile's)
        if (Tr::PIPELINED && qt < n_qt) {
            npf_fa_wgmma_next_queries<T, D>(qt, n_qt, qs, gs, lse, dvec, bh, a, b);
            if (qt < unmasked_from)
                npf_fa_wgmma_dkdv_tile<T, D, CAUSAL, true, true>(Kw, Vw, b.q(b.cur), b.dout(b.cur), nullptr, nullptr,
                                                                 b.nl(b.stat), b.d(b.stat), qt * BQ, kr, a, c, dka,
                                                                 dva, ap, as);
            else
                npf_fa_wgmma_dkdv_tile<T, D, CAUSAL, false, true>(Kw, Vw, b.q(b.cur), b.dout(b.cur), nullptr,
                                                                  nullptr, b.nl(b.stat), b.d(b.stat), qt * BQ, kr, a,
                                                                  c, dka, dva, ap, as);
            __syncthreads();                                 // done with these buffers before they are refilled
            b.advance();
            ++qt;
        }
        for (; qt < unmasked_from; ++qt) {                   // the tiles across the diagonal
            npf_fa_wgmma_next_queries<T, D>(qt, n_qt, qs, gs, lse, dvec, bh, a, b);
            npf_fa_wgmma_dkdv_tile<T, D, CAUSAL, true, false>(Kw, Vw, b.q(b.cur), b.dout(b.cur), b.q(b.prev),
                                                              b.dout(b.prev), b.nl(b.stat), b.d(b.stat), qt * BQ,
                                                              kr, a, c, dka, dva, ap, as);
            __syncthreads();
            b.advance();
        }
        for (; qt < n_qt; ++qt) {                            // the main loop: no masks
            npf_fa_wgmma_next_queries<T, D>(qt, n_qt, qs, gs, lse, dvec, bh, a, b);
            npf_fa_wgmma_dkdv_tile<T, D, CAUSAL, false, false>(Kw, Vw, b.q(b.cur), b.dout(b.cur), b.q(b.prev),
                                                               b.dout(b.prev), b.nl(b.stat), b.d(b.stat), qt * BQ,
                                                               kr, a, c, dka, dva, ap, as);
            __syncthreads();
            b.advance();
        }
        if (Tr::PIPELINED && qt0 < n_qt) {                   // the last tile's dV and dK products
            npf_fa_wgmma_dkdv_add<T, D>(dka, dva, ap, as, b.q(b.prev), b.dout(b.prev));
            npf_fa_wgmma_dkdv_wait<D>(dka, dva, ap, as);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int j = kr + g + 8 * r;
            if (j >= a.Tk) continue;
            T* dk_row = dk + npf_fa_head(dkl, bh, a.H) + j * dkl.st;
            T* dv_row = dv + npf_fa_head(dvl, bh, a.H) + j * dvl.st;
#pragma unroll
            for (int i = 0; i < D / 8; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int d = 8 * i + 2 * t + e;
                    if (d < a.hs) npf_store(dk_row + d, dka[4 * i + 2 * r + e] * a.scale);
                    if (d < a.hv) npf_store(dv_row + d, dva[4 * i + 2 * r + e]);
                }
        }
    }
}

// ---- the kernels: one __global__ template over kernel traits, as FlashAttention-2's Flash_fwd_kernel_traits ----
// A traits type K is one instantiation: its storage and arithmetic types (T, A), its block (THREADS) and
// __launch_bounds__'s MIN_BLOCKS (blocks an SM: the compiler keeps each thread to 65536 / (THREADS
// MIN_BLOCKS) registers), the rows a block takes on the grid's x axis (ROWS: queries; keys for dK, dV), its
// dynamic shared memory (SHARED, bytes), and run(p). flash_attention.py launches npf_fa_kernel<K>, named
// by flash_source.name_expression (e.g. npf_fa_kernel<NpfFaFwdTc<unsigned short, 64>>) through CuPy's
// RawModule(name_expressions=...); its copies of ROWS and SHARED (flash_source.GEOMETRY) are checked
// against these by tests/kernels/cuda/test_flash_attention.py. MIN_BLOCKS: what the registers allow at the
// occupancy benchmarks/cuda_kernels.py measured on sm_90 (registers a thread, occupancy), beside each.
// run takes the parameters by value and NpfFaArgs as a local copy: given the kernel parameter by reference,
// NVVM read the struct through a register-held address and kept its fields in registers for the whole kernel
// (the SIMT dQ at D 128 spilled, bwd_pre took 50-84 registers).
template <typename K>
__global__ void __launch_bounds__(K::THREADS, K::MIN_BLOCKS)
npf_fa_kernel(const NpfFaParams<typename K::T, typename K::A> p) {
    K::run(p);
}

// The arithmetic type of a storage type: float for float16 (unsigned short), bfloat16 (npf_bf16) and float32,
// double for float64
template <typename T> struct NpfFaAcc { typedef float A; };
template <> struct NpfFaAcc<double> { typedef double A; };

// The SIMT kernels' tiles (BR queries x BC keys): 64 x 64 in float up to D = 64; 32 x 32 at D = 128
// (registers: a thread holds 2 rows x 16 columns of each accumulator) and in double (so that every
// kernel's shared memory stays under an A100's 163 KiB)
template <typename T_, int D_> struct NpfFaSimt {
    typedef T_ T;
    typedef typename NpfFaAcc<T_>::A A;
    static constexpr int D = D_, THREADS = NPF_FA_THREADS, BR = sizeof(A) == 4 && D <= 64 ? 64 : 32, BC = BR;
    typedef NpfFaShape<A, D, BR, BC> S;
};

// SIMT forward. MIN_BLOCKS (sm_90, registers and occupancy), float: 3 at D 32, 64 (156-168, 18.75%), 4 at
// D 128 (128, 25%); double: 4 at D 32 (126, 25%), 3 at D 64 (167, 18.75%), 2 at D 128 (196, 12.5%)
template <typename T_, int D_> struct NpfFaFwd : NpfFaSimt<T_, D_> {
    typedef NpfFaSimt<T_, D_> B;
    static constexpr int ROWS = B::BR, SHARED = B::S::FWD * (int)sizeof(typename B::A);
    static constexpr int MIN_BLOCKS = sizeof(typename B::A) == 4 ? (D_ <= 64 ? 3 : 4)
                                                                  : (D_ <= 32 ? 4 : D_ <= 64 ? 3 : 2);
    static __device__ __forceinline__ void run(const NpfFaParams<T_, typename B::A> p) {
        const NpfFaArgs<typename B::A> a = p.a;
        npf_fa_forward<T_, typename B::A, D_, B::BR, B::BC>(p.q, p.k, p.v, p.out, p.lse, a, p.ql, p.kl, p.vl, p.ol);
    }
};

// SIMT dQ. MIN_BLOCKS, float: 2 at D 32, 64 (168-254 registers, 12.5-18.75%), 3 at D 128 (168, 18.75%);
// double: 3 at D 32 (155, 18.75%), 2 at D 64 (168; shared memory: 12.5%), 1 at D 128 (247; shared memory
// holds it to one block)
template <typename T_, int D_> struct NpfFaDq : NpfFaSimt<T_, D_> {
    typedef NpfFaSimt<T_, D_> B;
    static constexpr int ROWS = B::BR, SHARED = B::S::DQ * (int)sizeof(typename B::A);
    static constexpr int MIN_BLOCKS = sizeof(typename B::A) == 4 ? (D_ <= 64 ? 2 : 3)
                                                                  : (D_ <= 32 ? 3 : D_ <= 64 ? 2 : 1);
    static __device__ __forceinline__ void run(const NpfFaParams<T_, typename B::A> p) {
        const NpfFaArgs<typename B::A> a = p.a;
        npf_fa_bwd_dq<T_, typename B::A, D_, B::BR, B::BC>(p.q, p.k, p.v, p.dout, p.lse, p.dvec, p.dq, a, p.ql, p.kl,
                                                           p.vl, p.gl, p.dql);
    }
};

// SIMT dK, dV. MIN_BLOCKS, float: 3 at D 32 (156 registers, 18.75%), 2 at D 64 (254, 12.5%) and D 128 (160;
// shared memory: 12.5%); double: 3 at D 32 (162, 18.75%), 2 at D 64 (181, 12.5%), 1 at D 128 (245)
template <typename T_, int D_> struct NpfFaDkdv : NpfFaSimt<T_, D_> {
    typedef NpfFaSimt<T_, D_> B;
    static constexpr int ROWS = B::BC, SHARED = B::S::DKDV * (int)sizeof(typename B::A);
    static constexpr int MIN_BLOCKS = sizeof(typename B::A) == 4 ? (D_ <= 32 ? 3 : 2)
                                                                  : (D_ <= 32 ? 3 : D_ <= 64 ? 2 : 1);
    static __device__ __forceinline__ void run(const NpfFaParams<T_, typename B::A> p) {
        const NpfFaArgs<typename B::A> a = p.a;
        npf_fa_bwd_dkdv<T_, typename B::A, D_, B::BR, B::BC>(p.q, p.k, p.v, p.dout, p.lse, p.dvec, p.dk, p.dv, p.a,
                                                             p.ql, p.kl, p.vl, p.gl, p.dkl, p.dvl);
    }
};

// D = rowsum(dO O), a warp a row: 256 threads (8 rows) a block. MIN_BLOCKS 6: 38-40 registers, 75% (8, all
// 64 warps, spilled float32 and float64; without a bound it took 50-84 registers, 25-50%)
template <typename T_> struct NpfFaPre {
    typedef T_ T;
    typedef typename NpfFaAcc<T_>::A A;
    static constexpr int THREADS = 256, MIN_BLOCKS = 6, ROWS = THREADS / 32, SHARED = 0;
    static __device__ __forceinline__ void run(const NpfFaParams<T_, A> p) {
        const NpfFaArgs<A> a = p.a;
        npf_fa_bwd_pre<T_, A>(p.dout, p.out, p.dvec, a.bh_count * a.Tq, a.hv, a.Tq, a.H, p.gl, p.ol);
    }
};

// The tensor-core kernels (sm_80 and later): float16 and bfloat16 on NpfHalfOps<T> (m16n8k16), float32 on
// NpfTf32Ops (TF32
// m16n8k8, under the opt-in). A block takes 64 rows (NpfFaTcWarp); BC keys a tile (dQ; the forward's is its
// own): 32, 16 for TF32 at D 128 (float32 tiles take twice the bytes); BQ query rows a tile (dK, dV): 32, 16
// at D 128 (its dK and dV accumulators take D registers a lane).
template <typename T> struct NpfFaTcOps { typedef NpfHalfOps<T> Ops; };      // float16, bfloat16
template <> struct NpfFaTcOps<float> { typedef NpfTf32Ops Ops; };
template <typename T_, int D_> struct NpfFaTc {
    typedef T_ T;
    typedef float A;
    typedef typename NpfFaTcOps<T_>::Ops Ops;
    static constexpr bool HALF = sizeof(T_) == 2;
    static constexpr int D = D_, THREADS = NPF_FA_THREADS, ROWS = NPF_FA_TC_BR, BC = !HALF && D_ == 128 ? 16 : 32,
                         BQ = D_ == 128 ? 16 : 32;
};

// Forward on tensor cores, BC keys a tile: 16 at D 128 (with 32, the kernel spilled at 128 registers once its
// parameters came in one struct; 16: 127 registers, 36.6 instructions per HMMA on sm_90 against 49.2 before).
// MIN_BLOCKS: float16 4 (120-128 registers, 25% at every D on sm_90); TF32 3 (122-145, 18.75-25%)
template <typename T_, int D_> struct NpfFaFwdTc : NpfFaTc<T_, D_> {
    typedef NpfFaTc<T_, D_> B;
    static constexpr int BC = D_ == 128 ? 16 : B::BC;
    static constexpr int SHARED = NpfFaTcWarp<typename B::Ops, D_, BC>::SHARED_FWD, MIN_BLOCKS = B::HALF ? 4 : 3;
    static __device__ __forceinline__ void run(const NpfFaParams<T_, float> p) {
        const NpfFaArgs<float> a = p.a;
        npf_fa_forward_tc<typename B::Ops, D_, BC>(p.q, p.k, p.v, p.out, p.lse, a, p.ql, p.kl, p.vl, p.ol);
    }
};

// dQ on tensor cores. K and V in 2 buffers (the next tile's copies overlap this one's work); 1 for float16
// at D 128, where a second would hold sm_80 to 2 blocks an SM by shared memory, below the registers' 3.
// MIN_BLOCKS, float16: 4 at D 32, 64 (115-128 registers, 25%), 3 at D 128 (163, 18.75%); TF32: 3 at D 32, 64
// (141-154, 18.75%), 2 at D 128 (162; shared memory: 12.5%)
template <typename T_, int D_> struct NpfFaDqTc : NpfFaTc<T_, D_> {
    typedef NpfFaTc<T_, D_> B;
    static constexpr int BUFFERS = B::HALF && D_ == 128 ? 1 : 2;
    static constexpr int SHARED = NpfFaTcWarp<typename B::Ops, D_, B::BC, BUFFERS>::SHARED_DQ,
                         MIN_BLOCKS = B::HALF ? (D_ <= 64 ? 4 : 3) : (D_ <= 64 ? 3 : 2);
    static __device__ __forceinline__ void run(const NpfFaParams<T_, float> p) {
        const NpfFaArgs<float> a = p.a;
        npf_fa_bwd_dq_tc<typename B::Ops, D_, B::BC, BUFFERS>(p.q, p.k, p.v, p.dout, p.lse, p.dvec, p.dq, a, p.ql,
                                                              p.kl, p.vl, p.gl, p.dql);
    }
};

// dK, dV on tensor cores. MIN_BLOCKS, float16: 4 at D 32 (127 registers, 25%), 3 at D 64 (165, 18.75%), 2 at
// D 128 (210: the accumulators alone take 128 a lane; 12.5%); TF32: 4 at D 32 (128, 25%: with 3, sm_80 took
// 133-136 registers, 18.75%), 3 at D 64 (162, 18.75%), 2 at D 128 (204, 12.5%)
template <typename T_, int D_> struct NpfFaDkdvTc : NpfFaTc<T_, D_> {
    typedef NpfFaTc<T_, D_> B;
    static constexpr int SHARED = NpfFaTcWarp<typename B::Ops, D_, B::BQ>::SHARED_DKDV,
                         MIN_BLOCKS = D_ == 128 ? 2 : D_ == 32 ? 4 : 3;
    static __device__ __forceinline__ void run(const NpfFaParams<T_, float> p) {
        const NpfFaArgs<float> a = p.a;
        npf_fa_bwd_dkdv_tc<typename B::Ops, D_, B::BQ>(p.q, p.k, p.v, p.dout, p.lse, p.dvec, p.dk, p.dv, a, p.ql,
                                                       p.kl, p.vl, p.gl, p.dkl, p.dvl);
    }
};

// The dense kernels (float16, bfloat16; no mask, padding or dropout; CAUSAL or not): their traits are above
// (NpfFaDenseTraits, NpfFaDenseDqTraits, NpfFaDenseDkdvTraits), with the measured reasons.
template <typename T_, int D_, bool CAUSAL> struct NpfFaFwdDense : NpfFaDenseTraits<D_> {
    typedef T_ T;
    typedef float A;
    static constexpr int ROWS = NpfFaDenseTraits<D_>::BR;
    static __device__ __forceinline__ void run(const NpfFaParams<T, A> p) {
        const NpfFaArgs<A> a = p.a;
        npf_fa_forward_dense<T_, D_, CAUSAL>(p.q, p.k, p.v, p.out, p.lse, a, p.ql, p.kl, p.vl, p.ol);
    }
};
// float32's dense kernels are SIMT (no tensor cores without the TF32 opt-in): NpfFaSimtDense*Traits above
template <int D_, bool CAUSAL> struct NpfFaFwdDense<float, D_, CAUSAL> : NpfFaSimtDenseFwdTraits<D_> {
    typedef float T;
    typedef float A;
    static constexpr int ROWS = NpfFaSimtDenseTraits<D_>::BR;
    static __device__ __forceinline__ void run(const NpfFaParams<T, A> p) {
        const NpfFaArgs<A> a = p.a;
        npf_fa_forward_simt_dense<D_, CAUSAL>(p.q, p.k, p.v, p.out, p.lse, a, p.ql, p.kl, p.vl, p.ol);
    }
};
// The Hopper kernels (sm_90a, modules of their own): the forward, dQ, dK and dV, float16 and bfloat16 at D 64
// and 128, dense, causal or not; traits above (NpfFaWgmmaTraits, NpfFaWgmmaDqTraits, NpfFaWgmmaDkdvTraits).
template <typename T_, int D_, bool CAUSAL> struct NpfFaFwdWgmma : NpfFaWgmmaTraits<D_> {
    typedef T_ T;
    typedef float A;
    static constexpr int ROWS = NpfFaWgmmaTraits<D_>::BR;
    static __device__ __forceinline__ void run(const NpfFaParams<T, A> p) {
        const NpfFaArgs<A> a = p.a;
        npf_fa_forward_wgmma<T_, D_, CAUSAL>(p.q, p.k, p.v, p.out, p.lse, a, p.ql, p.kl, p.vl, p.ol);
    }
};
template <typename T_, int D_, bool CAUSAL> struct NpfFaDqWgmma : NpfFaWgmmaDqTraits<D_> {
    typedef T_ T;
    typedef float A;
    static constexpr int ROWS = NpfFaWgmmaDqTraits<D_>::BR;
    static __device__ __forceinline__ void run(const NpfFaParams<T, A> p) {
        const NpfFaArgs<A> a = p.a;
        npf_fa_bwd_dq_wgmma<T_, D_, CAUSAL>(p.q, p.k, p.v, p.dout, p.lse, p.dvec, p.dq, a, p.ql, p.kl, p.vl, p.gl,
                                            p.dql);
    }
};
template <typename T_, int D_, bool CAUSAL> struct NpfFaDkdvWgmma : NpfFaWgmmaDkdvTraits<D_> {
    typedef T_ T;
    typedef float A;
    static constexpr int ROWS = NpfFaWgmmaDkdvTraits<D_>::BC;
    static __device__ __forceinline__ void run(const NpfFaParams<T, A> p) {
        const NpfFaArgs<A> a = p.a;
        npf_fa_bwd_dkdv_wgmma<T_, D_, CAUSAL>(p.q, p.k, p.v, p.dout, p.lse, p.dvec, p.dk, p.dv, a, p.ql, p.kl, p.vl,
                                              p.gl, p.dkl, p.dvl);
    }
};
template <typename T_, int D_, bool CAUSAL> struct NpfFaDqDense : NpfFaDenseDqTraits<D_> {
    typedef T_ T;
    typedef float A;
    static constexpr int ROWS = NpfFaDenseDqTraits<D_>::BR;
    static __device__ __forceinline__ void run(const NpfFaParams<T, A> p) {
        const NpfFaArgs<A> a = p.a;
        npf_fa_bwd_dq_dense<T_, D_, CAUSAL>(p.q, p.k, p.v, p.dout, p.lse, p.dvec, p.dq, a, p.ql, p.kl, p.vl, p.gl,
                                            p.dql);
    }
};
template <typename T_, int D_, bool CAUSAL> struct NpfFaDkdvDense : NpfFaDenseDkdvTraits<D_> {
    typedef T_ T;
    typedef float A;
    static constexpr int ROWS = NpfFaDenseDkdvTraits<D_>::BC;
    static __device__ __forceinline__ void run(const NpfFaParams<T, A> p) {
        const NpfFaArgs<A> a = p.a;
        npf_fa_bwd_dkdv_dense<T_, D_, CAUSAL>(p.q, p.k, p.v, p.dout, p.lse, p.dvec, p.dk, p.dv, a, p.ql, p.kl, p.vl,
                                              p.gl, p.dkl, p.dvl);
    }
};
template <int D_, bool CAUSAL> struct NpfFaDqDense<float, D_, CAUSAL> : NpfFaSimtDenseDqTraits<D_> {
    typedef float T;
    typedef float A;
    static constexpr int ROWS = NpfFaSimtDenseTraits<D_>::BR;
    static __device__ __forceinline__ void run(const NpfFaParams<T, A> p) {
        const NpfFaArgs<A> a = p.a;
        npf_fa_bwd_dq_simt_dense<D_, CAUSAL>(p.q, p.k, p.v, p.dout, p.lse, p.dvec, p.dq, a, p.ql, p.kl, p.vl, p.gl,
                                             p.dql);
    }
};
template <int D_, bool CAUSAL> struct NpfFaDkdvDense<float, D_, CAUSAL> : NpfFaSimtDenseDkdvTraits<D_> {
    typedef float T;
    typedef float A;
    static constexpr int ROWS = NpfFaSimtDenseTraits<D_>::BC;
    static __device__ __forceinline__ void run(const NpfFaParams<T, A> p) {
        const NpfFaArgs<A> a = p.a;
        npf_fa_bwd_dkdv_simt_dense<D_, CAUSAL>(p.q, p.k, p.v, p.dout, p.lse, p.dvec, p.dk, p.dv, a, p.ql, p.kl, p.vl,
                                               p.gl, p.dkl, p.dvl);
    }
};

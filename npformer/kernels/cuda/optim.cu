// The optimisers' kernels (npformer/kernels/cuda/optim_source.py).
// Adam / AdamW over `total` contiguous elements (npformer.ops.optim.adam_update), in place:
//   g = grad gscale                               (scaled_grad: grad of type G, a float or mixed precision's
//                                                  16-bit gradient; gscale 1 / S times the clipping factor)
//   l2:        g = p wd + g                       (Adam's weight decay, in the gradient)
//   decoupled: p = p decay,  decay = 1 - lr wd    (AdamW's, on the parameter, first)
//   m = m b1 + (1 - b1) g;   v = v b2 + (1 - b2) (g g)
//   p = p - (m / (sqrt(v) / bc2 + eps)) step_size,   bc2 = sqrt(1 - b2^t),  step_size = lr / (1 - b1^t)
//   copy (has_copy): the new p rounded to C, float16 (unsigned short) or bfloat16 (npf_bf16): mixed
//   precision's model weights (npf_adam_update_f32 writes a float16 copy, npf_adam_bf16_copy_update_f32
//   a bfloat16 one; npf_adam_f16_grad_update_f32 and npf_adam_bf16_grad_update_f32 read that 16-bit
//   type's gradients too)
template <typename T, typename G, typename C>
__device__ void npf_adam_update(T* p, const G* g, T* m, T* v, C* copy, long long total, T gscale,
                                T b1, T c1, T b2, T c2, T wd, T decay, T bc2, T eps, T step_size,
                                int l2, int decoupled, int has_copy) {
    NPF_FOR_EACH(k, total) {
        T pk = p[k];
        T gk = (T)npf_load(g[k]);
        gk = gk * gscale;                    // exact for gscale 1
        if (l2) {
            T w = pk * wd;
            gk = w + gk;
        }
        if (decoupled) pk = pk * decay;
        T mk = m[k] * b1;
        T mg = gk * c1;
        mk = mk + mg;
        T vk = v[k] * b2;
        T gg = gk * gk;
        gg = gg * c2;
        vk = vk + gg;
        T d = npf_sqrt(vk);
        d = d / bc2;
        d = d + eps;
        T u = mk / d;
        u = u * step_size;
        pk = pk - u;
        p[k] = pk;
        m[k] = mk;
        v[k] = vk;
        if (has_copy) npf_store(copy + k, (float)pk);
    }
}

// Partial sums of squares in double (npformer.ops.optim.sum_of_squares): block b adds x^2 over its
// grid-stride share of the `total` elements and writes part[b]; the host adds the gridDim.x partials.
// blockDim.x is a power of two <= NPF_MAX_THREADS.
template <typename T>
__device__ void npf_sum_squares(const T* x, double* part, long long total, double* buf) {
    double s = 0.0;
    NPF_FOR_EACH(k, total) {
        double a = (double)npf_load(x[k]);
        s += a * a;
    }
    s = npf_block_sum(s, buf);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

extern "C" __global__ void npf_adam_update_f32(float* p, const float* g, float* m, float* v,
        unsigned short* copy, long long total, float gscale, float b1, float c1, float b2, float c2, float wd, float decay,
        float bc2, float eps, float step_size, int l2, int decoupled, int has_copy) {
    npf_adam_update<float, float, unsigned short>(p, g, m, v, copy, total, gscale, b1, c1, b2, c2, wd, decay, bc2,
        eps, step_size, l2, decoupled, has_copy);
}
extern "C" __global__ void npf_adam_bf16_copy_update_f32(float* p, const float* g, float* m, float* v,
        npf_bf16* copy, long long total, float gscale, float b1, float c1, float b2, float c2, float wd, float decay,
        float bc2, float eps, float step_size, int l2, int decoupled, int has_copy) {
    npf_adam_update<float, float, npf_bf16>(p, g, m, v, copy, total, gscale, b1, c1, b2, c2, wd, decay, bc2,
        eps, step_size, l2, decoupled, has_copy);
}
extern "C" __global__ void npf_adam_f16_grad_update_f32(float* p, const unsigned short* g, float* m, float* v,
        unsigned short* copy, long long total, float gscale, float b1, float c1, float b2, float c2, float wd, float decay,
        float bc2, float eps, float step_size, int l2, int decoupled, int has_copy) {
    npf_adam_update<float, unsigned short, unsigned short>(p, g, m, v, copy, total, gscale, b1, c1, b2, c2, wd, decay, bc2,
        eps, step_size, l2, decoupled, has_copy);
}
extern "C" __global__ void npf_adam_bf16_grad_update_f32(float* p, const npf_bf16* g, float* m, float* v,
        npf_bf16* copy, long long total, float gscale, float b1, float c1, float b2, float c2, float wd, float decay,
        float bc2, float eps, float step_size, int l2, int decoupled, int has_copy) {
    npf_adam_update<float, npf_bf16, npf_bf16>(p, g, m, v, copy, total, gscale, b1, c1, b2, c2, wd, decay, bc2,
        eps, step_size, l2, decoupled, has_copy);
}
extern "C" __global__ void npf_adam_update_f64(double* p, const double* g, double* m, double* v,
        unsigned short* copy, long long total, double gscale, double b1, double c1, double b2, double c2, double wd, double decay,
        double bc2, double eps, double step_size, int l2, int decoupled, int has_copy) {
    npf_adam_update<double, double, unsigned short>(p, g, m, v, copy, total, gscale, b1, c1, b2, c2, wd, decay, bc2,
        eps, step_size, l2, decoupled, has_copy);
}
extern "C" __global__ void npf_sum_squares_f16(const unsigned short* x, double* part, long long total) {
    __shared__ double buf[NPF_MAX_THREADS];
    npf_sum_squares<unsigned short>(x, part, total, buf);
}
extern "C" __global__ void npf_sum_squares_bf16(const npf_bf16* x, double* part, long long total) {
    __shared__ double buf[NPF_MAX_THREADS];
    npf_sum_squares<npf_bf16>(x, part, total, buf);
}
extern "C" __global__ void npf_sum_squares_f32(const float* x, double* part, long long total) {
    __shared__ double buf[NPF_MAX_THREADS];
    npf_sum_squares<float>(x, part, total, buf);
}
extern "C" __global__ void npf_sum_squares_f64(const double* x, double* part, long long total) {
    __shared__ double buf[NPF_MAX_THREADS];
    npf_sum_squares<double>(x, part, total, buf);
}

// Flash attention's test kernels (tests/kernels/cuda/sources.py puts them after flash.cu): never in a
// shipped module.

// Kernel traits K as the host launches npf_fa_kernel<K>: its block, the rows a block takes, its shared
// memory (flash_source.geometry's copies of them)
template <typename K> __global__ void npf_fa_geometry(long long* out) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    out[0] = K::THREADS;
    out[1] = K::ROWS;
    out[2] = K::SHARED;
}

// _keep (unscaled) for flat indices n = ((bh Tq) + i) Tk + j of a (bh_count, Tq, Tk) block, the seed
// made of its two draws
extern "C" __global__ void npf_fa_keep_mask(const double* draws, int keep_min, bool* keep, long long total) {
    NPF_FOR_EACH(n, total) keep[n] = npf_keep(npf_seed(draws), (unsigned long long)n, keep_min);
}

// Where each field of NpfFaParams<T, A> is (bytes from its start), in the order of flash_source.params_dtype's
// fields with NpfFaArgs's (a.*) in theirs, then sizeof(NpfFaParams<T, A>): the layout that dtype must have
#define NPF_FA_AT(field) (long long)((const char*)&p.field - (const char*)&p)
template <typename T, typename A> __device__ void npf_fa_params_layout(long long* out) {
    NpfFaParams<T, A> p;
    const long long at[] = {
        NPF_FA_AT(q), NPF_FA_AT(k), NPF_FA_AT(v), NPF_FA_AT(out), NPF_FA_AT(dout), NPF_FA_AT(dq), NPF_FA_AT(dk),
        NPF_FA_AT(dv), NPF_FA_AT(lse), NPF_FA_AT(dvec), NPF_FA_AT(ql), NPF_FA_AT(kl), NPF_FA_AT(vl), NPF_FA_AT(ol),
        NPF_FA_AT(gl), NPF_FA_AT(dql), NPF_FA_AT(dkl), NPF_FA_AT(dvl),
        NPF_FA_AT(a.mask_b), NPF_FA_AT(a.mask_bits), NPF_FA_AT(a.mask_f), NPF_FA_AT(a.mask_bh), NPF_FA_AT(a.mask_ld),
        NPF_FA_AT(a.mask_kind), NPF_FA_AT(a.pad_b), NPF_FA_AT(a.pad_bits), NPF_FA_AT(a.pad_f), NPF_FA_AT(a.key_end),
        NPF_FA_AT(a.pad_ld), NPF_FA_AT(a.pad_kind), NPF_FA_AT(a.seed_draws), NPF_FA_AT(a.keep_min),
        NPF_FA_AT(a.keep_scale), NPF_FA_AT(a.bh_count), NPF_FA_AT(a.H), NPF_FA_AT(a.Tq), NPF_FA_AT(a.Tk), NPF_FA_AT(a.hs), NPF_FA_AT(a.hv),
        NPF_FA_AT(a.scale), NPF_FA_AT(a.causal), NPF_FA_AT(a.shift), (long long)sizeof(p)};
    if (threadIdx.x == 0 && blockIdx.x == 0)
        for (int i = 0; i < (int)(sizeof(at) / sizeof(at[0])); ++i) out[i] = at[i];
}
extern "C" __global__ void npf_fa_params_layout_f32(long long* out) { npf_fa_params_layout<float, float>(out); }
extern "C" __global__ void npf_fa_params_layout_f64(long long* out) { npf_fa_params_layout<double, double>(out); }

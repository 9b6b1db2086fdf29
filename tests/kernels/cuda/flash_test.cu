// Flash attention's test kernels (tests/kernels/cuda/sources.py puts them after flash.cu): never in a
// shipped module.

// _keep (unscaled) for flat indices n = ((bh Tq) + i) Tk + j of a (bh_count, Tq, Tk) block
extern "C" __global__ void npf_fa_keep_mask(const unsigned long long* seed, int keep_min, bool* keep, long long total) {
    NPF_FOR_EACH(n, total) keep[n] = npf_fa_keep(*seed, (unsigned long long)n, keep_min);
}

// AdamW and the global gradient norm's chunk sums on the device, bit-identical to the CPU
// optimizer in mamba-train/src/optim/{adamw.rs,clip.rs}.
//
// Bit-identity holds because both sides evaluate the same IEEE operations in
// the same order: every operation here is spelled with an explicit
// round-to-nearest intrinsic (__fmul_rn, __fadd_rn, __fdiv_rn, __fsqrt_rn,
// __dmul_rn, __dadd_rn), which the compiler can neither contract into an FMA
// nor reassociate, and the CPU code is plain Rust arithmetic (never
// contracted). The per-step constants (bias corrections, decay factor) are
// computed once on the host exactly as the CPU optimizer computes them.

#include "mamba_common.cuh"

// One element per thread (grid-stride). Element i is decayed when it lies in
// one of the `nranges` half-open ranges [starts[r], ends[r]) (ascending,
// disjoint; the ParamKind::Matrix tensors), found by binary search.
//   gi = g * scale
//   m  = b1 * m + omb1 * gi
//   v  = b2 * v + (omb2 * gi) * gi
//   p  = p * decay_factor                (decayed elements only)
//   p  = p - step_size * (m / (sqrt(v) / bc2_sqrt + eps))
extern "C" __global__ void mamba_adamw(float* __restrict__ p, const float* __restrict__ g,
                                       float* __restrict__ m, float* __restrict__ v,
                                       unsigned long long n,
                                       const unsigned long long* __restrict__ starts,
                                       const unsigned long long* __restrict__ ends,
                                       int nranges, float b1, float b2, float omb1, float omb2,
                                       float eps, float decay_factor, float step_size,
                                       float bc2_sqrt, float scale) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        // First range whose end is above i.
        int lo = 0, hi = nranges;
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (ends[mid] <= i) lo = mid + 1;
            else hi = mid;
        }
        const bool decay = lo < nranges && starts[lo] <= i;
        const float gi = __fmul_rn(g[i], scale);
        const float mi = __fadd_rn(__fmul_rn(b1, m[i]), __fmul_rn(omb1, gi));
        const float vi = __fadd_rn(__fmul_rn(b2, v[i]), __fmul_rn(__fmul_rn(omb2, gi), gi));
        m[i] = mi;
        v[i] = vi;
        float pi = p[i];
        if (decay) pi = __fmul_rn(pi, decay_factor);
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
        p[i] = __fsub_rn(pi, __fmul_rn(step_size, __fdiv_rn(mi, denom)));
    }
}

// The global norm's chunk sums: partial[c] = sum over chunk c (elements
// [c*chunk, min(n, (c+1)*chunk))) of (double)g^2, serially in f64: the CPU's
// `global_norm` chunk sums, which the host then adds in chunk order (the
// device never sums them: the trainer downloads them, so a device stage 2
// was a pass nobody read; removed 2026-12-03). One thread per chunk; grid
// ceil(nchunks / 128), block 128. The sum stays serial in ascending i (the
// CPU's association); only the loads run ahead of it: kBatch elements (as
// float4 when the chunk start is 16-byte aligned) are in flight while the
// previous kBatch are added, so a thread keeps 2 x 256 bytes of its chunk
// moving. With one thread per 16 Ki-element chunk a 130m gradient is 7.9k
// threads, 60 an SM: a single batch of 16 in flight left the kernel at
// ~0.9 TB/s (0.76 ms, ncu 2026-12-02; one dependent load at a time, 1.2 ms).
extern "C" __global__ void mamba_sumsq_chunks(const float* __restrict__ g, unsigned long long n,
                                              unsigned long long chunk,
                                              double* __restrict__ partial,
                                              unsigned long long nchunks) {
    const unsigned long long c = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= nchunks) return;
    const unsigned long long lo = c * chunk;
    const unsigned long long hi = lo + chunk < n ? lo + chunk : n;
    constexpr int kBatch = 64, kQuads = kBatch / 4;
    double s = 0.0;
    unsigned long long i = lo;
    if ((((unsigned long long)(g + lo)) & 15ull) == 0 && i + kBatch <= hi) {
        float4 cur[kQuads];
#pragma unroll
        for (int q = 0; q < kQuads; ++q) cur[q] = *reinterpret_cast<const float4*>(g + i + 4 * q);
        for (;;) {
            const unsigned long long next = i + kBatch;
            const bool more = next + kBatch <= hi;
            float4 ahead[kQuads];
            if (more) {
#pragma unroll
                for (int q = 0; q < kQuads; ++q) {
                    ahead[q] = *reinterpret_cast<const float4*>(g + next + 4 * q);
                }
            }
#pragma unroll
            for (int q = 0; q < kQuads; ++q) {
                const float v[4] = {cur[q].x, cur[q].y, cur[q].z, cur[q].w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const double x = (double)v[e];
                    s = __dadd_rn(s, __dmul_rn(x, x));
                }
            }
            i = next;
            if (!more) break;
#pragma unroll
            for (int q = 0; q < kQuads; ++q) cur[q] = ahead[q];
        }
    }
    for (; i < hi; ++i) {
        const double x = (double)g[i];
        s = __dadd_rn(s, __dmul_rn(x, x));
    }
    partial[c] = s;
}

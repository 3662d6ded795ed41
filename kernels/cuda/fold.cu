// Fixed-order fold of per-rank gradient slots (SPEC.md, mamba-reduce).
//
// Contract, per element i (the bits of the result depend only on the addends
// and on their count, never on the launch shape, the GPU or the alignment):
//
//   det_chain:  dst[i] = ((a0[i] + a1[i]) + ...) + a{n-1}[i], then
//               optionally * factor (one more rounding, the mean)
//   det_scale:  buf[i] = buf[i] * factor
//
// where the addends a_k of det_chain are a list of up to kMaxAddends
// pointers (the chain's terms, `ChainTerms`), any of which may be dst itself
// (that is how an owner's own shard joins the chain at its rank's position
// without a copy). The scaled chain multiplies the finished f32 sum once
// (__fmul_rn), so its bits equal a chain followed by a separate det_scale
// pass; fusing only saves a read and a write of the output. Every addition
// is an IEEE f32 add rounded to nearest (__fadd_rn), which the compiler never contracts
// into an FMA nor reassociates; the build also passes --fmad=false, so no
// other arithmetic here can be contracted either. One thread owns an element
// (or four adjacent elements in the vector path) and walks the addends
// serially in order, so there is no cross-thread reduction at all.
//
// Indexing is 64-bit throughout (size_t), so arenas above 2^31 elements are
// addressed correctly. Both kernels are grid-stride loops: any grid size
// covers any length, the host caps the grid.
//
// Vector path: when dst and every addend are 16-byte aligned, a thread loads
// float4s. The branch depends only on kernel arguments, so it is uniform over
// the grid. It computes exactly the same per-element chain as the scalar path;
// only the width of the memory transactions differs.

#include "fold_chain.cuh"

namespace {

// Short chains (n <= kPairMax addends, the two-process reducer's case):
// each thread takes two float4 groups per iteration, v and v + step, and
// issues the loads of both before any addition or store, so a small grid
// (the reducer's fold that runs beside NCCL's kernels on a fraction of the
// SMs) still keeps enough loads in flight to stream at a high fraction of
// HBM bandwidth. Per element the chain is exactly chain4_at's: the first
// addend, then + a1, + a2, ... in order, then the optional scale. Both
// groups belong to this thread only, so reading an addend that is dst before
// writing it stays race-free.
constexpr unsigned kPairMax = 4;

template <bool SCALE>
__device__ __forceinline__ void chain4_pairs(float4* dst4, const ChainTerms& a, unsigned n,
                                             size_t n_vec, size_t step, float factor) {
    size_t v = global_thread();
    for (; v + step < n_vec; v += 2 * step) {
        float4 r0[kPairMax];
        float4 r1[kPairMax];
#pragma unroll
        for (unsigned k = 0; k < kPairMax; ++k) {
            if (k < n) {
                const float4* p = reinterpret_cast<const float4*>(a.p[k]);
                r0[k] = p[v];
                r1[k] = p[v + step];
            }
        }
        float4 acc0 = r0[0];
        float4 acc1 = r1[0];
#pragma unroll
        for (unsigned k = 1; k < kPairMax; ++k) {
            if (k < n) {
                acc0 = add4(acc0, r0[k]);
                acc1 = add4(acc1, r1[k]);
            }
        }
        if (SCALE) {
            acc0 = mul4(acc0, factor);
            acc1 = mul4(acc1, factor);
        }
        dst4[v] = acc0;
        dst4[v + step] = acc1;
    }
    // At most one group left for this thread (v < n_vec <= v + step).
    if (v < n_vec) dst4[v] = chain4_at<SCALE>(a, n, v, factor);
}

template <bool SCALE>
__device__ __forceinline__ void chain_list(float* dst, const ChainTerms& a, unsigned n, size_t len,
                                           float factor) {
    const size_t step = grid_threads();
    bool vec = aligned16(dst);
    for (unsigned k = 0; k < n; ++k) vec = vec && aligned16(a.p[k]);
    size_t done = 0;
    if (vec) {
        const size_t n_vec = len / 4;
        float4* dst4 = reinterpret_cast<float4*>(dst);
        if (n <= kPairMax) {
            chain4_pairs<SCALE>(dst4, a, n, n_vec, step, factor);
        } else {
            for (size_t v = global_thread(); v < n_vec; v += step)
                dst4[v] = chain4_at<SCALE>(a, n, v, factor);
        }
        done = n_vec * 4;
    }
    for (size_t i = done + global_thread(); i < len; i += step)
        dst[i] = chain_at<SCALE>(a, n, i, factor);
}

}  // namespace

// dst[0..len) = ((a0 + a1) + ...) + a{n-1} over 1 <= n <= 32 addends, times
// factor when scale != 0. Any addend may equal dst (the same base pointer).
// __launch_bounds__(1024): every block size up to CUDA's limit launches (the
// reducer runs it as one 1024-thread block per SM on part of the GPU while
// NCCL's kernels use the rest); it caps registers at 64 per thread.
extern "C" __global__ void __launch_bounds__(1024)
    det_chain_f32(float* dst, ChainTerms addends, unsigned n, unsigned long long len, float factor,
                  unsigned scale) {
    if (scale != 0u) {
        chain_list<true>(dst, addends, n, len, factor);
    } else {
        chain_list<false>(dst, addends, n, len, factor);
    }
}

// buf[0..len) *= factor, one IEEE round-to-nearest multiply per element
// (subnormals kept: the build never passes --ftz=true).
extern "C" __global__ void det_scale_f32(float* __restrict__ buf, unsigned long long len,
                                         float factor) {
    const size_t step = grid_threads();
    size_t done = 0;
    if (aligned16(buf)) {
        const size_t n_vec = len / 4;
        float4* buf4 = reinterpret_cast<float4*>(buf);
        for (size_t v = global_thread(); v < n_vec; v += step) buf4[v] = mul4(buf4[v], factor);
        done = n_vec * 4;
    }
    for (size_t i = done + global_thread(); i < len; i += step) buf[i] = __fmul_rn(buf[i], factor);
}

// What the SSD kernels of both products share (mamba_ssd.cu, the SIMT
// products every precision can run; mamba_ssd_tc.cu, the tensor-core
// products of tf32 and bf16 runs): the chunk length, the block size, a
// chunk's rows, and the per-(chunk, head) decays and weights, so that the
// two files' kernels read one definition of the algorithm's pieces.
#pragma once
#include "mamba_common.cuh"

namespace mamba_ssd {

// Chunk length: the Q x Q blocks' size (SsdShape::CHUNK on the host).
constexpr int kQ = 64;
// Threads of every per-chunk block (SsdShape's launches use it).
constexpr int kThreads = 256;

// One chunk of one sequence (block index bc = b * nc + c).
struct Chunk {
    long long m0;  // first row of the chunk
    int t0;        // first token within the sequence
    int q;         // tokens in the chunk (1..kQ)
    int last_row;  // m0 + q - 1 as an offset from m0
};

__device__ __forceinline__ Chunk chunk_of(int bc, int nc, int T) {
    const int b = bc / nc, c = bc % nc;
    Chunk k;
    k.t0 = c * kQ;
    k.q = min(kQ, T - k.t0);
    k.m0 = (long long)b * T + k.t0;
    k.last_row = k.q - 1;
    return k;
}

// s and dt of one (chunk, head) into shared memory (zeros past q).
__device__ __forceinline__ void stage_s_dt(const float* __restrict__ s,
                                           const float* __restrict__ dt, const Chunk& ck,
                                           int H, int h, float* ss, float* sdt) {
    const int tid = threadIdx.x;
    if (tid < kQ) {
        const bool in = tid < ck.q;
        ss[tid] = in ? s[(ck.m0 + tid) * H + h] : 0.0f;
        sdt[tid] = in ? dt[(ck.m0 + tid) * H + h] : 0.0f;
    }
}

// M_ij = exp(s_i - s_j) cb_ij dt_j, 0 outside j <= i < q: the diagonal block's weights (forward and backward alike).
__device__ __forceinline__ float weight_m(float cb, const float* ss, const float* sdt, int i,
                                          int j, int q) {
    return (j <= i && i < q) ? (expf(ss[i] - ss[j]) * cb) * sdt[j] : 0.0f;
}

}  // namespace mamba_ssd

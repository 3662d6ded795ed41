// The selective scan of Mamba-1, forward and backward.
//
// Per batch b, channel c < D and state n < N (A = -exp(A_log[c, n])):
//   a_t = exp(dt_t A),  h_t = a_t h_{t-1} + (dt_t B_t[n]) u_t,  h_{-1} = 0
//   y_t = sum_n C_t[n] h_t[n] + Dp[c] u_t,   out_t = y_t SiLU(z_t)
// Inputs are row-major [M, .] activations (row m = b*T + t): u, dt [M, D];
// B and C are columns of x_proj's output, bc[m*ldbc + n] and
// bc[m*ldbc + N + n]; z has leading dimension ldz.
//
// Layout. One thread owns kLaneStates consecutive states of one channel of
// one sequence, in registers, and walks time serially: `sp` lanes per channel
// (sp = ceil(N / kLaneStates) rounded up to a power of two, 1..16, lane l
// holding states l*kLaneStates ..), so a block of kSeqThreads threads covers
// cpb = kSeqThreads / sp channels. Sums over n are serial over a lane's
// states, then a fixed xor-butterfly over its channel's sp lanes (one warp).
// The recurrence itself is never reassociated: h_t comes from h_{t-1} by the
// formula above, in order, for every t. (The earlier design cut time into
// chunks solved independently and chained their affine maps; it launched
// seven kernels and, latency-bound at low occupancy, took 95 of the 121 ms of
// the 130m step's own kernels. ncu in docs/PERFORMANCE.md.)
//
// Forward (mamba_scan_fwd, one launch): walks t upward; at the start of each
// chunk of kChunk steps it stores the state it enters with in Hin
// ([B][nch][D][N], 1/kChunk of the (B, T, D, N) states, kept for the backward
// pass), and writes y and out at every step.
// Backward (mamba_scan_bwd): walks the chunks downward, carrying
// g_t = dL/dh_t = C_t dy_t + a_{t+1} g_{t+1} across them. Per chunk it
// recomputes the chunk's states from Hin into shared memory (same formula,
// same bits as the forward), then walks them back and produces d dt (already
// times softplus'), d u, d A summed over the sequence per (b, c, n), and the
// d B / d C sums over the block's channels, staged in shared memory and
// summed in ascending channel order, one partial per channel group;
// mamba_scan_dbc_reduce sums the groups in ascending order.
// Every sum has a fixed association that depends only on (T, D, N): no
// atomics, nothing depends on scheduling or on the batch.
//
// Block-uniform control flow wherever a shuffle or a barrier is reached:
// lanes of channels c >= D and states n >= N take part with zero values.

#include "mamba_common.cuh"

using namespace mamba;

namespace {

constexpr int kChunk = 16;
constexpr int kSeqThreads = 64;
constexpr int kLaneStates = 8;
// Backward steps whose d B / d C contributions are staged before one
// cross-channel summation (two barriers per stage).
constexpr int kStage = 2;

struct SeqLanes {
    int sp;    // lanes per channel (power of two, 1..16)
    int cpb;   // channels per block: kSeqThreads / sp
    int lane;  // this thread's lane within its channel
    int cl;    // this thread's channel within the block
    int n0;    // this thread's first state: lane * kLaneStates
};

__device__ __forceinline__ SeqLanes seq_lanes(int sp) {
    SeqLanes l;
    l.sp = sp;
    l.cpb = kSeqThreads / sp;
    l.lane = threadIdx.x % sp;
    l.cl = threadIdx.x / sp;
    l.n0 = l.lane * kLaneStates;
    return l;
}

// Index of (b, chunk k, c, n) in the [B][nch][D][N] chunk-state array.
__device__ __forceinline__ long long state_index(int b, int k, int nch, int c, int D, int n,
                                                 int N) {
    return (((long long)b * nch + k) * D + c) * N + n;
}

// out[j] = x[(m0 + min(j, len - 1)) * ld + col], j < kChunk: the chunk's
// column of x, the rows past a ragged chunk's end clamped to its last row
// (1 <= len <= kChunk), so every load is in bounds and unconditional and the
// compiler can issue them all before the serial chain needs them.
__device__ __forceinline__ void load_chunk(const float* __restrict__ x, long long ld,
                                           long long col, long long m0, int len,
                                           float (&out)[kChunk]) {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) out[j] = x[(m0 + min(j, len - 1)) * ld + col];
}

// A[i] = -exp(A_log[c, n0 + i]) for this thread's live states, 0 elsewhere.
__device__ __forceinline__ void load_a(const float* __restrict__ a_log, bool live_c, int c,
                                       int n0, int N, float (&A)[kLaneStates]) {
#pragma unroll
    for (int i = 0; i < kLaneStates; ++i) {
        A[i] = live_c && n0 + i < N ? -expf(a_log[(long long)c * N + n0 + i]) : 0.0f;
    }
}

}  // namespace

// grid (ceil(D / cpb), B), block kSeqThreads.
extern "C" __global__ void __launch_bounds__(kSeqThreads)
    mamba_scan_fwd(const float* __restrict__ u, const float* __restrict__ dt,
                   const float* __restrict__ bc, long long ldbc,
                   const float* __restrict__ a_log, const float* __restrict__ dpar,
                   const float* __restrict__ z, long long ldz, float* __restrict__ Hin,
                   float* __restrict__ y, float* __restrict__ out, int T, int D, int N,
                   int sp) {
    const SeqLanes l = seq_lanes(sp);
    const int b = blockIdx.y;
    const int c = blockIdx.x * l.cpb + l.cl;
    const bool live_c = c < D;
    // Lanes past the last channel read a valid element and never store.
    const int cc = min(c, D - 1);
    const int nch = (T + kChunk - 1) / kChunk;
    float A[kLaneStates], h[kLaneStates];
    load_a(a_log, live_c, c, l.n0, N, A);
#pragma unroll
    for (int i = 0; i < kLaneStates; ++i) h[i] = 0.0f;
    const float dp = dpar[cc];

    for (int k = 0; k < nch; ++k) {
        const int t0 = k * kChunk;
        const int len = min(kChunk, T - t0);
        const long long m0 = (long long)b * T + t0;
        if (live_c) {
#pragma unroll
            for (int i = 0; i < kLaneStates; ++i) {
                if (l.n0 + i < N) Hin[state_index(b, k, nch, c, D, l.n0 + i, N)] = h[i];
            }
        }
        float dtv[kChunk], uv[kChunk], zv[kChunk];
        load_chunk(dt, D, cc, m0, len, dtv);
        load_chunk(u, D, cc, m0, len, uv);
        load_chunk(z, ldz, cc, m0, len, zv);
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
            if (j < len) {  // uniform over the block
                const long long m = m0 + j;
                const float* bm = bc + m * ldbc;
                float part = 0.0f;
#pragma unroll
                for (int i = 0; i < kLaneStates; ++i) {
                    const int n = l.n0 + i;
                    if (n < N) {
                        const float a = expf(dtv[j] * A[i]);
                        h[i] = a * h[i] + (dtv[j] * bm[n]) * uv[j];
                        part = part + bm[N + n] * h[i];
                    }
                }
                part = group_sum(part, l.sp);
                if (l.lane == 0 && live_c) {
                    const float yv = part + dp * uv[j];
                    y[m * D + c] = yv;
                    out[m * D + c] = yv * siluf_(zv[j]);
                }
            }
        }
    }
}

// Outputs: ddtr[m, c] = (dL/d dt) * sigmoid(pre) (softplus' from dt itself:
// sigmoid(pre) = 1 - exp(-softplus(pre)) = -expm1(-dt)); du[m, c] = scan
// part + Dp dy (x_proj's backward GEMM adds its share later);
// dA_part[b][c][n] = sum over t (descending) of g a h_{t-1} dt;
// part[grp][m][0..N) = d B, part[grp][m][N..2N) = d C summed over the
// group's channels: `rounds` consecutive sets of cpb channels, walked one
// after the other (set r adds onto set r-1's partial in place).
// grid (groups, B), block kSeqThreads. Shared memory: the chunk's recomputed
// states (32 KiB, each thread's own column) and the d B / d C stage.
extern "C" __global__ void __launch_bounds__(kSeqThreads)
    mamba_scan_bwd(const float* __restrict__ u, const float* __restrict__ dt,
                   const float* __restrict__ bc, long long ldbc,
                   const float* __restrict__ a_log, const float* __restrict__ dpar,
                   const float* __restrict__ dy, const float* __restrict__ Hin,
                   float* __restrict__ ddtr, float* __restrict__ du, float* __restrict__ part,
                   float* __restrict__ dA_part, int T, int D, int N, int sp, int rounds) {
    // sH[j][i][tid] = state i of this thread before step t0 + j.
    __shared__ float sH[kChunk][kLaneStates][kSeqThreads];
    // sRed[slot][0 = d B, 1 = d C][i][tid]; rows padded against bank conflicts.
    __shared__ float sRed[kStage][2][kLaneStates][kSeqThreads + 1];
    const SeqLanes l = seq_lanes(sp);
    const int b = blockIdx.y, grp = blockIdx.x;
    const long long M = (long long)gridDim.y * T;
    const int nch = (T + kChunk - 1) / kChunk;
    const int npad = l.sp * kLaneStates;  // states covered by one channel's lanes
    const int tid = threadIdx.x;

    for (int r = 0; r < rounds; ++r) {
        const int cbase = (grp * rounds + r) * l.cpb;
        const int c = cbase + l.cl;
        const bool live_c = c < D;
        const int cc = min(c, D - 1);
        const float dp = dpar[cc];
        float A[kLaneStates], carry[kLaneStates], dA[kLaneStates], h[kLaneStates];
        load_a(a_log, live_c, c, l.n0, N, A);
#pragma unroll
        for (int i = 0; i < kLaneStates; ++i) carry[i] = dA[i] = 0.0f;

        for (int k = nch - 1; k >= 0; --k) {
            const int t0 = k * kChunk;
            const int len = min(kChunk, T - t0);
            const long long m0 = (long long)b * T + t0;
#pragma unroll
            for (int i = 0; i < kLaneStates; ++i) {
                const int n = l.n0 + i;
                h[i] = live_c && n < N ? Hin[state_index(b, k, nch, c, D, n, N)] : 0.0f;
            }
            float dtv[kChunk], uv[kChunk], dyv[kChunk];
            load_chunk(dt, D, cc, m0, len, dtv);
            load_chunk(u, D, cc, m0, len, uv);
            load_chunk(dy, D, cc, m0, len, dyv);
            // Recompute the chunk's states (the forward's formula and order).
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
                if (j < len) {
                    const float* bm = bc + (m0 + j) * ldbc;
#pragma unroll
                    for (int i = 0; i < kLaneStates; ++i) {
                        sH[j][i][tid] = h[i];
                        if (l.n0 + i < N) {
                            const float a = expf(dtv[j] * A[i]);
                            h[i] = a * h[i] + (dtv[j] * bm[l.n0 + i]) * uv[j];
                        }
                    }
                }
            }
            // Walk back: h[i] is the state after step j.
            int slot = 0;
#pragma unroll
            for (int j = kChunk - 1; j >= 0; --j) {
                if (j < len) {  // uniform over the block
                    const long long m = m0 + j;
                    const float* bm = bc + m * ldbc;
                    float pdt = 0.0f, pdu = 0.0f;
#pragma unroll
                    for (int i = 0; i < kLaneStates; ++i) {
                        const int n = l.n0 + i;
                        const float hprev = sH[j][i][tid];
                        float cB = 0.0f, cC = 0.0f;
                        if (n < N) {
                            const float bn = bm[n];
                            const float g = bm[N + n] * dyv[j] + carry[i];
                            const float a = expf(dtv[j] * A[i]);  // as in the recompute
                            const float hp = a * hprev;            // a_t h_{t-1}
                            const float gdt = g * dtv[j];
                            cC = dyv[j] * h[i];
                            cB = gdt * uv[j];
                            pdt = pdt + g * (A[i] * hp + bn * uv[j]);
                            pdu = pdu + gdt * bn;
                            dA[i] = dA[i] + (g * hp) * dtv[j];
                            carry[i] = a * g;
                        }
                        sRed[slot][0][i][tid] = live_c ? cB : 0.0f;
                        sRed[slot][1][i][tid] = live_c ? cC : 0.0f;
                        h[i] = hprev;
                    }
                    pdt = group_sum(pdt, l.sp);
                    pdu = group_sum(pdu, l.sp);
                    if (l.lane == 0 && live_c) {
                        ddtr[m * D + c] = pdt * -expm1f(-dtv[j]);
                        du[m * D + c] = pdu + dp * dyv[j];
                    }
                    if (slot == kStage - 1 || j == 0) {
                        // Slot q holds step j + slot - q. Sum each (slot,
                        // B/C, n) over the block's channels in ascending order.
                        __syncthreads();
                        const int outs = (slot + 1) * 2 * npad;
                        for (int o = tid; o < outs; o += kSeqThreads) {
                            const int q = o / (2 * npad), w = o % (2 * npad);
                            const int which = w / npad, n = w % npad;
                            const int i = n % kLaneStates, ln = n / kLaneStates;
                            if (n < N) {
                                float s = sRed[q][which][i][ln];
                                for (int cl2 = 1; cl2 < l.cpb; ++cl2) {
                                    s = s + sRed[q][which][i][cl2 * l.sp + ln];
                                }
                                const long long mq = m + slot - q;
                                float* dst = part + ((long long)grp * M + mq) * (2 * N) +
                                             which * N + n;
                                *dst = r == 0 ? s : *dst + s;
                            }
                        }
                        __syncthreads();
                        slot = 0;
                    } else {
                        ++slot;
                    }
                }
            }
        }
        if (live_c) {
#pragma unroll
            for (int i = 0; i < kLaneStates; ++i) {
                const int n = l.n0 + i;
                if (n < N) dA_part[((long long)b * D + c) * N + n] = dA[i];
            }
        }
    }
}

// dbc[m*ldbc + j] = part[0][m][j] + part[1][m][j] + ... (ascending groups)
// for j < 2N: d B then d C, into x_proj's output gradient.
// grid ceil(M * 2N / 256), block 256.
extern "C" __global__ void mamba_scan_dbc_reduce(const float* __restrict__ part, int groups,
                                                 long long M, int N, float* __restrict__ dbc,
                                                 long long ldbc) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long w = 2LL * N;
    if (i >= M * w) return;
    const long long m = i / w, j = i % w;
    float s = 0.0f;
    for (int g = 0; g < groups; ++g) s = s + part[((long long)g * M + m) * w + j];
    dbc[m * ldbc + j] = s;
}

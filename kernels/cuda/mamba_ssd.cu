// The Mamba-2 scan by state-space duality (SSD), chunked, forward and
// backward: the algorithm of the CPU reference
// (mamba-train/src/model/cpu/mamba2/ssd.rs, whose docs derive it), cut into
// kernels that each own one kind of output, so every sum is one thread's
// serial loop or a fixed butterfly and no kernel needs an atomic.
//
// Per sequence b and head h (group g = h / hpg; head_dim P, state N, chunk
// length kQ, the last chunk of a sequence shorter when kQ does not divide
// T), within a chunk starting at t0 with a_i = dt_i A (A = -exp(A_log[h])):
//   s_i    = a_0 + ... + a_i                     (mamba_ssd_cumsum)
//   L_ij   = exp(s_i - s_j), j <= i;  cb_ij = C_i . B_j
//   y_i[p] = (sum_{j<=i} (L_ij cb_ij dt_j) x_j[p]
//             + exp(s_i) sum_n C_i[n] H[p][n]) + D x_i[p]   (mamba_ssd_chunk_out)
//   S[p][n] = sum_j (exp(s_last - s_j) dt_j x_j[p]) B_j[n]    (mamba_ssd_chunk_state)
//   H_{c+1} = exp(s_last) H_c + S_c, H_0 = 0                  (mamba_ssd_state_pass)
// with H the chunk's entry state. The backward recomputes s and the entry
// states (nothing of the scan is kept from the forward but y), then
//   dH_c = exp(s_last_c) dH_{c+1} + sum_i exp(s_i) dy_i C_i^T, dS_c = dH_{c+1}
// (mamba_ssd_chunk_state in its backward mode, then the state pass in
// reverse), and per chunk
//   dx_j  = sum_{i>=j} M_ij dy_i + e_j (dS B_j) + D dy_j,  M_ij = L_ij cb_ij dt_j,
//           e_j = exp(s_last - s_j) dt_j                      (mamba_ssd_bwd_dx)
//   dB_j  = sum_h [sum_{i>=j} P_ij C_i + e_j (x_j^T dS)]       (mamba_ssd_bwd_dbc)
//   dC_i  = sum_h [sum_{j<=i} P_ij B_j + exp(s_i) (dy_i^T H)],
//           P_ij = (L_ij dt_j) (dy_i . x_j)
// where B and C are shared by a group's heads, so the diagonal terms take
// Psum = sum_h P (mamba_ssd_bwd_psum) and the state terms are one
// contraction over the group's (h, p): two products per group, not four
// per head, and no partial sums over heads to combine;
//   d dt_j = sum_{i>=j} L_ij cb_ij (dy_i . x_j) + exp(s_last - s_j) x_j^T dS B_j
//            + A da_j,  da_k = sum_{i>=k} ds_i                 (mamba_ssd_bwd_dt)
// where ds_i is the gradient of s_i: the row sum minus the column sum of
// w_ij = M_ij (dy_i . x_j) (mamba_ssd_bwd_qq), plus exp(s_i) dy_i . (H C_i),
// minus exp(s_last - s_i) dt_i x_i^T dS B_i (both per head, from
// mamba_ssd_bwd_dx), and, at the last token, the sum of those state terms
// plus exp(s_last) <dS, H> (also bwd_dx). dA_log = A sum over chunks of
// sum_k da_k dt_k (mamba_ssd_dalog).
//
// Layout: activations are row-major [M, .], row m = b*T + t. The conv
// output holds x (columns h*P + p), B (b_off + g*N + n) and C (c_off + g*N
// + n) with leading dimension ldu; dt and s are [M, H]; y, dy and the gate
// are [M, H*P]; the chunk states are [B*nc][H][P][N]; the Q x Q matrices M
// and P are [B*nc][H][kQ][kQ] (zero outside j <= i < q).
//
// Tiles: the Q x Q and Q x P products give each of 256 threads a 4 x 4
// register tile (rows 4*(tid/16) + a, columns tid%16 + 16*k), fed from
// shared-memory tiles of kTk contraction steps padded by one column against
// bank conflicts (bwd_dbc: kDk steps, stored step-major so a thread reads
// its four rows as one float4); the contraction is serial in ascending
// order per output.
// Zero padding past a chunk's length or a tile's edge adds exact zeros.
//
// Determinism: no atomics; every output is one thread's serial sum, or a
// fixed xor butterfly (group_sum) then a serial sum over warps, in an order
// that depends on the shapes alone. The chunk length is the constant kQ,
// not the model's chunk_size, so the bits do not depend on chunk_size.
// The file is built with --fmad=true (kernels/build/nvcc.rs): its contract
// is a tolerance against the CPU reference (tests/cuda_mamba2.rs) and the
// emulated check against a sequential f64 oracle (kernels/emu/ssd_check.cpp).
//
// Over 450 lines: one module (one fatbin, loaded as one of MambaKernels'
// modules) whose forward and backward kernels share the chunk helpers and
// the tiled products above them; split, the backward's file would include
// the forward's helpers, and the emulated check compiles the pair as one.
#include "ssd_chunk.cuh"

using namespace mamba;
using namespace mamba_ssd;

namespace {

// Contraction steps per shared-memory tile of the register-tiled products.
constexpr int kTk = 16;
// Rows of a staged tile, padded so every step's row of values starts
// 16-byte aligned (a thread reads its four rows as one float4).
constexpr int kQPad = kQ + 4;
constexpr int kTile = kTk * kQPad;
// Output columns (p) per pass of the Q x P products.
constexpr int kTp = 64;
// chunk_state's output tile: kSp channels x kSn states.
constexpr int kSp = 64;
constexpr int kSn = 64;
// bwd_dbc: states per block, contraction steps per staged tile.
constexpr int kDn = 64;
constexpr int kDk = 32;
// Chunks whose loads mamba_ssd_state_pass issues before walking them.
constexpr int kPass = 8;

// acc[a][k] = sum over kk < K (ascending) of A[r_a][kk] * Bm[r_k][kk],
// r_a = 4*(tid/16) + a, r_k = tid%16 + 16*k, where A has qa rows lda apart
// and Bm qb rows ldb apart (both already offset to their first column);
// rows past qa / qb and steps past K read as 0. sA, sB: kTile floats each,
// 16-byte aligned, staged step-major (sA[kk * kQPad + r]) so the four rows
// of a thread are one float4 load. Every thread of the block must call it
// (it synchronises).
__device__ __forceinline__ void rows_product(float acc[4][4], const float* __restrict__ A,
                                             long long lda, int qa,
                                             const float* __restrict__ Bm, long long ldb, int qb,
                                             int K, float* sA, float* sB) {
    const int tid = threadIdx.x, ti = tid / 16, tj = tid % 16;
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[a][k] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += kTk) {
        for (int idx = tid; idx < kQ * kTk; idx += kThreads) {
            const int r = idx / kTk, kk = idx % kTk;
            const bool in_k = k0 + kk < K;
            sA[kk * kQPad + r] = (r < qa && in_k) ? A[r * lda + k0 + kk] : 0.0f;
            sB[kk * kQPad + r] = (r < qb && in_k) ? Bm[r * ldb + k0 + kk] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kTk; ++kk) {
            const float4 av = *reinterpret_cast<const float4*>(&sA[kk * kQPad + 4 * ti]);
            float bv[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) bv[k] = sB[kk * kQPad + tj + 16 * k];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                acc[0][k] = acc[0][k] + av.x * bv[k];
                acc[1][k] = acc[1][k] + av.y * bv[k];
                acc[2][k] = acc[2][k] + av.z * bv[k];
                acc[3][k] = acc[3][k] + av.w * bv[k];
            }
        }
        __syncthreads();
    }
}

}  // namespace

// s[m, h] = a_0 + ... + a_i within each chunk (ascending), a = dt A.
// One thread per (chunk, head): nbc * H threads, block kThreads.
extern "C" __global__ void mamba_ssd_cumsum(const float* __restrict__ dt,
                                            const float* __restrict__ a_log,
                                            float* __restrict__ s, int T, int H, int nc,
                                            int nbc) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)nbc * H) return;
    const int h = (int)(i % H), bc = (int)(i / H);
    const Chunk ck = chunk_of(bc, nc, T);
    const float A = -expf(a_log[h]);
    float acc = 0.0f;
    for (int k = 0; k < ck.q; ++k) {
        const long long r = (ck.m0 + k) * H + h;
        acc = acc + dt[r] * A;
        s[r] = acc;
    }
}

// out[bc][h][p][n] = sum_j (w_j X_j[p]) Y_j[n], j ascending over the chunk:
//   mode 0 (the chunk's state S): X = x, Y = B, w_j = exp(s_last - s_j) dt_j;
//   mode 1 (its output gradient's share of dH): X = dy, Y = C, w_j = exp(s_j).
// X columns h*P + p (leading dimension ldx), Y columns y_off + g*N + n (ldy).
// grid (nbc, H, ceil(P / kSp) * ceil(N / kSn)), block kThreads.
extern "C" __global__ void __launch_bounds__(kThreads)
    mamba_ssd_chunk_state(const float* __restrict__ X, long long ldx,
                          const float* __restrict__ Y, long long ldy, int y_off,
                          const float* __restrict__ dt, const float* __restrict__ s,
                          float* __restrict__ out, int T, int H, int P, int N, int hpg, int nc,
                          int mode) {
    __shared__ __align__(16) float sX[kQ * kSp];
    __shared__ float sY[kQ * kSn];
    __shared__ float sw[kQ];
    __shared__ float ss[kQ], sdt[kQ];
    const int bc = blockIdx.x, h = blockIdx.y;
    const int tiles_n = (N + kSn - 1) / kSn;
    const int p0 = (blockIdx.z / tiles_n) * kSp, n0 = (blockIdx.z % tiles_n) * kSn;
    const int g = h / hpg;
    const Chunk ck = chunk_of(bc, nc, T);
    const int tid = threadIdx.x;
    stage_s_dt(s, dt, ck, H, h, ss, sdt);
    __syncthreads();
    if (tid < ck.q) {
        sw[tid] = mode == 0 ? expf(ss[ck.last_row] - ss[tid]) * sdt[tid] : expf(ss[tid]);
    }
    __syncthreads();
    for (int idx = tid; idx < ck.q * kSp; idx += kThreads) {
        const int j = idx / kSp, pp = idx % kSp;
        sX[idx] = p0 + pp < P ? sw[j] * X[(ck.m0 + j) * ldx + h * P + p0 + pp] : 0.0f;
    }
    for (int idx = tid; idx < ck.q * kSn; idx += kThreads) {
        const int j = idx / kSn, nn = idx % kSn;
        sY[idx] = n0 + nn < N ? Y[(ck.m0 + j) * ldy + y_off + g * N + n0 + nn] : 0.0f;
    }
    __syncthreads();
    // Thread (tp, tn) owns channels p0 + 4 tp + a and states n0 + tn + 16 k.
    const int tp = tid / 16, tn = tid % 16;
    float acc[4][4] = {};
    for (int j = 0; j < ck.q; ++j) {
        const float4 xv = *reinterpret_cast<const float4*>(&sX[j * kSp + 4 * tp]);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float yv = sY[j * kSn + tn + 16 * k];
            acc[0][k] = acc[0][k] + xv.x * yv;
            acc[1][k] = acc[1][k] + xv.y * yv;
            acc[2][k] = acc[2][k] + xv.z * yv;
            acc[3][k] = acc[3][k] + xv.w * yv;
        }
    }
    float* o = out + ((long long)bc * H + h) * P * N;
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const int p = p0 + 4 * tp + a;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int n = n0 + tn + 16 * k;
            if (p < P && n < N) o[(long long)p * N + n] = acc[a][k];
        }
    }
}

// The pass of states between chunks, in place over st ([B*nc][H][P*N]):
// forward (reverse = 0) st[c] becomes the entry state H_c (H_0 = 0) from
// the chunk states S_c; reverse (1), st[c] becomes dS_c = dH_{c+1} (0 for
// the last chunk) from the output gradients' shares. Both are
// carry = exp(s_last_c) carry + st[c] after storing the carry, c in the
// pass's order. One thread per (b, h, p*N + n): B * H * P * N threads.
// The walk is serial in c, but its loads are not: each round of kPass
// chunks loads every value and decay first (kPass loads in flight a
// thread, where one at a time left the pass latency-bound at ~170 GB/s),
// then runs the same chain of operations in the same order.
extern "C" __global__ void mamba_ssd_state_pass(float* __restrict__ st,
                                                const float* __restrict__ s, int T, int H,
                                                long long PN, int nc, int nbatch, int reverse) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)nbatch * H * PN) return;
    const long long e = i % PN, bh = i / PN;
    const int h = (int)(bh % H), b = (int)(bh / H);
    float carry = 0.0f;
    for (int step0 = 0; step0 < nc; step0 += kPass) {
        float v[kPass], decay[kPass];
#pragma unroll
        for (int k = 0; k < kPass; ++k) {
            const int step = step0 + k;
            if (step < nc) {
                const int c = reverse ? nc - 1 - step : step;
                v[k] = st[(((long long)b * nc + c) * H + h) * PN + e];
                const int last = min(T, (c + 1) * kQ) - 1;
                decay[k] = expf(s[((long long)b * T + last) * H + h]);
            }
        }
#pragma unroll
        for (int k = 0; k < kPass; ++k) {
            const int step = step0 + k;
            if (step < nc) {
                const int c = reverse ? nc - 1 - step : step;
                st[(((long long)b * nc + c) * H + h) * PN + e] = carry;
                carry = decay[k] * carry + v[k];
            }
        }
    }
}

// y = the chunk's output (module docs) and gate = y SiLU(z) ([M, H*P];
// z's columns h*P + p with leading dimension ldz), from the entry states st.
// z is f32 (`z`) or, when that is null, bf16 (`zh`); y and gate are stored
// in f32 and / or bf16 (either of each pair may be null), and the gate reads
// y as it is kept.
// grid (nbc, H), block kThreads.
extern "C" __global__ void __launch_bounds__(kThreads)
    mamba_ssd_chunk_out(const float* __restrict__ xbc, long long ldu, int b_off, int c_off,
                        const float* __restrict__ dt, const float* __restrict__ s,
                        const float* __restrict__ dpar, const float* __restrict__ st,
                        const float* __restrict__ z, const unsigned short* __restrict__ zh,
                        long long ldz, float* __restrict__ y, unsigned short* __restrict__ yh,
                        float* __restrict__ gate, unsigned short* __restrict__ gateh, int T,
                        int H, int P, int N, int hpg, int nc) {
    __shared__ __align__(16) float sA[kTile], sB[kTile];
    __shared__ float sM[kQ * (kQ + 1)];
    __shared__ float sX[kQ * kTp];
    __shared__ float ss[kQ], sdt[kQ];
    const int bc = blockIdx.x, h = blockIdx.y, g = h / hpg;
    const Chunk ck = chunk_of(bc, nc, T);
    const int tid = threadIdx.x, ti = tid / 16, tj = tid % 16;
    const long long E = (long long)H * P;
    stage_s_dt(s, dt, ck, H, h, ss, sdt);
    const float* rows = xbc + ck.m0 * ldu;
    float acc[4][4];
    rows_product(acc, rows + c_off + g * N, ldu, ck.q, rows + b_off + g * N, ldu, ck.q, N, sA,
                 sB);
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = 4 * ti + a, j = tj + 16 * k;
            sM[i * (kQ + 1) + j] = weight_m(acc[a][k], ss, sdt, i, j, ck.q);
        }
    const float dh = dpar[h];
    const float* hst = st + ((long long)bc * H + h) * P * N;
    for (int p0 = 0; p0 < P; p0 += kTp) {
        __syncthreads();
        for (int idx = tid; idx < kQ * kTp; idx += kThreads) {
            const int j = idx / kTp, pp = idx % kTp;
            sX[idx] = (j < ck.q && p0 + pp < P) ? rows[j * ldu + h * P + p0 + pp] : 0.0f;
        }
        __syncthreads();
        float yd[4][4] = {};
        const int jend = min(ck.q, 4 * ti + 4);
        for (int j = 0; j < jend; ++j) {
            float xv[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) xv[k] = sX[j * kTp + tj + 16 * k];
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                const float m = sM[(4 * ti + a) * (kQ + 1) + j];
#pragma unroll
                for (int k = 0; k < 4; ++k) yd[a][k] = yd[a][k] + m * xv[k];
            }
        }
        float off[4][4];
        rows_product(off, rows + c_off + g * N, ldu, ck.q, hst + (long long)p0 * N, N,
                     min(kTp, P - p0), N, sA, sB);
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const int i = 4 * ti + a;
            if (i >= ck.q) continue;
            const float es = expf(ss[i]);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int pp = tj + 16 * k;
                if (p0 + pp >= P) continue;
                const float yv = (yd[a][k] + es * off[a][k]) + dh * sX[i * kTp + pp];
                const long long r = ck.m0 + i;
                const long long col = (long long)h * P + p0 + pp;
                // The gate reads y as it is kept, as the gate's backward does.
                const float yk = store_kept(y, yh, r * E + col, yv);
                store_f32_bf16(gate, gateh, r * E + col,
                               gate_out(yk, load_f32_bf16(z, zh, r * ldz + col)));
            }
        }
    }
}

// The backward's Q x Q quantities of one (chunk, head): Mq = M (the
// diagonal block's weights) and Pq = P_ij = (L_ij dt_j)(dy_i . x_j)
// ([nbc][H][kQ][kQ]); ds_in[m, h] = sum_{j<=i} w_ij - sum_{k>=i} w_ki with
// w = M (dy . x) (both ascending); ddt_in[m, h] = sum_{i>=j} L_ij cb_ij
// (dy_i . x_j) (ascending i). dy is [M, H*P]. grid (nbc, H), block kThreads.
extern "C" __global__ void __launch_bounds__(kThreads, 3)
    mamba_ssd_bwd_qq(const float* __restrict__ xbc, long long ldu, int b_off, int c_off,
                     const float* __restrict__ dt, const float* __restrict__ s,
                     const float* __restrict__ dy, float* __restrict__ Mq,
                     float* __restrict__ Pq, float* __restrict__ ds_in,
                     float* __restrict__ ddt_in, int T, int H, int P, int N, int hpg, int nc) {
    __shared__ __align__(16) float sA[kTile], sB[kTile];
    __shared__ float sW[kQ * (kQ + 1)], sV[kQ * (kQ + 1)];
    __shared__ float ss[kQ], sdt[kQ];
    const int bc = blockIdx.x, h = blockIdx.y, g = h / hpg;
    const Chunk ck = chunk_of(bc, nc, T);
    const int tid = threadIdx.x, ti = tid / 16, tj = tid % 16;
    const long long E = (long long)H * P;
    stage_s_dt(s, dt, ck, H, h, ss, sdt);
    const float* rows = xbc + ck.m0 * ldu;
    float cb[4][4], dd[4][4];
    rows_product(cb, rows + c_off + g * N, ldu, ck.q, rows + b_off + g * N, ldu, ck.q, N, sA,
                 sB);
    rows_product(dd, dy + ck.m0 * E + (long long)h * P, E, ck.q, rows + h * P, ldu, ck.q, P,
                 sA, sB);
    float* mq = Mq + ((long long)bc * H + h) * kQ * kQ;
    float* pq = Pq + ((long long)bc * H + h) * kQ * kQ;
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = 4 * ti + a, j = tj + 16 * k;
            const bool in = j <= i && i < ck.q;
            const float l = in ? expf(ss[i] - ss[j]) : 0.0f;
            const float cbl = l * cb[a][k];
            const float m = cbl * sdt[j];
            mq[i * kQ + j] = in ? m : 0.0f;
            pq[i * kQ + j] = in ? (l * sdt[j]) * dd[a][k] : 0.0f;
            sW[i * (kQ + 1) + j] = in ? m * dd[a][k] : 0.0f;
            sV[i * (kQ + 1) + j] = in ? cbl * dd[a][k] : 0.0f;
        }
    __syncthreads();
    if (tid < ck.q) {
        const int t = tid;
        float row = 0.0f, col = 0.0f, dv = 0.0f;
        for (int j = 0; j <= t; ++j) row = row + sW[t * (kQ + 1) + j];
        for (int k = t; k < ck.q; ++k) col = col + sW[k * (kQ + 1) + t];
        for (int i = t; i < ck.q; ++i) dv = dv + sV[i * (kQ + 1) + t];
        ds_in[(ck.m0 + t) * H + h] = row - col;
        ddt_in[(ck.m0 + t) * H + h] = dv;
    }
}

// dx_j[p] = (sum_{i>=j} M_ij dy_i[p] + e_j (dS B_j)[p]) + D dy_j[p] into the
// x columns of dxbc (leading dimension lddx); and three per-head scalars of
// d dt's state terms: rst[m, h] = exp(s_last - s_j) x_j . (dS B_j) and
// o_row[m, h] = exp(s_i) dy_i . (H C_i) (per-lane serial sums over the
// lane's channels, then a butterfly over the 16 lanes of a row), and
// dsh[bc, h] = <dS, H> (per-thread serial, a butterfly per warp, then the
// warps in order). dS = dst[bc][h], H = st[bc][h]. grid (nbc, H), block
// kThreads.
extern "C" __global__ void __launch_bounds__(kThreads, 2)
    mamba_ssd_bwd_dx(const float* __restrict__ xbc, long long ldu, int b_off, int c_off,
                     const float* __restrict__ dt, const float* __restrict__ s,
                     const float* __restrict__ dpar, const float* __restrict__ dy,
                     const float* __restrict__ Mq, const float* __restrict__ st,
                     const float* __restrict__ dst, float* __restrict__ dxbc, long long lddx,
                     float* __restrict__ rst, float* __restrict__ o_row,
                     float* __restrict__ dsh, int T, int H, int P, int N, int hpg, int nc) {
    __shared__ __align__(16) float sA[kTile], sB[kTile];
    __shared__ float sM[kQ * (kQ + 1)];
    __shared__ float sY[kQ * kTp];
    __shared__ float ss[kQ], sdt[kQ];
    __shared__ float sred[kThreads / 32];
    const int bc = blockIdx.x, h = blockIdx.y, g = h / hpg;
    const Chunk ck = chunk_of(bc, nc, T);
    const int tid = threadIdx.x, ti = tid / 16, tj = tid % 16;
    const long long E = (long long)H * P;
    stage_s_dt(s, dt, ck, H, h, ss, sdt);
    const float* mq = Mq + ((long long)bc * H + h) * kQ * kQ;
    for (int idx = tid; idx < kQ * kQ; idx += kThreads) {
        sM[(idx / kQ) * (kQ + 1) + idx % kQ] = mq[idx];
    }
    const float* rows = xbc + ck.m0 * ldu;
    const float* dyr = dy + ck.m0 * E + (long long)h * P;
    const float* ds = dst + ((long long)bc * H + h) * P * N;
    const float* hst = st + ((long long)bc * H + h) * P * N;
    const float dh = dpar[h];
    float part[4] = {}, po[4] = {};
    for (int p0 = 0; p0 < P; p0 += kTp) {
        __syncthreads();
        for (int idx = tid; idx < kQ * kTp; idx += kThreads) {
            const int i = idx / kTp, pp = idx % kTp;
            sY[idx] = (i < ck.q && p0 + pp < P) ? dyr[i * E + p0 + pp] : 0.0f;
        }
        __syncthreads();
        float dxi[4][4] = {};
        for (int i = 4 * ti; i < ck.q; ++i) {
            float yv[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) yv[k] = sY[i * kTp + tj + 16 * k];
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                const float m = sM[i * (kQ + 1) + 4 * ti + a];
#pragma unroll
                for (int k = 0; k < 4; ++k) dxi[a][k] = dxi[a][k] + m * yv[k];
            }
        }
        float sb[4][4];
        rows_product(sb, rows + b_off + g * N, ldu, ck.q, ds + (long long)p0 * N, N,
                     min(kTp, P - p0), N, sA, sB);
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const int j = 4 * ti + a;
            if (j >= ck.q) continue;
            const float e = expf(ss[ck.last_row] - ss[j]) * sdt[j];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int pp = tj + 16 * k;
                if (p0 + pp >= P) continue;
                const long long col = (long long)h * P + p0 + pp;
                dxbc[(ck.m0 + j) * lddx + col] =
                    (dxi[a][k] + e * sb[a][k]) + dh * sY[j * kTp + pp];
                part[a] = part[a] + rows[j * ldu + col] * sb[a][k];
            }
        }
        // (H C_i)[p] of this tile's channels, dotted with dy_i.
        float hc[4][4];
        rows_product(hc, rows + c_off + g * N, ldu, ck.q, hst + (long long)p0 * N, N,
                     min(kTp, P - p0), N, sA, sB);
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            if (4 * ti + a >= ck.q) continue;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int pp = tj + 16 * k;
                if (p0 + pp < P) po[a] = po[a] + sY[(4 * ti + a) * kTp + pp] * hc[a][k];
            }
        }
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const float r = group_sum(part[a], 16);
        const float o = group_sum(po[a], 16);
        const int j = 4 * ti + a;
        if (tj == 0 && j < ck.q) {
            rst[(ck.m0 + j) * H + h] = expf(ss[ck.last_row] - ss[j]) * r;
            o_row[(ck.m0 + j) * H + h] = expf(ss[j]) * o;
        }
    }
    float w = 0.0f;
    for (long long e = tid; e < (long long)P * N; e += kThreads) w = w + ds[e] * hst[e];
    w = group_sum(w, 32);
    if (tid % 32 == 0) sred[tid / 32] = w;
    __syncthreads();
    if (tid == 0) {
        float tot = 0.0f;
        for (int k = 0; k < kThreads / 32; ++k) tot = tot + sred[k];
        dsh[(long long)bc * H + h] = tot;
    }
}

// psum[bc][g][i][j] = sum over the group's heads h (ascending) of
// Pq[bc][h][i][j]: the diagonal block's dB / dC weights of a whole group,
// since B and C are shared by its heads. One thread per element: nbc * G *
// kQ * kQ threads.
extern "C" __global__ void mamba_ssd_bwd_psum(const float* __restrict__ Pq,
                                              float* __restrict__ psum, int H, int hpg,
                                              long long n) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    const long long ij = idx % (kQ * kQ), bg = idx / (kQ * kQ);
    const int G = H / hpg, g = (int)(bg % G);
    const long long bc = bg / G;
    float acc = 0.0f;
    for (int h = g * hpg; h < (g + 1) * hpg; ++h) {
        acc = acc + Pq[((long long)bc * H + h) * kQ * kQ + ij];
    }
    psum[idx] = acc;
}

// acc[a][k] += sum over kk < kDk (ascending) of sA[kk][4 ti + a] sB[kk][tj +
// 16 k]: one staged tile of mamba_ssd_bwd_dbc's product.
__device__ __forceinline__ void dbc_tile(float acc[4][4], const float (*sA)[kQPad],
                                         const float (*sB)[kDn], int ti, int tj) {
#pragma unroll 8
    for (int kk = 0; kk < kDk; ++kk) {
        const float4 av = *reinterpret_cast<const float4*>(&sA[kk][4 * ti]);
        float bv[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) bv[k] = sB[kk][tj + 16 * k];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            acc[0][k] = acc[0][k] + av.x * bv[k];
            acc[1][k] = acc[1][k] + av.y * bv[k];
            acc[2][k] = acc[2][k] + av.z * bv[k];
            acc[3][k] = acc[3][k] + av.w * bv[k];
        }
    }
}

// dB (blockIdx.z even) or dC (odd) of one (chunk, group, kDn states):
//   dB_j[n] = sum_i Psum_ij C_i[n] + sum_(h,p) (e^h_j x_j[hP+p]) dS^h[p][n]
//   dC_i[n] = sum_j Psum_ij B_j[n] + sum_(h,p) (exp(s^h_i) dy_i[hP+p]) H^h[p][n]
// with e^h_j = exp(s_last - s_j) dt_j of head h, and (h, p) over the
// group's heads: one product per output, the Psum steps first, then (h,
// p) ascending, staged kDk steps at a time (sA[k][row], sB[k][state]; a
// head's channels in tiles of their own, so each row's factor is made once
// a head). Thread (ti, tj) owns rows 4 ti + a and states n0 + tj + 16 k.
// Into dxbc's B / C columns. grid (nbc, G, 2 ceil(N / kDn)), block
// kThreads.
extern "C" __global__ void __launch_bounds__(kThreads, 4)
    mamba_ssd_bwd_dbc(const float* __restrict__ xbc, long long ldu, int b_off, int c_off,
                      const float* __restrict__ dt, const float* __restrict__ s,
                      const float* __restrict__ dy, const float* __restrict__ psum,
                      const float* __restrict__ st, const float* __restrict__ dst,
                      float* __restrict__ dxbc, long long lddx, int T, int H, int P, int N,
                      int hpg, int nc) {
    __shared__ __align__(16) float sA[kDk][kQPad];
    __shared__ float sB[kDk][kDn];
    __shared__ float sfac[kQ];
    const int bc = blockIdx.x, g = blockIdx.y;
    const bool want_c = (blockIdx.z & 1) != 0;
    const int n0 = (int)(blockIdx.z >> 1) * kDn;
    const Chunk ck = chunk_of(bc, nc, T);
    const int tid = threadIdx.x, ti = tid / 16, tj = tid % 16;
    const long long E = (long long)H * P;
    const int G = H / hpg;
    const float* rows = xbc + ck.m0 * ldu;
    const float* ps = psum + ((long long)bc * G + g) * kQ * kQ;
    float acc[4][4] = {};
    // The Psum steps: times C (for dB) or B (for dC).
    const int y_col = (want_c ? b_off : c_off) + g * N + n0;
    for (int k0 = 0; k0 < kQ; k0 += kDk) {
        __syncthreads();
        if (!want_c) {
            // sA[kk][j] = Psum[k][j]: rows of Psum, read along j.
            for (int idx = tid; idx < kDk * kQ; idx += kThreads) {
                const int kk = idx / kQ, r = idx % kQ;
                sA[kk][r] = ps[(k0 + kk) * kQ + r];
            }
        } else {
            // sA[kk][i] = Psum[i][k].
            for (int idx = tid; idx < kQ * kDk; idx += kThreads) {
                const int r = idx / kDk, kk = idx % kDk;
                sA[kk][r] = ps[r * kQ + k0 + kk];
            }
        }
        for (int idx = tid; idx < kDk * kDn; idx += kThreads) {
            const int kk = idx / kDn, nn = idx % kDn, k = k0 + kk;
            sB[kk][nn] = (k < ck.q && n0 + nn < N) ? rows[k * ldu + y_col + nn] : 0.0f;
        }
        __syncthreads();
        dbc_tile(acc, sA, sB, ti, tj);
    }
    // The (h, p) steps: (e x) times dS (for dB), or (exp(s) dy) times H (for dC).
    for (int h = g * hpg; h < (g + 1) * hpg; ++h) {
        __syncthreads();
        if (tid < kQ) {
            const long long m = ck.m0 + tid;
            float f = 0.0f;
            if (tid < ck.q) {
                f = want_c ? expf(s[m * H + h])
                           : expf(s[(ck.m0 + ck.last_row) * H + h] - s[m * H + h]) * dt[m * H + h];
            }
            sfac[tid] = f;
        }
        const float* arow = want_c ? dy + ck.m0 * E + (long long)h * P : rows + (long long)h * P;
        const long long lda = want_c ? E : ldu;
        const float* mat = (want_c ? st : dst) + ((long long)bc * H + h) * P * N + n0;
        for (int p0 = 0; p0 < P; p0 += kDk) {
            __syncthreads();
            for (int idx = tid; idx < kQ * kDk; idx += kThreads) {
                const int r = idx / kDk, kk = idx % kDk;
                sA[kk][r] = (r < ck.q && p0 + kk < P) ? sfac[r] * arow[r * lda + p0 + kk] : 0.0f;
            }
            for (int idx = tid; idx < kDk * kDn; idx += kThreads) {
                const int kk = idx / kDn, nn = idx % kDn;
                sB[kk][nn] =
                    (p0 + kk < P && n0 + nn < N) ? mat[(long long)(p0 + kk) * N + nn] : 0.0f;
            }
            __syncthreads();
            dbc_tile(acc, sA, sB, ti, tj);
        }
    }
    const int col0 = (want_c ? c_off : b_off) + g * N + n0;
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const int r = 4 * ti + a;
        if (r >= ck.q) continue;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int nn = tj + 16 * k;
            if (n0 + nn < N) dxbc[(ck.m0 + r) * lddx + col0 + nn] = acc[a][k];
        }
    }
}

// d dt of one (chunk, head) (module docs), times softplus' from dt itself
// (sigmoid(pre) = -expm1(-dt)), into ddt_raw[m * ld_ddt + h] and / or its
// bf16 rounding into ddt_h there (the one not wanted null); and
// da_part[bc, h] = sum_k da_k dt_k. One warp per (chunk, head), lane l
// holding rows 2l and 2l + 1: the sums over the chunk are a butterfly
// (group_sum), the suffix sums da_k a fixed shuffle scan over the lanes'
// pair sums (kQ = 64 rows, two a lane). nbc * H warps, blocks of kThreads.
extern "C" __global__ void mamba_ssd_bwd_dt(
    const float* __restrict__ dt, const float* __restrict__ s, const float* __restrict__ a_log,
    const float* __restrict__ ds_in, const float* __restrict__ ddt_in,
    const float* __restrict__ rst, const float* __restrict__ o_row,
    const float* __restrict__ dsh, float* __restrict__ ddt_raw,
    unsigned short* __restrict__ ddt_h, long long ld_ddt, float* __restrict__ da_part, int T,
    int H, int nc, int nbc) {
    static_assert(kQ == 64, "two rows a lane");
    const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (w >= (long long)nbc * H) return;  // the whole warp: w is the warp's
    const int h = (int)(w % H), bc = (int)(w / H);
    const Chunk ck = chunk_of(bc, nc, T);
    const float A = -expf(a_log[h]);
    float rdt[2], ds[2], dtv[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int k = 2 * lane + u;
        rdt[u] = ds[u] = dtv[u] = 0.0f;
        if (k < ck.q) {
            const long long r = (ck.m0 + k) * H + h;
            dtv[u] = dt[r];
            rdt[u] = rst[r] * dtv[u];
            ds[u] = (ds_in[r] + o_row[r]) - rdt[u];
        }
    }
    const float tot_r = group_sum(rdt[0] + rdt[1], 32);
    const long long rl = (ck.m0 + ck.last_row) * H + h;
    const float last_extra = tot_r + expf(s[rl]) * dsh[(long long)bc * H + h];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        if (2 * lane + u == ck.last_row) ds[u] = ds[u] + last_extra;
    }
    // Inclusive suffix sums over lanes of the pairs, then each row's own.
    float suf = ds[0] + ds[1];
    for (int off = 1; off < 32; off <<= 1) {
        const float v = __shfl_down_sync(0xffffffffu, suf, off);
        if (lane + off < 32) suf = suf + v;
    }
    float after = __shfl_down_sync(0xffffffffu, suf, 1);
    if (lane == 31) after = 0.0f;
    float suffix[2];
    suffix[1] = after + ds[1];
    suffix[0] = suffix[1] + ds[0];
    float da = 0.0f;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int k = 2 * lane + u;
        if (k >= ck.q) continue;
        const long long r = (ck.m0 + k) * H + h;
        const float ddt = (ddt_in[r] + rst[r]) + suffix[u] * A;
        store_f32_bf16(ddt_raw, ddt_h, (ck.m0 + k) * ld_ddt + h, ddt * -expm1f(-dtv[u]));
        da = da + suffix[u] * dtv[u];
    }
    da = group_sum(da, 32);
    if (lane == 0) da_part[(long long)bc * H + h] = da;
}

// da_log[h] = A_h * sum over chunks (ascending) of da_part[bc, h]. One
// thread per head.
extern "C" __global__ void mamba_ssd_dalog(const float* __restrict__ da_part,
                                           const float* __restrict__ a_log,
                                           float* __restrict__ da_log, int H, int nbc) {
    const int h = blockIdx.x * blockDim.x + threadIdx.x;
    if (h >= H) return;
    float acc = 0.0f;
    for (int bc = 0; bc < nbc; ++bc) acc = acc + da_part[(long long)bc * H + h];
    da_log[h] = acc * -expf(a_log[h]);
}

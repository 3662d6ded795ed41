// The SSD scan's chunk products on tensor cores (tf32 mma.sync, f32
// accumulators): the kernels of tf32 and bf16 runs that replace
// mamba_ssd.cu's SIMT chunk_out, bwd_qq, bwd_dx and bwd_dbc with the same
// arguments, the same outputs and the same algorithm (mamba_ssd.cu's module
// docs derive it), and its chunk_state + state_pass pair with one kernel
// (state_scan_tc: the pair's arguments and outputs, one launch over the
// sequences instead of two). Two more differences: C B^T, which every head
// of a group shares, is made once per (chunk, group) by mamba_ssd_cb_tc and
// read by chunk_out and bwd_qq (their one extra argument) instead of once
// per head; and the chunk states never reach memory, only the entry states
// made from them. The other SSD kernels (running sums, psum, d dt, dA_log)
// have no product and are shared. The state kernels come twice: the
// entry states and their gradients kept in f32 (tf32 runs) or in bf16
// (the _h twins, bf16 runs; ssd_tc_tiles.cuh says how they are staged).
// f32 runs keep the SIMT kernels: their
// contract is 5e-5 of the f64 program, which tf32 operands (2^-11 relative)
// cannot keep.
//
// Layout and staging: ssd_tc_tiles.cuh.
//
// Determinism: no atomics; the same bits run to run on one GPU model (the
// tensor core's order inside an mma is the hardware's). Contract: the
// tolerance of tests/cuda_mamba2.rs' tf32 / bf16 cases against the f64
// program, and the emulated check (kernels/emu/ssd_check.cpp with
// EMU_TC=1) against the sequential f64 recurrence.
//
// Over 450 lines: one set of kernels, the six of the tensor-core products,
// each the twin of SIMT kernels of mamba_ssd.cu (or, for cb, of the product
// those repeat per head), sharing the tiles of ssd_tc_tiles.cuh.
#include "cp_async.cuh"
#include "ssd_tc_tiles.cuh"

using namespace mamba;
using namespace mamba_ssd;
using namespace mamba_ssd_tc;

// cb[bc][g][i][j] = C_i . B_j of one (chunk, group), all 64 x 64 (rows and
// columns past the chunk's end are 0): what the chunk outputs and the
// backward's Q x Q kernel of every head of the group read, computed once
// per group instead of once per head. xbc kept as S (ssd_tc_tiles.cuh: f32,
// or bf16 in mamba_ssd_cb_tc_h). grid (nbc, G), block kThreads.
template <class S>
__device__ __forceinline__ void cb_tc(const S* __restrict__ xbc, long long ldu, int b_off,
                                      int c_off, float* __restrict__ cb, int T, int N, int nc) {
    // One buffer per operand for the f32 kernel, two (cp.async) for the
    // bf16 one; 16-byte aligned for its 16-byte copies.
    constexpr int kBufs = sizeof(S) == 4 ? 1 : 2;
    __shared__ __align__(16) float sA[kBufs * kStage];
    __shared__ __align__(16) float sB[kBufs * kStage];
    const int bc = blockIdx.x, g = blockIdx.y, G = gridDim.y;
    const Chunk ck = chunk_of(bc, nc, T);
    const S* rows = xbc + ck.m0 * ldu;
    const Share w = share();
    Tile t;
    const bool vec = kept_vec(xbc, ldu | N | b_off | c_off);
    cb_product(t, w, rows + c_off + g * N, rows + b_off + g * N, (int)ldu, ck.q, N, sA, sB, vec);
    store_tile_f32(t, w, cb + ((long long)bc * G + g) * kQ * kQ, kQ, kQ, kQ, true);
}

#define MAMBA_SSD_CB(name, S)                                                                \
    extern "C" __global__ void __launch_bounds__(kThreads)                                   \
        name(const S* __restrict__ xbc, long long ldu, int b_off, int c_off,                 \
             float* __restrict__ cb, int T, int N, int nc) {                                 \
        cb_tc(xbc, ldu, b_off, c_off, cb, T, N, nc);                                         \
    }
MAMBA_SSD_CB(mamba_ssd_cb_tc, float)
MAMBA_SSD_CB(mamba_ssd_cb_tc_h, unsigned short)

// mamba_ssd_chunk_state and mamba_ssd_state_pass in one kernel, on tensor
// cores: each block owns one 64 x 64 tile of one (sequence, head)'s state
// and walks its chunks in the pass's order (mode 0 forward, mode 1 in
// reverse), making each chunk's state S_c[p][n] = sum_j (w_j X_j[p]) Y_j[n]
// by mma over the whole chunk, then, in its registers, out[c] = carry;
// carry = exp(s_last_c) carry + S_c (H_0 = 0, or dH past the last chunk =
// 0): state_pass's arithmetic in its order on the products a separate
// tensor-core chunk-state kernel would store (the emulated check's digests
// did not move when this kernel replaced that pair), without S_c's round
// trip through memory or a second launch. The weights are those of
// mamba_ssd_chunk_state: mode 0 (X = x, Y = B) w_j = exp(s_last - s_j) dt_j,
// mode 1 (X = dy, Y = C) w_j = exp(s_j), applied to X as the mma reads it
// (the product w_j X_j[p] a staged operand would hold). Only the entry
// states (or their gradients) are written, into out ([B*nc][H][P][N]).
//
// Staging: the X and Y tiles of the chunks ahead, with their rows' s and
// dt, are copied by cp.async into a ring of buffers (kStateScanSmemFloats
// of dynamic shared memory: two of f32 tiles, four of bf16 ones) while
// chunk c's mma runs, so no thread holds them in registers; two barriers a
// chunk (its copies landed; its weights made). 16-byte copies when every
// row of both tiles starts 16-byte aligned (`vec`), else 4-byte ones;
// either lands the same values.
// grid (B, H, ceil(P / 64) * ceil(N / 64)), block kThreads.
//
// The kept tensors are S (ssd_tc_tiles.cuh): X (x or dy) and Y (B or C)
// are read and the states written as f32, or as bf16
// (mamba_ssd_state_scan_tc_h). The carry stays f32 either way.
template <class S>
__device__ __forceinline__ void state_scan_tc(const S* __restrict__ X, long long ldx,
                                              const S* __restrict__ Y, long long ldy,
                                              int y_off, const float* __restrict__ dt,
                                              const float* __restrict__ s, S* __restrict__ out,
                                              int T, int H, int P, int N, int hpg, int nc,
                                              int mode) {
#ifdef MAMBA_CUDA_EMU
    float* smem = EMU_SMEM;
#else
    extern __shared__ __align__(16) float smem[];
#endif
    // kBufs buffers of chunk tiles (the f32 kernel's two fill the dynamic
    // shared memory; bf16 tiles take half the room, so four), copies
    // issued kBufs - 1 chunks ahead: a chunk's mma is short next to a
    // memory latency, and one chunk ahead left the walk waiting on each
    // copy. sraw holds each staged chunk's s and dt (its weights' inputs).
    constexpr int kBufs = sizeof(S) == 4 ? 2 : 4;
    constexpr int kBufFloats = kStateScanSmemFloats / kBufs;
    static_assert(2 * kStateScanTile * (int)sizeof(S) / 4 <= kBufFloats,
                  "a buffer holds a chunk's X and Y tiles");
    __shared__ float sraw[kBufs][2][kQ];
    __shared__ float sw[kQ], sdecay;
    const int b = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int tiles_n = (N + kQ - 1) / kQ;
    const int p0 = (blockIdx.z / tiles_n) * kQ, n0 = (blockIdx.z % tiles_n) * kQ;
    const int g = h / hpg;
    const bool vec_x = kept_vec(X, ldx | P), vec_y = kept_vec(Y, ldy | N | y_off);
    const bool pairs =
        (N & 1) == 0 && (reinterpret_cast<unsigned long long>(out) & (2 * sizeof(S) - 1)) == 0;
    // Step k of the pass: chunk c (of sequence b) and its rows.
    auto chunk_at = [&](int k) { return mode == 0 ? k : nc - 1 - k; };
    auto rows_of = [&](int k) { return chunk_of(b * nc + chunk_at(k), nc, T); };
    auto tile_x = [&](int buf) { return smem + buf * kBufFloats; };
    // Chunk k's X and Y tiles into buffer k % kBufs, step-major ([j][kKm]),
    // rows past the chunk and columns past P / N zero (plain stores: the
    // barrier that follows the wait covers them too), and its s and dt;
    // then one committed group (an empty one past the last chunk, so that
    // chunk k's group is always the k-th).
    auto stage = [&](int k) {
        if (k < nc) {
            const int buf = k % kBufs;
            const Chunk ck = rows_of(k);
            float* dX = tile_x(buf);
            float* dY = dX + kStateScanTile * (int)sizeof(S) / 4;
            stage_tile<kKm>(dX, X + ck.m0 * ldx + h * P + p0, ldx, vec_x,
                            [&](int j, int c) { return j < ck.q && p0 + c < P; });
            stage_tile<kKm>(dY, Y + ck.m0 * ldy + y_off + g * N + n0, ldy, vec_y,
                            [&](int j, int c) { return j < ck.q && n0 + c < N; });
            if (tid < kQ) {
                const int at = tid * H + h;  // of the chunk's rows: < 2^31 (SsdShape)
                cp_async_piece(&sraw[buf][0][tid], s + ck.m0 * H + at, tid < ck.q, 1);
                cp_async_piece(&sraw[buf][1][tid], dt + ck.m0 * H + at, tid < ck.q, 1);
            }
        }
        cp_async_commit();
    };
    const Share w = share();
    float carry[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) carry[nt][e] = 0.0f;
    for (int k = 0; k + 1 < kBufs; ++k) stage(k);
    for (int k = 0; k < nc; ++k) {
        const int buf = k % kBufs;
        const Chunk ck = rows_of(k);
        cp_async_wait(kBufs - 2);
        // Chunk k's copies are in place for every thread, and chunk k - 1's
        // mma is done with its buffer (which chunk k + kBufs - 1 takes) and
        // with sw.
        __syncthreads();
        stage(k + kBufs - 1);
        // Chunk k's weights: mode 0 (X = x) w_j = exp(s_last - s_j) dt_j,
        // mode 1 (X = dy) w_j = exp(s_j); and its decay exp(s_last).
        if (tid < kQ) {
            const float s_j = sraw[buf][0][tid], s_last = sraw[buf][0][ck.last_row];
            sw[tid] = tid >= ck.q ? 0.0f
                      : mode == 0 ? expf(s_last - s_j) * sraw[buf][1][tid]
                                  : expf(s_j);
            if (tid == 0) sdecay = expf(s_last);
        }
        __syncthreads();
        const float* sX = tile_x(buf);
        const float* sY = sX + kStateScanTile * (int)sizeof(S) / 4;
        Tile t;
        t.zero();
        t.mma_a([&](int r, int j) { return sw[j] * tile_at<kKm, S>(sX, j, w.r0 + r); },
                tile_of<kKm, S>(sY) + w.c0, tile_ld<kKm, S>, 1, (ck.q + 7) / 8);
        const float decay = sdecay;
        S* o = out + ((long long)(b * nc + chunk_at(k)) * H + h) * P * N;
        // A fragment's elements e and e + 1 are adjacent states (n even):
        // one store of the pair when both exist and N is even (the pair then
        // starts aligned to its size when out does), so each 32-byte sector
        // is written whole.
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const int p = p0 + w.r0 + Tile::row(e), n = n0 + w.c0 + Tile::col(nt, e);
                S* on = o + (long long)p * N + n;
                if (p < P && n + 1 < N && pairs) {
                    put_state_pair(on, carry[nt][e], carry[nt][e + 1]);
                } else if (p < P) {
                    if (n < N) put_state(on, carry[nt][e]);
                    if (n + 1 < N) put_state(on + 1, carry[nt][e + 1]);
                }
                carry[nt][e] = decay * carry[nt][e] + t.acc[nt][e];
                carry[nt][e + 1] = decay * carry[nt][e + 1] + t.acc[nt][e + 1];
            }
    }
}

// The entry points of each kept type (S): the f32 kernel, and its _h twin
// whose kept tensors are unsigned short (bf16).
#define MAMBA_SSD_STATE_SCAN(name, S)                                                       \
    extern "C" __global__ void __launch_bounds__(kThreads, 3)                               \
        name(const S* __restrict__ X, long long ldx, const S* __restrict__ Y, long long ldy, \
             int y_off, const float* __restrict__ dt, const float* __restrict__ s,          \
             S* __restrict__ out, int T, int H, int P, int N, int hpg, int nc, int mode) {  \
        state_scan_tc(X, ldx, Y, ldy, y_off, dt, s, out, T, H, P, N, hpg, nc, mode);        \
    }
MAMBA_SSD_STATE_SCAN(mamba_ssd_state_scan_tc, float)
MAMBA_SSD_STATE_SCAN(mamba_ssd_state_scan_tc_h, unsigned short)

// mamba_ssd_chunk_out on tensor cores (its arguments, then the group's
// C B^T from mamba_ssd_cb_tc; the same outputs): per 64 channels, y = M x +
// (exp(s_i) C_i) H^T, accumulated in that order (M x over 32-token tiles,
// the state product over 32-state steps, each ascending), plus D x. grid
// (nbc, H), block kThreads, kStagedSmemFloats of dynamic shared memory.
//
// Staging: the chunk's x tile (step-major) and the C and H tiles of 64
// states (row-major, two buffers) arrive by cp.async, issued before the
// weights M are made, so the block's loads are in flight together; the
// next state tile's while the current one's mma runs. exp(s_i) scales C as
// the mma reads it (the product a staged operand would hold), and D x reads
// the staged x: the register-staged kernel's values and order, so its bits.
// In mamba_ssd_chunk_out_tc_h the kept tensors (S: x, C and the states)
// are staged as bf16 in their f32 tiles' space and widened as they are
// read.
template <class S>
__device__ __forceinline__ void chunk_out_tc(
    const S* __restrict__ xbc, long long ldu, int b_off, int c_off,
    const float* __restrict__ dt, const float* __restrict__ s, const float* __restrict__ dpar,
    const S* __restrict__ st, const float* __restrict__ z, const unsigned short* __restrict__ zh,
    long long ldz, float* __restrict__ y, unsigned short* __restrict__ yh,
    float* __restrict__ gate, unsigned short* __restrict__ gateh, int T, int H, int P, int N,
    int hpg, int nc, const float* __restrict__ cbg) {
#ifdef MAMBA_CUDA_EMU
    float* smem = EMU_SMEM;
#else
    extern __shared__ __align__(16) float smem[];
#endif
    // sM's stride of 68 puts a fragment's rows g and steps t in banks 4 g + t.
    constexpr int kMs = kQ + 4;
    __shared__ float sM[kQ * kMs];
    __shared__ float ss[kQ], sdt[kQ], ses[kQ];
    float* const sX = smem;
    auto sC = [&](int buf) { return smem + kStateScanTile + buf * 2 * kOutStateTile; };
    auto sH = [&](int buf) { return sC(buf) + kOutStateTile; };
    const int bc = blockIdx.x, h = blockIdx.y, g = h / hpg;
    const Chunk ck = chunk_of(bc, nc, T);
    const int tid = threadIdx.x;
    const long long E = (long long)H * P;
    const S* rows = xbc + ck.m0 * ldu;
    const S* Cr = rows + c_off + g * N;
    const S* hst = st + ((long long)bc * H + h) * P * N;
    const bool vec_u = kept_vec(xbc, ldu | P | N | c_off), vec_st = kept_vec(st, N);
    // x of channels p0.. (step-major [j][.]) and the state tile nt of C
    // (rows i) and H (rows p) into buffer buf.
    auto stage_x = [&](int p0) {
        stage_tile<kKm>(sX, rows + h * P + p0, ldu, vec_u,
                        [&](int j, int c) { return j < ck.q && p0 + c < P; });
        cp_async_commit();
    };
    auto stage_state = [&](int p0, int nt, int buf) {
        const int n0 = nt * kQ;
        stage_tile<kOutLd>(sC(buf), Cr + n0, ldu, vec_u,
                           [&](int r, int c) { return r < ck.q && n0 + c < N; });
        stage_tile<kOutLd>(sH(buf), hst + (long long)p0 * N + n0, N, vec_st,
                           [&](int r, int c) { return p0 + r < P && n0 + c < N; });
        cp_async_commit();
    };
    const int ntn = (N + kQ - 1) / kQ;
    // The 8-step mma steps of the state product: those of its 32-state
    // tiles, so no more steps of zeros run than the register-staged kernel's.
    const int state_steps = 4 * ((N + kKt - 1) / kKt);
    stage_x(0);
    stage_state(0, 0, 0);
    stage_s_dt(s, dt, ck, H, h, ss, sdt);
    const Share w = share();
    Tile t;
    load_cb(t, w, cbg + ((long long)bc * (H / hpg) + g) * kQ * kQ);
    __syncthreads();  // ss and sdt
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = w.r0 + Tile::row(e), j = w.c0 + Tile::col(nt, e);
            sM[i * kMs + j] = weight_m(t.acc[nt][e], ss, sdt, i, j, ck.q);
        }
    if (tid < kQ) ses[tid] = tid < ck.q ? expf(ss[tid]) : 0.0f;
    const float dh = dpar[h];
    for (int p0 = 0; p0 < P; p0 += kQ) {
        if (p0 > 0) {
            __syncthreads();  // the previous channels' reads of sX and the buffers
            stage_x(p0);
            stage_state(p0, 0, 0);
        }
        t.zero();
        for (int nt = 0; nt < ntn; ++nt) {
            if (nt + 1 < ntn) {
                // Buffer (nt + 1) & 1's last reader was tile nt - 1's mma.
                if (nt > 0) __syncthreads();
                stage_state(p0, nt + 1, (nt + 1) & 1);
                cp_async_wait(1);
            } else {
                cp_async_wait(0);
            }
            __syncthreads();  // x (and sM, ses) and state tile nt landed for all
            if (nt == 0) {
                // M x over j, 32 at a time; a warp skips the tiles past its
                // last row (M is zero above the diagonal).
                for (int j0 = 0; j0 < ck.q; j0 += kKt) {
                    if (j0 <= w.r0 + 15) {
                        constexpr int ldx = tile_ld<kKm, S>;
                        t.mma(sM + w.r0 * kMs + j0, kMs, 1,
                              tile_of<kKm, S>(sX) + j0 * ldx + w.c0, ldx, 1, kKt / 8);
                    }
                }
            }
            const float* cb_ = sC(nt & 1);
            const float* es = ses + w.r0;
            const auto c_at = [&](int r, int k) {
                return es[r] * tile_at<kOutLd, S>(cb_, w.r0 + r, k);
            };
            const int steps = min(8, state_steps - 8 * nt);
            constexpr int ldh = tile_ld<kOutLd, S>;
            t.mma_a(c_at, tile_of<kOutLd, S>(sH(nt & 1)) + w.c0 * ldh, 1, ldh, steps);
        }
        // The outputs through shared memory (tile_rows8): y's f32 values
        // into the first state buffer (free once every warp's mma is done),
        // then z, y and the gate in runs of 8 channels a thread.
        __syncthreads();
        tile_rows8(
            t, w, sC(0), ck.q, P - p0,
            [&](int i, int pp, float acc) { return acc + dh * tile_at<kKm, S>(sX, i, pp); },
            [&](int i, int c8, int n, float(&v)[8]) {
                const long long r = ck.m0 + i;
                const long long col = (long long)h * P + p0 + c8;
                const long long at = r * E + col, zat = r * ldz + col;
                float zv[8];
                load8_f32_bf16(z, zh, zat, n, kept_vec8(z, zh, zat, n), zv);
                // The gate reads y as it is kept, as the gate's backward does.
                store8_kept(y, yh, at, n, kept_vec8(y, yh, at, n), v);
#pragma unroll
                for (int k = 0; k < 8; ++k) v[k] = gate_out(v[k], zv[k]);
                store8_f32_bf16(gate, gateh, at, n, kept_vec8(gate, gateh, at, n), v);
            });
    }
}

#define MAMBA_SSD_CHUNK_OUT(name, S)                                                         \
    extern "C" __global__ void __launch_bounds__(kThreads, 2)                                \
        name(const S* __restrict__ xbc, long long ldu, int b_off, int c_off,                 \
             const float* __restrict__ dt, const float* __restrict__ s,                      \
             const float* __restrict__ dpar, const S* __restrict__ st,                       \
             const float* __restrict__ z, const unsigned short* __restrict__ zh,             \
             long long ldz, float* __restrict__ y, unsigned short* __restrict__ yh,          \
             float* __restrict__ gate, unsigned short* __restrict__ gateh, int T, int H,     \
             int P, int N, int hpg, int nc, const float* __restrict__ cbg) {                 \
        chunk_out_tc(xbc, ldu, b_off, c_off, dt, s, dpar, st, z, zh, ldz, y, yh, gate,      \
                     gateh, T, H, P, N, hpg, nc, cbg);                                       \
    }
MAMBA_SSD_CHUNK_OUT(mamba_ssd_chunk_out_tc, float)
MAMBA_SSD_CHUNK_OUT(mamba_ssd_chunk_out_tc_h, unsigned short)

// mamba_ssd_bwd_qq on tensor cores (its arguments, then the group's C B^T
// from mamba_ssd_cb_tc; the same outputs): dd = dy x^T by mma, then the
// same weights and the same serial row / column sums; x and dy kept as S
// (mamba_ssd_bwd_qq_tc_h: bf16, widened as they are staged). grid (nbc,
// H), block kThreads.
template <class S>
__device__ __forceinline__ void bwd_qq_tc(const S* __restrict__ xbc, long long ldu,
                                          const float* __restrict__ dt,
                                          const float* __restrict__ s,
                                          const S* __restrict__ dy, float* __restrict__ Mq,
                                          float* __restrict__ Pq, float* __restrict__ ds_in,
                                          float* __restrict__ ddt_in, int T, int H, int P,
                                          int hpg, int nc, const float* __restrict__ cbg) {
    // 16-step tiles (stride 20: banks 20 g + t, distinct) leave room for
    // the two 64 x 65 weight matrices under the 48 KiB of static memory.
    constexpr int kT = 16, kR = kT + 4;
    __shared__ float sA[kQ * kR], sB[kQ * kR];
    __shared__ float sW[kQ * (kQ + 1)], sV[kQ * (kQ + 1)];
    __shared__ float ss[kQ], sdt[kQ];
    const int bc = blockIdx.x, h = blockIdx.y, g = h / hpg;
    const Chunk ck = chunk_of(bc, nc, T);
    const int tid = threadIdx.x;
    const long long E = (long long)H * P;
    stage_s_dt(s, dt, ck, H, h, ss, sdt);
    const S* rows = xbc + ck.m0 * ldu;
    const Share w = share();
    // Both products stage rows r < q of two matrices, kT steps a tile.
    auto product = [&](Tile& t, const auto* Ar, int lda, const auto* Br, int ldb, int K) {
        t.zero();
        contract<RowMajor<kT>, RowMajor<kT>>(
            (K + kT - 1) / kT, sA, sB,
            [&](int k, int r, int kk) {
                const int c = k * kT + kk;
                return r < ck.q && c < K ? kept_f32(Ar[r * lda + c]) : 0.0f;
            },
            [&](int k, int r, int kk) {
                const int c = k * kT + kk;
                return r < ck.q && c < K ? kept_f32(Br[r * ldb + c]) : 0.0f;
            },
            [&](int) { t.mma(sA + w.r0 * kR, kR, 1, sB + w.c0 * kR, 1, kR, kT / 8); });
    };
    Tile cb, dd;
    load_cb(cb, w, cbg + ((long long)bc * (H / hpg) + g) * kQ * kQ);
    const int ldi = (int)ldu;
    product(dd, dy + ck.m0 * E + (long long)h * P, (int)E, rows + h * P, ldi, P);
    float* mq = Mq + ((long long)bc * H + h) * kQ * kQ;
    float* pq = Pq + ((long long)bc * H + h) * kQ * kQ;
    // Elements e and e + 1 of a fragment are adjacent columns: their M and
    // P values go out as one 8-byte store, so a row's four lanes write
    // whole 32-byte sectors (4-byte stores wrote each sector in halves).
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e0 = 0; e0 < 4; e0 += 2) {
            // Element e's M and P values; its W and V into shared memory.
            const auto make = [&](int e, float& mv, float& pv) {
                const int i = w.r0 + Tile::row(e), j = w.c0 + Tile::col(nt, e);
                const bool in = j <= i && i < ck.q;
                const float l = in ? expf(ss[i] - ss[j]) : 0.0f;
                const float cbl = l * cb.acc[nt][e];
                const float m = cbl * sdt[j];
                const float d = dd.acc[nt][e];
                mv = in ? m : 0.0f;
                pv = in ? (l * sdt[j]) * d : 0.0f;
                sW[i * (kQ + 1) + j] = in ? m * d : 0.0f;
                sV[i * (kQ + 1) + j] = in ? cbl * d : 0.0f;
            };
            float m0, p0, m1, p1;
            make(e0, m0, p0);
            make(e0 + 1, m1, p1);
            const int i = w.r0 + Tile::row(e0), j = w.c0 + Tile::col(nt, e0);
            *reinterpret_cast<float2*>(mq + i * kQ + j) = float2{m0, m1};
            *reinterpret_cast<float2*>(pq + i * kQ + j) = float2{p0, p1};
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

#define MAMBA_SSD_BWD_QQ(name, S)                                                            \
    extern "C" __global__ void __launch_bounds__(kThreads)                                   \
        name(const S* __restrict__ xbc, long long ldu, int b_off, int c_off,                 \
             const float* __restrict__ dt, const float* __restrict__ s,                      \
             const S* __restrict__ dy, float* __restrict__ Mq, float* __restrict__ Pq,       \
             float* __restrict__ ds_in, float* __restrict__ ddt_in, int T, int H, int P,     \
             int N, int hpg, int nc, const float* __restrict__ cbg) {                        \
        bwd_qq_tc(xbc, ldu, dt, s, dy, Mq, Pq, ds_in, ddt_in, T, H, P, hpg, nc, cbg);        \
    }
MAMBA_SSD_BWD_QQ(mamba_ssd_bwd_qq_tc, float)
MAMBA_SSD_BWD_QQ(mamba_ssd_bwd_qq_tc_h, unsigned short)

// mamba_ssd_bwd_dx on tensor cores (same arguments and outputs), per 64
// channels: hc = C H^T (its rows dotted with dy give o_row), sb = B dS^T
// (dotted with x: rst), then dx = (e_j sb) + M^T dy + D dy, the M^T dy
// steps accumulated onto the scaled sb. The per-row dots: each lane's
// serial sum over its columns, a butterfly over the 4 lanes of a row's
// quad, then the two column halves in order. grid (nbc, H), block kThreads,
// kStagedSmemFloats of dynamic shared memory.
//
// Staging (chunk_out_tc's): M and the dy tile, then the two products' state
// tiles of 64 (C with H, then B with dS, row-major, two buffers) arrive by
// cp.async, the next tile in flight while the current one's mma runs; the
// dots and D dy read the staged dy. The sums and their order are the
// register-staged kernel's (32-state mma steps, 32-row tiles of M^T dy).
// In mamba_ssd_bwd_dx_tc_h the kept tensors (S: x, B, C, dy, H and dS) are
// bf16, staged as bf16 as in chunk_out_tc.
template <class S>
__device__ __forceinline__ void bwd_dx_tc(
    const S* __restrict__ xbc, long long ldu, int b_off, int c_off,
    const float* __restrict__ dt, const float* __restrict__ s, const float* __restrict__ dpar,
    const S* __restrict__ dy, const float* __restrict__ Mq, const S* __restrict__ st,
    const S* __restrict__ dst, float* __restrict__ dxbc, long long lddx,
    float* __restrict__ rst, float* __restrict__ o_row, float* __restrict__ dsh, int T, int H,
    int P, int N, int hpg, int nc) {
#ifdef MAMBA_CUDA_EMU
    float* smem = EMU_SMEM;
#else
    extern __shared__ __align__(16) float smem[];
#endif
    __shared__ __align__(16) float sM[kQ * kKm];  // M[i][j]: read as A(j, i), step-major
    __shared__ float ss[kQ], sdt[kQ], se[kQ];
    __shared__ float sdot[2][2][kQ];  // [rst / o_row][column half][row]
    __shared__ float sred[kThreads / 32];
    float* const sDy = smem;  // dy of the channels p0.., step-major [i][.]
    auto sA = [&](int buf) { return smem + kStateScanTile + buf * 2 * kOutStateTile; };
    auto sB = [&](int buf) { return sA(buf) + kOutStateTile; };
    const int bc = blockIdx.x, h = blockIdx.y, g = h / hpg;
    const Chunk ck = chunk_of(bc, nc, T);
    const int tid = threadIdx.x;
    const long long E = (long long)H * P;
    const S* rows = xbc + ck.m0 * ldu;
    const S* dyr = dy + ck.m0 * E + (long long)h * P;
    const S* ds = dst + ((long long)bc * H + h) * P * N;
    const S* hst = st + ((long long)bc * H + h) * P * N;
    const float* mq = Mq + ((long long)bc * H + h) * kQ * kQ;
    const bool vec_dy = kept_vec(dy, P), vec_m = kept_vec(Mq, 0);
    const bool vec_u = kept_vec(xbc, ldu | N | b_off | c_off), vec_x = kept_vec(xbc, ldu | P);
    const bool vec_st = kept_vec(st, N) && kept_vec(dst, N);
    // M (every step of it, the first tile only) and dy of the channels p0..
    auto stage_dy = [&](int p0) {
        if (p0 == 0) {
            tile_pieces(vec_m, [&](int r, int c, int width) {
                cp_async_piece(sM + r * kKm + c, mq + r * kQ + c, true, width);
            });
        }
        stage_tile<kKm>(sDy, dyr + p0, E, vec_dy,
                        [&](int r, int c) { return r < ck.q && p0 + c < P; });
        cp_async_commit();
    };
    // State tile k of the two products: k < ntn the (C, H) tile k, else the
    // (B, dS) tile k - ntn; A rows i / j of the chunk, B rows p0 + p.
    const int ntn = (N + kQ - 1) / kQ;
    auto stage_state = [&](int p0, int k, int buf) {
        const bool first = k < ntn;
        const int n0 = (first ? k : k - ntn) * kQ;
        const S* Ar = rows + (first ? c_off : b_off) + g * N + n0;
        const S* Br = (first ? hst : ds) + n0;
        stage_tile<kOutLd>(sA(buf), Ar, ldu, vec_u,
                           [&](int r, int c) { return r < ck.q && n0 + c < N; });
        stage_tile<kOutLd>(sB(buf), Br + (long long)p0 * N, N, vec_st,
                           [&](int r, int c) { return p0 + r < P && n0 + c < N; });
        cp_async_commit();
    };
    const int state_steps = 4 * ((N + kKt - 1) / kKt);
    stage_dy(0);
    stage_state(0, 0, 0);
    stage_s_dt(s, dt, ck, H, h, ss, sdt);
    __syncthreads();
    if (tid < kQ) se[tid] = tid < ck.q ? expf(ss[ck.last_row] - ss[tid]) * sdt[tid] : 0.0f;
    const float dh = dpar[h];
    const Share w = share();
    float part[2] = {0.0f, 0.0f}, po[2] = {0.0f, 0.0f};
    Tile t;
    for (int p0 = 0; p0 < P; p0 += kQ) {
        if (p0 > 0) {
            __syncthreads();  // the previous channels' reads of sDy and the buffers
            stage_dy(p0);
            stage_state(p0, 0, 0);
        }
        t.zero();
        for (int k = 0; k < 2 * ntn; ++k) {
            if (k + 1 < 2 * ntn) {
                // Buffer (k + 1) & 1's last reader was tile k - 1's mma.
                if (k > 0) __syncthreads();
                stage_state(p0, k + 1, (k + 1) & 1);
                cp_async_wait(1);
            } else {
                cp_async_wait(0);
            }
            __syncthreads();  // M, dy (and se) and state tile k landed for all
            if (k + 1 == 2 * ntn) {
                // x of the channels p0.. into buffer 0 (tile k, the last, is
                // odd: buffer 0's last reader, tile k - 1, is done), in
                // flight while this tile's mma runs.
                stage_tile<kOutLd>(sA(0), rows + h * P + p0, ldu, vec_x,
                                   [&](int r, int c) { return r < ck.q && p0 + c < P; });
                cp_async_commit();
            }
            const int nt = k < ntn ? k : k - ntn;
            const int steps = min(8, state_steps - 8 * nt);
            const float* a_t = sA(k & 1);
            constexpr int ldb = tile_ld<kOutLd, S>;
            t.mma_a([&](int r, int kk) { return tile_at<kOutLd, S>(a_t, w.r0 + r, kk); },
                    tile_of<kOutLd, S>(sB(k & 1)) + w.c0 * ldb, 1, ldb, steps);
            if (k == ntn - 1) {
                // (H C_i)[p] of this tile's channels, dotted with dy_i.
#pragma unroll
                for (int q = 0; q < 4; ++q)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int i = w.r0 + Tile::row(e), pp = w.c0 + Tile::col(q, e);
                        if (i < ck.q && p0 + pp < P) {
                            po[e >> 1] = po[e >> 1] + tile_at<kKm, S>(sDy, i, pp) * t.acc[q][e];
                        }
                    }
                t.zero();
            }
        }
        cp_async_wait(0);
        __syncthreads();  // x landed for all
        // (dS B_j)[p], dotted with x_j, then scaled by e_j.
#pragma unroll
        for (int q = 0; q < 4; ++q)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = w.r0 + Tile::row(e), pp = w.c0 + Tile::col(q, e);
                if (j < ck.q && p0 + pp < P) {
                    part[e >> 1] = part[e >> 1] + tile_at<kOutLd, S>(sA(0), j, pp) * t.acc[q][e];
                }
                t.acc[q][e] = se[j] * t.acc[q][e];
            }
        // + sum_{i >= j} M_ij dy_i, 32 rows i at a time; a warp skips the
        // tiles below its first row.
        for (int i0 = 0; i0 < ck.q; i0 += kKt) {
            if (i0 + kKt > w.r0) {
                constexpr int ldy = tile_ld<kKm, S>;
                t.mma(sM + i0 * kKm + w.r0, 1, kKm, tile_of<kKm, S>(sDy) + i0 * ldy + w.c0, ldy,
                      1, kKt / 8);
            }
        }
        // dx through shared memory (tile_rows8; buffer 0's B tile, unread
        // since tile 2 ntn - 2), in runs of 8 channels a thread.
        tile_rows8(
            t, w, sB(0), ck.q, P - p0,
            [&](int j, int pp, float acc) { return acc + dh * tile_at<kKm, S>(sDy, j, pp); },
            [&](int j, int c8, int n, float(&v)[8]) {
                const long long at = (ck.m0 + j) * lddx + (long long)h * P + p0 + c8;
                store8_f32_bf16(dxbc, nullptr, at, n, kept_vec8(dxbc, nullptr, at, n), v);
            });
    }
    // A row's dots: its quad's four lanes, then the two column halves.
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const float r = group_sum(part[u], 4);
        const float o = group_sum(po[u], 4);
        if (tid % 4 == 0) {
            const int row = w.r0 + Tile::row(2 * u);
            sdot[0][w.c0 / 32][row] = r;
            sdot[1][w.c0 / 32][row] = o;
        }
    }
    __syncthreads();
    if (tid < ck.q) {
        const int j = tid;
        rst[(ck.m0 + j) * H + h] = expf(ss[ck.last_row] - ss[j]) * (sdot[0][0][j] + sdot[0][1][j]);
        o_row[(ck.m0 + j) * H + h] = expf(ss[j]) * (sdot[1][0][j] + sdot[1][1][j]);
    }
    float v = 0.0f;
    for (long long e = tid; e < (long long)P * N; e += kThreads) {
        v = v + kept_f32(ds[e]) * kept_f32(hst[e]);
    }
    v = group_sum(v, 32);
    if (tid % 32 == 0) sred[tid / 32] = v;
    __syncthreads();
    if (tid == 0) {
        float tot = 0.0f;
        for (int k = 0; k < kThreads / 32; ++k) tot = tot + sred[k];
        dsh[(long long)bc * H + h] = tot;
    }
}

#define MAMBA_SSD_BWD_DX(name, S)                                                            \
    extern "C" __global__ void __launch_bounds__(kThreads, 2)                                \
        name(const S* __restrict__ xbc, long long ldu, int b_off, int c_off,                 \
             const float* __restrict__ dt, const float* __restrict__ s,                      \
             const float* __restrict__ dpar, const S* __restrict__ dy,                       \
             const float* __restrict__ Mq, const S* __restrict__ st,                         \
             const S* __restrict__ dst, float* __restrict__ dxbc, long long lddx,            \
             float* __restrict__ rst, float* __restrict__ o_row, float* __restrict__ dsh,    \
             int T, int H, int P, int N, int hpg, int nc) {                                  \
        bwd_dx_tc(xbc, ldu, b_off, c_off, dt, s, dpar, dy, Mq, st, dst, dxbc, lddx, rst,    \
                  o_row, dsh, T, H, P, N, hpg, nc);                                          \
    }
MAMBA_SSD_BWD_DX(mamba_ssd_bwd_dx_tc, float)
MAMBA_SSD_BWD_DX(mamba_ssd_bwd_dx_tc_h, unsigned short)

// mamba_ssd_bwd_dbc on tensor cores (same arguments and outputs): the Psum
// steps into the output's accumulator, then per head of the group
// (ascending) its (p) steps into a head accumulator, added to the output's
// scaled by the head's row factor (e^h_j for dB, exp(s^h_i) for dC: the
// factor multiplies the head's product, not its operand). The tiles of all
// heads run as one contraction, its operands staged by cp.async
// (contract_async: no register holds them; in mamba_ssd_bwd_dbc_tc_h the
// kept tensors, S: x, B, C, dy and the states, are staged as bf16). grid
// (nbc, G, 2 ceil(N / 64)), block kThreads.
template <class S>
__device__ __forceinline__ void bwd_dbc_tc(
    const S* __restrict__ xbc, long long ldu, int b_off, int c_off,
    const float* __restrict__ dt, const float* __restrict__ s, const S* __restrict__ dy,
    const float* __restrict__ psum, const S* __restrict__ st, const S* __restrict__ dst,
    float* __restrict__ dxbc, long long lddx, int T, int H, int P, int N, int hpg, int nc) {
    // Two buffers of each operand tile (contract_async).
    // 16-byte aligned: bf16 tiles arrive by 16-byte cp.async.
    __shared__ __align__(16) float sA[2 * kStage];
    __shared__ __align__(16) float sB[2 * kStage];
    const int bc = blockIdx.x, g = blockIdx.y;
    const bool want_c = (blockIdx.z & 1) != 0;
    const int n0 = (int)(blockIdx.z >> 1) * kQ;
    const Chunk ck = chunk_of(bc, nc, T);
    const long long E = (long long)H * P;
    const int G = H / hpg;
    const S* rows = xbc + ck.m0 * ldu;
    const float* ps = psum + ((long long)bc * G + g) * kQ * kQ;
    const bool vec_u = kept_vec(xbc, ldu | P | N | b_off | c_off);
    const bool vec_st = kept_vec(st, N) && kept_vec(dst, N);
    const bool vec_a = want_c ? kept_vec(dy, P) : vec_u;
    const Share w = share();
    Tile t;
    t.zero();
    // The Psum steps: A(r, k) = Psum[k][r] (dB: step-major as stored) or
    // Psum[r][k] (dC: row-major), times C (dB) or B (dC).
    const int y_col = (want_c ? b_off : c_off) + g * N + n0;
    const S* yr = rows + y_col;
    const int ldi = (int)ldu;
    const auto y_rows = [&](int k, int kk, int nn) -> const S* {
        const int j = k * kKt + kk;
        return j < ck.q && n0 + nn < N ? yr + j * ldi + nn : nullptr;
    };
    constexpr int psum_tiles = kQ / kKt;
    if (!want_c) {
        contract_async<Steps, Steps>(
            psum_tiles, sA, sB, kStage, false, vec_u,
            [&](int k, int kk, int r) -> const float* { return ps + (k * kKt + kk) * kQ + r; },
            y_rows,
            [&](int, const float* a, const S* b) { mma_staged<Steps, Steps>(t, w, a, b); });
    } else {
        contract_async<Rows, Steps>(
            psum_tiles, sA, sB, kStage, false, vec_u,
            [&](int k, int r, int kk) -> const float* { return ps + r * kQ + k * kKt + kk; },
            y_rows, [&](int, const float* a, const S* b) { mma_staged<Rows, Steps>(t, w, a, b); });
    }
    // The (h, p) steps: x times dS (for dB) or dy times H (for dC), a head's
    // ptiles tiles after the other's.
    const int ptiles = (P + kKt - 1) / kKt;
    const S* m0 = (want_c ? st : dst) + (long long)bc * H * P * N + n0;
    Tile th;
    const auto m_at = [&](int k, int kk, int nn) -> const S* {
        const int h = g * hpg + k / ptiles, p = k % ptiles * kKt + kk;
        return p < P && n0 + nn < N ? m0 + (h * P + p) * N + nn : nullptr;
    };
    // Tile k of the heads' contraction: its mma (step), then, after a
    // head's last tile, its product scaled into the output's accumulator.
    const auto th_step = [&](int k, auto step) {
        const int h = g * hpg + k / ptiles;
        if (k % ptiles == 0) th.zero();
        step();
        if (k % ptiles != ptiles - 1) return;
        float f[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int r = w.r0 + Tile::row(2 * u);
            const long long m = ck.m0 + r;
            f[u] = 0.0f;
            if (r < ck.q) {
                f[u] = want_c ? expf(s[m * H + h])
                              : expf(s[(ck.m0 + ck.last_row) * H + h] - s[m * H + h]) *
                                    dt[m * H + h];
            }
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) t.acc[nt][e] = t.acc[nt][e] + f[e >> 1] * th.acc[nt][e];
    };
    // A: x (for dB) or dy (for dC), lda apart.
    const S* a0 = want_c ? dy + ck.m0 * E : rows;
    const int lda = want_c ? (int)E : ldi;
    const auto a_at = [&](int k, int r, int kk) -> const S* {
        const int h = g * hpg + k / ptiles, p = k % ptiles * kKt + kk;
        return r < ck.q && p < P ? a0 + r * lda + h * P + p : nullptr;
    };
    contract_async<Rows, Steps>(hpg * ptiles, sA, sB, kStage, vec_a, vec_st, a_at, m_at,
                                [&](int k, const S* a, const S* b) {
                                    th_step(k, [&] { mma_staged<Rows, Steps>(th, w, a, b); });
                                });
    const int col0 = (want_c ? c_off : b_off) + g * N + n0;
    float* o = dxbc + ck.m0 * lddx + col0;
    const bool pairs = ((lddx | col0) & 1) == 0 && (reinterpret_cast<unsigned long long>(dxbc) & 7) == 0;
    store_tile_f32(t, w, o, lddx, ck.q, N - n0, pairs);
}

#define MAMBA_SSD_BWD_DBC(name, S)                                                           \
    extern "C" __global__ void __launch_bounds__(kThreads, 2)                                \
        name(const S* __restrict__ xbc, long long ldu, int b_off, int c_off,                 \
             const float* __restrict__ dt, const float* __restrict__ s,                      \
             const S* __restrict__ dy, const float* __restrict__ psum,                       \
             const S* __restrict__ st, const S* __restrict__ dst, float* __restrict__ dxbc,  \
             long long lddx, int T, int H, int P, int N, int hpg, int nc) {                  \
        bwd_dbc_tc(xbc, ldu, b_off, c_off, dt, s, dy, psum, st, dst, dxbc, lddx, T, H, P, N, \
                   hpg, nc);                                                                 \
    }
MAMBA_SSD_BWD_DBC(mamba_ssd_bwd_dbc_tc, float)
MAMBA_SSD_BWD_DBC(mamba_ssd_bwd_dbc_tc_h, unsigned short)

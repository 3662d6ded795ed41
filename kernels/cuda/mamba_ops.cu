// Element-wise and row/column kernels of the Mamba models (everything but
// the selective scan, the GEMMs and the optimizer), forward and backward.
//
// Layout conventions (shared with kernels/src/mamba/ops.rs, which checks every
// bound on the host before a launch):
//   - activations are row-major [M, width] with M = batch * seq_len and row
//     m = b * seq_len + t; a column block of a wider matrix is addressed by a
//     base pointer plus a leading dimension `ld` (e.g. x = xz[:, :D] and
//     z = xz[:, D:2D] with ld = 2D);
//   - parameters use the Hugging Face shapes of mamba-train/src/params.rs
//     (conv1d.weight [D, 1, K] -> w[c * K + k]).
// Over 450 lines: one module (loaded once, one --fmad contract in
// build/nvcc.rs, one set of layout conventions) holding every model kernel
// but the scan and the optimizer; the conv family (templates over the
// width: the forward and the fused backward, ~230 lines) is the piece to
// move into a module of its own, which changes module loading and so waits
// for a session with GPU time to run it.
// Determinism: see mamba_common.cuh. Column sums over rows go through fixed
// slabs of kColSlab rows (stage 1, a fixed tree inside the block) and an
// ascending serial sum over slabs (stage 2).

#include "mamba_common.cuh"

using namespace mamba;

// ---------------------------------------------------------------- embedding

// h[m, :] = emb[tok[m], :]. An out-of-range token (the host validates, so
// this is a bug guard) writes NaN so it cannot pass unnoticed.
// grid (M, ceil(d / 128)), block 128.
extern "C" __global__ void mamba_embed_fwd(const unsigned* __restrict__ tok,
                                           const float* __restrict__ emb,
                                           float* __restrict__ h, int d, int vocab) {
    const long long m = blockIdx.x;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= d) return;
    const unsigned v = tok[m];
    h[m * d + j] = v < (unsigned)vocab ? emb[(long long)v * d + j] : __int_as_float(0x7fc00000);
}

// dE[v, :] += dh[p0, :] + ... for each distinct token v, over its positions
// p0 < p1 < ... in ascending order: acc = ((dE + dh[p0]) + dh[p1]) + ...
// `uniq` lists the distinct tokens, `row_ptr[u]..row_ptr[u+1]` indexes `pos`
// (a CSR built on the host from the batch). Each dE row has one owner block
// column, so there are no atomics and the order is fixed.
// grid (U, ceil(d / 128)), block 128.
extern "C" __global__ void mamba_embed_bwd(const unsigned* __restrict__ uniq,
                                           const unsigned* __restrict__ row_ptr,
                                           const unsigned* __restrict__ pos,
                                           const float* __restrict__ dh,
                                           float* __restrict__ demb, int d) {
    const int u = blockIdx.x;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= d) return;
    const long long v = uniq[u];
    float acc = demb[v * d + j];
    for (unsigned p = row_ptr[u]; p < row_ptr[u + 1]; ++p) {
        acc = acc + dh[(long long)pos[p] * d + j];
    }
    demb[v * d + j] = acc;
}

// ------------------------------------------------------------------ RMSNorm

// y = w * (x * r), r = 1 / sqrt(mean(x^2) + eps) (Hugging Face MambaRMSNorm),
// into y and/or its bf16 copy y_h (either may be null); x is f32 (`x`) or,
// when that is null, kept in bf16 (`x_h`).
// One warp per row: lane-strided serial sums, then a xor butterfly.
// grid ceil(M / 8), block 256.
extern "C" __global__ void mamba_rmsnorm_fwd(const float* __restrict__ x,
                                             const unsigned short* __restrict__ x_h,
                                             const float* __restrict__ w,
                                             float* __restrict__ y,
                                             unsigned short* __restrict__ y_h,
                                             float* __restrict__ rstd, long long M, int d,
                                             float eps) {
    const long long m = (long long)blockIdx.x * 8 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (m >= M) return;  // whole warp leaves together
    float ss = 0.0f;
    for (int j = lane; j < d; j += 32) {
        const float v = load_f32_bf16(x, x_h, m * d + j);
        ss = ss + v * v;
    }
    ss = group_sum(ss, 32);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    for (int j = lane; j < d; j += 32)
        store_f32_bf16(y, y_h, m * d + j, w[j] * (load_f32_bf16(x, x_h, m * d + j) * r));
    if (lane == 0) rstd[m] = r;
}

// RMSNorm's backward, the parts its kernels share: the row's
// sum_k dy_k w_k x_k (lane-strided serial sums, then a xor butterfly over
// the warp; every lane gets it), then per element
// dx_j = r * w_j * dy_j - x_j * k with k = r^3 * sum / d.
static __device__ __forceinline__ float rmsnorm_bwd_dot(const float* __restrict__ gr,
                                                        const float* __restrict__ w,
                                                        const float* __restrict__ x,
                                                        const unsigned short* __restrict__ x_h,
                                                        long long m, int d, int lane) {
    float s = 0.0f;
    for (int j = lane; j < d; j += 32) s = s + gr[j] * w[j] * load_f32_bf16(x, x_h, m * d + j);
    return group_sum(s, 32);
}

static __device__ __forceinline__ float rmsnorm_bwd_k(float r, float dot, int d) {
    return r * r * r * dot / (float)d;
}

static __device__ __forceinline__ float rmsnorm_bwd_at(float r, float wj, float gj, float xj,
                                                       float k) {
    return r * wj * gj - xj * k;
}

// dx = r * w * dy - x * r^3 * (sum_k dy_k w_k x_k) / d; written (accumulate
// = 0) or added to dx (accumulate = 1: the residual stream's gradient); the
// result's bf16 copy into dx_h when it is not null. x is f32 (`x`) or, when
// that is null, kept in bf16 (`x_h`).
// grid ceil(M / 8), block 256.
extern "C" __global__ void mamba_rmsnorm_bwd(const float* __restrict__ dy,
                                             const float* __restrict__ x,
                                             const unsigned short* __restrict__ x_h,
                                             const float* __restrict__ w,
                                             const float* __restrict__ rstd,
                                             float* __restrict__ dx,
                                             unsigned short* __restrict__ dx_h, long long M,
                                             int d, int accumulate) {
    const long long m = (long long)blockIdx.x * 8 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (m >= M) return;
    const float* gr = dy + m * d;
    const float dot = rmsnorm_bwd_dot(gr, w, x, x_h, m, d, lane);
    const float r = rstd[m];
    const float k = rmsnorm_bwd_k(r, dot, d);
    float* out = dx + m * d;
    for (int j = lane; j < d; j += 32) {
        const float v = rmsnorm_bwd_at(r, w[j], gr[j], load_f32_bf16(x, x_h, m * d + j), k);
        store_f32_bf16(out, dx_h ? dx_h + m * d : nullptr, j, accumulate ? out[j] + v : v);
    }
}

// ------------------------------------------------------- causal conv + SiLU

// Rows a thread of the row-group kernels takes (launcher.rs ROWS_PER_THREAD;
// the two must agree): one column c, rows m0 .. m0 + kRowsPerThread - 1 (and
// < M), each row computed exactly as a thread of its own would (the same
// expression, so the same bits); only the block count and the index
// arithmetic shrink.
constexpr int kRowsPerThread = 8;

// The conv kernels are templates over the width K (dispatched once per
// launch), so a forward thread's window of kRowsPerThread + K - 1 input rows and the
// K weights of its channel sit in registers: each input element is loaded
// once instead of once per tap, and each tap is a compile-time register.
// Widths 1..8 (conv.rs MAX_CONV_WIDTH, checked on the host) have a case.
#define MAMBA_CONV_DISPATCH(K_VAR, CALL) \
    switch (K_VAR) {                     \
        case 1: CALL(1); break;          \
        case 2: CALL(2); break;          \
        case 3: CALL(3); break;          \
        case 4: CALL(4); break;          \
        case 5: CALL(5); break;          \
        case 6: CALL(6); break;          \
        case 7: CALL(7); break;          \
        case 8: CALL(8); break;          \
        default: break;                  \
    }

// The conv's pre-activation at one row: bias + sum_k w[k] x[row - (K-1) + k]
// over the taps inside the sequence (t: the row's position in it), k =
// 0..K-1 in order, where xs[k * S] holds x at row - (K-1) + k. The one
// expression of the forward and the backward's recompute, so they agree bit
// for bit.
template <int K, int S>
static __device__ __forceinline__ float conv_pre_at(const float* xs, const float (&wk)[K], float b,
                                                    int t) {
    float acc = b;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int back = K - 1 - k;
        if (t - back >= 0) acc = acc + wk[k] * xs[k * S];
    }
    return acc;
}

// pre[r] for rows m0 + r (r < kRowsPerThread; rows at or past m1 get a value
// that is never written), by conv_pre_at; t is the row's position in its
// sequence (a group may span a sequence boundary). Window slot j holds row
// m0 - (K-1) + j; rows outside [0, m1) are not read (the taps that would
// use them are outside the sequence or past the group).
template <int K>
static __device__ __forceinline__ void conv_pre_rows(const float* __restrict__ x,
                                                     const unsigned short* __restrict__ x_h,
                                                     long long ldx,
                                                     const float* __restrict__ w,
                                                     const float* __restrict__ bias,
                                                     long long m0, long long m1, int T, int c,
                                                     float (&pre)[kRowsPerThread]) {
    float xs[kRowsPerThread + K - 1], wk[K];
#pragma unroll
    for (int j = 0; j < kRowsPerThread + K - 1; ++j) {
        const long long m = m0 - (K - 1) + j;
        xs[j] = (m >= 0 && m < m1) ? load_f32_bf16(x, x_h, m * ldx + c) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < K; ++k) wk[k] = w[c * K + k];
    const float b = bias[c];
    int t = (int)(m0 % T);
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) {
        pre[r] = conv_pre_at<K, 1>(&xs[r], wk, b, t);
        if (++t == T) t = 0;
    }
}

template <int K>
static __device__ __forceinline__ void conv_fwd_rows(const float* __restrict__ x,
                                                     const unsigned short* __restrict__ x_h,
                                                     long long ldx,
                                                     const float* __restrict__ w,
                                                     const float* __restrict__ bias,
                                                     float* __restrict__ u,
                                                     unsigned short* __restrict__ u_h,
                                                     long long m0, long long m1, int T, int D,
                                                     int c) {
    float pre[kRowsPerThread];
    conv_pre_rows<K>(x, x_h, ldx, w, bias, m0, m1, T, c, pre);
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) {
        if (m0 + r < m1) store_f32_bf16(u, u_h, (m0 + r) * D + c, siluf_(pre[r]));
    }
}

// u = SiLU(conv(x)), x = xz[:, :D] (ld ldx; f32 in x or, when x is null,
// bf16 in x_h), for M rows; u's bf16 copy into u_h when it is not null.
// grid (ceil(M / kRowsPerThread), ceil(D / 128)), block 128; K in 1..8.
extern "C" __global__ void mamba_conv_fwd(const float* __restrict__ x,
                                          const unsigned short* __restrict__ x_h, long long ldx,
                                          const float* __restrict__ w,
                                          const float* __restrict__ bias,
                                          float* __restrict__ u, unsigned short* __restrict__ u_h,
                                          long long M, int T, int D, int K) {
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= D) return;
    const long long m0 = (long long)blockIdx.x * kRowsPerThread;
    const long long m1 = min(M, m0 + kRowsPerThread);
#define MAMBA_CONV_FWD(KW) conv_fwd_rows<KW>(x, x_h, ldx, w, bias, u, u_h, m0, m1, T, D, c)
    MAMBA_CONV_DISPATCH(K, MAMBA_CONV_FWD)
#undef MAMBA_CONV_FWD
}

// Rows of a slab the fused conv backward stages at a time: its shared tiles
// hold kConvTile rows plus the taps' halo. A multiple of 8, so a row keeps
// its slab lane (row - slab start) mod 8 in every tile.
constexpr int kConvTile = 64;

// Floats of conv_bwd_slab's shared tiles for width K: x with its two halos
// of K - 1 rows, du / dpre with one, and the 8 lanes' K + 1 sums. The
// kernel's one array holds the largest width's (8, conv.rs MAX_CONV_WIDTH:
// 28 KB).
__host__ __device__ constexpr int conv_bwd_smem(int K) {
    return (kConvTile + 2 * (K - 1)) * 32 + (kConvTile + K - 1) * 32 + (K + 1) * 8 * 32;
}
constexpr int kConvBwdSmem = conv_bwd_smem(8);

// The conv's backward through SiLU for one slab of kColSlab rows and 32
// channels (c = blockIdx.y * 32 + lane), in one pass:
//   dpre[m, c] = du[m, c] * SiLU'(pre[m, c]), pre recomputed from x by
//     conv_pre_at as mamba_conv_fwd makes it;
//   dx[m, c] = sum_k w[c, k] dpre[m + (K-1) - k, c] over the taps inside the
//     sequence, k = 0..K-1 in order, to dx (f32 and / or bf16, ld ldo);
//   stage 1 of the weight and bias gradients: part[s * (D*K + D) + c*K + k]
//     = sum over the slab's rows of dpre[m, c] x[m - (K-1) + k, c] (inside
//     the sequence) and part[s * (D*K + D) + D*K + c] = sum of dpre[m, c].
//     Row lane ty (of 8) sums rows r0 + ty, r0 + ty + 8, ... in ascending
//     order, then the 8 lanes are added in a fixed tree: the association is
//     the slab's, a function of the shape alone (mamba_reduce_partials is
//     stage 2).
// dpre is never stored: each tile of kConvTile rows stages x (with the K-1
// rows before it) and du (with the K-1 rows after it) in shared memory,
// makes dpre for the tile and the K-1 rows after it (the next tile makes
// those again, by the same expression: the same bits), then dx and the
// sums. x is f32 (`x`) or, when that is null, bf16 (`x_h`), ld ldx; du is
// [M, D]. `smem` holds kConvBwdSmem floats (the kernel's one shared array:
// one per width would add up, as every instantiation's statics are the
// kernel's).
template <int K>
static __device__ __forceinline__ void conv_bwd_slab(
    float* smem, const float* __restrict__ x, const unsigned short* __restrict__ x_h, long long ldx,
    const float* __restrict__ w, const float* __restrict__ bias, const float* __restrict__ du,
    float* __restrict__ dx, unsigned short* __restrict__ dx_h, long long ldo,
    float* __restrict__ part, long long M, int T, int D) {
    static_assert(conv_bwd_smem(K) <= kConvBwdSmem, "the kernel's shared array holds width K's tiles");
    constexpr int kHalo = K - 1;
    float(*sx)[32] = reinterpret_cast<float(*)[32]>(smem);  // x rows s - kHalo ..
    float(*sd)[32] = sx + kConvTile + 2 * kHalo;            // du, then dpre, rows s ..
    float(*sh)[8][32] = reinterpret_cast<float(*)[8][32]>(sd + kConvTile + kHalo);
    const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
    const int c = blockIdx.y * 32 + tx;
    const bool live = c < D;
    const long long r0 = (long long)blockIdx.x * kColSlab;
    const long long r1 = min(M, r0 + kColSlab);
    float wk[K], acc[K + 1];
    const float b = live ? bias[c] : 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) wk[k] = live ? w[c * K + k] : 0.0f;
#pragma unroll
    for (int k = 0; k <= K; ++k) acc[k] = 0.0f;
    for (long long s = r0; s < r1; s += kConvTile) {
        for (int i = ty; i < kConvTile + 2 * kHalo; i += 8) {
            const long long m = s - kHalo + i;
            sx[i][tx] = (live && m >= 0 && m < M) ? load_f32_bf16(x, x_h, m * ldx + c) : 0.0f;
        }
        for (int i = ty; i < kConvTile + kHalo; i += 8) {
            const long long m = s + i;
            sd[i][tx] = (live && m < M) ? du[m * D + c] : 0.0f;
        }
        __syncthreads();
        const int ts = (int)(s % T);
        for (int i = ty; i < kConvTile + kHalo && s + i < M; i += 8) {
            const float pre = conv_pre_at<K, 32>(&sx[i][0] + tx, wk, b, (ts + i) % T);
            sd[i][tx] = sd[i][tx] * dsiluf_(pre);
        }
        __syncthreads();
        for (int i = ty; i < kConvTile && s + i < r1; i += 8) {
            const int t = (ts + i) % T;
            const float g = sd[i][tx];
            float a = 0.0f;
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int fwd = K - 1 - k;
                if (t + fwd < T) a = a + wk[k] * sd[i + fwd][tx];
            }
            if (live) store_f32_bf16(dx, dx_h, (s + i) * ldo + c, a);
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int back = K - 1 - k;
                if (t - back >= 0) acc[k] = acc[k] + g * sx[i + k][tx];
            }
            acc[K] = acc[K] + g;
        }
        __syncthreads();
    }
#pragma unroll
    for (int k = 0; k <= K; ++k) sh[k][ty][tx] = acc[k];
    __syncthreads();
    if (ty == 0 && live) {
        float* out = part + (long long)blockIdx.x * ((long long)D * K + D);
#pragma unroll
        for (int k = 0; k <= K; ++k) {
            const float v = ((sh[k][0][tx] + sh[k][1][tx]) + (sh[k][2][tx] + sh[k][3][tx])) +
                            ((sh[k][4][tx] + sh[k][5][tx]) + (sh[k][6][tx] + sh[k][7][tx]));
            out[k < K ? (long long)c * K + k : (long long)D * K + c] = v;
        }
    }
}


// grid (ceil(M / kColSlab), ceil(D / 32)), block 256 (32 channels x 8 row
// lanes); K in 1..8. See conv_bwd_slab. The bounds ask for 4 blocks an SM
// (64 registers, the whole register file): without them ptxas gave the
// eight-width dispatch 48 registers and spilled (sm_90, CUDA 13.0).
extern "C" __global__ void __launch_bounds__(256, 4)
    mamba_conv_bwd(const float* __restrict__ x, const unsigned short* __restrict__ x_h,
                   long long ldx, const float* __restrict__ w, const float* __restrict__ bias,
                   const float* __restrict__ du, float* __restrict__ dx,
                   unsigned short* __restrict__ dx_h, long long ldo, float* __restrict__ part,
                   long long M, int T, int D, int K) {
    __shared__ float smem[kConvBwdSmem];
#define MAMBA_CONV_BWD(KW) conv_bwd_slab<KW>(smem, x, x_h, ldx, w, bias, du, dx, dx_h, ldo, part, M, T, D)
    MAMBA_CONV_DISPATCH(K, MAMBA_CONV_BWD)
#undef MAMBA_CONV_BWD
}

#undef MAMBA_CONV_DISPATCH

// ---------------------------------------------------- dt, gating, reductions

// dt = softplus(raw + bias[c]), [M, D]: into dt (f32) and / or dt_h (its
// bf16 rounding), or over raw in place when both are null (each element is
// read before the same thread writes it).
// grid (ceil(M / kRowsPerThread), ceil(D / 128)), block 128.
extern "C" __global__ void mamba_dt_softplus(float* __restrict__ raw,
                                             const float* __restrict__ bias,
                                             float* __restrict__ dt,
                                             unsigned short* __restrict__ dt_h, long long M,
                                             int D) {
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= D) return;
    const float b = bias[c];
    const long long m0 = (long long)blockIdx.x * kRowsPerThread;
    const long long m1 = min(M, m0 + kRowsPerThread);
    float* f = dt || dt_h ? dt : raw;
    for (long long m = m0; m < m1; ++m) {
        store_f32_bf16(f, dt_h, m * D + c, softplusf_(raw[m * D + c] + b));
    }
}

// The gate's backward at one element, out = y * SiLU(z) with gradient g:
// d z = g * y * SiLU'(z) -> dz / dz_h at i (either may be null); returns
// d y = g * z * sigmoid(z), which the caller stores.
static __device__ __forceinline__ float gate_bwd_at(float g, float yv, float zv,
                                                    float* __restrict__ dz,
                                                    unsigned short* __restrict__ dz_h,
                                                    long long i) {
    const float s = sigmoidf_(zv);
    store_f32_bf16(dz, dz_h, i, g * yv * (s * (1.0f + zv * (1.0f - s))));
    return g * (zv * s);
}

// Backward of out = y * SiLU(z): dy = dout * SiLU(z) -> dy (ld D);
// dz = dout * y * SiLU'(z) -> dz (ld ldz) and, when dz_h is not null, its
// bf16 copy -> dz_h (ld ldz); and out itself again, recomputed with
// gate_out exactly as the scan's forward wrote it (the same bits: no block
// keeps it), into g (f32) and / or g_h (bf16), ld D, for out_proj's weight
// gradient. z is read with ld ldz; y and z are each f32 (`y`, `z`) or, when
// that is null, bf16 (`y_h`, `z_h`).
// grid (M, ceil(D / 128)), block 128.
extern "C" __global__ void mamba_gate_bwd(const float* __restrict__ dout,
                                          const float* __restrict__ y,
                                          const unsigned short* __restrict__ y_h,
                                          const float* __restrict__ z,
                                          const unsigned short* __restrict__ z_h, long long ldz,
                                          float* __restrict__ dy, float* __restrict__ dz,
                                          unsigned short* __restrict__ dz_h,
                                          float* __restrict__ g_out,
                                          unsigned short* __restrict__ g_h, int D) {
    const long long m = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= D) return;
    const float zv = load_f32_bf16(z, z_h, m * ldz + c);
    const float yv = load_f32_bf16(y, y_h, m * D + c);
    dy[m * D + c] = gate_bwd_at(dout[m * D + c], yv, zv, dz, dz_h, m * ldz + c);
    store_f32_bf16(g_out, g_h, m * D + c, gate_out(yv, zv));
}

// Mamba-2's gated RMSNorm backward and the gate's in one pass, one warp per
// row: the norm's input gradient dg (mamba_rmsnorm_bwd's expressions, over
// the norm's input g, f32 or kept in bf16 in g_h) is never stored; it goes
// through the gate out = y * SiLU(z) (mamba_gate_bwd's expressions) into dy
// (f32 and / or bf16 in dy_h, ld D: Mamba-2's bf16 runs keep the SSD's dy
// in bf16 alone) and dz (f32 and / or bf16, ld ldz). The bits of
// mamba_rmsnorm_bwd into an f32 dg followed by mamba_gate_bwd (the emulated
// ops check compares them). dgn is the gradient of the norm's output, [M, D].
// grid ceil(M / 8), block 256.
extern "C" __global__ void mamba_gated_norm_bwd(
    const float* __restrict__ dgn, const float* __restrict__ g, const unsigned short* __restrict__ g_h,
    const float* __restrict__ w, const float* __restrict__ rstd, const float* __restrict__ y,
    const unsigned short* __restrict__ y_h, const float* __restrict__ z,
    const unsigned short* __restrict__ z_h, long long ldz, float* __restrict__ dy,
    unsigned short* __restrict__ dy_h, float* __restrict__ dz, unsigned short* __restrict__ dz_h,
    long long M, int D) {
    const long long m = (long long)blockIdx.x * 8 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (m >= M) return;
    const float* gr = dgn + m * D;
    const float dot = rmsnorm_bwd_dot(gr, w, g, g_h, m, D, lane);
    const float r = rstd[m];
    const float k = rmsnorm_bwd_k(r, dot, D);
    for (int c = lane; c < D; c += 32) {
        const float dg = rmsnorm_bwd_at(r, w[c], gr[c], load_f32_bf16(g, g_h, m * D + c), k);
        const float zv = load_f32_bf16(z, z_h, m * ldz + c);
        const float yv = load_f32_bf16(y, y_h, m * D + c);
        store_f32_bf16(dy, dy_h, m * D + c, gate_bwd_at(dg, yv, zv, dz, dz_h, m * ldz + c));
    }
}

// Stage 1 of a column sum over rows: part[s * C + c] = sum over slab s of
//   mode 0: a[m, c]
//   mode 1: a[m, c] * b[m, c]
//   mode 2: a[m, c] * b[m, c] * rs[m]
// (a with ld lda, b with ld ldb; each f32, or bf16 in a_h / b_h when a / b
// is null; the operands a mode does not read may be null).
// Block: 32 columns x 8 row lanes, fixed tree over the lanes.
// grid (nslabs, ceil(C / 32)), block 256.
extern "C" __global__ void mamba_colsum_partial(const float* __restrict__ a,
                                                const unsigned short* __restrict__ a_h,
                                                long long lda, const float* __restrict__ b,
                                                const unsigned short* __restrict__ b_h,
                                                long long ldb, const float* __restrict__ rs,
                                                int mode,
                                                float* __restrict__ part, long long M, int C) {
    __shared__ float sh[8][32];
    const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
    const int c = blockIdx.y * 32 + tx;
    const long long r0 = (long long)blockIdx.x * kColSlab;
    const long long r1 = min(M, r0 + kColSlab);
    float acc = 0.0f;
    if (c < C) {
        for (long long m = r0 + ty; m < r1; m += 8) {
            float v = load_f32_bf16(a, a_h, m * lda + c);
            if (mode >= 1) v = v * load_f32_bf16(b, b_h, m * ldb + c);
            if (mode == 2) v = v * rs[m];
            acc = acc + v;
        }
    }
    sh[ty][tx] = acc;
    __syncthreads();
    if (ty == 0 && c < C) {
        part[(long long)blockIdx.x * C + c] =
            ((sh[0][tx] + sh[1][tx]) + (sh[2][tx] + sh[3][tx])) +
            ((sh[4][tx] + sh[5][tx]) + (sh[6][tx] + sh[7][tx]));
    }
}

// Stage 2: out[j] = part[0][col0 + j] + part[1][col0 + j] + ... (ascending,
// serial), for j < ncols; rows of `part` are `stride` apart. mode 1 multiplies
// the sum by -exp(aux[j]) (d loss / d A_log = d loss / d A * A, A = -exp(A_log)).
// grid ceil(ncols / 64), block 64 (reductions.rs PARTIALS_THREADS).
extern "C" __global__ void mamba_reduce_partials(const float* __restrict__ part, int nparts,
                                                 long long stride, long long col0,
                                                 long long ncols,
                                                 const float* __restrict__ aux, int mode,
                                                 float* __restrict__ out) {
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= ncols) return;
    // The sum is serial in ascending p (fixed association); only the loads
    // are batched, kBatch in flight per thread, so a long partial list (the
    // scan's d A: batch * chunks partials) is not one memory latency per term.
    constexpr int kBatch = 32;
    const float* col = part + col0 + j;
    float s = 0.0f;
    for (int p0 = 0; p0 < nparts; p0 += kBatch) {
        float v[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
            v[i] = p0 + i < nparts ? col[(long long)(p0 + i) * stride] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
            if (p0 + i < nparts) s = s + v[i];
        }
    }
    if (mode == 1) s = s * -expf(aux[j]);
    out[j] = s;
}

// ------------------------------------------------------------ cross-entropy

// One block per row of logits [M, V]. For target t != -100:
//   row_loss[m] = logsumexp(l) - l[t]; l <- (softmax(l) - onehot(t)) * scale[0]
// (when write_grad); for target -100: row_loss = 0 and the row becomes 0.
// With grad_h not null the gradient goes to grad_h ([M, V] bf16, the bits
// mamba_cast_bf16 would give it) instead of over the logits, which stay.
// The max and the sum of exponentials are merged online per thread (strided,
// in order) and then in a fixed tree of (max, sum) pairs.
// `scale` is the loss scale pair (kernels::mamba::LossScale: 1 / counted,
// counted) in device memory, not a launch argument, so that a captured
// CUDA graph of the step reads each batch's count.
// grid M, block 256.
extern "C" __global__ void mamba_ce_fwd_bwd(float* __restrict__ logits,
                                            const int* __restrict__ targets,
                                            float* __restrict__ row_loss,
                                            unsigned short* __restrict__ grad_h,
                                            const float* __restrict__ scale, int V,
                                            int write_grad) {
    const float inv_count = scale[0];
    __shared__ float smax[kReduceThreads];
    __shared__ float ssum[kReduceThreads];
    const long long m = blockIdx.x;
    const int tid = threadIdx.x;
    float* l = logits + m * V;
    // Where the gradient goes: over the logits, or only into the bf16 copy.
    float* gl = grad_h ? nullptr : l;
    unsigned short* gh = grad_h ? grad_h + m * V : nullptr;
    const int target = targets[m];
    if (target < 0) {  // ignore index (the host rejects any other negative)
        if (write_grad)
            for (int j = tid; j < V; j += kReduceThreads) store_f32_bf16(gl, gh, j, 0.0f);
        if (tid == 0) row_loss[m] = 0.0f;
        return;
    }
    float mx = -INFINITY, s = 0.0f;
    for (int j = tid; j < V; j += kReduceThreads) {
        const float v = l[j];
        if (v > mx) {
            s = s * expf(mx - v) + 1.0f;
            mx = v;
        } else {
            s = s + expf(v - mx);
        }
        if (v != v) mx = v;  // NaN propagates
    }
    smax[tid] = mx;
    ssum[tid] = s;
    __syncthreads();
    for (int w = kReduceThreads / 2; w > 0; w >>= 1) {
        if (tid < w) {
            const float m1 = smax[tid], m2 = smax[tid + w];
            const float s1 = ssum[tid], s2 = ssum[tid + w];
            const float mm = fmaxf(m1, m2);
            float t1 = s1 == 0.0f ? 0.0f : s1 * expf(m1 - mm);
            float t2 = s2 == 0.0f ? 0.0f : s2 * expf(m2 - mm);
            smax[tid] = (m1 != m1 || m2 != m2) ? __int_as_float(0x7fc00000) : mm;
            ssum[tid] = t1 + t2;
        }
        __syncthreads();
    }
    const float gmax = smax[0], gsum = ssum[0];
    const float lt = l[target];
    __syncthreads();
    if (tid == 0) row_loss[m] = (gmax + logf(gsum)) - lt;
    if (write_grad) {
        const float inv_sum = 1.0f / gsum;
        for (int j = tid; j < V; j += kReduceThreads) {
            float p = expf(l[j] - gmax) * inv_sum;
            if (j == target) p = p - 1.0f;
            store_f32_bf16(gl, gh, j, p * inv_count);
        }
    }
}

// out[0] = (sum of row_loss[0..M)) / count, count = scale[1] (the loss
// scale pair in device memory, as mamba_ce_fwd_bwd's): lane-strided serial
// sums, then the fixed block tree. grid 1, block 256.
extern "C" __global__ void mamba_loss_mean(const float* __restrict__ row_loss, long long M,
                                           const float* __restrict__ scale,
                                           float* __restrict__ out) {
    const float count = scale[1];
    __shared__ float sh[kReduceThreads];
    float s = 0.0f;
    for (long long m = threadIdx.x; m < M; m += kReduceThreads) s = s + row_loss[m];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) out[0] = count > 0.0f ? s / count : 0.0f;
}

// ---------------------------------------------------------------- bf16 cast

// dst[i] = bf16_rne(src[i]) for i < n, 8 elements a thread: two 16-byte
// loads and one 16-byte store when both pointers are 16-byte aligned (the
// cast is pure bandwidth: one element a thread ran at ~1.2 TB/s on an H200,
// ncu 2026-12-02), element by element otherwise and for the tail. Every
// element is cast by the same function either way, so the bits do not
// depend on alignment. grid (ceil(n / 8 / 128)), block 128.
extern "C" __global__ void mamba_cast_bf16(const float* __restrict__ src,
                                           unsigned short* __restrict__ dst, long long n) {
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (i >= n) return;
    const bool wide = ((((unsigned long long)src) | ((unsigned long long)dst)) & 15ull) == 0;
    if (wide && i + 8 <= n) {
        const float4 a = *reinterpret_cast<const float4*>(src + i);
        const float4 b = *reinterpret_cast<const float4*>(src + i + 4);
        uint4 o;
        o.x = bf16_rne(a.x) | (bf16_rne(a.y) << 16);
        o.y = bf16_rne(a.z) | (bf16_rne(a.w) << 16);
        o.z = bf16_rne(b.x) | (bf16_rne(b.y) << 16);
        o.w = bf16_rne(b.z) | (bf16_rne(b.w) << 16);
        *reinterpret_cast<uint4*>(dst + i) = o;
    } else {
        for (long long j = i; j < i + 8 && j < n; ++j) dst[j] = (unsigned short)bf16_rne(src[j]);
    }
}

// ------------------------------------------------ per-head values (Mamba-2)
//
// Mamba-2 has one dt, A and D per head, shared by the head's P channels;
// the selective scan works per channel. These two move values between the
// per-head and the per-channel layouts: column group g of a row is the P
// columns g * P .. g * P + P - 1. With P = 1 they are strided copies (a
// column block of a wider matrix into a matrix of its own, or back).

// dst[m * ldd + g * P + p] = src[m * lds + g]  (g < G, p < P); src is f32
// (`src`) or kept in bf16 (`srch`, `src` null: widened, exactly).
// grid (M, ceil(G * P / 128)), block 128.
extern "C" __global__ void mamba_group_bcast(const float* __restrict__ src,
                                             const unsigned short* __restrict__ srch,
                                             long long lds, float* __restrict__ dst,
                                             long long ldd, int G, int P) {
    const long long m = blockIdx.x;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= G * P) return;
    dst[m * ldd + j] = mamba::load_f32_bf16(src, srch, m * lds + j / P);
}

// dst[m * ldd + g] = ((src[m * lds + g * P] + src[.. + 1]) + ...) + src[.. + P - 1]:
// one thread per (row, group), summing its P columns serially in ascending
// order (the association depends on P alone; a host loop in that order
// gives the same bits: additions only).
// grid (M, ceil(G / 128)), block 128.
extern "C" __global__ void mamba_group_sum(const float* __restrict__ src, long long lds,
                                           float* __restrict__ dst, long long ldd, int G,
                                           int P) {
    const long long m = blockIdx.x;
    const int g = blockIdx.y * blockDim.x + threadIdx.x;
    if (g >= G) return;
    const float* s = src + m * lds + (long long)g * P;
    float acc = s[0];
    for (int p = 1; p < P; ++p) acc = acc + s[p];
    dst[m * ldd + g] = acc;
}

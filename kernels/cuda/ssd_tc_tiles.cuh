// The tile machinery of the tensor-core SSD kernels (mamba_ssd_tc.cu):
// how a block's 64 x 64 output tile is shared among its warps, the two
// layouts of a staged operand tile, the register-staged pipeline that
// feeds them (contract), and the products every kernel there is made of
// (C B^T, the products with a chunk's state).
//
// Layout: every product is a 64 x 64 output tile of a 256-thread block,
// warp w owning rows 16 (w % 4) .. + 16 and columns 32 (w / 4) .. + 32 as
// four m16n8 accumulators (mma_tf32.cuh's WarpTile<4>). Operands are
// staged in shared memory a tile of KT contraction steps at a time, either
// row-major ([64 rows][KT + 4], for operands whose contraction index runs
// along a global row) or step-major ([KT steps][72], for operands whose
// output index runs along a global row): both strides put a warp's
// fragment reads in 32 distinct banks, and both keep the global reads
// along a row. Each block's contraction runs its tiles in ascending order
// and a warp's mma steps in ascending k, so every output's sum has a fixed
// association that depends on the shapes alone. Where the SIMT kernel
// scales a product afterwards (exp(s_i) C_i H, e_j dS B_j), this one
// scales an operand or the accumulator before the next product: the same
// quantity, different rounding, inside the tf32 tolerance.
//
// Over 450 lines: the one staging vocabulary of those kernels (the f32
// operands' cp.async and register paths, and the bf16 states' register
// path), which reads best beside the layouts it fills.
//
// Offsets inside a chunk are 32-bit: 64 rows of any operand and one
// chunk's H x P x N states span fewer than 2^31 elements (SsdShape's
// checks), which keeps the staging loads' address arithmetic in single
// registers.
#pragma once
#include "cp_async.cuh"
#include "mma_tf32.cuh"
#include "ssd_chunk.cuh"

namespace mamba_ssd_tc {

using namespace mamba;
using namespace mamba_ssd;

// Row stride of a step-major staged tile: steps t and columns g of a
// fragment read land in banks 8 t + g.
constexpr int kKm = kQ + 8;

// The warp's share of the block's 64 x 64 output tile.
struct Share {
    int r0, c0;  // first row, first column
};

__device__ __forceinline__ Share share() {
    const int w = threadIdx.x / 32;
    return Share{16 * (w % 4), 32 * (w / 4)};
}

using Tile = WarpTile<4>;

// The two layouts of a staged operand tile: row-major ([64 rows][KT + 4],
// value (r, kk)) and step-major ([KT steps][kKm], value (kk, c)). Thread
// tid owns elements idx = tid + i kThreads, i < kIt; a warp's 32 are
// consecutive along the global row, so every load it issues is coalesced.
template <int KT>
struct RowMajor {
    static constexpr int kIt = kQ * KT / kThreads;
    static __device__ __forceinline__ int first(int idx) { return idx / KT; }
    static __device__ __forceinline__ int second(int idx) { return idx % KT; }
    static __device__ __forceinline__ int at(int idx) { return idx / KT * (KT + 4) + idx % KT; }
};

template <int KT>
struct StepMajor {
    static constexpr int kIt = kQ * KT / kThreads;
    static __device__ __forceinline__ int first(int idx) { return idx / kQ; }
    static __device__ __forceinline__ int second(int idx) { return idx % kQ; }
    static __device__ __forceinline__ int at(int idx) { return idx / kQ * kKm + idx % kQ; }
};

// One operand tile in flight through a thread's registers: all kIt loads
// issued before any value is used (load), then written to shared memory
// (store).
template <class L>
struct Staged {
    float v[L::kIt];

    template <class F>
    __device__ __forceinline__ void load(int tile, F value) {
#pragma unroll
        for (int i = 0; i < L::kIt; ++i) {
            const int idx = threadIdx.x + i * kThreads;
            v[i] = value(tile, L::first(idx), L::second(idx));
        }
    }
    __device__ __forceinline__ void store(float* s) const {
#pragma unroll
        for (int i = 0; i < L::kIt; ++i) s[L::at(threadIdx.x + i * kThreads)] = v[i];
    }
};

// A contraction over `tiles` staged tiles of one operand (layout L, values
// value(k, ., .) into s) or two (LA / LB into sA / sB), each tile's
// product by mma(k) after it landed; tile k + 1's global loads are issued
// before tile k's mma runs, so they are in flight meanwhile. Tiles run in
// ascending k. Every thread of the block calls it; it synchronises before
// it first writes shared memory, so an earlier product's reads are safe.
template <class L, class V, class M>
__device__ __forceinline__ void contract(int tiles, float* s, V value, M mma) {
    Staged<L> r;
    r.load(0, value);
    for (int k = 0; k < tiles; ++k) {
        __syncthreads();
        r.store(s);
        __syncthreads();
        if (k + 1 < tiles) r.load(k + 1, value);
        mma(k);
    }
}

template <class LA, class LB, class VA, class VB, class M>
__device__ __forceinline__ void contract(int tiles, float* sA, float* sB, VA va, VB vb, M mma) {
    Staged<LA> ra;
    Staged<LB> rb;
    ra.load(0, va);
    rb.load(0, vb);
    for (int k = 0; k < tiles; ++k) {
        __syncthreads();
        ra.store(sA);
        rb.store(sB);
        __syncthreads();
        if (k + 1 < tiles) {
            ra.load(k + 1, va);
            rb.load(k + 1, vb);
        }
        mma(k);
    }
}

// Tile steps of the row-major products (KT = 32: stride 36, banks 4 g + t).
constexpr int kKt = 32;
constexpr int kRm = kKt + 4;
using Rows = RowMajor<kKt>;
using Steps = StepMajor<kKt>;
// Floats of one staging buffer: a row-major [64][36] or a step-major
// [32][72] tile, the same size.
constexpr int kStage = kQ * kRm;
static_assert(kStage == kKt * kKm, "the two staged layouts share one buffer");

// mamba_ssd_state_scan_tc's staging: one step-major operand tile of a whole
// chunk ([kQ steps][kKm]), and its dynamic shared memory, two buffers of
// the X and Y tiles (SsdShape::STATE_SCAN_SMEM_BYTES on the host).
constexpr int kStateScanTile = kQ * kKm;
constexpr int kStateScanSmemFloats = 4 * kStateScanTile;

// The staging of mamba_ssd_chunk_out_tc and mamba_ssd_bwd_dx_tc: a
// step-major 64-row tile (kStateScanTile floats: x, or dy), then two
// buffers of a pair of state tiles of 64 states each (C and H, B and dS),
// row-major with stride kOutLd (banks 4 g + t of a fragment read)
// (SsdShape::STAGED_SMEM_BYTES on the host).
constexpr int kOutLd = kQ + 4;
constexpr int kOutStateTile = kQ * kOutLd;
constexpr int kStagedSmemFloats = kStateScanTile + 4 * kOutStateTile;

// One piece of a tile staged by cp.async: `width` floats (4, both sides
// 16-byte aligned, or 1) copied when inside, else zeros by plain stores
// (the barrier that follows the copies' wait covers both).
__device__ __forceinline__ void cp_async_piece(float* dst, const float* src, bool inside,
                                               int width) {
    if (width == 4) {
        if (inside) {
            cp_async16(dst, src);
        } else {
            *reinterpret_cast<float4*>(dst) = float4{0.0f, 0.0f, 0.0f, 0.0f};
        }
    } else if (inside) {
        cp_async4(dst, src);
    } else {
        *dst = 0.0f;
    }
}

// This thread's share of a tile of Rows x 64 values, as copy(r, c, width)
// for each of its pieces: Width values along c (one 16-byte copy: 4 f32 or
// 8 bf16) when vec (every row 16-byte aligned), else single values; a
// warp's pieces are consecutive along a row.
template <int Rows, int Width, class F>
__device__ __forceinline__ void tile_pieces_of(bool vec, F copy) {
    const int tid = threadIdx.x;
    if (vec) {
#pragma unroll
        for (int i = 0; i < Rows * kQ / Width / kThreads; ++i) {
            const int idx = tid + i * kThreads;
            copy(idx / (kQ / Width), Width * (idx % (kQ / Width)), Width);
        }
    } else {
#pragma unroll 4
        for (int i = 0; i < Rows * kQ / kThreads; ++i) {
            const int idx = tid + i * kThreads;
            copy(idx / kQ, idx % kQ, 1);
        }
    }
}

// An f32 tile of 64 x 64: pieces of 4.
template <class F>
__device__ __forceinline__ void tile_pieces(bool vec, F copy) {
    tile_pieces_of<kQ, 4>(vec, copy);
}

// One operand tile of layout L, element by element by cp.async into dst:
// src(k, first, second) gives an element's address, or nullptr for a zero.
template <class L, class Src>
__device__ __forceinline__ void stage_elements(float* dst, int k, Src src) {
#pragma unroll
    for (int i = 0; i < L::kIt; ++i) {
        const int idx = threadIdx.x + i * kThreads;
        const float* p = src(k, L::first(idx), L::second(idx));
        cp_async_piece(dst + L::at(idx), p, p != nullptr, 1);
    }
}

// The two-buffer pipeline of the cp.async contractions: tile k + 1's copies
// (stage(k + 1): one committed group into buffer (k + 1) & 1) are in flight
// while run(k) reads buffer k & 1. Every thread of the block calls it; it
// synchronises before it first writes shared memory.
template <class Stage, class Run>
__device__ __forceinline__ void two_buffers(int tiles, Stage stage, Run run) {
    __syncthreads();
    stage(0);
    for (int k = 0; k < tiles; ++k) {
        if (k + 1 < tiles) {
            // Buffer (k + 1) & 1's last reader was tile k - 1's run.
            if (k > 0) __syncthreads();
            stage(k + 1);
            cp_async_wait(1);
        } else {
            cp_async_wait(0);
        }
        __syncthreads();
        run(k);
    }
}

// contract's twin for operands that are plain copies of global memory: each
// tile's elements arrive by cp.async (src(k, ., .) gives an element's
// address, or nullptr for a zero) in the other of two buffers per operand
// while the current tile's mma(k, a, b) runs on buffers a and b; no
// register holds them meanwhile. The same tiles, values and order as
// contract, so the same bits. sA and sB hold two tiles of their layouts
// each. Every thread of the block calls it; it synchronises before it first
// writes shared memory.
template <class LA, class LB, class SA, class SB, class M>
__device__ __forceinline__ void contract_async(int tiles, float* sA, float* sB, int stride,
                                               SA src_a, SB src_b, M mma) {
    auto stage = [&](int k) {
        stage_elements<LA>(sA + (k & 1) * stride, k, src_a);
        stage_elements<LB>(sB + (k & 1) * stride, k, src_b);
        cp_async_commit();
    };
    two_buffers(tiles, stage, [&](int k) { mma(k, sA + (k & 1) * stride, sB + (k & 1) * stride); });
}

// How the entry states and their gradients are kept between the state
// kernels: f32 (tf32 runs) or their bf16 rounding alone (bf16 runs, as the
// reference keeps its passed states in the input's type). The kernels that
// make or read them are templates over that type S. A bf16 state is widened
// to f32 as it is staged, so a product reads the values an f32 kernel fed
// the states' bf16 rounding would read, in the same order: its bits.
__device__ __forceinline__ float state_f32(float v) { return v; }
__device__ __forceinline__ float state_f32(unsigned short h) { return bf16_to_f32(h); }
__device__ __forceinline__ void put_state(float* o, float v) { *o = v; }
__device__ __forceinline__ void put_state(unsigned short* o, float v) {
    *o = (unsigned short)bf16_rne(v);
}
// Two adjacent states in one store (o aligned to the pair's size).
__device__ __forceinline__ void put_state_pair(float* o, float a, float b) {
    *reinterpret_cast<float2*>(o) = float2{a, b};
}
__device__ __forceinline__ void put_state_pair(unsigned short* o, float a, float b) {
    *reinterpret_cast<unsigned*>(o) = bf16_rne(a) | (bf16_rne(b) << 16);
}

// A bf16 state tile is staged as bf16, in the space of the f32 tile it
// replaces (half its bytes), with rows of kLdH values: 144 bytes, so rows
// stay 16-byte aligned, and a fragment read's 32 lanes fall on 16 words of
// distinct banks, two lanes a word (row-major [c][kLdH]: words 36 c + t / 2;
// step-major [t][kLdH]: words 36 t + g / 2). The mma widens each value as it
// reads it (b_tf32).
constexpr int kLdH = kQ + 8;
static_assert(kQ * kLdH * 2 <= kOutStateTile * 4, "a bf16 state tile fits its f32 tile's space");
static_assert(kKt * kLdH * 2 <= kStage * 4, "a bf16 step tile fits its f32 buffer");

// One piece of a bf16 tile: 8 values by one 16-byte cp.async (both sides
// 16-byte aligned), or 1 by a plain load and store (the barrier that
// follows the copies' wait covers it too); zeros when outside.
__device__ __forceinline__ void cp_async_piece_h(unsigned short* dst, const unsigned short* src,
                                                 bool inside, int width) {
    if (width == 8) {
        if (inside) {
            cp_async16(reinterpret_cast<float*>(dst), reinterpret_cast<const float*>(src));
        } else {
            *reinterpret_cast<uint4*>(dst) = uint4{0u, 0u, 0u, 0u};
        }
    } else {
        *dst = inside ? *src : (unsigned short)0;
    }
}

// Whether a bf16 state tile's rows can be copied in pieces of 8: the
// states start 16-byte aligned and every row of N does (a piece is then
// inside or outside as a whole).
__device__ __forceinline__ bool state_rows_vec8(const unsigned short* st, int N) {
    return (reinterpret_cast<unsigned long long>(st) & 15) == 0 && (N & 7) == 0;
}

// contract_async's twin whose B operand is bf16 states, step-major ([kk]
// [kLdH], 32 steps of 64): src_b(k, kk, nn) gives the address of a piece's
// first value (8 along nn when vec), or nullptr for zeros; mma(k, a, b)
// reads b as bf16. The same tiles, values and order as contract_async fed
// the states' rounding, so the same bits.
template <class LA, class SA, class SB, class M>
__device__ __forceinline__ void contract_async_h(int tiles, float* sA, float* sB, int stride,
                                                 bool vec, SA src_a, SB src_b, M mma) {
    auto stage = [&](int k) {
        stage_elements<LA>(sA + (k & 1) * stride, k, src_a);
        unsigned short* b = reinterpret_cast<unsigned short*>(sB + (k & 1) * stride);
        tile_pieces_of<kKt, 8>(vec, [&](int kk, int nn, int width) {
            const unsigned short* p = src_b(k, kk, nn);
            cp_async_piece_h(b + kk * kLdH + nn, p, p != nullptr, width);
        });
        cp_async_commit();
    };
    two_buffers(tiles, stage, [&](int k) {
        mma(k, sA + (k & 1) * stride,
            reinterpret_cast<const unsigned short*>(sB + (k & 1) * stride));
    });
}

// t += sum over the 32 steps of the tiles staged row-major in sA (rows) and
// sB (columns): A(r, k) = sA[r][k], B(k, c) = sB[c][k].
__device__ __forceinline__ void mma_rows(Tile& t, const Share& w, const float* sA,
                                         const float* sB) {
    t.mma(sA + w.r0 * kRm, kRm, 1, sB + w.c0 * kRm, 1, kRm, kKt / 8);
}

// t += sum over the 32 steps of A staged row-major in sA and B step-major
// in sB: A(r, k) = sA[r][k], B(k, c) = sB[k][c].
__device__ __forceinline__ void mma_rows_steps(Tile& t, const Share& w, const float* sA,
                                               const float* sB) {
    t.mma(sA + w.r0 * kRm, kRm, 1, sB + w.c0, kKm, 1, kKt / 8);
}

// t = C_i . B_j of one (chunk, group) over d_state (rows i, columns j),
// 32 states a tile. Every thread of the block calls it.
__device__ __forceinline__ void cb_product(Tile& t, const Share& w, const float* Cr,
                                           const float* Br, int ldu, int q, int N,
                                           float* sA, float* sB) {
    t.zero();
    contract<Rows, Rows>(
        (N + kKt - 1) / kKt, sA, sB,
        [&](int k, int r, int kk) {
            const int n = k * kKt + kk;
            return r < q && n < N ? Cr[r * ldu + n] : 0.0f;
        },
        [&](int k, int r, int kk) {
            const int n = k * kKt + kk;
            return r < q && n < N ? Br[r * ldu + n] : 0.0f;
        },
        [&](int) { mma_rows(t, w, sA, sB); });
}

// t += (f_r A_r) . Mt_c over N states (rows r < q of A, ld apart; f = 1
// when fac is null; Mt is [P][N] state-major, columns c with p0 + c < P):
// the products with a chunk's entry state or its gradient.
__device__ __forceinline__ void state_product(Tile& t, const Share& w, const float* Ar,
                                              int ld, const float* fac, int q,
                                              const float* Mt, int p0, int P, int N, float* sA,
                                              float* sB) {
    contract<Rows, Rows>(
        (N + kKt - 1) / kKt, sA, sB,
        [&](int k, int r, int kk) {
            const int n = k * kKt + kk;
            return r < q && n < N ? (fac ? fac[r] : 1.0f) * Ar[r * ld + n] : 0.0f;
        },
        [&](int k, int c, int kk) {
            const int n = k * kKt + kk;
            return p0 + c < P && n < N ? Mt[(p0 + c) * N + n] : 0.0f;
        },
        [&](int) { mma_rows(t, w, sA, sB); });
}

// This thread's fragment elements of the (chunk, group) tile cb (from
// mamba_ssd_cb_tc) into t.
__device__ __forceinline__ void load_cb(Tile& t, const Share& w, const float* cb) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            t.acc[nt][e] = cb[(w.r0 + Tile::row(e)) * kQ + w.c0 + Tile::col(nt, e)];
        }
}

}  // namespace mamba_ssd_tc

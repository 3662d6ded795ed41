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
// and bf16 operands' cp.async and register paths) and their two ways of
// writing an output tile (fragment pairs, store_tile_f32; rows of 8
// through shared memory, tile_rows8), which read best beside the layouts
// they fill and drain.
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

// How the SSD's kept tensors are held between its kernels: the scan's
// inputs x, B and C (the conv output), the gradient of its output dy and
// the chunks' entry states and their gradients are f32 (tf32 runs), or
// their bf16 rounding alone (bf16 runs: SPEC's stored activations, and the
// reference keeps its passed states in the input's type); dt and the
// running sums stay f32. The
// kernels that read or make them are templates over that type S. A bf16
// value is widened to f32 where it is read (exact), so a product reads the
// values an f32 kernel fed the bf16 rounding would read, in the same
// order: its bits.
__device__ __forceinline__ float kept_f32(float v) { return v; }
__device__ __forceinline__ float kept_f32(unsigned short h) { return bf16_to_f32(h); }

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
//
// A tile of bf16 values (T = unsigned short: the kept tensors below) is
// staged as bf16 in the same space, with rows of ld<T> values (KT + 8 or
// kQ + 8: 16-byte aligned rows, and a fragment read's 32 lanes on 16 words
// of distinct banks, two lanes a word), and widened as the mma reads it.
// A(r, k) and B(k, c) name the values an mma reads from a staged tile
// (a_value; b_at with strides b_ks, b_ns): a row-major tile is A's rows or
// B's columns, a step-major one A's columns or B's rows.
template <int KT>
struct RowMajor {
    static constexpr int kIt = kQ * KT / kThreads;
    static constexpr int kFirst = kQ, kSecond = KT, kSteps = KT / 8;
    template <class T>
    static constexpr int ld = sizeof(T) == 4 ? KT + 4 : KT + 8;
    static __device__ __forceinline__ int first(int idx) { return idx / KT; }
    static __device__ __forceinline__ int second(int idx) { return idx % KT; }
    static __device__ __forceinline__ int at(int idx) { return idx / KT * (KT + 4) + idx % KT; }
    template <class T>
    static __device__ __forceinline__ float a_value(const T* s, int r, int k) {
        return kept_f32(s[r * ld<T> + k]);
    }
    template <class T>
    static __device__ __forceinline__ const T* b_at(const T* s, int c) {
        return s + c * ld<T>;
    }
    template <class T>
    static constexpr int b_ks = 1;
    template <class T>
    static constexpr int b_ns = ld<T>;
};

template <int KT>
struct StepMajor {
    static constexpr int kIt = kQ * KT / kThreads;
    static constexpr int kFirst = KT, kSecond = kQ, kSteps = KT / 8;
    template <class T>
    static constexpr int ld = kQ + 8;
    static __device__ __forceinline__ int first(int idx) { return idx / kQ; }
    static __device__ __forceinline__ int second(int idx) { return idx % kQ; }
    static __device__ __forceinline__ int at(int idx) { return idx / kQ * kKm + idx % kQ; }
    template <class T>
    static __device__ __forceinline__ float a_value(const T* s, int r, int k) {
        return kept_f32(s[k * ld<T> + r]);
    }
    template <class T>
    static __device__ __forceinline__ const T* b_at(const T* s, int c) {
        return s + c;
    }
    template <class T>
    static constexpr int b_ks = ld<T>;
    template <class T>
    static constexpr int b_ns = 1;
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

// The element type of a source lambda's addresses.
template <class P>
struct Pointee;
template <class T>
struct Pointee<const T*> {
    using type = T;
};

// kLdH: a bf16 row of a 64-wide tile (kQ + 8 values, 144 bytes), the rows
// of the 64 x 64 tiles below and of StepMajor's bf16 tiles.
constexpr int kLdH = kQ + 8;
static_assert(kQ * kLdH * 2 <= kOutStateTile * 4, "a bf16 64 x 64 tile fits its f32 tile's space");
static_assert(kKt * kLdH * 2 <= kStage * 4, "a bf16 step tile fits its f32 buffer");
static_assert(kQ * (kKt + 8) * 2 <= kStage * 4, "a bf16 row tile fits its f32 buffer");

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

// Whether kept values of type T can be staged in whole pieces (4 f32 or 8
// bf16, one 16-byte copy): p 16-byte aligned, and `dims` (the leading
// dimensions, column offsets and extents whose multiples the pieces start
// at and stop before) multiples of the piece, so that a piece is inside or
// outside as a whole.
template <class T>
__device__ __forceinline__ bool kept_vec(const T* p, long long dims) {
    constexpr long long piece = 16 / sizeof(T);
    return (reinterpret_cast<unsigned long long>(p) & 15) == 0 && (dims & (piece - 1)) == 0;
}

// A 64 x 64 tile of kept values T by cp.async into dst (rows of LdF f32,
// or of kLdH bf16): element (r, c) from src + r ld + c when inside(r, c)
// (asked of a piece's first element), else zero; whole pieces when vec
// (kept_vec). Commits nothing.
template <int LdF, class T, class In>
__device__ __forceinline__ void stage_tile(float* dst, const T* src, long long ld, bool vec,
                                           In inside) {
    if constexpr (sizeof(T) == 4) {
        tile_pieces(vec, [&](int r, int c, int width) {
            cp_async_piece(dst + r * LdF + c, src + r * ld + c, inside(r, c), width);
        });
    } else {
        unsigned short* d = reinterpret_cast<unsigned short*>(dst);
        tile_pieces_of<kQ, 8>(vec, [&](int r, int c, int width) {
            cp_async_piece_h(d + r * kLdH + c, src + r * ld + c, inside(r, c), width);
        });
    }
}

// Reading a 64 x 64 tile staged by stage_tile<LdF, T>: its row length, its
// values as T, and element (r, c) widened.
template <int LdF, class T>
constexpr int tile_ld = sizeof(T) == 4 ? LdF : kLdH;
template <int LdF, class T>
__device__ __forceinline__ const T* tile_of(const float* s) {
    return reinterpret_cast<const T*>(s);
}
template <int LdF, class T>
__device__ __forceinline__ float tile_at(const float* s, int r, int c) {
    return kept_f32(tile_of<LdF, T>(s)[r * tile_ld<LdF, T> + c]);
}

// One operand tile of layout L by cp.async into dst: src(k, first, second)
// gives an element's address, or nullptr for a zero. f32 values element by
// element (4-byte copies); bf16 values in pieces of 8 along `second` when
// vec (src then asked of a piece's first element, which decides the whole
// piece), else element by element by plain loads.
template <class L, class Src>
__device__ __forceinline__ void stage_elements(float* dst, int k, bool vec, Src src) {
    using T = typename Pointee<decltype(src(0, 0, 0))>::type;
    if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int i = 0; i < L::kIt; ++i) {
            const int idx = threadIdx.x + i * kThreads;
            const float* p = src(k, L::first(idx), L::second(idx));
            cp_async_piece(dst + L::at(idx), p, p != nullptr, 1);
        }
    } else {
        unsigned short* d = reinterpret_cast<unsigned short*>(dst);
        constexpr int ld = L::template ld<T>;
        if (vec) {
            constexpr int per_row = L::kSecond / 8;
#pragma unroll
            for (int i = 0; i < L::kFirst * per_row / kThreads; ++i) {
                const int idx = threadIdx.x + i * kThreads;
                const int f = idx / per_row, c = 8 * (idx % per_row);
                const T* p = src(k, f, c);
                cp_async_piece_h(d + f * ld + c, p, p != nullptr, 8);
            }
        } else {
#pragma unroll
            for (int i = 0; i < L::kIt; ++i) {
                const int idx = threadIdx.x + i * kThreads;
                const int f = L::first(idx), c = L::second(idx);
                const T* p = src(k, f, c);
                cp_async_piece_h(d + f * ld + c, p, p != nullptr, 1);
            }
        }
    }
}

// t += A B over the KT steps of a staged A tile (layout LA, values TA) and
// B tile (LB, TB): the warp's share of rows and columns.
template <class LA, class LB, class TA, class TB>
__device__ __forceinline__ void mma_staged(Tile& t, const Share& w, const TA* a, const TB* b) {
    t.mma_a([&](int r, int k) { return LA::a_value(a, w.r0 + r, k); }, LB::b_at(b, w.c0),
            LB::template b_ks<TB>, LB::template b_ns<TB>, LA::kSteps);
}

// contract's twin for operands that are plain copies of global memory: each
// tile's elements arrive by cp.async (stage_elements: src_a / src_b(k, .,
// .) give an element's address, or nullptr for a zero; their pointee, f32
// or bf16, is the staged type, and vec_a / vec_b allow bf16 pieces of 8) in
// the other of two buffers per operand while the current tile's mma(k, a,
// b) runs on buffers a and b (as the staged types); no register holds them
// meanwhile. The same tiles, values and order as contract, so the same
// bits (bf16 values: those of the f32 values of their rounding). sA and
// sB hold two tiles of their layouts each. Every thread of the block calls
// it; it synchronises before it first writes shared memory.
template <class LA, class LB, class SA, class SB, class M>
__device__ __forceinline__ void contract_async(int tiles, float* sA, float* sB, int stride,
                                               bool vec_a, bool vec_b, SA src_a, SB src_b,
                                               M mma) {
    using TA = typename Pointee<decltype(src_a(0, 0, 0))>::type;
    using TB = typename Pointee<decltype(src_b(0, 0, 0))>::type;
    auto stage = [&](int k) {
        stage_elements<LA>(sA + (k & 1) * stride, k, vec_a, src_a);
        stage_elements<LB>(sB + (k & 1) * stride, k, vec_b, src_b);
        cp_async_commit();
    };
    two_buffers(tiles, stage, [&](int k) {
        mma(k, reinterpret_cast<const TA*>(sA + (k & 1) * stride),
            reinterpret_cast<const TB*>(sB + (k & 1) * stride));
    });
}

// A state as it is kept (kept_f32 above): f32, or its bf16 rounding.
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

// t = C_i . B_j of one (chunk, group) over d_state (rows i, columns j),
// 32 states a tile, C and B kept as S. f32 values are staged through
// registers (contract); bf16 ones arrive by cp.async in pieces of 8 when
// vec (kept_vec of their rows), in the other of two buffers per operand
// (contract_async: sA and sB then hold 2 kStage floats each), and are
// widened as the mma reads them: the values and order of the f32 kernel
// fed their widening, so its bits. Every thread of the block calls it.
template <class S>
__device__ __forceinline__ void cb_product(Tile& t, const Share& w, const S* Cr, const S* Br,
                                           int ldu, int q, int N, float* sA, float* sB,
                                           bool vec) {
    t.zero();
    const int tiles = (N + kKt - 1) / kKt;
    if constexpr (sizeof(S) == 4) {
        contract<Rows, Rows>(
            tiles, sA, sB,
            [&](int k, int r, int kk) {
                const int n = k * kKt + kk;
                return r < q && n < N ? Cr[r * ldu + n] : 0.0f;
            },
            [&](int k, int r, int kk) {
                const int n = k * kKt + kk;
                return r < q && n < N ? Br[r * ldu + n] : 0.0f;
            },
            [&](int) { mma_staged<Rows, Rows>(t, w, sA, sB); });
    } else {
        const auto at = [&](const S* base) {
            return [=](int k, int r, int kk) -> const S* {
                const int n = k * kKt + kk;
                return r < q && n < N ? base + r * ldu + n : nullptr;
            };
        };
        contract_async<Rows, Rows>(
            tiles, sA, sB, kStage, vec, vec, at(Cr), at(Br),
            [&](int, const S* a, const S* b) { mma_staged<Rows, Rows>(t, w, a, b); });
    }
}

// The warp's share of t into a row-major f32 matrix o (leading dimension
// ld): elements (r, c) with r < rows and c < cols. A fragment's elements e
// and e + 1 are adjacent columns: one 8-byte store of the pair when both
// are inside and `pairs` (o 8-byte aligned, ld even), so a row's four
// lanes write a whole 32-byte sector (4-byte stores wrote it in halves).
__device__ __forceinline__ void store_tile_f32(const Tile& t, const Share& w, float* o, long long ld,
                                               int rows, int cols, bool pairs) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
            const int r = w.r0 + Tile::row(e), c = w.c0 + Tile::col(nt, e);
            if (r >= rows) continue;
            float* at = o + r * ld + c;
            if (pairs && c + 1 < cols) {
                *reinterpret_cast<float2*>(at) = float2{t.acc[nt][e], t.acc[nt][e + 1]};
            } else {
                if (c < cols) at[0] = t.acc[nt][e];
                if (c + 1 < cols) at[1] = t.acc[nt][e + 1];
            }
        }
}

// The block's 64 x 64 output tile written through shared memory: each
// warp puts its share, val(r, c, acc) of each accumulator, into `stage`
// (f32 [64][kOutLd], free for the block: the caller's barrier made it so),
// then each thread takes runs of 8 consecutive columns of a row (r < rows,
// c < cols; n of them, 8 but at the edge) and finishes them, fin(r, c8,
// n, v), so its global accesses can be 16-byte ones (a fragment's 2- and
// 4-byte accesses fill each 32-byte sector a quarter). Every thread of the
// block calls it; stage is read until the caller's next barrier.
template <class Val, class Fin>
__device__ __forceinline__ void tile_rows8(const Tile& t, const Share& w, float* stage, int rows,
                                           int cols, Val val, Fin fin) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = w.r0 + Tile::row(e), c = w.c0 + Tile::col(nt, e);
            stage[r * kOutLd + c] = val(r, c, t.acc[nt][e]);
        }
    __syncthreads();
    for (int it = threadIdx.x; it < kQ * (kQ / 8); it += kThreads) {
        const int r = it / (kQ / 8), c8 = 8 * (it % (kQ / 8));
        if (r >= rows || c8 >= cols) continue;
        float v[8];
        const float4 a = *reinterpret_cast<const float4*>(stage + r * kOutLd + c8);
        const float4 b = *reinterpret_cast<const float4*>(stage + r * kOutLd + c8 + 4);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
        v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        fin(r, c8, min(8, cols - c8), v);
    }
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

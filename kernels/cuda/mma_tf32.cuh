// Warp-level tf32 tensor-core products (mma.sync m16n8k8, sm_80 and later)
// for kernels whose tf32 / bf16 runs may round a product's operands to
// tf32 (10 mantissa bits) and accumulate in f32.
//
// Determinism: an mma's sum over its 8 steps is done by the tensor core in
// an order fixed by the hardware (the same every run on one GPU model), and
// a warp's steps are issued in ascending k, each one mma on the running
// accumulator; nothing depends on scheduling. The order inside one mma is
// not IEEE's sequential one, so these products are pinned by tolerance
// (against f64 oracles and the CPU model), never bit for bit to a CPU twin.
//
// Under the CPU emulator (kernels/emu/cuda_emu.h) the fragments are
// exchanged through the warp exactly as laid out below, and each output is
// summed in ascending k: a wrong fragment index gives wrong numbers there
// too.
#pragma once

namespace mamba {

// x rounded to tf32, nearest with ties away from zero (cvt.rna.tf32.f32),
// as the bits of an f32 whose low 13 bits are zero.
static __device__ __forceinline__ unsigned to_tf32(float x) {
#ifdef MAMBA_CUDA_EMU
    unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & ~0x1fffu;
    return u;
#else
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
#endif
}

// d += a b over one 16 x 8 x 8 tile, called by all 32 lanes of a warp with
// their fragments (g = lane / 4, t = lane % 4; (row, k) of A, (k, column)
// of B, (row, column) of D):
//   a[0] (g, t), a[1] (g + 8, t), a[2] (g, t + 4), a[3] (g + 8, t + 4);
//   b[0] (t, g), b[1] (t + 4, g);
//   d[0] (g, 2t), d[1] (g, 2t + 1), d[2] (g + 8, 2t), d[3] (g + 8, 2t + 1).
static __device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4],
                                                const unsigned (&b)[2]) {
#ifdef MAMBA_CUDA_EMU
    emu_mma_tf32(d, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, "
        "%7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// A B operand element as tf32 bits: an f32 rounded as it is read, or a
// bf16 widened (exact in tf32, so the rounding would change nothing: none
// is done).
static __device__ __forceinline__ unsigned b_tf32(const float* p) { return to_tf32(*p); }
static __device__ __forceinline__ unsigned b_tf32(const unsigned short* p) {
    return (unsigned)*p << 16;
}

// A warp's 16 x 8 NT share of a product tile in registers: acc[nt][e] is
// (row(e), col(nt, e)) relative to the share's first row and column, and
// warp_mma adds sum_k A(row, k) B(k, col) to it, k from 0 to 8 ksteps
// ascending, with A(r, k) = sa[r * a_rs + k * a_ks] and B(k, c) = sb[k *
// b_ks + c * b_ns] (shared memory, f32 rounded to tf32 as they are read, or
// B in bf16 (TB), widened; sa and sb already offset to the share's first
// row / column and step).
template <int NT>
struct WarpTile {
    float acc[NT][4];

    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
    }
    static __device__ __forceinline__ int row(int e) { return threadIdx.x % 32 / 4 + 8 * (e >> 1); }
    static __device__ __forceinline__ int col(int nt, int e) {
        return 8 * nt + 2 * (threadIdx.x % 4) + (e & 1);
    }

    template <class TB>
    __device__ __forceinline__ void mma(const float* sa, int a_rs, int a_ks, const TB* sb,
                                        int b_ks, int b_ns, int ksteps) {
        mma_a([=](int r, int k) { return sa[r * a_rs + k * a_ks]; }, sb, b_ks, b_ns, ksteps);
    }

    // As mma, with A(r, k) = a_at(r, k), any f32 expression of shared
    // memory (rounded to tf32 once made, as a stored operand would be).
    template <class A, class TB>
    __device__ __forceinline__ void mma_a(A a_at, const TB* sb, int b_ks, int b_ns,
                                          int ksteps) {
        const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll 2
        for (int ks = 0; ks < ksteps; ++ks) {
            const int k = 8 * ks + t;
            const unsigned a[4] = {to_tf32(a_at(g, k)), to_tf32(a_at(g + 8, k)),
                                   to_tf32(a_at(g, k + 4)), to_tf32(a_at(g + 8, k + 4))};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int c = 8 * nt + g;
                const unsigned b[2] = {b_tf32(sb + k * b_ks + c * b_ns),
                                       b_tf32(sb + (k + 4) * b_ks + c * b_ns)};
                mma_tf32(acc[nt], a, b);
            }
        }
    }
};

}  // namespace mamba

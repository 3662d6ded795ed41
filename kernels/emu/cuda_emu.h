// A CPU emulation of the small CUDA subset the scan and SSD kernels use, so their
// logic (indices, barriers, shuffles, staging) can be checked against an
// oracle on a machine without a GPU (kernels/src/mamba/scan_emu_tests.rs).
// Not for timing, and not for bits: the math library is the host's.
//
// Model: the blocks of a launch run one after another on `blockDim.x`
// persistent std::threads; __syncthreads is a barrier over them;
// __shfl_xor_sync an exchange between two barriers over the warp (32
// threads); a `__shared__` array is a function static (shared by the
// threads of the one block that runs); dynamic shared memory (`EMU_SMEM`)
// is refilled with NaN before every block, so a read of something no thread
// wrote shows up in the results. cp.async (emu_cp_async) is modelled at its
// latest: a copy lands only when its thread waits for its group, so a read
// before the wait, or one the barrier does not cover, sees NaN or stale data.
// Kernels are compiled with MAMBA_CUDA_EMU defined, for the few places
// (inline PTX, `extern __shared__`) that need an emulated spelling.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct EmuDim {
    unsigned x = 1, y = 1, z = 1;
};
inline thread_local EmuDim threadIdx, blockIdx;
inline EmuDim blockDim, gridDim;
inline std::unique_ptr<std::barrier<>> g_block_barrier;
inline std::vector<std::unique_ptr<std::barrier<>>> g_warp_barriers;
inline float g_shfl[1024];
inline std::vector<float> g_dyn_smem;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__ __restrict
#define EMU_SMEM (g_dyn_smem.data())

inline void __syncthreads() { g_block_barrier->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int off) {
    const unsigned t = threadIdx.x, w = t / 32;
    g_shfl[t] = v;
    g_warp_barriers[w]->arrive_and_wait();
    const float r = g_shfl[t ^ static_cast<unsigned>(off)];
    g_warp_barriers[w]->arrive_and_wait();
    return r;
}

// Lane + delta's value, or the lane's own past the warp's end.
inline float __shfl_down_sync(unsigned, float v, unsigned delta) {
    const unsigned t = threadIdx.x, w = t / 32;
    g_shfl[t] = v;
    g_warp_barriers[w]->arrive_and_wait();
    const float r = t % 32 + delta < 32 ? g_shfl[t + delta] : v;
    g_warp_barriers[w]->arrive_and_wait();
    return r;
}

// mma.sync m16n8k8 tf32 (kernels/cuda/mma_tf32.cuh), the warp's
// fragments exchanged as the PTX layout places them: each lane publishes
// its a / b registers, then computes its four outputs from the whole
// warp's, each summed over k in ascending order in f32 onto the lane's
// accumulator (the products of tf32 values are exact in f32).
inline unsigned g_mma_a[1024][4], g_mma_b[1024][2];
inline void emu_mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    const unsigned t = threadIdx.x, w = t / 32, base = 32 * w, lane = t % 32;
    for (int i = 0; i < 4; ++i) g_mma_a[t][i] = a[i];
    for (int i = 0; i < 2; ++i) g_mma_b[t][i] = b[i];
    g_warp_barriers[w]->arrive_and_wait();
    auto fa = [&](unsigned r, unsigned k) {  // A(r, k): lane 4 (r % 8) + k % 4
        const unsigned reg = r / 8 + 2 * (k / 4);
        float v;
        std::memcpy(&v, &g_mma_a[base + 4 * (r % 8) + k % 4][reg], 4);
        return v;
    };
    auto fb = [&](unsigned k, unsigned c) {  // B(k, c): lane 4 c + k % 4
        float v;
        std::memcpy(&v, &g_mma_b[base + 4 * c + k % 4][k / 4], 4);
        return v;
    };
    const unsigned g = lane / 4, tq = lane % 4;
    for (int e = 0; e < 4; ++e) {
        const unsigned r = g + 8 * (e >> 1), c = 2 * tq + (e & 1);
        float s = d[e];
        for (unsigned k = 0; k < 8; ++k) s = s + fa(r, k) * fb(k, c);
        d[e] = s;
    }
    g_warp_barriers[w]->arrive_and_wait();
}

struct alignas(16) float4 {
    float x, y, z, w;
};

struct alignas(8) float2 {
    float x, y;
};

struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

// A single-rounding fused multiply-add, as the device's.
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
// A product never contracted into a neighbouring add (the host does not
// contract anyway: ISO C++ mode, no FMA target).
inline float __fmul_rn(float a, float b) { return a * b; }
inline unsigned __float_as_uint(float v) {
    unsigned b;
    std::memcpy(&b, &v, 4);
    return b;
}

inline float __uint_as_float(unsigned b) {
    float v;
    std::memcpy(&v, &b, 4);
    return v;
}

inline float __int_as_float(int b) {
    float v;
    std::memcpy(&v, &b, 4);
    return v;
}

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

struct EmuCopy {
    float* dst;
    const float* src;
};
inline thread_local std::vector<std::vector<EmuCopy>> g_groups;
inline thread_local std::vector<EmuCopy> g_open;
inline void emu_cp_async(float* dst, const float* src) { g_open.push_back({dst, src}); }
// A 16-byte cp.async (or vector store) needs both addresses 16-byte aligned;
// the device faults otherwise, so the emulated run stops, naming them.
inline void emu_check_aligned16(const void* dst, const void* src) {
    if (((reinterpret_cast<std::uintptr_t>(dst) | reinterpret_cast<std::uintptr_t>(src)) & 15) != 0) {
        std::fprintf(stderr, "misaligned 16-byte cp.async: dst %p src %p\n", dst, src);
        std::abort();
    }
}
inline void emu_commit() {
    g_groups.push_back(std::move(g_open));
    g_open.clear();
}
inline void emu_wait(size_t pending) {
    while (g_groups.size() > pending) {
        // Four raw bytes, as the hardware copies them (a staged pair of
        // bf16 values is no float: a float assignment could quiet a NaN).
        for (auto& c : g_groups.front()) std::memcpy(c.dst, c.src, 4);
        g_groups.erase(g_groups.begin());
    }
}

// Run `kernel` (which reads threadIdx / blockIdx) over `grid` blocks of
// `block` threads (a multiple of 32, at most 1024) with `dyn_floats` floats
// of dynamic shared memory.
inline void emu_launch(EmuDim grid, unsigned block, size_t dyn_floats,
                       const std::function<void()>& kernel) {
    gridDim = grid;
    blockDim = EmuDim{block, 1, 1};
    g_block_barrier = std::make_unique<std::barrier<>>(block);
    g_warp_barriers.clear();
    for (unsigned w = 0; w < block / 32; ++w) {
        g_warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
    }
    g_dyn_smem.assign(dyn_floats + 1, std::nanf(""));
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < block; ++t) {
        threads.emplace_back([&, t] {
            threadIdx = EmuDim{t, 0, 0};
            for (unsigned bz = 0; bz < grid.z; ++bz)
                for (unsigned by = 0; by < grid.y; ++by)
                    for (unsigned bx = 0; bx < grid.x; ++bx) {
                        blockIdx = EmuDim{bx, by, bz};
                        kernel();
                        emu_wait(0);
                        // The block is over: thread 0 refills the dynamic
                        // shared memory before the next one starts.
                        g_block_barrier->arrive_and_wait();
                        if (t == 0) std::fill(g_dyn_smem.begin(), g_dyn_smem.end(), std::nanf(""));
                        g_block_barrier->arrive_and_wait();
                    }
        });
    }
    for (auto& th : threads) th.join();
}

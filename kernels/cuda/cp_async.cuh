// cp.async (sm_80+): copies from global to shared memory that hold no
// register while in flight, grouped per thread (commit) and completed by a
// wait; a barrier after the wait makes them visible to the block. Under the
// CPU emulator (kernels/emu/cuda_emu.h) the same calls are modelled there,
// each copy landing only at its thread's wait.
#pragma once

// Internal linkage, like the kernels' other helpers: each .cu that
// includes this gets its own copies.
namespace {

// One float.
__device__ __forceinline__ void cp_async4(float* dst, const float* src) {
#ifdef MAMBA_CUDA_EMU
    emu_cp_async(dst, src);
#else
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src) : "memory");
#endif
}

// Four floats; dst and src 16-byte aligned (the emulator checks it: the
// hardware faults on a misaligned 16-byte copy).
__device__ __forceinline__ void cp_async16(float* dst, const float* src) {
#ifdef MAMBA_CUDA_EMU
    emu_check_aligned16(dst, src);
    for (int i = 0; i < 4; ++i) emu_cp_async(dst + i, src + i);
#else
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef MAMBA_CUDA_EMU
    emu_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most `pending` of this thread's committed groups are in
// flight (0 .. 3: wait_group takes an immediate; a larger count waits as
// for 3, which is only stricter).
__device__ __forceinline__ void cp_async_wait(int pending) {
#ifdef MAMBA_CUDA_EMU
    emu_wait(pending <= 0 ? 0 : pending < 3 ? pending : 3);
#else
    if (pending <= 0) {
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    } else if (pending == 1) {
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    } else if (pending == 2) {
        asm volatile("cp.async.wait_group 2;\n" ::: "memory");
    } else {
        asm volatile("cp.async.wait_group 3;\n" ::: "memory");
    }
#endif
}

}  // namespace

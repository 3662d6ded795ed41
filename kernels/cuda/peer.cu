// The peer fold of mamba-reduce's PeerReducer: ranks of one node map each
// other's gradient arenas (CUDA memory-pool IPC) and every shard owner folds
// its shard of all of them in one kernel, writing the mean back into every
// rank's arena. Two kernels:
//
//   peer_barrier:  every rank's arrival flag in every rank's flag array, then
//                  a wait for all of them, with a deadline (%globaltimer) and
//                  an abort value, so a dead or failed peer is a status code
//                  naming it, never a hang;
//   peer_fold_f32: dst_d[i] = ((a0[i] + a1[i]) + ...) + a{n-1}[i], then
//                  optionally * factor, for every destination d: the chain of
//                  fold_chain.cuh (the bits of det_chain, of the host fold),
//                  fanned out to up to kMaxPeers destinations.
//
// Memory model. Flags are u64 in device memory; rank q's flag array has one
// slot per rank, slot r written only by rank r. An arrival is a system-scope
// release store of the barrier's epoch (after a system-scope fence, so the
// fold kernel that ran before on this stream is ordered before it: every fold
// thread also ends with __threadfence_system()); a wait is a system-scope
// acquire load of the own array. Epochs grow by one per barrier and every
// rank runs the same barriers in the same order, so a slot holds the epoch
// being waited for or the next one (a peer cannot pass a barrier this rank
// has not arrived at), hence the `>=`. A slot with kAbort set is a peer that
// failed on its own side and told every peer so.
//
// Status word (device u32, this rank's own memory): 0 while all is well;
// (1 << 28) | q when peer q missed the deadline; (2 << 28) | q when peer q
// posted an abort. The first failure wins (atomicCAS); a fold or barrier
// launched after a failure returns at once without touching peer memory.

#include "fold_chain.cuh"

namespace {

constexpr unsigned kMaxPeers = 8;
constexpr unsigned long long kAbort = 1ull << 63;
constexpr unsigned kTimedOut = 1u << 28;
constexpr unsigned kAborted = 2u << 28;

struct FlagList {
    unsigned long long* p[kMaxPeers];
};

struct DstList {
    float* p[kMaxPeers];
};

__device__ __forceinline__ unsigned long long global_timer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void store_release_sys(unsigned long long* p, unsigned long long v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long load_acquire_sys(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ unsigned read_status(const unsigned* status) {
    return *reinterpret_cast<const volatile unsigned*>(status);
}

template <bool SCALE>
__device__ __forceinline__ void fold_fanout(const DstList& d, unsigned n_dst, const ChainTerms& a,
                                            unsigned n, size_t len, float factor) {
    const size_t step = grid_threads();
    bool vec = true;
    for (unsigned k = 0; k < n; ++k) vec = vec && aligned16(a.p[k]);
    for (unsigned k = 0; k < n_dst; ++k) vec = vec && aligned16(d.p[k]);
    size_t done = 0;
    if (vec) {
        const size_t n_vec = len / 4;
        for (size_t v = global_thread(); v < n_vec; v += step) {
            const float4 acc = chain4_at<SCALE>(a, n, v, factor);
            for (unsigned k = 0; k < n_dst; ++k) reinterpret_cast<float4*>(d.p[k])[v] = acc;
        }
        done = n_vec * 4;
    }
    for (size_t i = done + global_thread(); i < len; i += step) {
        const float acc = chain_at<SCALE>(a, n, i, factor);
        for (unsigned k = 0; k < n_dst; ++k) d.p[k][i] = acc;
    }
}

}  // namespace

// Arrive at barrier `epoch` and wait for every rank (thread q < world handles
// peer q), at most timeout_ns of %globaltimer from this kernel's start.
// flags.p[q] is rank q's flag array (flags.p[rank] this rank's own), each of
// `world` slots. One block of 32 threads, world <= kMaxPeers.
extern "C" __global__ void peer_barrier(FlagList flags, unsigned world, unsigned rank,
                                        unsigned long long epoch, unsigned long long timeout_ns,
                                        unsigned* status) {
    const unsigned q = threadIdx.x;
    if (q >= world || read_status(status) != 0u) return;
    __threadfence_system();
    store_release_sys(flags.p[q] + rank, epoch);
    const unsigned long long* own = flags.p[rank] + q;
    const unsigned long long start = global_timer();
    for (;;) {
        const unsigned long long v = load_acquire_sys(own);
        if (v & kAbort) {
            atomicCAS(status, 0u, kAborted | q);
            return;
        }
        if (v >= epoch) return;
        if (read_status(status) != 0u) return;  // another peer already failed
        if (global_timer() - start > timeout_ns) {
            atomicCAS(status, 0u, kTimedOut | q);
            return;
        }
        __nanosleep(256);
    }
}

// dsts.p[0..n_dst) = the chain over addends.p[0..n), times factor when
// scale != 0, for len elements; nothing when *status != 0. A destination may
// be one of the addends (the same base pointer): each element is read from
// every addend and then written by one thread only.
extern "C" __global__ void __launch_bounds__(1024)
    peer_fold_f32(DstList dsts, unsigned n_dst, ChainTerms addends, unsigned n,
                  unsigned long long len, float factor, unsigned scale, const unsigned* status) {
    if (read_status(status) != 0u) return;
    if (scale != 0u) {
        fold_fanout<true>(dsts, n_dst, addends, n, len, factor);
    } else {
        fold_fanout<false>(dsts, n_dst, addends, n, len, factor);
    }
    __threadfence_system();
}

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
// (sp = ceil(N / kLaneStates) rounded up to a power of two, 1..32, lane l
// holding states l*kLaneStates ..), so a block of kScanThreads threads covers
// cpb = kScanThreads / sp channels. Sums over n are serial over a lane's
// states, then a fixed xor-butterfly over its channel's sp lanes (one warp).
// The recurrence itself is never reassociated: h_t comes from h_{t-1} by the
// formula above, in order, for every t, as one fused multiply-add
// (__fmaf_rn(a, h, (dt B) u)) in the forward and in the backward's
// recompute alike, so the two passes' states have the same bits.
// The kernels are templates over sp (dispatched once per launch), so the
// lane layout and every shared-memory offset are compile-time constants.
// The file is built with --fmad=true (kernels/README.md): its contract is
// the tolerance of cuda_scan against a sequential f64 scan.
//
// Staging. Every thread of a block reads the same B_t / C_t rows (staged
// padded to npad = sp * kLaneStates states each, zeros past N, so no step
// branches on n < N) and each
// channel's dt / u / z (or dy) columns are read by its sp lanes, so a block
// copies each chunk of kChunk steps of them into shared memory with cp.async
// (no registers held), one chunk ahead of the one it computes: the serial
// walk reads only shared memory and registers. In a bf16 run u and dt are
// stored in bf16 only (and y is written in bf16 only): their columns are
// staged as bf16, two channels a 4-byte copy, and widened to f32 when read
// (exactly: every bf16 is an f32), so the walk is the f32-input walk on the
// same values, bit for bit (the CPU emulator checks it). (The first serial
// version loaded B_t / C_t from global memory inside each step and waited ~2,500
// cycles a step at 9 % warp occupancy; docs/PERFORMANCE.md.)
//
// Deferred sums. Inside the serial walk a thread keeps its per-step partial
// sums over its own states in registers (one per step of the chunk); the
// shuffles over a channel's lanes run after the walk, all steps at once,
// and the per-channel outputs (y and out; d dt and d u) are finished by the
// whole block from shared memory. No step waits on the previous step's
// shuffle, and no lane-0 branch sits in the walk. The sums keep their
// association: serial over a lane's states, then the xor butterfly.
//
// Forward (mamba_scan_fwd): walks t upward; at the start of each chunk it
// stores the state it enters with in Hin ([B][nch][D][N], 1/kChunk of the
// (B, T, D, N) states, kept for the backward pass), and writes y and out at
// every step.
//
// Time segments. A sequence of more than `seg` chunks (ScanShape's
// SEGMENT_CHUNKS, a function of nothing but the constant: the association
// depends on T alone) is cut into segments of `seg` chunks, each walked by
// its own blocks (grid z), so that a short batch of long sequences still
// fills the GPU: the serial walk is B x D x lanes threads, 48 blocks for one
// 8192-step sequence at the 130m shape. A first pass (mamba_scan_fwd_seg)
// gives each segment but the last its end state from a zero entry and the
// product of its decays; segment s then enters with h = P_{s-1} (...(P_0 0
// + hloc_0)...) + hloc_{s-1}, one FMA per earlier segment, in order. The
// backward does the same for the carry (mamba_scan_bwd_seg, folded from the
// last segment down), and writes one d A partial per segment. One segment
// (T <= 16 * seg) is exactly the unsegmented walk.
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
//
// Over 450 lines: one concept, the scan's two directions and their time
// segments' first passes and link, whose staging (cp.async helpers, the
// padded chunk layout, Lanes), decay and recurrence step are shared and must
// stay bit-identical between the forward, the backward's recompute and the
// first passes (the two first passes repeat their directions' chunk loops
// in miniature, staging C and a third column they do not read, so that
// stage_chunk stays the only staging code); splitting the file would put those helpers in a header that
// the CPU emulation check (kernels/emu) would then also have to track.

#include "mamba_common.cuh"
#include "cp_async.cuh"

using namespace mamba;

namespace {

constexpr int kChunk = 16;
constexpr int kScanThreads = 128;
constexpr int kLaneStates = 4;
// Backward steps whose d B / d C contributions are staged before one
// cross-channel summation (two barriers per stage).
constexpr int kStage = 4;
// Per-channel columns staged per chunk: dt, u and z (forward) or dy (backward).
constexpr int kCols = 3;

// The lane layout for SP lanes per channel (a power of two, 1..32).
template <int SP>
struct Lanes {
    static constexpr int cpb = kScanThreads / SP;   // channels per block
    static constexpr int npad = SP * kLaneStates;   // states a channel's lanes cover
    static constexpr int row = 2 * npad;            // staged B|C row: B[npad] then C[npad]
    // Floats of one chunk's staging buffer: the B|C rows [kChunk][row], then
    // kCols columns [kCols][kChunk][cpb]. Must match ScanShape (scan_shape.rs).
    static constexpr int stage = kChunk * (row + kCols * cpb);
    // Per-channel results of one chunk, `nv` per (step, channel):
    // fin[(j * nv + v) * cpb + cl].
    static constexpr int fin(int nv) { return kChunk * nv * cpb; }
    // Row stride of the backward's d B / d C stage (one column per thread,
    // a row per (slot, B/C, state slot i)). The walk's stores are
    // conflict-free for any stride (consecutive threads, one row); the
    // channel sums read, across a warp, rows (q, which, i) at columns
    // cl2 * SP + ln, and a stride of 128 + min(SP, 8) puts those 32 reads
    // in 32 distinct banks (128 + 1 left them 3-4 ways conflicted at SP =
    // 4; ncu 2026-12-02 had the backward at 76 % of its memory pipes).
    // Must match ScanShape::red_row (scan_shape.rs).
    static constexpr int red_row = kScanThreads + (SP < 8 ? SP : 8);
    int lane;  // this thread's lane within its channel
    int cl;    // this thread's channel within the block
    int n0;    // this thread's first state: lane * kLaneStates
    int fcl;   // the channel this thread finishes outputs for: tid % cpb
    __device__ __forceinline__ Lanes()
        : lane(threadIdx.x % SP),
          cl(threadIdx.x / SP),
          n0(threadIdx.x % SP * kLaneStates),
          fcl(threadIdx.x % cpb) {}
};

// Index of (b, chunk k, c, n) in the [B][nch][D][N] chunk-state array.
__device__ __forceinline__ long long state_index(int b, int k, int nch, int c, int D, int n,
                                                 int N) {
    return (((long long)b * nch + k) * D + c) * N + n;
}

// The chunks k0 .. k1 - 1 of time segment s (segments of `seg` chunks; the
// last may be shorter), and the number of segments.
struct Segment {
    int k0, k1, count;
};

__device__ __forceinline__ Segment segment_at(int s, int seg, int nch) {
    return Segment{s * seg, min(nch, (s + 1) * seg), (nch + seg - 1) / seg};
}

// Index of (b, segment s, c, n) in a [B][nseg][D][N] per-segment array.
__device__ __forceinline__ long long seg_index(int b, int s, int nseg, int c, int D, int n,
                                               int N) {
    return (((long long)b * nseg + s) * D + c) * N + n;
}

// One chunk of one sequence: steps t0 .. t0 + len - 1 (1 <= len <= kChunk),
// rows m0 .. m0 + len - 1.
struct Chunk {
    int len;
    long long m0;
};

__device__ __forceinline__ Chunk chunk_at(int b, int k, int T) {
    const int t0 = k * kChunk;
    return Chunk{min(kChunk, T - t0), (long long)b * T + t0};
}

// One per-channel activation column source, x[m * ld + c]. Its element type
// is the staging's compile-time choice (stage_chunk's HM: in a bf16 run dt
// and u, and the forward's z, are bf16, `p` then pointing at bf16 elements), so
// the walk carries no per-column type (an earlier version with a runtime
// type per column spilled registers in the backward).
struct Col {
    const void* p;
    long long ld;
};

// u, dt or z: the f32 pointer when given, else the bf16 one.
__device__ __forceinline__ Col act_col(const float* p, const unsigned short* h, long long ld) {
    return p ? Col{p, ld} : Col{h, ld};
}

// Which of the kCols columns a kernel stages (bit a: column a); the others
// are never read and not copied.
constexpr int kAllCols = 7;

// Which staged columns are bf16 in a bf16 run (stage_chunk's HM, bit a:
// column a): dt and u in every kernel; the forward's third column, z, too
// (in_proj's output is kept in bf16 with them); the backward's third, dy,
// stays f32 (the gate's backward makes it in f32).
constexpr int kHalfDtU = 3;
constexpr int kHalfDtUZ = 7;

// Start copying chunk `ch`'s B|C rows and the block's channels' columns into
// `buf` (one committed group). Rows past the chunk's end, states past N and
// channels past D are zero-filled by plain stores: zeros are what the walk
// computes with there (dt = 0 gives a = 1 and adds 0; B = C = 0 add 0).
template <int SP, int HM, int kStaged = kAllCols>
__device__ __forceinline__ void stage_chunk(float* buf, const float* __restrict__ bc,
                                            long long ldbc, int N, const Col (&cols)[kCols],
                                            int D, int cbase, Chunk ch) {
    using L = Lanes<SP>;
    for (int e = threadIdx.x; e < kChunk * L::row; e += kScanThreads) {
        const int j = e / L::row, q = e % L::row;
        const int which = q / L::npad, n = q % L::npad;
        if (j < ch.len && n < N) {
            cp_async4(buf + e, bc + (ch.m0 + j) * ldbc + which * N + n);
        } else {
            buf[e] = 0.0f;
        }
    }
#pragma unroll
    for (int a = 0; a < kCols; ++a) {
        float* colbuf = buf + kChunk * L::row + a * kChunk * L::cpb;
        if (!((kStaged >> a) & 1)) continue;
        if ((HM >> a) & 1) {
            // bf16 in the first half of the column's slot, [kChunk][cpb]
            // halves; each 4-byte copy takes channels c, c + 1 (cbase and
            // c even, D even: the launcher checks it, so both are < D or
            // neither is, and every source pair is 4-byte aligned).
            constexpr int pairs = L::cpb / 2;
            for (int e = threadIdx.x; e < kChunk * pairs; e += kScanThreads) {
                const int j = e / pairs, c2 = e % pairs * 2, c = cbase + c2;
                float* dst = reinterpret_cast<float*>(
                    reinterpret_cast<unsigned short*>(colbuf) + j * L::cpb + c2);
                if (j < ch.len && c < D) {
                    const unsigned short* src = static_cast<const unsigned short*>(cols[a].p);
                    cp_async4(dst, reinterpret_cast<const float*>(src + (ch.m0 + j) * cols[a].ld + c));
                } else {
                    *dst = 0.0f;  // two bf16 zeros
                }
            }
        } else {
            const float* src = static_cast<const float*>(cols[a].p);
            for (int e = threadIdx.x; e < kChunk * L::cpb; e += kScanThreads) {
                const int j = e / L::cpb, c = cbase + e % L::cpb;
                if (j < ch.len && c < D) {
                    cp_async4(colbuf + e, src + (ch.m0 + j) * cols[a].ld + c);
                } else {
                    colbuf[e] = 0.0f;
                }
            }
        }
    }
    cp_async_commit();
}

// Column `a` of the staged chunk at step j for block channel cl, staged as
// bf16 when H (stage_chunk's layout for a bf16 column), else as f32.
template <int SP, bool H = false>
__device__ __forceinline__ float staged_col(const float* buf, int a, int j, int cl) {
    using L = Lanes<SP>;
    const float* col = buf + kChunk * L::row + a * kChunk * L::cpb;
    if constexpr (H) {
        return bf16_to_f32(reinterpret_cast<const unsigned short*>(col)[j * L::cpb + cl]);
    } else {
        return col[j * L::cpb + cl];
    }
}

// A[i] = -exp(A_log[c, n0 + i]) for this thread's live states, 0 elsewhere;
// A2[i] = A[i] log2(e) (the decay's exponent in base 2); live[i] says which.
__device__ __forceinline__ void load_a(const float* __restrict__ a_log, bool live_c, int c,
                                       int n0, int N, float (&A)[kLaneStates],
                                       float (&A2)[kLaneStates], bool (&live)[kLaneStates]) {
#pragma unroll
    for (int i = 0; i < kLaneStates; ++i) {
        live[i] = live_c && n0 + i < N;
        A[i] = live[i] ? -expf(a_log[(long long)c * N + n0 + i]) : 0.0f;
        A2[i] = A[i] * 1.4426950408889634f;
    }
}

// The decay a = exp(dt A), as exp2(dt A log2 e): one MUFU.EX2 instead of
// expf's range reduction (a few ulp from expf, inside the scan's
// tolerance), flushing a decay below 2^-126 to zero (`.ftz`: exp2f's
// denormal scaling cost three more instructions per state-step, and a
// factor under 1e-38 on a state is no signal). The forward, the
// backward's recompute and its walk all take `a` from here, so they agree
// bit for bit. The emulator models the flush.
__device__ __forceinline__ float decay(float dtj, float a2) {
#ifdef MAMBA_CUDA_EMU
    const float r = exp2f(dtj * a2);
    return r < 1.17549435e-38f ? 0.0f : r;
#else
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(dtj * a2));
    return r;
#endif
}

// This thread's 4 consecutive staged values at `p` (16-byte aligned: rows
// are whole multiples of 8 floats and n0 is a multiple of 4), one
// shared-memory load.
__device__ __forceinline__ void load4(const float* p, float (&v)[kLaneStates]) {
    static_assert(kLaneStates == 4, "load4 reads a float4");
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
}

// One step of the recurrence: h = a h + (dt B) u with a = exp(dt A), as a
// fused multiply-add (the forward and the backward's recompute share it).
__device__ __forceinline__ float step_state(float h, float a, float dtj, float bn, float uj) {
    return __fmaf_rn(a, h, (dtj * bn) * uj);
}


// The d B / d C stage of steps m0 .. m0 + kStage - 1 (stage slot q holds
// row m0 + q; only the first `valid` are real steps), each (row, B/C, n)
// summed over the block's channels in ascending order into the group's
// partial (round r > 0 adds onto the previous round's partial).
template <int SP>
__device__ __forceinline__ void sum_stage(const float* sRed, float* __restrict__ part, int grp,
                                          long long M, int N, long long m0, int valid, int r) {
    using L = Lanes<SP>;
    for (int o = threadIdx.x; o < kStage * 2 * L::npad; o += kScanThreads) {
        const int q = o / (2 * L::npad), w = o % (2 * L::npad);
        const int which = w / L::npad, n = w % L::npad;
        const int i = n % kLaneStates, ln = n / kLaneStates;
        if (q < valid && n < N) {
            const float* src = sRed + ((q * 2 + which) * kLaneStates + i) * L::red_row;
            float s = src[ln];
#pragma unroll 8
            for (int cl2 = 1; cl2 < L::cpb; ++cl2) s = s + src[cl2 * SP + ln];
            float* dst = part + ((long long)grp * M + m0 + q) * (2 * N) + which * N + n;
            *dst = r == 0 ? s : *dst + s;
        }
    }
}

template <int SP, bool H>
__device__ __forceinline__ void scan_fwd(Col ucol, Col dtcol,
                                         const float* __restrict__ bc, long long ldbc,
                                         const float* __restrict__ a_log,
                                         const float* __restrict__ dpar,
                                         Col zcol,
                                         float* __restrict__ Hin, float* __restrict__ y,
                                         unsigned short* __restrict__ y_h,
                                         float* __restrict__ out,
                                         unsigned short* __restrict__ out_h, int T, int D,
                                         int N, int seg, float* smem) {
    using L = Lanes<SP>;
    const L l;
    const int b = blockIdx.y;
    const int cbase = blockIdx.x * L::cpb;
    const int c = cbase + l.cl;
    const bool live_c = c < D;
    const int nch = (T + kChunk - 1) / kChunk;
    float* sFin = smem + 2 * L::stage;
    const Col cols[kCols] = {dtcol, ucol, zcol};
    float A[kLaneStates], A2[kLaneStates], h[kLaneStates];
    bool live[kLaneStates];
    load_a(a_log, live_c, c, l.n0, N, A, A2, live);
    // Segment blockIdx.z > 0 enters with the state mamba_scan_seg_link left
    // in Hin at its first chunk; segment 0 with h = 0.
    const Segment sg = segment_at(blockIdx.z, seg, nch);
#pragma unroll
    for (int i = 0; i < kLaneStates; ++i) {
        h[i] = live[i] && blockIdx.z > 0 ? Hin[state_index(b, sg.k0, nch, c, D, l.n0 + i, N)]
                                         : 0.0f;
    }
    const int fc = cbase + l.fcl;
    const float dp = dpar[min(fc, D - 1)];

    // Chunk k is staged in buffer (k - k0) & 1.
    stage_chunk<SP, H ? kHalfDtUZ : 0>(smem, bc, ldbc, N, cols, D, cbase, chunk_at(b, sg.k0, T));
    for (int k = sg.k0; k < sg.k1; ++k) {
        const Chunk ch = chunk_at(b, k, T);
        if (k + 1 < sg.k1) {
            stage_chunk<SP, H ? kHalfDtUZ : 0>(smem + ((k + 1 - sg.k0) & 1) * L::stage, bc, ldbc, N, cols, D,
                                              cbase, chunk_at(b, k + 1, T));
        }
        cp_async_wait(k + 1 < sg.k1 ? 1 : 0);
        __syncthreads();
        const float* buf = smem + ((k - sg.k0) & 1) * L::stage;
#pragma unroll
        for (int i = 0; i < kLaneStates; ++i) {
            if (live[i]) Hin[state_index(b, k, nch, c, D, l.n0 + i, N)] = h[i];
        }
        // Steps past the chunk's end (last chunk only) read zeros: h is
        // unchanged and their sums are never written.
        float part[kChunk];
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
            const float dtj = staged_col<SP, H>(buf, 0, j, l.cl);
            const float uj = staged_col<SP, H>(buf, 1, j, l.cl);
            const float* row = buf + j * L::row + l.n0;
            float bv[kLaneStates], cv[kLaneStates];
            load4(row, bv);
            load4(row + L::npad, cv);
            part[j] = 0.0f;
#pragma unroll
            for (int i = 0; i < kLaneStates; ++i) {
                h[i] = step_state(h[i], decay(dtj, A2[i]), dtj, bv[i], uj);
                // No select: a state past N (C = 0, h = 0) or of a channel
                // past D (h = 0) adds an exact +0. __fmul_rn keeps the product
                // its own rounding, as it was behind the select.
                part[j] = part[j] + __fmul_rn(cv[i], h[i]);
            }
        }
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
            part[j] = group_sum(part[j], SP);
            if (l.lane == 0) sFin[j * L::cpb + l.cl] = part[j];
        }
        __syncthreads();
        for (int j = threadIdx.x / L::cpb; j < ch.len; j += kScanThreads / L::cpb) {
            if (fc < D) {
                const long long m = ch.m0 + j;
                const float yv =
                    sFin[j * L::cpb + l.fcl] + dp * staged_col<SP, H>(buf, 1, j, l.fcl);
                // The gate reads y as it is kept (its bf16 rounding when
                // only that is), as the gate's backward recomputes it.
                const float yk = store_kept(y, y_h, m * D + fc, yv);
                store_f32_bf16(out, out_h, m * D + fc,
                               gate_out(yk, staged_col<SP, H>(buf, 2, j, l.fcl)));
            }
        }
        // Every thread is done with this buffer and sFin before the next
        // iteration stages chunk k + 2 into it.
        __syncthreads();
    }
}

template <int SP, bool H>
__device__ __forceinline__ void scan_bwd(Col ucol, Col dtcol,
                                         const float* __restrict__ bc, long long ldbc,
                                         const float* __restrict__ a_log,
                                         const float* __restrict__ dpar,
                                         const float* __restrict__ dy,
                                         const float* __restrict__ Hin,
                                         float* __restrict__ ddtr,
                                         unsigned short* __restrict__ ddtr_h,
                                         float* __restrict__ du, float* __restrict__ part,
                                         float* __restrict__ dA_part,
                                         const float* __restrict__ seg_carry, int T, int D,
                                         int N, int rounds, int seg, float* smem) {
    using L = Lanes<SP>;
    float* sH = smem;
    float* sRed = sH + kChunk * kLaneStates * kScanThreads;
    float* stage = sRed + kStage * 2 * kLaneStates * L::red_row;
    float* sFin = stage + 2 * L::stage;
    const L l;
    const int b = blockIdx.y, grp = blockIdx.x;
    const long long M = (long long)gridDim.y * T;
    const int nch = (T + kChunk - 1) / kChunk;
    const int tid = threadIdx.x;
    const Col cols[kCols] = {dtcol, ucol, {dy, D}};
    const Segment sg = segment_at(blockIdx.z, seg, nch);

    for (int r = 0; r < rounds; ++r) {
        const int cbase = (grp * rounds + r) * L::cpb;
        const int c = cbase + l.cl;
        const bool live_c = c < D;
        const int fc = cbase + l.fcl;
        const float dp = dpar[min(fc, D - 1)];
        float A[kLaneStates], A2[kLaneStates], carry[kLaneStates], dA[kLaneStates],
            h[kLaneStates];
        bool live[kLaneStates];
        load_a(a_log, live_c, c, l.n0, N, A, A2, live);
        // A segment below the last enters with the carry mamba_scan_seg_link
        // left in seg_carry; the last with 0.
#pragma unroll
        for (int i = 0; i < kLaneStates; ++i) {
            dA[i] = 0.0f;
            carry[i] = live[i] && (int)blockIdx.z + 1 < sg.count
                           ? seg_carry[seg_index(b, blockIdx.z, sg.count, c, D, l.n0 + i, N)]
                           : 0.0f;
        }

        // Iteration it walks chunk k = k1 - 1 - it from staging buffer it & 1.
        stage_chunk<SP, H ? kHalfDtU : 0>(stage, bc, ldbc, N, cols, D, cbase, chunk_at(b, sg.k1 - 1, T));
        for (int it = 0; it < sg.k1 - sg.k0; ++it) {
            const int k = sg.k1 - 1 - it;
            const Chunk ch = chunk_at(b, k, T);
#pragma unroll
            for (int i = 0; i < kLaneStates; ++i) {
                h[i] = live[i] ? Hin[state_index(b, k, nch, c, D, l.n0 + i, N)] : 0.0f;
            }
            if (k > sg.k0) {
                stage_chunk<SP, H ? kHalfDtU : 0>(stage + ((it + 1) & 1) * L::stage, bc, ldbc, N, cols, D, cbase,
                                chunk_at(b, k - 1, T));
            }
            cp_async_wait(k > sg.k0 ? 1 : 0);
            __syncthreads();
            const float* buf = stage + (it & 1) * L::stage;
            // Recompute the chunk's states (the forward's step, same bits).
            // Steps past the chunk's end read zeros and are never walked.
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
                const float dtj = staged_col<SP, H>(buf, 0, j, l.cl);
                const float uj = staged_col<SP, H>(buf, 1, j, l.cl);
                float bv[kLaneStates];
                load4(buf + j * L::row + l.n0, bv);
#pragma unroll
                for (int i = 0; i < kLaneStates; ++i) {
                    sH[(j * kLaneStates + i) * kScanThreads + tid] = h[i];
                    h[i] = step_state(h[i], decay(dtj, A2[i]), dtj, bv[i], uj);
                }
            }
            // Walk back: h[i] is the state after step j. This lane's sums
            // over its states of d dt and d u at step j go into its own
            // column of sH, in the slots of step j's states (i = 0, 1) once
            // those are read, and are summed over lanes after the walk.
            // Step j's d B / d C addends go to stage slot j % kStage; the
            // slots of steps j0 .. j0 + kStage - 1 (j0 a multiple of kStage)
            // are summed over channels once step j0 is walked, so every slot
            // index and stage position is a compile-time constant.
#pragma unroll
            for (int j = kChunk - 1; j >= 0; --j) {
                const int slot = j % kStage;
                if (j < ch.len) {  // uniform over the block
                    const float dtj = staged_col<SP, H>(buf, 0, j, l.cl);
                    const float uj = staged_col<SP, H>(buf, 1, j, l.cl);
                    const float dyj = staged_col<SP>(buf, 2, j, l.cl);
                    float bv[kLaneStates], cv[kLaneStates];
                    load4(buf + j * L::row + l.n0, bv);
                    load4(buf + j * L::row + l.n0 + L::npad, cv);
                    float pdt = 0.0f, pdu = 0.0f;
#pragma unroll
                    for (int i = 0; i < kLaneStates; ++i) {
                        const float hprev = sH[(j * kLaneStates + i) * kScanThreads + tid];
                        const float bn = bv[i];
                        const float g = cv[i] * dyj + carry[i];
                        const float a = decay(dtj, A2[i]);  // as in the recompute
                        const float hp = a * hprev;        // a_t h_{t-1}
                        const float gdt = g * dtj;
                        // No selects: a state past N (B = C = A = h = 0) and
                        // a channel past D (dt = u = dy = h = 0) add exact
                        // +0s for finite B, C, dy (a non-finite one makes the
                        // live states' sums non-finite anyway); their stage
                        // slots are never summed (n >= N) or add +0 (c >= D).
                        // __fmul_rn keeps each addend its own rounding, as
                        // it was behind the selects.
                        pdt = pdt + __fmul_rn(g, A[i] * hp + bn * uj);
                        pdu = pdu + __fmul_rn(gdt, bn);
                        dA[i] = dA[i] + (g * hp) * dtj;
                        carry[i] = a * g;
                        sRed[((slot * 2 + 0) * kLaneStates + i) * L::red_row + tid] = gdt * uj;
                        sRed[((slot * 2 + 1) * kLaneStates + i) * L::red_row + tid] = dyj * h[i];
                        h[i] = hprev;
                    }
                    sH[(j * kLaneStates + 0) * kScanThreads + tid] = pdt;
                    sH[(j * kLaneStates + 1) * kScanThreads + tid] = pdu;
                }
                if (slot == 0 && j < ch.len) {  // uniform over the block
                    __syncthreads();
                    sum_stage<SP>(sRed, part, grp, M, N, ch.m0 + j, ch.len - j, r);
                    __syncthreads();
                }
            }
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
                if (j < ch.len) {  // uniform over the block
                    const float pdt = group_sum(sH[(j * kLaneStates + 0) * kScanThreads + tid], SP);
                    const float pdu = group_sum(sH[(j * kLaneStates + 1) * kScanThreads + tid], SP);
                    if (l.lane == 0) {
                        sFin[(j * 2 + 0) * L::cpb + l.cl] = pdt;
                        sFin[(j * 2 + 1) * L::cpb + l.cl] = pdu;
                    }
                }
            }
            __syncthreads();
            for (int j = tid / L::cpb; j < ch.len; j += kScanThreads / L::cpb) {
                if (fc < D) {
                    const long long m = ch.m0 + j;
                    const float dtj = staged_col<SP, H>(buf, 0, j, l.fcl);
                    const float dyj = staged_col<SP>(buf, 2, j, l.fcl);
                    store_f32_bf16(ddtr, ddtr_h, m * D + fc,
                                   sFin[(j * 2 + 0) * L::cpb + l.fcl] * -expm1f(-dtj));
                    du[m * D + fc] = sFin[(j * 2 + 1) * L::cpb + l.fcl] + dp * dyj;
                }
            }
            // Every read of this chunk's staging buffer and of sFin ends
            // before the next iteration stages chunk k - 2 into it.
            __syncthreads();
        }
#pragma unroll
        for (int i = 0; i < kLaneStates; ++i) {
            if (live[i]) {
                dA_part[seg_index(b, blockIdx.z, segment_at(0, seg, nch).count, c, D, l.n0 + i, N)] =
                    dA[i];
            }
        }
    }
}

// Pass 1 of a forward over several time segments, for segment s =
// blockIdx.z < nseg - 1: the state the segment ends with when it enters
// with h = 0 (hloc, the same steps as the forward) and the product of its
// decays (P, ascending), per (b, s, c, n): seg_state[0 .. len) holds hloc,
// seg_state[len .. 2 len) P, len = B * nseg * D * N. The segment's true end
// state is then P h_entry + hloc, which is how scan_fwd finds its entry.
template <int SP, bool H>
__device__ __forceinline__ void scan_fwd_seg(Col ucol, Col dtcol,
                                             const float* __restrict__ bc, long long ldbc,
                                             const float* __restrict__ a_log,
                                             float* __restrict__ seg_state, int T, int D, int N,
                                             int seg, float* smem) {
    using L = Lanes<SP>;
    const L l;
    const int b = blockIdx.y, s = blockIdx.z;
    const int cbase = blockIdx.x * L::cpb;
    const int c = cbase + l.cl;
    const int nch = (T + kChunk - 1) / kChunk;
    const Segment sg = segment_at(s, seg, nch);
    // Only dt, u and B are read: the third column is not staged.
    const Col cols[kCols] = {dtcol, ucol, {nullptr, 0}};
    constexpr int staged = 3;
    float A[kLaneStates], A2[kLaneStates], h[kLaneStates], p[kLaneStates];
    bool live[kLaneStates];
    load_a(a_log, c < D, c, l.n0, N, A, A2, live);
#pragma unroll
    for (int i = 0; i < kLaneStates; ++i) {
        h[i] = 0.0f;
        p[i] = 1.0f;
    }
    stage_chunk<SP, H ? kHalfDtU : 0, staged>(smem, bc, ldbc, N, cols, D, cbase, chunk_at(b, sg.k0, T));
    for (int k = sg.k0; k < sg.k1; ++k) {
        if (k + 1 < sg.k1) {
            stage_chunk<SP, H ? kHalfDtU : 0, staged>(smem + ((k + 1 - sg.k0) & 1) * L::stage, bc, ldbc, N, cols, D, cbase,
                            chunk_at(b, k + 1, T));
        }
        cp_async_wait(k + 1 < sg.k1 ? 1 : 0);
        __syncthreads();
        const float* buf = smem + ((k - sg.k0) & 1) * L::stage;
        // Steps past the sequence's end read zeros (a = 1, nothing added).
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
            const float dtj = staged_col<SP, H>(buf, 0, j, l.cl);
            const float uj = staged_col<SP, H>(buf, 1, j, l.cl);
            float bv[kLaneStates];
            load4(buf + j * L::row + l.n0, bv);
#pragma unroll
            for (int i = 0; i < kLaneStates; ++i) {
                const float a = decay(dtj, A2[i]);
                h[i] = step_state(h[i], a, dtj, bv[i], uj);
                p[i] = p[i] * a;
            }
        }
        // Every thread is done with this buffer before chunk k + 2 lands in it.
        __syncthreads();
    }
    const long long len = (long long)gridDim.y * sg.count * D * N;
#pragma unroll
    for (int i = 0; i < kLaneStates; ++i) {
        if (live[i]) {
            const long long at = seg_index(b, s, sg.count, c, D, l.n0 + i, N);
            seg_state[at] = h[i];
            seg_state[len + at] = p[i];
        }
    }
}

// Pass 1 of a backward over several time segments, for segment s =
// blockIdx.z + 1 (1 .. nseg - 1): the carry the segment passes down when
// nothing comes in from above (cloc: g_t = C_t dy_t + carry, carry = a_t
// g_t, walking down as scan_bwd does) and the product of its decays (P,
// descending), per (b, s, c, n), laid out as scan_fwd_seg's. The carry
// into segment s is then P_{s+1} carry_{s+1} + cloc_{s+1}, folded from the
// last segment down.
template <int SP, bool H>
__device__ __forceinline__ void scan_bwd_seg(Col dtcol,
                                             const float* __restrict__ bc, long long ldbc,
                                             const float* __restrict__ a_log,
                                             const float* __restrict__ dy,
                                             float* __restrict__ seg_carry, int T, int D, int N,
                                             int seg, float* smem) {
    using L = Lanes<SP>;
    const L l;
    const int b = blockIdx.y, s = blockIdx.z + 1;
    const int cbase = blockIdx.x * L::cpb;
    const int c = cbase + l.cl;
    const int nch = (T + kChunk - 1) / kChunk;
    const Segment sg = segment_at(s, seg, nch);
    // Only dt, C and dy are read: the second column is not staged.
    const Col cols[kCols] = {dtcol, {nullptr, 0}, {dy, D}};
    constexpr int staged = 5;
    float A[kLaneStates], A2[kLaneStates], carry[kLaneStates], p[kLaneStates];
    bool live[kLaneStates];
    load_a(a_log, c < D, c, l.n0, N, A, A2, live);
#pragma unroll
    for (int i = 0; i < kLaneStates; ++i) {
        carry[i] = 0.0f;
        p[i] = 1.0f;
    }
    stage_chunk<SP, H ? kHalfDtU : 0, staged>(smem, bc, ldbc, N, cols, D, cbase, chunk_at(b, sg.k1 - 1, T));
    for (int it = 0; it < sg.k1 - sg.k0; ++it) {
        const int k = sg.k1 - 1 - it;
        const Chunk ch = chunk_at(b, k, T);
        if (k > sg.k0) {
            stage_chunk<SP, H ? kHalfDtU : 0, staged>(smem + ((it + 1) & 1) * L::stage, bc, ldbc, N, cols, D, cbase,
                            chunk_at(b, k - 1, T));
        }
        cp_async_wait(k > sg.k0 ? 1 : 0);
        __syncthreads();
        const float* buf = smem + (it & 1) * L::stage;
#pragma unroll
        for (int j = kChunk - 1; j >= 0; --j) {
            if (j < ch.len) {  // uniform over the block
                const float dtj = staged_col<SP, H>(buf, 0, j, l.cl);
                const float dyj = staged_col<SP>(buf, 2, j, l.cl);
                float cv[kLaneStates];
                load4(buf + j * L::row + l.n0 + L::npad, cv);
#pragma unroll
                for (int i = 0; i < kLaneStates; ++i) {
                    const float g = cv[i] * dyj + carry[i];
                    const float a = decay(dtj, A2[i]);
                    carry[i] = a * g;
                    p[i] = p[i] * a;
                }
            }
        }
        __syncthreads();
    }
    const long long len = (long long)gridDim.y * sg.count * D * N;
#pragma unroll
    for (int i = 0; i < kLaneStates; ++i) {
        if (live[i]) {
            const long long at = seg_index(b, s, sg.count, c, D, l.n0 + i, N);
            seg_carry[at] = carry[i];
            seg_carry[len + at] = p[i];
        }
    }
}

}  // namespace

// The kernels' entry points: `sp` (ScanShape::lanes, a power of two 1..32)
// and whether u and dt are bf16 (`half`: their f32 pointers null) pick the
// instantiation; any other sp does nothing (the host launcher only passes
// valid ones). u and dt are both f32 or both bf16 (the launcher checks it).
#define MAMBA_SCAN_DISPATCH_SP(SP_VAR, H, CALL) \
    switch (SP_VAR) {                           \
        case 1: CALL(1, H); break;              \
        case 2: CALL(2, H); break;              \
        case 4: CALL(4, H); break;              \
        case 8: CALL(8, H); break;              \
        case 16: CALL(16, H); break;            \
        case 32: CALL(32, H); break;            \
        default: break;                         \
    }
#define MAMBA_SCAN_DISPATCH(SP_VAR, HALF, CALL)         \
    if (HALF) {                                         \
        MAMBA_SCAN_DISPATCH_SP(SP_VAR, true, CALL)      \
    } else {                                            \
        MAMBA_SCAN_DISPATCH_SP(SP_VAR, false, CALL)     \
    }

// u, dt and z: f32 (`u`, `dt`, `z`) or, when those are null, bf16 (`u_h`,
// `dt_h`, `z_h`; all three in the same type). The gated output is
// gate_out(y as kept, z).
// `y` / `y_h` and `out` / `out_h`: f32 and bf16 outputs, either may be null
// (a bf16 run keeps y and the gated output in bf16 alone).
// grid (ceil(D / cpb), B, nseg), block kScanThreads, dynamic shared memory
// 2 * Lanes::stage + Lanes::fin(1) floats. Block z walks time segment z
// (`seg` chunks), entering with the state mamba_scan_seg_link left in Hin
// at the segment's first chunk (z > 0).
extern "C" __global__ void __launch_bounds__(kScanThreads)
    mamba_scan_fwd(const float* __restrict__ u, const unsigned short* __restrict__ u_h,
                   const float* __restrict__ dt, const unsigned short* __restrict__ dt_h,
                   const float* __restrict__ bc, long long ldbc,
                   const float* __restrict__ a_log, const float* __restrict__ dpar,
                   const float* __restrict__ z, const unsigned short* __restrict__ z_h,
                   long long ldz, float* __restrict__ Hin,
                   float* __restrict__ y, unsigned short* __restrict__ y_h,
                   float* __restrict__ out, unsigned short* __restrict__ out_h, int T, int D,
                   int N, int sp, int seg) {
#ifdef MAMBA_CUDA_EMU
    float* smem = EMU_SMEM;
#else
    extern __shared__ float smem[];
#endif
#define MAMBA_SCAN_FWD(SP, H)                                                                  \
    scan_fwd<SP, H>(act_col(u, u_h, D), act_col(dt, dt_h, D), bc, ldbc, a_log, dpar,          \
                    act_col(z, z_h, ldz), Hin,                                               \
                    y, y_h, out, out_h, T, D, N, seg, smem)
    MAMBA_SCAN_DISPATCH(sp, !u, MAMBA_SCAN_FWD)
#undef MAMBA_SCAN_FWD
}

// Outputs: ddtr[m, c] = (dL/d dt) * sigmoid(pre) (softplus' from dt itself:
// sigmoid(pre) = 1 - exp(-softplus(pre)) = -expm1(-dt)), and its bf16 copy
// into ddtr_h when that is not null; du[m, c] = scan
// part + Dp dy (x_proj's backward GEMM adds its share later);
// dA_part[b][s][c][n] = sum over segment s's t (descending) of g a h_{t-1} dt;
// part[grp][m][0..N) = d B, part[grp][m][N..2N) = d C summed over the
// group's channels: `rounds` consecutive sets of cpb channels, walked one
// after the other (set r adds onto set r-1's partial in place).
// grid (groups, B, nseg), block kScanThreads: block z walks time segment z
// down, entering with the carry mamba_scan_seg_link left in seg_carry (z <
// nseg - 1), and writes its own d A partials, dA_part[b][z][c][n]. Dynamic shared
// memory, in floats:
// sH [kChunk][kLaneStates][kScanThreads] (the chunk's recomputed states,
// each thread's own column), sRed [kStage][2][kLaneStates][Lanes::red_row]
// (the d B / d C stage, rows padded against bank conflicts), two staging
// buffers of Lanes::stage, then Lanes::fin(2) (d dt and d u per step and
// channel).
// At most three blocks per SM, what the shared memory fits at N = 16 (and
// what the 130m grid, 384 blocks on 132 SMs, needs): the bound lets ptxas
// use up to 168 registers. Under the earlier bound of four (128 registers)
// the bf16-input instantiations spilled 24-56 bytes a thread.
extern "C" __global__ void __launch_bounds__(kScanThreads, 3)
    mamba_scan_bwd(const float* __restrict__ u, const unsigned short* __restrict__ u_h,
                   const float* __restrict__ dt, const unsigned short* __restrict__ dt_h,
                   const float* __restrict__ bc, long long ldbc,
                   const float* __restrict__ a_log, const float* __restrict__ dpar,
                   const float* __restrict__ dy, const float* __restrict__ Hin,
                   float* __restrict__ ddtr, unsigned short* __restrict__ ddtr_h,
                   float* __restrict__ du, float* __restrict__ part,
                   float* __restrict__ dA_part, const float* __restrict__ seg_carry, int T,
                   int D, int N, int sp, int rounds, int seg) {
#ifdef MAMBA_CUDA_EMU
    float* smem = EMU_SMEM;
#else
    extern __shared__ float smem[];
#endif
#define MAMBA_SCAN_BWD(SP, H)                                                                  \
    scan_bwd<SP, H>(act_col(u, u_h, D), act_col(dt, dt_h, D), bc, ldbc, a_log, dpar, dy, Hin, \
                    ddtr, ddtr_h, du, part, dA_part, seg_carry, T, D, N, rounds, seg, smem)
    MAMBA_SCAN_DISPATCH(sp, !u, MAMBA_SCAN_BWD)
#undef MAMBA_SCAN_BWD
}

// Pass 1 of a segmented forward (see scan_fwd_seg): grid (ceil(D / cpb), B,
// nseg - 1), block kScanThreads, the forward's dynamic shared memory (it
// uses the two staging buffers). Launched only when nseg > 1, before
// mamba_scan_fwd.
extern "C" __global__ void __launch_bounds__(kScanThreads)
    mamba_scan_fwd_seg(const float* __restrict__ u, const unsigned short* __restrict__ u_h,
                       const float* __restrict__ dt, const unsigned short* __restrict__ dt_h,
                       const float* __restrict__ bc, long long ldbc,
                       const float* __restrict__ a_log, float* __restrict__ seg_state, int T,
                       int D, int N, int sp, int seg) {
#ifdef MAMBA_CUDA_EMU
    float* smem = EMU_SMEM;
#else
    extern __shared__ float smem[];
#endif
#define MAMBA_SCAN_FWD_SEG(SP, H)                                                          \
    scan_fwd_seg<SP, H>(act_col(u, u_h, D), act_col(dt, dt_h, D), bc, ldbc, a_log, seg_state, \
                        T, D, N, seg, smem)
    MAMBA_SCAN_DISPATCH(sp, !u, MAMBA_SCAN_FWD_SEG)
#undef MAMBA_SCAN_FWD_SEG
}

// Pass 1 of a segmented backward (see scan_bwd_seg): grid (ceil(D / cpb),
// B, nseg - 1), block kScanThreads, the forward's dynamic shared memory.
// Launched only when nseg > 1, before mamba_scan_bwd.
extern "C" __global__ void __launch_bounds__(kScanThreads)
    mamba_scan_bwd_seg(const float* __restrict__ dt, const unsigned short* __restrict__ dt_h,
                       const float* __restrict__ bc, long long ldbc,
                       const float* __restrict__ a_log,
                       const float* __restrict__ dy, float* __restrict__ seg_carry, int T, int D,
                       int N, int sp, int seg) {
#ifdef MAMBA_CUDA_EMU
    float* smem = EMU_SMEM;
#else
    extern __shared__ float smem[];
#endif
#define MAMBA_SCAN_BWD_SEG(SP, H) \
    scan_bwd_seg<SP, H>(act_col(dt, dt_h, D), bc, ldbc, a_log, dy, seg_carry, T, D, N, seg, smem)
    MAMBA_SCAN_DISPATCH(sp, !dt, MAMBA_SCAN_BWD_SEG)
#undef MAMBA_SCAN_BWD_SEG
}

// Link the time segments after a first pass, one thread per (b, c, n),
// serially over the segments. Forward (backward = 0): segment s > 0
// enters with h_s = P_{s-1} h_{s-1} + hloc_{s-1} (h_0 = 0), one FMA a
// segment in ascending order, written to Hin at its first chunk (where
// mamba_scan_fwd reads it, and rewrites the same value). Backward: segment
// s < nseg - 1 enters with c_s = P_{s+1} c_{s+1} + cloc_{s+1} (c_{nseg-1} =
// 0), in descending order, written over cloc_s in `seg` (each slot is read
// before it is overwritten). grid ceil(B * D * N / 256), block 256.
extern "C" __global__ void mamba_scan_seg_link(float* __restrict__ seg_buf,
                                               float* __restrict__ Hin, int B, int T, int D,
                                               int N, int seg, int backward) {
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long per_b = (long long)D * N;
    if (e >= B * per_b) return;
    const int b = (int)(e / per_b), c = (int)(e % per_b / N), n = (int)(e % N);
    const int nch = (T + kChunk - 1) / kChunk;
    const int nseg = segment_at(0, seg, nch).count;
    const long long len = (long long)B * nseg * D * N;
    if (!backward) {
        float h = 0.0f;
        for (int s = 1; s < nseg; ++s) {
            const long long at = seg_index(b, s - 1, nseg, c, D, n, N);
            h = __fmaf_rn(seg_buf[len + at], h, seg_buf[at]);
            Hin[state_index(b, s * seg, nch, c, D, n, N)] = h;
        }
    } else {
        float carry = 0.0f;
        for (int s = nseg - 1; s >= 0; --s) {
            const long long at = seg_index(b, s, nseg, c, D, n, N);
            const float cloc = s > 0 ? seg_buf[at] : 0.0f, p = s > 0 ? seg_buf[len + at] : 0.0f;
            seg_buf[at] = carry;
            carry = __fmaf_rn(p, carry, cloc);
        }
    }
}

#undef MAMBA_SCAN_DISPATCH
#undef MAMBA_SCAN_DISPATCH_SP

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

// Recurrent decoding of Mamba-1: one token of one sequence per launch.
// Everything else of a decode step (embedding, RMSNorm, the GEMMs with one
// row, softplus of dt) reuses the training kernels and cuBLAS; only the two
// places where the full forward pass reads earlier rows need a kernel that
// reads a carried state instead:
//
//   mamba_decode_conv_step   the causal depthwise conv + SiLU for the new
//                            token over the kept inputs, then the new input
//                            shifted into the kept ones;
//   mamba_decode_scan_step   h <- exp(dt A) h + (dt B) u for the new token,
//                            y = C.h + Dp u, out = y SiLU(z).
//
// One thread per channel c < D; each thread owns its channel's state, so
// there is no cross-thread work, no atomics, and the arithmetic of a
// channel is one serial chain in the order written below (the same order as
// mamba_ops.cu's conv_pre and mamba_scan.cu's per-lane recurrence; the
// scan's sum over n is serial ascending here, where the chunked scan uses a
// butterfly, so the two agree within f32 rounding, not bit for bit).
// grid ceil(D / 128), block 128.

#include "mamba_common.cuh"

using namespace mamba;

// x: the new conv input (xz[0, :D]); w: [D, K]; bias: [D];
// state: [K-1, D], oldest first, of which only the newest `filled` rows hold
// inputs of this sequence (filled <= K-1; the others are never read);
// u: [D] out. acc = bias, + w[c, k] * input_k for ascending taps k inside the
// sequence (the kept inputs for k < K-1, x for k = K-1), u = SiLU(acc).
extern "C" __global__ void mamba_decode_conv_step(const float* __restrict__ x,
                                                  const float* __restrict__ w,
                                                  const float* __restrict__ bias,
                                                  float* __restrict__ state,
                                                  float* __restrict__ u, int D, int K,
                                                  int filled) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= D) return;
    const int kept = K - 1;
    float acc = bias[c];
    for (int k = kept - filled; k < kept; ++k) {
        acc = acc + w[c * K + k] * state[(long long)k * D + c];
    }
    const float xc = x[c];
    acc = acc + w[c * K + kept] * xc;
    u[c] = siluf_(acc);
    // The oldest input drops out; the new one becomes the newest.
    for (int k = 0; k + 1 < kept; ++k) {
        state[(long long)k * D + c] = state[(long long)(k + 1) * D + c];
    }
    if (kept > 0) state[(long long)(kept - 1) * D + c] = xc;
}

// u, dt, z: [D] (z with the row's z half: xz[0, D:2D]); bc: B at bc[n], C
// at bc[N + n]; a_log: [D, N]; dpar: [D]; h: [D, N] in/out; y, out: [D] out.
// For ascending n: A = -exp(a_log), a = exp(dt A), h = a h + (dt B) u,
// s = s + C h; y = s + Dp u; out = y SiLU(z).
extern "C" __global__ void mamba_decode_scan_step(const float* __restrict__ u,
                                                  const float* __restrict__ dt,
                                                  const float* __restrict__ bc,
                                                  const float* __restrict__ a_log,
                                                  const float* __restrict__ dpar,
                                                  const float* __restrict__ z,
                                                  float* __restrict__ h, float* __restrict__ y,
                                                  float* __restrict__ out, int D, int N) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= D) return;
    const float uc = u[c], dtc = dt[c];
    float* hc = h + (long long)c * N;
    float s = 0.0f;
    for (int n = 0; n < N; ++n) {
        const float A = -expf(a_log[(long long)c * N + n]);
        const float a = expf(dtc * A);
        const float hv = a * hc[n] + (dtc * bc[n]) * uc;
        hc[n] = hv;
        s = s + bc[N + n] * hv;
    }
    const float yv = s + dpar[c] * uc;
    y[c] = yv;
    out[c] = yv * siluf_(z[c]);
}

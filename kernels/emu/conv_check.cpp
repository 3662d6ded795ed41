// The conv's fused backward (mamba_conv_bwd in kernels/cuda/mamba_ops.cu,
// compiled as C++ under cuda_emu.h) and its forward, over shapes that cover
// every width, sequences shorter than the taps, slabs that end inside a tile
// and inside a sequence, a partial channel block, a column block of a wider
// matrix (ld > D), x kept in bf16 and dx written as f32, bf16 or both.
// Checked two ways:
//   - bit for bit against a host twin that makes each value by the kernel's
//     expression in its association (dpre per row, dx per row, the slab
//     sums lane by lane and the fixed tree over the 8 lanes): so the
//     association is the one the file promises, a function of the shape
//     alone, whatever the tiles and halos;
//   - dx, dw and db (after stage 2, mamba_reduce_partials) against the
//     backward in f64 written from the equations, within 1e-5.
// Built and run by kernels/src/mamba/conv_emu_tests.rs, which passes the
// host launcher's block (EMU_BLOCK) and slab (EMU_COL_SLAB). EMU_NEGATIVE=1 feeds
// the kernel one wrong du element (the twin and the oracle keep the right
// one): the check must then fail. Exit status 0 only when every shape
// passes.
#include <cstdio>
#include <random>
#include "check_report.h"
#include "mamba_ops.cu"

#ifndef EMU_NEGATIVE
#define EMU_NEGATIVE 0
#endif
#if !defined(EMU_BLOCK) || !defined(EMU_COL_SLAB)
#error "EMU_BLOCK and EMU_COL_SLAB (the host launcher's block and slab) must be defined"
#endif
// The host launcher (conv.rs) and the kernel agree on the slab and on the
// block of 32 channels x 8 row lanes.
static_assert(EMU_COL_SLAB == mamba::kColSlab, "conv.rs's COL_SLAB is not the kernel's kColSlab");
static_assert(EMU_BLOCK == 256, "mamba_conv_bwd's lanes assume a block of 256 threads");

// {batch, T, channels D, extra columns past D in x's rows, width K, x in
// bf16, dx outputs: 1 f32, 2 bf16, 3 both}
struct Case { int b, t, d, pad, k, xh, out; };

static unsigned short to_bf16(double v) { return (unsigned short)mamba::bf16_rne((float)v); }

int main() {
    const Case cases[] = {{2, 37, 5, 0, 4, 0, 1},   {1, 300, 33, 7, 4, 1, 3}, {3, 2, 40, 0, 4, 0, 2},
                          {1, 513, 9, 3, 1, 0, 1},  {2, 100, 70, 0, 8, 1, 2}, {4, 64, 32, 32, 3, 0, 3},
                          {1, 1, 3, 0, 2, 1, 1},    {2, 260, 64, 0, 5, 0, 1}};
    int fails = 0;
    unsigned seed = 11;
    for (const Case& cs : cases) {
        const int B = cs.b, T = cs.t, D = cs.d, K = cs.k, M = B * T, ldx = D + cs.pad, ldo = D + 2;
        std::mt19937_64 rng(seed++);
        auto x64 = uniform_floats(rng, -2, 2, (size_t)M * ldx), du64 = uniform_floats(rng, -1, 1, (size_t)M * D),
             w64 = uniform_floats(rng, -0.7, 0.7, (size_t)D * K), b64 = uniform_floats(rng, -0.5, 0.5, D);
        // The kernel's inputs, as floats (x as kept: its bf16 rounding when
        // it is kept in bf16, which the oracle then reads too).
        std::vector<float> xf(x64.size()), du(du64.begin(), du64.end()), w(w64.begin(), w64.end()),
            bias(b64.begin(), b64.end());
        std::vector<unsigned short> xh(x64.size());
        for (size_t i = 0; i < x64.size(); ++i) {
            xh[i] = to_bf16(x64[i]);
            xf[i] = cs.xh ? mamba::bf16_to_f32(xh[i]) : (float)x64[i];
            x64[i] = xf[i];
        }
        auto xat = [&](long long m, int c) { return xf[(size_t)m * ldx + c]; };

        // Host twin: the kernel's expressions, in its association.
        std::vector<float> dpre((size_t)M * D), tdx((size_t)M * D);
        const int slabs = (M + mamba::kColSlab - 1) / mamba::kColSlab, stride = D * K + D;
        std::vector<float> tpart((size_t)slabs * stride);
        for (int c = 0; c < D; ++c) {
            float wk[8] = {};
            for (int k = 0; k < K; ++k) wk[k] = w[c * K + k];
            for (int m = 0; m < M; ++m) {
                const int t = m % T;
                float acc = bias[c];
                for (int k = 0; k < K; ++k)
                    if (t - (K - 1 - k) >= 0) acc = acc + wk[k] * xat(m - (K - 1 - k), c);
                dpre[(size_t)m * D + c] = du[(size_t)m * D + c] * mamba::dsiluf_(acc);
            }
            for (int m = 0; m < M; ++m) {
                const int t = m % T;
                float a = 0.0f;
                for (int k = 0; k < K; ++k)
                    if (t + (K - 1 - k) < T) a = a + wk[k] * dpre[(size_t)(m + K - 1 - k) * D + c];
                tdx[(size_t)m * D + c] = a;
            }
            for (int s = 0; s < slabs; ++s) {
                const int r0 = s * mamba::kColSlab, r1 = std::min(M, r0 + mamba::kColSlab);
                float lane[9][8] = {};
                for (int ty = 0; ty < 8; ++ty)
                    for (int m = r0 + ty; m < r1; m += 8) {
                        const int t = m % T;
                        const float g = dpre[(size_t)m * D + c];
                        for (int k = 0; k < K; ++k)
                            if (t - (K - 1 - k) >= 0) lane[k][ty] = lane[k][ty] + g * xat(m - (K - 1 - k), c);
                        lane[K][ty] = lane[K][ty] + g;
                    }
                for (int k = 0; k <= K; ++k) {
                    const float* l = lane[k];
                    const float v = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
                    tpart[(size_t)s * stride + (k < K ? c * K + k : D * K + c)] = v;
                }
            }
        }

        // Oracle in f64: dpre, dx, dw, db from the equations.
        std::vector<double> edx((size_t)M * D), edw((size_t)D * K), edb(D), edp((size_t)M * D);
        for (int c = 0; c < D; ++c)
            for (int m = 0; m < M; ++m) {
                const int t = m % T;
                double pre = b64[c];
                for (int k = 0; k < K; ++k)
                    if (t - (K - 1 - k) >= 0) pre += w64[c * K + k] * x64[(size_t)(m - (K - 1 - k)) * ldx + c];
                const double sg = 1 / (1 + std::exp(-pre));
                edp[(size_t)m * D + c] = du64[(size_t)m * D + c] * sg * (1 + pre * (1 - sg));
            }
        for (int c = 0; c < D; ++c)
            for (int m = 0; m < M; ++m) {
                const int t = m % T;
                const double g = edp[(size_t)m * D + c];
                for (int k = 0; k < K; ++k) {
                    const int back = K - 1 - k;
                    if (t - back >= 0) edw[c * K + k] += g * x64[(size_t)(m - back) * ldx + c];
                    if (t + back < T) edx[(size_t)m * D + c] += w64[c * K + k] * edp[(size_t)(m + back) * D + c];
                }
                edb[c] += g;
            }

        // The kernel, then stage 2 as the host launcher runs it.
        if (EMU_NEGATIVE) du[(size_t)(M / 2) * D + D / 2] += 0.25f;
        std::vector<float> dx32((size_t)M * ldo, NAN), part((size_t)slabs * stride, NAN), dwdb(stride, NAN);
        std::vector<unsigned short> dx16((size_t)M * ldo, 0xffff);
        float* dxf = cs.out & 1 ? dx32.data() : nullptr;
        unsigned short* dxh = cs.out & 2 ? dx16.data() : nullptr;
        emu_launch({(unsigned)slabs, (unsigned)((D + 31) / 32), 1}, EMU_BLOCK, 0, [&] {
            mamba_conv_bwd(cs.xh ? nullptr : xf.data(), cs.xh ? xh.data() : nullptr, ldx, w.data(),
                           bias.data(), du.data(), dxf, dxh, ldo, part.data(), M, T, D, K);
        });
        emu_launch({(unsigned)((stride + 63) / 64), 1, 1}, 64, 0, [&] {
            mamba_reduce_partials(part.data(), slabs, stride, 0, stride, nullptr, 0, dwdb.data());
        });

        // dx as the kernel kept it (f32, else its bf16 read back), and
        // whether every kept copy is the twin's value (the bf16 one its
        // rounding).
        std::vector<float> gdx((size_t)M * D);
        bool dx_bits = true, part_bits = true;
        for (int m = 0; m < M; ++m)
            for (int c = 0; c < D; ++c) {
                const size_t i = (size_t)m * ldo + c;
                const float want = tdx[(size_t)m * D + c];
                gdx[(size_t)m * D + c] = dxf ? dx32[i] : mamba::bf16_to_f32(dx16[i]);
                if (dxf && std::memcmp(&dx32[i], &want, 4) != 0) dx_bits = false;
                if (dxh && dx16[i] != (unsigned short)mamba::bf16_rne(want)) dx_bits = false;
            }
        for (size_t i = 0; i < part.size(); ++i)
            if (std::memcmp(&part[i], &tpart[i], 4) != 0) part_bits = false;
        std::vector<float> gdw(dwdb.begin(), dwdb.begin() + D * K), gdb(dwdb.begin() + D * K, dwdb.end());
        // bf16 dx carries its rounding (2^-8 relative): its tolerance.
        const double dx_tol = cs.out == 2 ? 4e-3 : 1e-5;
        printf("B%d T%d D%d ld%d K%d x%s dx%s:", B, T, D, ldx, K, cs.xh ? "bf16" : "f32",
               cs.out == 1 ? "f32" : cs.out == 2 ? "bf16" : "both");
        printf(" twin-bits %s%s", dx_bits && part_bits ? "ok" : "DIFFER", dx_bits && part_bits ? "" : " FAIL");
        fails += !(dx_bits && part_bits);
        fails += report({{"dx", rel_l2(gdx, edx), dx_tol}, {"dw", rel_l2(gdw, edw), 1e-5}, {"db", rel_l2(gdb, edb), 1e-5}},
                        {&gdx, &part});
    }
    printf(fails ? "%d FAIL\n" : "all within tolerance\n", fails);
    return fails ? 1 : 0;
}

// Mamba-2's fused gated-norm backward (mamba_gated_norm_bwd in
// kernels/cuda/mamba_ops.cu, compiled as C++ under cuda_emu.h) against the
// two kernels it replaces in the model, mamba_rmsnorm_bwd into an f32 dg and
// then mamba_gate_bwd: dy and dz bit for bit, over shapes with widths below,
// at and past a warp, a row count that leaves a block part-empty, g / y / z
// in f32 or kept in bf16, z and dz in a wider matrix (ld > D), and dz
// written as f32, bf16 or both (dy with its bf16 rounding too when the
// inputs are bf16); and both against the backward in f64
// written from the equations. Built and run by
// kernels/src/mamba/gated_norm_emu_tests.rs. EMU_NEGATIVE=1 feeds the fused
// kernel one wrong dgn element (the two kernels and the oracle keep the
// right one): the check must then fail.
#include <cstdio>
#include <random>
#include "check_report.h"
#include "mamba_ops.cu"

#ifndef EMU_NEGATIVE
#define EMU_NEGATIVE 0
#endif
#if !defined(EMU_BLOCK) || !defined(EMU_ROWS_PER_BLOCK)
#error "EMU_BLOCK and EMU_ROWS_PER_BLOCK (the host launcher's geometry) must be defined"
#endif
static_assert(EMU_BLOCK == 32 * EMU_ROWS_PER_BLOCK, "one warp per row");

// (D 1 is left out: the norm's input gradient is then 0 up to rounding, so
// no relative error means anything.)
// {rows M, width D, extra columns past D in z's rows, kept in bf16 (1) or
// f32 (0), dz outputs: 1 f32, 2 bf16, 3 both}
struct Case { int m, d, pad, half, out; };

int main() {
    const Case cases[] = {{1, 3, 0, 0, 1},  {9, 31, 3, 1, 3},   {16, 32, 0, 0, 2},
                          {13, 100, 50, 1, 2}, {8, 257, 0, 0, 3}, {3, 1536, 1816, 1, 2}};
    int fails = 0;
    unsigned seed = 21;
    for (const Case& cs : cases) {
        const int M = cs.m, D = cs.d, ldz = D + cs.pad;
        std::mt19937_64 rng(seed++);
        auto dgn = uniform_floats(rng, -1, 1, (size_t)M * D), g64 = uniform_floats(rng, -2, 2, (size_t)M * D),
             w64 = uniform_floats(rng, 0.5, 1.5, D), y64 = uniform_floats(rng, -2, 2, (size_t)M * D),
             z64 = uniform_floats(rng, -3, 3, (size_t)M * ldz);
        // Inputs as kept: f32, or the bf16 rounding (which the oracle then
        // reads too).
        auto kept = [&](std::vector<double>& v, std::vector<float>& f, std::vector<unsigned short>& h) {
            f.resize(v.size());
            h.resize(v.size());
            for (size_t i = 0; i < v.size(); ++i) {
                h[i] = (unsigned short)mamba::bf16_rne((float)v[i]);
                f[i] = cs.half ? mamba::bf16_to_f32(h[i]) : (float)v[i];
                v[i] = f[i];
            }
        };
        std::vector<float> gf, yf, zf, dgnf(dgn.begin(), dgn.end()), w(w64.begin(), w64.end());
        std::vector<unsigned short> gh, yh, zh;
        kept(g64, gf, gh);
        kept(y64, yf, yh);
        kept(z64, zf, zh);
        // rstd as the forward makes it, in f32.
        std::vector<float> rstd(M);
        for (int m = 0; m < M; ++m) {
            double ss = 0;
            for (int j = 0; j < D; ++j) ss += g64[(size_t)m * D + j] * g64[(size_t)m * D + j];
            rstd[m] = (float)(1 / std::sqrt(ss / D + 1e-5));
        }
        auto pick = [&](std::vector<float>& f, std::vector<unsigned short>& h) {
            return std::make_pair(cs.half ? nullptr : f.data(), cs.half ? h.data() : nullptr);
        };
        auto [g, g_h] = pick(gf, gh);
        auto [y, y_h] = pick(yf, yh);
        auto [z, z_h] = pick(zf, zh);
        const unsigned blocks = (unsigned)((M + EMU_ROWS_PER_BLOCK - 1) / EMU_ROWS_PER_BLOCK);
        // The two kernels, as the model ran them before: dg in f32, then the
        // gate (whose recomputed gate output goes to a scratch buffer).
        std::vector<float> dg((size_t)M * D), dy2((size_t)M * D), dz2((size_t)M * ldz, NAN), gout((size_t)M * D);
        std::vector<unsigned short> dz2h((size_t)M * ldz, 0xffff);
        float* dzf2 = cs.out & 1 ? dz2.data() : nullptr;
        unsigned short* dzh2 = cs.out & 2 ? dz2h.data() : nullptr;
        emu_launch({blocks, 1, 1}, EMU_BLOCK, 0, [&] {
            mamba_rmsnorm_bwd(dgnf.data(), g, g_h, w.data(), rstd.data(), dg.data(), nullptr, M, D, 0);
        });
        emu_launch({(unsigned)M, (unsigned)((D + 127) / 128), 1}, 128, 0, [&] {
            mamba_gate_bwd(dg.data(), y, y_h, z, z_h, ldz, dy2.data(), dzf2, dzh2, gout.data(), nullptr, D);
        });
        // The fused kernel.
        if (EMU_NEGATIVE) dgnf[(size_t)(M / 2) * D + D / 2] += 0.25f;
        std::vector<float> dy((size_t)M * D, NAN), dz((size_t)M * ldz, NAN);
        std::vector<unsigned short> dzh((size_t)M * ldz, 0xffff), dyh((size_t)M * D, 0xffff);
        float* dzf = cs.out & 1 ? dz.data() : nullptr;
        unsigned short* dzhp = cs.out & 2 ? dzh.data() : nullptr;
        // bf16 inputs: dy also as its bf16 copy (Mamba-2's bf16 runs keep it so).
        unsigned short* dyhp = cs.half ? dyh.data() : nullptr;
        emu_launch({blocks, 1, 1}, EMU_BLOCK, 0, [&] {
            mamba_gated_norm_bwd(dgnf.data(), g, g_h, w.data(), rstd.data(), y, y_h, z, z_h, ldz, dy.data(),
                                 dyhp, dzf, dzhp, M, D);
        });
        bool same = !std::memcmp(dy.data(), dy2.data(), dy.size() * 4) &&
                    !std::memcmp(dz.data(), dz2.data(), dz.size() * 4) &&
                    !std::memcmp(dzh.data(), dz2h.data(), dzh.size() * 2);
        for (size_t i = 0; cs.half && i < dy2.size(); ++i) {
            same = same && dyh[i] == (unsigned short)mamba::bf16_rne(dy2[i]);
        }
        fails += !same;
        // f64 oracle of dy and dz from the equations, with the same rstd.
        std::vector<double> edy((size_t)M * D), edz((size_t)M * D);
        std::vector<float> gdz((size_t)M * D);
        for (int m = 0; m < M; ++m) {
            double dot = 0;
            const double r = rstd[m];
            for (int j = 0; j < D; ++j) dot += dgn[(size_t)m * D + j] * w64[j] * g64[(size_t)m * D + j];
            for (int j = 0; j < D; ++j) {
                const size_t i = (size_t)m * D + j, iz = (size_t)m * ldz + j;
                const double dgv = r * w64[j] * dgn[i] - g64[i] * r * r * r * dot / D;
                const double zv = z64[iz], sg = 1 / (1 + std::exp(-zv));
                edy[i] = dgv * zv * sg;
                edz[i] = dgv * y64[i] * sg * (1 + zv * (1 - sg));
                gdz[i] = dzf ? dz[iz] : mamba::bf16_to_f32(dzh[iz]);
            }
        }
        printf("M%d D%d ldz%d %s dz%s: %s", M, D, ldz, cs.half ? "bf16" : "f32",
               cs.out == 1 ? "f32" : cs.out == 2 ? "bf16" : "both", same ? "two-kernel-bits ok" : "two-kernel-bits DIFFER FAIL");
        fails += report({{"dy", rel_l2(dy, edy), 1e-5}, {"dz", rel_l2(gdz, edz), cs.out == 2 ? 4e-3 : 1e-5}},
                        {&dy, &gdz});
    }
    printf(fails ? "%d FAIL\n" : "all within tolerance\n", fails);
    return fails ? 1 : 0;
}

// The two-stage column sums (mamba_colsum_partial, then
// mamba_reduce_partials, in kernels/cuda/mamba_ops.cu, compiled as C++
// under cuda_emu.h) over every mode (a; a b; a b rs), f32 and bf16
// operands, leading dimensions past the width, a partial last slab and a
// partial column block. Checked two ways:
//   - the slab partials bit for bit against a host twin in the association
//     the kernel promises: row lane ty (of 8) adds rows r0 + ty, r0 + ty +
//     8, .. in ascending order, each addend a, (a b) or ((a b) rs) rounded
//     product by product, then the fixed tree over the 8 lanes; and the
//     sums bit for bit against stage 2's serial ascending sum of them;
//   - the sums against f64, within 1e-5.
// Built and run by kernels/src/mamba/colsum_emu_tests.rs (EMU_COL_SLAB:
// the host launcher's slab). EMU_NEGATIVE=1 feeds the kernel one wrong
// element of a (the twin and the oracle keep the right one): the check
// must then fail. Exit status 0 only when every shape passes.
#include <cstdio>
#include <random>
#include "check_report.h"
#include "mamba_ops.cu"

#ifndef EMU_NEGATIVE
#define EMU_NEGATIVE 0
#endif
#ifndef EMU_COL_SLAB
#error "EMU_COL_SLAB (the host launcher's slab) must be defined"
#endif
static_assert(EMU_COL_SLAB == mamba::kColSlab, "reductions.rs's COL_SLAB is not the kernel's kColSlab");

// {rows M, columns C, lda, ldb, mode, a in bf16, b in bf16}
struct Case { int m, c, lda, ldb, mode, ah, bh; };

int main() {
    const Case cases[] = {
        {700, 45, 45, 45, 0, 0, 0},    {513, 70, 80, 72, 1, 0, 0},  {300, 33, 40, 33, 2, 0, 1},
        {1030, 64, 64, 96, 1, 1, 1},   {257, 9, 12, 9, 2, 1, 0},    {64, 100, 100, 100, 0, 1, 0},
        {2, 31, 31, 31, 2, 0, 0},      {900, 40, 48, 40, 1, 0, 1},
    };
    std::mt19937_64 rng(11);
    int fails = 0;
    for (const Case& cs : cases) {
        const int M = cs.m, C = cs.c;
        const int slabs = (M + EMU_COL_SLAB - 1) / EMU_COL_SLAB;
        const auto a64 = uniform_floats(rng, -1, 1, (size_t)M * cs.lda);
        const auto b64 = uniform_floats(rng, -1, 1, (size_t)M * cs.ldb);
        const auto r64 = uniform_floats(rng, 0.5, 2, M);
        // The operands as the kernel reads them (bf16: their rounding).
        std::vector<float> af(a64.size()), bf(b64.size()), rs(r64.begin(), r64.end());
        std::vector<unsigned short> ah(a64.size()), bh(b64.size());
        for (size_t i = 0; i < a64.size(); ++i) {
            ah[i] = (unsigned short)mamba::bf16_rne((float)a64[i]);
            af[i] = cs.ah ? mamba::bf16_to_f32(ah[i]) : (float)a64[i];
        }
        for (size_t i = 0; i < b64.size(); ++i) {
            bh[i] = (unsigned short)mamba::bf16_rne((float)b64[i]);
            bf[i] = cs.bh ? mamba::bf16_to_f32(bh[i]) : (float)b64[i];
        }
        // Twin and oracle.
        auto addend = [&](int m, int c) {
            float v = af[(size_t)m * cs.lda + c];
            if (cs.mode >= 1) v = v * bf[(size_t)m * cs.ldb + c];
            if (cs.mode == 2) v = v * rs[m];
            return v;
        };
        std::vector<float> tpart((size_t)slabs * C), tsum(C);
        std::vector<double> esum(C);
        for (int c = 0; c < C; ++c) {
            for (int s = 0; s < slabs; ++s) {
                const int r0 = s * EMU_COL_SLAB, r1 = std::min(M, r0 + EMU_COL_SLAB);
                float lane[8];
                for (int ty = 0; ty < 8; ++ty) {
                    lane[ty] = 0.0f;
                    for (int m = r0 + ty; m < r1; m += 8) lane[ty] = lane[ty] + addend(m, c);
                }
                tpart[(size_t)s * C + c] =
                    ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
            }
            float t = 0.0f;
            for (int s = 0; s < slabs; ++s) t = t + tpart[(size_t)s * C + c];
            tsum[c] = t;
            for (int m = 0; m < M; ++m) {
                double v = af[(size_t)m * cs.lda + c];
                if (cs.mode >= 1) v *= bf[(size_t)m * cs.ldb + c];
                if (cs.mode == 2) v *= rs[m];
                esum[c] += v;
            }
        }
        // The kernels, as reductions.rs launches them.
        if (EMU_NEGATIVE) {
            const size_t i = (size_t)(M / 2) * cs.lda + C / 2;
            af[i] += 0.25f;
            ah[i] = (unsigned short)mamba::bf16_rne(mamba::bf16_to_f32(ah[i]) + 0.25f);
        }
        std::vector<float> part((size_t)slabs * C, NAN), sum(C, NAN);
        emu_launch({(unsigned)slabs, (unsigned)((C + 31) / 32), 1}, 256, 0, [&] {
            mamba_colsum_partial(cs.ah ? nullptr : af.data(), cs.ah ? ah.data() : nullptr, cs.lda,
                                 cs.mode == 0 || cs.bh ? nullptr : bf.data(),
                                 cs.mode >= 1 && cs.bh ? bh.data() : nullptr, cs.ldb,
                                 cs.mode == 2 ? rs.data() : nullptr, cs.mode, part.data(), M, C);
        });
        emu_launch({(unsigned)((C + 63) / 64), 1, 1}, 64, 0, [&] {
            mamba_reduce_partials(part.data(), slabs, C, 0, C, nullptr, 0, sum.data());
        });
        const bool bits = std::memcmp(part.data(), tpart.data(), part.size() * 4) == 0 &&
                          std::memcmp(sum.data(), tsum.data(), sum.size() * 4) == 0;
        printf("M%d C%d lda%d ldb%d mode%d a%s b%s:", M, C, cs.lda, cs.ldb, cs.mode,
               cs.ah ? "bf16" : "f32", cs.bh ? "bf16" : "f32");
        printf(" twin-bits %s%s", bits ? "ok" : "DIFFER", bits ? "" : " FAIL");
        fails += !bits;
        fails += report({{"sum", rel_l2(sum, esum), 1e-5}}, {&sum, &part});
    }
    printf(fails ? "%d FAIL\n" : "all within tolerance\n", fails);
    return fails ? 1 : 0;
}

// The scan kernels (kernels/cuda/mamba_scan.cu, compiled as C++ under
// cuda_emu.h) against a sequential f64 scan written from the equations (the
// oracle of mamba-train/tests/cuda_scan.rs, with the same tolerances), over
// shapes that cover ragged chunks, every lane count, inactive states and
// channels, several channel groups and two backward rounds. Built and run by
// kernels/src/mamba/scan_emu_tests.rs, which passes the launch geometry of
// scan_shape.rs: EMU_BLOCK (threads a block), EMU_LANE_STATES (states a
// thread). EMU_NEGATIVE=1 feeds the kernels one wrong dt (the oracle keeps
// the right one): the check must then fail. Exit status 0 only when every
// quantity of every shape is within tolerance.
#include <cstdio>
#include <random>
#include "check_report.h"
#include "mamba_scan.cu"

#if !defined(EMU_BLOCK) || !defined(EMU_LANE_STATES)
#error "EMU_BLOCK and EMU_LANE_STATES must be defined"
#endif
#ifndef EMU_NEGATIVE
#define EMU_NEGATIVE 0
#endif

struct Case { int b, t, d, n, r; };

static int next_pow2(int x) { int p = 1; while (p < x) p <<= 1; return p; }

int main() {
    // {batch, T, d_inner, d_state, dt_rank}
    const Case cases[] = {{1, 1, 1, 1, 1},   {2, 37, 5, 16, 3},    {1, 16, 9, 64, 2},
                          {3, 33, 40, 7, 4}, {1, 50, 3, 33, 1},    {2, 17, 130, 2, 5},
                          {1, 20, 300, 128, 2}, {2, 33, 70, 9, 3}, {2, 300, 3, 5, 2}};
    int fails = 0;
    unsigned seed = 1;
    for (const Case& c : cases) {
        const int B = c.b, T = c.t, D = c.d, N = c.n, R = c.r, M = B * T, ld = R + 2 * N;
        std::mt19937_64 rng(seed++);
        auto uni = [&](double lo, double hi, size_t len) { return uniform_floats(rng, lo, hi, len); };
        auto u = uni(-1, 1, (size_t)M * D), dt = uni(0.001, 0.6, (size_t)M * D),
             dbc = uni(-1, 1, (size_t)M * ld), dp = uni(0.5, 1.5, D),
             xz = uni(-2, 2, (size_t)M * 2 * D), dy = uni(-1, 1, (size_t)M * D);
        std::vector<double> a_log((size_t)D * N);
        for (size_t i = 0; i < a_log.size(); ++i) a_log[i] = (double)(float)std::log((double)(i % N + 1));
        // Oracle.
        std::vector<double> ey(M * D), eout(M * D), eddtr(M * D), edu(M * D), edbc(M * 2 * N), eda(D * N);
        auto bv = [&](int mm, int j) { return dbc[(size_t)mm * ld + R + j]; };
        auto cv = [&](int mm, int j) { return dbc[(size_t)mm * ld + R + N + j]; };
        for (int b = 0; b < B; ++b)
            for (int ch = 0; ch < D; ++ch) {
                std::vector<double> hs((T + 1) * N);
                for (int s = 0; s < N; ++s) {
                    double a = -std::exp(a_log[ch * N + s]), h = 0;
                    for (int t = 0; t < T; ++t) {
                        int mm = b * T + t;
                        h = std::exp(dt[mm * D + ch] * a) * h + dt[mm * D + ch] * bv(mm, s) * u[mm * D + ch];
                        hs[(t + 1) * N + s] = h;
                        ey[mm * D + ch] += cv(mm, s) * h;
                    }
                }
                for (int t = 0; t < T; ++t) {
                    int mm = b * T + t;
                    ey[mm * D + ch] += dp[ch] * u[mm * D + ch];
                    double z = xz[(size_t)mm * 2 * D + D + ch];
                    eout[mm * D + ch] = ey[mm * D + ch] * z / (1 + std::exp(-z));
                }
                for (int s = 0; s < N; ++s) {
                    double a = -std::exp(a_log[ch * N + s]), carry = 0;
                    for (int t = T - 1; t >= 0; --t) {
                        int mm = b * T + t;
                        double dtv = dt[mm * D + ch], uv = u[mm * D + ch], dyv = dy[mm * D + ch];
                        double at = std::exp(dtv * a), g = cv(mm, s) * dyv + carry, hp = hs[t * N + s];
                        edbc[mm * 2 * N + N + s] += dyv * hs[(t + 1) * N + s];
                        edbc[mm * 2 * N + s] += g * dtv * uv;
                        eddtr[mm * D + ch] += g * (a * at * hp + bv(mm, s) * uv);
                        edu[mm * D + ch] += g * dtv * bv(mm, s);
                        eda[ch * N + s] += g * at * hp * dtv * a;
                        carry = at * g;
                    }
                }
                for (int t = 0; t < T; ++t) {
                    int mm = b * T + t;
                    edu[mm * D + ch] += dp[ch] * dy[mm * D + ch];
                    eddtr[mm * D + ch] *= -std::expm1(-dt[mm * D + ch]);
                }
            }
        // Kernels: once with the host's segment length (64 chunks: one
        // segment at these lengths, the unsegmented walk), then with
        // segments of 1, 2 and 3 chunks where the sequence has more.
        auto f = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
        auto fu = f(u), fdt = f(dt), fdbc = f(dbc), fal = f(a_log), fdp = f(dp), fxz = f(xz), fdy = f(dy);
        if (EMU_NEGATIVE) fdt[fdt.size() / 2] *= 1.5f;
        const int sp = next_pow2((N + EMU_LANE_STATES - 1) / EMU_LANE_STATES), cpb = EMU_BLOCK / sp;
        const int nch = (T + 15) / 16, sets = (D + cpb - 1) / cpb;
        for (const int seg : {64, 1, 2, 3}) {
        if (seg != 64 && seg >= nch) continue;
        const int nseg = (nch + seg - 1) / seg;
        const int rounds = std::max(1, (sets + 63) / 64), groups = (sets + rounds - 1) / rounds;
        const float nan = std::nanf("");
        // Dynamic shared memory in floats (ScanShape::fwd_smem_bytes and
        // bwd_smem_bytes / 4): two chunk staging buffers and the chunk's
        // per-channel sums (1 a step forward, 2 backward); the backward adds
        // the chunk's states and the d B / d C stage.
        const size_t stage = 16 * (2 * sp * EMU_LANE_STATES + 3 * cpb);
        const size_t fwd_dyn = 2 * stage + 16 * cpb;
        const size_t bwd_dyn = 16 * EMU_LANE_STATES * EMU_BLOCK +
                               EMU_RED_STEPS * 2 * EMU_LANE_STATES * (EMU_BLOCK + std::min(sp, 8)) + 2 * stage +
                               16 * 2 * cpb;
        const float* bc = fdbc.data() + R;
        const unsigned link_blocks = (unsigned)((B * D * N + 255) / 256);
        // Every launch of one forward + backward: u and dt as f32 (uh, dth
        // null) or bf16 (u, dt null); y into y (f32) or, when y is null,
        // y_h alone. The outputs start as NaN (0xffff for the bf16 ones):
        // an element never written shows.
        struct Outs {
            std::vector<float> hin, y, out, ddtr, du, part, dapart, ddbc, seg_state, seg_carry;
            std::vector<unsigned short> y_h, out_h, ddtr_h;
        };
        auto run = [&](const float* uf, const unsigned short* uh, const float* dtf,
                       const unsigned short* dth, const float* zf, const unsigned short* zh,
                       bool y_half) {
            Outs o{std::vector<float>((size_t)B * nch * D * N, nan), std::vector<float>(M * D, nan),
                   std::vector<float>(M * D, nan), std::vector<float>(M * D, nan),
                   std::vector<float>(M * D, nan), std::vector<float>((size_t)groups * M * 2 * N, nan),
                   std::vector<float>((size_t)B * nseg * D * N, nan),
                   std::vector<float>((size_t)M * ld, nan),
                   // Pass-1 values per segment (segment 0's carry and the
                   // last's state are never written nor read).
                   std::vector<float>((size_t)2 * B * nseg * D * N, nan),
                   std::vector<float>((size_t)2 * B * nseg * D * N, nan),
                   std::vector<unsigned short>(M * D, 0xffff), std::vector<unsigned short>(M * D, 0xffff),
                   std::vector<unsigned short>(M * D, 0xffff)};
            float* yf = y_half ? nullptr : o.y.data();
            unsigned short* yh = y_half ? o.y_h.data() : nullptr;
            if (nseg > 1) {
                emu_launch({(unsigned)sets, (unsigned)B, (unsigned)(nseg - 1)}, EMU_BLOCK, fwd_dyn, [&] {
                    mamba_scan_fwd_seg(uf, uh, dtf, dth, bc, ld, fal.data(), o.seg_state.data(), T, D,
                                       N, sp, seg);
                });
                emu_launch({link_blocks, 1, 1}, 256, 0, [&] {
                    mamba_scan_seg_link(o.seg_state.data(), o.hin.data(), B, T, D, N, seg, 0);
                });
            }
            emu_launch({(unsigned)sets, (unsigned)B, (unsigned)nseg}, EMU_BLOCK, fwd_dyn, [&] {
                mamba_scan_fwd(uf, uh, dtf, dth, bc, ld, fal.data(), fdp.data(), zf, zh, 2 * D,
                               o.hin.data(), yf, yh, o.out.data(), o.out_h.data(), T, D, N, sp, seg);
            });
            if (nseg > 1) {
                emu_launch({(unsigned)sets, (unsigned)B, (unsigned)(nseg - 1)}, EMU_BLOCK, fwd_dyn, [&] {
                    mamba_scan_bwd_seg(dtf, dth, bc, ld, fal.data(), fdy.data(), o.seg_carry.data(), T,
                                       D, N, sp, seg);
                });
                emu_launch({link_blocks, 1, 1}, 256, 0, [&] {
                    mamba_scan_seg_link(o.seg_carry.data(), nullptr, B, T, D, N, seg, 1);
                });
            }
            emu_launch({(unsigned)groups, (unsigned)B, (unsigned)nseg}, EMU_BLOCK, bwd_dyn, [&] {
                mamba_scan_bwd(uf, uh, dtf, dth, bc, ld, fal.data(), fdp.data(), fdy.data(),
                               o.hin.data(), o.ddtr.data(), o.ddtr_h.data(), o.du.data(), o.part.data(),
                               o.dapart.data(), o.seg_carry.data(), T, D, N, sp, rounds, seg);
            });
            emu_launch({(unsigned)((M * 2 * N + 255) / 256), 1, 1}, 256, 0, [&] {
                mamba_scan_dbc_reduce(o.part.data(), groups, M, N, o.ddbc.data() + R, ld);
            });
            return o;
        };
        Outs o = run(fu.data(), nullptr, fdt.data(), nullptr, fxz.data() + D, nullptr, false);
        auto& [hin, y, out, ddtr, du, part, dapart, ddbc, seg_state, seg_carry, y_h, out_h, ddtr_h] = o;
        (void)part; (void)seg_state; (void)seg_carry; (void)y_h;
        // bf16-kept u, dt and z (even D): the bf16 staging must give the
        // bits of the f32 staging of the same values, y's bf16 the rounding
        // of that run's y, and the gated output gate_out of that rounded y
        // (what the gate's backward recomputes).
        bool half_ok = true;
        // (Unsegmented and one segmented walk per shape; not in the
        // negative build, which needs only the tolerance to fail.)
        const bool half_case = D % 2 == 0 && (seg == 64 || seg == 1) && !EMU_NEGATIVE;
        if (half_case) {
            std::vector<float> ru(fu.size()), rdt(fdt.size()), rxz(fxz.size());
            std::vector<unsigned short> hu(fu.size()), hdt(fdt.size()), hxz(fxz.size());
            for (size_t i = 0; i < fu.size(); ++i) {
                hu[i] = (unsigned short)mamba::bf16_rne(fu[i]);
                hdt[i] = (unsigned short)mamba::bf16_rne(fdt[i]);
                ru[i] = mamba::bf16_to_f32(hu[i]);
                rdt[i] = mamba::bf16_to_f32(hdt[i]);
            }
            for (size_t i = 0; i < fxz.size(); ++i) {
                hxz[i] = (unsigned short)mamba::bf16_rne(fxz[i]);
                rxz[i] = mamba::bf16_to_f32(hxz[i]);
            }
            Outs a = run(ru.data(), nullptr, rdt.data(), nullptr, rxz.data() + D, nullptr, false);
            Outs h = run(nullptr, hu.data(), nullptr, hdt.data(), nullptr, hxz.data() + D, true);
            auto same = [](const std::vector<float>& x, const std::vector<float>& z) {
                return std::memcmp(x.data(), z.data(), x.size() * 4) == 0;
            };
            half_ok = same(a.hin, h.hin) && same(a.ddtr, h.ddtr) && same(a.du, h.du) &&
                      same(a.ddbc, h.ddbc) && same(a.dapart, h.dapart);
            for (int i = 0; i < M * D; ++i) {
                const unsigned short yr = (unsigned short)mamba::bf16_rne(a.y[i]);
                const float zr = rxz[(size_t)(i / D) * 2 * D + D + i % D];
                const float g = mamba::gate_out(mamba::bf16_to_f32(yr), zr);
                half_ok = half_ok && h.y_h[i] == yr &&
                          std::memcmp(&h.out[i], &g, 4) == 0;
            }
            fails += !half_ok;
        }
        std::vector<float> da(D * N);
        for (int j = 0; j < D * N; ++j) {
            float s = 0;
            for (int p = 0; p < B * nseg; ++p) s = s + dapart[(size_t)p * D * N + j];
            da[j] = s * -std::exp(fal[j]);
        }
        std::vector<float> dbc_cols;
        for (int mm = 0; mm < M; ++mm)
            for (int j = 0; j < 2 * N; ++j) dbc_cols.push_back(ddbc[(size_t)mm * ld + R + j]);
        // Each bf16 copy must be the cast of its f32 value, bit for bit.
        int copy_bad = 0;
        for (int i = 0; i < M * D; ++i) {
            copy_bad += out_h[i] != (unsigned short)mamba::bf16_rne(out[i]);
            copy_bad += ddtr_h[i] != (unsigned short)mamba::bf16_rne(ddtr[i]);
        }
        fails += copy_bad != 0;
        printf("B %d T %d D %d N %d (sp %d cpb %d rounds %d groups %d seg %d nseg %d): bf16 copies %s, "
               "bf16 u/dt/z %s,",
               B, T, D, N, sp, cpb, rounds, groups, seg, nseg, copy_bad ? "DIFFER" : "exact",
               !half_case ? "not run" : half_ok ? "same bits" : "DIFFER");
        fails += report({{"y", rel_l2(y, ey), 2e-6},
                         {"out", rel_l2(out, eout), 2e-6},
                         {"ddt_raw", rel_l2(ddtr, eddtr), 1e-5},
                         {"du", rel_l2(du, edu), 1e-5},
                         {"dB|dC", rel_l2(dbc_cols, edbc), 1e-5},
                         {"dA_log", rel_l2(da, eda), 1e-5}},
                        {&hin, &y, &out, &ddtr, &du, &ddbc, &dapart});
        }
    }
    printf("%s\n", fails ? "FAILED" : "all within tolerance");
    return fails ? 1 : 0;
}

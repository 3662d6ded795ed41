// The SSD kernels (kernels/cuda/mamba_ssd.cu, compiled as C++ under
// cuda_emu.h) against the sequential recurrence in f64, written from the
// equations (y_t = H_t C_t + D x_t, H_t = exp(dt_t A) H_{t-1} + dt_t x_t
// B_t^T, and its reverse-mode gradient through time), over shapes that
// cover ragged and single chunks, several chunks, channel and state tiles
// past one (up to four, at d_state 200), groups of one and several heads,
// and padded leading dimensions (rows unaligned, and 16-byte rows). The launches are the host's (kernels/src/mamba/ssd.rs), in
// its order. EMU_NEGATIVE=1 feeds the kernels one wrong dt (the oracle keeps
// the right one): the check must then fail. EMU_TC=1 runs the tensor-core
// kernels (mamba_ssd_tc.cu, tf32 operands) where they replace the SIMT ones,
// against the same oracle at tf32's tolerances. Exit status 0 only when
// every quantity of every shape is within tolerance.
#include <cstdio>
#include <cstring>
#include <random>
#include "check_report.h"
#include "mamba_ssd.cu"
#include "mamba_ssd_tc.cu"

#ifndef EMU_NEGATIVE
#define EMU_NEGATIVE 0
#endif
#ifndef EMU_TC
#define EMU_TC 0
#endif

// The product kernels of the run: SIMT (f32 runs) or tensor cores (tf32 /
// bf16 runs); the two sets take the same arguments, but for the chunk
// outputs and the backward's Q x Q kernel, whose tensor-core kernels also
// read each group's C B^T (mamba_ssd_cb_tc), made into the psum buffer as
// the host does (bwd_psum overwrites it later).
static const auto bwd_dx = EMU_TC ? mamba_ssd_bwd_dx_tc : mamba_ssd_bwd_dx;
static const auto bwd_dbc = EMU_TC ? mamba_ssd_bwd_dbc_tc : mamba_ssd_bwd_dbc;
// tf32 operands carry 2^-11 relative rounding: a product's error is about
// 3e-4 relative, the gradients' about twice that.
static const double kTolFwd = EMU_TC ? 1e-3 : 2e-6;
static const double kTolBwd = EMU_TC ? 2e-3 : 1e-5;
// The bf16 kernels of bf16 runs: each kept x, B, C, dy and entry state
// carries 2^-9 relative rounding (about 1.1e-3 RMS) on top of tf32's, and
// y, d x, d B and d C each read three or four such factors.
static const double kTolStatesH = 5e-3;

// pad: the conv output's columns past x, B and C (odd: rows unaligned, the
// 4-byte staging; a multiple of 4: 16-byte f32 rows, the vector staging;
// a multiple of 8 with P and N too: 16-byte bf16 rows, the bf16 kernels'
// vector staging of x, B and C).
struct Case { int b, t, h, p, n, g, pad; };

static unsigned blocks(long long n) { return (unsigned)((n + 255) / 256); }

int main() {
    const Case cases[] = {{2, 150, 4, 8, 20, 2, 3}, {1, 64, 2, 72, 80, 1, 3},
                          {1, 37, 3, 16, 16, 3, 3}, {3, 1, 2, 4, 8, 1, 3},
                          {1, 129, 2, 64, 128, 1, 3}, {2, 200, 2, 40, 72, 1, 4},
                          {1, 70, 2, 16, 200, 1, 4}, {2, 130, 4, 16, 64, 2, 8}};
    int fails = 0;
    unsigned seed = 7;
    for (const Case& c : cases) {
        const int B = c.b, T = c.t, H = c.h, P = c.p, N = c.n, G = c.g, hpg = H / G;
        const int E = H * P, M = B * T, nc = (T + kQ - 1) / kQ, nbc = B * nc;
        const int b_off = E, c_off = E + G * N, ldu = E + 2 * G * N + c.pad, ldz = E + 5,
                  ld_ddt = H + 2;
        std::mt19937_64 rng(seed++);
        auto uni = [&](double lo, double hi, size_t len) { return uniform_floats(rng, lo, hi, len); };
        auto xbc = uni(-1, 1, (size_t)M * ldu), dt = uni(0.001, 0.6, (size_t)M * H),
             a_log = uni(-1, 1.5, H), dp = uni(0.5, 1.5, H), z = uni(-2, 2, (size_t)M * ldz),
             dy = uni(-1, 1, (size_t)M * E);
        auto X = [&](int m, int h, int p) { return xbc[(size_t)m * ldu + h * P + p]; };
        auto Bv = [&](int m, int g, int n) { return xbc[(size_t)m * ldu + b_off + g * N + n]; };
        auto Cv = [&](int m, int g, int n) { return xbc[(size_t)m * ldu + c_off + g * N + n]; };
        // Oracle.
        std::vector<double> ey((size_t)M * E), egate((size_t)M * E), edx((size_t)M * E),
            edb((size_t)M * G * N), edc((size_t)M * G * N), eddt((size_t)M * H), eda(H);
        for (int b = 0; b < B; ++b)
            for (int h = 0; h < H; ++h) {
                const int g = h / hpg;
                const double A = -std::exp(a_log[h]);
                std::vector<double> hs((size_t)(T + 1) * P * N, 0.0);
                for (int t = 0; t < T; ++t) {
                    const int m = b * T + t;
                    const double d = dt[(size_t)m * H + h], decay = std::exp(d * A);
                    double* hp = &hs[(size_t)t * P * N];
                    double* hn = &hs[(size_t)(t + 1) * P * N];
                    for (int p = 0; p < P; ++p) {
                        double acc = 0;
                        for (int n = 0; n < N; ++n) {
                            hn[p * N + n] = decay * hp[p * N + n] + d * X(m, h, p) * Bv(m, g, n);
                            acc += hn[p * N + n] * Cv(m, g, n);
                        }
                        const double yv = acc + dp[h] * X(m, h, p);
                        const double zv = z[(size_t)m * ldz + h * P + p];
                        ey[(size_t)m * E + h * P + p] = yv;
                        egate[(size_t)m * E + h * P + p] = yv * zv / (1 + std::exp(-zv));
                    }
                }
                std::vector<double> dh((size_t)P * N, 0.0);
                for (int t = T - 1; t >= 0; --t) {
                    const int m = b * T + t;
                    const double d = dt[(size_t)m * H + h], decay = std::exp(d * A);
                    const double* hp = &hs[(size_t)t * P * N];
                    const double* hn = &hs[(size_t)(t + 1) * P * N];
                    const double* dyr = &dy[(size_t)m * E + h * P];
                    for (int p = 0; p < P; ++p)
                        for (int n = 0; n < N; ++n) {
                            dh[p * N + n] += dyr[p] * Cv(m, g, n);
                            edc[(size_t)m * G * N + g * N + n] += dyr[p] * hn[p * N + n];
                        }
                    double ddt = 0;
                    for (int p = 0; p < P; ++p) {
                        double acc = 0;
                        for (int n = 0; n < N; ++n) {
                            const double gv = dh[p * N + n];
                            acc += gv * Bv(m, g, n);
                            edb[(size_t)m * G * N + g * N + n] += d * gv * X(m, h, p);
                            ddt += gv * (X(m, h, p) * Bv(m, g, n) + A * decay * hp[p * N + n]);
                            eda[h] += gv * d * decay * hp[p * N + n] * A;
                            dh[p * N + n] = decay * gv;
                        }
                        edx[(size_t)m * E + h * P + p] = d * acc + dp[h] * dyr[p];
                    }
                    eddt[(size_t)m * H + h] = ddt * -std::expm1(-d);
                }
            }
        // Kernels.
        auto f = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
        auto fx = f(xbc), fdt = f(dt), fal = f(a_log), fdp = f(dp), fz = f(z), fdy = f(dy);
        if (EMU_NEGATIVE) fdt[fdt.size() / 2] *= 1.5f;
        const float nan = std::nanf("");
        const long long st_len = (long long)nbc * H * P * N, qq_len = (long long)nbc * H * kQ * kQ;
        const int tiles_state = ((P + kSp - 1) / kSp) * ((N + kSn - 1) / kSn);
        const int ntn = (N + kDn - 1) / kDn;
        const long long psum_len = (long long)nbc * G * kQ * kQ;
        std::vector<float> s((size_t)M * H, nan), st(st_len, nan), y((size_t)M * E, nan),
            gate((size_t)M * E, nan);
        // Forward.
        emu_launch({blocks((long long)nbc * H), 1, 1}, 256, 0, [&] {
            mamba_ssd_cumsum(fdt.data(), fal.data(), s.data(), T, H, nc, nbc);
        });
        // The chunk states and their pass: two kernels of the SIMT set, one
        // of the tensor-core set (a block per sequence, head and state tile).
        auto states = [&](std::vector<float>& out, const float* Xp, long long ldx, const float* Yp,
                          int y_off, int mode) {
            if (EMU_TC) {
                emu_launch({(unsigned)B, (unsigned)H, (unsigned)tiles_state}, kThreads,
                           kStateScanSmemFloats, [&] {
                    mamba_ssd_state_scan_tc(Xp, ldx, Yp, ldu, y_off, fdt.data(), s.data(),
                                            out.data(), T, H, P, N, hpg, nc, mode);
                });
                return;
            }
            emu_launch({(unsigned)nbc, (unsigned)H, (unsigned)tiles_state}, kThreads, 0, [&] {
                mamba_ssd_chunk_state(Xp, ldx, Yp, ldu, y_off, fdt.data(), s.data(), out.data(), T,
                                      H, P, N, hpg, nc, mode);
            });
            emu_launch({blocks((long long)B * H * P * N), 1, 1}, 256, 0, [&] {
                mamba_ssd_state_pass(out.data(), s.data(), T, H, (long long)P * N, nc, B, mode);
            });
        };
        states(st, fx.data(), ldu, fx.data(), b_off, 0);
        std::vector<float> cbg(psum_len, nan);
        auto group_cb = [&] {
            emu_launch({(unsigned)nbc, (unsigned)G, 1}, kThreads, 0, [&] {
                mamba_ssd_cb_tc(fx.data(), ldu, b_off, c_off, cbg.data(), T, N, nc);
            });
        };
        if (EMU_TC) group_cb();
        // z f32 or bf16 (zh), y and the gate f32 and / or bf16 (yh, gh), as
        // the host passes a Stored and two Stores.
        auto chunk_out = [&](const float* zf, const unsigned short* zh, float* yf,
                             unsigned short* yh, float* g, unsigned short* gh) {
            emu_launch({(unsigned)nbc, (unsigned)H, 1}, kThreads, EMU_TC ? kStagedSmemFloats : 0,
                       [&] {
                           if (EMU_TC) {
                               mamba_ssd_chunk_out_tc(fx.data(), ldu, b_off, c_off, fdt.data(),
                                                      s.data(), fdp.data(), st.data(), zf, zh,
                                                      ldz, yf, yh, g, gh, T, H, P, N, hpg, nc,
                                                      cbg.data());
                           } else {
                               mamba_ssd_chunk_out(fx.data(), ldu, b_off, c_off, fdt.data(),
                                                   s.data(), fdp.data(), st.data(), zf, zh, ldz,
                                                   yf, yh, g, gh, T, H, P, N, hpg, nc);
                           }
                       });
        };
        chunk_out(fz.data(), nullptr, y.data(), nullptr, gate.data(), nullptr);
        // bf16 runs keep z, y and the gate in bf16 alone: y's bf16 is the
        // rounding of the f32 run's y, and the gate is the rounding of the
        // gate of that y and z's rounding.
        long long half_bad = 0;
        {
            std::vector<unsigned short> zh(fz.size()), yh(y.size());
            for (size_t i = 0; i < fz.size(); ++i) zh[i] = (unsigned short)mamba::bf16_rne(fz[i]);
            std::vector<unsigned short> gate_h(gate.size(), 0xffff);
            chunk_out(nullptr, zh.data(), nullptr, yh.data(), nullptr, gate_h.data());
            for (int m = 0; m < M; ++m)
                for (int e = 0; e < E; ++e) {
                    const size_t i = (size_t)m * E + e;
                    const float want = mamba::gate_out(mamba::bf16_to_f32(yh[i]),
                                                       mamba::bf16_to_f32(zh[(size_t)m * ldz + e]));
                    half_bad += yh[i] != (unsigned short)mamba::bf16_rne(y[i]) ||
                                gate_h[i] != (unsigned short)mamba::bf16_rne(want);
                }
        }

        // Backward, from fresh scratch as the host runs it (s and the
        // entry states recomputed).
        std::vector<float> s2((size_t)M * H, nan), st2(st_len, nan), dst(st_len, nan),
            mq(qq_len, nan), pq(qq_len, nan), ds_in((size_t)M * H, nan), ddt_in((size_t)M * H, nan),
            rst((size_t)M * H, nan), o_row((size_t)M * H, nan), dsh((size_t)nbc * H, nan),
            psum(psum_len, nan), dxbc((size_t)M * ldu, nan),
            ddt_raw((size_t)M * ld_ddt, nan), da_part((size_t)nbc * H, nan), da_log(H, nan);
        // bwd_dt also stores d dt_raw's bf16 rounding (bf16 runs' GEMMs read it).
        std::vector<unsigned short> ddt_h((size_t)M * ld_ddt, 0xffff);
        emu_launch({blocks((long long)nbc * H), 1, 1}, 256, 0, [&] {
            mamba_ssd_cumsum(fdt.data(), fal.data(), s2.data(), T, H, nc, nbc);
        });
        s = s2;
        states(st2, fx.data(), ldu, fx.data(), b_off, 0);
        states(dst, fdy.data(), E, fx.data(), c_off, 1);
        cbg.assign(psum_len, nan);
        if (EMU_TC) group_cb();
        emu_launch({(unsigned)nbc, (unsigned)H, 1}, kThreads, 0, [&] {
            if (EMU_TC) {
                mamba_ssd_bwd_qq_tc(fx.data(), ldu, b_off, c_off, fdt.data(), s.data(), fdy.data(),
                                    mq.data(), pq.data(), ds_in.data(), ddt_in.data(), T, H, P, N,
                                    hpg, nc, cbg.data());
            } else {
                mamba_ssd_bwd_qq(fx.data(), ldu, b_off, c_off, fdt.data(), s.data(), fdy.data(),
                                 mq.data(), pq.data(), ds_in.data(), ddt_in.data(), T, H, P, N,
                                 hpg, nc);
            }
        });
        emu_launch({(unsigned)nbc, (unsigned)H, 1}, kThreads, EMU_TC ? kStagedSmemFloats : 0, [&] {
            bwd_dx(fx.data(), ldu, b_off, c_off, fdt.data(), s.data(), fdp.data(),
                             fdy.data(), mq.data(), st2.data(), dst.data(), dxbc.data(), ldu,
                             rst.data(), o_row.data(), dsh.data(), T, H, P, N, hpg, nc);
        });
        emu_launch({blocks(psum_len), 1, 1}, 256, 0, [&] {
            mamba_ssd_bwd_psum(pq.data(), psum.data(), H, hpg, psum_len);
        });
        emu_launch({(unsigned)nbc, (unsigned)G, (unsigned)(2 * ntn)}, kThreads, 0, [&] {
            bwd_dbc(fx.data(), ldu, b_off, c_off, fdt.data(), s.data(), fdy.data(),
                              psum.data(), st2.data(), dst.data(), dxbc.data(), ldu, T, H, P, N,
                              hpg, nc);
        });
        emu_launch({blocks((long long)nbc * H * 32), 1, 1}, 256, 0, [&] {
            mamba_ssd_bwd_dt(fdt.data(), s.data(), fal.data(), ds_in.data(), ddt_in.data(),
                             rst.data(), o_row.data(), dsh.data(), ddt_raw.data(), ddt_h.data(), ld_ddt,
                             da_part.data(), T, H, nc, nbc);
        });
        emu_launch({blocks(H), 1, 1}, 256, 0, [&] {
            mamba_ssd_dalog(da_part.data(), fal.data(), da_log.data(), H, nbc);
        });
        // bf16 runs keep the scan's inputs x, B, C, dy and the entry states
        // and their gradients in bf16 (the _h kernels): each _h kernel gives
        // the bits of its f32 twin fed the bf16 rounding of what it reads
        // (x, B, C, dy, and the states the _h state scan stored: the
        // rounding of the f32 scan's states of the rounded inputs), compared
        // bit for bit
        // (C B^T, the entry states and their gradients, y, the gate, the Q x
        // Q outputs, d x, d B, d C and the dot terms), and is within bf16's
        // tolerance of the oracle.
        long long states_bad = 0;
        std::vector<float> yh_st((size_t)M * E, nan), dxbc_h((size_t)M * ldu, nan);
        if (EMU_TC) {
            auto rne = [](const std::vector<float>& v) {
                std::vector<unsigned short> r(v.size());
                for (size_t i = 0; i < v.size(); ++i) r[i] = (unsigned short)mamba::bf16_rne(v[i]);
                return r;
            };
            auto widen = [](const std::vector<unsigned short>& v) {
                std::vector<float> r(v.size());
                for (size_t i = 0; i < v.size(); ++i) r[i] = mamba::bf16_to_f32(v[i]);
                return r;
            };
            auto differ = [](const std::vector<float>& a, const std::vector<float>& b) {
                return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0;
            };
            const auto fxh = rne(fx), fdyh = rne(fdy);
            const auto fxw = widen(fxh), fdyw = widen(fdyh);
            auto states_h = [&](std::vector<unsigned short>& out, const unsigned short* Xh,
                                long long ldx, int y_off, int mode) {
                emu_launch({(unsigned)B, (unsigned)H, (unsigned)tiles_state}, kThreads,
                           kStateScanSmemFloats, [&] {
                    mamba_ssd_state_scan_tc_h(Xh, ldx, fxh.data(), ldu, y_off, fdt.data(),
                                              s.data(), out.data(), T, H, P, N, hpg, nc, mode);
                });
            };
            std::vector<float> stw_f(st_len, nan), dstw_f(st_len, nan);
            states(stw_f, fxw.data(), ldu, fxw.data(), b_off, 0);
            states(dstw_f, fdyw.data(), E, fxw.data(), c_off, 1);
            std::vector<unsigned short> sth(st_len, 0xffff), dsth(st_len, 0xffff);
            states_h(sth, fxh.data(), ldu, b_off, 0);
            states_bad += sth != rne(stw_f);
            states_h(dsth, fdyh.data(), E, c_off, 1);
            states_bad += dsth != rne(dstw_f);
            const auto stw = widen(sth), dstw = widen(dsth);
            std::vector<float> cbw(psum_len, nan), cbh(psum_len, nan);
            emu_launch({(unsigned)nbc, (unsigned)G, 1}, kThreads, 0, [&] {
                mamba_ssd_cb_tc(fxw.data(), ldu, b_off, c_off, cbw.data(), T, N, nc);
            });
            emu_launch({(unsigned)nbc, (unsigned)G, 1}, kThreads, 0, [&] {
                mamba_ssd_cb_tc_h(fxh.data(), ldu, b_off, c_off, cbh.data(), T, N, nc);
            });
            states_bad += differ(cbw, cbh);
            std::vector<float> ya((size_t)M * E, nan), ga((size_t)M * E, nan),
                gb((size_t)M * E, nan);
            emu_launch({(unsigned)nbc, (unsigned)H, 1}, kThreads, kStagedSmemFloats, [&] {
                mamba_ssd_chunk_out_tc(fxw.data(), ldu, b_off, c_off, fdt.data(), s.data(),
                                       fdp.data(), stw.data(), fz.data(), nullptr, ldz,
                                       ya.data(), nullptr, ga.data(), nullptr, T, H, P, N, hpg,
                                       nc, cbw.data());
            });
            emu_launch({(unsigned)nbc, (unsigned)H, 1}, kThreads, kStagedSmemFloats, [&] {
                mamba_ssd_chunk_out_tc_h(fxh.data(), ldu, b_off, c_off, fdt.data(), s.data(),
                                         fdp.data(), sth.data(), fz.data(), nullptr, ldz,
                                         yh_st.data(), nullptr, gb.data(), nullptr, T, H, P, N,
                                         hpg, nc, cbh.data());
            });
            states_bad += differ(ya, yh_st) || differ(ga, gb);
            std::vector<float> mqa(qq_len, nan), mqb(qq_len, nan), pqa(qq_len, nan),
                pqb(qq_len, nan), dia((size_t)M * H, nan), dib((size_t)M * H, nan),
                dta((size_t)M * H, nan), dtb((size_t)M * H, nan);
            emu_launch({(unsigned)nbc, (unsigned)H, 1}, kThreads, 0, [&] {
                mamba_ssd_bwd_qq_tc(fxw.data(), ldu, b_off, c_off, fdt.data(), s.data(),
                                    fdyw.data(), mqa.data(), pqa.data(), dia.data(), dta.data(),
                                    T, H, P, N, hpg, nc, cbw.data());
            });
            emu_launch({(unsigned)nbc, (unsigned)H, 1}, kThreads, 0, [&] {
                mamba_ssd_bwd_qq_tc_h(fxh.data(), ldu, b_off, c_off, fdt.data(), s.data(),
                                      fdyh.data(), mqb.data(), pqb.data(), dib.data(), dtb.data(),
                                      T, H, P, N, hpg, nc, cbh.data());
            });
            states_bad += differ(mqa, mqb) || differ(pqa, pqb) || differ(dia, dib) ||
                          differ(dta, dtb);
            std::vector<float> dxa((size_t)M * ldu, nan), rsa((size_t)M * H, nan),
                rsb((size_t)M * H, nan), ora((size_t)M * H, nan), orb((size_t)M * H, nan),
                dsa((size_t)nbc * H, nan), dsb((size_t)nbc * H, nan);
            emu_launch({(unsigned)nbc, (unsigned)H, 1}, kThreads, kStagedSmemFloats, [&] {
                mamba_ssd_bwd_dx_tc(fxw.data(), ldu, b_off, c_off, fdt.data(), s.data(),
                                    fdp.data(), fdyw.data(), mqa.data(), stw.data(), dstw.data(),
                                    dxa.data(), ldu, rsa.data(), ora.data(), dsa.data(), T, H, P,
                                    N, hpg, nc);
            });
            emu_launch({(unsigned)nbc, (unsigned)H, 1}, kThreads, kStagedSmemFloats, [&] {
                mamba_ssd_bwd_dx_tc_h(fxh.data(), ldu, b_off, c_off, fdt.data(), s.data(),
                                      fdp.data(), fdyh.data(), mqb.data(), sth.data(),
                                      dsth.data(), dxbc_h.data(), ldu, rsb.data(), orb.data(),
                                      dsb.data(), T, H, P, N, hpg, nc);
            });
            // The psum kernel's sums of the Pq just compared equal.
            std::vector<float> psw(psum_len, nan);
            emu_launch({blocks(psum_len), 1, 1}, 256, 0, [&] {
                mamba_ssd_bwd_psum(pqa.data(), psw.data(), H, hpg, psum_len);
            });
            emu_launch({(unsigned)nbc, (unsigned)G, (unsigned)(2 * ntn)}, kThreads, 0, [&] {
                mamba_ssd_bwd_dbc_tc(fxw.data(), ldu, b_off, c_off, fdt.data(), s.data(),
                                     fdyw.data(), psw.data(), stw.data(), dstw.data(),
                                     dxa.data(), ldu, T, H, P, N, hpg, nc);
            });
            emu_launch({(unsigned)nbc, (unsigned)G, (unsigned)(2 * ntn)}, kThreads, 0, [&] {
                mamba_ssd_bwd_dbc_tc_h(fxh.data(), ldu, b_off, c_off, fdt.data(), s.data(),
                                       fdyh.data(), psw.data(), sth.data(), dsth.data(),
                                       dxbc_h.data(), ldu, T, H, P, N, hpg, nc);
            });
            // NaN != NaN under memcmp too only when the bits differ: the
            // columns neither kernel writes hold the same NaN in both.
            states_bad += differ(dxa, dxbc_h) || differ(rsa, rsb) || differ(ora, orb) ||
                          differ(dsa, dsb);
        }
        // Compare.
        std::vector<float> gdx, gdb, gdc, gddt;
        for (int m = 0; m < M; ++m) {
            for (int e = 0; e < E; ++e) gdx.push_back(dxbc[(size_t)m * ldu + e]);
            for (int j = 0; j < G * N; ++j) {
                gdb.push_back(dxbc[(size_t)m * ldu + b_off + j]);
                gdc.push_back(dxbc[(size_t)m * ldu + c_off + j]);
            }
            for (int h = 0; h < H; ++h) gddt.push_back(ddt_raw[(size_t)m * ld_ddt + h]);
        }
        printf("B %d T %d H %d P %d N %d G %d (chunks %d):", B, T, H, P, N, G, nc);
        for (int m = 0; m < M; ++m)
            for (int h = 0; h < H; ++h) {
                const size_t i = (size_t)m * ld_ddt + h;
                half_bad += ddt_h[i] != (unsigned short)mamba::bf16_rne(ddt_raw[i]);
            }
        printf(" bf16-acts %s", half_bad ? "FAIL" : "ok");
        fails += half_bad != 0;
        if (EMU_TC) {
            // The bf16 kernels' own error against the oracle: y, d x, d B, d C
            // of the _h kernels (2^-9 relative per kept value).
            std::vector<float> hdx, hdb, hdc;
            for (int m = 0; m < M; ++m) {
                for (int e = 0; e < E; ++e) hdx.push_back(dxbc_h[(size_t)m * ldu + e]);
                for (int j = 0; j < G * N; ++j) {
                    hdb.push_back(dxbc_h[(size_t)m * ldu + b_off + j]);
                    hdc.push_back(dxbc_h[(size_t)m * ldu + c_off + j]);
                }
            }
            const double ey_h = rel_l2(yh_st, ey), edx_h = rel_l2(hdx, edx),
                         edb_h = rel_l2(hdb, edb), edc_h = rel_l2(hdc, edc);
            const bool tol_bad = !(ey_h <= kTolStatesH && edx_h <= kTolStatesH &&
                                   edb_h <= kTolStatesH && edc_h <= kTolStatesH);
            printf(" bf16-kept %s (y %.1e dx %.1e dB %.1e dC %.1e)",
                   states_bad ? "FAIL(bits)" : tol_bad ? "FAIL(tolerance)" : "ok", ey_h, edx_h,
                   edb_h, edc_h);
            fails += states_bad != 0 || tol_bad;
        }
        fails += report({{"y", rel_l2(y, ey), kTolFwd},
                         {"gate", rel_l2(gate, egate), kTolFwd},
                         {"dx", rel_l2(gdx, edx), kTolBwd},
                         {"dB", rel_l2(gdb, edb), kTolBwd},
                         {"dC", rel_l2(gdc, edc), kTolBwd},
                         {"ddt_raw", rel_l2(gddt, eddt), kTolBwd},
                         {"dA_log", rel_l2(da_log, eda), kTolBwd}},
                        {&y, &gate, &gdx, &gdb, &gdc, &gddt, &da_log});
    }
    printf("%s\n", fails ? "FAILED" : "all within tolerance");
    return fails ? 1 : 0;
}

//! The fused backward kernels on the GPU, each against what it replaced:
//! - `MambaKernels::conv_bwd` (the conv's backward through SiLU in one
//!   pass) against the backward in f64 written from the equations, at every
//!   width the kernels take, x in f32 or kept in bf16, dx written as f32,
//!   bf16 or both, into a wider matrix; the same bits run to run; and a
//!   negative control (the same comparison with one weight moved fails);
//! - `MambaKernels::gated_norm_bwd` (Mamba-2's gated RMSNorm backward and
//!   the gate's in one pass) against `rmsnorm_bwd` into an f32 gradient then
//!   `gate_bwd`, bit for bit: the fusion promises those kernels' bits on the
//!   device itself, where the compiler's FMA contraction could differ.
//!
//! The emulated checks (`kernels/emu/conv_check.cpp`,
//! `gated_norm_check.cpp`) pin the same kernels' logic on every machine;
//! these pin the compiled device code. They skip, printing why, without a
//! GPU.

mod cuda_common;

use cuda_common::{kernels_on_device0, rel_l2};
use kernels::mamba::cast::f32_to_bf16_rne;
use kernels::mamba::{MambaKernels, Store, Stored};
use mamba_train::seed::Rng;

fn uniform(r: &mut Rng, n: usize, lo: f64, hi: f64) -> Vec<f32> {
    (0..n)
        .map(|_| (lo + (hi - lo) * r.next_f64()) as f32)
        .collect()
}

/// bf16 bits by truncation (any bf16 will do as an input) and the f32
/// each widens to.
fn to_bf16(v: &[f32]) -> (Vec<u16>, Vec<f32>) {
    let h: Vec<u16> = v.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
    let w = h
        .iter()
        .map(|&b| f32::from_bits(u32::from(b) << 16))
        .collect();
    (h, w)
}

fn bf16_value(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// The conv backward in f64 from the equations: dx `[m, d]`, dw `[d, k]`,
/// db `[d]`, for x `[m, ldx]` (its first d columns), du `[m, d]`.
#[allow(clippy::too_many_arguments)]
fn conv_bwd_f64(
    x: &[f32],
    ldx: usize,
    du: &[f32],
    w: &[f32],
    b: &[f32],
    t_len: usize,
    d: usize,
    k: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let m = du.len() / d;
    let mut dpre = vec![0.0f64; m * d];
    for c in 0..d {
        for row in 0..m {
            let t = row % t_len;
            let mut pre = b[c] as f64;
            for j in 0..k {
                let back = k - 1 - j;
                if t >= back {
                    pre += w[c * k + j] as f64 * x[(row - back) * ldx + c] as f64;
                }
            }
            let s = 1.0 / (1.0 + (-pre).exp());
            dpre[row * d + c] = du[row * d + c] as f64 * s * (1.0 + pre * (1.0 - s));
        }
    }
    let (mut dx, mut dw, mut db) = (vec![0.0; m * d], vec![0.0; d * k], vec![0.0; d]);
    for c in 0..d {
        for row in 0..m {
            let t = row % t_len;
            let g = dpre[row * d + c];
            for j in 0..k {
                let back = k - 1 - j;
                if t >= back {
                    dw[c * k + j] += g * x[(row - back) * ldx + c] as f64;
                }
                if t + back < t_len {
                    dx[row * d + c] += w[c * k + j] as f64 * dpre[(row + back) * d + c];
                }
            }
            db[c] += g;
        }
    }
    (dx, dw, db)
}

#[test]
fn conv_backward_matches_f64_at_every_width_and_repeats_its_bits() {
    let Some((ctx, kr)) = kernels_on_device0() else {
        return;
    };
    let s = ctx.default_stream();
    let mut r = Rng::new(7);
    // (sequences, length, channels, extra x columns); lengths below and
    // past the taps, row counts that end a 256-row slab inside a tile.
    let shapes = [
        (2, 37, 5, 0),
        (1, 300, 33, 7),
        (3, 2, 40, 0),
        (2, 260, 70, 10),
    ];
    for k in 1..=8usize {
        for (i, &(b, t_len, d, pad)) in shapes.iter().enumerate() {
            let (m, ldx, ldo) = (b * t_len, d + pad, d + 3);
            let half = (k + i) % 2 == 1;
            let x = uniform(&mut r, m * ldx, -2.0, 2.0);
            let (xh, xw) = to_bf16(&x);
            let x_read = if half { xw } else { x.clone() };
            let du = uniform(&mut r, m * d, -1.0, 1.0);
            let w = uniform(&mut r, d * k, -0.7, 0.7);
            let bias = uniform(&mut r, d, -0.5, 0.5);
            let (edx, edw, edb) = conv_bwd_f64(&x_read, ldx, &du, &w, &bias, t_len, d, k);
            let d_x = s.clone_htod(&x).unwrap();
            let d_xh = s.clone_htod(&xh).unwrap();
            let (d_du, d_w, d_b) = (
                s.clone_htod(&du).unwrap(),
                s.clone_htod(&w).unwrap(),
                s.clone_htod(&bias).unwrap(),
            );
            let run = || -> (Vec<f32>, Vec<u16>, Vec<f32>) {
                let mut dx = s.alloc_zeros::<f32>(m * ldo).unwrap();
                let mut dx_h = s.alloc_zeros::<u16>(m * ldo).unwrap();
                let mut scratch = s
                    .alloc_zeros::<f32>(MambaKernels::conv_wgrad_scratch_len(m, d, k))
                    .unwrap();
                let mut dw_db = s.alloc_zeros::<f32>(d * k + d).unwrap();
                let (xv, xhv) = (d_x.as_view(), d_xh.as_view());
                let stored = if half {
                    Stored::Bf16(&xhv)
                } else {
                    Stored::F32(&xv)
                };
                kr.conv_bwd(
                    &s,
                    stored,
                    ldx,
                    &d_w.as_view(),
                    &d_b.as_view(),
                    &d_du.as_view(),
                    Store::Both(dx.as_view_mut(), dx_h.as_view_mut()),
                    ldo,
                    &mut scratch.as_view_mut(),
                    &mut dw_db.as_view_mut(),
                    m,
                    t_len,
                    d,
                    k,
                )
                .expect("conv_bwd");
                (
                    s.clone_dtoh(&dx).unwrap(),
                    s.clone_dtoh(&dx_h).unwrap(),
                    s.clone_dtoh(&dw_db).unwrap(),
                )
            };
            let (dx, dx_h, dw_db) = run();
            let dx_f: Vec<f32> = (0..m * d).map(|e| dx[e / d * ldo + e % d]).collect();
            let what = format!("K {k}, {b} x {t_len}, d {d}, x in bf16 {half}");
            for (name, got, want) in [
                ("dx", &dx_f[..], &edx),
                ("dw", &dw_db[..d * k], &edw),
                ("db", &dw_db[d * k..], &edb),
            ] {
                let (err, bad) = rel_l2(got, want);
                assert!(!bad && err < 1e-5, "{what}: {name} error {err:.2e}");
            }
            // The bf16 copy is the f32 value's rounding (the host twin of
            // the kernels' rounding, bit for bit), and the padding columns
            // were not written.
            for e in 0..m * ldo {
                let (row, col) = (e / ldo, e % ldo);
                if col >= d {
                    assert!(dx[e] == 0.0 && dx_h[e] == 0, "{what}: wrote column {col}");
                    continue;
                }
                assert_eq!(
                    dx_h[e],
                    f32_to_bf16_rne(dx[e]),
                    "{what}: dx[{row}, {col}] {} kept in bf16 as {}",
                    dx[e],
                    bf16_value(dx_h[e])
                );
            }
            assert_eq!(
                run(),
                (dx.clone(), dx_h, dw_db.clone()),
                "{what}: a second run gave other bits"
            );
            // Negative control: the same comparison against the oracle of
            // one moved weight must fail. The moved weight is channel 0's
            // last tap, the one on the current token, which every row reads
            // (an earlier tap reads only padding when T < K: moving it
            // changes nothing, which the GPU run of 2026-12-07 caught).
            let mut moved = w.clone();
            moved[k - 1] += 0.25;
            let (edx2, edw2, _) = conv_bwd_f64(&x_read, ldx, &du, &moved, &bias, t_len, d, k);
            for (name, got, want) in [("dx", &dx_f[..], &edx2), ("dw", &dw_db[..d * k], &edw2)] {
                let (err, _) = rel_l2(got, want);
                assert!(
                    err > 1e-4,
                    "{what}: a moved weight went unnoticed in {name} ({err:.2e})"
                );
            }
        }
    }
}

#[test]
fn gated_norm_backward_gives_the_bits_of_rmsnorm_bwd_then_gate_bwd() {
    let Some((ctx, kr)) = kernels_on_device0() else {
        return;
    };
    let s = ctx.default_stream();
    let mut r = Rng::new(11);
    for &(rows, d, pad, half) in &[(37, 200, 5, false), (9, 1536, 1816, true), (8, 31, 0, true)] {
        let ldz = d + pad;
        let dgn = uniform(&mut r, rows * d, -1.0, 1.0);
        let w = uniform(&mut r, d, 0.5, 1.5);
        let rstd = uniform(&mut r, rows, 0.5, 2.0);
        let inputs = [
            uniform(&mut r, rows * d, -2.0, 2.0),
            uniform(&mut r, rows * d, -2.0, 2.0),
            uniform(&mut r, rows * ldz, -3.0, 3.0),
        ];
        let f: Vec<_> = inputs.iter().map(|v| s.clone_htod(v).unwrap()).collect();
        let h: Vec<_> = inputs
            .iter()
            .map(|v| s.clone_htod(&to_bf16(v).0).unwrap())
            .collect();
        let (fv, hv): (Vec<_>, Vec<_>) = (
            f.iter().map(|b| b.as_view()).collect(),
            h.iter().map(|b| b.as_view()).collect(),
        );
        let kept = |i: usize| {
            if half {
                Stored::Bf16(&hv[i])
            } else {
                Stored::F32(&fv[i])
            }
        };
        let (d_dgn, d_w, d_rstd) = (
            s.clone_htod(&dgn).unwrap(),
            s.clone_htod(&w).unwrap(),
            s.clone_htod(&rstd).unwrap(),
        );
        let outputs = |dy: &cudarc::driver::CudaSlice<f32>,
                       dz: &cudarc::driver::CudaSlice<f32>,
                       dz_h: &cudarc::driver::CudaSlice<u16>| {
            let mut bits: Vec<u32> = s
                .clone_dtoh(dy)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            bits.extend(s.clone_dtoh(dz).unwrap().iter().map(|v| v.to_bits()));
            bits.extend(s.clone_dtoh(dz_h).unwrap().iter().map(|&v| u32::from(v)));
            bits
        };
        // dy, dz and dz's bf16 copy, zeroed.
        let zeroed_outputs = || {
            (
                s.alloc_zeros::<f32>(rows * d).unwrap(),
                s.alloc_zeros::<f32>(rows * ldz).unwrap(),
                s.alloc_zeros::<u16>(rows * ldz).unwrap(),
            )
        };
        // The two kernels, as the model ran them before the fusion.
        let mut dg = s.alloc_zeros::<f32>(rows * d).unwrap();
        let mut g_out = s.alloc_zeros::<f32>(rows * d).unwrap();
        let (mut dy2, mut dz2, mut dz2_h) = zeroed_outputs();
        kr.rmsnorm_bwd(
            &s,
            &d_dgn.as_view(),
            kept(0),
            &d_w.as_view(),
            &d_rstd.as_view(),
            Store::F32(dg.as_view_mut()),
            rows,
            d,
            false,
        )
        .expect("rmsnorm_bwd");
        kr.gate_bwd(
            &s,
            &dg.as_view(),
            kept(1),
            kept(2),
            ldz,
            &mut dy2.as_view_mut(),
            Store::Both(dz2.as_view_mut(), dz2_h.as_view_mut()),
            Store::F32(g_out.as_view_mut()),
            rows,
            d,
        )
        .expect("gate_bwd");
        let pair = outputs(&dy2, &dz2, &dz2_h);
        // The fused kernel.
        let (mut dy, mut dz, mut dz_h) = zeroed_outputs();
        let mut dy_h = s.alloc_zeros::<u16>(rows * d).unwrap();
        kr.gated_norm_bwd(
            &s,
            &d_dgn.as_view(),
            kept(0),
            &d_w.as_view(),
            &d_rstd.as_view(),
            kept(1),
            kept(2),
            ldz,
            Store::Both(dy.as_view_mut(), dy_h.as_view_mut()),
            Store::Both(dz.as_view_mut(), dz_h.as_view_mut()),
            rows,
            d,
        )
        .expect("gated_norm_bwd");
        let fused = outputs(&dy, &dz, &dz_h);
        assert!(
            fused[..rows * d].iter().any(|&b| b != 0),
            "rows {rows}, d {d}: all-zero dy"
        );
        assert_eq!(
            fused, pair,
            "rows {rows}, d {d}, bf16 inputs {half}: the fused kernel's bits differ from the two kernels'"
        );
        // dy's bf16 copy (Mamba-2's bf16 runs keep dy so) is its rounding.
        let want_h: Vec<u16> = s
            .clone_dtoh(&dy2)
            .unwrap()
            .iter()
            .map(|&v| kernels::mamba::f32_to_bf16_rne(v))
            .collect();
        assert_eq!(
            s.clone_dtoh(&dy_h).unwrap(),
            want_h,
            "rows {rows}, d {d}, bf16 inputs {half}: dy's bf16 copy"
        );
    }
}

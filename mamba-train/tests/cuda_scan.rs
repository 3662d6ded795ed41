//! The selective-scan kernels alone, on the GPU, against a naive sequential
//! f64 scan written here from the equations (so a scan bug is reported as
//! one, not as a model-level gradient mismatch). Skips (printing why) without
//! a GPU unless `MAMBA_REQUIRE_GPU=1`.
//!
//! Tolerance: relative L2 2e-6 for y and out, 1e-5 for every gradient (f32
//! rounding of the same recurrence, and the fixed-order sums over states,
//! channels and time in another association than the f64 loop's).

mod cuda_common;

use std::sync::Arc;

use cuda_common::{gpu_required, no_gpu_reason, rel_l2};
use cudarc::driver::{CudaSlice, CudaStream};
use kernels::mamba::{
    bf16_to_f32, f32_to_bf16_rne, MambaKernels, ScanBackward, ScanForward, ScanInputs, ScanShape,
    Store, Stored, SEGMENT_CHUNKS,
};
use mamba_train::seed::Rng;

fn device() -> Option<(Arc<CudaStream>, MambaKernels)> {
    if let Some(reason) = no_gpu_reason() {
        assert!(!gpu_required(), "MAMBA_REQUIRE_GPU=1 but {reason}");
        eprintln!("skipping: {reason}");
        return None;
    }
    let ctx = kernels::open_context(0).expect("open device 0");
    let k = MambaKernels::load(&ctx).expect("load the Mamba kernels");
    Some((ctx.default_stream(), k))
}

struct Case {
    b: usize,
    t: usize,
    d: usize,
    n: usize,
    r: usize,
}

/// Inputs in f64 (exactly the f32 values uploaded).
struct Inputs {
    u: Vec<f64>,
    dt: Vec<f64>,
    dbc: Vec<f64>,
    a_log: Vec<f64>,
    dp: Vec<f64>,
    xz: Vec<f64>,
    dy: Vec<f64>,
}

struct Expected {
    y: Vec<f64>,
    out: Vec<f64>,
    ddtr: Vec<f64>,
    du: Vec<f64>,
    dbc: Vec<f64>,
    da_log: Vec<f64>,
}

fn naive(c: &Case, x: &Inputs) -> Expected {
    let (m, d, n, r) = (c.b * c.t, c.d, c.n, c.r);
    let ld = r + 2 * n;
    let (bv, cv) = (
        |mm: usize, j: usize| x.dbc[mm * ld + r + j],
        |mm: usize, j: usize| x.dbc[mm * ld + r + n + j],
    );
    let mut e = Expected {
        y: vec![0.0; m * d],
        out: vec![0.0; m * d],
        ddtr: vec![0.0; m * d],
        du: vec![0.0; m * d],
        dbc: vec![0.0; m * 2 * n],
        da_log: vec![0.0; d * n],
    };
    for b in 0..c.b {
        for ch in 0..d {
            let mut hs = vec![0.0f64; (c.t + 1) * n];
            for s in 0..n {
                let a = -x.a_log[ch * n + s].exp();
                let mut h = 0.0;
                for t in 0..c.t {
                    let mm = b * c.t + t;
                    h = (x.dt[mm * d + ch] * a).exp() * h
                        + x.dt[mm * d + ch] * bv(mm, s) * x.u[mm * d + ch];
                    hs[(t + 1) * n + s] = h;
                    e.y[mm * d + ch] += cv(mm, s) * h;
                }
            }
            for t in 0..c.t {
                let mm = b * c.t + t;
                e.y[mm * d + ch] += x.dp[ch] * x.u[mm * d + ch];
                let z = x.xz[mm * 2 * d + d + ch];
                e.out[mm * d + ch] = e.y[mm * d + ch] * z / (1.0 + (-z).exp());
            }
            for s in 0..n {
                let a = -x.a_log[ch * n + s].exp();
                let mut carry = 0.0;
                for t in (0..c.t).rev() {
                    let mm = b * c.t + t;
                    let (dtv, uv, dyv) = (x.dt[mm * d + ch], x.u[mm * d + ch], x.dy[mm * d + ch]);
                    let at = (dtv * a).exp();
                    let g = cv(mm, s) * dyv + carry;
                    let hp = hs[t * n + s];
                    e.dbc[mm * 2 * n + n + s] += dyv * hs[(t + 1) * n + s];
                    e.dbc[mm * 2 * n + s] += g * dtv * uv;
                    e.ddtr[mm * d + ch] += g * (a * at * hp + bv(mm, s) * uv);
                    e.du[mm * d + ch] += g * dtv * bv(mm, s);
                    e.da_log[ch * n + s] += g * at * hp * dtv * a;
                    carry = at * g;
                }
            }
            for t in 0..c.t {
                let mm = b * c.t + t;
                e.du[mm * d + ch] += x.dp[ch] * x.dy[mm * d + ch];
                e.ddtr[mm * d + ch] *= -(-x.dt[mm * d + ch]).exp_m1();
            }
        }
    }
    e
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

#[test]
fn chunked_scan_matches_a_sequential_f64_scan() {
    let cases = [
        Case {
            b: 1,
            t: 1,
            d: 1,
            n: 1,
            r: 1,
        },
        Case {
            b: 2,
            t: 37,
            d: 5,
            n: 16,
            r: 3,
        },
        Case {
            b: 1,
            t: 16,
            d: 9,
            n: 64,
            r: 2,
        },
        Case {
            b: 3,
            t: 33,
            d: 40,
            n: 7,
            r: 4,
        },
        Case {
            b: 1,
            t: 50,
            d: 3,
            n: 33,
            r: 1,
        },
        Case {
            b: 2,
            t: 17,
            d: 130,
            n: 2,
            r: 5,
        },
        Case {
            b: 1,
            t: 70,
            d: 600,
            n: 16,
            r: 3,
        }, // 19 channel groups
        Case {
            b: 1,
            t: 20,
            d: 300,
            n: 128,
            r: 2,
        }, // 32 lanes a channel, 75 channel sets: two backward rounds
        Case {
            b: 2,
            t: 33,
            d: 70,
            n: 9,
            r: 3,
        }, // four lanes: the third has one live state, the fourth none
        Case {
            b: 1,
            t: 9,
            d: 4,
            n: 128,
            r: 2,
        },
        Case {
            b: 2,
            t: 300,
            d: 3,
            n: 5,
            r: 2,
        }, // 19 chunks
        Case {
            b: 2,
            t: 2100,
            d: 40,
            n: 16,
            r: 3,
        }, // 132 chunks: three time segments (64, 64, 4 chunks), the last ragged
    ];
    let Some((s, k)) = device() else { return };
    let mut failures = Vec::new();
    // The segmented walk is covered: some case has several time segments.
    assert!(
        cases.iter().any(|c| ScanShape {
            batch: c.b,
            seq_len: c.t,
            d_inner: c.d,
            d_state: c.n,
        }
        .segments()
            > 1),
        "no case exceeds one segment of {SEGMENT_CHUNKS} chunks"
    );
    for (ci, c) in cases.iter().enumerate() {
        let (m, d, n, r) = (c.b * c.t, c.d, c.n, c.r);
        let ld = r + 2 * n;
        let mut rng = Rng::new(ci as u64 + 1);
        let mut uni = |lo: f64, hi: f64, len: usize| -> Vec<f64> {
            (0..len)
                .map(|_| (lo + (hi - lo) * rng.next_f64()) as f32 as f64)
                .collect()
        };
        let x = Inputs {
            u: uni(-1.0, 1.0, m * d),
            dt: uni(0.001, 0.6, m * d),
            dbc: uni(-1.0, 1.0, m * ld),
            a_log: (0..d * n)
                .map(|i| (((i % n) + 1) as f64).ln() as f32 as f64)
                .collect(),
            dp: uni(0.5, 1.5, d),
            xz: uni(-2.0, 2.0, m * 2 * d),
            dy: uni(-1.0, 1.0, m * d),
        };
        let want = naive(c, &x);
        let shape = ScanShape {
            batch: c.b,
            seq_len: c.t,
            d_inner: d,
            d_state: n,
        };
        let up = |v: &[f64]| s.clone_htod(&f32s(v)).expect("upload");
        let nan = |len: usize| s.clone_htod(&vec![f32::NAN; len.max(1)]).expect("alloc");
        let (u, dt, dbc, a_log, dp, xz, dy) = (
            up(&x.u),
            up(&x.dt),
            up(&x.dbc),
            up(&x.a_log),
            up(&x.dp),
            up(&x.xz),
            up(&x.dy),
        );
        let sl = shape.state_len();
        let (mut da_part, mut hin) = (nan(shape.da_partial_len()), nan(sl));
        let (mut y, mut out) = (nan(m * d), nan(m * d));
        let mut seg = nan(shape.segment_scratch_len());
        // The bf16 copies the kernels store beside out and ddt_raw (0xffff,
        // a NaN pattern the rounding never yields, where nothing is written).
        let unwritten = |len: usize| s.clone_htod(&vec![0xffffu16; len.max(1)]).expect("alloc");
        let (mut out_h, mut ddtr_h) = (unwritten(m * d), unwritten(m * d));
        let (uv, dtv, bc, alv, dpv) = (
            u.as_view(),
            dt.as_view(),
            dbc.slice(r..),
            a_log.as_view(),
            dp.as_view(),
        );
        let inp = ScanInputs {
            u: Stored::F32(&uv),
            dt: Stored::F32(&dtv),
            bc: &bc,
            ldbc: ld,
            a_log: &alv,
            d: &dpv,
        };
        let zv = xz.slice(d..);
        k.scan_forward(
            &s,
            shape,
            inp,
            ScanForward {
                z: Stored::F32(&zv),
                ldz: 2 * d,
                hin: &mut hin.as_view_mut(),
                y: Store::F32(y.as_view_mut()),
                out: Store::Both(out.as_view_mut(), out_h.as_view_mut()),
                scratch_seg: &mut seg.as_view_mut(),
            },
        )
        .expect("scan_forward");
        let mut dbc_part = nan(shape.dbc_partial_len());
        let (mut ddtr, mut du, mut ddbc, mut da) =
            (nan(m * d), nan(m * d), nan(m * ld), nan(d * n));
        k.scan_backward(
            &s,
            shape,
            inp,
            ScanBackward {
                dy: &dy.as_view(),
                hin: &hin.as_view(),
                scratch_da: &mut da_part.as_view_mut(),
                scratch_dbc: &mut dbc_part.as_view_mut(),
                scratch_seg: &mut seg.as_view_mut(),
                ddt_raw: Store::Both(ddtr.as_view_mut(), ddtr_h.as_view_mut()),
                du: &mut du.as_view_mut(),
                dbc: &mut ddbc.slice_mut(r..),
                da_log: &mut da.as_view_mut(),
            },
        )
        .expect("scan_backward");
        let host = |v: &CudaSlice<f32>| s.clone_dtoh(v).expect("download");
        let ddbc_h = host(&ddbc);
        let ddbc_cols: Vec<f32> = (0..m)
            .flat_map(|mm| ddbc_h[mm * ld + r..mm * ld + ld].to_vec())
            .collect();
        let label = format!(
            "batch {} T {} d_inner {} d_state {} dt_rank {}",
            c.b, c.t, d, n, r
        );
        // Each stored bf16 copy is its f32 value's cast, bit for bit.
        for (what, f, h) in [("out", &out, &out_h), ("ddt_raw", &ddtr, &ddtr_h)] {
            let (f, h) = (host(f), s.clone_dtoh(h).expect("download"));
            let bad = f
                .iter()
                .zip(&h)
                .filter(|(x, b)| f32_to_bf16_rne(**x) != **b)
                .count();
            if bad > 0 {
                failures.push(format!(
                    "{label}: {bad} of {} elements of {what}'s bf16 copy are not its cast",
                    h.len()
                ));
            }
        }
        for (what, got, want, tol) in [
            ("y", host(&y), &want.y, 2e-6),
            ("out", host(&out), &want.out, 2e-6),
            ("ddt_raw", host(&ddtr), &want.ddtr, 1e-5),
            ("du", host(&du), &want.du, 1e-5),
            ("dB|dC", ddbc_cols, &want.dbc, 1e-5),
            ("dA_log", host(&da), &want.da_log, 1e-5),
        ] {
            let (err, bad) = rel_l2(&got, want);
            eprintln!("{label}: {what} rel err {err:.2e}");
            if bad || err > tol || err.is_nan() {
                failures.push(format!(
                    "{label}: {what} relative error {err:.3e} > {tol:.0e}{}",
                    if bad {
                        " (non-finite: unwritten element?)"
                    } else {
                        ""
                    }
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "scan kernels disagree with the sequential scan:\n{}",
        failures.join("\n")
    );
}

#[test]
fn scan_launchers_refuse_short_buffers() {
    let Some((s, k)) = device() else { return };
    let shape = ScanShape {
        batch: 1,
        seq_len: 20,
        d_inner: 4,
        d_state: 16,
    };
    let z = |len: usize| s.alloc_zeros::<f32>(len).expect("alloc");
    let (u, dt, bc, a, dp, zz) = (z(80), z(79), z(20 * 34), z(64), z(4), z(160));
    let (mut hin, mut y, mut out) = (z(128), z(80), z(80));
    let (uv, dtv, bcv, av, dpv) = (
        u.as_view(),
        dt.as_view(),
        bc.as_view(),
        a.as_view(),
        dp.as_view(),
    );
    let zv = zz.slice(4..);
    let err = k
        .scan_forward(
            &s,
            shape,
            ScanInputs {
                u: Stored::F32(&uv),
                dt: Stored::F32(&dtv),
                bc: &bcv,
                ldbc: 34,
                a_log: &av,
                d: &dpv,
            },
            ScanForward {
                z: Stored::F32(&zv),
                ldz: 8,
                hin: &mut hin.as_view_mut(),
                y: Store::F32(y.as_view_mut()),
                out: Store::F32(out.as_view_mut()),
                scratch_seg: &mut z(1).as_view_mut(),
            },
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("dt has 79 elements, needs 80"), "{err}");
}

/// Every output of one forward + backward scan, as bits (y in f32 or, when
/// the scan wrote it in bf16 alone, its bf16 values widened).
#[derive(PartialEq, Debug)]
struct ScanBits {
    hin: Vec<u32>,
    y: Vec<u32>,
    out: Vec<u32>,
    ddtr: Vec<u32>,
    du: Vec<u32>,
    ddbc: Vec<u32>,
    da: Vec<u32>,
}

/// The scan inputs besides u and dt: x_proj's output, A_log, D, in_proj's
/// output (for z) and dy.
type OtherInputs<'a> = (&'a [f32], &'a [f32], &'a [f32], &'a [f32], &'a [f32]);

/// Run both scan directions over `u` and `dt` (f32 values, all exactly
/// bf16 numbers) uploaded as f32 (`half` false) or as bf16 alone with y
/// written in bf16 alone (`half` true).
#[allow(clippy::too_many_arguments)]
fn run_scan(
    s: &Arc<CudaStream>,
    k: &MambaKernels,
    shape: ScanShape,
    r: usize,
    u: &[f32],
    dt: &[f32],
    rest: OtherInputs<'_>,
    half: bool,
) -> ScanBits {
    let (dbc, a_log, dp, xz, dy) = rest;
    let (m, d, n) = (shape.rows(), shape.d_inner, shape.d_state);
    let ld = r + 2 * n;
    let up = |v: &[f32]| s.clone_htod(v).expect("upload");
    let nan = |len: usize| s.clone_htod(&vec![f32::NAN; len.max(1)]).expect("alloc");
    let halves = |v: &[f32]| {
        let h: Vec<u16> = v.iter().map(|x| f32_to_bf16_rne(*x)).collect();
        s.clone_htod(&h).expect("upload")
    };
    let (uf, dtf, uh, dth) = (up(u), up(dt), halves(u), halves(dt));
    let xz_h = halves(xz);
    let (dbc, a_log, dp, xz, dy) = (up(dbc), up(a_log), up(dp), up(xz), up(dy));
    let (zf, zh) = (xz.slice(d..), xz_h.slice(d..));
    let zin = if half {
        Stored::Bf16(&zh)
    } else {
        Stored::F32(&zf)
    };
    let (ufv, dtfv, uhv, dthv) = (uf.as_view(), dtf.as_view(), uh.as_view(), dth.as_view());
    let (bc, alv, dpv) = (dbc.slice(r..), a_log.as_view(), dp.as_view());
    let inp = ScanInputs {
        u: if half {
            Stored::Bf16(&uhv)
        } else {
            Stored::F32(&ufv)
        },
        dt: if half {
            Stored::Bf16(&dthv)
        } else {
            Stored::F32(&dtfv)
        },
        bc: &bc,
        ldbc: ld,
        a_log: &alv,
        d: &dpv,
    };
    let (mut hin, mut y, mut out) = (nan(shape.state_len()), nan(m * d), nan(m * d));
    let mut y_h = s.clone_htod(&vec![0xffffu16; m * d]).expect("alloc");
    let mut seg = nan(shape.segment_scratch_len());
    k.scan_forward(
        s,
        shape,
        inp,
        ScanForward {
            z: zin,
            ldz: 2 * d,
            hin: &mut hin.as_view_mut(),
            y: if half {
                Store::Bf16(y_h.as_view_mut())
            } else {
                Store::F32(y.as_view_mut())
            },
            out: Store::F32(out.as_view_mut()),
            scratch_seg: &mut seg.as_view_mut(),
        },
    )
    .expect("scan_forward");
    // The gate's backward makes the gated output again (the backward pass
    // keeps no copy of it): from the same kept y and z, the same bits.
    let (mut g, mut dy_g, mut dz) = (nan(m * d), nan(m * d), nan(m * 2 * d));
    {
        let (yf, yh) = (y.as_view(), y_h.as_view());
        k.gate_bwd(
            s,
            &dy.as_view(),
            if half {
                Stored::Bf16(&yh)
            } else {
                Stored::F32(&yf)
            },
            zin,
            2 * d,
            &mut dy_g.as_view_mut(),
            Store::F32(dz.slice_mut(d..)),
            Store::F32(g.as_view_mut()),
            m,
            d,
        )
        .expect("gate_bwd");
    }
    let (mut da_part, mut dbc_part) = (nan(shape.da_partial_len()), nan(shape.dbc_partial_len()));
    let (mut ddtr, mut du, mut ddbc, mut da) = (nan(m * d), nan(m * d), nan(m * ld), nan(d * n));
    k.scan_backward(
        s,
        shape,
        inp,
        ScanBackward {
            dy: &dy.as_view(),
            hin: &hin.as_view(),
            scratch_da: &mut da_part.as_view_mut(),
            scratch_dbc: &mut dbc_part.as_view_mut(),
            scratch_seg: &mut seg.as_view_mut(),
            ddt_raw: Store::F32(ddtr.as_view_mut()),
            du: &mut du.as_view_mut(),
            dbc: &mut ddbc.slice_mut(r..),
            da_log: &mut da.as_view_mut(),
        },
    )
    .expect("scan_backward");
    let bits = |v: &CudaSlice<f32>| -> Vec<u32> {
        s.clone_dtoh(v)
            .expect("download")
            .iter()
            .map(|x| x.to_bits())
            .collect()
    };
    assert_eq!(
        bits(&g),
        bits(&out),
        "the gate's backward must remake the scan's gated output bit for bit (bf16 {half})"
    );
    let y = if half {
        let h = s.clone_dtoh(&y_h).expect("download");
        h.iter().map(|b| bf16_to_f32(*b).to_bits()).collect()
    } else {
        bits(&y)
    };
    ScanBits {
        hin: bits(&hin),
        y,
        out: bits(&out),
        ddtr: bits(&ddtr),
        du: bits(&du),
        ddbc: bits(&ddbc),
        da: bits(&da),
    }
}

/// bf16 runs keep u, dt and z in bf16 alone and write y in bf16 alone: the
/// scan staging them as bf16 must give exactly the bits of the f32 scan
/// over the same (bf16-representable) values, and y's bf16 must be the
/// rounding of that scan's y. The gated output is then made from the
/// rounded y (so it differs from the f32 run's); `run_scan` checks that the
/// gate's backward remakes it bit for bit in both runs. Shapes cover every
/// lane count the 130m model does not use, ragged chunks, odd channel-set
/// counts and several time segments; a negative control moves one u by one
/// bf16 step and must change the bits.
#[test]
fn bf16_stored_inputs_give_the_bits_of_the_same_values_in_f32() {
    let Some((s, k)) = device() else { return };
    // (batch, T, d_inner, d_state, dt_rank): d_inner even (a bf16 u / dt
    // needs it).
    let cases = [
        (1, 1, 2, 1, 1),
        (2, 37, 6, 16, 3),
        (1, 50, 130, 33, 2),
        (2, 17, 70, 9, 3),
        (1, 20, 300, 128, 2),
        (2, 2100, 40, 16, 3),
    ];
    for (ci, &(b, t, d, n, r)) in cases.iter().enumerate() {
        let shape = ScanShape {
            batch: b,
            seq_len: t,
            d_inner: d,
            d_state: n,
        };
        let (m, ld) = (b * t, r + 2 * n);
        let mut rng = Rng::new(100 + ci as u64);
        let mut uni = |lo: f32, hi: f32, len: usize, round: bool| -> Vec<f32> {
            (0..len)
                .map(|_| {
                    let x = lo + (hi - lo) * rng.next_f64() as f32;
                    if round {
                        bf16_to_f32(f32_to_bf16_rne(x))
                    } else {
                        x
                    }
                })
                .collect()
        };
        let (u, dt) = (uni(-1.0, 1.0, m * d, true), uni(0.001, 0.6, m * d, true));
        let (dbc, dp) = (uni(-1.0, 1.0, m * ld, false), uni(0.5, 1.5, d, false));
        let (xz, dy) = (
            uni(-2.0, 2.0, m * 2 * d, true),
            uni(-1.0, 1.0, m * d, false),
        );
        let a_log: Vec<f32> = (0..d * n).map(|i| (((i % n) + 1) as f32).ln()).collect();
        let rest = (&dbc[..], &a_log[..], &dp[..], &xz[..], &dy[..]);
        let f32_run = run_scan(&s, &k, shape, r, &u, &dt, rest, false);
        let mut bf16_run = run_scan(&s, &k, shape, r, &u, &dt, rest, true);
        // y: the bf16 run wrote only the rounding of the f32 run's y.
        let y_rounded: Vec<u32> = f32_run
            .y
            .iter()
            .map(|b| bf16_to_f32(f32_to_bf16_rne(f32::from_bits(*b))).to_bits())
            .collect();
        assert_eq!(
            bf16_run.y, y_rounded,
            "case {ci}: y's bf16 is not the f32 y rounded"
        );
        bf16_run.y = f32_run.y.clone();
        assert_ne!(
            bf16_run.out, f32_run.out,
            "case {ci}: the gated output must come from the rounded y"
        );
        bf16_run.out = f32_run.out.clone();
        assert_eq!(
            bf16_run, f32_run,
            "case {ci} (batch {b} T {t} d_inner {d} d_state {n}): bf16-staged u / dt changed the bits"
        );
        if ci == 1 {
            // Negative control: one bf16 step on one u.
            let mut u2 = u.clone();
            let i = u2.len() / 2;
            u2[i] = bf16_to_f32(f32_to_bf16_rne(u2[i]).wrapping_add(1));
            let moved = run_scan(&s, &k, shape, r, &u2, &dt, rest, true);
            assert_ne!(moved.y, f32_run.y, "a changed u must change the output");
        }
    }
}

#[test]
fn scan_launchers_refuse_mixed_or_odd_bf16_inputs() {
    let Some((s, k)) = device() else { return };
    let shape = |d: usize| ScanShape {
        batch: 1,
        seq_len: 4,
        d_inner: d,
        d_state: 4,
    };
    let zf = |len: usize| s.alloc_zeros::<f32>(len).expect("alloc");
    let zh = |len: usize| s.alloc_zeros::<u16>(len).expect("alloc");
    for (d, mixed, z_f32, want) in [
        (4, true, false, "u and dt must be kept in the same type"),
        (3, false, false, "bf16 u and dt need an even d_inner, got 3"),
        (4, false, true, "z must be kept in the type u and dt are"),
    ] {
        let (uh, dth, dtf) = (zh(4 * d), zh(4 * d), zf(4 * d));
        let (bc, a, dp, zz, zzh) = (zf(4 * 8), zf(d * 4), zf(d), zf(8 * d), zh(8 * d));
        let (zv, zhv) = (zz.slice(d..), zzh.slice(d..));
        let (mut hin, mut y, mut out) = (zf(shape(d).state_len()), zh(4 * d), zh(4 * d));
        let (uhv, dthv, dtfv, bcv, av, dpv) = (
            uh.as_view(),
            dth.as_view(),
            dtf.as_view(),
            bc.as_view(),
            a.as_view(),
            dp.as_view(),
        );
        let err = k
            .scan_forward(
                &s,
                shape(d),
                ScanInputs {
                    u: Stored::Bf16(&uhv),
                    dt: if mixed {
                        Stored::F32(&dtfv)
                    } else {
                        Stored::Bf16(&dthv)
                    },
                    bc: &bcv,
                    ldbc: 8,
                    a_log: &av,
                    d: &dpv,
                },
                ScanForward {
                    z: if z_f32 {
                        Stored::F32(&zv)
                    } else {
                        Stored::Bf16(&zhv)
                    },
                    ldz: 2 * d,
                    hin: &mut hin.as_view_mut(),
                    y: Store::Bf16(y.as_view_mut()),
                    out: Store::Bf16(out.as_view_mut()),
                    scratch_seg: &mut zf(1).as_view_mut(),
                },
            )
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{err}");
    }
}

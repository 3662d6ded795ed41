//! Tests of [`super`] (the SSD scan, forward and backward): chunked against the sequential
//! recurrence over random shapes and chunk sizes, with an off-by-one decay
//! mask as the negative control; the backward against central differences;
//! the f32 bits against the thread count.

use super::*;
use crate::seed::Rng;

/// Random scan inputs: x, B, C ~ N(0, 1), dt in (0.01, 0.5), A_log =
/// ln U(1, 4), D ~ N(0, 1).
#[derive(Clone)]
struct Case {
    dm: SsdDims,
    nseq: usize,
    u: Vec<f64>,
    dt: Vec<f64>,
    a_log: Vec<f64>,
    d: Vec<f64>,
}

/// `shape` is `[nseq, l, h, p, n, g, q]`.
fn case(shape: [usize; 7], seed: u64) -> Case {
    let [nseq, l, h, p, n, g, q] = shape;
    let mut r = Rng::new(seed);
    let ld_u = h * p + 2 * g * n;
    let dm = SsdDims {
        l,
        h,
        p,
        n,
        g,
        q,
        ld_u,
        b_off: h * p,
        c_off: h * p + g * n,
    };
    Case {
        dm,
        nseq,
        u: (0..nseq * l * ld_u).map(|_| r.normal()).collect(),
        dt: (0..nseq * l * h)
            .map(|_| 0.01 + 0.49 * r.next_f64())
            .collect(),
        a_log: (0..h).map(|_| (1.0 + 3.0 * r.next_f64()).ln()).collect(),
        d: (0..h).map(|_| r.normal()).collect(),
    }
}

impl Case {
    fn a(&self) -> Vec<f64> {
        self.a_log.iter().map(|&v| -v.exp()).collect()
    }
    fn y(&self, chunked: bool) -> Vec<f64> {
        let mut y = vec![f64::NAN; self.nseq * self.dm.l * self.dm.h * self.dm.p];
        let f = if chunked {
            ssd_fwd::<f64>
        } else {
            ssd_naive::<f64>
        };
        f(
            &self.u,
            &self.dt,
            &self.a(),
            &self.d,
            self.dm,
            self.nseq,
            &mut y,
        );
        y
    }
    /// Chunked forward on the calling thread only (for the thread-local
    /// fault of the negative control).
    fn y_here(&self) -> Vec<f64> {
        let (l, p, e) = (self.dm.l, self.dm.p, self.dm.h * self.dm.p);
        let a = self.a();
        let mut y = vec![0.0; self.nseq * l * e];
        let mut out = vec![0.0; l * p];
        for i in 0..self.nseq * self.dm.h {
            let hd = heads(&self.u, &self.dt, &a, &self.d, self.dm, i);
            head_fwd(&hd, &mut out);
            for t in 0..l {
                let dst = (hd.seq * l + t) * e + hd.head * p;
                y[dst..dst + p].copy_from_slice(&out[t * p..(t + 1) * p]);
            }
        }
        y
    }
}

fn max_rel_diff(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// f64 tolerance of chunked vs sequential: both are exact formulas of
/// the same recurrence; they differ by the rounding of a few hundred
/// operations per output (measured well under 1e-14).
const CHUNKED_TOL: f64 = 1e-12;

#[test]
fn chunked_scan_equals_the_sequential_recurrence() {
    let mut r = Rng::new(11);
    let mut worst = 0.0f64;
    for trial in 0..24u64 {
        let l = 1 + r.below(23) as usize;
        let g = 1 + r.below(2) as usize;
        let h = g * (1 + r.below(3) as usize);
        let p = 1 + r.below(4) as usize;
        let n = 1 + r.below(5) as usize;
        let nseq = 1 + r.below(3) as usize;
        // 1, 3, one that rarely divides l, exactly l, above l.
        for q in [1, 3, 5, l, l + 4] {
            let c = case([nseq, l, h, p, n, g, q], 100 + trial);
            let want = c.y(false);
            let got = c.y(true);
            let err = max_rel_diff(&got, &want);
            worst = worst.max(err);
            assert!(
                err < CHUNKED_TOL,
                "l {l} q {q} h {h} p {p} n {n} g {g}: {err:e}"
            );
        }
    }
    eprintln!("chunked vs sequential, worst relative difference {worst:e}");
}

#[test]
fn a_wrong_decay_mask_is_caught() {
    let c = case([2, 11, 2, 3, 4, 1, 4], 7);
    let want = c.y(false);
    assert!(
        max_rel_diff(&c.y_here(), &want) < CHUNKED_TOL,
        "the harness itself"
    );
    fault::set_wrong_mask(true);
    let bad = c.y_here();
    fault::set_wrong_mask(false);
    let err = max_rel_diff(&bad, &want);
    assert!(err > 1e-3, "an off-by-one mask changes y by only {err:e}");
}

/// `sum_k w_k y_k` with fixed random `w`, and its gradient.
fn loss_and_grads(c: &Case, w: &[f64]) -> (f64, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let y = c.y(true);
    let loss = y.iter().zip(w).map(|(a, b)| a * b).sum();
    let mut du = vec![f64::NAN; c.u.len()];
    let mut ddt = vec![f64::NAN; c.dt.len()];
    let (mut da, mut dd) = (vec![f64::NAN; c.dm.h], vec![f64::NAN; c.dm.h]);
    let out = SsdGrads {
        du: &mut du,
        ddt: &mut ddt,
        da_log: &mut da,
        dd: &mut dd,
    };
    ssd_bwd(&c.u, &c.dt, &c.a(), &c.d, w, c.dm, c.nseq, out);
    (loss, du, ddt, da, dd)
}

#[test]
fn backward_matches_central_differences_for_every_input() {
    let step = 1e-5;
    let mut worst = 0.0f64;
    for (q, g) in [(1, 1), (3, 2), (4, 1), (7, 2), (10, 1)] {
        let c = case([2, 7, 4, 2, 3, g, q], 40 + q as u64);
        let mut r = Rng::new(9);
        let w: Vec<f64> = (0..2 * 7 * 4 * 2).map(|_| r.normal()).collect();
        let (_, du, ddt, da, dd) = loss_and_grads(&c, &w);
        let loss = |c: &Case| -> f64 { c.y(true).iter().zip(&w).map(|(a, b)| a * b).sum() };
        let mut check = |name: &str, analytic: &[f64], get: fn(&mut Case) -> &mut Vec<f64>| {
            let mut cc = c.clone();
            for (k, &want) in analytic.iter().enumerate() {
                let v0 = get(&mut cc)[k];
                get(&mut cc)[k] = v0 + step;
                let up = loss(&cc);
                get(&mut cc)[k] = v0 - step;
                let down = loss(&cc);
                get(&mut cc)[k] = v0;
                let fd = (up - down) / (2.0 * step);
                let err = (fd - want).abs() / (1.0 + fd.abs());
                worst = worst.max(err);
                assert!(
                    err < 1e-7,
                    "q {q} g {g} d{name}[{k}]: analytic {want} fd {fd}"
                );
            }
        };
        check("u", &du, |c| &mut c.u);
        check("dt", &ddt, |c| &mut c.dt);
        check("A_log", &da, |c| &mut c.a_log);
        check("D", &dd, |c| &mut c.d);
    }
    eprintln!("scan backward vs central differences, worst relative error {worst:e}");
}

#[test]
fn f32_scan_bits_do_not_depend_on_the_thread_count() {
    let c = case([3, 37, 4, 4, 8, 2, 8], 3);
    let f = |v: &[f64]| -> Vec<f32> { v.iter().map(|&x| x as f32).collect() };
    let (u, dt, a, d) = (f(&c.u), f(&c.dt), f(&c.a()), f(&c.d));
    let dy: Vec<f32> = f(&c.y(true));
    let run = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| {
                let mut y = vec![0f32; dy.len()];
                ssd_fwd(&u, &dt, &a, &d, c.dm, c.nseq, &mut y);
                let mut du = vec![0f32; u.len()];
                let mut ddt = vec![0f32; dt.len()];
                let (mut da, mut dd) = (vec![0f32; 4], vec![0f32; 4]);
                let out = SsdGrads {
                    du: &mut du,
                    ddt: &mut ddt,
                    da_log: &mut da,
                    dd: &mut dd,
                };
                ssd_bwd(&u, &dt, &a, &d, &dy, c.dm, c.nseq, out);
                [y, du, ddt, da, dd].map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            })
    };
    let one = run(1);
    assert!(one[1].iter().any(|&b| b != 0), "gradients were computed");
    assert_eq!(one, run(3));
}

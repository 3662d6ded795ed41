//! The selective scan (Mamba-1 SSM), forward and backward, on the CPU.
//!
//! Per sequence, channel `c`, state `n`, token `t` (A = -exp(A_log)):
//! `abar = exp(dt[t,c] * A[c,n])`, `h = abar * h + (dt[t,c] * u[t,c]) * B[t,n]`,
//! `y[t,c] = (sum_n h * C[t,n]) + D[c] * u[t,c]` (ascending n, from 0).
//!
//! Work is split over sequences (one rayon task each) and, inside a task,
//! channels are processed in blocks of [`EB`] lanes so that the inner loops
//! vectorise *across channels* (each lane its own chain). Reductions that
//! cross channels (dB, dC) are a fixed tree inside a block and a chain over
//! blocks, inside the task; reductions that cross sequences (dA_log, dD) are per-sequence
//! partials summed in ascending sequence order. Nothing depends on the
//! thread count.
//!
//! The backward recomputes the forward states of one channel block (`L x N x
//! EB` values of `h` and `abar`, a few hundred KiB) instead of storing all
//! states, so memory stays `O(T * d_inner)`.

use rayon::prelude::*;

use super::float::Float;
use super::ops::lanes;
use super::simd::simd_fn;

/// Channels per block (vector lanes of the inner loops).
pub(crate) const EB: usize = 16;

/// Shapes of one layer's scan.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScanDims {
    /// Tokens per sequence.
    pub l: usize,
    /// Channels (`d_inner`).
    pub e: usize,
    /// State size.
    pub n: usize,
    /// Row stride of the `x_proj` output holding B and C.
    pub ld_bc: usize,
    /// Column of B[.,0] in that output (`dt_rank`).
    pub b_off: usize,
    /// Column of C[.,0] (`dt_rank + d_state`).
    pub c_off: usize,
}

impl ScanDims {
    fn blocks(&self) -> usize {
        self.e.div_ceil(EB)
    }
}

/// `A = -exp(A_log)` as `[n][e_pad]` (lanes past `e` are 0) for block loads.
pub(crate) fn a_blocks<F: Float>(a_log: &[F], dims: ScanDims) -> Vec<[F; EB]> {
    let ScanDims { e, n, .. } = dims;
    let mut a = vec![[F::ZERO; EB]; dims.blocks() * n];
    for c in 0..e {
        for s in 0..n {
            a[(c / EB) * n + s][c % EB] = -(a_log[c * n + s].exp());
        }
    }
    a
}

const _: () = assert!(EB == 16, "fold_lanes is written for 16 lanes");

/// Sum of the 16 lanes by a fixed tree: fold the upper half onto the lower
/// (`v[j] + v[j+8]`), then `+ [j+4]`, `+ [j+2]`, and finally `[0] + [1]`.
/// (Padding lanes hold exact zeros, so a partial block sums its real lanes.)
#[inline(always)]
fn fold_lanes<F: Float>(v: &[F; EB]) -> F {
    let h8: [F; 8] = std::array::from_fn(|j| v[j] + v[j + 8]);
    let h4: [F; 4] = std::array::from_fn(|j| h8[j] + h8[j + 4]);
    let h2: [F; 2] = std::array::from_fn(|j| h4[j] + h4[j + 2]);
    h2[0] + h2[1]
}

/// `src` (at most [`EB`] values) as a full lane array, zero-padded.
#[inline(always)]
fn load<F: Float>(src: &[F]) -> [F; EB] {
    lanes::<F, EB>(src)
}

/// Forward scan for every sequence: writes `y` (`[T, e]`).
/// `u`, `dt`: `[T, e]`; `bc`: `[T, ld_bc]`; `a`: from [`a_blocks`]; `d`: `[e]`.
pub(crate) fn scan_fwd<F: Float>(
    u: &[F],
    dt: &[F],
    bc: &[F],
    a: &[[F; EB]],
    d: &[F],
    dims: ScanDims,
    y: &mut [F],
) {
    let ScanDims { l, e, .. } = dims;
    y.par_chunks_mut(l * e).enumerate().for_each(|(b, yr)| {
        let r = b * l;
        let rows = Rows {
            u: &u[r * e..(r + l) * e],
            dt: &dt[r * e..(r + l) * e],
            bc: &bc[r * dims.ld_bc..(r + l) * dims.ld_bc],
        };
        fwd_seq(rows, a, d, dims, yr);
    });
}

/// One sequence's inputs.
#[derive(Clone, Copy)]
struct Rows<'a, F> {
    u: &'a [F],
    dt: &'a [F],
    bc: &'a [F],
}

simd_fn! {
/// One sequence's forward scan (module docs give the order).
fn fwd_seq<F: Float>(rows: Rows<'_, F>, a: &[[F; EB]], d: &[F], dims: ScanDims, y: &mut [F]) {
    let ScanDims { l, e, n, ld_bc, b_off, c_off } = dims;
    let mut h = vec![[F::ZERO; EB]; n];
    for blk in 0..dims.blocks() {
        let c0 = blk * EB;
        let w = EB.min(e - c0);
        let ab = &a[blk * n..(blk + 1) * n];
        let dv = load(&d[c0..c0 + w]);
        h.iter_mut().for_each(|v| *v = [F::ZERO; EB]);
        for t in 0..l {
            let uv = load(&rows.u[t * e + c0..t * e + c0 + w]);
            let dtv = load(&rows.dt[t * e + c0..t * e + c0 + w]);
            let bcr = &rows.bc[t * ld_bc..(t + 1) * ld_bc];
            let bt = &bcr[b_off..b_off + n];
            let ct = &bcr[c_off..c_off + n];
            let mut du = [F::ZERO; EB];
            for j in 0..EB {
                du[j] = dtv[j] * uv[j];
            }
            let mut yv = [F::ZERO; EB];
            for s in 0..n {
                let (bn, cn) = (bt[s], ct[s]);
                let (hs, an) = (&mut h[s], &ab[s]);
                for j in 0..EB {
                    let abar = (dtv[j] * an[j]).exp();
                    hs[j] = abar * hs[j] + du[j] * bn;
                    yv[j] = yv[j] + hs[j] * cn;
                }
            }
            let out = &mut y[t * e + c0..t * e + c0 + w];
            for j in 0..w {
                out[j] = yv[j] + dv[j] * uv[j];
            }
        }
    }
}
}

/// Outputs of the scan backward.
pub(crate) struct ScanGrads<'a, F> {
    /// `[T, e]`: d loss / d u through the scan and the D skip (overwritten).
    pub du: &'a mut [F],
    /// `[T, e]`: d loss / d dt (overwritten).
    pub ddt: &'a mut [F],
    /// `[T, ld_bc]`: the B and C columns are overwritten with d loss / d B,
    /// d loss / d C; other columns untouched.
    pub dbc: &'a mut [F],
    /// `[e, n]`: d loss / d A_log (overwritten).
    pub da_log: &'a mut [F],
    /// `[e]`: d loss / d D (overwritten).
    pub dd: &'a mut [F],
}

/// Scan backward given `dy` (`[T, e]`, gradient of `y`).
///
/// Per lane, going back in time with `gh` = d loss / d h_t (carried as
/// `abar_{t+1} * gh_{t+1}`, then `+ dy_t * C_t`):
/// `dC[t,n] += dy * h_t` and `dB[t,n] += gh * (dt*u)`, summed over the
/// channels of each block of [`EB`] by the fixed tree of `fold_lanes`, the
/// block sums added in ascending block order from 0; `q = (gh * h_{t-1}) * abar`;
/// `ddt = sum_n ((q * A) + (gh * B) * u)`, `du = (sum_n (gh * B) * dt) + dy * D`
/// (ascending n, from 0); `dA[c,n] += q * dt` over t descending, then over
/// sequences ascending; `dA_log = dA * A`; `dD[c] = sum dy * u` (t
/// descending per sequence, then sequences ascending).
#[allow(clippy::too_many_arguments)]
pub(crate) fn scan_bwd<F: Float>(
    u: &[F],
    dt: &[F],
    bc: &[F],
    a: &[[F; EB]],
    d: &[F],
    dy: &[F],
    dims: ScanDims,
    out: ScanGrads<'_, F>,
) {
    let ScanDims { l, e, n, ld_bc, .. } = dims;
    let nseq = u.len() / (l * e);
    let mut da_part = vec![F::ZERO; nseq * e * n];
    let mut dd_part = vec![F::ZERO; nseq * e];
    out.du
        .par_chunks_mut(l * e)
        .zip(out.ddt.par_chunks_mut(l * e))
        .zip(out.dbc.par_chunks_mut(l * ld_bc))
        .zip(da_part.par_chunks_mut(e * n))
        .zip(dd_part.par_chunks_mut(e))
        .enumerate()
        .for_each(|(b, ((((du, ddt), dbc), da), dd))| {
            let r = b * l;
            let rows = Rows {
                u: &u[r * e..(r + l) * e],
                dt: &dt[r * e..(r + l) * e],
                bc: &bc[r * ld_bc..(r + l) * ld_bc],
            };
            let seq = SeqGrads {
                dy: &dy[r * e..(r + l) * e],
                du,
                ddt,
                dbc,
                da,
                dd,
            };
            bwd_seq(rows, a, d, dims, seq);
        });
    // Sum the per-sequence partials in ascending sequence order.
    out.da_log.fill(F::ZERO);
    out.dd.fill(F::ZERO);
    for (dap, ddp) in da_part.chunks_exact(e * n).zip(dd_part.chunks_exact(e)) {
        for (o, &v) in out.da_log.iter_mut().zip(dap) {
            *o = *o + v;
        }
        for (o, &v) in out.dd.iter_mut().zip(ddp) {
            *o = *o + v;
        }
    }
    for c in 0..e {
        for s in 0..n {
            let i = c * n + s;
            out.da_log[i] = out.da_log[i] * a[(c / EB) * n + s][c % EB];
        }
    }
}

/// One sequence's gradient outputs (`da`: `[e, n]` partial of dA, `dd`:
/// `[e]` partial of dD).
struct SeqGrads<'a, F> {
    dy: &'a [F],
    du: &'a mut [F],
    ddt: &'a mut [F],
    dbc: &'a mut [F],
    da: &'a mut [F],
    dd: &'a mut [F],
}

simd_fn! {
/// One sequence's backward scan (order in [`scan_bwd`]).
fn bwd_seq<F: Float>(rows: Rows<'_, F>, a: &[[F; EB]], d: &[F], dims: ScanDims, g: SeqGrads<'_, F>) {
    let ScanDims { l, e, n, ld_bc, b_off, c_off } = dims;
    let SeqGrads { dy, du: du_out, ddt: ddt_out, dbc, da, dd } = g;
    // dB and dC accumulate over channel blocks: start from zero.
    for t in 0..l {
        dbc[t * ld_bc + b_off..t * ld_bc + b_off + n].fill(F::ZERO);
        dbc[t * ld_bc + c_off..t * ld_bc + c_off + n].fill(F::ZERO);
    }
    let mut hs = vec![[F::ZERO; EB]; l * n];
    let mut abs = vec![[F::ZERO; EB]; l * n];
    let mut hprev = vec![[F::ZERO; EB]; n];
    let mut gh = vec![[F::ZERO; EB]; n];
    let mut da_acc = vec![[F::ZERO; EB]; n];
    for blk in 0..dims.blocks() {
        let c0 = blk * EB;
        let w = EB.min(e - c0);
        let ab = &a[blk * n..(blk + 1) * n];
        let dv = load(&d[c0..c0 + w]);
        // Recompute the forward states of this block (same operations as
        // the forward, so the same bits).
        hprev.iter_mut().for_each(|v| *v = [F::ZERO; EB]);
        for t in 0..l {
            let uv = load(&rows.u[t * e + c0..t * e + c0 + w]);
            let dtv = load(&rows.dt[t * e + c0..t * e + c0 + w]);
            let bt = &rows.bc[t * ld_bc + b_off..t * ld_bc + b_off + n];
            let mut dtu = [F::ZERO; EB];
            for j in 0..EB {
                dtu[j] = dtv[j] * uv[j];
            }
            for s in 0..n {
                let bn = bt[s];
                let an = &ab[s];
                let hp = &mut hprev[s];
                let ab_t = &mut abs[t * n + s];
                for j in 0..EB {
                    let abar = (dtv[j] * an[j]).exp();
                    hp[j] = abar * hp[j] + dtu[j] * bn;
                    ab_t[j] = abar;
                }
                hs[t * n + s] = *hp;
            }
        }
        // Backward in time.
        gh.iter_mut().for_each(|v| *v = [F::ZERO; EB]);
        da_acc.iter_mut().for_each(|v| *v = [F::ZERO; EB]);
        let mut dd_acc = [F::ZERO; EB];
        for t in (0..l).rev() {
            let uv = load(&rows.u[t * e + c0..t * e + c0 + w]);
            let dtv = load(&rows.dt[t * e + c0..t * e + c0 + w]);
            let dyv = load(&dy[t * e + c0..t * e + c0 + w]);
            let mut dtu = [F::ZERO; EB];
            for j in 0..EB {
                dtu[j] = dtv[j] * uv[j];
                dd_acc[j] = dd_acc[j] + dyv[j] * uv[j];
            }
            let mut ddt_acc = [F::ZERO; EB];
            let mut du_acc = [F::ZERO; EB];
            let bcr = &mut dbc[t * ld_bc..(t + 1) * ld_bc];
            for s in 0..n {
                let bn = rows.bc[t * ld_bc + b_off + s];
                let cn = rows.bc[t * ld_bc + c_off + s];
                let an = &ab[s];
                let hcur = &hs[t * n + s];
                let abar = &abs[t * n + s];
                let zero = [F::ZERO; EB];
                let hp = if t > 0 { &hs[(t - 1) * n + s] } else { &zero };
                let g = &mut gh[s];
                let dacc = &mut da_acc[s];
                let mut pc = [F::ZERO; EB];
                let mut pb = [F::ZERO; EB];
                for j in 0..EB {
                    let gj = g[j] + dyv[j] * cn;
                    pc[j] = dyv[j] * hcur[j];
                    pb[j] = gj * dtu[j];
                    let q = (gj * hp[j]) * abar[j];
                    let gb = gj * bn;
                    ddt_acc[j] = ddt_acc[j] + ((q * an[j]) + gb * uv[j]);
                    du_acc[j] = du_acc[j] + gb * dtv[j];
                    dacc[j] = dacc[j] + q * dtv[j];
                    g[j] = gj * abar[j];
                }
                bcr[c_off + s] = bcr[c_off + s] + fold_lanes(&pc);
                bcr[b_off + s] = bcr[b_off + s] + fold_lanes(&pb);
            }
            let duo = &mut du_out[t * e + c0..t * e + c0 + w];
            let ddto = &mut ddt_out[t * e + c0..t * e + c0 + w];
            for j in 0..w {
                duo[j] = du_acc[j] + dyv[j] * dv[j];
                ddto[j] = ddt_acc[j];
            }
        }
        for c in 0..w {
            for s in 0..n {
                da[(c0 + c) * n + s] = da_acc[s][c];
            }
            dd[c0 + c] = dd_acc[c];
        }
    }
}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seed::Rng;

    struct Case {
        dims: ScanDims,
        nseq: usize,
        u: Vec<f64>,
        dt: Vec<f64>,
        bc: Vec<f64>,
        a_log: Vec<f64>,
        d: Vec<f64>,
    }

    fn case(nseq: usize, l: usize, e: usize, n: usize, seed: u64) -> Case {
        let r = 3;
        let ld_bc = r + 2 * n;
        let dims = ScanDims {
            l,
            e,
            n,
            ld_bc,
            b_off: r,
            c_off: r + n,
        };
        let mut g = Rng::new(seed);
        let mut v = |k: usize, lo: f64, hi: f64| {
            (0..k)
                .map(|_| lo + (hi - lo) * g.next_f64())
                .collect::<Vec<_>>()
        };
        let t = nseq * l;
        Case {
            dims,
            nseq,
            u: v(t * e, -1.0, 1.0),
            dt: v(t * e, 0.001, 0.5),
            bc: v(t * ld_bc, -1.0, 1.0),
            a_log: v(e * n, -0.5, 2.0),
            d: v(e, 0.5, 1.5),
        }
    }

    /// The recurrence exactly as the Hugging Face slow path writes it: one
    /// step at a time over a full `[e, n]` state.
    fn naive_y(c: &Case) -> Vec<f64> {
        let ScanDims {
            l,
            e,
            n,
            ld_bc,
            b_off,
            c_off,
        } = c.dims;
        let mut y = vec![0.0; c.nseq * l * e];
        for b in 0..c.nseq {
            let mut h = vec![0.0f64; e * n];
            for t in 0..l {
                let tok = b * l + t;
                for ch in 0..e {
                    let dt = c.dt[tok * e + ch];
                    let u = c.u[tok * e + ch];
                    let mut acc = 0.0;
                    for s in 0..n {
                        let a = -c.a_log[ch * n + s].exp();
                        let hv = &mut h[ch * n + s];
                        *hv = (dt * a).exp() * *hv + dt * c.bc[tok * ld_bc + b_off + s] * u;
                        acc += *hv * c.bc[tok * ld_bc + c_off + s];
                    }
                    y[tok * e + ch] = acc + c.d[ch] * u;
                }
            }
        }
        y
    }

    fn run_fwd<F: Float>(c: &Case, cast: impl Fn(f64) -> F) -> Vec<F> {
        let cv = |v: &[f64]| v.iter().map(|&x| cast(x)).collect::<Vec<F>>();
        let a = a_blocks(&cv(&c.a_log), c.dims);
        let mut y = vec![F::ZERO; c.u.len()];
        scan_fwd(
            &cv(&c.u),
            &cv(&c.dt),
            &cv(&c.bc),
            &a,
            &cv(&c.d),
            c.dims,
            &mut y,
        );
        y
    }

    #[test]
    fn scan_matches_the_naive_recurrence() {
        // e = 21 exercises a partial channel block.
        for (e, n) in [(21usize, 5usize), (32, 16), (3, 1)] {
            let c = case(3, 11, e, n, e as u64);
            let want = naive_y(&c);
            let got64 = run_fwd::<f64>(&c, |x| x);
            for (g, w) in got64.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-13 * (1.0 + w.abs()),
                    "f64 scan {g} vs naive {w}"
                );
            }
            let got32 = run_fwd::<f32>(&c, |x| x as f32);
            for (g, w) in got32.iter().zip(&want) {
                assert!(
                    (*g as f64 - w).abs() <= 2e-5 * (1.0 + w.abs()),
                    "f32 scan {g} vs naive {w}"
                );
            }
        }
    }

    /// Gradients of `sum(y * w)` for a fixed random `w`, by finite differences
    /// of the naive recurrence, against the scan backward.
    #[test]
    fn scan_backward_matches_finite_differences() {
        let c0 = case(2, 7, 19, 4, 99);
        let ScanDims {
            e,
            n,
            ld_bc,
            b_off,
            c_off,
            ..
        } = c0.dims;
        let mut g = Rng::new(7);
        let wy: Vec<f64> = (0..c0.u.len()).map(|_| g.next_f64() - 0.5).collect();
        let obj = |c: &Case| naive_y(c).iter().zip(&wy).map(|(a, b)| a * b).sum::<f64>();
        let a = a_blocks(&c0.a_log, c0.dims);
        let mut du = vec![0.0; c0.u.len()];
        let mut ddt = vec![0.0; c0.u.len()];
        let mut dbc = vec![f64::NAN; c0.bc.len()];
        let mut da_log = vec![0.0; e * n];
        let mut dd = vec![0.0; e];
        let out = ScanGrads {
            du: &mut du,
            ddt: &mut ddt,
            dbc: &mut dbc,
            da_log: &mut da_log,
            dd: &mut dd,
        };
        scan_bwd(&c0.u, &c0.dt, &c0.bc, &a, &c0.d, &wy, c0.dims, out);
        let h = 1e-6;
        let check = |name: &str, an: f64, pick: &dyn Fn(&mut Case) -> &mut f64| {
            let mut cp = case(2, 7, 19, 4, 99);
            *pick(&mut cp) += h;
            let up = obj(&cp);
            *pick(&mut cp) -= 2.0 * h;
            let dn = obj(&cp);
            let fd = (up - dn) / (2.0 * h);
            assert!(
                (fd - an).abs() <= 1e-7 + 1e-6 * an.abs(),
                "{name}: analytic {an}, numeric {fd}"
            );
        };
        for i in [0usize, 5, 40, 100, e * 14 - 1] {
            check("u", du[i], &|c| &mut c.u[i]);
            check("dt", ddt[i], &|c| &mut c.dt[i]);
        }
        for tok in [0usize, 3, 13] {
            for s in [0usize, n - 1] {
                check("B", dbc[tok * ld_bc + b_off + s], &|c| {
                    &mut c.bc[tok * ld_bc + b_off + s]
                });
                check("C", dbc[tok * ld_bc + c_off + s], &|c| {
                    &mut c.bc[tok * ld_bc + c_off + s]
                });
            }
        }
        assert!(
            dbc[0].is_nan(),
            "columns outside B and C are left untouched"
        );
        for i in [0usize, 7, e * n - 1] {
            check("A_log", da_log[i], &|c| &mut c.a_log[i]);
        }
        for i in [0usize, 18] {
            check("D", dd[i], &|c| &mut c.d[i]);
        }
    }
}

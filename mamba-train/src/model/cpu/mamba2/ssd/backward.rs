//! The backward of the chunked SSD scan ([`super`] has the forward, the
//! shared per-head views and the orders of the forward's sums).

use rayon::prelude::*;

use super::super::super::float::Float;
use super::{chunks, dot, heads, pass_state, Chunk, Head, SsdDims};

/// What one head's backward writes (head-major scratch rows) and returns.
struct HeadGrads<'a, F> {
    /// `[L, P]`.
    dx: &'a mut [F],
    /// `[L]`.
    ddt: &'a mut [F],
    /// `[L, N]`, this head's share of its group's dB.
    db: &'a mut [F],
    /// `[L, N]`, this head's share of its group's dC.
    dc: &'a mut [F],
}

/// One head's backward given `dy` `[T, H*P]`; returns `(dA, dD)` for this
/// sequence. Chunks run last to first, carrying `dH` (the gradient of the
/// state a chunk passes on). Within a chunk, every accumulator starts at 0
/// and takes its terms in this order: (1) the skip `D x`; (2) the diagonal
/// block, `i` ascending then `j <= i` ascending; (3) the entry state's
/// output term, `i` ascending; (4) the state passed on, `j` ascending. Then
/// `da_k = sum_{j<k} (sum_{i>=k} dseg[i][j]) + sum_{i>=k} ds_i` (inner sums
/// descending `i`, outer ascending `j`), and `ddt_k += da_k * A`,
/// `dA += da_k * dt_k`.
fn head_bwd<F: Float>(hd: &Head<'_, F>, dy: &[F], g: HeadGrads<'_, F>) -> (F, F) {
    let (l, p, n, e) = (hd.dm.l, hd.dm.p, hd.dm.n, hd.dm.e());
    let dyt = |t: usize| &dy[(hd.seq * l + t) * e + hd.head * p..][..p];
    // Entry states of every chunk, recomputed as the forward does.
    let spans: Vec<(usize, usize)> = chunks(l, hd.dm.q).collect();
    if spans.is_empty() {
        return (F::ZERO, F::ZERO);
    }
    let mut entry = vec![F::ZERO; spans.len() * p * n];
    for (c, &(t0, q)) in spans.iter().enumerate().take(spans.len() - 1) {
        let (done, next) = entry.split_at_mut((c + 1) * p * n);
        next[..p * n].copy_from_slice(&done[c * p * n..]);
        pass_state(hd, &Chunk::new(hd, t0, q), &mut next[..p * n]);
    }
    let (mut da_total, mut dd_total) = (F::ZERO, F::ZERO);
    let mut dh = vec![F::ZERO; p * n];
    for (c, &(t0, q)) in spans.iter().enumerate().rev() {
        let ch = Chunk::new(hd, t0, q);
        let hin = &entry[c * p * n..(c + 1) * p * n];
        let mut dseg = vec![F::ZERO; q * q];
        let mut ds = vec![F::ZERO; q];
        let (dx, ddt) = (&mut g.dx[t0 * p..(t0 + q) * p], &mut g.ddt[t0..t0 + q]);
        let (db, dc) = (
            &mut g.db[t0 * n..(t0 + q) * n],
            &mut g.dc[t0 * n..(t0 + q) * n],
        );
        dx.fill(F::ZERO);
        ddt.fill(F::ZERO);
        db.fill(F::ZERO);
        dc.fill(F::ZERO);
        // (1) skip.
        for i in 0..q {
            let (dyi, xi) = (dyt(t0 + i), hd.x(t0 + i));
            for pi in 0..p {
                dx[i * p + pi] = hd.d * dyi[pi];
            }
            dd_total = dd_total + dot(dyi, xi);
        }
        // (2) diagonal block: W = (ex * cb) * dt_j.
        for i in 0..q {
            let dyi = dyt(t0 + i);
            for j in 0..=i {
                let (xj, dtj) = (hd.x(t0 + j), hd.dt(t0 + j));
                let (exv, cbv) = (ch.ex[i * q + j], ch.cb[i * q + j]);
                let w = (exv * cbv) * dtj;
                let dw = dot(dyi, xj);
                for pi in 0..p {
                    dx[j * p + pi] = dx[j * p + pi] + w * dyi[pi];
                }
                let dcb = (dw * exv) * dtj;
                ddt[j] = ddt[j] + dw * (exv * cbv);
                dseg[i * q + j] = dw * w;
                let (bj, ci) = (hd.bv(t0 + j), hd.cv(t0 + i));
                for ni in 0..n {
                    dc[i * n + ni] = dc[i * n + ni] + dcb * bj[ni];
                    db[j * n + ni] = db[j * n + ni] + dcb * ci[ni];
                }
            }
        }
        // State passing, part one: H' = exp(s_last) H + S.
        let last = ch.last();
        let decay = ch.es[last];
        let mut dhin: Vec<F> = dh.iter().map(|&v| decay * v).collect();
        ds[last] = decay * dot(&dh, hin);
        // (3) the entry state's output: off_i[p] = es_i * (C_i . H[p]).
        for i in 0..q {
            let (dyi, ci, esi) = (dyt(t0 + i), hd.cv(t0 + i), ch.es[i]);
            let mut acc = F::ZERO;
            for pi in 0..p {
                let hrow = &hin[pi * n..(pi + 1) * n];
                acc = acc + dyi[pi] * dot(ci, hrow);
                let g = esi * dyi[pi];
                for ni in 0..n {
                    dc[i * n + ni] = dc[i * n + ni] + g * hrow[ni];
                    dhin[pi * n + ni] = dhin[pi * n + ni] + g * ci[ni];
                }
            }
            ds[i] = ds[i] + esi * acc;
        }
        // (4) S = sum_j (coef_j x_j) B_j^T, with dS = dh.
        for j in 0..q {
            let (xj, bj, coef) = (hd.x(t0 + j), hd.bv(t0 + j), ch.coef(hd, j));
            let mut r = F::ZERO;
            for pi in 0..p {
                let v = dot(&dh[pi * n..(pi + 1) * n], bj);
                dx[j * p + pi] = dx[j * p + pi] + coef * v;
                r = r + v * xj[pi];
            }
            for ni in 0..n {
                let mut acc = F::ZERO;
                for pi in 0..p {
                    acc = acc + dh[pi * n + ni] * xj[pi];
                }
                db[j * n + ni] = db[j * n + ni] + coef * acc;
            }
            ddt[j] = ddt[j] + r * ch.ex[last * q + j];
            dseg[last * q + j] = dseg[last * q + j] + r * coef;
        }
        // Decays to a_k = dt_k * A.
        let mut suffix = vec![F::ZERO; q * q];
        for j in 0..q {
            let mut acc = F::ZERO;
            for i in (j + 1..q).rev() {
                acc = acc + dseg[i * q + j];
                suffix[i * q + j] = acc;
            }
        }
        let mut ds_suffix = F::ZERO;
        let mut da = vec![F::ZERO; q];
        for k in (0..q).rev() {
            ds_suffix = ds_suffix + ds[k];
            da[k] = ds_suffix;
        }
        for (k, dak) in da.iter_mut().enumerate() {
            let mut acc = F::ZERO;
            for j in 0..k {
                acc = acc + suffix[k * q + j];
            }
            *dak = acc + *dak;
            ddt[k] = ddt[k] + *dak * hd.a;
            da_total = da_total + *dak * hd.dt(t0 + k);
        }
        dh = dhin;
    }
    (da_total, dd_total)
}

/// Gradients of the scan's inputs.
pub(crate) struct SsdGrads<'a, F> {
    /// `[T, ld_u]`: the x, B and C columns are overwritten (others untouched).
    pub du: &'a mut [F],
    /// `[T, H]`, overwritten.
    pub ddt: &'a mut [F],
    /// `[H]`, overwritten: `(sum over sequences of dA) * A`.
    pub da_log: &'a mut [F],
    /// `[H]`, overwritten.
    pub dd: &'a mut [F],
}

/// Chunked SSD backward given `dy` `[T, H*P]` (module docs for the orders).
#[allow(clippy::too_many_arguments)]
pub(crate) fn ssd_bwd<F: Float>(
    u: &[F],
    dt: &[F],
    a: &[F],
    d: &[F],
    dy: &[F],
    dm: SsdDims,
    nseq: usize,
    out: SsdGrads<'_, F>,
) {
    let (l, p, n, h) = (dm.l, dm.p, dm.n, dm.h);
    let tasks = nseq * h;
    let mut dxs = vec![F::ZERO; tasks * l * p];
    let mut ddts = vec![F::ZERO; tasks * l];
    let mut dbs = vec![F::ZERO; tasks * l * n];
    let mut dcs = vec![F::ZERO; tasks * l * n];
    let mut dad = vec![(F::ZERO, F::ZERO); tasks];
    dxs.par_chunks_mut(l * p)
        .zip(ddts.par_chunks_mut(l))
        .zip(dbs.par_chunks_mut(l * n))
        .zip(dcs.par_chunks_mut(l * n))
        .zip(dad.par_iter_mut())
        .enumerate()
        .for_each(|(i, ((((dx, ddt), db), dc), r))| {
            let g = HeadGrads { dx, ddt, db, dc };
            *r = head_bwd(&heads(u, dt, a, d, dm, i), dy, g);
        });
    let hpg = h / dm.g;
    out.du
        .par_chunks_mut(l * dm.ld_u)
        .zip(out.ddt.par_chunks_mut(l * h))
        .enumerate()
        .for_each(|(b, (dub, ddtb))| {
            for t in 0..l {
                let row = &mut dub[t * dm.ld_u..(t + 1) * dm.ld_u];
                for hh in 0..h {
                    let task = b * h + hh;
                    let src = (task * l + t) * p;
                    row[hh * p..(hh + 1) * p].copy_from_slice(&dxs[src..src + p]);
                    ddtb[t * h + hh] = ddts[task * l + t];
                }
                // B and C of a group: its heads' shares, ascending head.
                for gi in 0..dm.g {
                    for ni in 0..n {
                        let (mut sb, mut sc) = (F::ZERO, F::ZERO);
                        for hh in gi * hpg..(gi + 1) * hpg {
                            let src = ((b * h + hh) * l + t) * n + ni;
                            sb = sb + dbs[src];
                            sc = sc + dcs[src];
                        }
                        row[dm.b_off + gi * n + ni] = sb;
                        row[dm.c_off + gi * n + ni] = sc;
                    }
                }
            }
        });
    for hh in 0..h {
        let (mut sa, mut sd) = (F::ZERO, F::ZERO);
        for b in 0..nseq {
            let (da, dd) = dad[b * h + hh];
            sa = sa + da;
            sd = sd + dd;
        }
        out.da_log[hh] = sa * a[hh];
        out.dd[hh] = sd;
    }
}

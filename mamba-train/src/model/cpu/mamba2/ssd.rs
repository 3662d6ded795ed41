//! The Mamba-2 scan by state-space duality (SSD), forward and backward, with
//! the sequential recurrence it computes as its test oracle.
//!
//! Per sequence and head `h` (head_dim P channels `x_t`, state N, the
//! group's `B_t`, `C_t`, scalar `dt_t`, scalar `A_h = -exp(A_log_h)`,
//! scalar `D_h`), the recurrence is
//! `H_t = exp(dt_t A) H_{t-1} + dt_t x_t B_t^T` (`H` is `[P, N]`, `H_{-1} = 0`),
//! `y_t = H_t C_t + D x_t`.
//!
//! The chunked algorithm (Dao and Gu 2024, `ssd_minimal`): tokens split into
//! chunks of `Q` (the last one shorter when `Q` does not divide `L`; no
//! padding). Within a chunk starting at `t0`, with `a_i = dt_i * A`:
//! - the segment sums `seg[i][j] = a_{j+1} + ... + a_i` (`j <= i`, 0 on
//!   the diagonal), each one ascending chain, computed as a running sum down
//!   column `j` (the same additions as summing from `j+1` to `i`);
//! - the prefix `s_i = a_0 + ... + a_i` (ascending), the decay from the
//!   chunk's entry state to token `i`;
//! - the intra-chunk (quadratic, attention-like) term
//!   `diag_i[p] = sum_{j<=i} ((exp(seg[i][j]) * cb[i][j]) * dt_j) * x_j[p]`,
//!   ascending `j` from 0, with `cb[i][j] = sum_n C_i[n] * B_j[n]` ascending n;
//! - the inter-chunk term `off_i[p] = exp(s_i) * (sum_n C_i[n] * H[p][n])`
//!   (ascending n) from the entry state `H`;
//! - `y_i[p] = (diag_i[p] + off_i[p]) + D * x_i[p]`;
//! - the state passed on: `H'[p][n] = exp(s_last) * H[p][n] + S[p][n]`,
//!   `S[p][n] = sum_j (coef_j * x_j[p]) * B_j[n]` (ascending j),
//!   `coef_j = exp(seg[last][j]) * dt_j`.
//!
//! Determinism: one task per (sequence, head) does all of that serially, so
//! the bits do not depend on the thread count. The backward recomputes the
//! chunk entry states (nothing but `y` is kept from the forward); its
//! per-head dB, dC partials are summed over the heads of a group in
//! ascending head order, and dA_log, dD over sequences in ascending order,
//! after the parallel part. The orders of the backward's sums are stated at
//! [`head_bwd`].

use rayon::prelude::*;

use super::super::float::Float;

/// Shapes of one scan call. `u` rows (one per token, `ld_u` apart) hold x
/// (`H*P` columns from 0), B (`G*N` from `b_off`) and C (`G*N` from
/// `c_off`); `dt` is `[T, H]`; `y` is `[T, H*P]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SsdDims {
    /// Tokens per sequence.
    pub l: usize,
    /// Heads.
    pub h: usize,
    /// Channels per head.
    pub p: usize,
    /// State size.
    pub n: usize,
    /// Groups of heads sharing B and C (divides `h`).
    pub g: usize,
    /// Chunk length (at least 1).
    pub q: usize,
    /// Row stride of `u`.
    pub ld_u: usize,
    /// First column of B in a `u` row.
    pub b_off: usize,
    /// First column of C in a `u` row.
    pub c_off: usize,
}

impl SsdDims {
    fn e(&self) -> usize {
        self.h * self.p
    }
    fn group(&self, h: usize) -> usize {
        h / (self.h / self.g)
    }
}

/// The inputs of one (sequence, head).
struct Head<'a, F> {
    u: &'a [F],
    dt: &'a [F],
    dm: SsdDims,
    seq: usize,
    head: usize,
    a: F,
    d: F,
}

impl<'a, F: Float> Head<'a, F> {
    fn row(&self, t: usize) -> usize {
        (self.seq * self.dm.l + t) * self.dm.ld_u
    }
    fn x(&self, t: usize) -> &'a [F] {
        let r = self.row(t) + self.head * self.dm.p;
        &self.u[r..r + self.dm.p]
    }
    fn bv(&self, t: usize) -> &'a [F] {
        let r = self.row(t) + self.dm.b_off + self.dm.group(self.head) * self.dm.n;
        &self.u[r..r + self.dm.n]
    }
    fn cv(&self, t: usize) -> &'a [F] {
        let r = self.row(t) + self.dm.c_off + self.dm.group(self.head) * self.dm.n;
        &self.u[r..r + self.dm.n]
    }
    fn dt(&self, t: usize) -> F {
        self.dt[(self.seq * self.dm.l + t) * self.dm.h + self.head]
    }
}

/// `sum_k a[k] * b[k]`, ascending k, from 0.
#[inline]
fn dot<F: Float>(a: &[F], b: &[F]) -> F {
    a.iter().zip(b).fold(F::ZERO, |acc, (&x, &y)| acc + x * y)
}

/// The decays of one chunk (module docs): `ex = exp(seg)` as `[i * q + j]`
/// for `j <= i`, `es = exp(s)`, and `cb` (same indexing).
struct Chunk<F> {
    t0: usize,
    q: usize,
    es: Vec<F>,
    ex: Vec<F>,
    cb: Vec<F>,
}

impl<F: Float> Chunk<F> {
    fn new(hd: &Head<'_, F>, t0: usize, q: usize) -> Self {
        let a: Vec<F> = (0..q).map(|i| hd.dt(t0 + i) * hd.a).collect();
        let mut s = vec![F::ZERO; q];
        let mut acc = F::ZERO;
        for i in 0..q {
            acc = acc + a[i];
            s[i] = acc;
        }
        let es = s.iter().map(|&v| v.exp()).collect();
        let mut ex = vec![F::ZERO; q * q];
        let mut cb = vec![F::ZERO; q * q];
        for j in 0..q {
            let mut seg = if fault::wrong_mask() { a[j] } else { F::ZERO };
            ex[j * q + j] = F::ONE;
            for i in j + 1..q {
                seg = seg + a[i];
                ex[i * q + j] = seg.exp();
            }
            for i in j..q {
                cb[i * q + j] = dot(hd.cv(t0 + i), hd.bv(t0 + j));
            }
        }
        Chunk { t0, q, es, ex, cb }
    }
    fn last(&self) -> usize {
        self.q - 1
    }
    /// `coef_j = exp(seg[last][j]) * dt_j`.
    fn coef(&self, hd: &Head<'_, F>, j: usize) -> F {
        self.ex[self.last() * self.q + j] * hd.dt(self.t0 + j)
    }
}

/// The chunk starts of a sequence of `l` tokens in chunks of `q`.
fn chunks(l: usize, q: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..l.div_ceil(q)).map(move |c| (c * q, q.min(l - c * q)))
}

/// `state = exp(s_last) * state + S` (module docs), in place.
fn pass_state<F: Float>(hd: &Head<'_, F>, ch: &Chunk<F>, state: &mut [F]) {
    let (p, n) = (hd.dm.p, hd.dm.n);
    let decay = ch.es[ch.last()];
    let mut s = vec![F::ZERO; p * n];
    for j in 0..ch.q {
        let (x, b, coef) = (hd.x(ch.t0 + j), hd.bv(ch.t0 + j), ch.coef(hd, j));
        for pi in 0..p {
            let cx = coef * x[pi];
            for (sv, &bv) in s[pi * n..(pi + 1) * n].iter_mut().zip(b) {
                *sv = *sv + cx * bv;
            }
        }
    }
    for (hv, &sv) in state.iter_mut().zip(&s) {
        *hv = decay * *hv + sv;
    }
}

/// One head's outputs `[L, P]` (head-major scratch row).
fn head_fwd<F: Float>(hd: &Head<'_, F>, out: &mut [F]) {
    let (p, n) = (hd.dm.p, hd.dm.n);
    let mut state = vec![F::ZERO; p * n];
    for (t0, q) in chunks(hd.dm.l, hd.dm.q) {
        let ch = Chunk::new(hd, t0, q);
        for i in 0..q {
            let yi = &mut out[(t0 + i) * p..(t0 + i + 1) * p];
            yi.fill(F::ZERO);
            for j in 0..=i {
                let w = (ch.ex[i * q + j] * ch.cb[i * q + j]) * hd.dt(t0 + j);
                for (yv, &xv) in yi.iter_mut().zip(hd.x(t0 + j)) {
                    *yv = *yv + w * xv;
                }
            }
            let c = hd.cv(t0 + i);
            for (pi, (yv, &xv)) in yi.iter_mut().zip(hd.x(t0 + i)).enumerate() {
                let off = ch.es[i] * dot(c, &state[pi * n..(pi + 1) * n]);
                *yv = (*yv + off) + hd.d * xv;
            }
        }
        pass_state(hd, &ch, &mut state);
    }
}

/// Task `i` of the (sequence, head) order: sequence `i / H`, head `i % H`.
fn heads<'a, F: Float>(
    u: &'a [F],
    dt: &'a [F],
    a: &'a [F],
    d: &'a [F],
    dm: SsdDims,
    i: usize,
) -> Head<'a, F> {
    let (seq, head) = (i / dm.h, i % dm.h);
    Head {
        u,
        dt,
        dm,
        seq,
        head,
        a: a[head],
        d: d[head],
    }
}

/// Chunked SSD forward over `nseq` sequences: `y` `[T, H*P]` (overwritten).
/// `a[h] = -exp(A_log[h])`; `d` is `D`.
pub(crate) fn ssd_fwd<F: Float>(
    u: &[F],
    dt: &[F],
    a: &[F],
    d: &[F],
    dm: SsdDims,
    nseq: usize,
    y: &mut [F],
) {
    let (l, p, e) = (dm.l, dm.p, dm.e());
    let mut ys = vec![F::ZERO; nseq * dm.h * l * p];
    ys.par_chunks_mut(l * p)
        .enumerate()
        .for_each(|(i, out)| head_fwd(&heads(u, dt, a, d, dm, i), out));
    // Head-major to token-major.
    y.par_chunks_mut(l * e).enumerate().for_each(|(b, yb)| {
        for (t, row) in yb.chunks_exact_mut(e).enumerate() {
            for h in 0..dm.h {
                let src = ((b * dm.h + h) * l + t) * p;
                row[h * p..(h + 1) * p].copy_from_slice(&ys[src..src + p]);
            }
        }
    });
}

/// The sequential recurrence (module docs), token by token: the oracle the
/// chunked scan is tested against. `y` `[T, H*P]`.
#[cfg(test)]
pub(crate) fn ssd_naive<F: Float>(
    u: &[F],
    dt: &[F],
    a: &[F],
    d: &[F],
    dm: SsdDims,
    nseq: usize,
    y: &mut [F],
) {
    let (p, n, e) = (dm.p, dm.n, dm.e());
    for i in 0..nseq * dm.h {
        let hd = heads(u, dt, a, d, dm, i);
        let mut st = vec![F::ZERO; p * n];
        for t in 0..dm.l {
            let (x, b, c, dtt) = (hd.x(t), hd.bv(t), hd.cv(t), hd.dt(t));
            let decay = (dtt * hd.a).exp();
            let row = &mut y[(hd.seq * dm.l + t) * e + hd.head * p..][..p];
            for pi in 0..p {
                let dx = dtt * x[pi];
                for ni in 0..n {
                    let sv = &mut st[pi * n + ni];
                    *sv = decay * *sv + dx * b[ni];
                }
                row[pi] = dot(&st[pi * n..(pi + 1) * n], c) + hd.d * x[pi];
            }
        }
    }
}

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

/// The fault of the tests' negative control: segment sums that start at
/// `a_j` instead of `a_{j+1}` (an off-by-one decay mask). Always off in a
/// build; in tests, thread-local, so only a scan run on the test's own
/// thread sees it.
#[cfg(not(test))]
mod fault {
    #[inline(always)]
    pub(super) fn wrong_mask() -> bool {
        false
    }
}

#[cfg(test)]
mod fault {
    use std::cell::Cell;

    thread_local! {
        static WRONG_MASK: Cell<bool> = const { Cell::new(false) };
    }

    pub(super) fn wrong_mask() -> bool {
        WRONG_MASK.with(Cell::get)
    }

    pub(super) fn set_wrong_mask(on: bool) {
        WRONG_MASK.with(|w| w.set(on));
    }
}

#[cfg(test)]
mod tests {
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
}

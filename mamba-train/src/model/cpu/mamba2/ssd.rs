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
//! after the parallel part. The orders of the backward's sums are stated in
//! [`backward`].

use rayon::prelude::*;

use super::super::float::Float;

mod backward;
pub(crate) use backward::{ssd_bwd, SsdGrads};

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
mod tests;

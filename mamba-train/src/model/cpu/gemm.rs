//! Dense matrix multiply for the CPU model, with a summation order that is
//! fixed by definition.
//!
//! Every output element is ONE ascending chain over the inner dimension:
//! `C[i,j] = (((0 + A[i,0]*B[0,j]) + A[i,1]*B[1,j]) + ...) + A[i,k-1]*B[k-1,j]`
//! (and, in [`Accum::Add`] mode, `C_old[i,j] + that chain`). Each element is
//! computed by exactly one thread, and vectorisation runs across *different*
//! output columns, never inside a chain, so the bits do not depend on the
//! thread count, the row split, or the instruction set chosen at run time.
//!
//! Layout: B is packed into panels of [`NR`] columns (`k x NR`, contiguous,
//! zero-padded) shared read-only by all threads; A is read in place (its rows
//! or its columns contiguous). The kernel keeps an `MR x NR` block of
//! accumulators in registers (MR = 8 with AVX-512, 4 otherwise).

use rayon::prelude::*;

use super::float::Float;
use super::simd::{self, SimdLevel};

/// Columns of C per micro-kernel call (one B panel).
pub(crate) const NR: usize = 16;
/// Rows of C per micro-kernel call with AVX-512 (32 vector registers).
const MR_WIDE: usize = 8;
/// Rows of C per micro-kernel call otherwise (16 vector registers).
const MR_NARROW: usize = 4;

/// A read-only strided matrix view: element `(i, j)` is `data[i*rs + j*cs]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MatRef<'a, F> {
    data: &'a [F],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a, F: Float> MatRef<'a, F> {
    /// Row-major `rows x cols` whose rows start `ld` elements apart.
    /// Panics when `data` is too short (a bug in the caller's shapes).
    pub(crate) fn new(data: &'a [F], rows: usize, cols: usize, ld: usize) -> Self {
        if rows > 0 && cols > 0 {
            assert!(
                cols <= ld,
                "row stride {ld} shorter than the {cols} columns"
            );
            let need = (rows - 1) * ld + cols;
            assert!(
                need <= data.len(),
                "matrix {rows}x{cols} (ld {ld}) needs {need} elements, has {}",
                data.len()
            );
        }
        MatRef {
            data,
            rows,
            cols,
            rs: ld,
            cs: 1,
        }
    }
    /// The transpose (no copy).
    pub(crate) fn t(self) -> Self {
        MatRef {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }
    #[inline(always)]
    fn at(&self, i: usize, j: usize) -> F {
        self.data[i * self.rs + j * self.cs]
    }
}

/// Whether [`gemm`] replaces C or adds the product to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Accum {
    /// `C = A B`.
    Overwrite,
    /// `C = C + (A B)`: the whole chain first, then one add.
    Add,
}

/// The backward of a linear layer `y = x . w^T` (`x` is `[rows, in]`, `w`
/// is `[out, in]`, `dy` is `[rows, out]`): `dw = dy^T . x` (overwritten,
/// row-major `[out, in]` with row stride `in`), then `dx = dy . w`, or
/// `dx += dy . w` with [`Accum::Add`] (row stride `ldx`). Two [`gemm`]s, so
/// the same bits as calling them by hand.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_bwd<F: Float>(
    dy: MatRef<'_, F>,
    x: MatRef<'_, F>,
    w: MatRef<'_, F>,
    dw: &mut [F],
    dx: &mut [F],
    ldx: usize,
    dx_accum: Accum,
    panels: &mut Vec<F>,
) {
    gemm(dy.t(), x, dw, x.cols, Accum::Overwrite, panels);
    gemm(dy, w, dx, ldx, dx_accum, panels);
}

/// `C = A B` (or `C += A B`), C row-major `a.rows x b.cols` with row stride
/// `ldc`; columns of C beyond `b.cols` are not touched. `panels` is scratch
/// for packing B (reused between calls to avoid fresh allocations). Runs on
/// the current rayon pool; the result is the same for every pool size and
/// instruction set (module docs).
pub(crate) fn gemm<F: Float>(
    a: MatRef<'_, F>,
    b: MatRef<'_, F>,
    c: &mut [F],
    ldc: usize,
    accum: Accum,
    panels: &mut Vec<F>,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(
        b.rows, k,
        "inner dimensions differ: A is {m}x{k}, B is {}x{n}",
        b.rows
    );
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        ldc >= n && (m - 1) * ldc + n <= c.len(),
        "C too small for {m}x{n} with ldc {ldc}"
    );
    let c_len = (m * ldc).min(c.len());
    let c = &mut c[..c_len];
    if k == 0 {
        if accum == Accum::Overwrite {
            for i in 0..m {
                c[i * ldc..i * ldc + n].fill(F::ZERO);
            }
        }
        return;
    }
    // A is read in place: its rows or its columns are contiguous (every
    // view `MatRef` can build is one or the other).
    let (adata, lda, col_major) = if a.cs == 1 {
        (a.data, a.rs, false)
    } else {
        (a.data, a.cs, true)
    };
    debug_assert!(a.cs == 1 || a.rs == 1);
    pack_panels(b, panels);
    let threads = rayon::current_num_threads().max(1);
    let by_threads = m.div_ceil(4 * threads);
    let by_work = (1usize << 16).div_ceil(k * n);
    let task_rows = by_threads.max(by_work).div_ceil(MR_WIDE) * MR_WIDE;
    let job = GemmJob {
        adata,
        lda,
        col_major,
        bp: &panels[..],
        k,
        n,
        ldc,
        accum,
    };
    c.par_chunks_mut(task_rows * ldc)
        .enumerate()
        .for_each(|(t, chunk)| {
            let row0 = t * task_rows;
            let rows = task_rows.min(m - row0);
            job.run(row0, rows, chunk);
        });
}

/// B as `ceil(n/NR)` panels of `k x NR` (into `bp`), zero-padded past
/// column `n`.
fn pack_panels<F: Float>(b: MatRef<'_, F>, bp: &mut Vec<F>) {
    let (k, n) = (b.rows, b.cols);
    let npan = n.div_ceil(NR);
    bp.clear();
    bp.resize(npan * k * NR, F::ZERO);
    bp.par_chunks_mut(k * NR)
        .enumerate()
        .for_each(|(pan, panel)| {
            let j0 = pan * NR;
            let w = NR.min(n - j0);
            if b.cs == 1 {
                for (p, dst) in panel.chunks_exact_mut(NR).enumerate() {
                    let src = &b.data[p * b.rs + j0..p * b.rs + j0 + w];
                    match <&[F; NR]>::try_from(src) {
                        Ok(full) => *<&mut [F; NR]>::try_from(dst).expect("NR-sized chunk") = *full,
                        Err(_) => dst[..w].copy_from_slice(src),
                    }
                }
            } else {
                for j in 0..w {
                    for p in 0..k {
                        panel[p * NR + j] = b.at(p, j0 + j);
                    }
                }
            }
        });
}

/// Everything a row task needs (shared, read-only).
struct GemmJob<'a, F> {
    /// A: row `i`, column `p` at `i*lda + p`, or at `p*lda + i` when
    /// `col_major`.
    adata: &'a [F],
    lda: usize,
    col_major: bool,
    bp: &'a [F],
    k: usize,
    n: usize,
    ldc: usize,
    accum: Accum,
}

impl<F: Float> GemmJob<'_, F> {
    /// Rows `row0 .. row0+rows` of C; `chunk` starts at row `row0`.
    fn run(&self, row0: usize, rows: usize, chunk: &mut [F]) {
        #[cfg(target_arch = "x86_64")]
        {
            if simd::allowed(SimdLevel::Avx512) {
                // SAFETY: the CPU supports AVX-512F (checked by `allowed`).
                unsafe { self.run_avx512(row0, rows, chunk) };
                return;
            }
            if simd::allowed(SimdLevel::Avx2) {
                // SAFETY: the CPU supports AVX2 (checked by `allowed`).
                unsafe { self.run_avx2(row0, rows, chunk) };
                return;
            }
        }
        self.rows::<MR_NARROW>(row0, rows, chunk);
    }

    /// [`Self::rows`] compiled with AVX-512F, 8-row blocks.
    #[cfg(target_arch = "x86_64")]
    ///
    /// # Safety
    /// The CPU must support AVX-512F (`unsafe fn` keeps the crate's MSRV,
    /// 1.85, which requires it for `target_feature`).
    #[target_feature(enable = "avx512f")]
    unsafe fn run_avx512(&self, row0: usize, rows: usize, chunk: &mut [F]) {
        self.rows::<MR_WIDE>(row0, rows, chunk);
    }

    /// [`Self::rows`] compiled with AVX2, 4-row blocks.
    #[cfg(target_arch = "x86_64")]
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn run_avx2(&self, row0: usize, rows: usize, chunk: &mut [F]) {
        self.rows::<MR_NARROW>(row0, rows, chunk);
    }

    /// Blocks of `MR` rows, then of 4, then single rows. The block size changes only
    /// which elements are computed together, never an element's chain.
    #[inline(always)]
    fn rows<const MR: usize>(&self, row0: usize, rows: usize, chunk: &mut [F])
    where
        Micro: Kernel<MR>,
    {
        let mut i = 0;
        while i + MR <= rows {
            self.block::<MR>(row0, i, chunk);
            i += MR;
        }
        while i + MR_NARROW <= rows {
            self.block::<MR_NARROW>(row0, i, chunk);
            i += MR_NARROW;
        }
        while i < rows {
            self.block::<1>(row0, i, chunk);
            i += 1;
        }
    }

    /// Rows `i .. i+R` of the chunk against every panel.
    #[inline(always)]
    fn block<const R: usize>(&self, row0: usize, i: usize, chunk: &mut [F])
    where
        Micro: Kernel<R>,
    {
        let k = self.k;
        let first = row0 + i;
        for (pan, panel) in self.bp.chunks_exact(k * NR).enumerate() {
            let acc = if self.col_major {
                let acols = &self.adata[first..first + (k - 1) * self.lda + R];
                let lda = self.lda;
                Micro::run(panel, |p| {
                    *<&[F; R]>::try_from(&acols[p * lda..p * lda + R]).expect("R values")
                })
            } else {
                let arows: [&[F]; R] = std::array::from_fn(|r| {
                    let s = (first + r) * self.lda;
                    &self.adata[s..s + k]
                });
                Micro::run(panel, |p| std::array::from_fn(|r| arows[r][p]))
            };
            let j0 = pan * NR;
            let w = NR.min(self.n - j0);
            for (r, acc_r) in acc.iter().enumerate() {
                let s = (i + r) * self.ldc + j0;
                let crow = &mut chunk[s..s + w];
                match self.accum {
                    Accum::Overwrite => {
                        for (cv, &av) in crow.iter_mut().zip(acc_r) {
                            *cv = av;
                        }
                    }
                    Accum::Add => {
                        for (cv, &av) in crow.iter_mut().zip(acc_r) {
                            *cv = *cv + av;
                        }
                    }
                }
            }
        }
    }
}

/// The register-blocked inner kernel for `R` rows.
struct Micro;

/// `acc[r][j] = sum_p a(p)[r] * panel[p][j]`, one chain per `(r, j)` in
/// ascending `p` from 0. Each row's update is written out separately
/// (constant indices) so the accumulators stay in registers.
trait Kernel<const R: usize> {
    fn run<F: Float>(panel: &[F], a: impl Fn(usize) -> [F; R]) -> [[F; NR]; R];
}

/// `acc = acc + a * b` across one panel row.
#[inline(always)]
fn axpy<F: Float>(acc: &mut [F; NR], a: F, b: &[F; NR]) {
    for j in 0..NR {
        acc[j] = acc[j] + a * b[j];
    }
}

macro_rules! kernel {
    ($r:literal: $($i:literal)+) => {
        impl Kernel<$r> for Micro {
            #[inline(always)]
            fn run<F: Float>(panel: &[F], a: impl Fn(usize) -> [F; $r]) -> [[F; NR]; $r] {
                let mut acc = [[F::ZERO; NR]; $r];
                for (p, bv) in panel.chunks_exact(NR).enumerate() {
                    let bv: &[F; NR] = bv.try_into().expect("chunks_exact yields NR elements");
                    let av = a(p);
                    $( axpy(&mut acc[$i], av[$i], bv); )+
                }
                acc
            }
        }
    };
}
kernel!(1: 0);
kernel!(4: 0 1 2 3);
kernel!(8: 0 1 2 3 4 5 6 7);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seed::Rng;
    use proptest::prelude::*;

    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut r = Rng::new(seed);
        (0..n).map(|_| (r.next_f64() * 2.0 - 1.0) as f32).collect()
    }

    /// The defining chain, written the obvious way.
    fn naive(a: MatRef<'_, f32>, b: MatRef<'_, f32>, c: &mut [f32], ldc: usize, accum: Accum) {
        for i in 0..a.rows {
            for j in 0..b.cols {
                let mut s = 0.0f32;
                for p in 0..a.cols {
                    s += a.at(i, p) * b.at(p, j);
                }
                let o = &mut c[i * ldc + j];
                *o = if accum == Accum::Add { *o + s } else { s };
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Bit-identical to the naive chain for every shape, transposition,
        /// stride, accumulate mode and thread count.
        #[test]
        fn gemm_equals_the_defining_chain_bit_for_bit(
            m in 1usize..23, k in 0usize..40, n in 1usize..37,
            ta in any::<bool>(), tb in any::<bool>(), add in any::<bool>(),
            pad in 0usize..3, threads in 1usize..4, seed in any::<u64>(),
        ) {
            let a_store = rand_vec(m * k + 8, seed);
            let b_store = rand_vec(k * n + 8, seed ^ 1);
            let a = if ta { MatRef::new(&a_store, k, m, m).t() } else { MatRef::new(&a_store, m, k, k) };
            let b = if tb { MatRef::new(&b_store, n, k, k).t() } else { MatRef::new(&b_store, k, n, n) };
            let ldc = n + pad;
            let accum = if add { Accum::Add } else { Accum::Overwrite };
            let c0 = rand_vec(m * ldc, seed ^ 2);
            let mut want = c0.clone();
            naive(a, b, &mut want, ldc, accum);
            let mut got = c0.clone();
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| gemm(a, b, &mut got, ldc, accum, &mut Vec::new()));
            let wb: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
            let gb: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
            prop_assert_eq!(wb, gb);
        }
    }

    /// Negative control for the test above: a different association of the
    /// same sum (pairwise halves) does change bits, so bit equality with the
    /// chain is a real constraint.
    #[test]
    fn a_different_summation_order_changes_bits() {
        let k = 512;
        let a = rand_vec(k, 5);
        let b = rand_vec(k, 6);
        let mut c = [0.0f32];
        gemm(
            MatRef::new(&a, 1, k, k),
            MatRef::new(&b, k, 1, 1),
            &mut c,
            1,
            Accum::Overwrite,
            &mut Vec::new(),
        );
        let half = |r: std::ops::Range<usize>| r.fold(0.0f32, |s, p| s + a[p] * b[p]);
        let pairwise = half(0..k / 2) + half(k / 2..k);
        assert_ne!(c[0].to_bits(), pairwise.to_bits());
    }
}

#[cfg(test)]
mod bench {
    use super::*;
    #[test]
    #[ignore]
    fn gemm_speed() {
        let shapes: &[(&str, usize, usize, usize, bool, bool)] = &[
            ("fwd in_proj", 2048, 64, 256, false, true),
            ("fwd out_proj", 2048, 128, 64, false, true),
            ("fwd x_proj", 2048, 128, 36, false, true),
            ("bwd dX in_proj", 2048, 256, 64, false, false),
            ("bwd dW in_proj", 256, 2048, 64, true, false),
            ("bwd dW out_proj", 64, 2048, 128, true, false),
            ("bwd dW x_proj", 36, 2048, 128, true, false),
        ];
        for &(name, m, k, n, ta, tb) in shapes {
            let a = vec![0.5f32; m * k];
            let b = vec![0.25f32; k * n];
            let mut c = vec![0.0f32; m * n];
            let am = if ta {
                MatRef::new(&a, k, m, m).t()
            } else {
                MatRef::new(&a, m, k, k)
            };
            let bm = if tb {
                MatRef::new(&b, n, k, k).t()
            } else {
                MatRef::new(&b, k, n, n)
            };
            let reps = 50;
            let mut scratch = Vec::new();
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                gemm(am, bm, &mut c, n, Accum::Overwrite, &mut scratch);
            }
            let s = t0.elapsed().as_secs_f64() / reps as f64;
            eprintln!(
                "{name:18} {m}x{k}x{n}: {:.3} ms, {:.1} GFLOP/s",
                s * 1e3,
                2.0 * (m * k * n) as f64 / s / 1e9
            );
        }
    }
}

//! The model's GEMM handle (`Blas`) alone on the GPU, in tf32 and bf16,
//! where its calls go through cuBLASLt with one algorithm per problem
//! chosen at the problem's first call: each product against an f64 host
//! product of the same operands (bf16: of their bf16 roundings, the values
//! the tensor cores multiply), both transposes, `beta` 1 accumulation, a
//! bf16 output, and operands at element offsets that leave them 4- or
//! 2-byte aligned (a smaller alignment class, so another problem). The same
//! call twice gives the same bits, and the record names each problem once.
//! Skips (printing why) without a GPU unless `MAMBA_REQUIRE_GPU=1`.

mod cuda_common;

use cuda_common::kernels_on_device0;
use kernels::mamba::{bf16_to_f32, f32_to_bf16_rne};
use mamba_train::config::Precision;
use mamba_train::model::cuda::blas::{Blas, Elems, GemmOut, Operand};
use mamba_train::seed::Rng;

struct Case {
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
    /// Element offset of A and B inside their buffers.
    offset: usize,
    beta: f32,
}

fn host(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| (r.next_f64() * 2.0 - 1.0) as f32).collect()
}

/// Row-major `op(A) op(B)` in f64 (`round` applied to each operand first).
fn reference(c: &Case, a: &[f32], b: &[f32], round: impl Fn(f32) -> f32) -> Vec<f64> {
    let (lda, ldb) = (if c.ta { c.m } else { c.k }, if c.tb { c.k } else { c.n });
    let mut out = vec![0.0f64; c.m * c.n];
    for i in 0..c.m {
        for j in 0..c.n {
            let mut s = 0.0f64;
            for p in 0..c.k {
                let av = if c.ta { a[p * lda + i] } else { a[i * lda + p] };
                let bv = if c.tb { b[j * ldb + p] } else { b[p * ldb + j] };
                s += round(av) as f64 * round(bv) as f64;
            }
            out[i * c.n + j] = s;
        }
    }
    out
}

fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den.max(1e-300)).sqrt()
}

#[test]
fn tf32_and_bf16_gemms_run_one_recorded_algorithm_per_problem() {
    let Some((ctx, kernels)) = kernels_on_device0() else {
        return;
    };
    let s = ctx.default_stream();
    let cases = [
        Case {
            m: 33,
            n: 17,
            k: 65,
            ta: false,
            tb: true,
            offset: 0,
            beta: 0.0,
        },
        Case {
            m: 64,
            n: 80,
            k: 128,
            ta: true,
            tb: false,
            offset: 0,
            beta: 1.0,
        },
        Case {
            m: 128,
            n: 48,
            k: 256,
            ta: false,
            tb: false,
            offset: 1,
            beta: 0.0,
        },
        Case {
            m: 7,
            n: 300,
            k: 96,
            ta: true,
            tb: true,
            offset: 3,
            beta: 1.0,
        },
    ];
    for precision in [Precision::Tf32, Precision::Bf16] {
        let blas = Blas::with_precision(&s, precision, Some(kernels.clone())).expect("handle");
        let bf16 = precision == Precision::Bf16;
        let round = |x: f32| {
            if bf16 {
                bf16_to_f32(f32_to_bf16_rne(x))
            } else {
                x
            }
        };
        for (i, c) in cases.iter().enumerate() {
            let (a_len, b_len) = (c.m * c.k, c.k * c.n);
            let a = host(a_len + c.offset, 10 + i as u64);
            let b = host(b_len + c.offset, 20 + i as u64);
            let c0 = host(c.m * c.n, 30 + i as u64);
            let (da, db) = (s.clone_htod(&a).unwrap(), s.clone_htod(&b).unwrap());
            let (lda, ldb) = (if c.ta { c.m } else { c.k }, if c.tb { c.k } else { c.n });
            let run = || -> Vec<f32> {
                let mut dc = s.clone_htod(&c0).unwrap();
                blas.gemm(
                    "test",
                    c.m,
                    c.n,
                    c.k,
                    Operand {
                        elems: Elems::F32(da.slice(c.offset..)),
                        ld: lda,
                        trans: c.ta,
                    },
                    Operand {
                        elems: Elems::F32(db.slice(c.offset..)),
                        ld: ldb,
                        trans: c.tb,
                    },
                    c.beta,
                    &mut dc.as_view_mut(),
                    c.n,
                )
                .expect("gemm");
                s.clone_dtoh(&dc).unwrap()
            };
            let got = run();
            let again = run();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&got),
                bits(&again),
                "{precision} case {i}: same bits twice"
            );
            let mut want = reference(c, &a[c.offset..], &b[c.offset..], round);
            for (w, &c0) in want.iter_mut().zip(&c0) {
                *w += c.beta as f64 * c0 as f64;
            }
            let got64: Vec<f64> = got.iter().map(|&x| x as f64).collect();
            // bf16: exact products of the rounded operands, f32 sums; tf32:
            // the operands' 10-bit mantissas.
            let tol = if bf16 { 1e-5 } else { 5e-3 };
            let e = rel_err(&got64, &want);
            assert!(
                e < tol,
                "{precision} case {i}: relative error {e:.2e} >= {tol:.0e}"
            );
            // Negative control: the product without beta's addend is far off.
            if c.beta != 0.0 {
                let bare = reference(c, &a[c.offset..], &b[c.offset..], round);
                assert!(
                    rel_err(&got64, &bare) > 10.0 * tol,
                    "{precision} case {i}: beta ignored"
                );
            }
        }
        // bf16 output (beta 0): the f32 result's rounding, within one bf16 ulp.
        if bf16 {
            let c = &cases[0];
            let a = host(c.m * c.k, 40);
            let b = host(c.k * c.n, 41);
            let (da, db) = (s.clone_htod(&a).unwrap(), s.clone_htod(&b).unwrap());
            let mut dh = s.alloc_zeros::<u16>(c.m * c.n).unwrap();
            blas.gemm_into(
                "test bf16 out",
                c.m,
                c.n,
                c.k,
                Operand {
                    elems: Elems::F32(da.as_view()),
                    ld: c.k,
                    trans: false,
                },
                Operand {
                    elems: Elems::F32(db.as_view()),
                    ld: c.k,
                    trans: true,
                },
                0.0,
                GemmOut::Bf16(dh.as_view_mut()),
                c.n,
            )
            .expect("bf16 output");
            let got: Vec<f64> = s
                .clone_dtoh(&dh)
                .unwrap()
                .iter()
                .map(|&h| bf16_to_f32(h) as f64)
                .collect();
            let want = reference(c, &a, &b, round);
            let e = rel_err(&got, &want);
            assert!(e < 8e-3, "bf16 output: relative error {e:.2e}");
        }
        // The record: one line per distinct problem (the bf16 output is a
        // problem of its own), however often each ran.
        let record = blas.algorithms();
        let want = cases.len() + usize::from(bf16);
        assert_eq!(record.len(), want, "{precision}: {record:#?}");
        for line in &record {
            assert!(line.contains("align"), "{line}");
        }
    }
    // f32 runs cublasSgemm and records nothing.
    let f32 = Blas::with_precision(&s, Precision::F32, None).expect("f32 handle");
    assert!(f32.algorithms().is_empty());
}

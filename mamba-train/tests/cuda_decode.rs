//! Recurrent decoding on the GPU (`CudaDecoder`) against the CPU's
//! (`CpuDecoder`, which is the CPU full forward pass's bits, see
//! `decode_parity.rs`), over a seeded random sweep of small shapes. Skips
//! (printing why) without a GPU unless `MAMBA_REQUIRE_GPU=1`.
//!
//! Reference: the CPU model's f64 full forward pass over the same tokens,
//! so each side's own f32 error is measured. Tolerance, relative L2 of a
//! sequence's logits (`||gpu - ref|| / ||ref||`): at most 8x the CPU step's
//! own f32 error on the same sequence, and never below a floor of 1e-5.
//! Why: both programs round the same operations, in different orders
//! (cuBLAS's blocking of the one-row GEMMs, `expf` against the CPU's fixed
//! polynomial), the same allowance the full CUDA forward pass gets in
//! `cuda_parity.rs` (floor 5e-6 there; doubled here because a decode step
//! also accumulates the carried state's rounding across positions). The
//! carried state itself must agree within 1e-4 relative L2 at the end.
//!
//! Negative control: the GPU logits at position t against the reference at
//! t - 1 miss the tolerance by more than 10x (the comparison can
//! fail). The GPU step is also checked against the CUDA full forward pass
//! and for run-to-run identity (after a reset, the same bits). Mamba-2
//! (one group, and 2 or 4 groups of B and C) gets the same checks against
//! its own f64 forward pass.

mod cuda_common;

use cuda_common::{cuda_model, perturbed, random_case, rel_l2};
use mamba_train::config::{Arch, SsdConfig};
use mamba_train::model::cpu::{CpuDecoder, CpuModel, Mamba2Model};
use mamba_train::model::cuda::CudaDecoder;
use mamba_train::model::{Batch, Decoder, IGNORE};
use mamba_train::seed::Rng;
use mamba_train::ModelConfig;

const FLOOR: f64 = 1e-5;
const CPU_FACTOR: f64 = 8.0;
const STATE_TOL: f64 = 1e-4;

fn run(dec: &mut dyn Decoder, toks: &[u32]) -> Vec<f32> {
    dec.reset().unwrap();
    let mut out = Vec::new();
    for &t in toks {
        out.extend_from_slice(dec.step(t).unwrap());
    }
    out
}

/// One sequence of `l` random tokens through the CUDA and the CPU decoders
/// of `cfg` (perturbed weights of `seed`), against `reference`, the f64
/// full forward pass's logits (module docs: tolerance, state, the CUDA
/// forward pass, rerun, negative control). Returns the GPU's error, or
/// `None` when this machine skips.
fn check_case(
    cfg: &ModelConfig,
    seed: u64,
    l: usize,
    reference: &dyn Fn(&[f64], &Batch) -> Vec<f64>,
) -> Option<f64> {
    let model = cuda_model(cfg)?;
    let mut fwd = cuda_model(cfg)?;
    let params = perturbed(cfg, seed);
    let mut r = Rng::new(seed ^ 0xdec0de);
    let toks: Vec<u32> = (0..l)
        .map(|_| r.below(cfg.vocab_size as u64) as u32)
        .collect();
    let b = Batch {
        tokens: toks.clone(),
        targets: vec![IGNORE; l],
        batch: 1,
        seq_len: l,
    };
    let p64: Vec<f64> = params.iter().map(|&x| x as f64).collect();
    let want = reference(&p64, &b);

    let mut cpu = CpuDecoder::new(cfg.clone(), params.clone()).unwrap();
    let mut gpu = CudaDecoder::new(model, &params).unwrap();
    let got_cpu = run(&mut cpu, &toks);
    let got_gpu = run(&mut gpu, &toks);
    let (cpu_err, _) = rel_l2(&got_cpu, &want);
    let (err, bad) = rel_l2(&got_gpu, &want);
    let tol = FLOOR.max(CPU_FACTOR * cpu_err);
    println!("seed {seed} {cfg:?} l {l}: gpu {err:.2e}, cpu {cpu_err:.2e}, tol {tol:.1e}");
    assert!(
        !bad && err <= tol,
        "seed {seed}: GPU step error {err:e} > {tol:e}"
    );

    // The carried state agrees too.
    let (sc, sg) = (cpu.snapshot().unwrap(), gpu.snapshot().unwrap());
    let as64 = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let (e_conv, _) = rel_l2(&sg.conv, &as64(&sc.conv));
    let (e_ssm, _) = rel_l2(&sg.ssm, &as64(&sc.ssm));
    assert!(
        e_conv <= STATE_TOL && e_ssm <= STATE_TOL,
        "seed {seed}: state conv {e_conv:e} ssm {e_ssm:e}"
    );

    // Against the CUDA full forward pass over the same prefix.
    let full = fwd.logits_host(&params, &b).unwrap();
    let full64: Vec<f64> = full.iter().map(|&x| x as f64).collect();
    let (e_full, _) = rel_l2(&got_gpu, &full64);
    assert!(
        e_full <= 2.0 * tol,
        "seed {seed}: step vs CUDA forward {e_full:e}"
    );

    // Run to run: the same bits after a reset.
    assert_eq!(run(&mut gpu, &toks), got_gpu, "seed {seed}: rerun");

    // Negative control: position t against the reference at t - 1.
    if l > 2 {
        let v = cfg.vocab_size;
        let (shift, _) = rel_l2(&got_gpu[v..], &want[..(l - 1) * v]);
        assert!(shift > 10.0 * tol, "seed {seed}: shifted {shift:e}");
    }
    Some(err)
}

#[test]
fn cuda_recurrent_step_matches_the_cpu_step() {
    let mut worst = 0.0f64;
    for seed in 0..24u64 {
        let (cfg, _, l) = random_case(seed);
        let reference = |p: &[f64], b: &Batch| {
            CpuModel::new(cfg.clone())
                .unwrap()
                .logits_f64(p, b)
                .unwrap()
        };
        let Some(err) = check_case(&cfg, seed, l, &reference) else {
            return;
        };
        worst = worst.max(err);
    }
    println!("worst GPU decode error {worst:.2e}");
}

/// Mamba-2: the same checks against the Mamba-2 f64 forward pass, over
/// heads of 8 and 4 channels, d_state 16 and 64, conv 4 and 2, 1, 2 and 4
/// groups of B and C, and sequences that end mid-chunk of the CPU's scan.
#[test]
fn cuda_mamba2_recurrent_step_matches_the_cpu_step() {
    let mut worst = 0.0f64;
    for (seed, (d, n, hd, conv, l, groups)) in [
        (16, 16, 8, 4, 23, 1),
        (16, 64, 4, 2, 17, 1),
        (24, 8, 16, 3, 30, 1),
        (16, 16, 8, 4, 21, 2),
        (16, 12, 4, 3, 19, 4),
    ]
    .into_iter()
    .enumerate()
    {
        let mut cfg = ModelConfig::mamba2(29, d, 2);
        cfg.d_state = n;
        cfg.d_conv = conv;
        cfg.arch = Arch::Mamba2(SsdConfig {
            head_dim: hd,
            n_groups: groups,
            chunk_size: 8,
        });
        let reference = |p: &[f64], b: &Batch| {
            Mamba2Model::new(cfg.clone())
                .unwrap()
                .logits_f64(p, b)
                .unwrap()
        };
        let Some(err) = check_case(&cfg, 100 + seed as u64, l, &reference) else {
            return;
        };
        worst = worst.max(err);
    }
    println!("worst GPU Mamba-2 decode error {worst:.2e}");
}

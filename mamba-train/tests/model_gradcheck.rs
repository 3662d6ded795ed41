//! Gradients of the CPU model: f64 analytic gradients against central finite
//! differences for every parameter tensor, and f32 against f64.

mod common;
mod cuda_common;

use common::gradcheck;
use cuda_common::batch;
use mamba_train::model::cpu::CpuModel;
use mamba_train::ModelConfig;

/// A small model with non-default d_state, d_conv and dt_rank so that shape
/// mix-ups cannot cancel out; d_inner = 20 is not a multiple of the scan's
/// channel block.
fn small() -> ModelConfig {
    ModelConfig {
        vocab_size: 11,
        d_model: 10,
        n_layer: 2,
        d_state: 4,
        d_conv: 3,
        expand: 2,
        dt_rank: 2,
        arch: Default::default(),
    }
}

/// Reference init plus noise, in f64 ([`gradcheck::perturbed`]).
fn perturbed(model: &CpuModel, seed: u64) -> Vec<f64> {
    gradcheck::perturbed(&model.init_params(seed), seed)
}

/// Central-difference check of every tensor of `cfg` (7 sampled entries
/// each). Returns the worst error as a fraction of the tolerance.
fn check_every_tensor(cfg: ModelConfig, nseq: usize, l: usize) -> f64 {
    let model = CpuModel::new(cfg.clone()).unwrap();
    let b = batch(&cfg, nseq, l, 3);
    let mut p = perturbed(&model, 5);
    let mut g = vec![f64::NAN; p.len()];
    let loss = model.forward_backward_f64(&p, &b, &mut g).unwrap();
    assert!(loss.is_finite() && loss > 0.0);
    assert!(
        g.iter().all(|v| v.is_finite()),
        "every gradient element is written"
    );
    assert_eq!(
        loss,
        model.loss_f64(&p, &b).unwrap(),
        "forward_backward and loss agree"
    );

    let loss_at = |p: &[f64]| model.loss_f64(p, &b).unwrap();
    let (worst, _) = gradcheck::check_sampled(model.layout(), &mut p, &g, 5, loss_at);
    worst
}

#[test]
fn f64_gradients_match_central_differences_for_every_tensor() {
    let worst = check_every_tensor(small(), 2, 9);
    eprintln!("worst error / tolerance = {worst:.3}");
}

/// Odd shapes: a conv wider than the sequence and than the stack-held taps,
/// d_inner 18 (one full and one 2-lane scan block), expand 3, d_state 17,
/// dt_rank 1, one layer.
#[test]
fn f64_gradients_match_central_differences_for_odd_shapes() {
    let cfg = ModelConfig {
        vocab_size: 7,
        d_model: 6,
        n_layer: 1,
        d_state: 17,
        d_conv: 10,
        expand: 3,
        dt_rank: 1,
        arch: Default::default(),
    };
    let worst = check_every_tensor(cfg, 3, 8);
    eprintln!("worst error / tolerance = {worst:.3}");
}

#[test]
fn f32_gradients_track_the_f64_twin() {
    let cfg = ModelConfig {
        vocab_size: 16,
        d_model: 24,
        n_layer: 2,
        d_state: 8,
        d_conv: 4,
        expand: 2,
        dt_rank: 2,
        arch: Default::default(),
    };
    let model = CpuModel::new(cfg.clone()).unwrap();
    let b = batch(&cfg, 3, 20, 8);
    let p32: Vec<f32> = perturbed(&model, 11).iter().map(|&v| v as f32).collect();
    let p64: Vec<f64> = p32.iter().map(|&v| v as f64).collect();
    let mut g32 = vec![f32::NAN; p32.len()];
    let mut g64 = vec![f64::NAN; p64.len()];
    let l32 = model.forward_backward(&p32, &b, &mut g32).unwrap();
    let l64 = model.forward_backward_f64(&p64, &b, &mut g64).unwrap();
    assert!(
        (l32 as f64 - l64).abs() < 1e-5 * l64,
        "loss f32 {l32} vs f64 {l64}"
    );
    let mut worst = 0.0f64;
    for e in model.layout().entries() {
        let r = e.range();
        let num: f64 = g32[r.clone()]
            .iter()
            .zip(&g64[r.clone()])
            .map(|(&a, &b)| (a as f64 - b).powi(2))
            .sum();
        let den: f64 = g64[r].iter().map(|b| b * b).sum();
        assert!(den > 0.0, "{} has an all-zero gradient", e.name);
        let rel = (num / den).sqrt();
        worst = worst.max(rel);
        assert!(
            rel < 1e-5,
            "{}: f32 gradient differs from f64 by {rel:e} (relative L2)",
            e.name
        );
    }
    eprintln!("worst per-tensor relative L2 difference f32 vs f64: {worst:e}");
}

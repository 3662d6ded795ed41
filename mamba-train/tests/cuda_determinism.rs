//! Run-to-run determinism of the CUDA path, on the GPU: the same parameters
//! and batch give the same loss and gradient bits (SHA-256 digests) on
//! repeated calls, on a fresh model (new cuBLAS handle, new workspace), and
//! after the workspace was rebuilt for another shape; the device optimizer
//! reproduces the CPU optimizer bit for bit; a few training steps replay
//! bit for bit. Skips (printing why) without a GPU unless
//! `MAMBA_REQUIRE_GPU=1`.

mod cuda_common;

use cuda_common::{batch, cuda_model, digest, perturbed};
use cudarc::driver::CudaSlice;
use mamba_train::model::cuda::CudaModel;
use mamba_train::model::Batch;
use mamba_train::optim::{AdamWConfig, HostMath, Optimizer, Schedule};
use mamba_train::seed::Rng;
use mamba_train::ModelConfig;

/// Big enough for several scan chunks, backward channel rounds and
/// column-sum slabs: d_inner 256, 300 rows.
fn cfg() -> ModelConfig {
    ModelConfig::new(300, 128, 2)
}

fn run(model: &mut CudaModel, p: &[f32], b: &Batch) -> (u32, String) {
    let p = model.upload(p).expect("upload");
    let mut g = model.zeros_arena().expect("grads");
    let loss = model
        .forward_backward(&p, b, &mut g)
        .expect("forward_backward");
    (
        loss.to_bits(),
        digest(&model.download(&g).expect("download")),
    )
}

#[test]
fn same_inputs_give_the_same_bits_every_run() {
    let cfg = cfg();
    let Some(mut model) = cuda_model(&cfg) else {
        return;
    };
    let p = perturbed(&cfg, 1);
    let b = batch(&cfg, 2, 150, 2);
    let first = run(&mut model, &p, &b);
    for i in 0..3 {
        assert_eq!(
            run(&mut model, &p, &b),
            first,
            "repeat {i} on the same model differs"
        );
    }
    // Another shape rebuilds the workspace; coming back must not matter.
    let other = batch(&cfg, 1, 17, 3);
    let _ = run(&mut model, &p, &other);
    assert_eq!(run(&mut model, &p, &b), first, "after a workspace rebuild");
    // A fresh model: new modules, cuBLAS handle and workspace.
    let mut fresh = cuda_model(&cfg).expect("second model");
    assert_eq!(run(&mut fresh, &p, &b), first, "a fresh model differs");
    // Negative control: one token changed must change the digest.
    let mut b2 = b.clone();
    b2.tokens[7] = (b2.tokens[7] + 1) % cfg.vocab_size as u32;
    assert_ne!(
        run(&mut model, &p, &b2).1,
        first.1,
        "the digest did not see a changed token"
    );
    eprintln!("loss bits {:08x}, grads sha256 {}", first.0, first.1);
}

fn random(n: usize, seed: u64, scale: f64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| (r.normal() * scale) as f32).collect()
}

/// A fresh optimizer with its moments on `model`'s device.
fn device_optimizer(
    model: &CudaModel,
    adam: AdamWConfig,
    sched: Schedule,
) -> Optimizer<CudaSlice<f32>> {
    let zeros = || model.zeros_arena().expect("moments");
    Optimizer::fresh(adam, sched, model.layout(), zeros(), zeros()).expect("device optimizer")
}

#[test]
fn device_optimizer_matches_the_cpu_optimizer_bit_for_bit() {
    let cfg = ModelConfig::new(500, 64, 2); // > 2 norm chunks of 16384
    let Some(mut model) = cuda_model(&cfg) else {
        return;
    };
    let n = model.layout().len();
    assert!(n > 2 * mamba_train::optim::clip::NORM_CHUNK);
    let adam = AdamWConfig::default();
    let sched = Schedule {
        peak_lr: 1e-2,
        warmup_steps: 2,
        total_steps: 10,
        min_lr_frac: 0.1,
    };
    let mut cpu = Optimizer::new(adam, sched, model.layout()).expect("cpu optimizer");
    let mut gpu = device_optimizer(&model, adam, sched);
    let mut p_host = random(n, 1, 0.1);
    let mut p_dev = model.upload(&p_host).expect("upload");
    // Steps 0-1 small gradients (no clipping), 2-3 large ones (clipped).
    for step in 0..4u64 {
        let scale = if step < 2 { 1e-4 } else { 1.0 };
        let g = random(n, 10 + step, scale);
        let g_dev = model.upload(&g).expect("upload grads");
        let want = cpu
            .step(&mut HostMath, step, &mut p_host, &g, true)
            .expect("cpu step");
        let got = gpu
            .step(&mut model, step, &mut p_dev, &g_dev, true)
            .expect("gpu step");
        assert_eq!(
            got.grad_norm.to_bits(),
            want.grad_norm.to_bits(),
            "step {step}: norm {} vs {}",
            got.grad_norm,
            want.grad_norm
        );
        assert_eq!(
            got.clip_scale.to_bits(),
            want.clip_scale.to_bits(),
            "step {step}: clip scale"
        );
        assert_eq!(got.skipped, want.skipped);
        let p_got = model.download(&p_dev).expect("download");
        let first_diff = p_got
            .iter()
            .zip(&p_host)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert!(
            first_diff.is_none(),
            "step {step}: parameter {first_diff:?} differs from the CPU optimizer"
        );
    }
    assert!(cpu.adamw().exp_avg().iter().any(|&m| m != 0.0));
    let back = Optimizer::from_parts(
        gpu.adamw()
            .try_map_ref(|a| model.download(a))
            .expect("moments download"),
        *gpu.schedule(),
    )
    .expect("host optimizer");
    assert_eq!(back, cpu, "moments and step count round-trip bit for bit");
    // A non-finite gradient skips on both.
    let mut g = random(n, 99, 1.0);
    g[5] = f32::NAN;
    let g_dev = model.upload(&g).expect("upload");
    let before = model.download(&p_dev).expect("download");
    assert!(
        gpu.step(&mut model, 4, &mut p_dev, &g_dev, true)
            .expect("step")
            .skipped
    );
    assert_eq!(
        digest(&model.download(&p_dev).expect("download")),
        digest(&before)
    );
}

#[test]
fn training_steps_replay_bit_for_bit() {
    let cfg = ModelConfig::new(64, 32, 2);
    let sched = Schedule {
        peak_lr: 3e-3,
        warmup_steps: 1,
        total_steps: 6,
        min_lr_frac: 0.1,
    };
    let mut digests = Vec::new();
    for _ in 0..2 {
        let Some(mut model) = cuda_model(&cfg) else {
            return;
        };
        let mut p = model.init_params(42).expect("init");
        let mut g = model.zeros_arena().expect("grads");
        let mut opt = device_optimizer(&model, AdamWConfig::default(), sched);
        let mut losses = Vec::new();
        for step in 0..4u64 {
            let b = batch(&cfg, 2, 23, 1000 + step);
            let loss = model.forward_backward(&p, &b, &mut g).expect("step");
            opt.step(&mut model, step, &mut p, &g, loss.is_finite())
                .expect("update");
            losses.push(loss.to_bits());
        }
        digests.push((losses, digest(&model.download(&p).expect("download"))));
    }
    assert_eq!(digests[0], digests[1], "two identical 4-step runs differ");
}

//! ZeRO-1's arithmetic on the GPU against its CPU twin: the CUDA model's
//! `ArenaMath` over shards of the arena (views into whole arenas, moments
//! of the shard only) gives the CPU's bits for the norm's chunk sums, the
//! gathered clipping norm, the shard's weights and its moments. The GPU
//! world tests of `--shard-optimizer` are in `cuda_train.rs`.
//!
//! Skips with `skipping: <reason>` without a GPU (fails instead under
//! `MAMBA_REQUIRE_GPU=1`).

mod cuda_common;

use cuda_common::cuda_model;
use mamba_train::model::Backend;
use mamba_train::optim::{
    AdamW, AdamWConfig, ArenaMath, HostMath, Optimizer, OptimizerShards, Schedule,
};
use mamba_train::seed::Rng;
use mamba_train::ModelConfig;

fn random(n: usize, seed: u64, scale: f64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| (r.normal() * scale) as f32).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn sharded_optimizer_steps_on_the_gpu_are_the_cpu_bits() {
    // Five norm chunks, so three shards of 2, 2 and 1 chunks, with tensor
    // and decay boundaries inside them.
    let cfg = ModelConfig::new(10, 64, 2);
    let Some(mut model) = cuda_model(&cfg) else {
        return;
    };
    let n = model.layout().len();
    let shards = OptimizerShards::new(n, 3).expect("partition");
    let adam = AdamWConfig::default();
    let sched = Schedule {
        peak_lr: 1e-2,
        warmup_steps: 1,
        total_steps: 10,
        min_lr_frac: 0.1,
    };
    let layout = model.layout().clone();
    let mut cpu: Vec<Optimizer> = Vec::new();
    let mut gpu = Vec::new();
    for r in shards.ranges() {
        let z = vec![0.0f32; r.len()];
        let a = AdamW::from_shard(adam, &layout, r.clone(), z.clone(), z.clone(), 0).unwrap();
        cpu.push(Optimizer::from_parts(a, sched).unwrap());
        let (m, v) = (
            model.upload_shard(&z).unwrap(),
            model.upload_shard(&z).unwrap(),
        );
        let a = AdamW::from_shard(adam, &layout, r.clone(), m, v, 0).unwrap();
        gpu.push(Optimizer::from_parts(a, sched).unwrap());
    }
    let mut p_host = random(n, 1, 0.1);
    let mut p_dev = model.upload(&p_host).expect("upload");
    for step in 0..4u64 {
        // Steps 0-1 unclipped, 2-3 clipped.
        let g = random(n, 10 + step, if step < 2 { 1e-4 } else { 1.0 });
        let g_dev = model.upload(&g).expect("upload grads");
        let mut host_sums = Vec::new();
        let mut dev_sums = Vec::new();
        for r in shards.ranges() {
            host_sums.extend(HostMath.norm_partials(&g, r.clone()).unwrap());
            dev_sums.extend(model.norm_partials(&g_dev, r).expect("device chunk sums"));
        }
        let to_bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            to_bits(&dev_sums),
            to_bits(&host_sums),
            "step {step}: chunk sums"
        );
        for k in 0..shards.parts() {
            let want = cpu[k]
                .step_gathered(&mut HostMath, step, &mut p_host, &g, true, &mut |_| {
                    Ok(host_sums.clone())
                })
                .unwrap();
            let got = gpu[k]
                .step_gathered(&mut model, step, &mut p_dev, &g_dev, true, &mut |_| {
                    Ok(dev_sums.clone())
                })
                .expect("gpu step");
            assert_eq!(got.grad_norm.to_bits(), want.grad_norm.to_bits());
            assert_eq!(got.clip_scale.to_bits(), want.clip_scale.to_bits());
        }
        let p_got = model.download(&p_dev).expect("download");
        assert_eq!(bits(&p_got), bits(&p_host), "step {step}: weights");
    }
    for (c, g) in cpu.iter().zip(&gpu) {
        let len = g.adamw().shard().len();
        let m = model
            .shard_to_host(g.adamw().exp_avg(), len)
            .unwrap()
            .into_owned();
        let v = model
            .shard_to_host(g.adamw().exp_avg_sq(), len)
            .unwrap()
            .into_owned();
        assert_eq!(bits(&m), bits(c.adamw().exp_avg()), "first moments");
        assert_eq!(bits(&v), bits(c.adamw().exp_avg_sq()), "second moments");
        assert!(c.adamw().exp_avg().iter().any(|&x| x != 0.0));
    }
    // A shard that cuts a norm chunk is refused on the device too.
    let g_dev = model.upload(&vec![0.0; n]).unwrap();
    assert!(model.norm_partials(&g_dev, 3..n).is_err());
}

/// The chunk-sum kernel alone against the CPU's `chunk_sums`, bit for bit,
/// at lengths around its 64-element load batches and the 16 Ki-element
/// chunk (a short last chunk, a chunk of one batch plus a tail, two full
/// batches exactly, none), and from a start that is not 16-byte aligned
/// (the kernel's scalar path). The values span 2^-20 .. 2^20 so that the
/// f64 sums round, and an order other than ascending would show.
#[test]
fn device_chunk_sums_are_the_cpus_bits_at_every_length_and_alignment() {
    use cuda_common::kernels_on_device0;
    use kernels::mamba::{MambaKernels, NORM_CHUNK};
    use mamba_train::optim::chunk_sums;
    let Some((ctx, k)) = kernels_on_device0() else {
        return;
    };
    let s = ctx.default_stream();
    let mut r = Rng::new(77);
    let total = 3 * NORM_CHUNK + 200;
    let host: Vec<f32> = (0..total)
        .map(|_| (r.normal() * 2f64.powi((r.below(41) as i32) - 20)) as f32)
        .collect();
    let dev = s.clone_htod(&host).expect("upload");
    let lens = [
        0,
        1,
        63,
        64,
        65,
        128,
        200,
        NORM_CHUNK - 1,
        NORM_CHUNK,
        NORM_CHUNK + 64 + 5,
        2 * NORM_CHUNK + 130,
        3 * NORM_CHUNK + 199,
    ];
    for start in [0usize, 1] {
        for &n in &lens {
            let want = chunk_sums(&host[start..start + n]);
            let chunks = MambaKernels::grad_sumsq_chunks_len(n);
            assert_eq!(chunks, want.len(), "n = {n}: chunk count");
            let mut part = s.alloc_zeros::<f64>(chunks.max(1)).expect("alloc");
            k.grad_sumsq_chunks(
                &s,
                &dev.slice(start..start + n),
                n,
                &mut part.slice_mut(0..chunks),
            )
            .expect("chunk sums");
            let got = s.clone_dtoh(&part.slice(0..chunks)).expect("download");
            let b = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(b(&got), b(&want), "start {start}, n = {n}");
        }
    }
    // Too short an output is refused, naming it.
    let mut part = s.alloc_zeros::<f64>(1).expect("alloc");
    let err = k
        .grad_sumsq_chunks(
            &s,
            &dev.slice(0..2 * NORM_CHUNK),
            2 * NORM_CHUNK,
            &mut part.slice_mut(..),
        )
        .expect_err("one slot for two chunks");
    assert!(err.to_string().contains("partial"), "{err}");
}

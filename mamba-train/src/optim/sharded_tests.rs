//! ZeRO-1 at the optimizer level: a step over shards (each owner's moments
//! only, the norm from every shard's chunk sums) is the unsharded step bit
//! for bit, for random chunk-aligned partitions; the naive per-shard norm
//! is not.

use std::ops::Range;

use proptest::prelude::*;

use super::clip::NORM_CHUNK;
use super::*;
use crate::config::ModelConfig;
use crate::seed::Rng;

fn layout() -> ParamLayout {
    // Several norm chunks, with tensor (and decay) boundaries inside them.
    ParamLayout::new(&ModelConfig::new(300, 64, 2))
}

fn sched() -> Schedule {
    Schedule {
        peak_lr: 1e-2,
        warmup_steps: 1,
        total_steps: 10,
        min_lr_frac: 0.1,
    }
}

fn random(n: usize, seed: u64, scale: f64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| (r.normal() * scale) as f32).collect()
}

/// The shards between chunk-index cut points `cuts` (ascending, within the
/// chunk count), as element ranges.
fn shards_at(cuts: &[usize], len: usize) -> Vec<Range<usize>> {
    let chunks = len.div_ceil(NORM_CHUNK);
    let mut bounds = vec![0];
    bounds.extend(cuts.iter().map(|&c| c.min(chunks)));
    bounds.push(chunks);
    bounds
        .windows(2)
        .map(|w| (w[0] * NORM_CHUNK).min(len)..(w[1] * NORM_CHUNK).min(len))
        .collect()
}

struct Outcome {
    params: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    norms: Vec<u64>,
}

/// Three steps (gradients large enough that clipping acts) over the
/// shards `shards`, each with its own optimizer; `global` chooses whether
/// each shard's norm comes from every shard's chunk sums (ZeRO-1) or from
/// its own alone (the naive, wrong, per-shard norm).
fn run(shards: &[Range<usize>], global: bool) -> Outcome {
    let l = layout();
    let n = l.len();
    let cfg = AdamWConfig::default();
    let mut opts: Vec<Optimizer> = shards
        .iter()
        .map(|r| {
            let z = || vec![0.0f32; r.len()];
            let adamw = AdamW::from_shard(cfg, &l, r.clone(), z(), z(), 0).unwrap();
            Optimizer::from_parts(adamw, sched()).unwrap()
        })
        .collect();
    let mut params = random(n, 1, 0.1);
    let mut norms = Vec::new();
    for step in 0..3u64 {
        let g = random(n, 10 + step, 5.0);
        let all: Vec<f64> = shards
            .iter()
            .flat_map(|r| HostMath.norm_partials(&g, r.clone()).unwrap())
            .collect();
        for (k, opt) in opts.iter_mut().enumerate() {
            let out = opt
                .step_gathered(&mut HostMath, step, &mut params, &g, true, &mut |own| {
                    Ok(if global { all.clone() } else { own })
                })
                .unwrap();
            assert!(!out.skipped);
            assert!(out.clip_scale < 1.0, "clipping must act in this test");
            if k == 0 {
                norms.push(out.grad_norm.to_bits());
            }
        }
    }
    let cat = |f: fn(&AdamW) -> &Vec<f32>| -> Vec<f32> {
        opts.iter()
            .flat_map(|o| f(o.adamw()).iter().copied())
            .collect()
    };
    Outcome {
        m: cat(|a| a.exp_avg()),
        v: cat(|a| a.exp_avg_sq()),
        params,
        norms,
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn sharded_steps_over_random_chunk_aligned_partitions_are_the_unsharded_bits(
        mut cuts in proptest::collection::vec(0usize..6, 0..5)
    ) {
        cuts.sort_unstable();
        let n = layout().len();
        let whole = run(std::slice::from_ref(&(0..n)), true);
        let sharded = run(&shards_at(&cuts, n), true);
        prop_assert_eq!(bits(&sharded.params), bits(&whole.params));
        prop_assert_eq!(bits(&sharded.m), bits(&whole.m));
        prop_assert_eq!(bits(&sharded.v), bits(&whole.v));
        prop_assert_eq!(&sharded.norms, &whole.norms);
        // And the whole-arena shard is the plain step.
        let l = layout();
        let mut plain = Optimizer::new(AdamWConfig::default(), sched(), &l).unwrap();
        let mut p = random(n, 1, 0.1);
        for step in 0..3u64 {
            plain.step(&mut HostMath, step, &mut p, &random(n, 10 + step, 5.0), true).unwrap();
        }
        prop_assert_eq!(bits(&p), bits(&whole.params));
    }
}

/// Negative control: each owner clipping by the norm of its own shard
/// gives other weights, so the sharded test above can fail.
#[test]
fn the_naive_per_shard_norm_changes_the_bits() {
    let n = layout().len();
    let whole = run(std::slice::from_ref(&(0..n)), true);
    let naive = run(&shards_at(&[1, 3], n), false);
    assert_ne!(bits(&naive.params), bits(&whole.params));
    assert_ne!(naive.norms, whole.norms);
}

#[test]
fn shards_that_cut_a_norm_chunk_or_miss_their_moments_are_refused() {
    let l = layout();
    let n = l.len();
    let g = vec![0.0f32; n];
    assert!(HostMath.norm_partials(&g, 0..NORM_CHUNK).is_ok());
    let e = HostMath.norm_partials(&g, 5..NORM_CHUNK).unwrap_err();
    assert!(e.to_string().contains("chunk boundaries"), "{e}");
    assert!(HostMath.norm_partials(&g, 0..n + 1).is_err());
    assert!(HostMath.norm_partials(&g, NORM_CHUNK..n).is_ok());
    let mut opt = AdamW::from_shard(
        AdamWConfig::default(),
        &l,
        0..NORM_CHUNK,
        vec![0.0; 3],
        vec![0.0; 3],
        0,
    )
    .unwrap();
    let mut p = vec![0.0; n];
    assert!(opt.update(&mut HostMath, &mut p, &g, 1.0, 1e-3).is_err());
    assert_eq!(opt.updates(), 0);
    assert!(AdamW::from_shard(
        AdamWConfig::default(),
        &l,
        0..n + 1,
        Vec::<f32>::new(),
        Vec::new(),
        0
    )
    .is_err());
}

#[test]
fn decay_within_a_shard_is_the_arena_decay_shifted() {
    let d = vec![2..5, 8..12, 20..30];
    assert_eq!(math::decayed_within(&d, &(0..100)), d);
    assert_eq!(math::decayed_within(&d, &(4..10)), vec![0..1, 4..6]);
    assert_eq!(
        math::decayed_within(&d, &(12..20)),
        Vec::<Range<usize>>::new()
    );
    assert_eq!(
        math::decayed_within(&d, &(25..25)),
        Vec::<Range<usize>>::new()
    );
}

//! ZeRO-1 in live thread worlds: the sharded loop ends every step with the
//! unsharded weights, each rank holding only its shard of the moments, and
//! the shards put together are the unsharded moments bit for bit.

use std::time::Duration;

use mamba_comm::host::{HostOptions, HostTransport};
use mamba_reduce::ReduceContract;

use super::{host, DataParallel, DpOptions};
use crate::config::ModelConfig;
use crate::optim::clip::NORM_CHUNK;
use crate::train::testutil::{toy_model, toy_run, ToyModel};
use crate::train::{RunConfig, Trainer};

/// What one rank ends with.
struct RankEnd {
    digest: String,
    shard: std::ops::Range<usize>,
    m: Vec<f32>,
    v: Vec<f32>,
    norms: Vec<u64>,
}

/// A toy run whose arena spans several norm chunks (so every rank of a
/// world of up to 4 owns a real shard).
fn run(l: usize, contract: ReduceContract) -> RunConfig {
    let mut run = toy_run(5);
    run.model = ModelConfig::new(run.task.vocab_size(), 64, 2);
    run.logical_world = l;
    run.contract = contract;
    run
}

fn world(run: &RunConfig, p: usize, shard_optimizer: bool) -> Vec<RankEnd> {
    let opts = DpOptions {
        shard_optimizer,
        ..DpOptions::default()
    };
    let transports =
        HostTransport::thread_world(p, HostOptions::with_timeout(Duration::from_secs(60))).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = transports
            .into_iter()
            .map(|t| {
                s.spawn(move || {
                    let trainer = Trainer::new(toy_model(run), run.clone()).unwrap();
                    let reducer = host::reducer(t, run);
                    let mut dp: DataParallel<ToyModel, _> =
                        DataParallel::new(trainer, reducer, opts).unwrap();
                    let mut norms = Vec::new();
                    while !dp.finished() {
                        norms.push(dp.step().unwrap().grad_norm.to_bits());
                    }
                    let (mut trainer, _) = dp.into_parts();
                    let (m, v) = trainer.shard_moments_host().unwrap();
                    RankEnd {
                        digest: trainer.weights_digest().unwrap(),
                        shard: trainer.optimizer().adamw().shard(),
                        m,
                        v,
                        norms,
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn sharded_worlds_hold_a_shard_each_and_end_with_the_unsharded_bits() {
    let r = run(4, ReduceContract::FixedOrder);
    let whole = world(&r, 1, false).remove(0);
    let n = whole.m.len();
    assert!(n > 4 * NORM_CHUNK, "the arena must span several chunks");
    for p in [1, 2, 4] {
        let ends = world(&r, p, true);
        let mut m = Vec::new();
        let mut v = Vec::new();
        let mut next = 0;
        for (rank, e) in ends.iter().enumerate() {
            assert_eq!(e.digest, whole.digest, "P = {p}, rank {rank}");
            assert_eq!(e.norms, whole.norms, "P = {p}: clipping norms");
            // A real shard: contiguous in rank order, 1/P of the arena
            // (to a chunk), its moments only.
            assert_eq!(e.shard.start, next);
            next = e.shard.end;
            assert_eq!(e.m.len(), e.shard.len());
            assert!(
                e.shard.len() <= n.div_ceil(p) + NORM_CHUNK,
                "P = {p}: {:?}",
                e.shard
            );
            m.extend_from_slice(&e.m);
            v.extend_from_slice(&e.v);
        }
        assert_eq!(next, n);
        assert_eq!(bits(&m), bits(&whole.m), "P = {p}: first moments");
        assert_eq!(bits(&v), bits(&whole.v), "P = {p}: second moments");
    }
}

#[test]
fn the_library_sum_is_sharded_to_the_same_bits_as_unsharded_at_the_same_p() {
    let r = run(2, ReduceContract::NcclSum);
    let plain = world(&r, 2, false);
    let sharded = world(&r, 2, true);
    assert_eq!(sharded[0].digest, plain[0].digest);
    assert_eq!(sharded[1].digest, plain[1].digest);
    assert!(sharded[1].m.len() < plain[1].m.len());
}

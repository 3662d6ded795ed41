//! The research-reducer seam, proven from outside mamba-reduce: a
//! pairwise-tree reducer written against the public API alone
//! (`mamba_integration_tests::tree::TreeReducer`) runs the agreement check
//! (a mismatch is a clear error on every rank, never a hang), matches a
//! plain reference on random inputs across thread worlds, and trains the
//! CLI's default CPU model through the data-parallel trainer.

use std::time::Duration;

use mamba_comm::host::{HostOptions, HostTransport};
use mamba_integration_tests::tree::{tree_mean_reference, tree_pairs, TreeReducer};
use mamba_reduce::{ReduceContract, ReduceError, Reducer, RunIdentity};
use proptest::prelude::*;

/// Run `body(rank, reducer)` on a thread world of `world` tree reducers over
/// `logical` logical ranks; every rank's result in rank order.
fn world_of<R: Send>(
    world: usize,
    logical: usize,
    body: impl Fn(usize, TreeReducer) -> R + Sync,
) -> Vec<R> {
    let transports =
        HostTransport::thread_world(world, HostOptions::with_timeout(Duration::from_secs(30)))
            .expect("thread world");
    std::thread::scope(|s| {
        let handles: Vec<_> = transports
            .into_iter()
            .enumerate()
            .map(|(r, t)| {
                let body = &body;
                s.spawn(move || body(r, TreeReducer::new(t, logical)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

fn id(len: usize, logical: usize, fingerprint: u64) -> RunIdentity {
    RunIdentity::new(len, ReduceContract::NcclSum, logical, fingerprint)
}

#[test]
fn the_tree_pairs_cover_every_rank_once_as_a_child() {
    for world in 1..=9usize {
        let pairs = tree_pairs(world);
        let mut children: Vec<usize> = pairs.iter().map(|p| p.1).collect();
        children.sort_unstable();
        assert_eq!(children, (1..world).collect::<Vec<_>>(), "P = {world}");
        // A parent has finished receiving before it sends: every pair that
        // sends rank c's partial comes after every pair that feeds c.
        for (k, &(_, c)) in pairs.iter().enumerate() {
            assert!(pairs[k..].iter().all(|&(p, _)| p != c), "P = {world}");
        }
    }
}

#[test]
fn agreeing_ranks_pass_the_check() {
    for world in [1usize, 2, 3, 4] {
        let out = world_of(world, world, |_, mut r| {
            r.check_agreement(&id(10, world, 7))
        });
        for (rank, o) in out.into_iter().enumerate() {
            o.unwrap_or_else(|e| panic!("P = {world}, rank {rank}: {e}"));
        }
    }
}

#[test]
fn ranks_with_different_identities_all_fail_clearly() {
    // Rank 1 has another fingerprint, then another arena length: every rank
    // returns the same disagreement error (no hang, no rank left waiting).
    for world in [2usize, 3] {
        for (what, other) in [
            ("fingerprint", id(10, world, 8)),
            ("arena", id(11, world, 7)),
        ] {
            let out = world_of(world, world, |rank, mut r| {
                let mine = if rank == 1 { other } else { id(10, world, 7) };
                r.check_agreement(&mine)
            });
            for (rank, o) in out.into_iter().enumerate() {
                let e = o.expect_err("a mismatch must fail on every rank");
                assert!(
                    matches!(e, ReduceError::Disagreement { .. }),
                    "P = {world}, rank {rank}: {e:?}"
                );
                let msg = e.to_string();
                assert!(msg.contains(what), "P = {world}, rank {rank}: {msg}");
            }
        }
    }
}

#[test]
fn a_reducer_asked_for_a_contract_it_does_not_keep_fails_on_every_rank() {
    // Rank 0 is asked for FixedOrder, which a pairwise tree does not keep:
    // its own error says so; the others fail naming it.
    let out = world_of(2, 2, |rank, mut r| {
        let contract = if rank == 0 {
            ReduceContract::FixedOrder
        } else {
            ReduceContract::NcclSum
        };
        r.check_agreement(&RunIdentity::new(10, contract, 2, 7))
    });
    let msgs: Vec<String> = out
        .into_iter()
        .map(|o| o.expect_err("must fail").to_string())
        .collect();
    assert!(msgs[0].contains("keeps only"), "{}", msgs[0]);
    assert!(msgs[1].contains("rank 0"), "{}", msgs[1]);
}

/// xorshift64*: reproducible data without a dependency.
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let u = s.wrapping_mul(0x2545_f491_4f6c_dd1d);
            // Mixed magnitudes, so association shows in the low bits.
            let m = ((u >> 40) as f32 / (1u64 << 24) as f32) - 0.5;
            m * f32::powi(2.0, ((u >> 8) % 24) as i32 - 12)
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Random arenas on worlds of 1 to 5 threads with 1 to 3 logical ranks
    /// each: every rank ends with the reference's bits.
    #[test]
    fn the_tree_mean_matches_its_plain_reference(world in 1usize..=5, blocks in 1usize..=3,
                                                 len in 0usize..300, seed in any::<u64>()) {
        let logical = world * blocks;
        let arenas: Vec<Vec<f32>> =
            (0..logical).map(|j| values(seed ^ ((j as u64 + 1) * 0x9e37), len)).collect();
        let want = bits(&tree_mean_reference(&arenas, world));
        let got = world_of(world, logical, |rank, mut r| {
            let mut local = arenas[rank * blocks..(rank + 1) * blocks].to_vec();
            r.reduce_mean(&mut local).map(|()| bits(&local[0]))
        });
        for (rank, g) in got.into_iter().enumerate() {
            let g = g.map_err(|e| TestCaseError::fail(format!("rank {rank}: {e}")))?;
            prop_assert_eq!(&g, &want, "P = {}, L = {}, rank {}", world, logical, rank);
        }
        // The reference is a real mean: close to the ascending one. Two
        // associations of L addends differ by at most about L roundings of
        // the addends' magnitude (with cancellation the mean itself can be
        // far smaller, so the bound is on the addends, not on the mean).
        if len > 0 {
            let rows: Vec<&[f32]> = arenas.iter().map(|a| &a[..]).collect();
            let asc = mamba_reduce::host_mean(&rows).expect("host mean");
            let tree = tree_mean_reference(&arenas, world);
            for (i, (a, t)) in asc.iter().zip(&tree).enumerate() {
                let magnitude = arenas.iter().map(|r| r[i].abs()).sum::<f32>() / logical as f32;
                let bound = 2.0 * logical as f32 * f32::EPSILON * magnitude + f32::MIN_POSITIVE;
                prop_assert!((a - t).abs() <= bound, "{} vs {} (bound {})", a, t, bound);
            }
        }
    }
}

/// Where this test uses mamba-train (kept in one place). Trains the CLI's default CPU model (`mamba-train train`
/// with no flags but a short run, under `NcclSum`, the tree's contract) at
/// `L = logical` on this rank through `DataParallel` with `reducer`; returns
/// the per-step losses and the final weights digest.
fn train_default_cpu_model(reducer: TreeReducer, logical: usize, steps: u64) -> (Vec<f32>, String) {
    use clap::Parser;
    use mamba_train::cli::{resolve::resolve_run, Cli, Command};
    use mamba_train::dp::{DataParallel, DpOptions};
    use mamba_train::model::cpu::CpuModel;
    use mamba_train::train::Trainer;

    let (steps_s, logical_s) = (steps.to_string(), logical.to_string());
    let argv = [
        "mamba-train",
        "train",
        "--steps",
        &steps_s,
        "--logical-world",
        &logical_s,
    ];
    let Command::Train(args) = Cli::try_parse_from(argv).expect("flags parse").command else {
        panic!("parsed as another command")
    };
    let mut run = resolve_run(&args, None).expect("default run resolves").run;
    run.contract = ReduceContract::NcclSum;
    let model = CpuModel::new(run.model.clone()).expect("model");
    let trainer = Trainer::new(model, run).expect("trainer");
    let mut dp = DataParallel::new(trainer, reducer, DpOptions::default()).expect("join");
    let mut losses = Vec::new();
    while !dp.finished() {
        losses.push(dp.step().expect("step").loss);
    }
    let digest = dp
        .replica_check("at the end")
        .expect("replicas agree")
        .digest;
    assert_eq!(digest, dp.trainer_mut().weights_digest().expect("digest"));
    (losses, digest)
}

#[test]
fn the_outside_reducer_trains_the_default_model_on_two_threads() {
    let (world, logical, steps) = (2usize, 2usize, 40u64);
    let out = world_of(world, logical, |_, r| {
        train_default_cpu_model(r, logical, steps)
    });
    let (losses, digest) = &out[0];
    assert_eq!(losses.len(), steps as usize);
    for (rank, (l, d)) in out.iter().enumerate() {
        assert_eq!(d, digest, "rank {rank} ended with other weights");
        assert_eq!(bits(l), bits(losses), "rank {rank} logged other losses");
    }
    let first = losses[0];
    let last: f32 = losses[losses.len() - 5..].iter().sum::<f32>() / 5.0;
    assert!(
        last < 0.9 * first,
        "the loss did not fall: first {first}, mean of the last five {last} ({losses:?})"
    );
}

//! The data-parallel trainer against mamba-reduce's oracle, across crates:
//! the engine's step with the mean from an `EmulatedWorld`, the
//! data-parallel loop on live host worlds of 1..L threads, and the engine
//! stepped by the contract's definition (a host fold, no reducer) give the same weights and the same logged losses, bit for
//! bit, at every physical world size. (`mamba-train/tests/dp_world.rs`
//! does the same with real processes through the CLI, against the definition
//! step.)

use mamba_integration_tests::dp::{
    definition_run, emulated_run, thread_world, tiny_run, try_thread_world, Trace, WorldRun,
};
use mamba_reduce::{Delivery, EmulateOptions, ReduceContract};
use mamba_train::dp::fault_hooks::RankStep;
use mamba_train::dp::{DpOptions, FaultHooks};
use proptest::prelude::*;

fn divisors(l: usize) -> Vec<usize> {
    (1..=l).filter(|p| l % p == 0).collect()
}

/// Every rank's trace is `want`.
fn assert_world(traces: &[Trace], want: &Trace, what: &str) {
    for (r, t) in traces.iter().enumerate() {
        assert_eq!(t, want, "{what}, rank {r}");
    }
}

#[test]
fn every_world_size_equals_the_emulated_world_and_the_definition() {
    for (seed, l, steps) in [(3u64, 4usize, 4u64), (11, 6, 3)] {
        let run = tiny_run(seed, l, steps);
        let want = definition_run(&run);
        assert_eq!(want.losses.len(), steps as usize);
        for emulated in divisors(l) {
            let opts = EmulateOptions {
                delivery: Delivery::Shuffled(seed + emulated as u64),
                chunk_elems: Some(333),
                ..EmulateOptions::default()
            };
            let got = emulated_run(&run, emulated, &opts);
            assert_eq!(got, want, "L = {l}, emulated P = {emulated}");
        }
        for world in divisors(l) {
            let traces = thread_world(&run, world, WorldRun::default());
            assert_world(&traces, &want, &format!("L = {l}, live P = {world}"));
        }
    }
}

#[test]
fn the_logical_world_and_library_sums_are_negative_controls() {
    let four = tiny_run(5, 4, 3);
    let want = definition_run(&four);
    // Another L is another run.
    let two = definition_run(&tiny_run(5, 2, 3));
    assert_ne!(two.digest, want.digest);
    // nccl-sum on P = 2 < L = 4 adds block sums: the bits move away from
    // the fixed-order fold (same on both of its ranks, though).
    let mut nccl = four.clone();
    nccl.contract = ReduceContract::NcclSum;
    let traces = thread_world(&nccl, 2, WorldRun::default());
    assert_eq!(traces[0], traces[1]);
    assert_ne!(traces[0].digest, want.digest);
    // At P = 1 the library sum is the one-block ascending fold.
    assert_world(
        &thread_world(&nccl, 1, WorldRun::default()),
        &want,
        "nccl-sum P = 1",
    );
}

#[test]
fn a_checkpoint_of_four_ranks_resumes_on_two_and_on_one_onto_the_unbroken_bits() {
    let dir = tempfile::tempdir().unwrap();
    let run = tiny_run(8, 4, 6);
    let unbroken = definition_run(&run);
    let first = thread_world(
        &run,
        4,
        WorldRun {
            stop_at: Some(2),
            save_to: Some(dir.path()),
            ..WorldRun::default()
        },
    );
    assert_eq!(first[0].losses[..], unbroken.losses[..2]);
    for world in [2, 1] {
        let rest = thread_world(
            &run,
            world,
            WorldRun {
                resume: Some(dir.path()),
                ..WorldRun::default()
            },
        );
        for t in &rest {
            assert_eq!(t.digest, unbroken.digest, "resumed on {world}");
            assert_eq!(t.losses[..], unbroken.losses[2..], "resumed on {world}");
        }
    }
}

#[test]
fn a_nan_on_any_rank_skips_the_same_step_everywhere() {
    let run = tiny_run(2, 4, 4);
    let clean = definition_run(&run);
    let mut traces = Vec::new();
    for (world, rank) in [(4, 3), (2, 1), (1, 0)] {
        let how = WorldRun {
            opts: DpOptions {
                hooks: FaultHooks {
                    inject_nan: Some(RankStep { rank, step: 2 }),
                    ..FaultHooks::default()
                },
                ..DpOptions::default()
            },
            ..WorldRun::default()
        };
        let t = thread_world(&run, world, how);
        assert!(t.iter().all(|x| x == &t[0]), "P = {world}: ranks differ");
        assert_eq!(t[0].skipped, [false, true, false, false], "P = {world}");
        // The gradient was poisoned, not the loss: the logged loss is the
        // clean run's.
        assert_eq!(t[0].losses[..2], clean.losses[..2]);
        traces.push(t[0].clone());
    }
    assert_ne!(traces[0].digest, clean.digest);
    assert!(traces.iter().all(|t| t.digest == traces[0].digest));
}

#[test]
fn a_perturbed_replica_is_reported_by_every_rank() {
    let run = tiny_run(4, 3, 4);
    let how = WorldRun {
        opts: DpOptions {
            replica_check_every: 1,
            hooks: FaultHooks {
                perturb_weights: Some(RankStep { rank: 2, step: 3 }),
                ..FaultHooks::default()
            },
            ..DpOptions::default()
        },
        ..WorldRun::default()
    };
    for (r, res) in try_thread_world(&run, 3, how).into_iter().enumerate() {
        let e = res.expect_err("the check must fail").to_string();
        assert!(
            e.contains("replica divergence: after step 3") && e.contains("rank 2 differs"),
            "rank {r}: {e}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]

    /// Any seed, L, dividing P and short run: the live world equals the
    /// oracle (emulated on one process, in-order delivery).
    #[test]
    fn live_worlds_equal_the_oracle(seed in 0u64..1000, l in 1usize..=4, pick in 0usize..4, steps in 1u64..=3) {
        let ps = divisors(l);
        let world = ps[pick % ps.len()];
        let run = tiny_run(seed, l, steps);
        let want = emulated_run(&run, 1, &EmulateOptions::default());
        let got = thread_world(&run, world, WorldRun::default());
        for (r, t) in got.iter().enumerate() {
            prop_assert_eq!(t, &want, "seed {} L {} P {} rank {}", seed, l, world, r);
        }
    }
}

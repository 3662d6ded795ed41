//! Live host worlds of real processes over loopback TCP (the supervisor's
//! test worlds): the same bits as the EmulatedWorld for P = L and L > P.

mod common;

use std::time::Duration;

use common::{arenas, assert_bits_eq};
use mamba_comm::bootstrap::{detect, is_rank_process, ProcessEnv};
use mamba_comm::host::{HostOptions, HostTransport};
use mamba_comm::rendezvous;
use mamba_comm::supervisor::test_world;
use mamba_reduce::{
    EmulateOptions, EmulatedWorld, HostReducer, ReduceContract, Reducer, ReducerOptions,
    RunIdentity,
};

const TIMEOUT: Duration = Duration::from_secs(30);

/// This rank's transport, from the contract the supervisor put in the
/// environment.
fn connect() -> HostTransport {
    let place = detect(&ProcessEnv)
        .expect("valid launcher environment")
        .expect("a rank process has a place");
    let rdv = rendezvous::open(&place, TIMEOUT).expect("rendezvous");
    HostTransport::connect(&*rdv, HostOptions::with_timeout(TIMEOUT)).expect("connect")
}

/// Reduce arenas of logical world `logical` (from `seed`) under every
/// chunking, on this process world, and compare with the oracle at P = 1
/// and at this P.
fn check_against_oracle(
    mut t: HostTransport,
    logical: usize,
    len: usize,
    seed: u64,
) -> HostTransport {
    let (rank, world) = (
        mamba_comm::Transport::rank(&t),
        mamba_comm::Transport::world(&t),
    );
    let a = arenas(seed, logical, len);
    let em = EmulatedWorld::new(a.clone()).unwrap();
    let want = em.reduce_mean(world, &EmulateOptions::default()).unwrap();
    assert_bits_eq(
        &want,
        &em.reduce_mean(1, &EmulateOptions::default()).unwrap(),
        "oracle P=1 vs P",
    );
    let blocks = logical / world;
    for chunk in [None, Some(97), Some(4096)] {
        let opts = ReducerOptions {
            chunk_elems: chunk,
            ..ReducerOptions::new(ReduceContract::FixedOrder, logical)
        };
        let mut r = HostReducer::new(t, opts);
        r.check_agreement(&RunIdentity::new(
            len,
            ReduceContract::FixedOrder,
            logical,
            seed,
        ))
        .unwrap();
        let mut local = a[rank * blocks..(rank + 1) * blocks].to_vec();
        r.reduce_mean(&mut local).unwrap();
        assert_bits_eq(
            &local[0],
            &want,
            &format!("rank {rank} of {world}, L={logical}, len={len}, chunk={chunk:?}"),
        );
        t = r.into_parts().0;
    }
    t
}

fn supervise(name: &str, world: usize) {
    let report = test_world(name, world, &[]).expect("spawn the world");
    if let Err(e) = report.check() {
        panic!("{e}");
    }
}

#[test]
fn four_processes_equal_the_oracle() {
    if !is_rank_process() {
        return supervise("four_processes_equal_the_oracle", 4);
    }
    let mut t = connect();
    for (logical, len, seed) in [(4, 10_007, 1), (4, 3, 2), (8, 5003, 3), (16, 1, 4)] {
        t = check_against_oracle(t, logical, len, seed);
    }
    // Drop says goodbye and flushes; `shutdown` would report a peer that
    // already left first as an error, which is not this test's subject.
    drop(t);
}

#[test]
fn two_processes_equal_the_oracle() {
    if !is_rank_process() {
        return supervise("two_processes_equal_the_oracle", 2);
    }
    let mut t = connect();
    for (logical, len, seed) in [(2, 65_537, 5), (4, 10_007, 1), (6, 999, 6)] {
        t = check_against_oracle(t, logical, len, seed);
    }
    // Drop says goodbye and flushes; `shutdown` would report a peer that
    // already left first as an error, which is not this test's subject.
    drop(t);
}

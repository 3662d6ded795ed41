//! The peer fold between real processes on one GPU (CUDA memory-pool IPC
//! between processes on one device works, while NCCL refuses two ranks
//! there): the EmulatedWorld's bits for P = 2 and L in {2, 4, 8, 64} at
//! lengths that leave a shard empty, over several reductions of the same
//! registered arenas; a killed peer is an error naming it within the
//! deadline; a rank that fails on its own side aborts its peer at once.
//! Skips without a GPU unless MAMBA_REQUIRE_GPU=1.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{arenas, assert_bits_eq, gpu_stream, Rng};
use cudarc::driver::{CudaSlice, CudaStream};
use mamba_comm::bootstrap::{detect, is_rank_process, ProcessEnv};
use mamba_comm::host::{HostOptions, HostTransport};
use mamba_comm::rendezvous;
use mamba_comm::supervisor::{test_world_with, RankStatus, SpawnOptions};
use mamba_comm::{CommError, Transport};
use mamba_reduce::{
    EmulateOptions, EmulatedWorld, HostReducer, PeerOptions, PeerReducer, ReduceContract,
    ReduceError, Reducer, ReducerOptions,
};

const TIMEOUT: Duration = Duration::from_secs(60);

fn connect() -> HostTransport {
    let place = detect(&ProcessEnv)
        .expect("valid launcher environment")
        .expect("a rank process has a place");
    let rdv = rendezvous::open(&place, TIMEOUT).expect("rendezvous");
    HostTransport::connect(&*rdv, HostOptions::with_timeout(TIMEOUT)).expect("connect")
}

fn stream() -> Arc<CudaStream> {
    let ctx = kernels::open_context(0).expect("CUDA device 0");
    ctx.new_stream().expect("a stream")
}

/// A peer reducer of logical world `logical` over `t`.
fn peer(
    t: HostTransport,
    logical: usize,
    s: &Arc<CudaStream>,
    timeout: Duration,
) -> PeerReducer<HostReducer> {
    let control = HostReducer::new(t, ReducerOptions::new(ReduceContract::FixedOrder, logical));
    PeerReducer::new(control, s.clone(), PeerOptions { timeout }).expect("peer reducer")
}

/// Spawn `world` ranks of `name` on this GPU (the rank side shares device
/// 0), with `grace` for the survivors of an intended failure.
fn supervise(
    name: &str,
    world: usize,
    grace: Duration,
) -> Option<mamba_comm::supervisor::WorldReport> {
    gpu_stream()?;
    let opts = SpawnOptions {
        grace,
        ..SpawnOptions::default()
    };
    Some(test_world_with(name, world, opts).expect("spawn the world"))
}

fn download(s: &Arc<CudaStream>, a: &CudaSlice<f32>) -> Vec<f32> {
    s.clone_dtoh(a).expect("download")
}

#[test]
fn two_processes_on_one_gpu_equal_the_oracle() {
    if !is_rank_process() {
        if let Some(report) = supervise(
            "two_processes_on_one_gpu_equal_the_oracle",
            2,
            Duration::ZERO,
        ) {
            report.check().expect("every rank succeeded");
        }
        return;
    }
    let s = stream();
    let mut t = connect();
    let (rank, world) = (t.rank(), t.world());
    let mut rng = Rng(77);
    let random = 5000 + rng.below(60_000) as usize;
    // 1 element: rank 1's shard is empty; 3: uneven shards and the scalar
    // tail; 64 logical ranks: a chain longer than one launch takes.
    let cases: [(usize, &[usize]); 4] = [
        (2, &[1, 3, 4099, random]),
        (4, &[2, 65_537]),
        (8, &[1023]),
        (64, &[1001]),
    ];
    for (logical, lens) in cases {
        for &len in lens {
            let blocks = logical / world;
            let mut r = peer(t, logical, &s, TIMEOUT);
            // Arenas after the reducer: it installed the shareable pool.
            let mut local: Vec<CudaSlice<f32>> = (0..blocks)
                .map(|_| s.alloc_zeros::<f32>(len).expect("alloc"))
                .collect();
            for round in 0..3u64 {
                let seed = 1000 * logical as u64 + 10 * len as u64 + round;
                let a = arenas(seed, logical, len);
                let want = EmulatedWorld::new(a.clone())
                    .unwrap()
                    .reduce_mean(world, &EmulateOptions::default())
                    .unwrap();
                for (k, dst) in local.iter_mut().enumerate() {
                    s.memcpy_htod(&a[rank * blocks + k], dst).expect("upload");
                }
                r.reduce_mean(&mut local).expect("peer reduction");
                let what = format!("rank {rank}, L={logical}, len={len}, round {round}");
                assert_bits_eq(&download(&s, &local[0]), &want, &what);
                for (k, arena) in local.iter().enumerate().skip(1) {
                    assert_bits_eq(
                        &download(&s, arena),
                        &a[rank * blocks + k],
                        &format!("{what}: arena {k} untouched"),
                    );
                }
            }
            // Importers release before the exporter frees: every rank drops
            // its mappings, meets the others, then frees its arenas.
            let mut control = r.into_control();
            control.any(false).expect("a barrier");
            drop(local);
            t = control.into_parts().0;
        }
    }
    drop(t);
}

#[test]
fn a_killed_peer_is_an_error_naming_it_within_the_deadline() {
    const DEADLINE: Duration = Duration::from_secs(2);
    if !is_rank_process() {
        let name = "a_killed_peer_is_an_error_naming_it_within_the_deadline";
        let Some(report) = supervise(name, 2, Duration::from_secs(30)) else {
            return;
        };
        assert_eq!(
            report.ranks[1].status,
            RankStatus::Signaled(6),
            "{report:?}"
        );
        assert!(
            report.ranks[0].status.success() && !report.ranks[0].killed_by_supervisor,
            "rank 0 must see the error and end by itself: {report:?}"
        );
        return;
    }
    let s = stream();
    let t = connect();
    let rank = t.rank();
    let mut r = peer(t, 2, &s, DEADLINE);
    let mut local = vec![s.alloc_zeros::<f32>(4096).expect("alloc")];
    r.reduce_mean(&mut local).expect("the first reduction");
    if rank == 1 {
        std::process::abort();
    }
    let start = Instant::now();
    let e = r.reduce_mean(&mut local).expect_err("the peer is dead");
    let took = start.elapsed();
    match &e {
        ReduceError::Comm(CommError::PeerFailed { rank: 1, detail }) => {
            assert!(detail.contains("did not reach"), "{e}")
        }
        other => panic!("expected PeerFailed naming rank 1, got {other}"),
    }
    assert!(
        took >= DEADLINE && took < DEADLINE + Duration::from_secs(10),
        "took {took:?}"
    );
    // The reducer refuses to go on.
    let again = r.reduce_mean(&mut local).expect_err("stopped");
    assert!(
        again.to_string().contains("stopped after a failure"),
        "{again}"
    );
    eprintln!("rank 0: {e} after {took:?}");
    // Skip the transport's goodbye to a dead peer.
    std::process::exit(0);
}

#[test]
fn a_rank_that_fails_on_its_side_aborts_its_peer_at_once() {
    if !is_rank_process() {
        let name = "a_rank_that_fails_on_its_side_aborts_its_peer_at_once";
        if let Some(report) = supervise(name, 2, Duration::from_secs(30)) {
            report.check().expect("both ranks saw the expected errors");
        }
        return;
    }
    let s = stream();
    let t = connect();
    let rank = t.rank();
    let mut r = peer(t, 2, &s, TIMEOUT);
    let mut local = vec![s.alloc_zeros::<f32>(1000).expect("alloc")];
    r.reduce_mean(&mut local).expect("the first reduction");
    let start = Instant::now();
    if rank == 1 {
        // Other arenas than the registered ones: a local error, and an
        // abort posted to rank 0.
        let mut other = vec![s.alloc_zeros::<f32>(1000).expect("alloc")];
        let e = r.reduce_mean(&mut other).expect_err("unregistered arenas");
        assert!(
            e.to_string().contains("other than the ones it registered"),
            "{e}"
        );
    } else {
        let e = r.reduce_mean(&mut local).expect_err("the peer aborted");
        match &e {
            ReduceError::Comm(CommError::PeerFailed { rank: 1, detail }) => {
                assert!(detail.contains("aborted"), "{e}")
            }
            other => panic!("expected PeerFailed naming rank 1, got {other}"),
        }
        // At once: far inside the 60 s deadline.
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "took {:?}",
            start.elapsed()
        );
    }
    std::process::exit(0);
}

/// A world of one process: no mapping, the same fold over its `L` local
/// arenas, the oracle's bits; and a different logical world changes them
/// (the comparison is not vacuous).
#[test]
fn one_process_equals_the_oracle_at_every_logical_world() {
    let Some(s) = gpu_stream() else { return };
    for (logical, len) in [(1, 4099), (3, 1), (4, 65_537), (40, 777)] {
        let t = HostTransport::thread_world(1, HostOptions::with_timeout(TIMEOUT))
            .expect("a world of one")
            .remove(0);
        let mut r = peer(t, logical, &s, TIMEOUT);
        let a = arenas(logical as u64 * 31 + len as u64, logical, len);
        let mut local: Vec<CudaSlice<f32>> =
            a.iter().map(|v| s.clone_htod(v).expect("upload")).collect();
        r.reduce_mean(&mut local).expect("reduction");
        let em = EmulatedWorld::new(a.clone()).unwrap();
        let want = em.reduce_mean(1, &EmulateOptions::default()).unwrap();
        let got = download(&s, &local[0]);
        assert_bits_eq(&got, &want, &format!("P=1, L={logical}, len={len}"));
        if logical > 1 && len > 1 {
            let fewer = EmulatedWorld::new(a[..logical - 1].to_vec())
                .unwrap()
                .reduce_mean(1, &EmulateOptions::default())
                .unwrap();
            assert!(
                common::differing(&got, &fewer) > 0,
                "L={logical} and L={} gave the same bits",
                logical - 1
            );
        }
    }
}

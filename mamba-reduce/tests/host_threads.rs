//! Live host worlds (one thread per rank, channels) against the oracle:
//! same bits as the EmulatedWorld for P = L and L > P; the collective
//! helpers; and the agreement check failing on every rank at once.

mod common;

use std::time::Duration;

use common::{arenas, assert_bits_eq, bits, divisors, run_world};
use mamba_comm::host::{HostOptions, HostTransport};
use mamba_reduce::{
    host_fold, EmulateOptions, EmulatedWorld, HostReducer, ReduceContract, ReduceError, Reducer,
    ReducerOptions, RunIdentity,
};
use proptest::prelude::*;

/// Reduce `a` (L arenas) on a live world of `world` threads; every rank's
/// `local[0]` afterwards.
fn live_mean(
    a: &[Vec<f32>],
    world: usize,
    contract: ReduceContract,
    chunk: Option<usize>,
) -> Vec<Vec<f32>> {
    let logical = a.len();
    let blocks = logical / world;
    let opts = ReducerOptions {
        chunk_elems: chunk,
        ..ReducerOptions::new(contract, logical)
    };
    run_world(world, opts, |rank, r| {
        let mut local: Vec<Vec<f32>> = a[rank * blocks..(rank + 1) * blocks].to_vec();
        r.reduce_mean(&mut local).unwrap();
        // The other local arenas are left alone.
        for j in 1..blocks {
            assert_bits_eq(&local[j], &a[rank * blocks + j], "untouched local arena");
        }
        local.swap_remove(0)
    })
}

fn oracle(a: &[Vec<f32>], world: usize) -> Vec<f32> {
    EmulatedWorld::new(a.to_vec())
        .unwrap()
        .reduce_mean(world, &EmulateOptions::default())
        .unwrap()
}

#[test]
fn live_threads_equal_the_oracle() {
    for (logical, world) in [
        (1, 1),
        (2, 2),
        (3, 3),
        (4, 4),
        (5, 5),
        (8, 8),
        (4, 1),
        (4, 2),
        (6, 3),
        (16, 4),
        (12, 2),
    ] {
        for len in [0usize, 1, 3, 1009, 4096] {
            let a = arenas((logical * 100 + world) as u64 ^ len as u64, logical, len);
            let want = oracle(&a, world);
            for chunk in [None, Some(7), Some(1000)] {
                for (rank, got) in live_mean(&a, world, ReduceContract::FixedOrder, chunk)
                    .iter()
                    .enumerate()
                {
                    assert_bits_eq(
                        got,
                        &want,
                        &format!("L={logical} P={world} len={len} chunk={chunk:?} rank {rank}"),
                    );
                }
            }
        }
    }
}

#[test]
fn logical_world_four_is_the_same_on_one_two_and_four_threads() {
    let a = arenas(44, 4, 10_007);
    let results: Vec<Vec<f32>> = [1, 2, 4]
        .iter()
        .map(|&p| live_mean(&a, p, ReduceContract::FixedOrder, None).remove(0))
        .collect();
    assert_bits_eq(&results[0], &results[1], "L=4: P=1 vs P=2");
    assert_bits_eq(&results[0], &results[2], "L=4: P=1 vs P=4");
    assert_bits_eq(&results[0], &oracle(&a, 4), "L=4 vs oracle");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn live_threads_equal_the_oracle_random(
        logical in 1usize..=16,
        pick in any::<prop::sample::Index>(),
        len in prop_oneof![0usize..=20, 0usize..=10_000],
        seed in any::<u64>(),
        chunk in proptest::option::of(1usize..=5000),
    ) {
        let ds = divisors(logical);
        let world = ds[pick.index(ds.len())].min(8);
        let world = if logical % world == 0 { world } else { 1 };
        let a = arenas(seed, logical, len);
        let want = oracle(&a, world);
        for got in live_mean(&a, world, ReduceContract::FixedOrder, chunk) {
            assert_bits_eq(&got, &want, &format!("L={logical} P={world} len={len} chunk={chunk:?}"));
        }
    }
}

#[test]
fn library_sum_is_close_and_the_same_on_every_rank() {
    for (logical, world) in [(1, 1), (2, 2), (4, 2), (3, 3)] {
        let a = arenas(7 + logical as u64, logical, 2000);
        let exact: Vec<f64> = (0..2000)
            .map(|i| a.iter().map(|g| g[i] as f64).sum::<f64>() / logical as f64)
            .collect();
        let scale: f64 = a
            .iter()
            .flat_map(|g| g.iter())
            .map(|x| x.abs() as f64)
            .fold(0.0, f64::max);
        let got = live_mean(&a, world, ReduceContract::NcclSum, None);
        for r in &got {
            assert_eq!(bits(r), bits(&got[0]), "NcclSum replicas differ");
        }
        for (i, (&g, &e)) in got[0].iter().zip(&exact).enumerate() {
            assert!(
                (g as f64 - e).abs() <= 1e-6 * scale * logical as f64,
                "element {i}: {g} vs {e}"
            );
        }
    }
}

#[test]
fn any_is_true_iff_some_rank_says_so() {
    let opts = ReducerOptions::new(ReduceContract::FixedOrder, 4);
    for pattern in [[false; 4], [false, false, true, false], [true; 4]] {
        let got = run_world(4, opts, |rank, r| r.any(pattern[rank]).unwrap());
        assert_eq!(got, vec![pattern.iter().any(|&b| b); 4]);
    }
}

#[test]
fn host_all_reduce_folds_ranks_in_ascending_order() {
    let rows = arenas(9, 3, 17);
    let got = run_world(
        3,
        ReducerOptions::new(ReduceContract::FixedOrder, 3),
        |rank, r| {
            let mut v = rows[rank].clone();
            r.all_reduce_host(&mut v).unwrap();
            v
        },
    );
    let mut want = vec![0.0; 17];
    host_fold(
        &rows.iter().map(|v| v.as_slice()).collect::<Vec<_>>(),
        &mut want,
    )
    .unwrap();
    for v in &got {
        assert_bits_eq(v, &want, "all_reduce_host");
    }
}

#[test]
fn logical_host_sum_is_the_same_for_every_physical_world() {
    let rows = arenas(10, 4, 5);
    let mut want = vec![0.0; 5];
    host_fold(
        &rows.iter().map(|v| v.as_slice()).collect::<Vec<_>>(),
        &mut want,
    )
    .unwrap();
    for world in [1, 2, 4] {
        let blocks = 4 / world;
        let got = run_world(
            world,
            ReducerOptions::new(ReduceContract::FixedOrder, 4),
            |rank, r| {
                let mine: Vec<&[f32]> = rows[rank * blocks..(rank + 1) * blocks]
                    .iter()
                    .map(|v| v.as_slice())
                    .collect();
                r.all_reduce_host_logical(&mine).unwrap()
            },
        );
        for v in &got {
            assert_bits_eq(v, &want, &format!("logical host sum at P={world}"));
        }
    }
}

fn disagreement(e: &ReduceError) -> &str {
    match e {
        ReduceError::Disagreement { detail } => detail,
        other => panic!("expected a disagreement, got {other}"),
    }
}

#[test]
fn a_different_fingerprint_fails_on_every_rank() {
    let opts = ReducerOptions::new(ReduceContract::FixedOrder, 3);
    let got = run_world(3, opts, |rank, r| {
        let fp = if rank == 2 { 0xbad } else { 0x600d };
        r.check_agreement(&RunIdentity::new(100, ReduceContract::FixedOrder, 3, fp))
    });
    let msgs: Vec<String> = got
        .iter()
        .map(|res| disagreement(res.as_ref().unwrap_err()).to_string())
        .collect();
    assert!(
        msgs[0].contains(
            "model/config fingerprint: rank 0 0x000000000000600d, rank 2 0x0000000000000bad"
        ),
        "{}",
        msgs[0]
    );
    assert!(
        msgs.iter().all(|m| m == &msgs[0]),
        "every rank reaches the same verdict: {msgs:?}"
    );
}

/// Ranks built with different chunk lengths would pair messages of
/// different sizes (on NCCL a hang until the watchdog): the chunk length is
/// part of the identity, so they fail the check on every rank, naming it.
#[test]
fn a_different_chunk_length_fails_on_every_rank() {
    let transports =
        HostTransport::thread_world(2, HostOptions::with_timeout(Duration::from_secs(30))).unwrap();
    let msgs: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = transports
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                s.spawn(move || {
                    let opts = ReducerOptions {
                        chunk_elems: (rank == 1).then_some(64),
                        ..ReducerOptions::new(ReduceContract::FixedOrder, 2)
                    };
                    let mut r = HostReducer::new(t, opts);
                    let mut local = vec![vec![rank as f32; 1000]];
                    let e = r.reduce_mean(&mut local).unwrap_err();
                    disagreement(&e).to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        msgs[0].contains("reducer chunk length: rank 0 default, rank 1 64 elements"),
        "{}",
        msgs[0]
    );
    assert_eq!(msgs[0], msgs[1], "the same verdict on every rank");
}

#[test]
fn agreement_passes_and_pins_the_arena_length() {
    let opts = ReducerOptions::new(ReduceContract::FixedOrder, 2);
    let got = run_world(2, opts, |_, r| {
        r.check_agreement(&RunIdentity::new(8, ReduceContract::FixedOrder, 2, 1))
            .unwrap();
        let mut local = vec![vec![1.0f32; 8]];
        r.reduce_mean(&mut local).unwrap();
        local.remove(0)
    });
    assert_eq!(got, vec![vec![1.0; 8]; 2]);
    // A later call with another length is refused locally (P = 1: no peer waits).
    let mut r = HostReducer::new(
        HostTransport::thread_world(1, HostOptions::default())
            .unwrap()
            .remove(0),
        ReducerOptions::new(ReduceContract::FixedOrder, 1),
    );
    r.check_agreement(&RunIdentity::new(8, ReduceContract::FixedOrder, 1, 0))
        .unwrap();
    let err = r.reduce_mean(&mut [vec![0.0; 9]]).unwrap_err().to_string();
    assert!(err.contains("agreed on 8"), "{err}");
}

#[test]
fn implicit_check_catches_different_arena_lengths_everywhere() {
    let opts = ReducerOptions::new(ReduceContract::FixedOrder, 2);
    let got = run_world(2, opts, |rank, r| {
        r.reduce_mean(&mut [vec![1.0; 10 + rank]])
    });
    for res in &got {
        let m = disagreement(res.as_ref().unwrap_err());
        assert!(m.contains("arena length: rank 0 10, rank 1 11"), "{m}");
    }
}

#[test]
fn contract_mismatch_fails_everywhere() {
    let transports =
        HostTransport::thread_world(2, HostOptions::with_timeout(Duration::from_secs(30))).unwrap();
    let got: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = transports
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                s.spawn(move || {
                    let c = if rank == 0 {
                        ReduceContract::FixedOrder
                    } else {
                        ReduceContract::NcclSum
                    };
                    HostReducer::new(t, ReducerOptions::new(c, 2)).reduce_mean(&mut [vec![1.0; 4]])
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for res in &got {
        assert!(disagreement(res.as_ref().unwrap_err())
            .contains("contract: rank 0 fixed-order, rank 1 nccl-sum"));
    }
}

#[test]
fn a_rank_with_the_wrong_number_of_arenas_fails_and_is_named_everywhere() {
    let opts = ReducerOptions::new(ReduceContract::FixedOrder, 4);
    let got = run_world(2, opts, |rank, r| {
        let mut local = vec![vec![1.0f32; 6]; if rank == 1 { 1 } else { 2 }];
        r.reduce_mean(&mut local)
    });
    let own = got[1].as_ref().unwrap_err().to_string();
    assert!(
        own.contains("rank 1 passed 1 local arenas") && own.contains("passes 2"),
        "{own}"
    );
    assert!(disagreement(got[0].as_ref().unwrap_err()).contains("rank 1 found a local problem"));
}

#[test]
fn a_logical_world_the_physical_world_does_not_divide_fails_everywhere() {
    let got = run_world(
        2,
        ReducerOptions::new(ReduceContract::FixedOrder, 3),
        |_, r| r.reduce_mean(&mut [vec![0.0; 4]]),
    );
    for res in &got {
        let m = res.as_ref().unwrap_err().to_string();
        assert!(
            m.contains("logical world 3 is not a multiple of the physical world 2"),
            "{m}"
        );
    }
}

#[test]
fn owned_ranges_reach_every_rank_bit_for_bit() {
    // Uneven and empty ranges, and an element nobody owns (left alone).
    let owned = [0..5, 5..5, 5..12, 12..13];
    let got = run_world(
        4,
        ReducerOptions::new(ReduceContract::FixedOrder, 4),
        |rank, r| {
            // This rank's values (NaN payloads included) in its range, its rank
            // number elsewhere.
            let mut buf: Vec<f32> = (0..14)
                .map(|i| {
                    if owned[rank].contains(&i) {
                        f32::from_bits(0x7fc0_0000 | (100 * rank + i) as u32)
                    } else {
                        rank as f32
                    }
                })
                .collect();
            r.all_gather_ranges(&mut buf, &owned).unwrap();
            buf
        },
    );
    for (rank, buf) in got.iter().enumerate() {
        for (k, range) in owned.iter().enumerate() {
            for i in range.clone() {
                assert_eq!(buf[i].to_bits(), 0x7fc0_0000 | (100 * k + i) as u32);
            }
        }
        assert_eq!(
            buf[13], rank as f32,
            "an element outside every range is untouched"
        );
    }
    // Ranges that do not fit, or not one per rank, are errors.
    let errs = run_world(
        2,
        ReducerOptions::new(ReduceContract::FixedOrder, 2),
        |_, r| {
            let mut buf = vec![0.0f32; 4];
            let one_range = std::slice::from_ref(&(0..2usize));
            let a = r.all_gather_ranges(&mut buf, one_range).unwrap_err();
            let b = r.all_gather_ranges(&mut buf, &[0..2, 2..9]).unwrap_err();
            (a.to_string(), b.to_string())
        },
    );
    for (a, b) in errs {
        assert!(a.contains("one per rank"), "{a}");
        assert!(b.contains("outside"), "{b}");
    }
}

#[test]
fn the_default_reduce_scatter_is_the_full_mean_on_the_owned_range() {
    let a = arenas(3, 4, 1000);
    let want = oracle(&a, 2);
    let owned = [0..400, 400..1000];
    let got = run_world(
        2,
        ReducerOptions::new(ReduceContract::FixedOrder, 4),
        |rank, r| {
            let mut local = a[2 * rank..2 * rank + 2].to_vec();
            r.reduce_mean_shard(&mut local, &owned).unwrap();
            local.swap_remove(0)
        },
    );
    for (rank, g) in got.iter().enumerate() {
        let r = owned[rank].clone();
        assert_bits_eq(&g[r.clone()], &want[r], "owned range");
    }
}

/// A rank whose identity already names a dataflow (the peer fold fills in
/// `RunIdentity::PEER_FOLD` before its control reducer's check) keeps it,
/// so a peer-fold rank and a message-dataflow rank fail the check by name
/// on both; two peer-fold ranks agree.
#[test]
fn a_prefilled_dataflow_joins_the_agreement_check() {
    let opts = ReducerOptions::new(ReduceContract::FixedOrder, 2);
    let base = RunIdentity::new(100, ReduceContract::FixedOrder, 2, 0);
    let peer = RunIdentity {
        chunk_elems: RunIdentity::PEER_FOLD,
        ..base
    };
    let mixed = run_world(2, opts, |rank, r| {
        r.check_agreement(if rank == 0 { &peer } else { &base })
            .map_err(|e| e.to_string())
    });
    for (rank, got) in mixed.into_iter().enumerate() {
        let e = got.expect_err("a peer-fold rank and a message rank must disagree");
        assert!(e.contains("none (the peer fold)"), "rank {rank}: {e}");
    }
    let same = run_world(2, opts, |_, r| {
        r.check_agreement(&peer).map_err(|e| e.to_string())
    });
    assert!(same.iter().all(Result::is_ok), "{same:?}");
}

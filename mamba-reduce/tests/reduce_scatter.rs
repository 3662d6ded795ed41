//! The reduction that ends at the shard owners (ZeRO-1's reduce-scatter):
//! on every owned range, the bits of the full reduction, for both fixed
//! contracts, every physical world, delivery order, lane schedule, chunking
//! and partition (ragged, empty and gapped ranges); on the emulated oracle
//! and on live thread worlds. Negative controls: the plans really move
//! fewer bytes and really leave non-owned elements unreduced (so the
//! equality is not the all-reduce's by accident); the partition must agree
//! across ranks and must not change.

mod common;

use std::ops::Range;

use common::{arenas, assert_bits_eq, differing, divisors, run_world};
use mamba_reduce::{
    host_mean, host_tree_mean, Delivery, EmulateOptions, EmulatedWorld, RankPlan, ReduceContract,
    Reducer, ReducerOptions, TreeAccumulator,
};
use proptest::prelude::*;

fn refs(a: &[Vec<f32>]) -> Vec<&[f32]> {
    a.iter().map(|v| v.as_slice()).collect()
}

/// A partition of `0..len` over `world` ranks from `cuts` (any values):
/// `2 * world` sorted cut points, rank `k` owning `c[2k]..c[2k+1]`, so
/// ranges may be empty and elements may belong to nobody.
fn partition(len: usize, world: usize, cuts: &[u64]) -> Vec<Range<usize>> {
    let mut c: Vec<usize> = (0..2 * world)
        .map(|i| (cuts[i % cuts.len()].wrapping_mul(i as u64 + 1) % (len as u64 + 1)) as usize)
        .collect();
    c.sort_unstable();
    (0..world).map(|k| c[2 * k]..c[2 * k + 1]).collect()
}

/// The whole arena split evenly (what the optimizer's partition looks like).
fn even(len: usize, world: usize) -> Vec<Range<usize>> {
    (0..world)
        .map(|k| k * len / world..(k + 1) * len / world)
        .collect()
}

/// The worlds a contract runs `logical` over.
fn worlds(contract: ReduceContract, logical: usize) -> Vec<usize> {
    match contract {
        ReduceContract::FixedTree => (0..=logical.trailing_zeros()).map(|k| 1 << k).collect(),
        _ => divisors(logical),
    }
}

fn reference(contract: ReduceContract, a: &[Vec<f32>]) -> Vec<f32> {
    match contract {
        ReduceContract::FixedTree => host_tree_mean(&refs(a)).unwrap(),
        _ => host_mean(&refs(a)).unwrap(),
    }
}

fn contracts() -> impl Strategy<Value = (ReduceContract, usize)> {
    prop_oneof![
        (1usize..=12).prop_map(|l| (ReduceContract::FixedOrder, l)),
        (0u32..=4).prop_map(|k| (ReduceContract::FixedTree, 1usize << k)),
    ]
}

fn deliveries() -> impl Strategy<Value = Delivery> {
    prop_oneof![
        Just(Delivery::InOrder),
        Just(Delivery::Reversed),
        any::<u64>().prop_map(Delivery::Shuffled)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn every_owned_range_holds_the_full_reductions_bits(
        (contract, logical) in contracts(),
        len in prop_oneof![0usize..=24, 0usize..=5000],
        seed in any::<u64>(),
        cuts in proptest::collection::vec(any::<u64>(), 1..8),
        chunk in proptest::option::of(1usize..=1500),
        delivery in deliveries(),
        lanes in proptest::option::of(any::<u64>()),
    ) {
        let a = arenas(seed, logical, len);
        let want = reference(contract, &a);
        let world = EmulatedWorld::new(a).unwrap();
        for p in worlds(contract, logical) {
            let owned = partition(len, p, &cuts);
            let opts = EmulateOptions { chunk_elems: chunk, delivery, lanes, contract };
            let per_rank = world.reduce_scatter_per_rank(p, &opts, &owned).unwrap();
            for (r, got) in per_rank.iter().enumerate() {
                let o = owned[r].clone();
                assert_bits_eq(
                    &got[o.clone()],
                    &want[o],
                    &format!("{contract} L={logical} P={p} len={len} rank {r} {owned:?} {opts:?}"),
                );
            }
        }
    }
}

/// The cut is real: at P >= 2 with the arena split evenly, every rank moves
/// fewer bytes than the all-reduce plan (and some rank's non-owned elements
/// are not the mean, which an all-reduce would have made them).
#[test]
fn the_plans_move_less_and_leave_other_ranges_unreduced() {
    let len = 4096;
    for (contract, logical, p) in [
        (ReduceContract::FixedOrder, 2, 2),
        (ReduceContract::FixedOrder, 4, 4),
        (ReduceContract::FixedOrder, 8, 2),
        (ReduceContract::FixedOrder, 6, 3),
        (ReduceContract::FixedTree, 4, 2),
        (ReduceContract::FixedTree, 8, 4),
    ] {
        let owned = even(len, p);
        let what = format!("{contract} L={logical} P={p}");
        for rank in 0..p {
            let full = RankPlan::for_contract(contract, rank, p, logical, len, None).unwrap();
            let cut =
                RankPlan::ending_at_owners(contract, rank, p, logical, len, None, &owned).unwrap();
            let moved = |p: &RankPlan| p.cost().bytes_sent + p.cost().bytes_received;
            let (f, c) = (moved(&full), moved(&cut));
            // (In the pipeline, rank P-2 still sends the whole prefix: it
            // moves less by what it no longer receives.)
            assert!(c < f, "{what} rank {rank}: {c} bytes moved cut vs {f} full");
            assert_eq!(cut.owners(), Some(owned.as_slice()));
            assert_eq!(full.owners(), None);
        }
        let a = arenas(7, logical, len);
        let want = reference(contract, &a);
        let per_rank = EmulatedWorld::new(a)
            .unwrap()
            .reduce_scatter_per_rank(
                p,
                &EmulateOptions {
                    contract,
                    ..Default::default()
                },
                &owned,
            )
            .unwrap();
        let unreduced: usize = per_rank
            .iter()
            .enumerate()
            .map(|(r, got)| {
                let outside: Vec<usize> = (0..len).filter(|i| !owned[r].contains(i)).collect();
                let g: Vec<f32> = outside.iter().map(|&i| got[i]).collect();
                let w: Vec<f32> = outside.iter().map(|&i| want[i]).collect();
                differing(&g, &w)
            })
            .sum();
        assert!(unreduced > 0, "{what}: every element reached every rank");
    }
}

/// Sharded P = L: the traffic the module docs state, `(P-1)/P N (1 + 1/P)`
/// per rank with one chunk and an even partition (against `2 (P-1)/P N`).
#[test]
fn sharded_traffic_is_a_reduce_scatter_plus_a_pth() {
    let (p, len) = (4usize, 4096usize);
    let owned = even(len, p);
    for rank in 0..p {
        let c =
            RankPlan::ending_at_owners(ReduceContract::FixedOrder, rank, p, p, len, None, &owned)
                .unwrap()
                .cost();
        // Scatter: 3 shards of 1024 out; gather: of this rank's fold shard
        // (a quarter of the arena) only the part another rank owns, which,
        // with one chunk and the fold shards equal to the partition, is none.
        assert_eq!(c.bytes_sent, 4 * 3 * 1024, "rank {rank}");
    }
}

#[test]
fn live_threads_end_at_the_owners_with_the_oracles_bits() {
    for (contract, logical, p) in [
        (ReduceContract::FixedOrder, 4, 2),
        (ReduceContract::FixedOrder, 3, 3),
        (ReduceContract::FixedTree, 8, 4),
        (ReduceContract::FixedTree, 4, 2),
        (ReduceContract::NcclSum, 4, 2),
    ] {
        let len = 3001;
        let a = arenas(11, logical, len);
        let owned = partition(len, p, &[5, 99, 1234567]);
        let blocks = logical / p;
        let opts = ReducerOptions {
            chunk_elems: Some(700),
            ..ReducerOptions::new(contract, logical)
        };
        let got = run_world(p, opts, |rank, r| {
            let block = &a[rank * blocks..(rank + 1) * blocks];
            let local = if contract == ReduceContract::FixedTree {
                let mut acc = TreeAccumulator::new(blocks, len).unwrap();
                for g in block {
                    acc.push(&mut mamba_reduce::HostFold, g.clone()).unwrap();
                }
                vec![acc.finish().unwrap()]
            } else {
                block.to_vec()
            };
            // Twice: the second call reuses the agreed partition and plan
            // and must give the same bits.
            let mut first = local.clone();
            r.reduce_mean_shard(&mut first, &owned).unwrap();
            let mut second = local;
            r.reduce_mean_shard(&mut second, &owned).unwrap();
            let o = owned[rank].clone();
            assert_bits_eq(&first[0][o.clone()], &second[0][o], "second call");
            first.swap_remove(0)
        });
        let what = format!("{contract} L={logical} P={p}");
        if contract == ReduceContract::NcclSum {
            // The library sum reduces everything (no plan to cut), close to
            // the reference but not pinned.
            let want = host_mean(&refs(&a)).unwrap();
            for g in &got {
                for (i, (x, y)) in g.iter().zip(&want).enumerate() {
                    // Within rounding of the addends' magnitudes (the sum
                    // may cancel).
                    let scale: f32 = a.iter().map(|v| v[i].abs()).sum::<f32>() / logical as f32;
                    assert!(
                        (x - y).abs() <= 1e-6 * scale,
                        "{what} element {i}: {x} vs {y}"
                    );
                }
            }
            continue;
        }
        let want = reference(contract, &a);
        for (rank, g) in got.iter().enumerate() {
            let o = owned[rank].clone();
            assert_bits_eq(&g[o.clone()], &want[o], &format!("{what} rank {rank}"));
        }
    }
}

#[test]
fn a_partition_that_differs_between_ranks_fails_every_rank() {
    let len = 100;
    let errs = run_world(
        3,
        ReducerOptions::new(ReduceContract::FixedOrder, 3),
        |rank, r| {
            let owned = if rank == 2 {
                vec![0..30, 30..60, 60..100]
            } else {
                even(len, 3)
            };
            let mut local = vec![vec![rank as f32; len]];
            r.reduce_mean_shard(&mut local, &owned)
                .unwrap_err()
                .to_string()
        },
    );
    for e in errs {
        assert!(e.contains("differ from rank 0's on ranks 2"), "{e}");
    }
}

#[test]
fn a_partition_that_changes_after_the_first_call_is_refused() {
    let len = 64;
    let errs = run_world(
        2,
        ReducerOptions::new(ReduceContract::FixedOrder, 2),
        |_, r| {
            let mut local = vec![vec![1.0f32; len]];
            r.reduce_mean_shard(&mut local, &even(len, 2)).unwrap();
            r.reduce_mean_shard(&mut local, &[0..10, 10..64])
                .unwrap_err()
                .to_string()
        },
    );
    for e in errs {
        assert!(e.contains("must not change"), "{e}");
    }
}

#[test]
fn bad_partitions_are_named() {
    let e = RankPlan::ending_at_owners(
        ReduceContract::FixedOrder,
        0,
        2,
        2,
        10,
        None,
        std::slice::from_ref(&(0..5)),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("needs 2 owned ranges"), "{e}");
    let e = RankPlan::ending_at_owners(
        ReduceContract::FixedOrder,
        0,
        2,
        2,
        10,
        None,
        &[0..6, 4..10],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("ascending and disjoint"), "{e}");
    let e = RankPlan::ending_at_owners(ReduceContract::NcclSum, 0, 2, 2, 10, None, &[0..5, 5..10])
        .unwrap_err()
        .to_string();
    assert!(e.contains("no plan"), "{e}");
}

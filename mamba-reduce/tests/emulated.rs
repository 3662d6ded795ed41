//! The oracle against the reference fold: every physical world, chunking and
//! delivery order gives the bits of `host_mean`; and negative controls
//! showing the value sets are ones where the order (and L) matter.

mod common;

use common::{arenas, assert_bits_eq, differing, divisors};
use mamba_reduce::{host_fold, host_mean, mean_factor, Delivery, EmulateOptions, EmulatedWorld};
use proptest::prelude::*;

const PRIMES: [usize; 10] = [2, 3, 5, 7, 13, 97, 1009, 4099, 7919, 9973];

fn lengths() -> impl Strategy<Value = usize> {
    prop_oneof![
        0usize..=20,                               // fewer elements than ranks
        proptest::sample::select(PRIMES.to_vec()), // primes: uneven shards
        0usize..=10_000,
    ]
}

fn deliveries() -> impl Strategy<Value = Delivery> {
    prop_oneof![
        Just(Delivery::InOrder),
        Just(Delivery::Reversed),
        any::<u64>().prop_map(Delivery::Shuffled)
    ]
}

fn refs(a: &[Vec<f32>]) -> Vec<&[f32]> {
    a.iter().map(|v| v.as_slice()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// For every P dividing L: the emulated dataflow equals the reference
    /// ascending fold bit for bit, whatever the chunking and delivery order.
    #[test]
    fn every_physical_world_gives_the_reference_bits(
        logical in 1usize..=16,
        len in lengths(),
        seed in any::<u64>(),
        chunk in proptest::option::of(1usize..=3000),
        delivery in deliveries(),
        lanes in proptest::option::of(any::<u64>()),
    ) {
        let a = arenas(seed, logical, len);
        let want = host_mean(&refs(&a)).unwrap();
        let world = EmulatedWorld::new(a).unwrap();
        for p in divisors(logical) {
            let opts = EmulateOptions { chunk_elems: chunk, delivery, lanes, ..Default::default() };
            let got = world.reduce_mean(p, &opts).unwrap();
            assert_bits_eq(&got, &want, &format!("L={logical} P={p} len={len} {opts:?}"));
        }
    }

    /// The two-lane schedules the NCCL executor may run (folds overlapping
    /// later groups, within the plan's waits) give the sequential bits, for
    /// many chunks (so many steps overlap) and every physical world.
    #[test]
    fn two_lane_schedules_give_the_reference_bits(
        logical in 1usize..=8,
        len in 0usize..=2000,
        chunks in 1usize..=12,
        seed in any::<u64>(),
    ) {
        let a = arenas(seed, logical, len);
        let want = host_mean(&refs(&a)).unwrap();
        let world = EmulatedWorld::new(a).unwrap();
        let chunk = len.div_ceil(chunks).max(1);
        for p in divisors(logical) {
            let opts = EmulateOptions { chunk_elems: Some(chunk), lanes: Some(seed ^ p as u64), ..Default::default() };
            let per_rank = world.reduce_mean_per_rank(p, &opts).unwrap();
            for (r, got) in per_rank.iter().enumerate() {
                assert_bits_eq(got, &want, &format!("L={logical} P={p} len={len} rank {r} {opts:?}"));
            }
        }
    }

    /// Negative control, fold tree: on these value sets the reversed and the
    /// pairwise trees give different bits than the ascending chain (for
    /// L >= 3 and enough elements), so the equality above is not vacuous.
    #[test]
    fn another_fold_tree_changes_the_bits(logical in 3usize..=16, seed in any::<u64>()) {
        let len = 256;
        let a = arenas(seed, logical, len);
        let r = refs(&a);
        let mut asc = vec![0.0; len];
        host_fold(&r, &mut asc).unwrap();
        let rev: Vec<&[f32]> = r.iter().rev().copied().collect();
        let mut desc = vec![0.0; len];
        host_fold(&rev, &mut desc).unwrap();
        prop_assert!(differing(&asc, &desc) > 0, "reversed order gave the same bits");
        let pair = pairwise(&r);
        if logical >= 4 {
            prop_assert!(differing(&asc, &pair) > 0, "pairwise tree gave the same bits");
        }
    }

    /// Negative control, logical world: the same data seen as L/2 logical
    /// ranks (each holding the sum of two neighbours' gradients, i.e. a
    /// different L) reduces to different bits: L is part of a run's identity.
    #[test]
    fn another_logical_world_changes_the_bits(half in 2usize..=8, seed in any::<u64>()) {
        let logical = 2 * half;
        let len = 256;
        let a = arenas(seed, logical, len);
        let m = EmulatedWorld::new(a.clone()).unwrap().reduce_mean(1, &EmulateOptions::default()).unwrap();
        let merged: Vec<Vec<f32>> = a
            .chunks(2)
            .map(|p| p[0].iter().zip(&p[1]).map(|(x, y)| (x + y) * 0.5).collect())
            .collect();
        let m2 = EmulatedWorld::new(merged).unwrap().reduce_mean(1, &EmulateOptions::default()).unwrap();
        prop_assert!(differing(&m, &m2) > 0, "L={} and L={} gave the same bits", logical, half);
    }
}

fn pairwise(r: &[&[f32]]) -> Vec<f32> {
    if r.len() == 1 {
        return r[0].to_vec();
    }
    let (lo, hi) = r.split_at(r.len() / 2);
    let (a, b) = (pairwise(lo), pairwise(hi));
    a.iter().zip(&b).map(|(x, y)| x + y).collect()
}

/// The textbook case: 2^27 + 1 - 2^27 + 1 is 1 left to right, 0 pairwise.
#[test]
fn order_matters_on_a_known_case() {
    let big = 134_217_728.0f32;
    let a = vec![vec![big], vec![1.0], vec![-big], vec![1.0]];
    let m = EmulatedWorld::new(a.clone())
        .unwrap()
        .reduce_mean(2, &EmulateOptions::default())
        .unwrap();
    assert_eq!(m[0], 0.25);
    assert_eq!(pairwise(&refs(&a))[0] * mean_factor(4), 0.0);
}

/// Exhaustive small corner: every L in 1..=16, every divisor, lengths around
/// the rank count, tiny chunks (many pipeline steps), all three deliveries.
#[test]
fn small_lengths_and_tiny_chunks() {
    for logical in 1..=16usize {
        for len in [
            0,
            1,
            logical.saturating_sub(1),
            logical,
            logical + 1,
            3 * logical + 2,
        ] {
            let a = arenas(logical as u64 * 1000 + len as u64, logical, len);
            let want = host_mean(&refs(&a)).unwrap();
            let world = EmulatedWorld::new(a).unwrap();
            for p in divisors(logical) {
                for chunk in [None, Some(1), Some(2), Some(5)] {
                    for (delivery, lanes) in [
                        (Delivery::InOrder, None),
                        (Delivery::Reversed, None),
                        (Delivery::Shuffled(len as u64), None),
                        (Delivery::InOrder, Some(len as u64)),
                    ] {
                        let got = world
                            .reduce_mean(
                                p,
                                &EmulateOptions {
                                    chunk_elems: chunk,
                                    delivery,
                                    lanes,
                                    ..Default::default()
                                },
                            )
                            .unwrap();
                        assert_bits_eq(
                            &got,
                            &want,
                            &format!("L={logical} P={p} len={len} chunk={chunk:?}"),
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn emulated_world_refuses_bad_input() {
    assert!(EmulatedWorld::new(vec![]).is_err());
    let err = EmulatedWorld::new(vec![vec![1.0], vec![]])
        .unwrap_err()
        .to_string();
    assert!(err.contains("arena 1 has 0 elements, expected 1"), "{err}");
    let w = EmulatedWorld::new(vec![vec![1.0]; 4]).unwrap();
    assert!(w
        .reduce_mean(3, &EmulateOptions::default())
        .unwrap_err()
        .to_string()
        .contains("not a multiple"));
}

//! The fixed-tree contract end to end on the host: the emulated oracle and
//! live thread worlds against the scalar tree reference, for every
//! power-of-two P dividing L, every delivery order and ragged lengths; the
//! negative control (the chain's bits differ); and the refusals (an L that
//! is not a power of two, a wrong arena count).

mod common;

use common::{arenas, assert_bits_eq, differing, run_world};
use mamba_reduce::{
    host_mean, host_tree_mean, Delivery, EmulateOptions, EmulatedWorld, HostReducer,
    ReduceContract, Reducer, ReducerOptions, Result, TreeAccumulator,
};
use proptest::prelude::*;

const TREE: ReduceContract = ReduceContract::FixedTree;

fn refs(a: &[Vec<f32>]) -> Vec<&[f32]> {
    a.iter().map(|v| v.as_slice()).collect()
}

/// Powers of two dividing `n` (itself a power of two), ascending.
fn power_of_two_worlds(n: usize) -> Vec<usize> {
    (0..=n.trailing_zeros()).map(|k| 1 << k).collect()
}

fn lengths() -> impl Strategy<Value = usize> {
    prop_oneof![
        0usize..=20, // fewer elements than ranks: empty shards
        proptest::sample::select(vec![7usize, 97, 1009, 4099]),
        0usize..=6000,
    ]
}

fn deliveries() -> impl Strategy<Value = Delivery> {
    prop_oneof![
        Just(Delivery::InOrder),
        Just(Delivery::Reversed),
        any::<u64>().prop_map(Delivery::Shuffled)
    ]
}

fn tree_opts(chunk: Option<usize>, delivery: Delivery, lanes: Option<u64>) -> EmulateOptions {
    EmulateOptions {
        chunk_elems: chunk,
        delivery,
        lanes,
        contract: TREE,
    }
}

/// What a live process does under the fixed tree: fold its block in
/// logical order through the reducer's own arithmetic, computing each leaf
/// into a spare buffer when there is one, then reduce the one block sum.
/// Returns the mean and the most buffers the block ever needed.
fn live_rank(r: &mut HostReducer, block: &[Vec<f32>]) -> Result<(Vec<f32>, usize)> {
    let len = block.first().map_or(0, Vec::len);
    let mut acc = TreeAccumulator::new(block.len(), len)?;
    let mut allocated = 0;
    for g in block {
        let mut leaf = acc.take_spare().unwrap_or_else(|| {
            allocated += 1;
            vec![f32::NAN; len]
        });
        leaf.copy_from_slice(g);
        let fold = r
            .local_fold()
            .expect("the host reducer offers its fold arithmetic");
        acc.push(fold, leaf)?;
    }
    let mut local = [acc.finish()?];
    r.reduce_mean(&mut local)?;
    let [mean] = local;
    Ok((mean, allocated))
}

fn live_tree(a: &[Vec<f32>], world: usize, chunk: Option<usize>) -> Vec<(Vec<f32>, usize)> {
    let blocks = a.len() / world;
    let opts = ReducerOptions {
        chunk_elems: chunk,
        ..ReducerOptions::new(TREE, a.len())
    };
    run_world(world, opts, |rank, r| {
        live_rank(r, &a[rank * blocks..(rank + 1) * blocks]).unwrap()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// The oracle: for every power-of-two P dividing L = 2^k, every chunking,
    /// delivery order and two-lane schedule, every emulated rank ends with
    /// the scalar tree's bits.
    #[test]
    fn every_power_of_two_world_gives_the_tree_reference(
        k in 0u32..=6,
        len in lengths(),
        seed in any::<u64>(),
        chunk in proptest::option::of(1usize..=2500),
        delivery in deliveries(),
        lanes in proptest::option::of(any::<u64>()),
    ) {
        let logical = 1usize << k;
        let a = arenas(seed, logical, len);
        let want = host_tree_mean(&refs(&a)).unwrap();
        let world = EmulatedWorld::new(a).unwrap();
        for p in power_of_two_worlds(logical) {
            let opts = tree_opts(chunk, delivery, lanes);
            for (r, got) in world.reduce_mean_per_rank(p, &opts).unwrap().iter().enumerate() {
                assert_bits_eq(got, &want, &format!("L={logical} P={p} len={len} rank {r} {opts:?}"));
            }
        }
    }

    /// Live thread worlds: every rank's mean equals the oracle and the
    /// reference, and no rank held more than log2(L/P) + 1 block buffers.
    #[test]
    fn live_threads_equal_the_oracle(
        k in 0u32..=4,
        pick in any::<prop::sample::Index>(),
        len in lengths(),
        seed in any::<u64>(),
        chunk in proptest::option::of(1usize..=3000),
    ) {
        let logical = 1usize << k;
        let worlds: Vec<usize> = power_of_two_worlds(logical).into_iter().filter(|&p| p <= 8).collect();
        let world = worlds[pick.index(worlds.len())];
        let a = arenas(seed, logical, len);
        let want = host_tree_mean(&refs(&a)).unwrap();
        let oracle = EmulatedWorld::new(a.clone()).unwrap()
            .reduce_mean(world, &tree_opts(chunk, Delivery::InOrder, None)).unwrap();
        assert_bits_eq(&oracle, &want, "oracle vs reference");
        let most = TreeAccumulator::<Vec<f32>>::max_buffers(logical / world);
        for (rank, (got, allocated)) in live_tree(&a, world, chunk).iter().enumerate() {
            assert_bits_eq(got, &want, &format!("L={logical} P={world} len={len} rank {rank}"));
            prop_assert!(*allocated <= most, "rank {} allocated {} > {}", rank, allocated, most);
        }
    }

    /// Negative control: on these value sets the tree and the chain give
    /// different bits (L >= 4), so the equalities above pin the tree, not
    /// just "some deterministic sum".
    #[test]
    fn the_chain_gives_other_bits(k in 2u32..=6, seed in any::<u64>()) {
        let logical = 1usize << k;
        let a = arenas(seed, logical, 256);
        let tree = EmulatedWorld::new(a.clone()).unwrap()
            .reduce_mean(1, &tree_opts(None, Delivery::InOrder, None)).unwrap();
        let chain = host_mean(&refs(&a)).unwrap();
        prop_assert!(differing(&tree, &chain) > 0, "L={}: tree and chain agree everywhere", logical);
    }
}

/// The textbook case: 2^27, 1, -2^27, 1 is 1 as a chain and 0 as a tree,
/// on one, two and four live processes alike.
#[test]
fn the_known_case_is_the_tree_on_every_world() {
    let big = 134_217_728.0f32;
    let a = vec![
        vec![big, 1.0],
        vec![1.0, 2.0],
        vec![-big, 3.0],
        vec![1.0, 4.0],
    ];
    let chain = host_mean(&refs(&a)).unwrap();
    assert_eq!(chain, vec![0.25, 2.5]);
    for world in [1, 2, 4] {
        for (rank, (got, _)) in live_tree(&a, world, None).into_iter().enumerate() {
            assert_eq!(got, vec![0.0, 2.5], "P={world} rank {rank}");
        }
    }
    // The fixed-order world, from the same arenas: the chain's bits.
    let fixed = EmulatedWorld::new(a)
        .unwrap()
        .reduce_mean(2, &EmulateOptions::default())
        .unwrap();
    assert_eq!(fixed, chain);
}

/// A block of 64 micro-batches on one process folds in 7 buffers.
#[test]
fn a_deep_block_needs_logarithmic_buffers() {
    let a = arenas(9, 64, 300);
    let want = host_tree_mean(&refs(&a)).unwrap();
    for (world, most) in [(1, 7), (2, 6), (8, 4)] {
        for (got, allocated) in live_tree(&a, world, None) {
            assert_bits_eq(&got, &want, &format!("P={world}"));
            assert_eq!(allocated, most, "P={world}");
        }
    }
}

/// An L that is not a power of two fails on every rank, at the agreement
/// check, naming L; in the oracle and the plan as well.
#[test]
fn a_logical_world_that_is_not_a_power_of_two_is_refused() {
    for (logical, world) in [(6usize, 2usize), (3, 3), (12, 4)] {
        let errors = run_world(world, ReducerOptions::new(TREE, logical), |_, r| {
            let mut local = vec![vec![1.0f32; 5]];
            r.reduce_mean(&mut local).unwrap_err().to_string()
        });
        for (rank, e) in errors.iter().enumerate() {
            assert!(
                e.contains(&format!("got L = {logical}")) && e.contains("power of two"),
                "L={logical} P={world} rank {rank}: {e}"
            );
        }
    }
    let e = EmulatedWorld::new(vec![vec![1.0]; 6])
        .unwrap()
        .reduce_mean(2, &tree_opts(None, Delivery::InOrder, None))
        .unwrap_err()
        .to_string();
    assert!(e.contains("got L = 6"), "{e}");
    assert!(mamba_reduce::RankPlan::tree(0, 1, 5, 10, None).is_err());
}

/// Passing the L/P arenas instead of the block sum is named on the rank
/// that did it; its peers fail too (naming it) instead of waiting.
#[test]
fn the_tree_takes_one_block_sum_per_process() {
    let errors = run_world(2, ReducerOptions::new(TREE, 4), |rank, r| {
        let n = if rank == 1 { 2 } else { 1 };
        let mut local = vec![vec![1.0f32; 5]; n];
        r.reduce_mean(&mut local).unwrap_err().to_string()
    });
    assert!(
        errors[1].contains("passed 2 local arenas")
            && errors[1].contains("each process passes 1, the tree sum of its block of 2"),
        "{}",
        errors[1]
    );
    assert!(errors[0].contains("rank 1"), "{}", errors[0]);
    // The oracle has no plan for the library's sum.
    let e = EmulatedWorld::new(vec![vec![1.0]; 2])
        .unwrap()
        .reduce_mean(
            2,
            &EmulateOptions {
                contract: ReduceContract::NcclSum,
                ..EmulateOptions::default()
            },
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("no plan"), "{e}");
}

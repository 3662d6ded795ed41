//! Plan construction: costs, chunk defaults, and every plan validating with
//! paired messages.

use super::*;
use proptest::prelude::*;

#[test]
fn two_ranks_one_chunk_is_two_groups_and_one_fused_fold() {
    for rank in 0..2 {
        let p = RankPlan::new(rank, 2, 2, 1 << 20, None).unwrap();
        let c = p.cost();
        assert_eq!(p.dataflow(), Dataflow::Sharded);
        assert_eq!(p.chunks(), 1);
        assert_eq!(
            (
                c.steps,
                c.groups,
                c.fold_launches,
                c.scale_launches,
                c.copies
            ),
            (2, 2, 1, 0, 0)
        );
        // Half the arena out in each phase: one all-reduce's bytes.
        assert_eq!(c.bytes_sent, 4 << 20);
        assert_eq!(c.bytes_received, 4 << 20);
        assert_eq!(c.scratch_bytes, 2 << 20);
        // Fold: own shard + one slot read, own shard written.
        assert_eq!(c.fold_bytes, 3 * (2 << 20));
    }
}

#[test]
fn two_chunk_sharded_plans_double_buffer_their_slots() {
    let len = 32 << 20;
    let p = RankPlan::new(1, 2, 2, len, Some(len / 2)).unwrap();
    assert_eq!(p.chunks(), 2);
    let c = p.cost();
    assert_eq!((c.steps, c.groups, c.fold_launches), (4, 4, 2));
    assert_eq!(c.bytes_sent, 4 * len as u64);
    // Two slot sets of half a chunk's shard: still half the arena.
    assert_eq!(c.scratch_bytes, 2 * len as u64);
    let default = RankPlan::new(1, 2, 2, len, None).unwrap();
    assert_eq!(default.chunks(), 1, "sharded plans default to one chunk");
}

#[test]
fn sharded_bytes_match_ring_all_reduce() {
    let (world, len) = (8, 8 * 1000);
    for rank in 0..world {
        let c = RankPlan::new(rank, world, world, len, Some(1000))
            .unwrap()
            .cost();
        assert_eq!(c.bytes_sent, 4 * 2 * 7 * 1000);
        assert_eq!(c.copies, 0);
    }
}

#[test]
fn ranks_past_the_chain_limit_copy_their_shard() {
    let (world, len) = (5, 1000);
    for rank in 0..world {
        let p = RankPlan::with_dst_limit(rank, world, world, len, None, 3).unwrap();
        assert_eq!(p.cost().copies, usize::from(rank >= 3), "rank {rank}");
    }
}

#[test]
fn pipeline_bytes_are_near_one_all_reduce() {
    let len = 1 << 20;
    for rank in 0..2 {
        let p = RankPlan::new(rank, 2, 4, len, Some(len / 16)).unwrap();
        assert_eq!(p.dataflow(), Dataflow::Pipeline);
        let c = p.cost();
        assert_eq!(c.bytes_sent, 4 * len as u64);
        assert_eq!(c.steps, 16 + 3);
        assert_eq!(c.groups, 16 + 2);
        assert_eq!(c.fold_launches, 16);
        assert_eq!(c.scale_launches, 0);
        assert_eq!(
            c.scratch_bytes,
            if rank == 0 {
                0
            } else {
                2 * 4 * len as u64 / 16
            }
        );
    }
}

#[test]
fn default_chunks_follow_the_documented_counts() {
    let chunks = |mib: usize, p: usize, l: usize| {
        let len = mib * (1 << 20) / 4;
        len.div_ceil(RankPlan::default_chunk(len, p, l))
    };
    assert_eq!(chunks(1024, 2, 4), 9);
    assert_eq!(chunks(256, 2, 4), 5);
    assert_eq!(chunks(64, 2, 4), 2);
    assert_eq!(chunks(16, 2, 4), 1);
    assert_eq!(chunks(4, 2, 4), 1);
    assert_eq!(chunks(1024, 2, 2), 1);
    assert_eq!(chunks(256, 2, 2), 1);
    assert_eq!(chunks(128, 2, 2), 1);
    assert_eq!(chunks(64, 2, 2), 1);
    assert_eq!(chunks(32, 2, 2), 1);
    assert_eq!(chunks(1024, 1, 4), 1);
    assert_eq!(RankPlan::default_chunk(0, 2, 4), 1);
    assert_eq!(RankPlan::default_chunk(5000, 2, 4) % chunk::CHUNK_ALIGN, 0);
}

#[test]
fn pipeline_sends_at_most_twice_the_arena() {
    let len = 1000;
    let cost = |r| RankPlan::new(r, 4, 8, len, Some(64)).unwrap().cost();
    let sent: Vec<u64> = (0..4).map(|r| cost(r).bytes_sent).collect();
    let l = 4 * len as u64;
    assert_eq!(sent, vec![2 * l, 2 * l, l, l]);
    let got: Vec<u64> = (0..4).map(|r| cost(r).bytes_received).collect();
    assert_eq!(got, vec![l, 2 * l, 2 * l, l]);
}

#[test]
fn chain_launch_counts() {
    let max = kernels::MAX_CHAIN_ADDENDS;
    assert_eq!(chain_launches(1), 1);
    assert_eq!(chain_launches(max), 1);
    assert_eq!(chain_launches(max + 1), 2);
    assert_eq!(chain_launches(2 * max - 1), 2);
    assert_eq!(chain_launches(2 * max), 3);
}

#[test]
fn bad_worlds_are_config_errors() {
    assert!(RankPlan::new(0, 3, 4, 10, None)
        .unwrap_err()
        .to_string()
        .contains("not a multiple"));
    assert!(RankPlan::new(2, 2, 2, 10, None).is_err());
    assert!(RankPlan::new(0, 2, 2, 10, Some(0)).is_err());
    assert!(RankPlan::new(0, 0, 2, 10, None).is_err());
}

proptest! {
    #[test]
    fn every_plan_validates_and_messages_pair_up(
        world in 1usize..=8,
        blocks in 1usize..=3,
        len in 0usize..300,
        chunk in proptest::option::of(1usize..64),
        dst_limit in 1usize..=9,
    ) {
        let l = world * blocks;
        let plans: Vec<RankPlan> = (0..world)
            .map(|r| RankPlan::with_dst_limit(r, world, l, len, chunk, dst_limit).unwrap())
            .collect();
        let steps = plans.iter().map(|p| p.steps.len()).max().unwrap_or(0);
        for t in 0..steps {
            for a in 0..world {
                for b in 0..world {
                    let sent: Vec<usize> = plans[a].steps.get(t).map_or(vec![], |s| s.comm.iter().filter_map(|op| match op {
                        CommOp::Send { range, peer, .. } if *peer == b => Some(range.len()),
                        _ => None,
                    }).collect());
                    let got: Vec<usize> = plans[b].steps.get(t).map_or(vec![], |s| s.comm.iter().filter_map(|op| match op {
                        CommOp::Recv { range, peer, .. } if *peer == a => Some(range.len()),
                        _ => None,
                    }).collect());
                    prop_assert_eq!(sent, got, "step {} {} -> {}", t, a, b);
                }
            }
        }
    }
}

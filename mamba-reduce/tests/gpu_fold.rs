//! Single-GPU loopback harness: the device fold, scale and copy against the
//! host fold bit for bit, and whole emulated worlds (every rank on one
//! device, messages as device copies) against the host oracle. Skips
//! without a GPU unless MAMBA_REQUIRE_GPU=1.

mod common;

use common::{arenas, assert_bits_eq, divisors, gpu_stream, Rng};
use mamba_reduce::{
    host_mean, host_scale, host_tree_mean, mean_factor, ChainTerm, Delivery, DeviceFold,
    EmulateOptions, EmulatedWorld, EmulatorMemory, FoldOps, HostFold, ReduceContract,
};

#[test]
fn kernel_fold_equals_host_fold_bit_for_bit() {
    let Some(stream) = gpu_stream() else { return };
    let mut fold = DeviceFold::load(&stream).expect("load fold and scale kernels");
    let mut rng = Rng(2024);
    for n_slots in 1..=16usize {
        for len in [1usize, 3, 4, 5, 257, 4099, 65_537] {
            for (slots_off, out_off, pad) in
                [(0usize, 0usize, 0usize), (1, 3, 0), (0, 0, 5), (4, 8, 3)]
            {
                let stride = len + pad;
                let total = slots_off + (n_slots - 1) * stride + len;
                let slots_h: Vec<f32> = (0..total).map(|_| rng.wide()).collect();
                let out0: Vec<f32> = (0..out_off + len).map(|_| rng.wide()).collect();
                let rows: Vec<&[f32]> = (0..n_slots)
                    .map(|k| &slots_h[slots_off + k * stride..][..len])
                    .collect();
                let what = format!(
                    "{n_slots} slots x {len}, offsets {slots_off}/{out_off}, stride {stride}"
                );

                let slots_d = fold.load(&slots_h).unwrap();
                let logical = n_slots;
                let mut sc_d = fold.load(&out0).unwrap();
                fold.scale(&mut sc_d, out_off, len, mean_factor(logical))
                    .unwrap();
                let got = fold.store(&sc_d).unwrap();
                let mut want = out0.clone();
                host_scale(&mut want[out_off..], mean_factor(logical));
                assert_bits_eq(&got, &want, &format!("scale by 1/{logical}, {what}"));

                // The chain: slots in order with the output's own values at
                // position n_slots / 2, scaled by 1/(n_slots + 1) (fused).
                let at = n_slots / 2;
                let factor = Some(mean_factor(n_slots + 1));
                let mut ch_d = fold.load(&out0).unwrap();
                let terms = slot_terms(&slots_d, slots_off, n_slots, stride, at);
                fold.chain(&mut ch_d, out_off, &terms, len, factor).unwrap();
                let got = fold.store(&ch_d).unwrap();
                let mut want = out0.clone();
                let terms = slot_terms(&slots_h, slots_off, n_slots, stride, at);
                HostFold
                    .chain(&mut want, out_off, &terms, len, factor)
                    .unwrap();
                assert_bits_eq(&got, &want, &format!("chain, output at {at}, {what}"));

                let mut cp_d = fold.load(&out0).unwrap();
                fold.copy(&slots_d, slots_off, &mut cp_d, out_off, len)
                    .unwrap();
                let got = fold.store(&cp_d).unwrap();
                let mut want = out0.clone();
                want[out_off..].copy_from_slice(rows[0]);
                assert_bits_eq(&got, &want, &format!("copy {what}"));
            }
        }
    }
}

/// `n_slots` strided slots of `b` as chain terms, the output at `at`.
fn slot_terms<B>(
    b: &B,
    slots_off: usize,
    n_slots: usize,
    stride: usize,
    at: usize,
) -> Vec<ChainTerm<&B>> {
    let mut t: Vec<ChainTerm<&B>> = (0..n_slots)
        .map(|k| ChainTerm::Buf(b, slots_off + k * stride))
        .collect();
    t.insert(at, ChainTerm::Dst);
    t
}

#[test]
fn loopback_worlds_on_one_gpu_equal_the_host_oracle() {
    let Some(stream) = gpu_stream() else { return };
    let mut fold = DeviceFold::load(&stream).expect("load fold and scale kernels");
    for logical in 1..=16usize {
        for len in [1usize, 7, 1009, 100_003] {
            let a = arenas(logical as u64 * 7919 + len as u64, logical, len);
            let want = host_mean(&a.iter().map(|v| v.as_slice()).collect::<Vec<_>>()).unwrap();
            let world = EmulatedWorld::new(a).unwrap();
            for p in divisors(logical) {
                for (chunk, delivery) in [
                    (None, Delivery::InOrder),
                    (Some(997), Delivery::Shuffled(p as u64)),
                    (Some(1024), Delivery::Reversed),
                ] {
                    let opts = EmulateOptions {
                        chunk_elems: chunk,
                        delivery,
                        lanes: None,
                        ..Default::default()
                    };
                    let per_rank = world.reduce_mean_per_rank_on(p, &opts, &mut fold).unwrap();
                    for (r, got) in per_rank.iter().enumerate() {
                        assert_bits_eq(
                            got,
                            &want,
                            &format!("device L={logical} P={p} len={len} {opts:?} rank {r}"),
                        );
                    }
                }
            }
        }
    }
}

/// The fixed tree on one GPU: every emulated process folds its block with
/// a `TreeAccumulator` over the device fold and runs the tree plan with
/// device copies as messages; every power-of-two P gives the host tree's
/// bits.
#[test]
fn fixed_tree_loopback_worlds_on_one_gpu_equal_the_host_tree() {
    let Some(stream) = gpu_stream() else { return };
    let mut fold = DeviceFold::load(&stream).expect("load fold and scale kernels");
    for k in 0..=5u32 {
        let logical = 1usize << k;
        for len in [1usize, 7, 1009, 100_003] {
            let a = arenas(u64::from(k) * 31 + len as u64, logical, len);
            let want = host_tree_mean(&a.iter().map(|v| v.as_slice()).collect::<Vec<_>>()).unwrap();
            let world = EmulatedWorld::new(a).unwrap();
            for p in (0..=k).map(|j| 1usize << j) {
                for (chunk, delivery) in [
                    (None, Delivery::InOrder),
                    (Some(997), Delivery::Shuffled(p as u64)),
                ] {
                    let opts = EmulateOptions {
                        chunk_elems: chunk,
                        delivery,
                        lanes: None,
                        contract: ReduceContract::FixedTree,
                    };
                    let per_rank = world.reduce_mean_per_rank_on(p, &opts, &mut fold).unwrap();
                    for (r, got) in per_rank.iter().enumerate() {
                        assert_bits_eq(
                            got,
                            &want,
                            &format!("device tree L={logical} P={p} len={len} {opts:?} rank {r}"),
                        );
                    }
                }
            }
        }
    }
}

/// ZeRO-1's reduction on one GPU: the plans cut to end at the owners, with
/// the fold kernels and device copies as messages, give every owner the
/// host reference's bits on its range, under both fixed contracts and
/// ragged, empty and gapped partitions.
#[test]
fn reduce_scatter_loopback_worlds_on_one_gpu_equal_the_host_reference() {
    let Some(stream) = gpu_stream() else { return };
    let mut fold = DeviceFold::load(&stream).expect("load fold and scale kernels");
    for (contract, logical) in [
        (ReduceContract::FixedOrder, 2usize),
        (ReduceContract::FixedOrder, 4),
        (ReduceContract::FixedOrder, 6),
        (ReduceContract::FixedTree, 4),
        (ReduceContract::FixedTree, 8),
    ] {
        for len in [7usize, 1009, 100_003] {
            let a = arenas(logical as u64 * 131 + len as u64, logical, len);
            let r: Vec<&[f32]> = a.iter().map(|v| v.as_slice()).collect();
            let want = match contract {
                ReduceContract::FixedTree => host_tree_mean(&r).unwrap(),
                _ => host_mean(&r).unwrap(),
            };
            let world = EmulatedWorld::new(a.clone()).unwrap();
            let worlds: Vec<usize> = divisors(logical)
                .into_iter()
                .filter(|p| contract != ReduceContract::FixedTree || p.is_power_of_two())
                .collect();
            for p in worlds {
                let even: Vec<_> = (0..p).map(|k| k * len / p..(k + 1) * len / p).collect();
                // Rank 0 owns nothing, a gap nobody owns, the rest ragged.
                let ragged: Vec<_> = (0..p)
                    .map(|k| match k {
                        0 => 0..0,
                        _ => {
                            (len / 3 + (k - 1) * len / (2 * p)).min(len)
                                ..(len / 3 + k * len / (2 * p)).min(len)
                        }
                    })
                    .collect();
                for owned in [even, ragged] {
                    let opts = EmulateOptions {
                        chunk_elems: Some(997),
                        delivery: Delivery::Shuffled(p as u64),
                        lanes: None,
                        contract,
                    };
                    let per_rank = world
                        .reduce_scatter_per_rank_on(p, &opts, &owned, &mut fold)
                        .unwrap();
                    for (rank, got) in per_rank.iter().enumerate() {
                        let o = owned[rank].clone();
                        assert_bits_eq(
                            &got[o.clone()],
                            &want[o],
                            &format!("device {contract} L={logical} P={p} len={len} {owned:?} rank {rank}"),
                        );
                    }
                }
            }
        }
    }
}

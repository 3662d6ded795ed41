//! Global gradient norm in a fixed order, and the clipping factor.
//!
//! The norm is the same bits for any thread count: the arena is cut into
//! [`NORM_CHUNK`]-element chunks at fixed boundaries, each chunk's sum of
//! squares is accumulated in f64 sequentially, and the chunk sums are added
//! sequentially in chunk order. Threads only decide *who* computes a chunk,
//! never how sums are grouped.

use rayon::prelude::*;

use super::shard::norm_from_chunk_sums;

/// Elements per partial sum of the norm.
pub const NORM_CHUNK: usize = 1 << 14;

/// Euclidean norm of `grads`, accumulated in f64 in the fixed order above.
/// Any NaN or infinity in `grads` gives a non-finite result.
pub fn global_norm(grads: &[f32]) -> f64 {
    norm_from_chunk_sums(&chunk_sums(grads))
}

/// The sum of squares of each [`NORM_CHUNK`]-element chunk of `grads`
/// (the last one possibly short), each in f64 sequentially, in chunk order:
/// the partial sums the norm adds. A slice starting on a chunk boundary of
/// the arena gives exactly the arena's sums for those chunks, which is what
/// lets ZeRO owners compute their part ([`super::shard`]).
pub fn chunk_sums(grads: &[f32]) -> Vec<f64> {
    grads
        .par_chunks(NORM_CHUNK)
        .map(|c| {
            let mut s = 0.0f64;
            for &g in c {
                let g = g as f64;
                s += g * g;
            }
            s
        })
        .collect()
}

/// The factor gradients are multiplied by, as `torch.nn.utils.clip_grad_norm_`:
/// `max_norm / (norm + 1e-6)` when that is below 1, else exactly 1.
/// `max_norm <= 0` disables clipping.
pub fn clip_scale(norm: f64, max_norm: f32) -> f32 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    let coef = max_norm as f64 / (norm + 1e-6);
    if coef < 1.0 {
        coef as f32
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(f)
    }

    #[test]
    fn norm_of_a_known_vector() {
        let g = vec![3.0f32, 4.0];
        assert_eq!(global_norm(&g), 5.0);
        assert_eq!(global_norm(&[]), 0.0);
        assert!(!global_norm(&[1.0, f32::NAN]).is_finite());
        assert!(!global_norm(&[f32::INFINITY]).is_finite());
    }

    #[test]
    fn clip_scale_matches_torch_rule() {
        assert_eq!(clip_scale(0.5, 1.0), 1.0);
        let s = clip_scale(4.0, 1.0);
        assert!((s as f64 - 1.0 / (4.0 + 1e-6)).abs() < 1e-7);
        assert_eq!(clip_scale(100.0, 0.0), 1.0, "0 disables clipping");
    }

    proptest! {
        #[test]
        fn norm_bits_do_not_depend_on_thread_count(len in 0usize..(3 * NORM_CHUNK + 17), seed in any::<u64>()) {
            let mut r = crate::seed::Rng::new(seed);
            let g: Vec<f32> = (0..len).map(|_| (r.normal() * 1e3) as f32).collect();
            let one = in_pool(1, || global_norm(&g));
            let four = in_pool(4, || global_norm(&g));
            prop_assert_eq!(one.to_bits(), four.to_bits());
            // And it is the norm (to f64 rounding).
            let exact: f64 = g.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt();
            prop_assert!((one - exact).abs() <= 1e-9 * exact.max(1.0));
        }
    }
}

//! Launch shapes for grid-stride kernels.

use cudarc::driver::LaunchConfig;

use crate::error::KernelError;

/// Block size and grid cap of a one-dimensional grid-stride kernel.
///
/// A grid-stride kernel is correct for every grid size, so the grid is
/// `min(ceil(work / threads), max_blocks)` blocks: small jobs get one thread
/// per work item, large ones loop instead of launching millions of blocks.
/// The shape never changes results for the kernels of this crate (each
/// element's arithmetic is done by one thread, whatever the grid).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchShape {
    threads_per_block: u32,
    max_blocks: u32,
}

impl LaunchShape {
    /// Largest grid x-dimension CUDA allows.
    pub const MAX_GRID_X: u32 = i32::MAX as u32;

    /// Checked constructor: `threads_per_block` a multiple of 32 in
    /// 32..=1024 (whole warps, CUDA's block limit), `max_blocks` in
    /// 1..=[`Self::MAX_GRID_X`].
    pub fn new(threads_per_block: u32, max_blocks: u32) -> Result<Self, KernelError> {
        if !(32..=1024).contains(&threads_per_block) || threads_per_block % 32 != 0 {
            return Err(KernelError::invalid(
                "LaunchShape",
                format!("threads_per_block = {threads_per_block}; expected a multiple of 32 in 32..=1024"),
            ));
        }
        if !(1..=Self::MAX_GRID_X).contains(&max_blocks) {
            return Err(KernelError::invalid(
                "LaunchShape",
                format!(
                    "max_blocks = {max_blocks}; expected 1..={}",
                    Self::MAX_GRID_X
                ),
            ));
        }
        Ok(LaunchShape {
            threads_per_block,
            max_blocks,
        })
    }

    /// `threads_per_block` threads, and `blocks_per_sm` resident-ish blocks
    /// for each of `sm_count` multiprocessors (clamped into range).
    pub fn for_device(
        threads_per_block: u32,
        sm_count: u32,
        blocks_per_sm: u32,
    ) -> Result<Self, KernelError> {
        let blocks = sm_count
            .max(1)
            .saturating_mul(blocks_per_sm.max(1))
            .min(Self::MAX_GRID_X);
        Self::new(threads_per_block, blocks)
    }

    /// `threads_per_block` threads in `ceil(fraction * sm_count)` blocks
    /// (at least one, at most `sm_count`): with blocks so large that only
    /// one fits on a multiprocessor, a grid-stride kernel then occupies about
    /// that fraction of the SMs and leaves the others free for kernels of
    /// other streams (the reducer's fold beside NCCL's transfers).
    /// `fraction` must lie in `(0, 1]`.
    pub fn for_sm_fraction(
        threads_per_block: u32,
        sm_count: u32,
        fraction: f64,
    ) -> Result<Self, KernelError> {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(KernelError::invalid(
                "LaunchShape",
                format!("SM fraction {fraction}; expected a number in (0, 1]"),
            ));
        }
        let sms = sm_count.max(1);
        let blocks = (fraction * f64::from(sms)).ceil() as u32;
        Self::new(threads_per_block, blocks.clamp(1, sms))
    }

    pub fn threads_per_block(&self) -> u32 {
        self.threads_per_block
    }

    pub fn max_blocks(&self) -> u32 {
        self.max_blocks
    }

    /// Number of blocks for `work` items (at least one).
    pub fn blocks_for(&self, work: u64) -> u32 {
        let wanted = work.div_ceil(u64::from(self.threads_per_block)).max(1);
        u32::try_from(wanted.min(u64::from(self.max_blocks))).unwrap_or(self.max_blocks)
    }

    /// The launch configuration for `work` items (no shared memory).
    pub fn config(&self, work: u64) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.blocks_for(work), 1, 1),
            block_dim: (self.threads_per_block, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rejects_bad_shapes() {
        for (t, b) in [
            (0, 1),
            (16, 1),
            (33, 1),
            (2048, 1),
            (256, 0),
            (256, LaunchShape::MAX_GRID_X + 1),
        ] {
            let err = LaunchShape::new(t, b).unwrap_err();
            assert!(
                matches!(err, KernelError::InvalidArgument { .. }),
                "{t}x{b}: {err:?}"
            );
        }
        assert!(LaunchShape::new(1024, LaunchShape::MAX_GRID_X).is_ok());
        assert!(LaunchShape::new(32, 1).is_ok());
    }

    #[test]
    fn sm_fractions_round_up_and_stay_in_range() {
        let blocks = |f: f64| LaunchShape::for_sm_fraction(1024, 132, f).map(|s| s.max_blocks());
        assert_eq!(blocks(0.5).unwrap(), 66);
        assert_eq!(blocks(0.25).unwrap(), 33);
        assert_eq!(blocks(0.001).unwrap(), 1);
        assert_eq!(blocks(1.0).unwrap(), 132);
        // 0.3 * 132 = 39.6 -> 40
        assert_eq!(blocks(0.3).unwrap(), 40);
        for bad in [0.0, -0.5, 1.01, f64::NAN, f64::INFINITY] {
            assert!(blocks(bad).is_err(), "{bad}");
        }
        // A device that reports no SMs still gets one block.
        let one = LaunchShape::for_sm_fraction(256, 0, 0.5).unwrap();
        assert_eq!(one.max_blocks(), 1);
        assert!(LaunchShape::for_sm_fraction(100, 132, 0.5).is_err());
    }

    proptest! {
        #[test]
        fn grid_covers_work_or_hits_the_cap(threads in (1u32..=32).prop_map(|w| w * 32),
                                            cap in 1u32..100_000,
                                            work in 0u64..(1u64 << 40)) {
            let shape = LaunchShape::new(threads, cap).unwrap();
            let blocks = shape.blocks_for(work);
            prop_assert!(blocks >= 1 && blocks <= cap);
            let covered = u64::from(blocks) * u64::from(threads);
            // Either one thread per item, or the full cap (threads then loop).
            prop_assert!(covered >= work || blocks == cap);
            // And never a whole block more than needed.
            prop_assert!(blocks == 1 || covered - u64::from(threads) < work);
        }
    }
}

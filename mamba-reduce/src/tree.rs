//! The fixed-tree association: its scalar reference ([`host_tree_fold`],
//! [`host_tree_mean`]) and the binary counter that folds one process's
//! block of it as the micro-batches finish ([`TreeAccumulator`]).
//!
//! The tree over `n = 2^k` addends in logical order: level 0 adds the
//! neighbours `(a0 + a1)`, `(a2 + a3)`, ...; level 1 adds pairs of those;
//! the root is the whole sum. Every aligned block of `2^j` addends is a
//! subtree, which is what lets a process fold its block alone and the
//! processes finish the upper levels together (`plan::tree`), with the same
//! bits for every power-of-two split. IEEE addition of two values commutes
//! exactly, so only the pairing matters, never which operand comes first.

use crate::fold::{host_scale, mean_factor, ChainTerm, FoldOps};
use crate::{ReduceError, Result};

/// `out[i]` = the complete binary tree over `addends` (a power-of-two count,
/// in order) at element `i`, one f32 round-to-nearest addition per pair, no
/// contraction. The direct reference: a recursive halving, independent of
/// [`TreeAccumulator`]'s counter and of every plan.
pub fn host_tree_fold(addends: &[&[f32]], out: &mut [f32]) -> Result<()> {
    if !addends.len().is_power_of_two() {
        return Err(ReduceError::config(format!(
            "host_tree_fold needs a power-of-two number of addends, got {}",
            addends.len()
        )));
    }
    if let Some((k, a)) = addends
        .iter()
        .enumerate()
        .find(|(_, a)| a.len() != out.len())
    {
        return Err(ReduceError::config(format!(
            "addend {k} has {} elements, expected {} like the output",
            a.len(),
            out.len()
        )));
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = tree_at(addends, i);
    }
    Ok(())
}

fn tree_at(addends: &[&[f32]], i: usize) -> f32 {
    if addends.len() == 1 {
        return addends[0][i];
    }
    let (lo, hi) = addends.split_at(addends.len() / 2);
    tree_at(lo, i) + tree_at(hi, i)
}

/// The fixed-tree mean of `addends` (one per logical rank, in logical
/// order, a power-of-two count): [`host_tree_fold`], then times
/// [`mean_factor`] unless there is one addend (as
/// [`host_mean`](crate::host_mean)). The value every live fixed-tree world
/// and the [`EmulatedWorld`](crate::EmulatedWorld) must produce bit for
/// bit.
pub fn host_tree_mean(addends: &[&[f32]]) -> Result<Vec<f32>> {
    let len = addends.first().map_or(0, |a| a.len());
    let mut out = vec![0.0; len];
    host_tree_fold(addends, &mut out)?;
    if addends.len() > 1 {
        host_scale(&mut out, mean_factor(addends.len()));
    }
    Ok(out)
}

/// One subtree sum waiting for its right neighbour.
struct Partial<B> {
    /// `log2` of the number of leaves it sums.
    height: u32,
    buf: B,
}

/// A binary counter over `leaves = 2^k` buffers pushed in logical order:
/// whenever the two newest partial sums cover subtrees of the same height
/// they are added (`left = left + right`, the right buffer becomes spare),
/// so after the last push one buffer holds the complete binary tree over
/// all leaves ([`host_tree_fold`]'s bits, scale not applied).
///
/// Memory: at most `k` partial sums wait at any time (one per height, the
/// binary digits of the count so far), so a caller that computes each leaf
/// into [`TreeAccumulator::take_spare`] (allocating only when it returns
/// `None`) never holds more than [`TreeAccumulator::max_buffers`] `= k + 1`
/// buffers, whatever `2^k` is; holding all leaves would take `2^k`.
///
/// Ownership: pushed buffers belong to the accumulator until they come
/// back as spares or as the result of [`TreeAccumulator::finish`], which
/// the caller may hand back with [`TreeAccumulator::recycle`] to reuse
/// across steps. Buffer contents of spares are garbage; a leaf must be
/// overwritten entirely before it is pushed.
///
/// Ordering: additions are issued on the [`FoldOps`] passed to each push,
/// in push order; on a device they are asynchronous on its stream, so the
/// caller computes the next leaf on the same stream (or waits).
pub struct TreeAccumulator<B> {
    leaves: usize,
    len: usize,
    pushed: usize,
    stack: Vec<Partial<B>>,
    spare: Vec<B>,
}

impl<B> TreeAccumulator<B> {
    /// A counter for `leaves` (a power of two) buffers of `len` elements.
    pub fn new(leaves: usize, len: usize) -> Result<Self> {
        if !leaves.is_power_of_two() {
            return Err(ReduceError::config(format!(
                "a fixed-tree block needs a power-of-two number of logical ranks (L/P), got {leaves}"
            )));
        }
        Ok(TreeAccumulator {
            leaves,
            len,
            pushed: 0,
            stack: Vec::new(),
            spare: Vec::new(),
        })
    }

    /// Leaves per round (`L/P` for a process's block).
    pub fn leaves(&self) -> usize {
        self.leaves
    }

    /// Leaves pushed in the current round.
    pub fn pushed(&self) -> usize {
        self.pushed
    }

    /// Most buffers a round needs at once, spares included: `log2(leaves) +
    /// 1`.
    pub fn max_buffers(leaves: usize) -> usize {
        leaves.max(1).ilog2() as usize + 1
    }

    /// Buffers the accumulator holds right now (partials and spares).
    pub fn held(&self) -> usize {
        self.stack.len() + self.spare.len()
    }

    /// A buffer freed by an earlier addition (or recycled), to compute the
    /// next leaf into; `None` when the caller must allocate one.
    pub fn take_spare(&mut self) -> Option<B> {
        self.spare.pop()
    }

    /// Give a buffer (typically [`TreeAccumulator::finish`]'s) back for
    /// later leaves.
    pub fn recycle(&mut self, buf: B) {
        self.spare.push(buf);
    }

    /// Push the next leaf (logical order) and add every pair of subtrees it
    /// completes, through `fold`.
    pub fn push<F: FoldOps<B> + ?Sized>(&mut self, fold: &mut F, leaf: B) -> Result<()> {
        if self.pushed == self.leaves {
            return Err(ReduceError::config(format!(
                "a fixed-tree block of {} leaves got a leaf past its last; call finish first",
                self.leaves
            )));
        }
        self.pushed += 1;
        self.stack.push(Partial {
            height: 0,
            buf: leaf,
        });
        while self.stack.len() >= 2
            && self.stack[self.stack.len() - 1].height == self.stack[self.stack.len() - 2].height
        {
            let right = self
                .stack
                .pop()
                .ok_or_else(|| ReduceError::invariant("tree counter lost its right partial"))?;
            let left = self
                .stack
                .last_mut()
                .ok_or_else(|| ReduceError::invariant("tree counter lost its left partial"))?;
            fold.chain(
                &mut left.buf,
                0,
                &[ChainTerm::Dst, ChainTerm::Buf(&right.buf, 0)],
                self.len,
                None,
            )?;
            left.height += 1;
            self.spare.push(right.buf);
        }
        Ok(())
    }

    /// The root of the round (the block's subtree sum, unscaled) once all
    /// leaves were pushed; the counter is then ready for the next round.
    pub fn finish(&mut self) -> Result<B> {
        if self.pushed != self.leaves {
            return Err(ReduceError::config(format!(
                "a fixed-tree block of {} leaves is finished after {} of them",
                self.leaves, self.pushed
            )));
        }
        let root = self
            .stack
            .pop()
            .filter(|_| self.stack.is_empty())
            .ok_or_else(|| {
                ReduceError::invariant(format!(
                    "tree counter holds {} partials after {} leaves",
                    self.stack.len() + 1,
                    self.leaves
                ))
            })?;
        self.pushed = 0;
        Ok(root.buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fold::{host_fold, HostFold};
    use proptest::prelude::*;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn values(seed: u64, n: usize, len: usize) -> Vec<Vec<f32>> {
        let mut s = seed;
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let mant = ((s >> 40) as f32) / (1u32 << 24) as f32 + 0.5;
            let exp = ((s >> 20) % 48) as i32 - 24;
            if s & 1 == 0 {
                mant * 2f32.powi(exp)
            } else {
                -mant * 2f32.powi(exp)
            }
        };
        (0..n).map(|_| (0..len).map(|_| next()).collect()).collect()
    }

    /// The counter with a spare-first allocation policy; returns the root
    /// and the most buffers that ever existed.
    fn counter_root(leaves: &[Vec<f32>]) -> (Vec<f32>, usize) {
        let len = leaves[0].len();
        let mut acc = TreeAccumulator::new(leaves.len(), len).unwrap();
        let mut allocated = 0;
        for leaf in leaves {
            let mut buf = acc.take_spare().unwrap_or_else(|| {
                allocated += 1;
                vec![f32::NAN; len]
            });
            buf.copy_from_slice(leaf);
            acc.push(&mut HostFold, buf).unwrap();
        }
        (acc.finish().unwrap(), allocated)
    }

    #[test]
    fn the_known_case_pairs_neighbours() {
        // 2^27, 1, -2^27, 1: the chain ((2^27 + 1) - 2^27) + 1 gives 1; the
        // tree rounds 2^27 + 1 to 2^27 and -2^27 + 1 to -2^27, and gives 0.
        let big = 134_217_728.0f32;
        let a: [&[f32]; 4] = [&[big], &[1.0], &[-big], &[1.0]];
        let mut chain = [0.0];
        host_fold(&a, &mut chain).unwrap();
        let mut tree = [0.0];
        host_tree_fold(&a, &mut tree).unwrap();
        assert_eq!((chain[0], tree[0]), (1.0, 0.0));
        let leaves: Vec<Vec<f32>> = a.iter().map(|x| x.to_vec()).collect();
        assert_eq!(counter_root(&leaves).0, vec![0.0]);
    }

    #[test]
    fn one_leaf_is_itself_and_the_mean_of_one_is_not_scaled() {
        let a = vec![3.0f32, f32::MIN_POSITIVE / 8.0];
        let (root, allocated) = counter_root(std::slice::from_ref(&a));
        assert_eq!((bits(&root), allocated), (bits(&a), 1));
        assert_eq!(bits(&host_tree_mean(&[&a]).unwrap()), bits(&a));
    }

    #[test]
    fn bad_rounds_are_refused() {
        assert!(TreeAccumulator::<Vec<f32>>::new(3, 1)
            .err()
            .unwrap()
            .to_string()
            .contains("power-of-two number of logical ranks (L/P), got 3"));
        let mut acc = TreeAccumulator::new(2, 1).unwrap();
        acc.push(&mut HostFold, vec![1.0]).unwrap();
        let e = acc.finish().err().unwrap().to_string();
        assert!(e.contains("finished after 1 of them"), "{e}");
        acc.push(&mut HostFold, vec![2.0]).unwrap();
        let e = acc.push(&mut HostFold, vec![3.0]).unwrap_err().to_string();
        assert!(e.contains("past its last"), "{e}");
        assert_eq!(acc.finish().unwrap(), vec![3.0]);
        assert!(host_tree_fold(&[&[1.0], &[2.0], &[3.0]], &mut [0.0]).is_err());
    }

    proptest! {
        /// The counter gives the recursive reference's bits, holds at most
        /// log2(n) + 1 buffers, and reuses them across rounds.
        #[test]
        fn counter_equals_the_recursive_tree(k in 0u32..=7, len in 0usize..40, seed in any::<u64>()) {
            let n = 1usize << k;
            let leaves = values(seed, n, len);
            let refs: Vec<&[f32]> = leaves.iter().map(|v| v.as_slice()).collect();
            let mut want = vec![0.0; len];
            host_tree_fold(&refs, &mut want).unwrap();
            let (root, allocated) = counter_root(&leaves);
            prop_assert_eq!(bits(&root), bits(&want));
            prop_assert_eq!(allocated, TreeAccumulator::<Vec<f32>>::max_buffers(n));
            let mut acc = TreeAccumulator::new(n, len).unwrap();
            for round in 0..2 {
                for leaf in &leaves {
                    let mut buf = acc.take_spare().unwrap_or_else(|| vec![0.0; len]);
                    buf.copy_from_slice(leaf);
                    acc.push(&mut HostFold, buf).unwrap();
                    prop_assert!(acc.held() <= k as usize + 1);
                }
                let root = acc.finish().unwrap();
                prop_assert_eq!(bits(&root), bits(&want), "round {}", round);
                acc.recycle(root);
                prop_assert_eq!(acc.held(), k as usize + 1);
            }
        }
    }
}

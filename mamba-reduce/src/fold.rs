//! The reference fold on the CPU, and the fold seam the fixed-order
//! dataflow calls for its arithmetic.
//!
//! Rust never contracts `a + b` into a fused multiply-add and never
//! reassociates float arithmetic, so the loops below perform exactly one
//! round-to-nearest f32 addition per addend per element, in the order
//! written. The compiler may vectorise them across *elements* (each SIMD
//! lane still runs its own ascending chain), which does not change a bit.
//! This is the fold `kernels::FoldKernel` must reproduce bit for bit.

use crate::{ReduceError, Result};

/// `out[i] = ((a0[i] + a1[i]) + a2[i]) + ...`: the reference fold, strictly
/// ascending over `addends`, f32, round-to-nearest, no contraction.
///
/// Needs at least one addend; every addend and `out` must have the same
/// length.
pub fn host_fold(addends: &[&[f32]], out: &mut [f32]) -> Result<()> {
    let Some((first, rest)) = addends.split_first() else {
        return Err(ReduceError::config("host_fold needs at least one addend"));
    };
    check_lengths(addends, out.len())?;
    out.copy_from_slice(first);
    for a in rest {
        add_into(out, a);
    }
    Ok(())
}

/// `acc[i] = ((acc[i] + a0[i]) + a1[i]) + ...`: one running-prefix step
/// (zero addends leave `acc` unchanged).
pub fn host_accumulate(acc: &mut [f32], addends: &[&[f32]]) -> Result<()> {
    check_lengths(addends, acc.len())?;
    for a in addends {
        add_into(acc, a);
    }
    Ok(())
}

/// The factor the mean multiplies by: `fl(1/L)`, exact for power-of-two
/// `L`.
pub fn mean_factor(logical_world: usize) -> f32 {
    1.0f32 / logical_world as f32
}

/// `v[i] = v[i] * factor`, one rounding per element.
pub fn host_scale(v: &mut [f32], factor: f32) {
    for x in v {
        *x *= factor;
    }
}

/// The fixed-order mean of `addends` (one per logical rank, in logical
/// order): [`host_fold`] then multiply by [`mean_factor`] (skipped for one
/// addend, where it would only quiet a signalling NaN). This is the value
/// every live world and the [`EmulatedWorld`](crate::EmulatedWorld) must
/// produce bit for bit.
pub fn host_mean(addends: &[&[f32]]) -> Result<Vec<f32>> {
    let len = addends.first().map_or(0, |a| a.len());
    let mut out = vec![0.0; len];
    host_fold(addends, &mut out)?;
    if addends.len() > 1 {
        host_scale(&mut out, mean_factor(addends.len()));
    }
    Ok(out)
}

fn check_lengths(addends: &[&[f32]], len: usize) -> Result<()> {
    if let Some((k, a)) = addends.iter().enumerate().find(|(_, a)| a.len() != len) {
        return Err(ReduceError::config(format!(
            "addend {k} has {} elements, expected {len} like the output",
            a.len()
        )));
    }
    Ok(())
}

#[inline]
fn add_into(acc: &mut [f32], a: &[f32]) {
    for (x, y) in acc.iter_mut().zip(a) {
        *x += *y;
    }
}

/// One term (addend) of a fold chain: the destination's own values, or
/// `len` elements of another buffer from an offset. `R` names the buffer:
/// a reference (`ChainTerm<&B>`) in [`FoldOps::chain`], a buffer id in a
/// plan's fold operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainTerm<R> {
    /// The output region's own values (read before they are overwritten).
    Dst,
    /// `len` elements of another buffer, from this offset.
    Buf(R, usize),
}

/// The arithmetic the fixed-order dataflow needs next to byte movement:
/// the seam between the transport-generic dataflow and the memory the
/// transport moves (host `Vec<f32>`, or device memory with the kernels).
///
/// Offsets and lengths are in elements. Implementations must compute
/// exactly the chains described (one f32 round-to-nearest add per addend, no
/// contraction, no reassociation); the bits of the whole crate rest on it.
///
/// Ordering: operations take effect in the order they are called, and after
/// any point-to-point group the dataflow ran before them (host: trivially;
/// device: everything runs on the communicator's stream). [`FoldOps::finish`]
/// returns once every operation called so far has completed.
pub trait FoldOps<B> {
    /// `dst[dst_off..dst_off + len] = src[src_off..src_off + len]` (bits).
    fn copy(
        &mut self,
        src: &B,
        src_off: usize,
        dst: &mut B,
        dst_off: usize,
        len: usize,
    ) -> Result<()>;

    /// `buf[off + i] = buf[off + i] * factor`, one rounding each.
    fn scale(&mut self, buf: &mut B, off: usize, len: usize, factor: f32) -> Result<()>;

    /// `dst[dst_off + i] = ((t_0[i] + t_1[i]) + ...) + t_{n-1}[i]`, then
    /// `* factor` when `factor` is `Some` (one more rounding of the finished
    /// sum: the same bits as [`FoldOps::scale`] afterwards), for `i < len`.
    /// [`ChainTerm::Dst`] (at most once) stands for `dst`'s own values at
    /// `dst_off + i` before the call; [`ChainTerm::Buf`] terms name other
    /// buffers. Needs at least one term.
    fn chain(
        &mut self,
        dst: &mut B,
        dst_off: usize,
        terms: &[ChainTerm<&B>],
        len: usize,
        factor: Option<f32>,
    ) -> Result<()>;

    /// Wait until every operation called so far has completed.
    fn finish(&mut self) -> Result<()>;
}

/// [`FoldOps`] on host memory: the same loops as [`host_fold`].
#[derive(Clone, Copy, Debug, Default)]
pub struct HostFold;

fn region<'a>(buf: &'a [f32], off: usize, len: usize, what: &str) -> Result<&'a [f32]> {
    off.checked_add(len)
        .and_then(|end| buf.get(off..end))
        .ok_or_else(|| {
            ReduceError::invariant(format!(
                "{what}: elements {off}..{off}+{len} lie outside a buffer of {}",
                buf.len()
            ))
        })
}

fn region_mut<'a>(buf: &'a mut [f32], off: usize, len: usize, what: &str) -> Result<&'a mut [f32]> {
    let n = buf.len();
    off.checked_add(len)
        .and_then(move |end| buf.get_mut(off..end))
        .ok_or_else(|| {
            ReduceError::invariant(format!(
                "{what}: elements {off}..{off}+{len} lie outside a buffer of {n}"
            ))
        })
}

impl FoldOps<Vec<f32>> for HostFold {
    fn copy(
        &mut self,
        src: &Vec<f32>,
        src_off: usize,
        dst: &mut Vec<f32>,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        let s = region(src, src_off, len, "copy source")?;
        region_mut(dst, dst_off, len, "copy destination")?.copy_from_slice(s);
        Ok(())
    }

    fn scale(&mut self, buf: &mut Vec<f32>, off: usize, len: usize, factor: f32) -> Result<()> {
        host_scale(region_mut(buf, off, len, "scale")?, factor);
        Ok(())
    }

    fn chain(
        &mut self,
        dst: &mut Vec<f32>,
        dst_off: usize,
        terms: &[ChainTerm<&Vec<f32>>],
        len: usize,
        factor: Option<f32>,
    ) -> Result<()> {
        check_terms(terms)?;
        let out = region_mut(dst, dst_off, len, "chain output")?;
        // None stands for the output's own values.
        let sources = terms
            .iter()
            .map(|t| match t {
                ChainTerm::Dst => Ok(None),
                ChainTerm::Buf(b, off) => region(b, *off, len, "chain term").map(Some),
            })
            .collect::<Result<Vec<Option<&[f32]>>>>()?;
        host_chain(out, &sources, factor);
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

/// At least one term, and [`ChainTerm::Dst`] at most once.
pub(crate) fn check_terms<B>(terms: &[ChainTerm<&B>]) -> Result<()> {
    let dsts = terms.iter().filter(|t| matches!(t, ChainTerm::Dst)).count();
    if terms.is_empty() || dsts > 1 {
        return Err(ReduceError::invariant(format!(
            "a chain needs at least one term and the output at most once; got {} terms, {dsts} \
             of them the output",
            terms.len()
        )));
    }
    Ok(())
}

/// Elements per block of [`host_chain`]: the running sums of one block live
/// on the stack while every term is added to them, term by term.
const CHAIN_BLOCK: usize = 256;

/// `out[i] = ((s_0[i] + s_1[i]) + ...) * factor` where a `None` source is
/// `out`'s own value. Blocked so each addition is a vectorisable loop over
/// elements (each lane keeps its own ascending chain).
fn host_chain(out: &mut [f32], sources: &[Option<&[f32]>], factor: Option<f32>) {
    let mut acc = [0.0f32; CHAIN_BLOCK];
    let mut start = 0;
    while start < out.len() {
        let n = CHAIN_BLOCK.min(out.len() - start);
        let acc = &mut acc[..n];
        for (k, s) in sources.iter().enumerate() {
            let src = s.map_or(&out[start..start + n], |v| &v[start..start + n]);
            if k == 0 {
                acc.copy_from_slice(src);
            } else {
                add_into(acc, src);
            }
        }
        if let Some(f) = factor {
            host_scale(acc, f);
        }
        out[start..start + n].copy_from_slice(acc);
        start += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fold_is_left_to_right() {
        // 1e8 + 1 - 1e8: left to right gives 0 (1 is lost to rounding at
        // 1e8), another order gives 1.
        let a = [1.0e8f32];
        let b = [1.0f32];
        let c = [-1.0e8f32];
        let mut out = [f32::NAN];
        host_fold(&[&a, &b, &c], &mut out).unwrap();
        assert_eq!(out[0], 0.0);
        host_fold(&[&a, &c, &b], &mut out).unwrap();
        assert_eq!(out[0], 1.0);
    }

    #[test]
    fn accumulate_continues_the_chain() {
        let g: Vec<Vec<f32>> = (0..5)
            .map(|k| vec![0.1 * k as f32 + 1e7, -1e7, 0.3])
            .collect();
        let all: Vec<&[f32]> = g.iter().map(|v| v.as_slice()).collect();
        let mut whole = vec![0.0; 3];
        host_fold(&all, &mut whole).unwrap();
        let mut acc = vec![0.0; 3];
        host_fold(&all[..2], &mut acc).unwrap();
        host_accumulate(&mut acc, &all[2..]).unwrap();
        assert_eq!(bits(&acc), bits(&whole));
    }

    #[test]
    fn errors_name_the_mismatch() {
        let mut out = [0.0f32; 2];
        assert!(host_fold(&[], &mut out).is_err());
        let err = host_fold(&[&[1.0, 2.0], &[1.0]], &mut out)
            .unwrap_err()
            .to_string();
        assert!(err.contains("addend 1 has 1 elements, expected 2"), "{err}");
        let mut f = HostFold;
        let mut v = vec![0.0f32; 4];
        assert!(f.scale(&mut v, 3, 2, 0.5).is_err());
    }

    #[test]
    fn mean_of_one_is_identity_and_power_of_two_scale_is_exact() {
        let a = [3.0f32, -0.0, f32::MIN_POSITIVE / 8.0];
        assert_eq!(bits(&host_mean(&[&a]).unwrap()), bits(&a));
        let m = host_mean(&[&a, &a]).unwrap();
        assert_eq!(bits(&m), bits(&a));
        assert_eq!(mean_factor(3), 1.0 / 3.0);
    }

    #[test]
    fn chain_puts_the_output_at_its_position() {
        // a = 1e8 (f32 spacing 8 there), b = c = 3: (a + b) + c rounds each
        // 3 away, (b + c) + a rounds 6 up to 8.
        let mut f = HostFold;
        let b = vec![3.0f32; 300];
        let c = vec![3.0f32; 300];
        for (pos, want) in [(0usize, 1.0e8f32), (1, 1.0e8), (2, 100_000_008.0)] {
            let mut dst = vec![1.0e8f32; 300];
            let mut terms = vec![ChainTerm::Buf(&b, 0), ChainTerm::Buf(&c, 0)];
            terms.insert(pos, ChainTerm::Dst);
            f.chain(&mut dst, 0, &terms, 300, None).unwrap();
            let mut order: Vec<&[f32]> = vec![&b, &c];
            let a = vec![1.0e8f32; 300];
            order.insert(pos, &a);
            let mut reference = vec![0.0; 300];
            host_fold(&order, &mut reference).unwrap();
            assert_eq!(bits(&dst), bits(&reference), "dst at {pos}");
            assert_eq!(dst[299], want, "dst at {pos}");
        }
        // Scaled: one more rounding, as host_scale after.
        let mut dst = vec![3.0f32; 5];
        f.chain(
            &mut dst,
            1,
            &[ChainTerm::Dst, ChainTerm::Buf(&b, 0)],
            3,
            Some(1.0 / 3.0),
        )
        .unwrap();
        let third = 6.0f32 * (1.0 / 3.0);
        assert_eq!(dst, vec![3.0, third, third, third, 3.0]);
        assert!(f.chain(&mut dst, 0, &[], 3, None).is_err());
        assert!(f
            .chain(&mut dst, 0, &[ChainTerm::Dst, ChainTerm::Dst], 3, None)
            .is_err());
        assert!(f.chain(&mut dst, 3, &[ChainTerm::Dst], 3, None).is_err());
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }
}

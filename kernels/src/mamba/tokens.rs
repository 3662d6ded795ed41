//! The embedding's token grouping: a counting sort of a batch's token ids
//! on the host ([`TokenCsr`]) and its device copy ([`DeviceTokenCsr`]),
//! which [`super::MambaKernels::embed_bwd`] scatters by.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use crate::error::KernelError;

/// The positions of every distinct token of a batch, for the embedding's
/// deterministic scatter-add: distinct tokens ascending, and for each its
/// positions ascending (a counting sort of the token ids; built on the host,
/// where the batch lives).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenCsr {
    /// Distinct token ids, ascending.
    pub uniq: Vec<u32>,
    /// `pos[row_ptr[u]..row_ptr[u + 1]]` are the positions of `uniq[u]`.
    pub row_ptr: Vec<u32>,
    /// Row indices into the `[rows, d]` activation, grouped by token.
    pub pos: Vec<u32>,
    vocab: usize,
}

impl TokenCsr {
    /// Group `tokens` by id; every id must be `< vocab`.
    pub fn build(tokens: &[u32], vocab: usize) -> Result<TokenCsr, KernelError> {
        const NAME: &str = "TokenCsr::build";
        if u32::try_from(tokens.len()).is_err() {
            return Err(KernelError::invalid(
                NAME,
                format!("{} tokens; at most {} per batch", tokens.len(), u32::MAX),
            ));
        }
        let mut counts = vec![0u32; vocab];
        for (i, &t) in tokens.iter().enumerate() {
            match counts.get_mut(t as usize) {
                Some(c) => *c += 1,
                None => {
                    return Err(KernelError::invalid(
                        NAME,
                        format!(
                            "token {t} at position {i} is not below the vocabulary size {vocab}"
                        ),
                    ))
                }
            }
        }
        let mut uniq = Vec::new();
        let mut row_ptr = vec![0u32];
        let mut start = vec![0u32; vocab];
        let mut next = 0u32;
        for (v, &c) in counts.iter().enumerate() {
            if c > 0 {
                uniq.push(v as u32);
                start[v] = next;
                next += c;
                row_ptr.push(next);
            }
        }
        let mut pos = vec![0u32; tokens.len()];
        for (i, &t) in tokens.iter().enumerate() {
            let s = &mut start[t as usize];
            pos[*s as usize] = i as u32;
            *s += 1;
        }
        Ok(TokenCsr {
            uniq,
            row_ptr,
            pos,
            vocab,
        })
    }

    /// Rows of the device form of any batch of `positions` tokens over a
    /// vocabulary of `vocab`: the most distinct tokens such a batch can
    /// have, `min(positions, vocab)`.
    pub fn capacity(positions: usize, vocab: usize) -> usize {
        positions.min(vocab)
    }

    /// The CSR padded to [`Self::capacity`] rows, as the device holds it:
    /// after the distinct tokens come, ascending, as many tokens absent from
    /// the batch as fill the capacity, each with no positions (the last
    /// row pointer repeated). The embedding's backward rewrites an empty
    /// row's values unchanged, so padding changes no bit; what it buys is a
    /// launch of the same extent for every batch of one shape (a captured
    /// CUDA graph replays it). There are enough absent tokens: a batch with
    /// `u` distinct ones leaves `vocab - u >= capacity - u` absent.
    pub fn padded(&self) -> (Vec<u32>, Vec<u32>) {
        let cap = Self::capacity(self.pos.len(), self.vocab);
        let mut uniq = self.uniq.clone();
        let mut row_ptr = self.row_ptr.clone();
        let last = *row_ptr.last().unwrap_or(&0);
        let mut next_real = self.uniq.iter().peekable();
        let mut v = 0u32;
        while uniq.len() < cap {
            match next_real.peek() {
                Some(&&r) if r == v => {
                    next_real.next();
                }
                _ => {
                    uniq.push(v);
                    row_ptr.push(last);
                }
            }
            v += 1;
        }
        (uniq, row_ptr)
    }

    /// Copy to the device (asynchronous on `stream`) into new buffers of
    /// this batch's shape.
    pub fn upload(&self, stream: &Arc<CudaStream>) -> Result<DeviceTokenCsr, KernelError> {
        let mut dev = DeviceTokenCsr::alloc(stream, self.pos.len(), self.vocab)?;
        self.upload_into(stream, &mut dev)?;
        Ok(dev)
    }

    /// Copy to the device (asynchronous on `stream`) into `dev`, whose
    /// shape (positions and vocabulary) must be this batch's: the buffers
    /// keep their addresses, which is what a captured CUDA graph reads.
    pub fn upload_into(
        &self,
        stream: &Arc<CudaStream>,
        dev: &mut DeviceTokenCsr,
    ) -> Result<(), KernelError> {
        if dev.positions != self.pos.len() || dev.vocab != self.vocab {
            return Err(KernelError::invalid(
                "TokenCsr::upload_into",
                format!(
                    "a batch of {} tokens over a vocabulary of {} into a device CSR of {} \
                     tokens over {}",
                    self.pos.len(),
                    self.vocab,
                    dev.positions,
                    dev.vocab
                ),
            ));
        }
        let (uniq, row_ptr) = self.padded();
        let put = |host: &[u32], to: &mut CudaSlice<u32>, what: &str| {
            if host.is_empty() {
                return Ok(());
            }
            stream
                .memcpy_htod(host, &mut to.slice_mut(0..host.len()))
                .map_err(|e| KernelError::driver(format!("uploading the token CSR's {what}"), e))
        };
        put(&uniq, &mut dev.uniq, "distinct tokens")?;
        put(&row_ptr, &mut dev.row_ptr, "row pointers")?;
        put(&self.pos, &mut dev.pos, "positions")
    }
}

/// A [`TokenCsr`] on the device, padded to [`TokenCsr::capacity`] rows
/// ([`TokenCsr::padded`]). Only [`TokenCsr::upload`] and
/// [`TokenCsr::upload_into`] fill one, so its contents are known valid:
/// every token `< vocab`, every position `< positions`. A fresh one from
/// [`Self::alloc`] is zero-filled, which is valid too (row pointers all 0:
/// every row empty).
#[derive(Debug)]
pub struct DeviceTokenCsr {
    pub(super) uniq: CudaSlice<u32>,
    pub(super) row_ptr: CudaSlice<u32>,
    pub(super) pos: CudaSlice<u32>,
    /// Rows launched: the capacity.
    pub(super) rows: usize,
    pub(super) positions: usize,
    pub(super) vocab: usize,
}

impl DeviceTokenCsr {
    /// Zero-filled buffers for batches of `positions` tokens over `vocab`
    /// (each at least one element, so every buffer is a real allocation).
    pub fn alloc(
        stream: &Arc<CudaStream>,
        positions: usize,
        vocab: usize,
    ) -> Result<Self, KernelError> {
        let rows = TokenCsr::capacity(positions, vocab);
        let zeros = |n: usize, what: &str| {
            stream
                .alloc_zeros::<u32>(n.max(1))
                .map_err(|e| KernelError::driver(format!("allocating the token CSR's {what}"), e))
        };
        Ok(DeviceTokenCsr {
            uniq: zeros(rows, "distinct tokens")?,
            row_ptr: zeros(rows + 1, "row pointers")?,
            pos: zeros(positions, "positions")?,
            rows,
            positions,
            vocab,
        })
    }
    /// Rows of the CSR, padding included ([`TokenCsr::capacity`]).
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Number of positions (the batch's token count).
    pub fn positions(&self) -> usize {
        self.positions
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn csr_groups_positions_by_token_in_order() {
        let csr = TokenCsr::build(&[3, 1, 3, 0, 1, 3], 5).unwrap();
        assert_eq!(csr.uniq, vec![0, 1, 3]);
        assert_eq!(csr.row_ptr, vec![0, 1, 3, 6]);
        assert_eq!(csr.pos, vec![3, 1, 4, 0, 2, 5]);
        let e = TokenCsr::build(&[0, 5], 5).unwrap_err().to_string();
        assert!(
            e.contains("token 5 at position 1") && e.contains("vocabulary size 5"),
            "{e}"
        );
        let empty = TokenCsr::build(&[], 5).unwrap();
        assert!(empty.uniq.is_empty() && empty.pos.is_empty() && empty.row_ptr == vec![0]);
    }

    #[test]
    fn padding_fills_the_capacity_with_absent_empty_tokens() {
        let csr = TokenCsr::build(&[3, 1, 3, 0, 1, 3], 5).unwrap();
        let (uniq, row_ptr) = csr.padded();
        assert_eq!(
            uniq,
            vec![0, 1, 3, 2, 4],
            "absent 2 and 4 fill min(6, 5) rows"
        );
        assert_eq!(row_ptr, vec![0, 1, 3, 6, 6, 6]);
        let small = TokenCsr::build(&[7, 7], 10).unwrap();
        assert_eq!(
            small.padded(),
            (vec![7, 0], vec![0, 2, 2]),
            "capacity min(2, 10)"
        );
        assert_eq!(TokenCsr::build(&[], 5).unwrap().padded(), (vec![], vec![0]));
    }

    proptest! {
        #[test]
        fn padded_rows_are_distinct_absent_and_empty(
            tokens in proptest::collection::vec(0u32..23, 0..60),
            vocab in 23usize..40,
        ) {
            let csr = TokenCsr::build(&tokens, vocab).unwrap();
            let (uniq, row_ptr) = csr.padded();
            let cap = TokenCsr::capacity(tokens.len(), vocab);
            prop_assert_eq!(uniq.len(), cap);
            prop_assert_eq!(row_ptr.len(), cap + 1);
            prop_assert_eq!(&uniq[..csr.uniq.len()], &csr.uniq[..]);
            prop_assert_eq!(&row_ptr[..csr.row_ptr.len()], &csr.row_ptr[..]);
            let mut seen = std::collections::HashSet::new();
            prop_assert!(uniq.iter().all(|&v| (v as usize) < vocab && seen.insert(v)), "distinct ids");
            for u in csr.uniq.len()..cap {
                prop_assert!(!tokens.contains(&uniq[u]), "padding is absent from the batch");
                prop_assert_eq!(row_ptr[u], row_ptr[u + 1]);
            }
        }

        #[test]
        fn csr_is_a_stable_grouping(tokens in proptest::collection::vec(0u32..17, 0..200)) {
            let csr = TokenCsr::build(&tokens, 17).unwrap();
            prop_assert_eq!(csr.pos.len(), tokens.len());
            prop_assert_eq!(csr.row_ptr.len(), csr.uniq.len() + 1);
            prop_assert!(csr.uniq.windows(2).all(|w| w[0] < w[1]));
            for (u, &v) in csr.uniq.iter().enumerate() {
                let group = &csr.pos[csr.row_ptr[u] as usize..csr.row_ptr[u + 1] as usize];
                prop_assert!(!group.is_empty());
                prop_assert!(group.windows(2).all(|w| w[0] < w[1]), "ascending positions");
                let want: Vec<u32> = (0..tokens.len() as u32).filter(|&i| tokens[i as usize] == v).collect();
                prop_assert_eq!(group, &want[..]);
            }
        }
    }
}

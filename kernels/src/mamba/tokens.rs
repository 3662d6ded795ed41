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

    /// Copy to the device (asynchronous on `stream`).
    pub fn upload(&self, stream: &Arc<CudaStream>) -> Result<DeviceTokenCsr, KernelError> {
        let up = |v: &[u32], what: &str| {
            // An empty upload would be a zero-byte allocation; keep one
            // element so every buffer is a real allocation.
            let data = if v.is_empty() { &[0u32][..] } else { v };
            stream
                .clone_htod(data)
                .map_err(|e| KernelError::driver(format!("uploading the token CSR's {what}"), e))
        };
        Ok(DeviceTokenCsr {
            uniq: up(&self.uniq, "distinct tokens")?,
            row_ptr: up(&self.row_ptr, "row pointers")?,
            pos: up(&self.pos, "positions")?,
            distinct: self.uniq.len(),
            positions: self.pos.len(),
            vocab: self.vocab,
        })
    }
}

/// A [`TokenCsr`] on the device. Only [`TokenCsr::upload`] makes one, so its
/// contents are known valid: every token `< vocab`, every position `<
/// positions`.
#[derive(Debug)]
pub struct DeviceTokenCsr {
    pub(super) uniq: CudaSlice<u32>,
    pub(super) row_ptr: CudaSlice<u32>,
    pub(super) pos: CudaSlice<u32>,
    pub(super) distinct: usize,
    pub(super) positions: usize,
    pub(super) vocab: usize,
}

impl DeviceTokenCsr {
    /// Number of distinct tokens.
    pub fn distinct(&self) -> usize {
        self.distinct
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

    proptest! {
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

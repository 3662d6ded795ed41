//! What a plan is made of: buffers, messages and fold operations per step.
//! The lowest layer of the plan module: [`super::lanes`] and the plan
//! builders read these; nothing here knows a plan.

use std::ops::Range;

use crate::fold::ChainTerm;

/// Which buffer an operation names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum BufId {
    /// The caller's `j`-th local arena (logical rank `rank * B + j`).
    Local(usize),
    /// The reducer's scratch buffer (slots, or the incoming prefix).
    Scratch,
}

/// One point-to-point message, in elements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum CommOp {
    Send {
        buf: BufId,
        range: Range<usize>,
        peer: usize,
    },
    Recv {
        buf: BufId,
        range: Range<usize>,
        peer: usize,
    },
}

/// One fold operation (see [`FoldOps`](crate::FoldOps) for the semantics).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ComputeOp {
    /// `dst[dst_off + i] = ((t0[i] + t1[i]) + ...) * factor`.
    Chain {
        dst: BufId,
        dst_off: usize,
        terms: Vec<ChainTerm<BufId>>,
        len: usize,
        factor: Option<f32>,
    },
    /// `dst[dst_off..][..len] = src[src_off..][..len]`.
    Copy {
        src: BufId,
        src_off: usize,
        dst: BufId,
        dst_off: usize,
        len: usize,
    },
}

/// A group of messages, then fold operations.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Step {
    pub(crate) comm: Vec<CommOp>,
    pub(crate) compute: Vec<ComputeOp>,
}

/// Whether two element ranges share an element.
pub(crate) fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end && !a.is_empty() && !b.is_empty()
}

//! The tied LM head and the cross-entropy, over chunks of rows, so that the
//! `[rows, vocab]` logits and their gradient never sit in memory whole.
//!
//! For each chunk of at most [`super::CudaModel::loss_chunk_rows`] rows (fewer
//! for the last, and the whole batch when it is smaller), in ascending
//! order: `logits = xf[chunk] . E^T` (cuBLAS, into the one chunk-sized
//! buffer), the cross-entropy of those rows (their losses into `row_loss`,
//! and with gradients the logits overwritten by `(softmax - onehot) /
//! counted`; in bf16 runs it is stored in bf16 alone, into `dlogits_h`,
//! the only form its GEMMs read), then `dxf[chunk] = dlogits . E` and `dE (+)= dlogits^T .
//! xf[chunk]` (`beta = 0` for the first chunk, 1 after: the chunks' sums
//! are added in ascending order). The mean over `row_loss` follows, as
//! before, in its fixed order.
//!
//! The chunk size is part of the configuration, not of the device: a
//! function of the batch shape and [`LOSS_CHUNK_ROWS`] only, so the
//! association of `dE` and the GEMM shapes are the same on every run. A
//! batch of at most `LOSS_CHUNK_ROWS` rows is one chunk: exactly the
//! unchunked head.

use cudarc::driver::CudaSlice;
use kernels::mamba::LogitGrad;

use super::blas::Operand;
use super::forward::{half, op, op_t, stored};
use super::workspace::Workspace;
use super::Engine;
use crate::config::ModelConfig;
use crate::error::{Result, TrainError};
use crate::params::ParamLayout;

/// Rows of one loss chunk by default: 1024 rows of the 50280-token
/// vocabulary are 206 MB of f32 logits (and in bf16 runs 103 MB of their
/// bf16 gradient; 8192 rows whole were 1.65 GB). Earlier builds took 2048
/// (the association of the embedding's head gradient over chunks is part of
/// the bits, so this changed them).
pub const LOSS_CHUNK_ROWS: usize = 1024;

/// The row ranges of the chunks of `rows` rows, `chunk` at a time.
pub(crate) fn chunks(rows: usize, chunk: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let chunk = chunk.max(1);
    (0..rows.div_ceil(chunk)).map(move |i| i * chunk..((i + 1) * chunk).min(rows))
}

/// What the head pass produces besides the per-row losses.
pub(super) enum HeadOutput<'a> {
    /// The loss only.
    Loss,
    /// The loss, `ws.dxn` = d loss / d xf and the head's share of d E in
    /// `grads` (overwritten: the embedding's lookup gradient is added later
    /// by the backward pass).
    LossAndGrad(&'a mut CudaSlice<f32>),
}

/// Enqueue the head and the loss over `ws.xf` (the final norm's output):
/// the batch's mean loss into `ws.loss` over the counted targets (their
/// count read from `ws.loss_scale`, uploaded with the batch), and
/// with [`HeadOutput::LossAndGrad`] the gradients above.
#[allow(clippy::too_many_arguments)]
pub(super) fn head_loss(
    e: &Engine,
    cfg: &ModelConfig,
    lay: &ParamLayout,
    p: &CudaSlice<f32>,
    pb: Option<&CudaSlice<u16>>,
    ws: &mut Workspace,
    mut out: HeadOutput<'_>,
) -> Result<()> {
    let rows = ws.batch * ws.seq_len;
    let (d, v) = (cfg.d_model, cfg.vocab_size);
    let emb = p.slice(lay.embedding.clone());
    let emb_half = half(pb, &lay.embedding);
    let write_grad = matches!(out, HeadOutput::LossAndGrad(_));
    // The forward pass's final norm stored xf's bf16 copy (bf16 runs).
    let xf_all = stored(&ws.xf_h, rows * d);
    for (i, r) in chunks(rows, ws.loss_rows).enumerate() {
        let n = r.len();
        let xf = ws.xf.slice(r.start * d..r.end * d);
        let xf_h = || xf_all.as_ref().map(|h| h.slice(r.start * d..r.end * d));
        let mut logits = ws.logits.slice_mut(0..n * v);
        e.blas.gemm(
            "lm_head",
            n,
            v,
            d,
            op(&xf, d).with_bf16(xf_h()),
            op_t(&emb, d).with_bf16(emb_half.as_ref().map(|h| h.slice(..))),
            0.0,
            &mut logits,
            v,
        )?;
        let grad = match (write_grad, ws.dlogits_h.as_mut()) {
            (false, _) => LogitGrad::None,
            (true, Some(h)) => LogitGrad::Bf16(h.slice_mut(0..n * v)),
            (true, None) => LogitGrad::InPlace,
        };
        e.kernels.cross_entropy(
            &e.stream,
            &mut logits,
            &ws.targets.slice(r.clone()),
            &mut ws.row_loss.slice_mut(r.clone()),
            &ws.loss_scale.as_view(),
            n,
            v,
            grad,
        )?;
        if let HeadOutput::LossAndGrad(grads) = &mut out {
            // The gradient: in bf16 alone when the copies are kept (the f32
            // logits are then still the logits), else in place in f32.
            let dlogits = ws.logits.slice(0..n * v);
            let dlogits_h = stored(&ws.dlogits_h, n * v);
            let dlogits_op = |trans: bool| Operand {
                elems: match &dlogits_h {
                    Some(h) => h.into(),
                    None => (&dlogits).into(),
                },
                ld: v,
                trans,
            };
            e.blas.gemm(
                "lm_head dx",
                n,
                d,
                v,
                dlogits_op(false),
                op(&emb, d).with_bf16(emb_half.as_ref().map(|h| h.slice(..))),
                0.0,
                &mut ws.dxn.slice_mut(r.start * d..r.end * d),
                d,
            )?;
            e.blas.gemm(
                "lm_head dW",
                v,
                d,
                n,
                dlogits_op(true),
                op(&xf, d).with_bf16(xf_h()),
                if i == 0 { 0.0 } else { 1.0 },
                &mut grads.slice_mut(lay.embedding.clone()),
                d,
            )?;
        }
    }
    e.kernels.loss_mean(
        &e.stream,
        &ws.row_loss.as_view(),
        rows,
        &ws.loss_scale.as_view(),
        &mut ws.loss.as_view_mut(),
    )?;
    Ok(())
}

/// The logits of every row, chunk by chunk (the same GEMMs as the loss
/// sees), downloaded into one host vector `[rows, vocab]`. Synchronizes the
/// stream once per chunk.
pub(super) fn head_logits(
    e: &Engine,
    cfg: &ModelConfig,
    lay: &ParamLayout,
    p: &CudaSlice<f32>,
    pb: Option<&CudaSlice<u16>>,
    ws: &mut Workspace,
) -> Result<Vec<f32>> {
    let rows = ws.batch * ws.seq_len;
    let (d, v) = (cfg.d_model, cfg.vocab_size);
    let emb = p.slice(lay.embedding.clone());
    let emb_half = half(pb, &lay.embedding);
    let mut host = vec![0.0f32; rows * v];
    let xf_all = stored(&ws.xf_h, rows * d);
    for r in chunks(rows, ws.loss_rows) {
        let n = r.len();
        let xf = ws.xf.slice(r.start * d..r.end * d);
        let xf_h = xf_all.as_ref().map(|h| h.slice(r.start * d..r.end * d));
        e.blas.gemm(
            "lm_head",
            n,
            v,
            d,
            op(&xf, d).with_bf16(xf_h),
            op_t(&emb, d).with_bf16(emb_half.as_ref().map(|h| h.slice(..))),
            0.0,
            &mut ws.logits.slice_mut(0..n * v),
            v,
        )?;
        e.stream
            .memcpy_dtoh(
                &ws.logits.slice(0..n * v),
                &mut host[r.start * v..r.end * v],
            )
            .map_err(|err| TrainError::Cuda {
                what: "downloading the logits".into(),
                detail: err.to_string(),
            })?;
    }
    e.stream.synchronize().map_err(|err| TrainError::Cuda {
        what: "waiting for the logits".into(),
        detail: err.to_string(),
    })?;
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::chunks;

    #[test]
    fn chunks_cover_the_rows_in_order_once() {
        for (rows, chunk) in [
            (0, 4),
            (1, 4),
            (4, 4),
            (5, 4),
            (8192, 2048),
            (8193, 2048),
            (7, 1),
        ] {
            let got: Vec<_> = chunks(rows, chunk).collect();
            assert_eq!(got.iter().map(|r| r.len()).sum::<usize>(), rows);
            for w in got.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            assert!(got.iter().all(|r| !r.is_empty() && r.len() <= chunk));
            assert_eq!(got.first().map_or(0, |r| r.start), 0);
        }
        assert_eq!(chunks(5, 0).count(), 5, "a chunk of 0 rows is taken as 1");
    }
}

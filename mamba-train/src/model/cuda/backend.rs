//! The CUDA model as the engine's [`Backend`]: device arenas
//! (`CudaSlice<f32>`), the model's passes, and (in [`super::optim`]) the
//! optimizer's arithmetic.

use std::borrow::Cow;

use cudarc::driver::CudaSlice;

use super::CudaModel;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::Backend;
use crate::model::Batch;
use crate::params::ParamLayout;

impl Backend for CudaModel {
    fn config(&self) -> &ModelConfig {
        CudaModel::config(self)
    }
    fn layout(&self) -> &ParamLayout {
        CudaModel::layout(self)
    }
    fn device_name(&self) -> &'static str {
        "cuda"
    }
    fn precision_name(&self) -> &'static str {
        self.precision().name()
    }
    fn zeros(&mut self) -> Result<CudaSlice<f32>> {
        self.zeros_arena()
    }
    fn upload(&mut self, host: &[f32]) -> Result<CudaSlice<f32>> {
        CudaModel::upload(self, host)
    }
    /// A download (synchronizes the stream).
    fn to_host<'a>(&mut self, arena: &'a CudaSlice<f32>) -> Result<Cow<'a, [f32]>> {
        Ok(Cow::Owned(self.download(arena)?))
    }
    /// Device memory holds no empty buffer: an empty shard is one element
    /// nobody reads (its updates and downloads use the shard's length).
    fn upload_shard(&mut self, host: &[f32]) -> Result<CudaSlice<f32>> {
        let stream = &self.engine.stream;
        let made = if host.is_empty() {
            stream.alloc_zeros::<f32>(1)
        } else {
            stream.clone_htod(host)
        };
        made.map_err(|e| super::cuda("uploading an optimizer shard", e))
    }
    /// A download of the first `len` elements (synchronizes the stream).
    fn shard_to_host<'a>(
        &mut self,
        arena: &'a CudaSlice<f32>,
        len: usize,
    ) -> Result<Cow<'a, [f32]>> {
        if arena.len() < len {
            return Err(crate::error::TrainError::Config(format!(
                "an optimizer shard arena holds {} elements, expected {len}",
                arena.len()
            )));
        }
        if len == 0 {
            return Ok(Cow::Owned(Vec::new()));
        }
        self.engine
            .stream
            .clone_dtoh(&arena.slice(0..len))
            .map(Cow::Owned)
            .map_err(|e| super::cuda("downloading an optimizer shard", e))
    }
    /// The CPU's reference initialisation, uploaded.
    fn init_params(&mut self, seed: u64) -> Result<CudaSlice<f32>> {
        CudaModel::init_params(self, seed)
    }
    fn forward_backward(
        &mut self,
        params: &CudaSlice<f32>,
        batch: &Batch,
        grads: &mut CudaSlice<f32>,
    ) -> Result<f32> {
        CudaModel::forward_backward(self, params, batch, grads)
    }
    /// Computed in pieces of at most the current workspace's rows (the
    /// training batch's, once a step ran): the workspace keeps the training
    /// shape (no reallocation, no larger peak), and the rows of a batch are
    /// independent, so the pieces make up the whole.
    fn logits(&mut self, params: &CudaSlice<f32>, batch: &Batch) -> Result<Vec<f32>> {
        let piece = self.workspace_rows().unwrap_or(batch.batch).max(1);
        let t = batch.seq_len;
        let n = batch.batch.saturating_mul(t);
        if batch.batch <= piece || batch.tokens.len() != n || batch.targets.len() != n {
            // One piece, or a malformed batch the model reports in full.
            return CudaModel::logits(self, params, batch);
        }
        let mut out = Vec::with_capacity(n * self.config().vocab_size);
        let mut row = 0;
        while row < batch.batch {
            let end = (row + piece).min(batch.batch);
            let part = Batch {
                tokens: batch.tokens[row * t..end * t].to_vec(),
                targets: batch.targets[row * t..end * t].to_vec(),
                batch: end - row,
                seq_len: t,
            };
            out.extend(CudaModel::logits(self, params, &part)?);
            row = end;
        }
        Ok(out)
    }
    /// Always `true`, without reading the arena: a non-finite gradient
    /// element makes the reduced mean non-finite on every rank (NaN and
    /// infinity survive every sum and the `1/L` scale), so the optimizer's
    /// global-norm check skips that step on every rank alike, and the
    /// step is counted as skipped. A non-finite *loss* is still agreed on
    /// before the reduction (the loop checks it), which skips the
    /// reduction as well. This saves a pass and a host wait per
    /// micro-batch.
    fn all_finite(&mut self, _grads: &CudaSlice<f32>) -> Result<bool> {
        Ok(true)
    }
}

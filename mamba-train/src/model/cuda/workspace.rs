//! Device buffers of one forward/backward shape: the activations the
//! backward pass reads, and the scratch both passes share.
//!
//! Sized for one `(batch, seq_len)`; [`super::CudaModel`] rebuilds it when a
//! batch of another shape arrives (dropping the old one first, so the peak
//! is one workspace). Every buffer is zero-filled at allocation, so no
//! kernel can ever read uninitialised memory; after that each is fully
//! overwritten by the step that produces it before any step reads it.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use kernels::mamba::{MambaKernels, ScanShape};

use crate::config::ModelConfig;
use crate::error::{Result, TrainError};

/// What one block's backward pass needs from its forward pass.
pub(crate) struct LayerActs {
    /// 1/rms of each row of the block's input, `[rows]`.
    pub rstd: CudaSlice<f32>,
    /// RMSNorm output, `[rows, d_model]` (in_proj's input).
    pub xn: CudaSlice<f32>,
    /// in_proj output, `[rows, 2 d_inner]`: x then z.
    pub xz: CudaSlice<f32>,
    /// `SiLU(conv(x))`, `[rows, d_inner]`.
    pub u: CudaSlice<f32>,
    /// x_proj output, `[rows, dt_rank + 2 d_state]`: dt_raw, B, C.
    pub dbc: CudaSlice<f32>,
    /// `softplus(dt_proj(dt_raw) + bias)`, `[rows, d_inner]`.
    pub dt: CudaSlice<f32>,
    /// Scan output `C.h + D u`, `[rows, d_inner]`.
    pub y: CudaSlice<f32>,
    /// Gated output `y SiLU(z)`, `[rows, d_inner]` (out_proj's input).
    pub g: CudaSlice<f32>,
    /// The scan's chunk entry states ([`ScanShape::state_len`]).
    pub hin: CudaSlice<f32>,
}

/// All device buffers of one shape.
pub(crate) struct Workspace {
    pub batch: usize,
    pub seq_len: usize,
    /// Residual stream: `resid[l]` enters block `l`, `resid[n_layer]` leaves
    /// the last one; each `[rows, d_model]`.
    pub resid: Vec<CudaSlice<f32>>,
    pub layers: Vec<LayerActs>,
    /// Final norm's 1/rms `[rows]` and output `[rows, d_model]`.
    pub rstd_f: CudaSlice<f32>,
    pub xf: CudaSlice<f32>,
    /// Rows of one loss chunk (`min(rows, the model's loss chunk)`): the
    /// head and the loss run over the rows this many at a time
    /// ([`super::head`]).
    pub loss_rows: usize,
    /// One chunk's logits `[loss_rows, vocab]`; the cross-entropy turns them
    /// into their gradient in place.
    pub logits: CudaSlice<f32>,
    /// The scan backward's d A partials ([`ScanShape::da_partial_len`]).
    pub da_part: CudaSlice<f32>,
    /// d B / d C partials ([`ScanShape::dbc_partial_len`]).
    pub dbc_part: CudaSlice<f32>,
    /// Column-sum partials (the largest any column sum of the model needs).
    pub colsum: CudaSlice<f32>,
    pub row_loss: CudaSlice<f32>,
    pub loss: CudaSlice<f32>,
    /// Backward buffers, reused by every block.
    pub dres: CudaSlice<f32>,
    pub dxn: CudaSlice<f32>,
    pub dout: CudaSlice<f32>,
    pub dy: CudaSlice<f32>,
    pub dxz: CudaSlice<f32>,
    pub ddtr: CudaSlice<f32>,
    pub du: CudaSlice<f32>,
    pub ddbc: CudaSlice<f32>,
    /// The batch on the device.
    pub tokens: CudaSlice<u32>,
    pub targets: CudaSlice<i32>,
    /// Bytes allocated above.
    pub bytes: usize,
}

/// Allocates zero-filled buffers and counts their bytes.
struct Alloc<'a> {
    stream: &'a Arc<CudaStream>,
    bytes: usize,
}

impl Alloc<'_> {
    fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &mut self,
        what: &str,
        len: usize,
    ) -> Result<CudaSlice<T>> {
        let len = len.max(1);
        let s = self
            .stream
            .alloc_zeros::<T>(len)
            .map_err(|e| TrainError::Cuda {
                what: format!("allocating {what} ({len} elements)"),
                detail: format!("{e}; the batch may be too large for this GPU's memory"),
            })?;
        self.bytes += len * std::mem::size_of::<T>();
        Ok(s)
    }
}

impl Workspace {
    /// The scan's extents for this model and shape.
    pub fn scan_shape(cfg: &ModelConfig, batch: usize, seq_len: usize) -> ScanShape {
        ScanShape {
            batch,
            seq_len,
            d_inner: cfg.d_inner(),
            d_state: cfg.d_state,
        }
    }

    /// Allocate every buffer for `batch` sequences of `seq_len` tokens,
    /// with the loss over chunks of at most `loss_chunk_rows` rows.
    pub fn new(
        stream: &Arc<CudaStream>,
        cfg: &ModelConfig,
        batch: usize,
        seq_len: usize,
        loss_chunk_rows: usize,
    ) -> Result<Workspace> {
        let rows = batch * seq_len;
        let loss_rows = rows.min(loss_chunk_rows.max(1));
        let (d, di, v) = (cfg.d_model, cfg.d_inner(), cfg.vocab_size);
        let ldbc = cfg.dt_rank + 2 * cfg.d_state;
        let shape = Self::scan_shape(cfg, batch, seq_len);
        let sl = shape.state_len();
        let mut a = Alloc { stream, bytes: 0 };
        let mut resid = Vec::with_capacity(cfg.n_layer + 1);
        for l in 0..=cfg.n_layer {
            resid.push(a.zeros(&format!("residual stream {l}"), rows * d)?);
        }
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for l in 0..cfg.n_layer {
            let w = |s: &str| format!("layer {l} {s}");
            layers.push(LayerActs {
                rstd: a.zeros(&w("rstd"), rows)?,
                xn: a.zeros(&w("norm output"), rows * d)?,
                xz: a.zeros(&w("in_proj output"), rows * 2 * di)?,
                u: a.zeros(&w("conv output"), rows * di)?,
                dbc: a.zeros(&w("x_proj output"), rows * ldbc)?,
                dt: a.zeros(&w("dt"), rows * di)?,
                y: a.zeros(&w("scan output"), rows * di)?,
                g: a.zeros(&w("gated output"), rows * di)?,
                hin: a.zeros(&w("scan chunk states"), sl)?,
            });
        }
        let colsum = MambaKernels::colsum_scratch_len(rows, d.max(di))
            .max(MambaKernels::conv_wgrad_scratch_len(rows, di, cfg.d_conv));
        let ws = Workspace {
            batch,
            seq_len,
            resid,
            layers,
            rstd_f: a.zeros("final rstd", rows)?,
            xf: a.zeros("final norm output", rows * d)?,
            loss_rows,
            logits: a.zeros("logits of one loss chunk", loss_rows * v)?,
            da_part: a.zeros("scan dA partials", shape.da_partial_len())?,
            dbc_part: a.zeros("scan dB/dC partials", shape.dbc_partial_len())?,
            colsum: a.zeros("column-sum partials", colsum)?,
            row_loss: a.zeros("row losses", rows)?,
            loss: a.zeros("loss", 1)?,
            dres: a.zeros("residual gradient", rows * d)?,
            dxn: a.zeros("norm output gradient", rows * d)?,
            dout: a.zeros("gated output gradient", rows * di)?,
            dy: a.zeros("scan output gradient", rows * di)?,
            dxz: a.zeros("in_proj output gradient", rows * 2 * di)?,
            ddtr: a.zeros("dt_proj output gradient", rows * di)?,
            du: a.zeros("conv output gradient", rows * di)?,
            ddbc: a.zeros("x_proj output gradient", rows * ldbc)?,
            tokens: a.zeros("tokens", rows)?,
            targets: a.zeros("targets", rows)?,
            bytes: 0,
        };
        Ok(Workspace {
            bytes: a.bytes,
            ..ws
        })
    }
}

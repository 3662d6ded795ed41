//! `state.json`: everything besides the tensors that a resumed run needs to
//! land on the same bits, plus what identifies the run.

use serde::{Deserialize, Serialize};

use crate::run_config::RunConfig;

/// Version of the checkpoint directory format; bumped on any incompatible
/// change of file names, tensor names, or `state.json` fields.
pub const FORMAT_VERSION: u32 = 1;

/// Where the sample stream continues. Samples are a pure function of
/// `(seed, step, micro, row)` (see [`crate::data`]), so the next step number
/// is the whole position; the other two fields make the shape explicit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPosition {
    /// The first step the resumed run draws.
    pub next_step: u64,
    /// Logical micro-batches drawn per step (the logical world).
    pub micro_batches_per_step: usize,
    /// Rows per logical micro-batch.
    pub rows_per_micro_batch: usize,
}

/// The JSON state of a checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// Steps completed (skipped ones included); the next step's index.
    pub step: u64,
    /// AdamW updates applied (`t` of the bias correction); `step` minus the
    /// skipped steps.
    pub optimizer_updates: u64,
    /// Steps skipped for a non-finite loss or gradient.
    pub skipped_steps: u64,
    /// Where the data stream continues.
    pub data_position: DataPosition,
    /// Hex SHA-256 of the weight arena's little-endian bytes; checked on load.
    pub weights_digest: String,
    /// The run's identity: seed, model, task, batch, logical world, contract,
    /// optimizer and schedule.
    #[serde(flatten)]
    pub run: RunConfig,
}

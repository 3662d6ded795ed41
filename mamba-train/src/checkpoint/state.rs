//! `state.json`: everything besides the tensors that a resumed run needs to
//! land on the same bits, plus what identifies the run.

use serde::{Deserialize, Serialize};

use crate::run_config::RunConfig;

/// Version of the checkpoint directory format; bumped on any incompatible
/// change of file names, tensor names, or `state.json` fields.
///
/// 2: `state.json` carries a SHA-256 of every other file (`file_digests`)
/// and of itself (`state_digest`), the device and precision that wrote it,
/// and the schedule extensions (`schedule_changes`).
pub const FORMAT_VERSION: u32 = 2;

/// The only precision this build trains in (recorded in every checkpoint).
pub const PRECISION_F32: &str = "f32";

/// One extension of a run's schedule (`--extend`): from step `at_step` on,
/// the cosine schedule's total is `new_total` instead of `old_total`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleChange {
    /// The step at which the new schedule took over (the resumed step).
    pub at_step: u64,
    /// The total steps before the change.
    pub old_total: u64,
    /// The total steps after the change.
    pub new_total: u64,
}

/// What a checkpoint records about how it was written, besides the run's
/// identity: the device, the precision, and the schedule's history.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Where the run trained when this checkpoint was written (`cpu`,
    /// `cuda`). A resume on another device is allowed (same format).
    pub device: String,
    /// Arithmetic precision of the training step (`f32`). Part of the
    /// run's bits: a resume in another precision is refused.
    pub precision: String,
    /// Every `--extend` of the run, oldest first.
    #[serde(default)]
    pub schedule_changes: Vec<ScheduleChange>,
    /// The pretrained weights the run started from (`--init-from`), if it
    /// did not start from the seed law's initialisation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<InitRecord>,
}

/// Where a fine-tuning run's initial weights came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitRecord {
    /// The directory given to `--init-from`, as given.
    pub source: String,
    /// Hex SHA-256 of the initial weight arena (the `weights-digest` of
    /// that model), so the start is identified even if the directory moves.
    pub weights_sha256: String,
}

impl Default for CheckpointMeta {
    fn default() -> Self {
        CheckpointMeta {
            device: "cpu".into(),
            precision: PRECISION_F32.into(),
            schedule_changes: Vec::new(),
            init_from: None,
        }
    }
}

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

//! Defaults of `mamba-train train`, chosen so that the command with no flags
//! finishes on two CPU cores in well under a minute and visibly learns the
//! selective-copying task (docs/PERFORMANCE.md has the measured time).

/// Default task.
pub const TASK: crate::data::TaskKind = crate::data::TaskKind::SelectiveCopy;
/// Optimizer steps.
pub const STEPS: u64 = 2000;
/// Residual width.
pub const D_MODEL: usize = 64;
/// Blocks.
pub const LAYERS: usize = 2;
/// Rows per micro-batch.
pub const BATCH: usize = 16;
/// Tokens per row for the synthetic tasks.
pub const SEQ_LEN: usize = 48;
/// Tokens per row for text.
pub const TEXT_SEQ_LEN: usize = 128;
/// Share of a text corpus held out for evaluation (`train --task text`).
pub const VAL_FRACTION: f64 = 0.1;
/// Share of the tokens `tokenize` holds out in val.bin (corpora given to it
/// are larger: 1% is plenty to evaluate on).
pub const TOKENIZE_VAL_FRACTION: f64 = 0.01;
/// Selective copy: tokens to remember.
pub const MEMORIZE: usize = 8;
/// Synthetic tasks: distinct data tokens.
pub const ALPHABET: usize = 8;
/// Peak learning rate.
pub const LR: f32 = 1e-2;
/// Warmup steps (capped at a tenth of the run).
pub const WARMUP: u64 = 50;
/// Cosine floor as a fraction of the peak.
pub const MIN_LR_FRAC: f32 = 0.1;
/// Master seed.
pub const SEED: u64 = 0;
/// Checkpoint period in steps (0: only at the end).
pub const CHECKPOINT_EVERY: u64 = 200;
/// Replica check period in steps (0: only at checkpoints and the end).
pub const REPLICA_CHECK_EVERY: u64 = 100;
/// Seconds a rank waits for a peer before failing.
pub const COMM_TIMEOUT_SECS: u64 = 300;

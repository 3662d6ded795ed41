//! [`RankContext`]: what the rank's loop and its reports need to know
//! besides the world (the command line, where the loop stops, what it
//! resumed from).

use std::path::PathBuf;

use super::args::TrainArgs;
use crate::checkpoint::CheckpointMeta;

/// What the loop needs to know besides the world.
pub struct RankContext<'a> {
    /// The command line.
    pub args: &'a TrainArgs,
    /// The step the loop stops after.
    pub end: u64,
    /// The checkpoint the run resumed from, if any.
    pub resumed_from: Option<PathBuf>,
    /// Worker threads of this rank, for the description line.
    pub threads: usize,
    /// The run directory (`--out`, or its default: see
    /// [`super::run_dir::run_dir_of`]).
    pub out: PathBuf,
    /// What every checkpoint of this run records besides its state: the
    /// device, the precision, the schedule's changes.
    pub meta: CheckpointMeta,
}

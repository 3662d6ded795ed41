//! The `mamba-train` command line: arguments, defaults, resolution against a
//! checkpoint, progress display, and the `train` command.

pub mod args;
pub mod config_file;
pub mod context;
pub mod defaults;
pub mod drive;
pub mod flags;
pub mod plan;
pub mod progress;
pub mod report;
pub mod resolve;
pub mod run;
pub mod run_dir;

pub use args::{Cli, Command, Device, TrainArgs};
pub use run::{rank_prefix, train, TrainOutcome, TrainSummary, METRICS_FILE, PLOT_FILE};

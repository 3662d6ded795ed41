//! The `mamba-train` command line: arguments, defaults, resolution against a
//! checkpoint, progress display, the `train` command, and `tokenize`.

pub mod args;
pub mod context;
pub mod defaults;
pub mod drive;
pub mod plan;
pub mod progress;
pub mod report;
pub mod resolve;
mod resolve_data;
pub mod run;
pub mod run_dir;
pub mod tokenize;

pub use args::{Cli, Command, Device, TokenizeArgs, TrainArgs};
pub use run::{rank_prefix, train, TrainOutcome, TrainSummary, METRICS_FILE, PLOT_FILE};
pub use tokenize::run_tokenize;

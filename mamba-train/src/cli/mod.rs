//! The `mamba-train` command line: arguments, defaults, resolution against a
//! checkpoint, progress display, and the `train` command.

pub mod args;
pub mod defaults;
pub mod progress;
pub mod resolve;
pub mod run;

pub use args::{Cli, Command, Device, TrainArgs};
pub use run::{train, TrainSummary, METRICS_FILE, PLOT_FILE};

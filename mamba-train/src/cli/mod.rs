//! The `mamba-train` command line: arguments, defaults, resolution against a
//! checkpoint, progress display, and the `train`, `generate`, `eval` and
//! `tokenize` commands.

pub mod arch;
pub mod args;
pub mod config_file;
pub mod context;
pub mod defaults;
pub mod drive;
pub mod eval;
pub mod flags;
pub mod generate;
pub mod plan;
pub mod progress;
mod rank_setup;
pub mod report;
pub mod resolve;
mod resolve_data;
pub mod run;
pub mod run_dir;
pub mod source;
pub mod tokenize;

pub use args::{Cli, CliArch, Command, Device, TokenizeArgs, TrainArgs};
pub use eval::{eval, EvalArgs, EvalOutcome};
pub use generate::{generate, GenerateArgs};
pub use run::{rank_prefix, train, TrainOutcome, TrainSummary, METRICS_FILE, PLOT_FILE};
pub use tokenize::{run_tokenize, run_train_tokenizer};

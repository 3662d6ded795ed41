//! The `mamba-train` command. `mamba-train train` with no flags trains a
//! small Mamba on the CPU; its last stdout line is `weights-digest: <hex>`.
//!
//! With `--world P` (and no launcher) this process starts `P` copies of
//! itself as ranks and waits; rank 0 prints the summary, the other ranks
//! print their digest on stderr, and an error of a rank is printed with a
//! `[rank R of P]` prefix. The exit status is non-zero when any rank
//! failed; the supervisor's error names the first failed rank.

use std::process::ExitCode;

use clap::Parser;
use mamba_train::cli::progress::stderr_line;
use mamba_train::cli::{self, Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Train(args) => {
            let stdout = std::io::stdout();
            let mut lock = stdout.lock();
            match cli::train(&args, &mut lock) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => {
                    stderr_line(&format!("{}error: {e}", cli::rank_prefix()));
                    ExitCode::FAILURE
                }
            }
        }
        Command::Tokenize(args) => {
            let stdout = std::io::stdout();
            match cli::run_tokenize(&args, &mut stdout.lock()) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => {
                    stderr_line(&format!("error: {e}"));
                    ExitCode::FAILURE
                }
            }
        }
    }
}

//! The `mamba-train` command. `mamba-train train` with no flags trains a
//! small Mamba on the CPU; its last stdout line is `weights-digest: <hex>`.

use std::process::ExitCode;

use clap::Parser;
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
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

//! The `mamba-train` command. `mamba-train train` with no flags trains a
//! small Mamba on the CPU; its last stdout line is `weights-digest: <hex>`.
//! `generate` continues a prompt with a checkpoint, `eval` scores one.
//!
//! With `--world P` (and no launcher) this process starts `P` copies of
//! itself as ranks and waits; rank 0 prints the summary, the other ranks
//! print their digest on stderr, and an error of a rank is printed with a
//! `[rank R of P]` prefix. The exit status is non-zero when any rank
//! failed; the supervisor's error names the first failed rank.

use std::process::ExitCode;

use mamba_train::cli::progress::stderr_line;
use mamba_train::cli::{self, Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse_with_config(std::env::args_os().collect());
    let stdout = std::io::stdout();
    let mut lock = stdout.lock();
    let result = match cli.command {
        Command::Train(args) => {
            // From the start, so that a stop request during start-up is
            // honoured at the first step boundary instead of killing the
            // process (see mamba_comm::stop_signal).
            if let Err(e) = mamba_comm::stop_signal::StopSignal::install() {
                stderr_line(&format!(
                    "warning: {e}; SIGTERM and SIGINT will end the run at once"
                ));
            }
            cli::train(&args, &mut lock).map(|_| ())
        }
        Command::Generate(args) => cli::generate(&args, &mut lock).map(|_| ()),
        Command::Eval(args) => cli::eval(&args, &mut lock).map(|_| ()),
        Command::Tokenize(args) => cli::run_tokenize(&args, &mut lock).map(|_| ()),
        Command::TrainTokenizer(args) => cli::run_train_tokenizer(&args, &mut lock),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => match e.stop_status() {
            // A requested stop is not an error: its message says where the
            // checkpoint is and how to continue.
            Some(status) => {
                stderr_line(&format!("{}{e}", cli::rank_prefix()));
                ExitCode::from(status as u8)
            }
            None => {
                stderr_line(&format!(
                    "{}error: {}",
                    cli::rank_prefix(),
                    cli::flags::user_message(&e)
                ));
                ExitCode::FAILURE
            }
        },
    }
}

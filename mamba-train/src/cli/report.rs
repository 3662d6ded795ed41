//! What `mamba-train train` tells the user: the description line at the
//! start, the contract note, and the outcome and summary at the end.

use std::path::{Path, PathBuf};

use mamba_comm::supervisor::WorldReport;
use mamba_reduce::ReduceContract;

use super::context::RankContext;
use crate::data::TaskSpec;
use crate::train::RunConfig;

/// What a finished `train` command reports on rank 0 (also printed to
/// stdout).
#[derive(Clone, Debug)]
pub struct TrainSummary {
    /// Steps completed.
    pub steps: u64,
    /// Steps skipped.
    pub skipped: u64,
    /// Loss of the last step run here (NaN when none ran).
    pub final_loss: f32,
    /// Held-out loss.
    pub eval_loss: f64,
    /// Held-out accuracy on scored positions.
    pub accuracy: f64,
    /// Accuracy of uniform guessing.
    pub chance: f64,
    /// The last checkpoint written.
    pub checkpoint: PathBuf,
    /// Hex SHA-256 of the final weights (the same on every rank).
    pub weights_digest: String,
    /// Processes in the world.
    pub world: usize,
    /// Logical world L.
    pub logical_world: usize,
    /// Replica checks run (all passed).
    pub replica_checks: u64,
}

/// What a finished `train` command was in the world.
#[derive(Debug)]
pub enum TrainOutcome {
    /// Rank 0 (or the only process): the run's summary, printed to stdout.
    Summary(TrainSummary),
    /// Another rank: its final state, equal to rank 0's (checked).
    Replica {
        /// This rank.
        rank: usize,
        /// Steps completed.
        steps: u64,
        /// Hex SHA-256 of its final weights.
        weights_digest: String,
    },
    /// This process started the ranks and waited for them; they did the
    /// work (rank 0 printed the summary). Every rank succeeded.
    Supervised(WorldReport),
}

pub(crate) fn describe(
    run: &RunConfig,
    n_params: usize,
    device: &str,
    run_dir: &Path,
    step: u64,
    world: usize,
    ctx: &RankContext<'_>,
) -> String {
    let task = match &run.task {
        TaskSpec::SelectiveCopy(c) => format!(
            "selective-copy (seq {}, remember {} of {} symbols)",
            c.seq_len, c.n_memorize, c.alphabet
        ),
        TaskSpec::Induction(c) => format!("induction (seq {}, {} symbols)", c.seq_len, c.alphabet),
        TaskSpec::Text(c) => format!(
            "text {} ({} bytes, {} {}, {} held out; seq {})",
            c.path.display(),
            c.corpus_bytes,
            c.tokens,
            match &c.tokenizer {
                Some(t) => format!("tokens of {}", t.path.display()),
                None => "byte tokens".into(),
            },
            c.held_out_tokens,
            c.seq_len
        ),
        TaskSpec::Tokens(c) => format!(
            "tokens {} ({} + {} held-out {} tokens, vocabulary {}; seq {})",
            c.dir.display(),
            c.train.bytes / c.dtype.width() as u64,
            c.val.bytes / c.dtype.width() as u64,
            c.dtype,
            c.vocab_size,
            c.seq_len
        ),
    };
    let from = if step > 0 {
        format!(", resuming at step {step}")
    } else {
        String::new()
    };
    let layout = if world > 1 || run.logical_world > 1 {
        format!(
            "; {world} {device} {} x {} {} (logical world {}, {})",
            plural(world, "process"),
            run.logical_world / world,
            plural(run.logical_world / world, "micro-batch"),
            run.logical_world,
            run.contract
        )
    } else {
        String::new()
    };
    format!(
        "mamba-train: {task}; {}d_model {} x {} layers ({} params); batch {}{layout}; {} steps, lr {}, warmup {}; seed {}; {} thread{}{}; out {}{from}",
        super::arch::shape_note(&run.model),
        run.model.d_model,
        run.model.n_layer,
        n_params,
        run.batch,
        run.schedule.total_steps,
        run.schedule.peak_lr,
        run.schedule.warmup_steps,
        run.seed,
        ctx.threads,
        if ctx.threads == 1 { "" } else { "s" },
        if world > 1 { " per process" } else { "" },
        run_dir.display()
    )
}

/// `--contract` as the trainer records it.
pub fn contract_note(c: ReduceContract, world: usize, logical: usize) -> Option<String> {
    (c == ReduceContract::NcclSum).then(|| {
        if world > 1 && world < logical {
            format!(
                "note: --contract nccl-sum with {world} processes and logical world {logical}: \
                 each process sums its block first, so the bits differ from --world 1 or \
                 --contract fixed-order"
            )
        } else {
            "note: --contract nccl-sum: the library's sum; its bits may change with the world \
             size, the transport or the machine"
                .to_string()
        }
    })
}

/// `word` for a count of `n`: `process`/`processes`,
/// `micro-batch`/`micro-batches`.
pub(crate) fn plural(n: usize, word: &str) -> String {
    match (n, word.ends_with("ss") || word.ends_with('h')) {
        (1, _) => word.to_string(),
        (_, true) => format!("{word}es"),
        _ => format!("{word}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::plural;

    #[test]
    fn plurals_of_the_words_the_cli_counts() {
        assert_eq!(plural(1, "process"), "process");
        assert_eq!(plural(2, "process"), "processes");
        assert_eq!(plural(1, "micro-batch"), "micro-batch");
        assert_eq!(plural(0, "micro-batch"), "micro-batches");
        assert_eq!(plural(3, "step"), "steps");
    }
}

//! Command-line arguments (clap).
//!
//! Settings that define the run are `Option`s without clap defaults: on a
//! fresh run an omitted flag takes the default in [`super::defaults`] (the
//! help text quotes them; a test keeps the two in sync); on `--resume` it
//! takes the checkpoint's value, and a flag that *is* given must agree with
//! the checkpoint (the error names the setting).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use mamba_reduce::ReduceContract;

use crate::config::{Arch, Precision};
use crate::data::{TaskKind, TokenDtype};

/// `mamba-train`: deterministic Mamba training.
#[derive(Debug, Parser)]
#[command(
    name = "mamba-train",
    version,
    about = "Deterministic training of Mamba-1 and Mamba-2 language models"
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
// Parsed once per process, so the size of `TrainArgs` does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a model (CPU by default); prints `weights-digest: <hex>` last.
    Train(TrainArgs),
    /// Continue a prompt with a trained model (greedy or sampled), by
    /// recurrent decoding; prints the continuation.
    Generate(super::generate::GenerateArgs),
    /// Held-out loss, perplexity and accuracy of a checkpoint.
    Eval(super::eval::EvalArgs),
    /// Turn text files or directories into token files (train.bin, val.bin,
    /// meta.json, tokenizer.json) for `train --task tokens --data DIR`.
    Tokenize(TokenizeArgs),
    /// Train a byte-level BPE tokenizer (tokenizer.json) on text files or
    /// directories, for `tokenize` and `train --tokenizer`.
    TrainTokenizer(TrainTokenizerArgs),
}

/// `--task` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CliTask {
    /// Selective copying (Mamba paper 4.1.1).
    SelectiveCopy,
    /// Induction heads (Mamba paper 4.1.2).
    Induction,
    /// Language modelling on the text file or directory `--data PATH`:
    /// byte-level, or tokenized at the start with `--tokenizer`.
    Text,
    /// Language modelling on pre-tokenized token files, `--data DIR` (its
    /// train.bin; evaluation reads its val.bin).
    Tokens,
}

impl From<CliTask> for TaskKind {
    fn from(t: CliTask) -> TaskKind {
        match t {
            CliTask::SelectiveCopy => TaskKind::SelectiveCopy,
            CliTask::Induction => TaskKind::Induction,
            CliTask::Text => TaskKind::Text,
            CliTask::Tokens => TaskKind::Tokens,
        }
    }
}

/// `--arch` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CliArch {
    /// Mamba-1: the selective scan (`MambaForCausalLM`).
    Mamba1,
    /// Mamba-2: the state-space-duality mixer (`Mamba2ForCausalLM`).
    Mamba2,
}

impl CliArch {
    /// The flag's spelling of the architecture of `arch`.
    pub fn of(arch: &Arch) -> CliArch {
        match arch {
            Arch::Mamba1 => CliArch::Mamba1,
            Arch::Mamba2(_) => CliArch::Mamba2,
        }
    }
    /// The flag's value (`mamba1`, `mamba2`), as [`Arch::name`].
    pub fn name(self) -> &'static str {
        match self {
            CliArch::Mamba1 => "mamba1",
            CliArch::Mamba2 => "mamba2",
        }
    }
}

/// `--device` values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// The CPU reference model (all cores, same bits for any thread count).
    #[default]
    Cpu,
    /// NVIDIA GPUs: the CUDA model, one GPU per process, gradients reduced
    /// through NCCL also on one GPU (needs the NVIDIA driver, NCCL 2.26 or
    /// newer and a build with the CUDA kernels).
    Cuda,
}

/// `mamba-train train` flags. Run-defining settings without a flag take the
/// default quoted in their help on a fresh run, the checkpoint's on --resume.
#[derive(Clone, Debug, Default, Args)]
pub struct TrainArgs {
    /// A TOML file of these flags (`layers = 4`, `d-model = 128`,
    /// `overwrite = true`); flags given on the command line override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Task to train on [default: selective-copy].
    #[arg(long, value_enum)]
    pub task: Option<CliTask>,
    /// `--task text`: a text file or a directory of them (recursively, in
    /// sorted order). `--task tokens`: a directory holding train.bin and
    /// val.bin (or the path of its train.bin).
    #[arg(long, value_name = "PATH")]
    pub data: Option<PathBuf>,
    /// A Hugging Face tokenizer.json: `--task text` tokenizes --data with it
    /// at the start; `--task tokens` checks the files were made with it
    /// (default: the tokenizer.json beside them, if any). Without it text is
    /// byte-level (vocabulary 256). Copied into every checkpoint.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// `--task text`: share of the tokens held out for evaluation (the
    /// corpus's tail); training never reads them [default: 0.1].
    #[arg(long, value_name = "F")]
    pub val_fraction: Option<f64>,
    /// `--task tokens`: width of the tokens in train.bin/val.bin, which have
    /// no header [default: meta.json's, else u16 (nanoGPT's)].
    #[arg(long, value_name = "u16|u32", value_parser = parse_dtype)]
    pub token_dtype: Option<TokenDtype>,
    /// Model vocabulary of a tokenized run (--tokenizer or --task tokens): at
    /// least the tokenizer's [default: the tokenizer's, rounded up to a
    /// multiple of 8; without a tokenizer or meta.json, required].
    #[arg(long, value_name = "N")]
    pub vocab_size: Option<usize>,
    /// Total optimizer steps of the run, the schedule's length [default: 2000].
    #[arg(long, value_name = "N")]
    pub steps: Option<u64>,
    /// Block architecture: mamba1 (the selective scan of Mamba) or mamba2
    /// (the SSD mixer of Mamba-2: heads of --head-dim channels, --n-groups,
    /// a chunked scan of --chunk-size tokens; state size --d-state, 128 by
    /// default). Mamba-2
    /// trains and evaluates with --device cpu only for now [default:
    /// mamba1; with --resume or --init-from, the checkpoint's config.json
    /// model_type, which the flag, if given, must equal].
    #[arg(long, value_enum)]
    pub arch: Option<CliArch>,
    /// Residual width [default: 64].
    #[arg(long, value_name = "N")]
    pub d_model: Option<usize>,
    /// Number of Mamba blocks [default: 2].
    #[arg(long, value_name = "N")]
    pub layers: Option<usize>,
    /// State size: per channel (Mamba-1) or per head (Mamba-2), config.json's
    /// d_state; --device cuda takes at most 128 for --arch mamba1 [default:
    /// 16; --arch mamba2: 128; with --resume or --init-from, the
    /// checkpoint's, which the flag, if given, must equal].
    #[arg(long, value_name = "N")]
    pub d_state: Option<usize>,
    /// --arch mamba2: channels per head; must divide the inner width 2 x
    /// --d-model [default: 64, at most 2 x --d-model].
    #[arg(long, value_name = "N")]
    pub head_dim: Option<usize>,
    /// --arch mamba2: groups of heads sharing one B and C; must divide the
    /// number of heads (2 x --d-model / --head-dim) [default: 1].
    #[arg(long, value_name = "N")]
    pub n_groups: Option<usize>,
    /// --arch mamba2: tokens per chunk of the SSD scan; it fixes the scan's
    /// summation order, so it is part of the run's identity [default: 256].
    #[arg(long, value_name = "N")]
    pub chunk_size: Option<usize>,
    /// Sequences per (logical) micro-batch [default: 16].
    #[arg(long, value_name = "N")]
    pub batch: Option<usize>,
    /// Tokens per sequence [default: 48; text: 128].
    #[arg(long, value_name = "N")]
    pub seq_len: Option<usize>,
    /// Selective copy: data tokens to remember per sequence [default: 8].
    #[arg(long, value_name = "N")]
    pub memorize: Option<usize>,
    /// Synthetic tasks: number of distinct data tokens [default: 8].
    #[arg(long, value_name = "N")]
    pub alphabet: Option<usize>,
    /// Peak learning rate [default: 0.01].
    #[arg(long, value_name = "LR")]
    pub lr: Option<f32>,
    /// Linear warmup steps [default: 50, at most a tenth of --steps].
    #[arg(long, value_name = "N")]
    pub warmup: Option<u64>,
    /// Final learning rate as a fraction of the peak, the cosine floor [default: 0.1].
    #[arg(long, value_name = "F")]
    pub min_lr_frac: Option<f32>,
    /// AdamW decoupled weight decay of matrices and the embedding [default: 0.1].
    #[arg(long, value_name = "F")]
    pub weight_decay: Option<f32>,
    /// Global gradient-norm clipping threshold, 0 disables [default: 1.0].
    #[arg(long, value_name = "F")]
    pub clip: Option<f32>,
    /// Master seed: weights and data derive from it [default: 0].
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// Run directory: metrics.jsonl, loss.svg, checkpoints/; one run at a
    /// time (locked while it trains) [default: runs/latest; with --resume,
    /// the run directory of the checkpoint].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Continue from a checkpoint: a run directory or a checkpoint
    /// directory. Without --out the run continues in the checkpoint's own
    /// run directory.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Start from the weights of a Hugging Face Mamba or Mamba-2
    /// checkpoint: a directory with config.json and model.safetensors (as
    /// transformers' save_pretrained writes them, or one of ours). The
    /// model's architecture, shape and vocabulary come from its config.json
    /// (--arch, --d-model, --layers and the Mamba-2 shape flags, if given,
    /// must agree); the task's tokens must fit its vocabulary. The
    /// optimizer starts fresh at step 0. Not with --resume.
    #[arg(long, value_name = "DIR")]
    pub init_from: Option<PathBuf>,
    /// Replace another run that --out holds (its checkpoints, metrics and
    /// plot; nothing else there). Without it a run refuses a directory
    /// holding another run's checkpoints or metrics.
    #[arg(long)]
    pub overwrite: bool,
    /// With --resume and a --steps N larger than the run's planned steps:
    /// continue past them. The cosine schedule's total becomes N, so from
    /// the resumed step on the learning rate, and the bits, follow the new
    /// schedule (not those of a run planned with N steps from the start).
    /// The checkpoint records the change.
    #[arg(long)]
    pub extend: bool,
    /// Also checkpoint every N steps (0: only at the end).
    #[arg(long, value_name = "N", default_value_t = super::defaults::CHECKPOINT_EVERY)]
    pub checkpoint_every: u64,
    /// Checkpoints kept in the run directory (the newest ones).
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub keep_checkpoints: usize,
    /// Stop (with a checkpoint) once this many steps are done, as if
    /// interrupted; continue later with --resume.
    #[arg(long, value_name = "STEP")]
    pub stop_at: Option<u64>,
    /// Where to run.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// Worker threads (default: all cores). The bits do not depend on it.
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Without a terminal, print a progress line every N steps (default:
    /// about 20 lines per run).
    #[arg(long, value_name = "N")]
    pub log_every: Option<u64>,
    /// Held-out batches for the final evaluation.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub eval_batches: usize,
    /// Processes (ranks): with --device cpu, CPU ranks on this machine
    /// linked by loopback sockets; with --device cuda, one GPU each. Without
    /// a launcher this program starts them itself; under torchrun, srun or
    /// mpirun the launcher's world is used (and must equal this if given)
    /// [default: 1, or the launcher's world].
    #[arg(long, value_name = "P")]
    pub world: Option<usize>,
    /// Logical world L: micro-batches of --batch rows per step, averaged in
    /// a fixed order; each process computes L/P of them, so P must divide
    /// L. At a fixed L the weights are the same bits for every P. Part of
    /// the run's identity [default: P; on --resume the checkpoint's].
    #[arg(long, value_name = "L")]
    pub logical_world: Option<usize>,
    /// Gradient reduction contract: fixed-order (bits independent of P,
    /// transport and topology), fixed-tree (the same guarantees with a
    /// pairwise tree, other bits; a power-of-two logical world; gradient
    /// memory log2(L/P)+1 arenas instead of L/P) or nccl-sum (the
    /// library's sum: fastest, bits may change with P or the machine)
    /// [default: fixed-order].
    #[arg(long, value_name = "CONTRACT", value_parser = parse_contract)]
    pub contract: Option<ReduceContract>,
    /// ZeRO-1: each of the P processes keeps and updates only its 1/P of
    /// the optimizer state (the AdamW moments); the updated weights are
    /// all-gathered. The same bits as without it, for every P and contract,
    /// and the same checkpoints (so a run resumes with or without it).
    #[arg(long)]
    pub shard_optimizer: bool,
    /// With --device cuda: keep one block's activations instead of every
    /// block's and recompute each block's forward pass during the backward
    /// (about a third more compute, the activation memory of one block):
    /// for sequences or batches that do not fit otherwise. The same bits
    /// as without it, so a run resumes with or without it.
    #[arg(long)]
    pub recompute: bool,
    /// With --device cuda: run every micro-batch's forward and backward
    /// pass eagerly, launch by launch, instead of replaying the CUDA graph
    /// captured from the second pass on (the default). The same bits
    /// either way; for comparison and diagnosis.
    #[arg(long)]
    pub no_cuda_graph: bool,
    /// With --device cuda and the fixed-order contract: reduce gradients
    /// inside the node without NCCL's transfers: every rank maps the
    /// others' gradient arenas (CUDA memory-pool IPC) and folds its shard
    /// of all of them in one kernel. The same bits as without it. Every
    /// rank on one node; not with --shard-optimizer.
    #[arg(long)]
    pub peer_fold: bool,
    /// Arithmetic of the GEMMs with --device cuda: f32 (the reference),
    /// tf32 (tensor cores, inputs rounded to TF32, f32 accumulation) or
    /// bf16 (GEMM operands rounded to bf16, f32 accumulation and output).
    /// Weights, gradients, AdamW, the scan state, norms, loss and every
    /// reduction stay f32 in all three, and each is deterministic (same bits
    /// run to run and for every P at a fixed L). Part of the run's identity:
    /// checkpoints record it and a resume cannot change it. The CPU model
    /// trains in f32 only [default: f32; on --resume the checkpoint's].
    #[arg(long, value_name = "PRECISION", value_parser = parse_precision)]
    pub precision: Option<Precision>,
    /// Compare every rank's weights digest every N steps (0: only at the
    /// start, before each checkpoint and at the end, which always happen).
    #[arg(long, value_name = "N", default_value_t = super::defaults::REPLICA_CHECK_EVERY)]
    pub replica_check_every: u64,
    /// Seconds a rank waits for its peers (meeting, each collective) before
    /// failing; must exceed the longest pause of one rank, e.g. rank 0
    /// writing a checkpoint.
    #[arg(long, value_name = "SECS", default_value_t = super::defaults::COMM_TIMEOUT_SECS)]
    pub comm_timeout: u64,
}

impl Cli {
    /// Parse `argv` (the program name first) as [`clap::Parser::parse`]
    /// does (help, version and usage errors print and exit), after
    /// expanding `train --config FILE` (see [`super::config_file`]). A later
    /// flag overrides an earlier one, which is how the command line
    /// overrides the file. A bad file prints its error and exits with 2.
    pub fn parse_with_config(argv: Vec<std::ffi::OsString>) -> Self {
        use clap::{CommandFactory, FromArgMatches};
        let argv = match super::config_file::expand(argv) {
            Ok(v) => v,
            Err(e) => {
                super::progress::stderr_line(&format!("error: {}", super::flags::user_message(&e)));
                std::process::exit(2);
            }
        };
        let matches = Cli::command()
            .args_override_self(true)
            .get_matches_from(argv);
        Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
    }
}

/// `mamba-train train-tokenizer` flags.
#[derive(Clone, Debug, Args)]
pub struct TrainTokenizerArgs {
    /// Most ids of the tokenizer (at least 257: the 256 bytes and
    /// <|endoftext|>, which is id 0).
    #[arg(long, value_name = "N")]
    pub vocab_size: usize,
    /// Where to write the tokenizer.json (replaced atomically).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Text files or directories (read recursively, in sorted path order).
    #[arg(value_name = "INPUT", required = true)]
    pub inputs: Vec<PathBuf>,
}

/// `mamba-train tokenize` flags.
#[derive(Clone, Debug, Args)]
pub struct TokenizeArgs {
    /// The Hugging Face tokenizer.json to encode with.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: PathBuf,
    /// Directory to write train.bin, val.bin, meta.json and a copy of the
    /// tokenizer into (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Share of the tokens held out in val.bin (the stream's tail).
    #[arg(long, value_name = "F", default_value_t = super::defaults::TOKENIZE_VAL_FRACTION)]
    pub val_fraction: f64,
    /// Width of the written tokens [default: u16 when the vocabulary fits, else u32].
    #[arg(long, value_name = "u16|u32", value_parser = parse_dtype)]
    pub token_dtype: Option<TokenDtype>,
    /// Replace the token files already in --out.
    #[arg(long)]
    pub overwrite: bool,
    /// Text files or directories (read recursively, in sorted path order),
    /// in the order given; each file is one document, followed by the
    /// tokenizer's end-of-text token if it has one.
    #[arg(value_name = "INPUT", required = true)]
    pub inputs: Vec<PathBuf>,
}

/// `--token-dtype` values.
fn parse_dtype(s: &str) -> Result<TokenDtype, String> {
    s.parse()
        .map_err(|e: crate::error::TrainError| e.to_string())
}

/// `--precision` values: the names [`Precision`] parses.
fn parse_precision(s: &str) -> Result<Precision, String> {
    s.parse()
}

/// `--contract` values: the names [`ReduceContract`] parses.
fn parse_contract(s: &str) -> Result<ReduceContract, String> {
    match s {
        "fixed-order" => Ok(ReduceContract::FixedOrder),
        "nccl-sum" => Ok(ReduceContract::NcclSum),
        "fixed-tree" => Ok(ReduceContract::FixedTree),
        other => Err(format!(
            "unknown contract {other:?}; expected fixed-order (default), fixed-tree or nccl-sum"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::super::defaults as d;
    use super::*;
    use crate::config::SsdConfig;
    use clap::CommandFactory;

    #[test]
    fn help_quotes_the_real_defaults() {
        let mut cmd = Cli::command();
        let train = cmd.find_subcommand_mut("train").unwrap();
        let help = |id: &str| -> String {
            let arg = train.get_arguments().find(|a| a.get_id() == id).unwrap();
            arg.get_help().unwrap().to_string()
        };
        let want = [
            ("steps", d::STEPS.to_string()),
            ("d_model", d::D_MODEL.to_string()),
            ("layers", d::LAYERS.to_string()),
            (
                "d_state",
                format!(
                    "{}; --arch mamba2: {}",
                    crate::ModelConfig::new(2, 2, 1).d_state,
                    crate::ModelConfig::mamba2(2, 2, 1).d_state
                ),
            ),
            ("batch", d::BATCH.to_string()),
            (
                "seq_len",
                format!("{}; text: {}", d::SEQ_LEN, d::TEXT_SEQ_LEN),
            ),
            ("memorize", d::MEMORIZE.to_string()),
            ("alphabet", d::ALPHABET.to_string()),
            ("lr", d::LR.to_string()),
            ("warmup", d::WARMUP.to_string()),
            ("min_lr_frac", d::MIN_LR_FRAC.to_string()),
            (
                "weight_decay",
                crate::optim::AdamWConfig::default()
                    .weight_decay
                    .to_string(),
            ),
            (
                "clip",
                format!("{:.1}", crate::optim::AdamWConfig::default().clip_norm),
            ),
            ("seed", d::SEED.to_string()),
            ("val_fraction", d::VAL_FRACTION.to_string()),
            ("arch", "mamba1".to_string()),
            (
                "head_dim",
                format!("{}, at most 2 x --d-model", SsdConfig::DEFAULT.head_dim),
            ),
            ("n_groups", SsdConfig::DEFAULT.n_groups.to_string()),
            ("chunk_size", SsdConfig::DEFAULT.chunk_size.to_string()),
        ];
        for (id, value) in want {
            let h = help(id);
            assert!(
                h.contains(&format!("[default: {value}")),
                "--{id} help {h:?} does not quote {value}"
            );
        }
        assert!(help("task").contains(d::TASK.name()));
        assert!(help("contract").contains("[default: fixed-order]"));
        let tokenize = cmd.find_subcommand_mut("tokenize").unwrap();
        let arg = tokenize
            .get_arguments()
            .find(|a| a.get_id() == "val_fraction")
            .unwrap();
        let default: Vec<_> = arg.get_default_values().iter().collect();
        assert_eq!(default, [&d::TOKENIZE_VAL_FRACTION.to_string()]);
    }

    #[test]
    fn world_flags_parse_and_bad_contracts_are_named() {
        let cli = Cli::try_parse_from([
            "mamba-train",
            "train",
            "--world",
            "2",
            "--logical-world",
            "4",
            "--contract",
            "nccl-sum",
        ])
        .unwrap();
        let Command::Train(a) = cli.command else {
            panic!("parsed as another command")
        };
        assert_eq!((a.world, a.logical_world), (Some(2), Some(4)));
        assert_eq!(a.contract, Some(ReduceContract::NcclSum));
        assert_eq!(a.replica_check_every, d::REPLICA_CHECK_EVERY);
        let e = Cli::try_parse_from(["mamba-train", "train", "--contract", "fast"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("fast") && e.contains("fixed-order"), "{e}");
        assert!(e.contains("fixed-tree"), "{e}");
        let cli =
            Cli::try_parse_from(["mamba-train", "train", "--contract", "fixed-tree"]).unwrap();
        let Command::Train(a) = cli.command else {
            panic!("not a train command")
        };
        assert_eq!(a.contract, Some(ReduceContract::FixedTree));
    }

    #[test]
    fn the_cuda_d_state_limit_is_mamba1_s_alone() {
        let check = |extra: &[&str]| {
            let mut argv = vec!["mamba-train", "train", "--device", "cuda"];
            argv.extend_from_slice(extra);
            let Ok(Command::Train(a)) = Cli::try_parse_from(argv).map(|c| c.command) else {
                panic!("not a train command: {extra:?}")
            };
            crate::cli::run::check_arch_device(&a).map_err(|e| e.to_string())
        };
        let most = kernels::mamba::MAX_D_STATE.to_string();
        let over = (kernels::mamba::MAX_D_STATE + 1).to_string();
        assert!(check(&["--d-state", &most]).is_ok());
        for refused in [
            vec!["--d-state", over.as_str()],
            vec!["--arch", "mamba1", "--d-state", over.as_str()],
        ] {
            let e = check(&refused).unwrap_err();
            assert!(
                e.contains(&format!("--d-state {over}")) && e.contains("--arch mamba2"),
                "{e}"
            );
        }
        assert!(check(&["--arch", "mamba2", "--d-state", "256"]).is_ok());
        // A checkpoint's architecture is not known here: the model decides.
        assert!(check(&["--resume", "runs/x", "--d-state", &over]).is_ok());
        // The CPU has no such limit.
        let a = match Cli::try_parse_from(["mamba-train", "train", "--d-state", "512"]) {
            Ok(Cli {
                command: Command::Train(a),
                ..
            }) => a,
            _ => panic!("not a train command"),
        };
        assert!(crate::cli::run::check_arch_device(&a).is_ok());
    }

    #[test]
    fn precision_parses_and_is_checked_against_the_device() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["mamba-train", "train"];
            argv.extend_from_slice(extra);
            match Cli::try_parse_from(argv).map(|c| c.command) {
                Ok(Command::Train(a)) => Ok(a),
                Ok(_) => panic!("not a train command"),
                Err(e) => Err(e.to_string()),
            }
        };
        assert_eq!(parse(&[]).unwrap().precision, None);
        for p in Precision::ALL {
            let a = parse(&["--device", "cuda", "--precision", p.name()]).unwrap();
            assert_eq!(a.precision, Some(p));
            assert!(crate::cli::run::check_cuda_only_flags(&a).is_ok());
        }
        let e = parse(&["--precision", "fp16"]).unwrap_err();
        assert!(
            e.contains("fp16") && e.contains("bf16") && e.contains("tf32"),
            "{e}"
        );
        // The CPU trains in f32 only: tf32 and bf16 are refused by name.
        for p in [Precision::Tf32, Precision::Bf16] {
            let a = parse(&["--precision", p.name()]).unwrap();
            let e = crate::cli::run::check_cuda_only_flags(&a)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("--precision {p}")) && e.contains("--device cuda"),
                "{e}"
            );
        }
        let a = parse(&["--precision", "f32"]).unwrap();
        assert!(crate::cli::run::check_cuda_only_flags(&a).is_ok());
        // --recompute too: a CUDA-only setting, refused by name on the CPU.
        let a = parse(&["--recompute"]).unwrap();
        let e = crate::cli::run::check_cuda_only_flags(&a)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--recompute") && e.contains("--device cuda"),
            "{e}"
        );
        let a = parse(&["--device", "cuda", "--recompute"]).unwrap();
        assert!(a.recompute && crate::cli::run::check_cuda_only_flags(&a).is_ok());
        assert!(!parse(&[]).unwrap().recompute);
        // --no-cuda-graph likewise.
        let e = crate::cli::run::check_cuda_only_flags(&parse(&["--no-cuda-graph"]).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--no-cuda-graph") && e.contains("--device cuda"),
            "{e}"
        );
        let a = parse(&["--device", "cuda", "--no-cuda-graph"]).unwrap();
        assert!(a.no_cuda_graph && crate::cli::run::check_cuda_only_flags(&a).is_ok());
        assert!(!parse(&[]).unwrap().no_cuda_graph);
        // --peer-fold: CUDA only, and not with the sharded optimizer.
        let flags = |v: &[&str]| {
            crate::cli::run::check_cuda_only_flags(&parse(v).unwrap()).map_err(|e| e.to_string())
        };
        let e = flags(&["--peer-fold"]).unwrap_err();
        assert!(e.contains("--peer-fold needs --device cuda"), "{e}");
        let e = flags(&["--device", "cuda", "--peer-fold", "--shard-optimizer"]).unwrap_err();
        assert!(e.contains("--peer-fold and --shard-optimizer"), "{e}");
        assert!(flags(&["--device", "cuda", "--peer-fold"]).is_ok());
        assert!(!parse(&[]).unwrap().peer_fold);
        // The whole command refuses it before anything starts.
        let a = parse(&["--precision", "bf16", "--steps", "1"]).unwrap();
        let e = crate::cli::run::train(&a, &mut Vec::new())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--precision bf16") && e.contains("--device cuda"),
            "{e}"
        );
    }
}

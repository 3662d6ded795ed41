//! From flags (and, on resume, the checkpoint's recorded run) to a
//! [`RunConfig`].
//!
//! Precedence per setting: an explicit flag, else the checkpoint's value
//! (on `--resume`), else the default. The caller then compares the result
//! with the checkpoint, so an explicit flag that disagrees is an error that
//! names the setting rather than a silently different run.

use std::path::Path;
use std::sync::Arc;

use super::arch;
use super::args::TrainArgs;
use super::defaults as d;
use super::resolve_data::{check_data_flags, resolve_text, resolve_tokens};
use crate::checkpoint;
use crate::config::ModelConfig;
use crate::data::{Corpus, InductionConfig, SelectiveCopyConfig, TaskKind, TaskSpec};
use crate::error::{Result, TrainError};
use crate::optim::{AdamWConfig, Schedule};
use crate::train::{RunConfig, DEFAULT_CONTRACT};
use mamba_reduce::ReduceContract;

/// A resolved run, plus the corpus when its files were read to build it.
pub struct Resolved {
    /// The run.
    pub run: RunConfig,
    /// The text or token corpus, when `--data` was read here.
    pub corpus: Option<Arc<Corpus>>,
}

fn pick<T>(flag: Option<T>, recorded: Option<T>, default: T) -> T {
    flag.or(recorded).unwrap_or(default)
}

/// Resolve the run of `args` for a single process (`--world`, default 1),
/// given the recorded run of a checkpoint when resuming.
pub fn resolve_run(args: &TrainArgs, recorded: Option<&RunConfig>) -> Result<Resolved> {
    resolve_run_in(args, recorded, args.world.unwrap_or(1), None)
}

/// The logical world L of a run in a world of `world` processes: the flag,
/// else `MAMBA_LOGICAL_WORLD` (`env_logical`), else the checkpoint's, else
/// `world`. The world must divide it; the error names where L came from.
pub fn logical_world(
    args: &TrainArgs,
    recorded: Option<&RunConfig>,
    world: usize,
    env_logical: Option<usize>,
) -> Result<usize> {
    if world == 0 {
        return Err(TrainError::Config(
            "--world must be at least 1 process, got 0".into(),
        ));
    }
    let (l, source) = match (args.logical_world, env_logical, recorded) {
        (Some(l), _, _) => (l, "--logical-world"),
        (None, Some(l), _) => (l, "MAMBA_LOGICAL_WORLD"),
        (None, None, Some(r)) => (r.logical_world, "the checkpoint's logical world"),
        (None, None, None) => (world, "the default, the world size"),
    };
    if l == 0 {
        return Err(TrainError::Config(format!(
            "the logical world must be at least 1, got 0 ({source})"
        )));
    }
    if l % world != 0 {
        let divisors: Vec<String> = (1..=l)
            .filter(|d| l % d == 0)
            .map(|d| d.to_string())
            .collect();
        return Err(TrainError::Config(format!(
            "a world of {world} processes does not divide the logical world {l} ({source}); \
             each process computes L/P of the step's L micro-batches, so P must divide L: \
             use a world of {} processes, or a logical world that is a multiple of {world} \
             (a new run: L is part of a run's identity)",
            divisors.join(", ")
        )));
    }
    Ok(l)
}

/// `--contract fixed-tree` needs a power-of-two logical world (the complete
/// binary tree over the L micro-batches); refuse another L naming both
/// flags and the nearest values that work.
fn check_tree_world(contract: ReduceContract, logical: usize) -> Result<()> {
    if contract != ReduceContract::FixedTree || logical.is_power_of_two() {
        return Ok(());
    }
    let below = 1usize << logical.max(1).ilog2();
    Err(TrainError::Config(format!(
        "--contract fixed-tree needs a logical world that is a power of two (the complete \
         binary tree over the step's L micro-batches), but the logical world is {logical} \
         (--logical-world, or the world size when it is not given); use --logical-world \
         {below} or {}, or --contract fixed-order, which takes any logical world",
        2 * below
    )))
}

/// Resolve the run of `args` in a world of `world` processes (`env_logical`:
/// `MAMBA_LOGICAL_WORLD`), given the recorded run of a checkpoint when
/// resuming.
pub fn resolve_run_in(
    args: &TrainArgs,
    recorded: Option<&RunConfig>,
    world: usize,
    env_logical: Option<usize>,
) -> Result<Resolved> {
    let logical = logical_world(args, recorded, world, env_logical)?;
    let kind: TaskKind = pick(
        args.task.map(Into::into),
        recorded.map(|r| r.task.kind()),
        d::TASK,
    );
    // The recorded task, only when it is the same kind (otherwise its shape
    // does not apply; the kind mismatch is reported by the comparison).
    let same = recorded.map(|r| &r.task).filter(|t| t.kind() == kind);
    check_data_flags(args, kind)?;
    let mut corpus = None;
    let task = match kind {
        TaskKind::SelectiveCopy => {
            let rec = match same {
                Some(TaskSpec::SelectiveCopy(c)) => Some(c),
                _ => None,
            };
            TaskSpec::SelectiveCopy(SelectiveCopyConfig {
                seq_len: pick(args.seq_len, rec.map(|c| c.seq_len), d::SEQ_LEN),
                n_memorize: pick(args.memorize, rec.map(|c| c.n_memorize), d::MEMORIZE),
                alphabet: pick(args.alphabet, rec.map(|c| c.alphabet), d::ALPHABET),
            })
        }
        TaskKind::Induction => {
            if args.memorize.is_some() {
                return Err(TrainError::Config(
                    "--memorize is only used by --task selective-copy".into(),
                ));
            }
            let rec = match same {
                Some(TaskSpec::Induction(c)) => Some(c),
                _ => None,
            };
            TaskSpec::Induction(InductionConfig {
                seq_len: pick(args.seq_len, rec.map(|c| c.seq_len), d::SEQ_LEN),
                alphabet: pick(args.alphabet, rec.map(|c| c.alphabet), d::ALPHABET),
            })
        }
        TaskKind::Text => {
            let rec = match same {
                Some(TaskSpec::Text(c)) => Some(c),
                _ => None,
            };
            let (task, loaded) = resolve_text(args, rec)?;
            corpus = loaded;
            task
        }
        TaskKind::Tokens => {
            let rec = match same {
                Some(TaskSpec::Tokens(c)) => Some(c),
                _ => None,
            };
            let (task, loaded) = resolve_tokens(args, rec)?;
            corpus = loaded;
            task
        }
    };

    let rm = recorded.map(|r| &r.model);
    let d_model = pick(args.d_model, rm.map(|m| m.d_model), d::D_MODEL);
    let layers = pick(args.layers, rm.map(|m| m.n_layer), d::LAYERS);
    // The vocabulary: fixed by a synthetic or byte-level task; for a
    // tokenized one the flag, else the checkpoint's, else the tokenizer's
    // rounded up (`TaskSpec::vocab_size`). `RunConfig::validate` refuses one
    // smaller than the tokenizer's.
    let vocab = match (args.vocab_size, task.vocab_is_open()) {
        (Some(_), false) => {
            return Err(TrainError::Config(format!(
                "--vocab-size is for tokenized runs (--tokenizer, or --task tokens); the {kind} \
                 task's vocabulary is fixed at {}",
                task.vocab_size()
            )))
        }
        (Some(v), true) => v,
        (None, true) => rm
            .filter(|_| same.is_some())
            .map_or(task.vocab_size(), |m| m.vocab_size),
        (None, false) => task.vocab_size(),
    };
    if let Some(m) = rm {
        arch::check_against(
            args,
            m,
            "the checkpoint being resumed",
            "a resumed run keeps its checkpoint's architecture and shape",
        )?;
    }
    let model = match (&args.init_from, rm) {
        (Some(dir), _) => pretrained_model(args, dir, &task)?,
        // Keep the recorded shape's other fields when the flags agree, so a
        // checkpoint with non-default d_state (or a pretrained model's
        // larger vocabulary) resumes.
        (None, Some(m))
            if m.d_model == d_model
                && m.n_layer == layers
                && args.d_state.is_none_or(|n| n == m.d_state)
                && (m.vocab_size == vocab || (!task.vocab_is_open() && m.vocab_size > vocab)) =>
        {
            m.clone()
        }
        _ => arch::fresh_model(args, rm, vocab, d_model, layers)?,
    };

    let steps = pick(
        args.steps,
        recorded.map(|r| r.schedule.total_steps),
        d::STEPS,
    );
    let rs = recorded.map(|r| &r.schedule);
    let schedule = Schedule {
        peak_lr: pick(args.lr, rs.map(|s| s.peak_lr), d::LR),
        warmup_steps: pick(
            args.warmup,
            rs.map(|s| s.warmup_steps),
            d::WARMUP.min(steps / 10),
        ),
        total_steps: steps,
        min_lr_frac: pick(args.min_lr_frac, rs.map(|s| s.min_lr_frac), d::MIN_LR_FRAC),
    };
    let ro = recorded.map(|r| r.optimizer).unwrap_or_default();
    let optimizer = AdamWConfig {
        weight_decay: args.weight_decay.unwrap_or(ro.weight_decay),
        clip_norm: args.clip.unwrap_or(ro.clip_norm),
        ..ro
    };
    let contract = pick(
        args.contract,
        recorded.map(|r| r.contract),
        DEFAULT_CONTRACT,
    );
    check_tree_world(contract, logical)?;
    let run = RunConfig {
        seed: pick(args.seed, recorded.map(|r| r.seed), d::SEED),
        model,
        task,
        batch: pick(args.batch, recorded.map(|r| r.batch), d::BATCH),
        logical_world: logical,
        contract,
        optimizer,
        schedule,
    };
    run.validate()?;
    Ok(Resolved { run, corpus })
}

/// The model of `--init-from dir`: its `config.json`'s shape, which the
/// shape flags (if given) must equal, with room for the task's tokens.
fn pretrained_model(args: &TrainArgs, given: &Path, task: &TaskSpec) -> Result<ModelConfig> {
    let dir = checkpoint::hf_model_dir(given)?;
    let m = checkpoint::load_hf_config(&dir)?;
    let shown = given.display();
    // A tokenizer shipped with the model must be the one the data uses.
    let shipped = dir.join(checkpoint::TOKENIZER_FILE);
    if let (Some(rec), true) = (task.tokenizer(), shipped.is_file()) {
        let theirs = crate::data::Codec::from_file(&shipped)?;
        let sha = theirs
            .record()
            .map(|r| r.sha256.clone())
            .unwrap_or_default();
        if sha != rec.sha256 {
            return Err(TrainError::Config(format!(
                "--init-from {shown}: the model was trained with another tokenizer ({}, sha256 \
                 {sha}) than the data's ({}, sha256 {}); tokenize the data with the model's \
                 tokenizer (--tokenizer {})",
                shipped.display(),
                rec.path.display(),
                rec.sha256,
                shipped.display()
            )));
        }
    }
    let source = format!("--init-from {shown}");
    let keep = "a pretrained model's architecture and shape come from its config.json";
    for (flag, given, theirs) in [
        ("--d-model", args.d_model, m.d_model),
        ("--layers", args.layers, m.n_layer),
        ("--d-state", args.d_state, m.d_state),
        ("--vocab-size", args.vocab_size, m.vocab_size),
    ] {
        arch::check_given(flag, given, theirs, &source, keep)?;
    }
    arch::check_against(args, &m, &source, keep)?;
    let need = task.token_vocab();
    if m.vocab_size < need {
        return Err(TrainError::Config(format!(
            "--init-from {shown}: the model's vocabulary has {} tokens, but the {} task uses {need}; \
             fine-tune it on data whose token ids are below {} (e.g. text encoded with the \
             model's own tokenizer)",
            m.vocab_size,
            task.kind(),
            m.vocab_size
        )));
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::args::CliTask;

    #[test]
    fn defaults_then_flags() {
        let r = resolve_run(&TrainArgs::default(), None).unwrap().run;
        assert_eq!(r.task.kind(), TaskKind::SelectiveCopy);
        assert_eq!(r.model.d_model, d::D_MODEL);
        assert_eq!(r.model.vocab_size, d::ALPHABET + 2);
        assert_eq!(r.schedule.total_steps, d::STEPS);
        let args = TrainArgs {
            task: Some(CliTask::Induction),
            d_model: Some(24),
            steps: Some(10),
            ..TrainArgs::default()
        };
        let r = resolve_run(&args, None).unwrap().run;
        assert_eq!(r.model.d_model, 24);
        assert_eq!(r.model.dt_rank, 2);
        assert_eq!(
            r.schedule.warmup_steps, 1,
            "warmup capped at a tenth of the run"
        );
        assert_eq!(r.model.vocab_size, d::ALPHABET + 1);
    }

    #[test]
    fn d_state_comes_from_the_flag_else_the_record_else_the_architecture() {
        use crate::cli::args::CliArch;
        let d_state = |args: &TrainArgs, rec: Option<&RunConfig>| {
            resolve_run(args, rec).unwrap().run.model.d_state
        };
        assert_eq!(d_state(&TrainArgs::default(), None), 16);
        let m2 = TrainArgs {
            arch: Some(CliArch::Mamba2),
            d_model: Some(16),
            head_dim: Some(8),
            ..TrainArgs::default()
        };
        assert_eq!(d_state(&m2, None), 128);
        let small = TrainArgs {
            d_state: Some(4),
            ..TrainArgs::default()
        };
        assert_eq!(d_state(&small, None), 4);
        let m2_small = TrainArgs {
            d_state: Some(8),
            ..m2.clone()
        };
        assert_eq!(d_state(&m2_small, None), 8);
        // A resumed run keeps the recorded state size without the flag,
        // also when another shape flag makes it a fresh shape to compare.
        let rec = resolve_run(&small, None).unwrap().run;
        assert_eq!(d_state(&TrainArgs::default(), Some(&rec)), 4);
        let wider = TrainArgs {
            d_model: Some(24),
            ..TrainArgs::default()
        };
        assert_eq!(d_state(&wider, Some(&rec)), 4);
        let other = TrainArgs {
            d_state: Some(2),
            ..TrainArgs::default()
        };
        assert_eq!(
            d_state(&other, Some(&rec)),
            2,
            "the flag is what gets compared"
        );
        let zero = TrainArgs {
            d_state: Some(0),
            ..TrainArgs::default()
        };
        let Err(err) = resolve_run(&zero, None) else {
            panic!("--d-state 0 was accepted");
        };
        let e = crate::cli::flags::user_message(&err);
        assert!(e.contains("--d-state must be at least 1"), "{e}");
    }

    #[test]
    fn resume_takes_the_recorded_run_and_flags_override_it() {
        let args = TrainArgs {
            d_model: Some(24),
            seed: Some(9),
            lr: Some(1e-2),
            ..TrainArgs::default()
        };
        let rec = resolve_run(&args, None).unwrap().run;
        let back = resolve_run(&TrainArgs::default(), Some(&rec)).unwrap().run;
        assert_eq!(back, rec, "no flags: the recorded run");
        let other = resolve_run(
            &TrainArgs {
                batch: Some(3),
                ..TrainArgs::default()
            },
            Some(&rec),
        )
        .unwrap()
        .run;
        let e = other.mismatches(&rec).unwrap_err();
        assert!(e.contains("batch: checkpoint 16, requested 3"), "{e}");
    }

    #[test]
    fn logical_world_precedence_and_divisibility() {
        let rec = resolve_run(
            &TrainArgs {
                logical_world: Some(4),
                steps: Some(3),
                ..TrainArgs::default()
            },
            None,
        )
        .unwrap()
        .run;
        assert_eq!(rec.logical_world, 4);
        let none = TrainArgs::default();
        let l = |args: &TrainArgs, rec: Option<&RunConfig>, p: usize, env: Option<usize>| {
            logical_world(args, rec, p, env)
        };
        assert_eq!(l(&none, None, 4, None).unwrap(), 4, "default: P");
        assert_eq!(l(&none, Some(&rec), 2, None).unwrap(), 4, "checkpoint");
        assert_eq!(
            l(&none, Some(&rec), 2, Some(8)).unwrap(),
            8,
            "env over checkpoint"
        );
        let flag = TrainArgs {
            logical_world: Some(6),
            ..TrainArgs::default()
        };
        assert_eq!(l(&flag, Some(&rec), 3, Some(8)).unwrap(), 6, "flag first");
        let e = l(&none, Some(&rec), 3, None).unwrap_err().to_string();
        assert!(
            e.contains("3 processes does not divide the logical world 4")
                && e.contains("checkpoint")
                && e.contains("1, 2, 4"),
            "{e}"
        );
        let e = l(&flag, None, 4, None).unwrap_err().to_string();
        assert!(e.contains("--logical-world"), "{e}");
        assert!(l(&none, None, 0, None)
            .unwrap_err()
            .to_string()
            .contains("--world"));
        let zero = TrainArgs {
            logical_world: Some(0),
            ..TrainArgs::default()
        };
        assert!(l(&zero, None, 1, None)
            .unwrap_err()
            .to_string()
            .contains("at least 1"));
        // The contract: flag, else the checkpoint's, else fixed-order.
        let nccl = TrainArgs {
            contract: Some(mamba_reduce::ReduceContract::NcclSum),
            ..TrainArgs::default()
        };
        let r = resolve_run(&nccl, None).unwrap().run;
        assert_eq!(r.contract, mamba_reduce::ReduceContract::NcclSum);
        let back = resolve_run(&none, Some(&r)).unwrap().run;
        assert_eq!(back.contract, mamba_reduce::ReduceContract::NcclSum);
        assert_eq!(
            resolve_run(&none, None).unwrap().run.contract,
            DEFAULT_CONTRACT
        );
        // The tree takes power-of-two logical worlds only, named by flag.
        let tree = |l: usize| TrainArgs {
            contract: Some(ReduceContract::FixedTree),
            logical_world: Some(l),
            ..TrainArgs::default()
        };
        assert_eq!(
            resolve_run(&tree(8), None).unwrap().run.contract,
            ReduceContract::FixedTree
        );
        let e = resolve_run_in(&tree(6), None, 3, None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("--contract fixed-tree")
                && e.contains("logical world is 6")
                && e.contains("--logical-world 4 or 8"),
            "{e}"
        );
    }

    #[test]
    fn bad_combinations_are_named() {
        let e = resolve_run(
            &TrainArgs {
                task: Some(CliTask::Text),
                ..TrainArgs::default()
            },
            None,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("--data"), "{e}");
        let e = resolve_run(
            &TrainArgs {
                data: Some("x".into()),
                ..TrainArgs::default()
            },
            None,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("only used by --task text"), "{e}");
        let e = resolve_run(
            &TrainArgs {
                batch: Some(0),
                ..TrainArgs::default()
            },
            None,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("batch must be at least 1"), "{e}");
    }
}

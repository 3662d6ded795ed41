//! The engine driving the real CPU Mamba: the one-process loop against the
//! contract's definition, thread-count invariance, and checkpoint resume,
//! bit for bit.

mod common;

use mamba_train::checkpoint;
use mamba_train::config::ModelConfig;
use mamba_train::data::{Dataset, SelectiveCopyConfig, TaskSpec};
use mamba_train::dp::{self, DpOptions};
use mamba_train::model::cpu::CpuModel;
use mamba_train::optim::{AdamWConfig, Schedule};
use mamba_train::train::{RunConfig, Trainer, DEFAULT_CONTRACT};

fn run(steps: u64, logical_world: usize) -> RunConfig {
    let task = TaskSpec::SelectiveCopy(SelectiveCopyConfig {
        seq_len: 12,
        n_memorize: 3,
        alphabet: 4,
    });
    RunConfig {
        seed: 5,
        model: ModelConfig::new(task.vocab_size(), 16, 2),
        task,
        batch: 3,
        logical_world,
        contract: DEFAULT_CONTRACT,
        optimizer: AdamWConfig::default(),
        schedule: Schedule {
            peak_lr: 1e-2,
            warmup_steps: 2,
            total_steps: steps,
            min_lr_frac: 0.1,
        },
    }
}

fn trainer(r: &RunConfig) -> Trainer<CpuModel> {
    Trainer::new(CpuModel::new(r.model.clone()).unwrap(), r.clone()).unwrap()
}

/// Train to the end in a one-process world (the library's loop).
fn finish(t: Trainer<CpuModel>) -> Trainer<CpuModel> {
    steps(t, u64::MAX)
}

/// At most `n` steps in a one-process world.
fn steps(t: Trainer<CpuModel>, n: u64) -> Trainer<CpuModel> {
    let mut w = dp::host::local(t, DpOptions::default()).unwrap();
    for _ in 0..n {
        if w.finished() {
            break;
        }
        w.step().unwrap();
    }
    w.into_parts().0
}

#[test]
fn the_local_loop_equals_the_contract_definition() {
    for l in [1usize, 2] {
        let r = run(4, l);
        let mut world = finish(trainer(&r));
        let mut reference = trainer(&r);
        common::train_by_definition(&mut reference);
        assert_eq!(
            world.weights_digest().unwrap(),
            reference.weights_digest().unwrap(),
            "L = {l}"
        );
        assert_eq!(world.optimizer(), reference.optimizer(), "L = {l}");
        assert_eq!(world.skipped_steps(), 0);
    }
}

#[test]
fn whole_training_is_the_same_bits_on_one_or_four_threads() {
    let digest = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| finish(trainer(&run(3, 1))).weights_digest().unwrap())
    };
    assert_eq!(digest(1), digest(4));
}

#[test]
fn resume_matches_the_unbroken_run_and_fresh_moments_do_not() {
    let dir = tempfile::tempdir().unwrap();
    let r = run(6, 1);
    let mut unbroken = finish(trainer(&r));

    let mut first = steps(trainer(&r), 2);
    first.save_checkpoint(dir.path(), 2).unwrap();
    drop(first);

    let ck = checkpoint::load(dir.path()).unwrap();
    let data = Dataset::new(r.task.clone(), r.batch).unwrap();
    let model = || CpuModel::new(r.model.clone()).unwrap();
    let resumed = Trainer::resume(model(), r.clone(), data.clone(), ck.clone()).unwrap();
    let mut resumed = finish(resumed);
    let want = unbroken.weights_digest().unwrap();
    assert_eq!(resumed.weights_digest().unwrap(), want);

    let weights_only = Trainer::resume_weights_only(model(), r.clone(), data, ck).unwrap();
    assert_ne!(finish(weights_only).weights_digest().unwrap(), want);
}

#[test]
fn the_model_learns_a_little_in_a_few_steps() {
    let mut t = trainer(&run(30, 1));
    let before = t.evaluate(2, 16).unwrap().loss;
    let mut t = finish(t);
    let after = t.evaluate(2, 16).unwrap().loss;
    assert!(after < before, "held-out loss {before} -> {after}");
}

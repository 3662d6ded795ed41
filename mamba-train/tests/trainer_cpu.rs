//! The trainer driving the real CPU Mamba: the backward / reduce / step seam,
//! thread-count invariance, and checkpoint resume, bit for bit.

use mamba_train::checkpoint;
use mamba_train::config::ModelConfig;
use mamba_train::data::{Dataset, SelectiveCopyConfig, TaskSpec};
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

fn finish(t: &mut Trainer<CpuModel>) {
    while !t.finished() {
        t.train_step().unwrap();
    }
}

#[test]
fn separate_backward_reduce_and_step_equal_the_fused_step() {
    for l in [1usize, 2] {
        let r = run(4, l);
        let mut fused = trainer(&r);
        let mut split = trainer(&r);
        let n = split.params().len();
        for _ in 0..4 {
            fused.train_step().unwrap();
            // The reducer's view: one arena per logical micro-batch, folded in
            // ascending order, then scaled by 1/L.
            let mut locals = vec![vec![0.0f32; n]; l];
            let mut loss = 0.0f32;
            for (micro, g) in locals.iter_mut().enumerate() {
                loss += split.micro_gradient(micro as u64, g).unwrap();
            }
            let (first, rest) = locals.split_first_mut().unwrap();
            for g in rest.iter() {
                first.iter_mut().zip(g).for_each(|(a, b)| *a += *b);
            }
            if l > 1 {
                let inv = 1.0 / l as f32;
                first.iter_mut().for_each(|a| *a *= inv);
                loss *= inv;
            }
            let s = split.apply_external(first, loss).unwrap();
            assert!(!s.skipped && s.loss.is_finite());
        }
        assert_eq!(fused.weights_digest(), split.weights_digest(), "L = {l}");
        assert_eq!(fused.optimizer(), split.optimizer(), "L = {l}");
    }
}

#[test]
fn whole_training_is_the_same_bits_on_one_or_four_threads() {
    let digest = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| {
                let mut t = trainer(&run(3, 1));
                finish(&mut t);
                t.weights_digest()
            })
    };
    assert_eq!(digest(1), digest(4));
}

#[test]
fn resume_matches_the_unbroken_run_and_fresh_moments_do_not() {
    let dir = tempfile::tempdir().unwrap();
    let r = run(6, 1);
    let mut unbroken = trainer(&r);
    finish(&mut unbroken);

    let mut first = trainer(&r);
    for _ in 0..2 {
        first.train_step().unwrap();
    }
    first.save_checkpoint(dir.path(), 2).unwrap();
    drop(first);

    let ck = checkpoint::load(dir.path()).unwrap();
    let data = Dataset::new(r.task.clone(), r.batch).unwrap();
    let model = || CpuModel::new(r.model.clone()).unwrap();
    let mut resumed = Trainer::resume(model(), r.clone(), data.clone(), ck.clone()).unwrap();
    finish(&mut resumed);
    assert_eq!(resumed.weights_digest(), unbroken.weights_digest());

    let mut weights_only = Trainer::resume_weights_only(model(), r.clone(), data, ck).unwrap();
    finish(&mut weights_only);
    assert_ne!(weights_only.weights_digest(), unbroken.weights_digest());
}

#[test]
fn the_model_learns_a_little_in_a_few_steps() {
    let mut t = trainer(&run(30, 1));
    let before = t.evaluate(2, 16).unwrap().loss;
    finish(&mut t);
    let after = t.evaluate(2, 16).unwrap().loss;
    assert!(after < before, "held-out loss {before} -> {after}");
}

//! Training: the run's identity ([`RunConfig`]), the model interface the
//! loop drives ([`TrainModel`]), and the loop itself ([`Trainer`]).

pub mod model;
pub mod run_config;
pub mod trainer;

#[cfg(test)]
pub(crate) mod testutil;

pub use model::TrainModel;
pub use run_config::{RunConfig, CONTRACTS, DEFAULT_CONTRACT};
pub use trainer::{evaluate_with, run_state, EvalReport, StepStats, Trainer};

#[cfg(test)]
mod tests {
    use super::testutil::{toy_model, toy_run, ToyModel};
    use super::*;
    use crate::checkpoint;
    use crate::data::Dataset;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn trainer(run: RunConfig) -> Trainer<ToyModel> {
        Trainer::new(toy_model(&run), run).unwrap()
    }

    #[test]
    fn split_backward_reduce_step_equals_the_fused_step() {
        for l in [1usize, 3] {
            let mut run = toy_run(6);
            run.logical_world = l;
            let mut fused = trainer(run.clone());
            let mut split = trainer(run.clone());
            let n = split.params().len();
            for _ in 0..6 {
                fused.train_step().unwrap();
                // What a reducer sees: each logical micro-batch's gradient in
                // its own buffer; it folds them in ascending order and scales.
                let mut locals: Vec<Vec<f32>> = vec![vec![0.0; n]; l];
                let mut loss = 0.0f32;
                for (micro, g) in locals.iter_mut().enumerate() {
                    loss += split.micro_gradient(micro as u64, g).unwrap();
                }
                let mut mean = locals[0].clone();
                for g in &locals[1..] {
                    for (a, b) in mean.iter_mut().zip(g) {
                        *a += *b;
                    }
                }
                if l > 1 {
                    let inv = 1.0 / l as f32;
                    mean.iter_mut().for_each(|a| *a *= inv);
                    loss *= inv;
                }
                split.apply_external(&mean, loss).unwrap();
            }
            assert_eq!(bits(fused.params()), bits(split.params()), "L = {l}");
            assert_eq!(fused.optimizer(), split.optimizer(), "L = {l}");
            assert_eq!(fused.step(), 6);
        }
    }

    #[test]
    fn backward_then_apply_is_train_step_and_moves_the_weights() {
        let mut a = trainer(toy_run(4));
        let mut b = trainer(toy_run(4));
        let p0 = a.params().to_vec();
        for _ in 0..4 {
            a.train_step().unwrap();
            let loss = b.backward().unwrap();
            b.apply(loss).unwrap();
        }
        assert_eq!(bits(a.params()), bits(b.params()));
        assert_ne!(
            bits(a.params()),
            bits(&p0),
            "training must move the weights"
        );
        assert!(a.finished());
    }

    #[test]
    fn the_logical_world_changes_the_run() {
        // Negative control for the fold: L = 2 draws and averages two
        // micro-batches per step, so it must not equal L = 1.
        let mut one = trainer(toy_run(3));
        let mut run2 = toy_run(3);
        run2.logical_world = 2;
        let mut two = trainer(run2);
        for _ in 0..3 {
            one.train_step().unwrap();
            two.train_step().unwrap();
        }
        assert_ne!(one.weights_digest(), two.weights_digest());
    }

    #[test]
    fn same_bits_with_one_or_four_threads() {
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let mut t = trainer(toy_run(5));
                while !t.finished() {
                    t.train_step().unwrap();
                }
                t.weights_digest()
            })
        };
        assert_eq!(run(1), run(4));
    }

    #[test]
    fn resume_lands_on_the_unbroken_bits_and_weights_only_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let run = toy_run(8);
        let mut unbroken = trainer(run.clone());
        while !unbroken.finished() {
            unbroken.train_step().unwrap();
        }

        let mut first = trainer(run.clone());
        for _ in 0..3 {
            first.train_step().unwrap();
        }
        let saved = first.save_checkpoint(dir.path(), 2).unwrap();
        drop(first);

        let ck = checkpoint::load(dir.path()).unwrap();
        assert_eq!(ck.dir, saved);
        assert_eq!(ck.state.step, 3);
        let data = Dataset::new(run.task.clone(), run.batch).unwrap();
        let mut resumed =
            Trainer::resume(toy_model(&run), run.clone(), data.clone(), ck.clone()).unwrap();
        while !resumed.finished() {
            resumed.train_step().unwrap();
        }
        assert_eq!(resumed.weights_digest(), unbroken.weights_digest());
        assert_eq!(resumed.optimizer(), unbroken.optimizer());

        let mut weights_only =
            Trainer::resume_weights_only(toy_model(&run), run.clone(), data, ck).unwrap();
        while !weights_only.finished() {
            weights_only.train_step().unwrap();
        }
        assert_ne!(
            weights_only.weights_digest(),
            unbroken.weights_digest(),
            "fresh moments must differ"
        );
    }

    #[test]
    fn resume_refuses_another_run_naming_the_setting() {
        let dir = tempfile::tempdir().unwrap();
        let run = toy_run(4);
        let mut t = trainer(run.clone());
        t.train_step().unwrap();
        t.save_checkpoint(dir.path(), 2).unwrap();
        let ck = checkpoint::load(dir.path()).unwrap();
        let mut other = run.clone();
        other.batch = 5;
        other.seed = 7;
        let data = Dataset::new(other.task.clone(), other.batch).unwrap();
        let e = Trainer::resume(toy_model(&other), other, data, ck)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("batch: checkpoint 4, requested 5"), "{e}");
        assert!(e.contains("seed: checkpoint 42, requested 7"), "{e}");
    }

    #[test]
    fn non_finite_loss_skips_and_counts() {
        let mut t = trainer(toy_run(4));
        let before = t.params().to_vec();
        let loss = t.backward().unwrap();
        assert!(loss.is_finite());
        let s = t.apply(f32::NAN).unwrap();
        assert!(s.skipped);
        assert_eq!((s.step, s.skipped_total, t.skipped_steps()), (1, 1, 1));
        assert_eq!(bits(t.params()), bits(&before));
        assert_eq!(t.optimizer().adamw().updates(), 0);
        let s = t.train_step().unwrap();
        assert!(!s.skipped);
        assert_eq!(t.run_state().optimizer_updates, 1);
        assert_eq!(t.run_state().step, 2);
        // A world's verdict skips even a finite local loss.
        let loss = t.backward().unwrap();
        let g = t.grads().to_vec();
        let before = t.params().to_vec();
        assert!(t.apply_with_verdict(&g, loss, false).unwrap().skipped);
        assert_eq!(bits(t.params()), bits(&before));
        assert_eq!((t.step(), t.skipped_steps()), (3, 2));
    }

    #[test]
    fn evaluation_scores_answer_positions_only() {
        let mut t = trainer(toy_run(1));
        let r = t.evaluate(2, 5).unwrap();
        // selective copy with 3 answers per row: 2 batches x 5 rows x 3.
        assert_eq!(r.accuracy.total, 30);
        assert!(r.loss > 0.0 && r.loss.is_finite());
        assert_eq!(r.chance, 1.0 / 5.0);
    }
}

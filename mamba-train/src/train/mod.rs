//! Training: the engine ([`Trainer`]) over what it asks of a device
//! ([`Backend`], and [`HostModel`] for models over host arenas, both defined
//! with the models in [`crate::model`]), and the run's identity
//! ([`RunConfig`], [`crate::run_config`]), re-exported here.

pub mod trainer;

#[cfg(test)]
pub(crate) mod testutil;

pub use crate::model::{Backend, HostModel};
pub use crate::run_config::{RunConfig, CONTRACTS, DEFAULT_CONTRACT};
pub use trainer::{evaluate_with, run_state, EvalReport, StepStats, Trainer};

#[cfg(test)]
mod tests {
    use super::testutil::{run_steps, toy_model, toy_run, ToyModel};
    use super::*;
    use crate::checkpoint;
    use crate::data::Dataset;
    use crate::dp::{host, DataParallel, DpOptions};
    use crate::optim::{HostMath, Optimizer};
    use mamba_reduce::{host_fold, mean_factor, HostReducer};

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn trainer(run: RunConfig) -> Trainer<ToyModel> {
        Trainer::new(toy_model(&run), run).unwrap()
    }

    /// `t` as a one-process world.
    fn local(t: Trainer<ToyModel>) -> DataParallel<ToyModel, HostReducer> {
        host::local(t, DpOptions::default()).unwrap()
    }

    /// Train `t` to the end of its schedule in a one-process world.
    fn finish(t: Trainer<ToyModel>) -> Trainer<ToyModel> {
        run_steps(t, u64::MAX)
    }

    #[test]
    fn a_local_step_is_the_fold_of_the_micro_batches_then_the_update() {
        // The meaning of a step, written out: each logical micro-batch's
        // gradient in its own buffer, folded in ascending order and scaled
        // by fl(1/L), the losses likewise, then the optimizer.
        for l in [1usize, 3] {
            let mut run = toy_run(6);
            run.logical_world = l;
            let mut world = local(trainer(run.clone()));
            let mut manual = trainer(run.clone());
            let n = manual.arena_len();
            for _ in 0..6 {
                let s = world.step().unwrap();
                let mut locals: Vec<Vec<f32>> = vec![vec![0.0; n]; l];
                let mut losses = Vec::new();
                for (micro, g) in locals.iter_mut().enumerate() {
                    losses.push([manual.micro_gradient(micro as u64, g).unwrap()]);
                }
                let rows: Vec<&[f32]> = locals.iter().map(|g| &g[..]).collect();
                let mut mean = vec![0.0f32; n];
                host_fold(&rows, &mut mean).unwrap();
                let rows: Vec<&[f32]> = losses.iter().map(|x| &x[..]).collect();
                let mut loss = [0.0f32];
                host_fold(&rows, &mut loss).unwrap();
                let mut loss = loss[0];
                if l > 1 {
                    let inv = mean_factor(l);
                    mean.iter_mut().for_each(|a| *a *= inv);
                    loss *= inv;
                }
                let m = manual.apply(&mean, loss, true).unwrap();
                assert_eq!(s.loss.to_bits(), m.loss.to_bits(), "L = {l}");
            }
            let world = world.into_parts().0;
            assert_eq!(bits(world.params()), bits(manual.params()), "L = {l}");
            assert_eq!(world.optimizer(), manual.optimizer(), "L = {l}");
            assert_eq!(world.step(), 6);
        }
    }

    #[test]
    fn training_moves_the_weights_and_ends_with_the_schedule() {
        let a = trainer(toy_run(4));
        let p0 = a.params().to_vec();
        let a = finish(a);
        assert_ne!(
            bits(a.params()),
            bits(&p0),
            "training must move the weights"
        );
        assert!(a.finished());
        assert_eq!(a.step(), 4);
    }

    #[test]
    fn the_logical_world_changes_the_run() {
        // Negative control for the fold: L = 2 draws and averages two
        // micro-batches per step, so it must not equal L = 1.
        let mut one = finish(trainer(toy_run(3)));
        let mut run2 = toy_run(3);
        run2.logical_world = 2;
        let mut two = finish(trainer(run2));
        assert_ne!(one.weights_digest().unwrap(), two.weights_digest().unwrap());
    }

    #[test]
    fn same_bits_with_one_or_four_threads() {
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| finish(trainer(toy_run(5))).weights_digest().unwrap())
        };
        assert_eq!(run(1), run(4));
    }

    #[test]
    fn resume_lands_on_the_unbroken_bits_and_weights_only_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let run = toy_run(8);
        let mut unbroken = finish(trainer(run.clone()));

        let mut first = local(trainer(run.clone()));
        for _ in 0..3 {
            first.step().unwrap();
        }
        let saved = first.trainer_mut().save_checkpoint(dir.path(), 2).unwrap();
        drop(first);

        let ck = checkpoint::load(dir.path()).unwrap();
        assert_eq!(ck.dir, saved);
        assert_eq!(ck.state.step, 3);
        let data = Dataset::new(run.task.clone(), run.batch).unwrap();
        let resumed =
            Trainer::resume(toy_model(&run), run.clone(), data.clone(), ck.clone()).unwrap();
        let mut resumed = finish(resumed);
        assert_eq!(
            resumed.weights_digest().unwrap(),
            unbroken.weights_digest().unwrap()
        );
        assert_eq!(resumed.optimizer(), unbroken.optimizer());

        let weights_only =
            Trainer::resume_weights_only(toy_model(&run), run.clone(), data, ck).unwrap();
        let mut weights_only = finish(weights_only);
        assert_ne!(
            weights_only.weights_digest().unwrap(),
            unbroken.weights_digest().unwrap(),
            "fresh moments must differ"
        );
    }

    #[test]
    fn resume_refuses_another_run_naming_the_setting() {
        let dir = tempfile::tempdir().unwrap();
        let run = toy_run(4);
        let mut w = local(trainer(run.clone()));
        w.step().unwrap();
        w.trainer_mut().save_checkpoint(dir.path(), 2).unwrap();
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
    fn a_skipped_step_counts_and_leaves_weights_and_moments() {
        let mut t = trainer(toy_run(4));
        let n = t.arena_len();
        let mut g = vec![0.0f32; n];
        let loss = t.micro_gradient(0, &mut g).unwrap();
        assert!(loss.is_finite());
        let before = t.params().to_vec();
        // A world's verdict skips even a finite local loss and gradient.
        let s = t.apply(&g, loss, false).unwrap();
        assert!(s.skipped);
        assert_eq!((s.step, s.skipped_total, t.skipped_steps()), (1, 1, 1));
        assert_eq!(bits(t.params()), bits(&before));
        assert_eq!(t.optimizer().adamw().updates(), 0);
        // A non-finite gradient skips on its own (the norm is non-finite).
        g[0] = f32::NAN;
        assert!(t.apply(&g, loss, true).unwrap().skipped);
        assert_eq!(bits(t.params()), bits(&before));
        g[0] = 0.5;
        let s = t.apply(&g, loss, true).unwrap();
        assert!(!s.skipped);
        assert_ne!(bits(t.params()), bits(&before), "control: a step moves");
        let st = t.run_state().unwrap();
        assert_eq!((st.optimizer_updates, st.step, st.skipped_steps), (1, 3, 2));
    }

    #[test]
    fn the_engine_step_is_the_optimizer_step() {
        // The engine adds nothing to the optimizer's arithmetic: the same
        // gradient through a bare host optimizer gives the same bits.
        let run = toy_run(3);
        let mut t = trainer(run.clone());
        let mut p = t.params().to_vec();
        let layout = crate::params::ParamLayout::new(&run.model);
        let mut opt = Optimizer::new(run.optimizer, run.schedule, &layout).unwrap();
        let mut g = vec![0.0f32; t.arena_len()];
        for step in 0..3 {
            t.micro_gradient(0, &mut g).unwrap();
            t.apply(&g, 1.0, true).unwrap();
            opt.step(&mut HostMath, step, &mut p, &g, true).unwrap();
        }
        assert_eq!(bits(t.params()), bits(&p));
        assert_eq!(t.optimizer(), &opt);
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

//! Shared helpers for the cross-crate integration tests.
//!
//! [`dp`]: three ways to train the same run, whose bits must agree under
//! the fixed-order contract: the engine stepped by the contract's
//! definition (an ascending host fold, no reducer), the engine's step with
//! the mean from mamba-reduce's [`EmulatedWorld`] oracle, and the
//! data-parallel loop on a live host world of threads.
//!
//! [`tree`]: a research reducer written against mamba-reduce's public API
//! alone (a pairwise tree over the host transport).
//!
//! [`EmulatedWorld`]: mamba_reduce::EmulatedWorld

pub mod tree;

pub mod dp {
    use std::path::Path;
    use std::time::Duration;

    use mamba_comm::host::{HostOptions, HostTransport};
    use mamba_reduce::{
        host_mean, EmulateOptions, EmulatedWorld, HostReducer, ReduceContract, ReducerOptions,
    };
    use mamba_train::checkpoint;
    use mamba_train::config::ModelConfig;
    use mamba_train::data::{Dataset, SelectiveCopyConfig, TaskSpec};
    use mamba_train::dp::{DataParallel, DpOptions};
    use mamba_train::model::cpu::CpuModel;
    use mamba_train::optim::{AdamWConfig, Schedule};
    use mamba_train::train::{RunConfig, Trainer};

    /// What a run leaves behind, for bit comparisons.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct Trace {
        /// Hex SHA-256 of the final weights.
        pub digest: String,
        /// Bits of each step's logged loss.
        pub losses: Vec<u32>,
        /// Which steps were skipped.
        pub skipped: Vec<bool>,
    }

    /// A tiny selective-copy run of the CPU Mamba (width 16, one block,
    /// rows of 12 tokens, 2 rows per micro-batch).
    pub fn tiny_run(seed: u64, logical_world: usize, steps: u64) -> RunConfig {
        let task = TaskSpec::SelectiveCopy(SelectiveCopyConfig {
            seq_len: 12,
            n_memorize: 3,
            alphabet: 4,
        });
        RunConfig {
            seed,
            model: ModelConfig::new(task.vocab_size(), 16, 1),
            task,
            batch: 2,
            logical_world,
            contract: ReduceContract::FixedOrder,
            optimizer: AdamWConfig::default(),
            schedule: Schedule {
                peak_lr: 1e-2,
                warmup_steps: 1,
                total_steps: steps,
                min_lr_frac: 0.1,
            },
        }
    }

    fn trainer(run: &RunConfig) -> Trainer<CpuModel> {
        Trainer::new(
            CpuModel::new(run.model.clone()).expect("model"),
            run.clone(),
        )
        .expect("trainer")
    }

    /// Train `run` to the end with each step's mean gradient from `mean`,
    /// given the `L` micro-batch gradients in logical order: the loss is
    /// the ascending host fold of the `L` losses times `fl(1/L)`, and a
    /// non-finite loss or gradient skips the step.
    fn run_with_mean(run: &RunConfig, mut mean: impl FnMut(Vec<Vec<f32>>) -> Vec<f32>) -> Trace {
        let mut t = trainer(run);
        let l = run.logical_world;
        let n = t.arena_len();
        let (mut losses, mut skipped) = (Vec::new(), Vec::new());
        while !t.finished() {
            let mut grads = vec![vec![0.0f32; n]; l];
            let mut micro = Vec::with_capacity(l);
            for (j, g) in grads.iter_mut().enumerate() {
                micro.push([t.micro_gradient(j as u64, g).expect("gradient")]);
            }
            let finite = micro.iter().all(|m| m[0].is_finite())
                && grads.iter().all(|g| g.iter().all(|x| x.is_finite()));
            let rows: Vec<&[f32]> = micro.iter().map(|m| &m[..]).collect();
            let loss = host_mean(&rows).expect("loss fold")[0];
            // A skipped step never reads the gradient: no reduction.
            let m = if finite {
                mean(grads)
            } else {
                grads.swap_remove(0)
            };
            let s = t.apply(&m, loss, finite).expect("apply");
            losses.push(s.loss.to_bits());
            skipped.push(s.skipped);
        }
        Trace {
            digest: t.weights_digest().expect("digest"),
            losses,
            skipped,
        }
    }

    /// The engine stepped by the fixed-order contract's definition: each
    /// step's mean is the ascending host fold of the `L` gradients times
    /// `fl(1/L)` (`host_mean`, no reducer).
    pub fn definition_run(run: &RunConfig) -> Trace {
        run_with_mean(run, |grads| {
            let rows: Vec<&[f32]> = grads.iter().map(|g| &g[..]).collect();
            host_mean(&rows).expect("gradient fold")
        })
    }

    /// The engine's step with the gradient mean from mamba-reduce's oracle:
    /// an [`EmulatedWorld`] of `world` emulated processes (with `opts`'
    /// delivery order and chunking).
    pub fn emulated_run(run: &RunConfig, world: usize, opts: &EmulateOptions) -> Trace {
        run_with_mean(run, |grads| {
            EmulatedWorld::new(grads)
                .expect("emulated world")
                .reduce_mean(world, opts)
                .expect("emulated reduction")
        })
    }

    /// How a thread world starts and ends.
    #[derive(Clone, Copy, Debug, Default)]
    pub struct WorldRun<'a> {
        /// Resume every rank from this checkpoint (a run or checkpoint dir).
        pub resume: Option<&'a Path>,
        /// Stop after this step (default: the run's end).
        pub stop_at: Option<u64>,
        /// Rank 0 saves a checkpoint here at the end.
        pub save_to: Option<&'a Path>,
        /// The loop's options (hooks, replica-check period).
        pub opts: DpOptions,
    }

    /// The data-parallel loop on a live host world of `world` threads (one
    /// [`HostReducer`] each, `run`'s contract): every rank's trace, in rank
    /// order. Panics (with the rank) on any rank's error.
    pub fn thread_world(run: &RunConfig, world: usize, how: WorldRun<'_>) -> Vec<Trace> {
        try_thread_world(run, world, how)
            .into_iter()
            .enumerate()
            .map(|(r, t)| t.unwrap_or_else(|e| panic!("rank {r} of {world}: {e}")))
            .collect()
    }

    /// [`thread_world`], returning each rank's result instead of panicking.
    pub fn try_thread_world(
        run: &RunConfig,
        world: usize,
        how: WorldRun<'_>,
    ) -> Vec<mamba_train::Result<Trace>> {
        let transports =
            HostTransport::thread_world(world, HostOptions::with_timeout(Duration::from_secs(60)))
                .expect("thread world");
        std::thread::scope(|s| {
            let handles: Vec<_> = transports
                .into_iter()
                .map(|t| s.spawn(move || rank_run(run, t, how)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank thread"))
                .collect()
        })
    }

    fn rank_run(
        run: &RunConfig,
        transport: HostTransport,
        how: WorldRun<'_>,
    ) -> mamba_train::Result<Trace> {
        let model = CpuModel::new(run.model.clone())?;
        let t = match how.resume {
            Some(dir) => {
                let ck = checkpoint::load(dir)?;
                let data = Dataset::new(run.task.clone(), run.batch)?;
                Trainer::resume(model, run.clone(), data, ck)?
            }
            None => Trainer::new(model, run.clone())?,
        };
        let reducer = HostReducer::new(
            transport,
            ReducerOptions::new(run.contract, run.logical_world),
        );
        let mut dp = DataParallel::new(t, reducer, how.opts)?;
        let end = how.stop_at.unwrap_or(run.schedule.total_steps);
        let (mut losses, mut skipped) = (Vec::new(), Vec::new());
        while dp.trainer().step() < end {
            let s = dp.step()?;
            losses.push(s.loss.to_bits());
            skipped.push(s.skipped);
        }
        let agreed = dp.replica_check("at the end")?;
        if let (0, Some(dir)) = (dp.rank(), how.save_to) {
            dp.trainer_mut().save_checkpoint(dir, 2)?;
        }
        Ok(Trace {
            digest: agreed.digest,
            losses,
            skipped,
        })
    }
}

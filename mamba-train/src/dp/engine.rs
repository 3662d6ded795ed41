//! [`DataParallel`]: one rank's training loop over the engine
//! ([`Trainer`]) and a reducer.

use std::path::{Path, PathBuf};

use mamba_reduce::{mean_factor, ReduceContract, Reducer, RunIdentity, TreeAccumulator};

#[cfg(feature = "fault-injection")]
use super::fault_hooks::FaultHooks;
use super::reduce_err;
use super::replica_check::{self, ReplicaState};
use super::zero::{gather_moments, ZeroShards};
use crate::checkpoint::CheckpointMeta;
use crate::error::{Result, TrainError};
use crate::train::{Backend, StepStats, Trainer};

mod local_phase;

/// Settings of a [`DataParallel`] loop besides the run itself.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DpOptions {
    /// Run the replica check after every N-th step (0: only when
    /// [`DataParallel::replica_check`] is called, e.g. before checkpoints
    /// and at the end).
    pub replica_check_every: u64,
    /// Fault-injection hooks (test builds only: the `fault-injection`
    /// feature).
    #[cfg(feature = "fault-injection")]
    pub hooks: FaultHooks,
    /// A fingerprint of everything outside the [`RunConfig`] that decides
    /// *when* a rank makes a collective call (checkpoint period, replica
    /// check period, stop step): it joins the agreement check, so ranks
    /// started with different schedules fail at once instead of pairing
    /// unrelated collectives.
    ///
    /// [`RunConfig`]: crate::train::RunConfig
    pub schedule_fingerprint: u64,
    /// ZeRO-1 (`--shard-optimizer`): each rank keeps and updates only its
    /// shard of the optimizer state ([`super::zero`]). Never changes bits,
    /// so it is not part of the run's identity (a checkpoint resumes
    /// sharded or not, at any P); it joins the agreement check, since the
    /// ranks of one world must all make its collective calls.
    pub shard_optimizer: bool,
}

/// One rank of a data-parallel world: a model replica (the [`Trainer`]
/// over its [`Backend`]) and the world's [`Reducer`].
///
/// A step (every call is collective: all ranks make the same calls in the
/// same order):
/// 1. this rank computes the loss and gradient of each of its logical
///    micro-batches `rank*L/P .. (rank+1)*L/P`, in logical order, each into
///    its own arena (under fixed-tree, each finished gradient is folded
///    into the block's [`TreeAccumulator`] right away);
/// 2. [`Reducer::any`]: did any rank see a non-finite loss or gradient,
///    or fail in step 1? (A failure is then named to every rank, which
///    all fail at this step: see [`DataParallel::step`].)
/// 3. [`Reducer::all_reduce_host_logical`] of the `L` micro losses: the
///    logged loss, `sum * fl(1/L)`, identical on every rank and for every P;
/// 4. unless some rank was non-finite, [`Reducer::reduce_mean`] of the
///    local arenas (under fixed-tree: of the one block sum): the mean over
///    all `L`, in the contract's association;
/// 5. the backend clips and steps (or skips, on every rank alike);
/// 6. every `replica_check_every` steps, the replica check.
///
/// With [`DpOptions::shard_optimizer`] at `P > 1`, steps 4 and 5 are
/// ZeRO-1's ([`super::zero`]): the reduction ends at the shard owners,
/// each owner updates its shard, the shards are all-gathered; the same
/// bits as unsharded.
///
/// Invariant: after every step every rank holds the same weights, moments
/// and step; the replica check verifies it and fails every rank with
/// [`mamba_comm::CommError::ReplicaDivergence`] when it does not hold.
///
/// Memory: the gradient arenas (in the backend's memory: `L/P` under
/// fixed-order and nccl-sum, `log2(L/P) + 1` under fixed-tree;
/// [`DataParallel::gradient_arenas`]), the optimizer's moments (`2N`, or
/// this rank's shard under ZeRO-1), plus what the reducer keeps.
pub struct DataParallel<B: Backend, R: Reducer<Buffer = B::Arena>> {
    trainer: Trainer<B>,
    reducer: R,
    grads: Gradients<B::Arena>,
    /// Gradient arenas allocated so far (they persist across steps).
    arenas: usize,
    opts: DpOptions,
    checked_at: Option<u64>,
    replica_checks: u64,
    /// The optimizer partition when sharded over more than one rank (at
    /// `P = 1` ZeRO-1 is the unsharded path exactly).
    zero: Option<ZeroShards>,
}

impl<B: Backend, R: Reducer<Buffer = B::Arena>> DataParallel<B, R> {
    /// Join the world: the agreement check (arena length, contract, logical
    /// world, and a fingerprint of the run and schedule, on every rank),
    /// then the first replica check (every rank starts from the same
    /// weights and step, e.g. the same checkpoint). Collective.
    pub fn new(trainer: Trainer<B>, reducer: R, opts: DpOptions) -> Result<Self> {
        let mut dp = DataParallel {
            trainer,
            reducer,
            grads: Gradients::PerRank(Vec::new()),
            arenas: 0,
            opts,
            checked_at: None,
            replica_checks: 0,
            zero: None,
        };
        let run = dp.trainer.run_config().clone();
        let mut agreed = format!(
            "{:016x}/{:016x}",
            run.fingerprint(),
            opts.schedule_fingerprint
        );
        if opts.shard_optimizer {
            agreed.push_str("/shard-optimizer");
        }
        // The precision is part of the run's bits: ranks in different
        // precisions must not pair up. (f32 adds nothing, so f32 runs keep
        // the fingerprint of builds before precisions existed.)
        let precision = dp.trainer.backend().precision_name();
        if precision != crate::config::Precision::F32.name() {
            agreed.push_str("/precision=");
            agreed.push_str(precision);
        }
        let fingerprint = RunIdentity::fingerprint_of(agreed.as_bytes());
        let id = RunIdentity::new(
            dp.trainer.arena_len(),
            run.contract,
            run.logical_world,
            fingerprint,
        );
        // A reducer built for another contract or L is reported by the
        // check on every rank (as this rank's local problem).
        dp.reducer.check_agreement(&id).map_err(reduce_err)?;
        if opts.shard_optimizer && dp.world() > 1 {
            let zero = ZeroShards::new(dp.trainer.arena_len(), dp.world())?;
            dp.trainer.shard_optimizer(zero.range(dp.rank()))?;
            dp.zero = Some(zero);
        }
        let blocks = dp.blocks();
        let (grads, arenas) = if run.contract == ReduceContract::FixedTree {
            if dp.reducer.local_fold().is_none() {
                return Err(TrainError::Config(
                    "--contract fixed-tree needs a reducer that offers its fold arithmetic \
                     (Reducer::local_fold) to fold each process's block; this reducer offers \
                     none: use --contract fixed-order"
                        .to_string(),
                ));
            }
            let mut acc =
                TreeAccumulator::new(blocks, dp.trainer.arena_len()).map_err(reduce_err)?;
            // Allocated up front, like the per-rank arenas: the counter never
            // needs more, and a device that cannot hold them fails here.
            let most = TreeAccumulator::<B::Arena>::max_buffers(blocks);
            for _ in 0..most {
                acc.recycle(dp.trainer.backend_mut().zeros()?);
            }
            (Gradients::Tree(acc), most)
        } else {
            let mut locals = Vec::with_capacity(blocks);
            for _ in 0..blocks {
                locals.push(dp.trainer.backend_mut().zeros()?);
            }
            (Gradients::PerRank(locals), blocks)
        };
        dp.grads = grads;
        dp.arenas = arenas;
        let step = dp.trainer.step();
        dp.replica_check(&format!("at the start (step {step})"))?;
        Ok(dp)
    }

    /// Logical ranks (micro-batches) this rank computes per step: `L / P`.
    pub fn blocks(&self) -> usize {
        self.reducer.logical_world() / self.reducer.world().max(1)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.reducer.rank()
    }

    /// `P`.
    pub fn world(&self) -> usize {
        self.reducer.world()
    }

    /// `L`.
    pub fn logical_world(&self) -> usize {
        self.reducer.logical_world()
    }

    /// The model replica.
    pub fn trainer(&self) -> &Trainer<B> {
        &self.trainer
    }

    /// The model replica, mutable (rank 0 saves and evaluates through it).
    pub fn trainer_mut(&mut self) -> &mut Trainer<B> {
        &mut self.trainer
    }

    /// Replica checks run so far (the start's included).
    pub fn replica_checks(&self) -> u64 {
        self.replica_checks
    }

    /// True once the schedule's steps are done.
    pub fn finished(&self) -> bool {
        self.trainer.finished()
    }

    /// Gradient arenas this rank holds (allocated once, reused every step):
    /// `L/P` under fixed-order and nccl-sum, `log2(L/P) + 1` under
    /// fixed-tree (more only if a step ever needed one more, which the
    /// counter's invariant excludes).
    pub fn gradient_arenas(&self) -> usize {
        self.arenas
    }

    /// The trainer and the reducer back.
    pub fn into_parts(self) -> (Trainer<B>, R) {
        (self.trainer, self.reducer)
    }

    /// One data-parallel step (see the type's docs). Collective.
    ///
    /// A rank whose local phase fails (its forward/backward, its data, a
    /// device error) still makes the step's first collective call, saying
    /// so, before it returns its own error: every other rank then fails at
    /// once with [`mamba_comm::CommError::PeerFailed`] naming it, instead
    /// of waiting in the next collective until the watchdog (a launcher
    /// that does not kill a world on the first exit, or ranks on other
    /// nodes, would otherwise leave them hanging). The common path costs
    /// nothing extra: the failure rides on the non-finite check's flag.
    pub fn step(&mut self) -> Result<StepStats> {
        #[cfg(feature = "fault-injection")]
        let hooks = self.opts.hooks;
        #[cfg(feature = "fault-injection")]
        hooks.before_step();
        let logical = self.logical_world();
        let mut losses = Vec::with_capacity(self.blocks());
        // Under the tree: the block's sum, once its last leaf is folded.
        let mut block = Vec::new();
        let local = self.local_phase(&mut losses, &mut block);
        let failed = local.is_err();
        let finite = *local.as_ref().unwrap_or(&false);
        let skip = self.reducer.any(!finite || failed).map_err(reduce_err)?;
        if skip && self.reducer.any(failed).map_err(reduce_err)? {
            return Err(self.local_failure(local.err())?);
        }
        let rows: Vec<&[f32]> = losses.iter().map(|l| &l[..]).collect();
        let sum = self
            .reducer
            .all_reduce_host_logical(&rows)
            .map_err(reduce_err)?;
        let total = sum.first().copied().ok_or_else(|| {
            TrainError::Config("the loss all-reduce returned no value".to_string())
        })?;
        // As the fold: no scale for one addend, else sum * fl(1/L).
        let loss = if logical > 1 {
            total * mean_factor(logical)
        } else {
            total
        };
        let locals: &mut [B::Arena] = match &mut self.grads {
            Gradients::PerRank(locals) => locals,
            Gradients::Tree(_) => &mut block,
        };
        match (&self.zero, skip) {
            (_, true) => {}
            (None, false) => self.reducer.reduce_mean(locals).map_err(reduce_err)?,
            (Some(z), false) => self
                .reducer
                .reduce_mean_shard(locals, z.ranges())
                .map_err(reduce_err)?,
        }
        let Some(mean) = locals.first() else {
            return Err(TrainError::Config(
                "a data-parallel rank holds no gradient arena (L / P = 0)".to_string(),
            ));
        };
        let mut stats = match &self.zero {
            None => self.trainer.apply(mean, loss, !skip)?,
            Some(z) => {
                let reducer = &mut self.reducer;
                let stats = self.trainer.apply_gathered(mean, loss, !skip, &mut |own| {
                    z.gather_chunk_sums(reducer, &own)
                })?;
                if !stats.skipped {
                    self.reducer
                        .all_gather_ranges(self.trainer.params_mut(), z.ranges())
                        .map_err(reduce_err)?;
                }
                stats
            }
        };
        if let Gradients::Tree(acc) = &mut self.grads {
            block.drain(..).for_each(|b| acc.recycle(b));
        }
        if skip {
            // Nothing was reduced: no rank has the world's gradient norm.
            stats.grad_norm = f64::NAN;
        }
        #[cfg(feature = "fault-injection")]
        hooks.after_step(self.rank(), stats.step, &mut self.trainer)?;
        let every = self.opts.replica_check_every;
        if every > 0 && stats.step % every == 0 {
            self.replica_check(&format!("after step {}", stats.step))?;
        }
        Ok(stats)
    }

    /// Compare every rank's weights digest and step through the reducer's
    /// host all-gather; `when` names the point in the run for the error.
    /// Skipped (returning this rank's state) when the current step was
    /// already checked. Collective.
    pub fn replica_check(&mut self, when: &str) -> Result<ReplicaState> {
        let mine = ReplicaState {
            step: self.trainer.step(),
            digest: self.trainer.weights_digest()?,
        };
        if self.checked_at == Some(mine.step) {
            return Ok(mine);
        }
        let values = replica_check::encode(&mine)?;
        let all = self.reducer.all_gather_host(&values).map_err(reduce_err)?;
        let agreed = replica_check::verdict(&all, self.world(), when)?;
        self.checked_at = Some(mine.step);
        self.replica_checks += 1;
        Ok(agreed)
    }

    /// The world's answer to "stop here?": every rank passes the stop signal
    /// it received (if any) and gets back the lowest rank that received
    /// one, with its signal, the same on every rank. Collective: called at
    /// a step boundary, it is how a world stops at one step in agreement.
    pub fn stop_requests(&mut self, local: Option<i32>) -> Result<Option<(usize, i32)>> {
        let all = self
            .reducer
            .all_gather_host(&[local.unwrap_or(0) as f32])
            .map_err(reduce_err)?;
        Ok(all
            .iter()
            .enumerate()
            .find(|(_, &s)| s != 0.0)
            .map(|(rank, &s)| (rank, s as i32)))
    }

    /// Save a checkpoint of the current step: rank 0 passes its run
    /// directory (`Some`), every other rank `None`, and only the rank with
    /// a directory writes (keeping the newest `keep`). The files are the
    /// unsharded run's: under ZeRO-1 the moments of every shard are
    /// gathered first, so this is collective then (every rank calls it at
    /// the same step); unsharded it communicates nothing.
    pub fn save_checkpoint(
        &mut self,
        run_dir: Option<&Path>,
        keep: usize,
        meta: &CheckpointMeta,
    ) -> Result<Option<PathBuf>> {
        let Some(zero) = &self.zero else {
            return run_dir
                .map(|d| self.trainer.save_checkpoint_with_meta(d, keep, meta))
                .transpose();
        };
        let (m, v) = gather_moments(zero, &mut self.trainer, &mut self.reducer)?;
        run_dir
            .map(|d| {
                self.trainer
                    .save_checkpoint_with_moments(d, keep, meta, &m, &v)
            })
            .transpose()
    }

    /// The optimizer partition when the optimizer is sharded over more
    /// than one rank.
    pub fn optimizer_shards(&self) -> Option<&ZeroShards> {
        self.zero.as_ref()
    }

    /// Return once every rank got here (e.g. so that rank 0 prints its
    /// summary after the others printed theirs). Collective.
    pub fn barrier(&mut self) -> Result<()> {
        self.reducer.any(false).map_err(reduce_err)?;
        Ok(())
    }
}

/// Where a rank's micro-batch gradients live until the reduction.
///
/// Invariant: the arenas are allocated in [`DataParallel::new`] and reused
/// every step, so the gradient memory of a run is fixed at the start.
enum Gradients<A> {
    /// One arena per local logical rank, all held until the reduction
    /// (fixed-order: the chain `((g0 + g1) + g2) + ...` cannot fold a
    /// rank's addends before the lower ranks' prefix arrives; nccl-sum).
    PerRank(Vec<A>),
    /// Fixed-tree: the binary counter of the block's subtree, fed each
    /// micro-batch gradient as it finishes (`log2(L/P) + 1` arenas).
    Tree(TreeAccumulator<A>),
}

//! A research reducer written outside mamba-reduce, against its public API
//! alone: the proof that the [`Reducer`] seam is real (SPEC.md: "keep one
//! such reducer as a test").
//!
//! [`TreeReducer`] averages over a host world with a pairwise tree: each
//! process first folds its own block of `L/P` arenas in ascending order,
//! then the `P` block sums meet in a binary tree over ranks (at distance
//! `1, 2, 4, ...`, rank `r` adds rank `r + d`'s partial to its own), rank 0
//! scales the total by `fl(1/L)` and broadcasts it. The association depends
//! on `P`, so this is not `FixedOrder`: it reports
//! [`ReduceContract::NcclSum`], the weaker promise (stable on a frozen
//! machine and configuration). The agreement check is mamba-reduce's own
//! [`agree`] over the same transport.

use mamba_comm::host::HostTransport;
use mamba_comm::Transport;
use mamba_reduce::{
    agree, all_gather, host_fold, mean_factor, ReduceContract, ReduceError, Reducer, Result,
    RunIdentity,
};

/// A pairwise-tree mean over a [`HostTransport`] (see the module docs).
pub struct TreeReducer {
    transport: HostTransport,
    logical_world: usize,
    /// The agreement check's and host exchanges' buffer.
    small: Option<Vec<f32>>,
    /// The partial received from a child.
    incoming: Vec<f32>,
    agreed: Option<RunIdentity>,
}

impl TreeReducer {
    /// A reducer over `transport` for `logical_world` logical ranks. Nothing
    /// is exchanged until the agreement check.
    pub fn new(transport: HostTransport, logical_world: usize) -> Self {
        TreeReducer {
            transport,
            logical_world,
            small: None,
            incoming: Vec::new(),
            agreed: None,
        }
    }

    /// What this rank's reducer cannot do for `id` (checked before the
    /// exchange and reported through it, so every rank fails together).
    fn local_problem(&self, id: &RunIdentity) -> Option<String> {
        if id.contract != ReduceContract::NcclSum || id.logical_world != self.logical_world as u64 {
            return Some(format!(
                "rank {}: the tree reducer keeps only {} (logical world {}), but was asked to \
                 agree on contract {} and logical world {}",
                self.transport.rank(),
                ReduceContract::NcclSum,
                self.logical_world,
                id.contract,
                id.logical_world
            ));
        }
        None
    }

    fn exchange(&mut self, id: &RunIdentity, problem: Option<String>) -> Result<()> {
        let agreed = agree(&mut self.transport, &mut self.small, id, problem)?;
        self.agreed = Some(agreed);
        Ok(())
    }
}

/// `acc[i] = acc[i] + a[i]`, one f32 round-to-nearest add each.
fn add_into(acc: &mut [f32], a: &[f32]) {
    for (x, y) in acc.iter_mut().zip(a) {
        *x += *y;
    }
}

/// The tree's pairs: at each distance `d = 1, 2, 4, ...` below `world`,
/// `(parent, child) = (r, r + d)` for every `r` a multiple of `2d` with
/// `r + d < world`. Rank 0 ends with the total.
pub fn tree_pairs(world: usize) -> Vec<(usize, usize)> {
    let mut pairs = Vec::new();
    let mut d = 1;
    while d < world {
        for r in (0..world).step_by(2 * d) {
            if r + d < world {
                pairs.push((r, r + d));
            }
        }
        d *= 2;
    }
    pairs
}

/// The plain reference of [`TreeReducer::reduce_mean`]: `arenas` are the
/// `L` logical arenas in logical order, `world` processes hold `L/P` each.
pub fn tree_mean_reference(arenas: &[Vec<f32>], world: usize) -> Vec<f32> {
    let logical = arenas.len();
    let blocks = logical / world;
    let mut partial: Vec<Vec<f32>> = arenas
        .chunks(blocks)
        .map(|block| {
            let mut acc = block[0].clone();
            for a in &block[1..] {
                add_into(&mut acc, a);
            }
            acc
        })
        .collect();
    for (parent, child) in tree_pairs(world) {
        let c = partial[child].clone();
        add_into(&mut partial[parent], &c);
    }
    let mut out = partial.swap_remove(0);
    if logical > 1 {
        let f = mean_factor(logical);
        out.iter_mut().for_each(|x| *x *= f);
    }
    out
}

impl Reducer for TreeReducer {
    type Buffer = Vec<f32>;

    fn contract(&self) -> ReduceContract {
        ReduceContract::NcclSum
    }

    fn logical_world(&self) -> usize {
        self.logical_world
    }

    fn world(&self) -> usize {
        self.transport.world()
    }

    fn rank(&self) -> usize {
        self.transport.rank()
    }

    fn reduce_mean(&mut self, local: &mut [Vec<f32>]) -> Result<()> {
        let (rank, world) = (self.transport.rank(), self.transport.world());
        let len = local.first().map_or(0, Vec::len);
        let blocks = self.logical_world / world.max(1);
        let problem = (local.len() != blocks || local.iter().any(|a| a.len() != len)).then(|| {
            format!(
                "rank {rank} passed {} arenas (expected {blocks}, all of one length)",
                local.len()
            )
        });
        if self.agreed.is_none() {
            let id = RunIdentity::new(len, ReduceContract::NcclSum, self.logical_world, 0);
            self.exchange(&id, problem)?;
        } else if let Some(p) = problem {
            return Err(ReduceError::config(p));
        }
        if self.agreed.is_some_and(|a| a.arena_len != len as u64) {
            return Err(ReduceError::config(format!(
                "rank {rank}: arenas of {len} elements, but the world agreed on another length"
            )));
        }
        let Some((first, rest)) = local.split_first_mut() else {
            return Err(ReduceError::config("reduce_mean got no local arenas"));
        };
        for a in rest.iter() {
            add_into(first, a);
        }
        if world > 1 && len > 0 {
            self.incoming.resize(len, 0.0);
            for (parent, child) in tree_pairs(world) {
                if rank == child {
                    let t = &mut self.transport;
                    t.group(&mut [&mut *first], |g| g.send(0, 0..len, parent))?;
                } else if rank == parent {
                    let (t, buf) = (&mut self.transport, &mut self.incoming);
                    t.group(&mut [buf], |g| g.recv(0, 0..len, child))?;
                    add_into(first, &self.incoming);
                }
            }
        }
        if self.logical_world > 1 && rank == 0 {
            let f = mean_factor(self.logical_world);
            first.iter_mut().for_each(|x| *x *= f);
        }
        if world > 1 && len > 0 {
            self.transport.broadcast(first, 0..len, 0)?;
        }
        Ok(())
    }

    fn any(&mut self, flag: bool) -> Result<bool> {
        let mut v = [i32::from(flag)];
        if self.transport.world() > 1 {
            self.transport.all_reduce_max_i32(&mut v)?;
        }
        Ok(v[0] != 0)
    }

    fn all_reduce_host(&mut self, v: &mut [f32]) -> Result<()> {
        let n = v.len();
        if self.transport.world() == 1 || n == 0 {
            return Ok(());
        }
        let all = all_gather(&mut self.transport, &mut self.small, v)?;
        let rows: Vec<&[f32]> = all.chunks(n).collect();
        host_fold(&rows, v)
    }

    fn all_gather_host(&mut self, v: &[f32]) -> Result<Vec<f32>> {
        all_gather(&mut self.transport, &mut self.small, v)
    }

    fn check_agreement(&mut self, id: &RunIdentity) -> Result<()> {
        let problem = self.local_problem(id);
        self.exchange(id, problem)
    }
}

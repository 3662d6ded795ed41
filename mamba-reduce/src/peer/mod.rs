//! [`PeerReducer`]: the fixed-order reduction inside one node as one fused
//! kernel per rank (its documentation is on the type, which is public).

mod registration;

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use kernels::{FoldKernel, PeerKernels, PeerStatus, ABORT_FLAG, MAX_CHAIN_ADDENDS, MAX_PEERS};
use mamba_comm::ipc::SharedPool;
use mamba_comm::CommError;

use crate::contract::ReduceContract;
use crate::fold::mean_factor;
use crate::identity::RunIdentity;
use crate::reducer::Reducer;
use crate::shard::ShardPlan;
use crate::{ReduceError, Result};

use registration::{register, Own, Registration};

/// Settings of a [`PeerReducer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerOptions {
    /// How long a barrier waits for a peer (on the GPU) and how long the
    /// registration waits for the peers' sockets.
    pub timeout: Duration,
}

impl Default for PeerOptions {
    /// Two minutes: longer than any step's skew between ranks, short enough
    /// that a dead peer ends the run well before a person would notice.
    fn default() -> Self {
        PeerOptions {
            timeout: Duration::from_secs(120),
        }
    }
}

/// The fixed-order [`Reducer`] of one node's ranks over mapped peer memory,
/// as one fused kernel per rank. `R` carries the host collectives.
///
/// # Dataflow
///
/// The ranks of a node map each other's gradient arenas once (CUDA
/// memory-pool IPC, [`mamba_comm::ipc`]; the first [`Reducer::reduce_mean`]
/// registers them, collectively). A reduction is then, on every rank's
/// stream and with no host round trip:
///
/// 1. barrier: every rank has finished writing its arenas;
/// 2. the owner of shard `r` (the [`ShardPlan`] of the arena over `P`
///    ranks) runs one kernel that reads element `i` of shard `r` from all
///    `L` logical arenas of all ranks, in ascending logical order, folds
///    them (`((g0 + g1) + g2) + ...`, then times `fl(1/L)`: the chain of
///    `det_chain`, so the bits of every other fixed-order path at the same
///    `L`, for every `P`) and writes the mean into `local[0]` of every rank;
/// 3. barrier: every owner has written; each rank's arena holds the mean.
///
/// Per rank that moves `(P-1)/P N` in and `(P-1)/P N` out over the links,
/// what a ring all-reduce moves, in one kernel instead of NCCL's transfers
/// plus a fold pass. Only the owner of an element ever writes it, and only
/// between the two barriers, so there is no race whatever the timing.
///
/// # Failure
///
/// Every barrier waits on the GPU with a deadline ([`PeerOptions::timeout`]
/// of `%globaltimer`): a peer that died or hangs is a
/// [`CommError::PeerFailed`] naming it after at most the deadline, never a
/// hang. A rank that fails on its own side after registering (for
/// instance, arenas that are not the registered ones) posts an abort into
/// every peer's flags before returning its error, so its peers fail at once
/// with an error naming it instead of waiting for the deadline
/// ([`PeerReducer::abort`] does the same for a caller's own failures). After
/// any failure the reducer refuses further reductions: tear the world down.
///
/// # What it needs
///
/// - All ranks on one node, in one network and pid namespace (the pools
///   travel as file descriptors over abstract Unix sockets, checked by
///   pid); the first reduction's registration compares every rank's boot
///   id and namespaces ([`mamba_comm::ipc::NodeIdentity`]) before anything
///   else and refuses a world that spans nodes or containers on every rank
///   at once, naming the ranks of each; at most
///   [`kernels::MAX_PEERS`] of them; two ranks may share one GPU (CUDA IPC
///   between processes on one device works; NCCL refuses it).
/// - The arenas allocated after [`PeerReducer::new`] (which installs the
///   shareable pool, [`SharedPool::install`]) and kept for the reducer's
///   life: passing others later is an error on this rank and an abort on
///   its peers. To free them, first drop the reducer on every rank (that
///   releases the peers' mappings), meet (any collective of the control
///   reducer, see [`PeerReducer::into_control`]), then free: CUDA wants
///   every importer to let go before the exporter frees.
/// - The fixed-order contract (the only one it implements). Its host
///   collectives, the agreement check and the registration exchange go
///   through a control [`Reducer`] (the host transport's or NCCL's), whose
///   contract and logical world it takes.
pub struct PeerReducer<R: Reducer> {
    control: R,
    stream: Arc<CudaStream>,
    kernels: PeerKernels,
    fold: FoldKernel,
    pool: Option<Arc<SharedPool>>,
    opts: PeerOptions,
    /// This rank's flag array (`P` slots, slot `q` written by rank `q`).
    flags: CudaSlice<u64>,
    status: CudaSlice<u32>,
    registration: Option<Registration>,
    /// The head of chains longer than one launch takes.
    scratch: Option<CudaSlice<f32>>,
    epoch: u64,
    agreed: bool,
    /// Why this reducer stopped, once it has.
    failed: Option<String>,
}

impl<R: Reducer> PeerReducer<R> {
    /// A peer reducer on `stream` (the stream that writes the arenas),
    /// with `control` for the host collectives. Installs the device's
    /// shareable pool when `P > 1`: allocate the arenas after this call.
    /// Nothing is exchanged yet.
    pub fn new(control: R, stream: Arc<CudaStream>, opts: PeerOptions) -> Result<Self> {
        if control.contract() != ReduceContract::FixedOrder {
            return Err(ReduceError::config(format!(
                "the peer fold keeps the fixed-order contract only, but the control reducer was \
                 built for {}",
                control.contract()
            )));
        }
        let world = control.world();
        if world == 0 || world > MAX_PEERS {
            return Err(ReduceError::config(format!(
                "the peer fold spans 1..={MAX_PEERS} ranks of one node; this world has {world}"
            )));
        }
        if control.logical_world() % world != 0 || control.logical_world() == 0 {
            return Err(ReduceError::config(format!(
                "logical world {} is not a multiple of the {world} processes",
                control.logical_world()
            )));
        }
        let ctx = stream.context().clone();
        let pool = if world > 1 {
            Some(SharedPool::install(&ctx)?)
        } else {
            None
        };
        let device = |op: &str| {
            let op = op.to_owned();
            move |e: cudarc::driver::DriverError| ReduceError::device(op, e)
        };
        let flags = stream
            .alloc_zeros::<u64>(world)
            .map_err(device("allocating the peer flags"))?;
        let status = stream
            .alloc_zeros::<u32>(1)
            .map_err(device("allocating the peer status"))?;
        Ok(PeerReducer {
            kernels: PeerKernels::load(&ctx)?,
            fold: FoldKernel::load(&ctx)?,
            control,
            stream,
            pool,
            opts,
            flags,
            status,
            registration: None,
            scratch: None,
            epoch: 0,
            agreed: false,
            failed: None,
        })
    }

    /// The control reducer (host collectives).
    pub fn control_mut(&mut self) -> &mut R {
        &mut self.control
    }

    /// The control reducer back; the peers' mappings are released (do it on
    /// every rank, after the last reduction).
    pub fn into_control(self) -> R {
        self.control
    }

    /// Stop this reducer and tell every registered peer, so that their
    /// barriers fail at once naming this rank instead of at the deadline.
    /// For a caller that fails on its own side between reductions. Posting
    /// is best effort (a peer that is gone cannot be told); later calls
    /// refuse to reduce.
    pub fn abort(&mut self, why: &str) {
        if let Some(reg) = &self.registration {
            let rank = self.control.rank();
            let value = (ABORT_FLAG | self.epoch).to_le_bytes();
            for flags in reg.peer_flags.iter().flatten() {
                let _ = flags.write(rank as u64 * 8, &value);
            }
        }
        self.failed.get_or_insert_with(|| why.to_owned());
    }

    fn fail(&mut self, e: ReduceError) -> ReduceError {
        self.abort(&e.to_string());
        e
    }

    /// The arenas' length after checking their count and lengths.
    fn checked_len(&self, local: &[CudaSlice<f32>]) -> Result<usize> {
        let blocks = self.control.logical_world() / self.control.world();
        if local.len() != blocks {
            return Err(ReduceError::config(format!(
                "rank {} passed {} local arenas to reduce_mean; with logical world {} over {} \
                 processes each process passes {blocks} (its contiguous block of logical ranks, \
                 ascending)",
                self.control.rank(),
                local.len(),
                self.control.logical_world(),
                self.control.world()
            )));
        }
        let len = local[0].len();
        if let Some(k) = local.iter().position(|a| a.len() != len) {
            return Err(ReduceError::config(format!(
                "local arena {k} holds {} elements, arena 0 {len}; all arenas of a reduction \
                 have one length",
                local[k].len()
            )));
        }
        Ok(len)
    }

    /// Register `own` on the first call; afterwards check that they are
    /// the registered arenas.
    fn registered(&mut self, own: &[(CUdeviceptr, usize)], len: usize) -> Result<()> {
        if let Some(reg) = &self.registration {
            if reg.own != own {
                return Err(ReduceError::config(format!(
                    "rank {} passed arenas other than the ones it registered at its first \
                     reduction (the peers have those mapped); the peer fold needs the same \
                     arenas for the reducer's life: keep them, or build a new reducer on every \
                     rank",
                    self.control.rank()
                )));
            }
            return Ok(());
        }
        let (rank, world) = (self.control.rank(), self.control.world());
        // Peers may touch the memory only once its stream-ordered
        // allocation (and the caller's writes so far) completed here.
        self.stream
            .synchronize()
            .map_err(|e| ReduceError::device("synchronizing before the peer registration", e))?;
        let (flags, _guard) = self.flags.device_ptr(&self.stream);
        let reg = match &self.pool {
            None => Registration::local(own, flags),
            Some(pool) => register(
                &mut self.control,
                &Own {
                    ctx: self.stream.context(),
                    pool,
                    rank,
                    world,
                    len,
                    arenas: own,
                    flags,
                    timeout: self.opts.timeout,
                },
            )?,
        };
        drop(_guard);
        self.registration = Some(reg);
        Ok(())
    }

    /// Enqueue the barriers and this rank's shard fold, wait, and read the
    /// status.
    fn run(&mut self, len: usize) -> Result<()> {
        let Some(reg) = self.registration.as_ref() else {
            return Err(ReduceError::invariant("reduction before registration"));
        };
        let (world, rank) = (self.control.world(), self.control.rank());
        let logical = self.control.logical_world();
        let shard = ShardPlan::new(len, world)?.range(rank);
        let at = |p: CUdeviceptr| p + shard.start as u64 * 4;
        let addends: Vec<CUdeviceptr> = reg.arenas.iter().flatten().map(|&p| at(p)).collect();
        let dsts: Vec<CUdeviceptr> = reg.arenas.iter().map(|a| at(a[0])).collect();
        let factor = Some(mean_factor(logical));
        let n = shard.len();
        // A chain longer than one launch: its head goes to a scratch shard
        // first (det_chain continues from it across launches), and the last
        // launch starts from there.
        let head = addends.len().saturating_sub(MAX_CHAIN_ADDENDS - 1);
        if head > 0 && self.scratch.as_ref().is_none_or(|s| s.len() < n.max(1)) {
            self.scratch = Some(
                self.stream
                    .alloc_zeros::<f32>(n.max(1))
                    .map_err(|e| ReduceError::device("allocating the peer fold's scratch", e))?,
            );
        }
        let (status, _status_guard) = self.status.device_ptr(&self.stream);
        let timeout = self.opts.timeout;
        self.epoch += 1;
        // SAFETY: the registration's addresses are live device memory of
        // this context (its invariant) of at least len f32 (arenas) and
        // world u64 (flags); shard lies inside 0..len; between the two
        // barriers only this rank touches shard `rank` of any arena, and no
        // rank touches its arenas outside them until run() returns (they
        // are borrowed by reduce_mean); status is this rank's own word.
        unsafe {
            self.kernels
                .barrier(&self.stream, &reg.flags, rank, self.epoch, timeout, status)?;
            if n > 0 {
                let mut chain = addends.clone();
                if head > 0 {
                    let Some(scratch) = self.scratch.as_mut() else {
                        return Err(ReduceError::invariant("scratch missing"));
                    };
                    let (s, _g) = scratch.device_ptr_mut(&self.stream);
                    self.fold
                        .det_chain_raw(&self.stream, s, &addends[..head], n, None)?;
                    chain = std::iter::once(s)
                        .chain(addends[head..].iter().copied())
                        .collect();
                }
                self.kernels
                    .fold_fanout(&self.stream, &dsts, &chain, n, factor, status)?;
            }
            self.epoch += 1;
            self.kernels
                .barrier(&self.stream, &reg.flags, rank, self.epoch, timeout, status)?;
        }
        drop(_status_guard);
        let word = self
            .stream
            .clone_dtoh(&self.status)
            .map_err(|e| ReduceError::device("waiting for the peer fold", e))?;
        match PeerStatus::decode(word.first().copied().unwrap_or(0)) {
            PeerStatus::Ok => Ok(()),
            PeerStatus::TimedOut { peer } => Err(ReduceError::Comm(CommError::PeerFailed {
                rank: peer,
                detail: format!(
                    "it did not reach the peer fold's barrier within {timeout:?} (rank {rank} \
                     waited on the GPU); it died, hangs, or runs another collective"
                ),
            })),
            PeerStatus::Aborted { peer } => Err(ReduceError::Comm(CommError::PeerFailed {
                rank: peer,
                detail: format!(
                    "it aborted the peer fold (its own log says why); rank {rank} stops too"
                ),
            })),
            PeerStatus::Unknown(w) => Err(ReduceError::invariant(format!(
                "the peer fold's status word holds {w:#x}, which no kernel writes"
            ))),
        }
    }
}

impl<R: Reducer> Reducer for PeerReducer<R> {
    type Buffer = CudaSlice<f32>;

    fn contract(&self) -> ReduceContract {
        ReduceContract::FixedOrder
    }

    fn logical_world(&self) -> usize {
        self.control.logical_world()
    }

    fn world(&self) -> usize {
        self.control.world()
    }

    fn rank(&self) -> usize {
        self.control.rank()
    }

    fn reduce_mean(&mut self, local: &mut [CudaSlice<f32>]) -> Result<()> {
        if let Some(why) = &self.failed {
            return Err(ReduceError::config(format!(
                "this peer reducer stopped after a failure ({why}); tear the world down"
            )));
        }
        let len = match self.checked_len(local) {
            Ok(len) => len,
            Err(e) => return Err(self.fail(e)),
        };
        if !self.agreed {
            self.check_agreement(&RunIdentity::new(
                len,
                ReduceContract::FixedOrder,
                self.logical_world(),
                0,
            ))?;
        }
        if len == 0 {
            return Ok(());
        }
        // The arenas' addresses, through cudarc's tracking: the stream waits
        // for their last writes on other streams, and the guards record this
        // stream's use when they drop (after the wait in run()).
        let stream = self.stream.clone();
        let (first, rest) = local.split_at_mut(1);
        let (p0, g0) = first[0].device_ptr_mut(&stream);
        let mut own = vec![(p0, len)];
        let mut guards = Vec::with_capacity(rest.len());
        for a in rest.iter() {
            let (p, g) = a.device_ptr(&stream);
            own.push((p, len));
            guards.push(g);
        }
        let outcome = self.registered(&own, len).and_then(|()| self.run(len));
        drop(guards);
        drop(g0);
        outcome.map_err(|e| self.fail(e))
    }

    fn any(&mut self, flag: bool) -> Result<bool> {
        self.control.any(flag)
    }

    fn all_reduce_host(&mut self, v: &mut [f32]) -> Result<()> {
        self.control.all_reduce_host(v)
    }

    fn all_gather_host(&mut self, v: &[f32]) -> Result<Vec<f32>> {
        self.control.all_gather_host(v)
    }

    /// The control reducer's check, with the peer fold as the dataflow
    /// ([`RunIdentity::PEER_FOLD`]): a rank on the message dataflow fails
    /// it by name.
    fn check_agreement(&mut self, id: &RunIdentity) -> Result<()> {
        let id = RunIdentity {
            chunk_elems: RunIdentity::PEER_FOLD,
            ..*id
        };
        self.control.check_agreement(&id)?;
        self.agreed = true;
        Ok(())
    }

    fn all_reduce_host_logical(&mut self, per_logical: &[&[f32]]) -> Result<Vec<f32>> {
        self.control.all_reduce_host_logical(per_logical)
    }
}

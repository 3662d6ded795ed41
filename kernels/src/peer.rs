//! The peer kernels of `kernels/cuda/peer.cu`: the barrier and the fanned-out
//! fold that mamba-reduce's `PeerReducer` runs over gradient arenas that
//! other processes of the node own (mapped through CUDA memory-pool IPC).
//!
//! - [`PeerKernels::barrier`]: this rank's arrival in every rank's flag
//!   array, then a wait for every rank's, with a deadline measured on the
//!   GPU (`%globaltimer`) and an abort value, so a dead or failed peer ends
//!   as a [`PeerStatus`] naming it, never as a hang;
//! - [`PeerKernels::fold_fanout`]: the fixed-order chain of
//!   [`FoldKernel::det_chain`](crate::FoldKernel::det_chain) (the same
//!   per-element code, `fold_chain.cuh`), with the result written to up to
//!   [`MAX_PEERS`] destinations.
//!
//! Both take the rank's status word and do nothing once it records a
//! failure, so the launches after a failed barrier never touch peer memory.
//! Both are `unsafe`: they take raw device addresses, some of them in other
//! processes' memory, whose lifetime and exclusive use only the caller's
//! protocol can vouch for.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg,
};

use crate::device::load_module;
use crate::error::KernelError;
use crate::fold::MAX_CHAIN_ADDENDS;
use crate::launch::LaunchShape;

/// Most ranks a barrier spans, and most destinations a fold writes (the
/// by-value pointer arrays of `peer.cu`): one node's GPUs.
pub const MAX_PEERS: usize = 8;

/// The value of a flag slot that says "this peer failed": the top bit, with
/// any epoch below it. See [`PeerKernels::barrier`].
pub const ABORT_FLAG: u64 = 1 << 63;

const TIMED_OUT: u32 = 1 << 28;
const ABORTED: u32 = 2 << 28;
const PEER_MASK: u32 = (1 << 28) - 1;

/// What a rank's status word says after its barriers and folds ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerStatus {
    /// Every barrier completed.
    Ok,
    /// `peer` had not arrived when the deadline passed (dead, hung, or
    /// running another collective).
    TimedOut { peer: usize },
    /// `peer` posted an abort: it failed on its own side.
    Aborted { peer: usize },
    /// A value the kernels never write (memory corruption, or a status word
    /// that is not this crate's).
    Unknown(u32),
}

impl PeerStatus {
    /// Decode a status word.
    pub fn decode(word: u32) -> PeerStatus {
        let peer = (word & PEER_MASK) as usize;
        match word & !PEER_MASK {
            0 if word == 0 => PeerStatus::Ok,
            TIMED_OUT => PeerStatus::TimedOut { peer },
            ABORTED => PeerStatus::Aborted { peer },
            _ => PeerStatus::Unknown(word),
        }
    }
}

/// The loaded peer module of one context.
#[derive(Debug, Clone)]
pub struct PeerKernels {
    ctx: Arc<CudaContext>,
    _module: Arc<CudaModule>,
    barrier: CudaFunction,
    fold: CudaFunction,
    shape: LaunchShape,
}

impl PeerKernels {
    /// The module name (`kernels/cuda/peer.cu`).
    pub const MODULE: &'static str = "peer";
    /// Kernel symbol of [`Self::barrier`].
    pub const BARRIER_SYMBOL: &'static str = "peer_barrier";
    /// Kernel symbol of [`Self::fold_fanout`].
    pub const FOLD_SYMBOL: &'static str = "peer_fold_f32";

    /// Load the module into `ctx`; the fold's grid is one 1024-thread block
    /// per multiprocessor (a grid-stride loop: the shape changes no bit).
    pub fn load(ctx: &Arc<CudaContext>) -> Result<PeerKernels, KernelError> {
        let module = load_module(ctx, Self::MODULE)?;
        let function = |symbol: &str| {
            module.load_function(symbol).map_err(|e| {
                KernelError::driver(format!("looking up kernel {symbol} in module peer"), e)
            })
        };
        let barrier = function(Self::BARRIER_SYMBOL)?;
        let fold = function(Self::FOLD_SYMBOL)?;
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| KernelError::driver("querying the multiprocessor count", e))?;
        let shape = LaunchShape::for_device(1024, u32::try_from(sms).unwrap_or(1), 1)?;
        Ok(PeerKernels {
            ctx: ctx.clone(),
            _module: module,
            barrier,
            fold,
            shape,
        })
    }

    /// The context the module lives in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Enqueue barrier `epoch` on `stream`: this rank (`rank` of
    /// `flags.len()`) stores `epoch` into slot `rank` of every rank's flag
    /// array (`flags[q]` is rank `q`'s, `flags[rank]` this rank's own), then
    /// waits until every slot of its own array holds at least `epoch`. A
    /// slot with [`ABORT_FLAG`] set ends the wait with
    /// [`PeerStatus::Aborted`]; `timeout` after the kernel starts, a missing
    /// slot ends it with [`PeerStatus::TimedOut`]. Either is written to
    /// `status` (the first failure wins) and makes every later launch that
    /// takes `status` return at once.
    ///
    /// Refused before any launch: no ranks, more than [`MAX_PEERS`],
    /// `rank` out of range, a stream of another context.
    ///
    /// # Safety
    ///
    /// Every `flags[q]` must address at least `flags.len()` u64 of live
    /// device memory accessible from this context (IPC-mapped for peers)
    /// until the launch completes, slot `r` of each written only by rank
    /// `r`'s barriers (and its abort); `status` must address a live `u32` of
    /// this context's device memory. Every rank must run the same barriers
    /// with the same, increasing epochs (that is what makes `>=` correct).
    pub unsafe fn barrier(
        &self,
        stream: &CudaStream,
        flags: &[CUdeviceptr],
        rank: usize,
        epoch: u64,
        timeout: Duration,
        status: CUdeviceptr,
    ) -> Result<(), KernelError> {
        const NAME: &str = "peer_barrier";
        self.check_stream(NAME, stream)?;
        if flags.is_empty() || flags.len() > MAX_PEERS || rank >= flags.len() {
            return Err(KernelError::invalid(
                NAME,
                format!(
                    "rank {rank} of {} flag arrays; expected 1..={MAX_PEERS} arrays and a rank \
                     among them",
                    flags.len()
                ),
            ));
        }
        let mut list = [0u64; MAX_PEERS];
        list[..flags.len()].copy_from_slice(flags);
        let world = flags.len() as u32;
        let rank = rank as u32;
        let timeout_ns = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(&self.barrier);
        launch
            .arg(&list)
            .arg(&world)
            .arg(&rank)
            .arg(&epoch)
            .arg(&timeout_ns)
            .arg(&status);
        // SAFETY: the arguments match peer_barrier(FlagList {u64* p[8]} by
        // value, u32 world, u32 rank, u64 epoch, u64 timeout_ns, u32*
        // status); thread q < world touches flags[q][rank] and
        // flags[rank][q] only, addresses the caller vouches for.
        unsafe { launch.launch(cfg) }
            .map_err(|e| KernelError::driver(format!("launching {NAME} ({world} ranks)"), e))?;
        Ok(())
    }

    /// Enqueue `dsts[d][i] = ((a_0[i] + a_1[i]) + ...) + a_{n-1}[i]`, then
    /// `* factor` when `factor` is `Some`, for every destination `d` and
    /// `i < len`: per element exactly
    /// [`FoldKernel::det_chain`](crate::FoldKernel::det_chain)'s chain (so
    /// the host fold's bits). Does nothing once `status` records a failure.
    ///
    /// Refused before any launch: no addend or more than
    /// [`MAX_CHAIN_ADDENDS`] (a longer chain folds its head into a
    /// destination-free scratch first, with `det_chain_raw`); no
    /// destination or more than [`MAX_PEERS`]; a stream of another context.
    /// `len == 0` launches nothing.
    ///
    /// # Safety
    ///
    /// Every addend and destination must address at least `len` f32 of
    /// live device memory accessible from this context, 4-byte aligned,
    /// until the launch completes; a destination either equals an addend
    /// (the same address) or overlaps none of them nor another destination;
    /// nothing else may write those ranges, or read the destinations, while
    /// the launch runs (the barriers before and after it are how the peer
    /// reducer keeps that across processes). `status` as in
    /// [`Self::barrier`].
    pub unsafe fn fold_fanout(
        &self,
        stream: &CudaStream,
        dsts: &[CUdeviceptr],
        addends: &[CUdeviceptr],
        len: usize,
        factor: Option<f32>,
        status: CUdeviceptr,
    ) -> Result<(), KernelError> {
        const NAME: &str = "peer_fold";
        self.check_stream(NAME, stream)?;
        if addends.is_empty() || addends.len() > MAX_CHAIN_ADDENDS {
            return Err(KernelError::invalid(
                NAME,
                format!(
                    "{} addends; expected 1..={MAX_CHAIN_ADDENDS} (fold a longer chain's head \
                     first)",
                    addends.len()
                ),
            ));
        }
        if dsts.is_empty() || dsts.len() > MAX_PEERS {
            return Err(KernelError::invalid(
                NAME,
                format!("{} destinations; expected 1..={MAX_PEERS}", dsts.len()),
            ));
        }
        if len == 0 {
            return Ok(());
        }
        let mut dst_list = [0u64; MAX_PEERS];
        dst_list[..dsts.len()].copy_from_slice(dsts);
        let mut add_list = [0u64; MAX_CHAIN_ADDENDS];
        add_list[..addends.len()].copy_from_slice(addends);
        let (n_dst, n) = (dsts.len() as u32, addends.len() as u32);
        let l = len as u64;
        let (f, scale) = match factor {
            Some(f) => (f, 1u32),
            None => (1.0f32, 0u32),
        };
        let cfg = self.shape.config(l.div_ceil(4));
        let mut launch = stream.launch_builder(&self.fold);
        launch
            .arg(&dst_list)
            .arg(&n_dst)
            .arg(&add_list)
            .arg(&n)
            .arg(&l)
            .arg(&f)
            .arg(&scale)
            .arg(&status);
        // SAFETY: the arguments match peer_fold_f32(DstList {float* p[8]},
        // u32 n_dst, ChainTerms {const float* p[32]}, u32 n, u64 len, f32
        // factor, u32 scale, const u32* status); the kernel reads the first
        // n addends and writes the first n_dst destinations below len only,
        // addresses and exclusivity the caller vouches for.
        unsafe { launch.launch(cfg) }.map_err(|e| {
            KernelError::driver(
                format!("launching {NAME} ({n} addends to {n_dst} destinations x {len} elements)"),
                e,
            )
        })?;
        Ok(())
    }

    fn check_stream(&self, kernel: &'static str, stream: &CudaStream) -> Result<(), KernelError> {
        if stream.context().cu_ctx() == self.ctx.cu_ctx() {
            Ok(())
        } else {
            Err(KernelError::invalid(
                kernel,
                format!(
                    "stream belongs to the context of device {}, but the peer module was loaded \
                     into device {}'s; load PeerKernels per context",
                    stream.context().ordinal(),
                    self.ctx.ordinal()
                ),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_words_decode_to_the_peer_they_name() {
        assert_eq!(PeerStatus::decode(0), PeerStatus::Ok);
        assert_eq!(
            PeerStatus::decode(TIMED_OUT | 3),
            PeerStatus::TimedOut { peer: 3 }
        );
        assert_eq!(PeerStatus::decode(ABORTED), PeerStatus::Aborted { peer: 0 });
        assert_eq!(
            PeerStatus::decode(ABORTED | 7),
            PeerStatus::Aborted { peer: 7 }
        );
        // Both failure bits, or a high bit the kernels never set: unknown.
        assert_eq!(
            PeerStatus::decode(TIMED_OUT | ABORTED | 1),
            PeerStatus::Unknown(TIMED_OUT | ABORTED | 1)
        );
        assert_eq!(PeerStatus::decode(1 << 31), PeerStatus::Unknown(1 << 31));
        // The constants are those of peer.cu.
        let src = include_str!("../cuda/peer.cu");
        assert!(src.contains("constexpr unsigned kTimedOut = 1u << 28;"));
        assert!(src.contains("constexpr unsigned kAborted = 2u << 28;"));
        assert!(src.contains("constexpr unsigned long long kAbort = 1ull << 63;"));
        assert!(src.contains(&format!("constexpr unsigned kMaxPeers = {MAX_PEERS};")));
    }
}

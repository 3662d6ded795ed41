//! GPU worlds: what a GPU rank needs besides its model (the CUDA model is
//! a [`Backend`](crate::train::Backend) of the one engine): the checks that
//! this machine can run the world at all (before anything is spawned), the
//! device of each rank, and the NCCL communicator and reducer.
//!
//! One stream per rank carries everything: the communicator's
//! ([`NcclComm::stream`]), which the model is built on
//! ([`crate::model::cuda::CudaModel::with_stream`]), so forward/backward,
//! the reduction and the optimizer are ordered by the stream alone.
//!
//! A world of one (one GPU) runs the same path through a 1-rank
//! communicator: the same reducer and the same fixed-order plan as every
//! `P`, which is what makes its weights the bits of `--world P` at the
//! same logical world `L`.
//!
//! Setup order on every rank ([`crate::cli::run`]): [`preflight`] (driver,
//! devices, kernels, NCCL), [`rank_device`], the run and checkpoint,
//! [`connect`] (rendezvous + `NcclComm::init`), the model on the
//! communicator's stream, the trainer, [`reducer`]; at the end of a
//! successful run [`shutdown`] (finalize, destroy). The self-spawning
//! supervisor runs [`preflight`] and [`check_world_fits`] before it starts
//! any rank.

use std::sync::Arc;
use std::time::Duration;

use mamba_comm::bootstrap::WorldPlace;
use mamba_comm::nccl::{self, NcclComm, NcclOptions, NcclVersion};
use mamba_comm::rendezvous::{self, Rendezvous};
use mamba_comm::world_abort::AbortWatch;
use mamba_comm::Transport;
use mamba_reduce::{NcclReducer, PeerOptions, PeerReducer, ReduceContract, ReducerOptions};

use crate::dp::reduce_err;
use crate::error::{Result, TrainError};
use crate::train::RunConfig;

/// What this machine offers `--device cuda` (see [`preflight`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuHost {
    /// CUDA devices this process can see (after `CUDA_VISIBLE_DEVICES`).
    pub devices: usize,
    /// The NCCL library's version.
    pub nccl: NcclVersion,
}

fn missing(what: &str, detail: String) -> TrainError {
    TrainError::Cuda {
        what: format!("preparing --device cuda ({what})"),
        detail,
    }
}

/// Check, in this order, that the NVIDIA driver loads, at least one device
/// is visible, this build embeds the CUDA kernels and NCCL (>= 2.26) loads.
/// Each failure names what is missing and what to do. Cheap (no context is
/// created), so a supervisor runs it before spawning ranks and every rank
/// runs it again (a launcher's ranks have no supervisor).
///
/// NCCL is needed on one GPU too: a world of one reduces through a 1-rank
/// communicator with the same reducer and plan as every other world, which
/// is what makes its bits those of `--world P` at the same logical world.
pub fn preflight() -> Result<GpuHost> {
    if !kernels::driver_present() {
        return Err(missing(
            "no NVIDIA driver",
            "--device cuda needs an NVIDIA GPU and its driver, but libcuda.so.1 could not be \
             loaded: install the NVIDIA driver or add its directory (e.g. /usr/local/nvidia/lib64) \
             to LD_LIBRARY_PATH; on a machine without a GPU use --device cpu"
                .into(),
        ));
    }
    let devices = kernels::device_count()
        .map_err(|e| missing("cannot count devices", format!("{e}; check nvidia-smi")))?;
    if devices == 0 {
        return Err(missing(
            "no GPU",
            "the NVIDIA driver loads but reports no CUDA device (check nvidia-smi and \
             CUDA_VISIBLE_DEVICES); on a machine without a GPU use --device cpu"
                .into(),
        ));
    }
    if !kernels::available() {
        return Err(missing(
            "no kernels",
            format!(
                "this mamba-train was built without its CUDA kernels (nvcc was not found at \
                 build time): {}",
                kernels::HOW_TO_GET_KERNELS
            ),
        ));
    }
    let nccl = nccl::preflight().map_err(|e| {
        missing(
            "no NCCL",
            format!(
                "gradients are reduced through NCCL, also on one GPU, and NCCL is not usable: {e}"
            ),
        )
    })?;
    Ok(GpuHost { devices, nccl })
}

/// Refuse to start `world` GPU processes on this machine when fewer GPUs
/// are visible (NCCL refuses two ranks on one GPU), suggesting the largest
/// world that fits and divides `logical`, the run's logical world, which
/// keeps the bits. Run by the self-spawning supervisor before it spawns.
pub fn check_world_fits(host: &GpuHost, world: usize, logical: usize) -> Result<()> {
    if world <= host.devices {
        return Ok(());
    }
    let fits = (1..=host.devices)
        .rev()
        .find(|d| logical % d == 0)
        .unwrap_or(1);
    Err(TrainError::Config(format!(
        "--world {world} with --device cuda needs {world} GPUs (one per process: NCCL cannot put \
         two ranks on one GPU), but {} {} visible; run --world {fits} --logical-world {logical} \
         instead: at the same logical world the weights are the same bits for every number of \
         processes",
        host.devices,
        if host.devices == 1 { "is" } else { "are" },
    )))
}

/// The CUDA device of the rank at `place`: its local rank.
///
/// One exception: a rank that sees exactly one device while its local rank
/// is higher, with `CUDA_VISIBLE_DEVICES` set (`visible`), was given a GPU
/// of its own by its launcher (e.g. `srun --gpus-per-task 1`): that GPU is
/// device 0. (Should two ranks still share it, NCCL refuses at init, with
/// its own message.) Otherwise a local rank without a device is an error
/// naming both.
pub fn rank_device(host: &GpuHost, place: &WorldPlace, visible: Option<&str>) -> Result<usize> {
    let local = place.device();
    if local < host.devices {
        return Ok(local);
    }
    let bound = visible.is_some_and(|v| !v.trim().is_empty());
    if host.devices == 1 && bound {
        return Ok(0);
    }
    Err(TrainError::Config(format!(
        "rank {} of {} has local rank {local} ({}) and so uses CUDA device {local}, but this node \
         shows it {} device{} (CUDA_VISIBLE_DEVICES {}); start at most {} process{} per node, one \
         per GPU, and use --logical-world for more logical ranks (the same bits for every number \
         of processes)",
        place.rank,
        place.world,
        place.launcher.local_rank_var(),
        host.devices,
        if host.devices == 1 { "" } else { "s" },
        match visible {
            Some(v) => format!("={v:?}"),
            None => "unset".to_string(),
        },
        host.devices,
        if host.devices == 1 { "" } else { "es" },
    )))
}

/// One GPU rank's link to its world.
///
/// Ownership: the rendezvous is kept for the communicator's lifetime, as
/// for CPU worlds (under a TCP rendezvous rank 0 serves the store); the
/// communicator's world-abort watch holds a second reference until the
/// communicator is gone. The communicator owns its stream, on which the
/// model, the reducer and the optimizer all work.
pub struct CudaLink {
    /// The rendezvous the ranks met through (the NCCL unique id went
    /// through it), and the world abort's board
    /// ([`super::world_abort::post_failure`] posts this rank's failure
    /// there).
    pub rendezvous: Arc<dyn Rendezvous>,
    /// This rank's communicator, on its device.
    pub comm: NcclComm,
}

/// Meet the other ranks of `place` and create this rank's communicator on
/// CUDA `device`. `timeout` bounds the meeting, NCCL's init and every
/// later collective window (a peer that does not arrive is an error after
/// it, never an eternal wait). A world of one needs nobody: its 1-rank
/// communicator meets through an in-memory rendezvous.
///
/// The communicator watches the rendezvous for another rank's posted
/// failure ([`mamba_comm::world_abort`]): a peer that fails outside a
/// collective ends this rank's waits at once, naming it.
pub fn connect(place: &WorldPlace, device: usize, timeout: Duration) -> Result<CudaLink> {
    let rendezvous: Arc<dyn Rendezvous> = Arc::from(rendezvous::open(place, timeout)?);
    let opts = NcclOptions {
        init_timeout: timeout,
        collective_timeout: timeout,
    };
    let mut comm = NcclComm::init(place.rank, place.world, device, &*rendezvous, opts)?;
    if place.world > 1 {
        comm.watch_aborts(AbortWatch::start(rendezvous.clone())?);
    }
    Ok(CudaLink { rendezvous, comm })
}

/// The reducer of `run` (its contract and logical world) over `comm`
/// (loads the fold kernels into the communicator's context).
pub fn reducer(comm: NcclComm, run: &RunConfig) -> Result<NcclReducer> {
    NcclReducer::new(comm, ReducerOptions::new(run.contract, run.logical_world)).map_err(reduce_err)
}

/// `--peer-fold` keeps the fixed-order contract only (the contract comes
/// from `--contract` or the checkpoint of `--resume`).
pub fn check_peer_fold(run: &RunConfig) -> Result<()> {
    if run.contract == ReduceContract::FixedOrder {
        return Ok(());
    }
    Err(TrainError::Config(format!(
        "--peer-fold folds in fixed order only, but this run's contract is {} (from --contract \
         or the checkpoint it resumes); drop --peer-fold or train with --contract fixed-order",
        run.contract
    )))
}

/// Make the device's memory shareable with the node's other ranks (the
/// peer fold maps every rank's gradient arenas): installs the exportable
/// pool ([`mamba_comm::ipc::SharedPool`]), so call it before the model
/// allocates. A world of one shares nothing.
pub fn share_arenas(comm: &NcclComm) -> Result<()> {
    if comm.world() > 1 {
        mamba_comm::ipc::SharedPool::install(comm.stream().context())?;
    }
    Ok(())
}

/// The peer fold over `control` (which keeps the host collectives), on the
/// model's `stream`, with `timeout` for its barriers.
pub fn peer_reducer(
    control: NcclReducer,
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
    timeout: Duration,
) -> Result<PeerReducer<NcclReducer>> {
    PeerReducer::new(control, stream, PeerOptions { timeout }).map_err(reduce_err)
}

/// Orderly end of a finished rank's communicator: NCCL's finalize, then
/// destroy (see [`NcclComm::shutdown`]). Only after a run that succeeded;
/// after a failure the communicator is dropped instead, which aborts it
/// (peers may be gone or waiting).
pub fn shutdown(reducer: NcclReducer) -> Result<()> {
    let (comm, _fold) = reducer.into_parts();
    comm.shutdown()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use mamba_comm::bootstrap::Launcher;

    fn host(devices: usize) -> GpuHost {
        GpuHost {
            devices,
            nccl: NcclVersion::new(2, 28, 3),
        }
    }

    #[test]
    fn more_processes_than_gpus_is_refused_with_a_world_that_fits() {
        check_world_fits(&host(2), 2, 4).unwrap();
        check_world_fits(&host(2), 1, 1).unwrap();
        let e = check_world_fits(&host(2), 4, 4).unwrap_err().to_string();
        assert!(
            e.contains("--world 4 with --device cuda needs 4 GPUs"),
            "{e}"
        );
        assert!(e.contains("but 2 are visible"), "{e}");
        assert!(e.contains("run --world 2 --logical-world 4 instead"), "{e}");
        // The suggestion divides L: L = 3 on 2 GPUs can only run on one.
        let e = check_world_fits(&host(2), 3, 3).unwrap_err().to_string();
        assert!(e.contains("run --world 1 --logical-world 3"), "{e}");
        let e = check_world_fits(&host(1), 2, 2).unwrap_err().to_string();
        assert!(e.contains("but 1 is visible"), "{e}");
    }

    #[test]
    fn a_rank_uses_its_local_rank_or_the_one_gpu_its_launcher_bound() {
        let mut place = WorldPlace::single();
        place.world = 4;
        place.rank = 3;
        place.local_rank = 1;
        place.launcher = Launcher::Slurm;
        assert_eq!(rank_device(&host(2), &place, None).unwrap(), 1);
        // A launcher that binds one GPU per task: the rank sees device 0 only.
        assert_eq!(rank_device(&host(1), &place, Some("3")).unwrap(), 0);
        // One GPU and no binding: two ranks would share it.
        let e = rank_device(&host(1), &place, None).unwrap_err().to_string();
        assert!(
            e.contains("shows it 1 device (CUDA_VISIBLE_DEVICES unset)"),
            "{e}"
        );
        assert!(e.contains("at most 1 process per node"), "{e}");
        place.local_rank = 2;
        let e = rank_device(&host(2), &place, Some("0,1"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 3 of 4 has local rank 2 (SLURM_LOCALID)"),
            "{e}"
        );
        assert!(e.contains("--logical-world"), "{e}");
    }
}

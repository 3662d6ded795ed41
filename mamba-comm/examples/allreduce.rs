//! Start a world by any of the four lanes and all-reduce a vector.
//!
//! ```text
//! allreduce [--world N] [--len N] [--rounds N] [--transport host|nccl] [--timeout-s S]
//! ```
//!
//! Lanes (the program finds out which one it is in from the environment):
//! - self-spawn: `allreduce --world 4` re-executes itself as 4 ranks;
//! - torchrun:   `torchrun --standalone --nproc-per-node 4 --no-python target/release/examples/allreduce`
//!   (ranks meet in a TCP store served by rank 0 at `MASTER_ADDR`, port
//!   `MASTER_PORT + 1` because torchrun's own store holds `MASTER_PORT`;
//!   set `MAMBA_STORE_PORT` to choose another);
//! - SLURM:      `srun -N1 -n4 target/release/examples/allreduce`
//!   (several nodes: export `MAMBA_RENDEZVOUS_DIR=<shared dir>` or
//!   `MASTER_ADDR=<node0> MASTER_PORT=<port>` first);
//! - Open MPI:   `mpirun -np 4 target/release/examples/allreduce`.
//!
//! `--transport host` (default) moves host memory over loopback sockets
//! (all ranks on one host). `--transport nccl` uses the NCCL communicator
//! on GPU `local_rank` of each rank (one GPU per rank).
//!
//! Every rank checks the result exactly (the values are small integers, so
//! any summation order gives the same bits) and prints one line; the
//! supervisor prints every rank's exit. Exit code 0 only if all is well.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use mamba_comm::bootstrap::ProcessEnv;
use mamba_comm::host::{HostOptions, HostTransport};
use mamba_comm::nccl::{self, NcclComm, NcclOptions};
use mamba_comm::supervisor::{start_world, Role, SpawnOptions};
use mamba_comm::{rendezvous, CommError, Result, Transport};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Host,
    Nccl,
}

struct Args {
    world: Option<usize>,
    len: usize,
    rounds: usize,
    transport: Kind,
    timeout: Duration,
}

const USAGE: &str =
    "usage: allreduce [--world N] [--len N] [--rounds N] [--transport host|nccl] [--timeout-s S]";

fn parse_args() -> std::result::Result<Args, String> {
    let mut a = Args {
        world: None,
        len: 1 << 20,
        rounds: 3,
        transport: Kind::Host,
        timeout: Duration::from_secs(60),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value\n{USAGE}"))
        };
        let number = |name: &str, v: String| {
            v.parse::<usize>()
                .map_err(|_| format!("{name}: {v:?} is not a number"))
        };
        match flag.as_str() {
            "--world" => a.world = Some(number("--world", value("--world")?)?),
            "--len" => a.len = number("--len", value("--len")?)?,
            "--rounds" => a.rounds = number("--rounds", value("--rounds")?)?,
            "--timeout-s" => {
                a.timeout =
                    Duration::from_secs(number("--timeout-s", value("--timeout-s")?)? as u64)
            }
            "--transport" => {
                a.transport = match value("--transport")?.as_str() {
                    "host" => Kind::Host,
                    "nccl" => Kind::Nccl,
                    other => return Err(format!("--transport {other:?}: expected host or nccl")),
                }
            }
            "-h" | "--help" => return Err(USAGE.to_string()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    Ok(a)
}

/// Rank r contributes `(r + 1) + (i % 7)` at element i; the exact sum is
/// `world (world + 1) / 2 + world (i % 7)` in any order.
fn contribution(rank: usize, i: usize) -> f32 {
    (rank + 1) as f32 + (i % 7) as f32
}

fn expected(world: usize, i: usize) -> f32 {
    (world * (world + 1) / 2) as f32 + (world * (i % 7)) as f32
}

/// The same code for every transport: upload, all-reduce, download, check.
fn all_reduce<T: Transport>(t: &mut T, len: usize, rounds: usize) -> Result<Duration> {
    let (rank, world) = (t.rank(), t.world());
    let host: Vec<f32> = (0..len).map(|i| contribution(rank, i)).collect();
    let mut buf = t.alloc(len)?;
    let mut best = Duration::MAX;
    let mut out = vec![0.0f32; len];
    for _ in 0..rounds.max(1) {
        t.upload(&host, &mut buf, 0)?;
        t.barrier()?;
        let start = Instant::now();
        t.all_reduce_sum_f32(&mut buf, 0..len)?;
        t.download(&buf, 0, &mut out)?;
        best = best.min(start.elapsed());
    }
    if let Some(i) = (0..len).find(|&i| out[i] != expected(world, i)) {
        return Err(CommError::ReplicaDivergence {
            detail: format!(
                "rank {rank}: element {i} is {} but the sum must be {}",
                out[i],
                expected(world, i)
            ),
        });
    }
    Ok(best)
}

fn rank_main(args: &Args, place: mamba_comm::bootstrap::WorldPlace) -> Result<()> {
    let rdv = rendezvous::open(&place, args.timeout)?;
    let best = match args.transport {
        Kind::Host => {
            let mut t = HostTransport::connect(&*rdv, HostOptions::with_timeout(args.timeout))?;
            let best = all_reduce(&mut t, args.len, args.rounds)?;
            t.shutdown()?;
            best
        }
        // The NCCL transport plugs in here: same rendezvous, same Transport
        // trait, device memory; one GPU per rank (its local rank).
        Kind::Nccl => {
            let opts = NcclOptions {
                init_timeout: args.timeout,
                collective_timeout: args.timeout,
            };
            let mut c = NcclComm::init(place.rank, place.world, place.device(), &*rdv, opts)?;
            let best = all_reduce(&mut c, args.len, args.rounds)?;
            c.shutdown()?;
            best
        }
    };
    let gbps = (args.len * 4) as f64 / best.as_secs_f64().max(1e-9) / 1e9;
    println!(
        "rank {}/{} ({:?}, local rank {}): all-reduced {} f32 over {:?}: ok, best of {} in {:?} ({gbps:.2} GB/s algbw)",
        place.rank, place.world, place.launcher, place.local_rank, args.len, args.transport, args.rounds, best
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
    // Check NCCL once, before any rank is spawned.
    if args.transport == Kind::Nccl {
        if let Err(e) = nccl::preflight() {
            eprintln!("allreduce: {e}");
            return ExitCode::FAILURE;
        }
    }
    match start_world(&ProcessEnv, args.world, SpawnOptions::default()) {
        Ok(Role::Rank(place)) => match rank_main(&args, place) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("allreduce: {e}");
                ExitCode::FAILURE
            }
        },
        Ok(Role::Supervised(report)) => {
            println!(
                "supervisor: world of {} ended in {:?}\n{report}",
                report.ranks.len(),
                report.elapsed
            );
            match report.check() {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("allreduce: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Err(e) => {
            eprintln!("allreduce: {e}");
            ExitCode::FAILURE
        }
    }
}

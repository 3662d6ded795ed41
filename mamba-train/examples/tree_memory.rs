//! Gradient and optimizer memory and step time of the data-parallel engine
//! under `fixed-order` (the chain: one arena per local logical rank),
//! `fixed-tree` (the binary counter: `log2(L/P) + 1` arenas) and
//! `fixed-tree` with ZeRO-1 (`--shard-optimizer`: each rank keeps `1/P` of
//! the AdamW moments), for `L/P = 1, 2, 4, ..., 64` micro-batches per
//! process, at `--world P` ranks.
//!
//! ```text
//! cargo run --release -p mamba-train --example tree_memory -- \
//!     [--device cpu|cuda] [--world 1] [--blocks 1,2,4,8,16,32,64] [--steps 3] \
//!     [--warmup 1] [--rounds 1] [--d-model 256] [--layers 2] [--batch 1] [--seq-len 32]
//! ```
//!
//! Every (configuration, `L/P`) point runs in a fresh child process (this
//! program re-executed with `--child`), so each measured high-water mark
//! is that configuration's alone. On the CPU the `P` ranks are threads of
//! that child over the host transport (the same engine and reducer as
//! `--world P` processes, without sockets); on CUDA `P` is 1 (a 1-GPU
//! machine cannot hold a 2-rank NCCL world), so there ZeRO-1 has one shard,
//! the whole arena, and its column shows that it costs nothing at `P = 1`.
//! Per point:
//! - `arenas`: gradient arenas the engine allocated per rank
//!   ([`DataParallel::gradient_arenas`]), and their bytes;
//! - `opt MiB`: the AdamW moments one rank holds (`2 |shard|` f32; the
//!   whole arena twice unsharded), counted from the optimizer's shard;
//! - CPU: the process's peak resident memory (`VmHWM` of
//!   `/proc/self/status`) after the steps, minus its resident memory
//!   (`VmRSS`) just before the model was built: the whole training
//!   footprint (weights, AdamW moments, gradients, activations), so the
//!   configurations differ by their gradient arenas and moments alone;
//!   with `P > 1` threads, that process total divided by `P` (every rank
//!   holds the same weights and activations);
//! - CUDA (one GPU, a 1-rank NCCL world: the logical world on one device):
//!   device memory in use after the steps minus before the model (the
//!   engine allocates every gradient arena up front, so this is its
//!   high-water as well, up to the allocator's caching);
//! - `step ms`: the median wall time of the timed steps (after `--warmup`
//!   untimed ones); a step is `L/P` forward/backward passes, the reduction
//!   and AdamW;
//! - `cpu ms` (CPU only): the median process CPU time of those steps (all
//!   threads, `CLOCK_PROCESS_CPUTIME_ID`): on a shared machine, whose wall
//!   times move with the other users' load, the steadier measure of the
//!   work a step does.
//!
//! The printed table is what `docs/PERFORMANCE.md` records.

use std::process::Command;
use std::time::{Duration, Instant};

use clap::Parser;
use mamba_reduce::ReduceContract;
use mamba_reduce::Reducer;
use mamba_train::config::ModelConfig;
use mamba_train::data::{SelectiveCopyConfig, TaskSpec};
use mamba_train::dp::{self, DataParallel, DpOptions};
use mamba_train::optim::{AdamWConfig, Schedule};
use mamba_train::train::{Backend, RunConfig, Trainer};

#[derive(Parser, Debug, Clone)]
#[command(about = "Gradient memory and step time: fixed-order vs fixed-tree against L/P")]
struct Args {
    /// cpu (the reference model) or cuda (one GPU).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Ranks `P` (CPU: threads over the host transport; CUDA: 1).
    #[arg(long, default_value_t = 1)]
    world: usize,
    /// Micro-batches per process (`L/P`; `L` is `P` times this).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    blocks: Vec<usize>,
    /// Timed steps per point.
    #[arg(long, default_value_t = 3)]
    steps: u64,
    /// Untimed leading steps per point.
    #[arg(long, default_value_t = 1)]
    warmup: u64,
    /// Child processes per point, chain and tree alternating, each first in
    /// every other round (so a change in the machine's load or an order
    /// effect hits both alike); the table shows the median
    /// over rounds of each round's median step time.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Residual width.
    #[arg(long, default_value_t = 256)]
    d_model: usize,
    /// Mamba blocks.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Rows per micro-batch.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Tokens per row.
    #[arg(long, default_value_t = 32)]
    seq_len: usize,
    /// Internal: measure one point (`CONFIG:BLOCKS`, CONFIG one of
    /// `CONFIGS`) and print it.
    #[arg(long, hide = true)]
    child: Option<String>,
}

/// The configurations of a row, in column order: (name, contract, ZeRO-1).
const CONFIGS: [(&str, ReduceContract, bool); 3] = [
    ("chain", ReduceContract::FixedOrder, false),
    ("tree", ReduceContract::FixedTree, false),
    ("tree+zero", ReduceContract::FixedTree, true),
];

/// One measured point.
struct Point {
    arenas: usize,
    arena_bytes: u64,
    optimizer_bytes: u64,
    footprint_bytes: u64,
    step_ms: f64,
    cpu_ms: f64,
}

fn main() {
    let args = Args::parse();
    let result = match &args.child {
        Some(point) => child(&args, point),
        None => parent(&args),
    };
    if let Err(e) = result {
        eprintln!("tree_memory: {e}");
        std::process::exit(1);
    }
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn parent(args: &Args) -> Res<()> {
    let exe = std::env::current_exe()?;
    if args.device == "cuda" && args.world != 1 {
        return Err(format!(
            "--world {} with --device cuda: one GPU holds a 1-rank NCCL world only; use --world 1",
            args.world
        )
        .into());
    }
    println!(
        "device {}, P = {}, d_model {}, {} layers, {} x {} tokens per micro-batch, {} timed steps after {} warm-up, {} rounds",
        args.device, args.world, args.d_model, args.layers, args.batch, args.seq_len, args.steps, args.warmup, args.rounds
    );
    println!();
    print!("| L/P |");
    for (name, _, _) in CONFIGS {
        print!(" {name} arenas | {name} grad MiB | {name} opt MiB | {name} footprint MiB | {name} step ms | {name} cpu ms |");
    }
    println!(" tree/chain cpu | tree+zero/chain cpu |");
    println!("|---:|{}---:|---:|", "---:|".repeat(6 * CONFIGS.len()));
    for &b in &args.blocks {
        let mut rounds: Vec<Vec<Point>> = CONFIGS.iter().map(|_| Vec::new()).collect();
        for round in 0..args.rounds.max(1) {
            // Each configuration goes first in turn (so a change in the
            // machine's load or an order effect hits all alike).
            for i in 0..CONFIGS.len() {
                let k = (i + round) % CONFIGS.len();
                let name = CONFIGS[k].0;
                let out = Command::new(&exe)
                    .args(std::env::args().skip(1))
                    .arg("--child")
                    .arg(format!("{name}:{b}"))
                    .output()?;
                if !out.status.success() {
                    return Err(format!(
                        "{name} at L/P = {b} failed: {}",
                        String::from_utf8_lossy(&out.stderr)
                    )
                    .into());
                }
                rounds[k].push(parse_point(&String::from_utf8_lossy(&out.stdout))?);
            }
        }
        let row: Vec<Point> = rounds.into_iter().map(median_point).collect();
        let mib = |x: u64| x as f64 / (1 << 20) as f64;
        print!("| {b} |");
        for p in &row {
            print!(
                " {} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} |",
                p.arenas,
                mib(p.arenas as u64 * p.arena_bytes),
                mib(p.optimizer_bytes),
                mib(p.footprint_bytes),
                p.step_ms,
                p.cpu_ms
            );
        }
        println!(
            " {:.3} | {:.3} |",
            row[1].cpu_ms / row[0].cpu_ms,
            row[2].cpu_ms / row[0].cpu_ms
        );
    }
    Ok(())
}

fn parse_point(stdout: &str) -> Res<Point> {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("POINT "))
        .ok_or_else(|| format!("the child printed no POINT line: {stdout}"))?;
    let v: Vec<&str> = line.split_whitespace().collect();
    if v.len() != 6 {
        return Err(format!("malformed POINT line {line:?}").into());
    }
    Ok(Point {
        arenas: v[0].parse()?,
        arena_bytes: v[1].parse()?,
        optimizer_bytes: v[2].parse()?,
        footprint_bytes: v[3].parse()?,
        step_ms: v[4].parse()?,
        cpu_ms: v[5].parse()?,
    })
}

/// The point with the median wall time of `points`, its CPU time replaced by
/// the median CPU time and its footprint by the largest (memory is the
/// same every round up to the allocator; time is what varies).
fn median_point(mut points: Vec<Point>) -> Point {
    let mid = points.len() / 2;
    let mut cpu: Vec<f64> = points.iter().map(|p| p.cpu_ms).collect();
    cpu.sort_by(f64::total_cmp);
    let footprint = points.iter().map(|p| p.footprint_bytes).max().unwrap_or(0);
    points.sort_by(|a, b| a.step_ms.total_cmp(&b.step_ms));
    let mut p = points.swap_remove(mid);
    p.cpu_ms = cpu[mid];
    p.footprint_bytes = footprint;
    p
}

fn run_config(args: &Args, contract: ReduceContract, blocks: usize) -> RunConfig {
    let task = TaskSpec::SelectiveCopy(SelectiveCopyConfig {
        seq_len: args.seq_len,
        n_memorize: (args.seq_len / 4).max(1),
        alphabet: 8,
    });
    RunConfig {
        seed: 7,
        model: ModelConfig::new(task.vocab_size(), args.d_model, args.layers),
        task,
        batch: args.batch,
        logical_world: blocks * args.world,
        contract,
        optimizer: AdamWConfig::default(),
        schedule: Schedule {
            peak_lr: 1e-3,
            warmup_steps: 1,
            total_steps: args.warmup + args.steps,
            min_lr_frac: 0.1,
        },
    }
}

fn child(args: &Args, point: &str) -> Res<()> {
    let (name, blocks) = point
        .split_once(':')
        .ok_or_else(|| format!("--child wants CONFIG:BLOCKS, got {point:?}"))?;
    let (_, contract, zero) = CONFIGS
        .iter()
        .find(|c| c.0 == name)
        .copied()
        .ok_or_else(|| format!("--child: unknown configuration {name:?}"))?;
    let run = run_config(args, contract, blocks.parse()?);
    let opts = DpOptions {
        shard_optimizer: zero,
        ..DpOptions::default()
    };
    let m = match args.device.as_str() {
        "cpu" => cpu_point(&run, args, opts)?,
        "cuda" => cuda_point(&run, args, opts)?,
        other => return Err(format!("--device {other:?}: expected cpu or cuda").into()),
    };
    let (wall, cpu): (Vec<Duration>, Vec<Duration>) = m.times.into_iter().unzip();
    println!(
        "POINT {} {} {} {} {:.4} {:.4}",
        m.arenas,
        m.arena_bytes,
        m.optimizer_bytes,
        m.footprint_bytes,
        median_ms(wall),
        median_ms(cpu)
    );
    Ok(())
}

/// Step `world` through the warm-up and the timed steps: (wall, process
/// CPU) time of each timed step.
fn time_steps<B, R>(world: &mut DataParallel<B, R>, args: &Args) -> Res<Vec<(Duration, Duration)>>
where
    B: Backend,
    R: Reducer<Buffer = B::Arena>,
{
    for _ in 0..args.warmup {
        world.step()?;
    }
    let mut times = Vec::new();
    for _ in 0..args.steps {
        let (t, cpu) = (Instant::now(), process_cpu_time());
        world.step()?;
        times.push((t.elapsed(), process_cpu_time().saturating_sub(cpu)));
    }
    Ok(times)
}

/// CPU time of this process so far, all threads.
fn process_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call's duration;
    // CLOCK_PROCESS_CPUTIME_ID exists on every Linux this runs on (on an
    // error `ts` stays zero, which only zeroes the measurement).
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    Duration::new(
        ts.tv_sec.max(0) as u64,
        ts.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

/// What a child measured (per rank).
struct Measured {
    arenas: usize,
    arena_bytes: u64,
    optimizer_bytes: u64,
    footprint_bytes: u64,
    /// Rank 0's (wall, CPU) time per timed step.
    times: Vec<(Duration, Duration)>,
}

/// The moments one rank's optimizer holds, in bytes.
fn optimizer_bytes<B: Backend>(trainer: &Trainer<B>) -> u64 {
    8 * trainer.optimizer().adamw().shard().len() as u64
}

fn cpu_point(run: &RunConfig, args: &Args, opts: DpOptions) -> Res<Measured> {
    use mamba_comm::host::{HostOptions, HostTransport};
    let world = args.world.max(1);
    let transports =
        HostTransport::thread_world(world, HostOptions::with_timeout(Duration::from_secs(600)))?;
    let before = proc_status_kib("VmRSS")?;
    // Errors cross the thread boundary as text (boxed errors are not Send).
    let ranks: Vec<Result<Measured, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = transports
            .into_iter()
            .map(|t| {
                s.spawn(move || {
                    let rank = || -> Res<Measured> {
                        let model = mamba_train::model::cpu::CpuModel::new(run.model.clone())?;
                        let trainer = Trainer::new(model, run.clone())?;
                        let arena_bytes = 4 * trainer.arena_len() as u64;
                        let reducer = dp::host::reducer(t, run);
                        let mut dp = DataParallel::new(trainer, reducer, opts)?;
                        let times = time_steps(&mut dp, args)?;
                        let arenas = dp.gradient_arenas();
                        let (trainer, _) = dp.into_parts();
                        Ok(Measured {
                            arenas,
                            arena_bytes,
                            optimizer_bytes: optimizer_bytes(&trainer),
                            footprint_bytes: 0,
                            times,
                        })
                    };
                    rank().map_err(|e| e.to_string())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a rank thread panicked".into()))
            })
            .collect()
    });
    let peak = proc_status_kib("VmHWM")?;
    let mut ranks = ranks.into_iter().collect::<Result<Vec<_>, String>>()?;
    let mut m = ranks.swap_remove(0);
    m.footprint_bytes = 1024 * peak.saturating_sub(before) / world as u64;
    Ok(m)
}

fn cuda_point(run: &RunConfig, args: &Args, opts: DpOptions) -> Res<Measured> {
    use mamba_comm::bootstrap::WorldPlace;
    use mamba_train::model::cuda::CudaModel;
    dp::cuda::preflight()?;
    let place = WorldPlace::single();
    let link = dp::cuda::connect(&place, 0, Duration::from_secs(120))?;
    let ctx = link.comm.stream().context().clone();
    let used = || -> Res<u64> {
        let (free, total) = ctx.mem_get_info()?;
        Ok((total - free) as u64)
    };
    let before = used()?;
    let model = CudaModel::with_stream(run.model.clone(), link.comm.stream().clone())?;
    let trainer = Trainer::new(model, run.clone())?;
    let arena_bytes = 4 * trainer.arena_len() as u64;
    let reducer = dp::cuda::reducer(link.comm, run)?;
    let mut world = DataParallel::new(trainer, reducer, opts)?;
    let times = time_steps(&mut world, args)?;
    let after = used()?;
    let arenas = world.gradient_arenas();
    let (trainer, reducer) = world.into_parts();
    let optimizer_bytes = optimizer_bytes(&trainer);
    drop(trainer);
    dp::cuda::shutdown(reducer)?;
    drop(link.rendezvous);
    Ok(Measured {
        arenas,
        arena_bytes,
        optimizer_bytes,
        footprint_bytes: after.saturating_sub(before),
        times,
    })
}

/// A `kB` field of `/proc/self/status` (Linux).
fn proc_status_kib(field: &str) -> Res<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| format!("no {field} in /proc/self/status").into())
}

fn median_ms(mut times: Vec<Duration>) -> f64 {
    times.sort();
    times
        .get(times.len() / 2)
        .map_or(f64::NAN, |t| t.as_secs_f64() * 1e3)
}

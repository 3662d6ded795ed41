//! Benchmark: the fixed-order reducer and the library-sum reducer against
//! NCCL's own f32 all-reduce, on the same buffers in the same processes.
//!
//! ```text
//! bench_reduce [--world 2] [--sizes-mib 4,8,...,1024] [--reps N] [--warmup N]
//!              [--chunk-elems N] [--pipeline] [--markdown FILE]
//! ```
//!
//! Started without a launcher it re-executes itself as `--world` ranks (one
//! GPU each) through the supervisor; under torchrun/SLURM/MPI or the
//! project's `MAMBA_*` contract it is one rank. Every timed call is
//! synchronous (each returns once the stream has completed its work), so a
//! rank's wall-clock time of one call is that call's full latency,
//! including the host's waits between groups. Ranks meet at a barrier
//! before every call; the reported time is the median over repetitions, and
//! the maximum of that median over ranks. Rank 0 prints a plain table and
//! the same table in markdown.
//!
//! Columns: `nccl` = `NcclComm::all_reduce_sum_f32` (the library's own
//! all-reduce, no scaling); `fixed` = `FixedOrder` mean (`P = L`);
//! `lib` = `NcclSum` mean (all-reduce + scale); with `--pipeline`,
//! `fixed L=2P` = `FixedOrder` with two logical ranks per process (the
//! running-prefix pipeline). Ratios are against `nccl`.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use cudarc::driver::CudaSlice;
use mamba_comm::bootstrap::{detect, is_rank_process, ProcessEnv};
use mamba_comm::nccl::{self, NcclComm, NcclOptions};
use mamba_comm::supervisor::{spawn_world, SpawnOptions};
use mamba_comm::{rendezvous, Transport};
use mamba_reduce::{
    KernelFold, NcclReducer, ReduceContract, Reducer, ReducerOptions, TransportReducer,
};

#[derive(Clone, Debug)]
struct Args {
    world: usize,
    sizes_mib: Vec<usize>,
    reps: Option<usize>,
    warmup: usize,
    chunk_elems: Option<usize>,
    pipeline: bool,
    markdown: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        world: 2,
        sizes_mib: vec![4, 8, 16, 32, 64, 128, 256, 512, 1024],
        reps: None,
        warmup: 3,
        chunk_elems: None,
        pipeline: false,
        markdown: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        let num =
            |name: &str, v: String| v.parse::<usize>().map_err(|e| format!("{name} {v:?}: {e}"));
        match flag.as_str() {
            "--world" => a.world = num("--world", value("--world")?)?,
            "--sizes-mib" => {
                a.sizes_mib = value("--sizes-mib")?
                    .split(',')
                    .map(|s| {
                        s.trim()
                            .parse::<usize>()
                            .map_err(|e| format!("--sizes-mib {s:?}: {e}"))
                    })
                    .collect::<Result<_, _>>()?
            }
            "--reps" => a.reps = Some(num("--reps", value("--reps")?)?),
            "--warmup" => a.warmup = num("--warmup", value("--warmup")?)?,
            "--chunk-elems" => a.chunk_elems = Some(num("--chunk-elems", value("--chunk-elems")?)?),
            "--pipeline" => a.pipeline = true,
            "--markdown" => a.markdown = Some(value("--markdown")?),
            // libtest-style flags cargo may pass to examples are not ours.
            "--bench" => {}
            other => {
                return Err(format!(
                    "unknown argument {other:?} (see the file's docs for the flags)"
                ))
            }
        }
    }
    if a.world < 2 || a.sizes_mib.is_empty() || a.sizes_mib.contains(&0) {
        return Err("--world must be at least 2 and every size at least 1 MiB".into());
    }
    Ok(a)
}

/// Why this machine cannot run the benchmark, if it cannot.
fn missing(world: usize) -> Option<String> {
    if !kernels::driver_present() {
        return Some("no CUDA driver (libcuda.so.1)".into());
    }
    match kernels::device_count() {
        Ok(n) if n >= world => {}
        Ok(n) => return Some(format!("{world} ranks need {world} GPUs, {n} visible")),
        Err(e) => return Some(format!("cannot count CUDA devices: {e}")),
    }
    if !kernels::available() {
        return Some(format!(
            "this build has no kernels: {}",
            kernels::HOW_TO_GET_KERNELS
        ));
    }
    nccl::preflight()
        .err()
        .map(|e| format!("NCCL is not usable: {e}"))
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench_reduce: {e}");
            return ExitCode::from(2);
        }
    };
    let result = if is_rank_process() {
        rank(&args)
    } else {
        supervise(&args)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench_reduce: {e}");
            ExitCode::FAILURE
        }
    }
}

fn supervise(args: &Args) -> Result<(), String> {
    if let Some(why) = missing(args.world) {
        return Err(format!("cannot run: {why}"));
    }
    let opts = SpawnOptions {
        deadline: Some(Duration::from_secs(1800)),
        ..SpawnOptions::default()
    };
    let report = spawn_world(args.world, opts).map_err(|e| e.to_string())?;
    report.check().map_err(|e| e.to_string())
}

/// Deterministic values of moderate magnitude (no overflow after many
/// in-place reductions).
fn values(len: usize, rank: usize) -> Vec<f32> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64 ^ rank as u64;
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

fn upload(t: &mut NcclComm, v: &[f32]) -> Result<CudaSlice<f32>, String> {
    let mut b = t.alloc(v.len()).map_err(|e| e.to_string())?;
    t.upload(v, &mut b, 0).map_err(|e| e.to_string())?;
    Ok(b)
}

/// Median over ranks-max of `reps` timed calls of `op` after `warmup`
/// untimed ones; every call starts after a barrier.
fn time<T: Transport>(
    t: &mut T,
    warmup: usize,
    reps: usize,
    mut op: impl FnMut(&mut T) -> Result<(), String>,
) -> Result<Duration, String> {
    for _ in 0..warmup {
        t.barrier().map_err(|e| e.to_string())?;
        op(t)?;
    }
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        t.barrier().map_err(|e| e.to_string())?;
        let start = Instant::now();
        op(t)?;
        samples.push(start.elapsed());
    }
    samples.sort();
    let median = samples[samples.len() / 2];
    let mut worst = [i32::try_from(median.as_nanos() / 100).unwrap_or(i32::MAX)];
    t.all_reduce_max_i32(&mut worst)
        .map_err(|e| e.to_string())?;
    Ok(Duration::from_nanos(worst[0] as u64 * 100))
}

struct Row {
    mib: usize,
    nccl: Duration,
    fixed: Duration,
    lib: Duration,
    pipeline: Option<Duration>,
    groups: usize,
    launches: usize,
}

/// Swap the contract (and logical world) of a reducer without reloading
/// the kernels.
fn remake(
    r: TransportReducer<NcclComm, KernelFold>,
    contract: ReduceContract,
    logical: usize,
    chunk: Option<usize>,
) -> TransportReducer<NcclComm, KernelFold> {
    let (comm, fold) = r.into_parts();
    let opts = ReducerOptions {
        chunk_elems: chunk,
        ..ReducerOptions::new(contract, logical)
    };
    TransportReducer::with_fold(comm, fold, opts)
}

fn rank(args: &Args) -> Result<(), String> {
    let place = detect(&ProcessEnv)
        .map_err(|e| e.to_string())?
        .ok_or("no launcher environment")?;
    let rdv = rendezvous::open(&place, Duration::from_secs(120)).map_err(|e| e.to_string())?;
    let comm = NcclComm::init(
        place.rank,
        place.world,
        place.device(),
        &*rdv,
        NcclOptions::default(),
    )
    .map_err(|e| e.to_string())?;
    let (rank, world) = (place.rank, place.world);
    let mut r: TransportReducer<NcclComm, KernelFold> =
        NcclReducer::new(comm, ReducerOptions::new(ReduceContract::FixedOrder, world))
            .map_err(|e| e.to_string())?;
    let mut rows = Vec::new();
    for &mib in &args.sizes_mib {
        let len = mib * (1 << 20) / 4;
        let reps = args.reps.unwrap_or(if mib >= 256 { 10 } else { 20 });
        let v = values(len, rank);

        // NCCL's own all-reduce on the arena.
        let mut arena = [upload(r.transport_mut(), &v)?];
        let nccl = time(r.transport_mut(), args.warmup, reps, |t| {
            t.all_reduce_sum_f32(&mut arena[0], 0..len)
                .map_err(|e| e.to_string())
        })?;

        // FixedOrder on the same buffer.
        r = remake(r, ReduceContract::FixedOrder, world, args.chunk_elems);
        let plan = r.plan_for(len).map_err(|e| e.to_string())?;
        let cost = plan.cost();
        let fixed = time_reducer(&mut r, &mut arena, args.warmup, reps)?;

        // NcclSum on the same buffer.
        r = remake(r, ReduceContract::NcclSum, world, args.chunk_elems);
        let lib = time_reducer(&mut r, &mut arena, args.warmup, reps)?;
        drop(arena);

        // Optional: two logical ranks per process (pipeline).
        let pipeline = if args.pipeline {
            r = remake(r, ReduceContract::FixedOrder, 2 * world, args.chunk_elems);
            let mut two = [
                upload(r.transport_mut(), &v)?,
                upload(r.transport_mut(), &v)?,
            ];
            Some(time_reducer(&mut r, &mut two, args.warmup, reps)?)
        } else {
            None
        };
        rows.push(Row {
            mib,
            nccl,
            fixed,
            lib,
            pipeline,
            groups: cost.groups,
            launches: cost.fold_launches + cost.copies + cost.scale_launches,
        });
        if rank == 0 {
            eprintln!("bench_reduce: {mib} MiB done");
        }
    }
    if rank == 0 {
        let (plain, md) = render(&rows, world, args);
        println!("{plain}");
        println!("{md}");
        if let Some(path) = &args.markdown {
            std::fs::write(path, &md).map_err(|e| format!("writing {path}: {e}"))?;
        }
    }
    r.into_parts().0.shutdown().map_err(|e| e.to_string())
}

/// Time `reduce_mean` (the reducer's own transport provides the barrier
/// and the max over ranks).
fn time_reducer(
    r: &mut TransportReducer<NcclComm, KernelFold>,
    local: &mut [CudaSlice<f32>],
    warmup: usize,
    reps: usize,
) -> Result<Duration, String> {
    let run = |r: &mut TransportReducer<NcclComm, KernelFold>, local: &mut [CudaSlice<f32>]| {
        r.reduce_mean(local).map_err(|e| e.to_string())
    };
    for _ in 0..warmup {
        r.transport_mut().barrier().map_err(|e| e.to_string())?;
        run(r, local)?;
    }
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        r.transport_mut().barrier().map_err(|e| e.to_string())?;
        let start = Instant::now();
        run(r, local)?;
        samples.push(start.elapsed());
    }
    samples.sort();
    let median = samples[samples.len() / 2];
    let mut worst = [i32::try_from(median.as_nanos() / 100).unwrap_or(i32::MAX)];
    r.transport_mut()
        .all_reduce_max_i32(&mut worst)
        .map_err(|e| e.to_string())?;
    Ok(Duration::from_nanos(worst[0] as u64 * 100))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn render(rows: &[Row], world: usize, args: &Args) -> (String, String) {
    let mut plain = format!(
        "reduce benchmark: {world} ranks, median of repetitions (max over ranks), chunk {:?}\n",
        args.chunk_elems
    );
    plain.push_str(&format!(
        "{:>8} {:>10} {:>9} {:>10} {:>7} {:>10} {:>7} {:>7} {:>9}{}\n",
        "MiB",
        "nccl ms",
        "GB/s",
        "fixed ms",
        "ratio",
        "lib ms",
        "ratio",
        "groups",
        "launches",
        if args.pipeline {
            "  fixed L=2P ms  ratio"
        } else {
            ""
        }
    ));
    let mut md = String::from(
        "| MiB | NCCL all-reduce ms | algbw GB/s | FixedOrder ms | ratio | NcclSum ms | ratio | groups | launches |",
    );
    md.push_str(if args.pipeline {
        " FixedOrder L=2P ms | ratio |\n"
    } else {
        "\n"
    });
    md.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    md.push_str(if args.pipeline { "---:|---:|\n" } else { "\n" });
    for r in rows {
        let bytes = (r.mib as f64) * (1u64 << 20) as f64;
        let gbs = bytes / r.nccl.as_secs_f64() / 1e9;
        let ratio = |d: Duration| ms(d) / ms(r.nccl);
        let pipe_plain = r.pipeline.map_or(String::new(), |p| {
            format!("  {:>13.3} {:>6.2}", ms(p), ratio(p))
        });
        let pipe_md = r.pipeline.map_or(String::new(), |p| {
            format!(" {:.3} | {:.2} |", ms(p), ratio(p))
        });
        plain.push_str(&format!(
            "{:>8} {:>10.3} {:>9.1} {:>10.3} {:>7.2} {:>10.3} {:>7.2} {:>7} {:>9}{}\n",
            r.mib,
            ms(r.nccl),
            gbs,
            ms(r.fixed),
            ratio(r.fixed),
            ms(r.lib),
            ratio(r.lib),
            r.groups,
            r.launches,
            pipe_plain
        ));
        md.push_str(&format!(
            "| {} | {:.3} | {:.1} | {:.3} | {:.2} | {:.3} | {:.2} | {} | {} |{}\n",
            r.mib,
            ms(r.nccl),
            gbs,
            ms(r.fixed),
            ratio(r.fixed),
            ms(r.lib),
            ratio(r.lib),
            r.groups,
            r.launches,
            pipe_md
        ));
    }
    (plain, md)
}

//! Benchmark: the fixed-order reducer and the library-sum reducer against
//! NCCL's own f32 all-reduce, on the same buffers in the same processes.
//!
//! ```text
//! bench_reduce [--world 2] [--sizes-mib 4,8,...,1024] [--reps N] [--warmup N]
//!              [--chunk-elems N] [--pipeline] [--serial]
//!              [--chunks 1,2,4,8] [--pipeline-chunks 4,8,16,32,64]
//!              [--fold-sms-frac full,0.25,0.5,0.75] [--floors]
//!              [--markdown FILE]
//! ```
//!
//! Started without a launcher it re-executes itself as `--world` ranks (one
//! GPU each) through the supervisor; under torchrun/SLURM/MPI or the
//! project's `MAMBA_*` contract it is one rank. Every timed call is
//! synchronous (each returns once all its device work has completed), so a
//! rank's wall-clock time of one call is that call's full latency. Ranks
//! meet at a barrier before every call; the reported time is the median
//! over repetitions, and the maximum of that median over ranks. Rank 0
//! prints a plain table and the same table in markdown.
//!
//! Columns: `nccl` = `NcclComm::all_reduce_sum_f32` (the library's own
//! all-reduce, no scaling); `fixed` = `FixedOrder` mean (`P = L`, default
//! chunking, two-lane executor); `lib` = `NcclSum` mean (all-reduce +
//! scale); `C`, `groups`, `launches` = chunks, point-to-point groups and
//! fold launches of the fixed plan; with `--serial`, `serial` = the same
//! plan run step by step with a host wait per group (the executor before
//! the two-lane one, for comparison); with `--pipeline`, `L=2P` =
//! `FixedOrder` with two logical ranks per process (the running-prefix
//! pipeline, default chunking) and its chunk count. Ratios are against
//! `nccl`.
//!
//! More columns of the main table: `grid` = the fold grid of folds that run
//! beside transfers (`DeviceFold::set_overlap_grid`; one-chunk plans always
//! fold on the full grid); `sent MiB` and `fold MiB` = bytes this rank sends
//! and bytes its folds read and write in device memory (`PlanCost`).
//!
//! Sweeps (one extra table each, to pick defaults from one GPU run):
//! `--chunks LIST` times `P = L` with each chunk count,
//! `--pipeline-chunks LIST` times `L = 2P` with each. A count `c` means
//! `chunk_elems = ceil(len / c)` rounded up to 1024 elements. `--chunk-elems N` instead fixes the chunk
//! length of every fixed-order column. `--fold-sms-frac LIST` (entries
//! `full` or a fraction of the SMs in `(0, 1]`) repeats the `--chunks`
//! sweep (chunk counts 1, 2, 4 when `--chunks` is not given) once per fold
//! grid, one table per grid.
//!
//! `--floors` adds what bounds FixedOrder from below, measured in the same
//! run: `p2p C=1` / `p2p C=2` = the sharded plan's transfers alone (its
//! scatter and gather groups with no fold, 2 and 4 groups in one window);
//! and per fold grid (`full`, the default, and every `--fold-sms-frac`
//! entry) the fold of one chunk of a two-chunk plan alone (one `det_chain`
//! of `P` addends over a `1/(2P)` shard, fused scale) with its HBM rate.
//! A fold hides behind the next chunk's transfer when its time is below a
//! quarter of `p2p C=2` (at `P = 2`).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use cudarc::driver::CudaSlice;
use mamba_comm::bootstrap::{detect, is_rank_process, ProcessEnv};
use mamba_comm::nccl::{self, NcclComm, NcclOptions};
use mamba_comm::supervisor::{spawn_world, SpawnOptions};
use mamba_comm::{rendezvous, CommError, Transport};
use mamba_reduce::{
    mean_factor, DeviceFold, FoldGrid, NcclReducer, ReduceContract, Reducer, ReducerOptions,
    ShardPlan, TransportReducer,
};

#[derive(Clone, Debug)]
struct Args {
    world: usize,
    sizes_mib: Vec<usize>,
    reps: Option<usize>,
    warmup: usize,
    chunk_elems: Option<usize>,
    pipeline: bool,
    serial: bool,
    chunks: Vec<usize>,
    pipeline_chunks: Vec<usize>,
    fold_grids: Vec<FoldGrid>,
    floors: bool,
    markdown: Option<String>,
}

impl Args {
    /// Chunk counts of the per-grid sweeps.
    fn grid_chunks(&self) -> Vec<usize> {
        if self.chunks.is_empty() {
            vec![1, 2, 4]
        } else {
            self.chunks.clone()
        }
    }
}

fn list(name: &str, v: &str) -> Result<Vec<usize>, String> {
    v.split(',')
        .map(|s| {
            s.trim()
                .parse::<usize>()
                .map_err(|e| format!("{name} {s:?}: {e}"))
        })
        .collect()
}

/// The settings without any flag.
fn default_args() -> Args {
    Args {
        world: 2,
        sizes_mib: vec![4, 8, 16, 32, 64, 128, 256, 512, 1024],
        reps: None,
        warmup: 3,
        chunk_elems: None,
        pipeline: false,
        serial: false,
        chunks: Vec::new(),
        pipeline_chunks: Vec::new(),
        fold_grids: Vec::new(),
        floors: false,
        markdown: None,
    }
}

fn parse_args() -> Result<Args, String> {
    let mut a = default_args();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        let num =
            |name: &str, v: String| v.parse::<usize>().map_err(|e| format!("{name} {v:?}: {e}"));
        match flag.as_str() {
            "--world" => a.world = num("--world", value("--world")?)?,
            "--sizes-mib" => a.sizes_mib = list("--sizes-mib", &value("--sizes-mib")?)?,
            "--chunks" => a.chunks = list("--chunks", &value("--chunks")?)?,
            "--pipeline-chunks" => {
                a.pipeline_chunks = list("--pipeline-chunks", &value("--pipeline-chunks")?)?
            }
            "--fold-sms-frac" => {
                a.fold_grids = value("--fold-sms-frac")?
                    .split(',')
                    .map(|g| g.parse::<FoldGrid>().map_err(|e| e.to_string()))
                    .collect::<Result<_, _>>()?
            }
            "--floors" => a.floors = true,
            "--serial" => a.serial = true,
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
    if a.chunks.contains(&0) || a.pipeline_chunks.contains(&0) {
        return Err("chunk counts must be at least 1".into());
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
    serial: Option<Duration>,
    pipeline: Option<(Duration, usize)>,
    chunks: usize,
    groups: usize,
    launches: usize,
    /// Bytes this rank sends, and its folds' device-memory bytes.
    sent: u64,
    fold_bytes: u64,
    /// `(chunk count, time)` of the `--chunks` sweep.
    sweep: Vec<(usize, Duration)>,
    /// `(chunk count, time)` of the `--pipeline-chunks` sweep.
    pipeline_sweep: Vec<(usize, Duration)>,
    /// Per `--fold-sms-frac` grid, `(chunk count, time)`.
    grid_sweeps: Vec<Vec<(usize, Duration)>>,
    floors: Option<Floors>,
}

/// What bounds FixedOrder from below (see the module docs).
struct Floors {
    /// Transfers alone, one and two chunks.
    p2p: [Duration; 2],
    /// One chunk's fold alone (two-chunk plan) per grid, and its HBM bytes.
    fold: Vec<(FoldGrid, Duration)>,
    fold_bytes: u64,
}

/// Swap the contract (and logical world, chunking) of a reducer without
/// reloading the kernels.
fn remake(
    r: TransportReducer<NcclComm, DeviceFold>,
    contract: ReduceContract,
    logical: usize,
    chunk: Option<usize>,
) -> TransportReducer<NcclComm, DeviceFold> {
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
    let mut r: TransportReducer<NcclComm, DeviceFold> =
        NcclReducer::new(comm, ReducerOptions::new(ReduceContract::FixedOrder, world))
            .map_err(|e| e.to_string())?;
    let mut rows = Vec::new();
    for &mib in &args.sizes_mib {
        let len = mib * (1 << 20) / 4;
        let reps = args.reps.unwrap_or(if mib >= 256 { 10 } else { 20 });
        let (warmup, v) = (args.warmup, values(len, rank));
        // Chunk length for a chunk count, rounded up to 1024 elements like
        // the defaults (keeps shards 16-byte aligned).
        let count = |c: usize| Some(len.div_ceil(c).next_multiple_of(1024));

        // NCCL's own all-reduce on the arena.
        let mut arena = [upload(r.transport_mut(), &v)?];
        let nccl = time(r.transport_mut(), warmup, reps, |t| {
            t.all_reduce_sum_f32(&mut arena[0], 0..len)
                .map_err(|e| e.to_string())
        })?;

        // FixedOrder on the same buffer.
        r = remake(r, ReduceContract::FixedOrder, world, args.chunk_elems);
        let plan = r.plan_for(len, None).map_err(|e| e.to_string())?;
        let cost = plan.cost();
        let fixed = time_reducer(&mut r, &mut arena, warmup, reps)?;
        let serial = if args.serial {
            r.fold_mut().set_overlap(false);
            let t = time_reducer(&mut r, &mut arena, warmup, reps);
            r.fold_mut().set_overlap(true);
            Some(t?)
        } else {
            None
        };
        let mut sweep = Vec::new();
        for &c in &args.chunks {
            r = remake(r, ReduceContract::FixedOrder, world, count(c));
            sweep.push((c, time_reducer(&mut r, &mut arena, warmup, reps)?));
        }
        let mut grid_sweeps = Vec::new();
        for &g in &args.fold_grids {
            r.fold_mut()
                .set_overlap_grid(g)
                .map_err(|e| e.to_string())?;
            let mut times = Vec::new();
            for c in args.grid_chunks() {
                r = remake(r, ReduceContract::FixedOrder, world, count(c));
                times.push((c, time_reducer(&mut r, &mut arena, warmup, reps)?));
            }
            grid_sweeps.push(times);
        }
        r.fold_mut()
            .set_overlap_grid(FoldGrid::DEFAULT)
            .map_err(|e| e.to_string())?;
        let floors = if args.floors {
            Some(floors(&mut r, &mut arena[0], args, warmup, reps)?)
        } else {
            None
        };

        // NcclSum on the same buffer.
        r = remake(r, ReduceContract::NcclSum, world, None);
        let lib = time_reducer(&mut r, &mut arena, warmup, reps)?;
        drop(arena);

        // Two logical ranks per process (pipeline).
        let mut pipeline = None;
        let mut pipeline_sweep = Vec::new();
        if args.pipeline || !args.pipeline_chunks.is_empty() {
            let mut two = [
                upload(r.transport_mut(), &v)?,
                upload(r.transport_mut(), &v)?,
            ];
            if args.pipeline {
                r = remake(r, ReduceContract::FixedOrder, 2 * world, args.chunk_elems);
                let chunks = r.plan_for(len, None).map_err(|e| e.to_string())?.chunks();
                pipeline = Some((time_reducer(&mut r, &mut two, warmup, reps)?, chunks));
            }
            for &c in &args.pipeline_chunks {
                r = remake(r, ReduceContract::FixedOrder, 2 * world, count(c));
                pipeline_sweep.push((c, time_reducer(&mut r, &mut two, warmup, reps)?));
            }
        }
        rows.push(Row {
            mib,
            nccl,
            fixed,
            lib,
            serial,
            pipeline,
            chunks: plan.chunks(),
            groups: cost.groups,
            launches: cost.fold_launches + cost.copies + cost.scale_launches,
            sent: cost.bytes_sent,
            fold_bytes: cost.fold_bytes,
            sweep,
            pipeline_sweep,
            grid_sweeps,
            floors,
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
    r: &mut TransportReducer<NcclComm, DeviceFold>,
    local: &mut [CudaSlice<f32>],
    warmup: usize,
    reps: usize,
) -> Result<Duration, String> {
    let run = |r: &mut TransportReducer<NcclComm, DeviceFold>, local: &mut [CudaSlice<f32>]| {
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

/// Chunk length for `c` chunks of `len`, as the sweeps round it.
fn chunk_len(len: usize, c: usize) -> usize {
    len.div_ceil(c).next_multiple_of(1024)
}

/// The sharded plan's transfers alone with `chunks` chunks, in one window:
/// per chunk a scatter group (every peer's shard out of the arena, this
/// rank's shard in from every peer into a scratch slot), then per chunk a
/// gather group (this rank's shard out, every peer's shard into the arena),
/// the plan's own order and sizes with no fold between them. `scratch`
/// holds at least `len + world` elements.
fn transfers(
    c: &mut NcclComm,
    arena: &mut CudaSlice<f32>,
    scratch: &mut CudaSlice<f32>,
    len: usize,
    chunks: usize,
) -> Result<(), CommError> {
    let (rank, world) = (c.rank(), c.world());
    let chunk = chunk_len(len, chunks);
    let pieces: Vec<(usize, ShardPlan)> = (0..len.div_ceil(chunk))
        .map(|a| {
            let start = a * chunk;
            let shards = ShardPlan::new((start + chunk).min(len) - start, world)
                .map_err(|e| CommError::config(e.to_string()))?;
            Ok((start, shards))
        })
        .collect::<Result<_, CommError>>()?;
    let shift = |r: std::ops::Range<usize>, by: usize| r.start + by..r.end + by;
    c.window(&mut [&mut *arena, &mut *scratch], |w| {
        for (start, shards) in &pieces {
            let own = shards.range(rank);
            let slot = shards.max_shard_len();
            w.group(|g| {
                for peer in (0..world).filter(|&p| p != rank) {
                    g.send(0, shift(shards.range(peer), *start), peer)?;
                }
                for peer in (0..world).filter(|&p| p != rank) {
                    let at = start + peer * slot;
                    g.recv(1, at..at + own.len(), peer)?;
                }
                Ok(())
            })?;
        }
        for (start, shards) in &pieces {
            w.group(|g| {
                for peer in (0..world).filter(|&p| p != rank) {
                    g.send(0, shift(shards.range(rank), *start), peer)?;
                }
                for peer in (0..world).filter(|&p| p != rank) {
                    g.recv(0, shift(shards.range(peer), *start), peer)?;
                }
                Ok(())
            })?;
        }
        Ok::<(), CommError>(())
    })
}

/// The `--floors` measurements for one size (collective: every rank runs
/// the same calls).
fn floors(
    r: &mut TransportReducer<NcclComm, DeviceFold>,
    arena: &mut CudaSlice<f32>,
    args: &Args,
    warmup: usize,
    reps: usize,
) -> Result<Floors, String> {
    let len = arena.len();
    let (rank, world) = (r.rank(), r.world());
    let t = r.transport_mut();
    let mut scratch = t.alloc(len + world).map_err(|e| e.to_string())?;
    let mut p2p = [Duration::ZERO; 2];
    for (i, chunks) in [1usize, 2].into_iter().enumerate() {
        p2p[i] = time(t, warmup, reps, |c| {
            transfers(c, arena, &mut scratch, len, chunks).map_err(|e| e.to_string())
        })?;
    }
    drop(scratch);

    // One chunk's fold of a two-chunk plan: a shard of chunk_len(len, 2) /
    // P, its own values at this rank's position among P addends.
    let shard = ShardPlan::new(chunk_len(len, 2).min(len), world)
        .map_err(|e| e.to_string())?
        .max_shard_len();
    let others = r
        .transport_mut()
        .alloc((world - 1) * shard.next_multiple_of(4))
        .map_err(|e| e.to_string())?;
    let mut grids = vec![FoldGrid::Full, FoldGrid::DEFAULT];
    for &g in &args.fold_grids {
        if !grids.contains(&g) {
            grids.push(g);
        }
    }
    let factor = Some(mean_factor(world));
    let mut fold = Vec::new();
    for g in grids {
        r.fold_mut()
            .set_overlap_grid(g)
            .map_err(|e| e.to_string())?;
        let kernel = r.fold().overlap_kernel().clone();
        let stream = r.fold().stream().clone();
        let srcs: Vec<_> = (0..world - 1)
            .map(|k| {
                let at = k * shard.next_multiple_of(4);
                others.slice(at..at + shard)
            })
            .collect();
        let mut one = |_: &mut NcclComm| -> Result<(), String> {
            let mut dst = arena.slice_mut(..shard);
            kernel
                .det_chain(&stream, &mut dst, Some(rank), &srcs, shard, factor)
                .map_err(|e| e.to_string())?;
            stream.synchronize().map_err(|e| e.to_string())
        };
        fold.push((g, time(r.transport_mut(), warmup, reps, &mut one)?));
    }
    r.fold_mut()
        .set_overlap_grid(FoldGrid::DEFAULT)
        .map_err(|e| e.to_string())?;
    Ok(Floors {
        p2p,
        fold,
        fold_bytes: 4 * (world as u64 + 1) * shard as u64,
    })
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / f64::from(1u32 << 20))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One table, as plain text (right-aligned columns) and markdown.
struct Table {
    title: String,
    head: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn plain(&self) -> String {
        let n = self.head.len();
        let width: Vec<usize> = (0..n)
            .map(|c| {
                self.rows
                    .iter()
                    .map(|r| r[c].len())
                    .chain([self.head[c].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |cells: &[String]| {
            let mut l = String::new();
            for (c, cell) in cells.iter().enumerate() {
                l.push_str(&format!("{:>w$}  ", cell, w = width[c]));
            }
            l.trim_end().to_string() + "\n"
        };
        let mut out = format!("{}\n", self.title);
        out.push_str(&line(&self.head));
        for r in &self.rows {
            out.push_str(&line(r));
        }
        out
    }

    fn markdown(&self) -> String {
        let mut out = format!("{}\n\n| {} |\n", self.title, self.head.join(" | "));
        out.push_str(&format!("|{}\n", "---:|".repeat(self.head.len())));
        for r in &self.rows {
            out.push_str(&format!("| {} |\n", r.join(" | ")));
        }
        out
    }
}

fn render(rows: &[Row], world: usize, args: &Args) -> (String, String) {
    let f = |d: Duration| format!("{:.3}", ms(d));
    let ratio = |d: Duration, r: &Row| format!("{:.2}", ms(d) / ms(r.nccl));
    let mut head: Vec<String> = [
        "MiB", "nccl ms", "GB/s", "fixed ms", "ratio", "lib ms", "ratio", "C", "grid", "groups",
        "launches", "sent MiB", "fold MiB",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if args.serial {
        head.extend(["serial ms".into(), "ratio".into()]);
    }
    if args.pipeline {
        head.extend(["L=2P ms".into(), "ratio".into(), "C".into()]);
    }
    let mut main = Table {
        title: format!(
            "reduce benchmark: {world} ranks, median of repetitions (max over ranks), chunk \
             {:?}; ratios against nccl",
            args.chunk_elems
        ),
        head,
        rows: Vec::new(),
    };
    for r in rows {
        let bytes = (r.mib as f64) * (1u64 << 20) as f64;
        let gbs = bytes / r.nccl.as_secs_f64() / 1e9;
        let mut cells = vec![
            r.mib.to_string(),
            f(r.nccl),
            format!("{gbs:.1}"),
            f(r.fixed),
            ratio(r.fixed, r),
            f(r.lib),
            ratio(r.lib, r),
            r.chunks.to_string(),
            if r.chunks > 1 {
                FoldGrid::DEFAULT.to_string()
            } else {
                FoldGrid::Full.to_string()
            },
            r.groups.to_string(),
            r.launches.to_string(),
            mib(r.sent),
            mib(r.fold_bytes),
        ];
        if let Some(s) = r.serial {
            cells.extend([f(s), ratio(s, r)]);
        }
        if let Some((p, c)) = r.pipeline {
            cells.extend([f(p), ratio(p, r), c.to_string()]);
        }
        main.rows.push(cells);
    }
    let mut tables = vec![main];
    let sweep = |title: &str, counts: &[usize], pick: &dyn Fn(&Row) -> &[(usize, Duration)]| {
        let mut head = vec!["MiB".to_string(), "nccl ms".to_string()];
        head.extend(counts.iter().map(|c| format!("C={c} ms (ratio)")));
        Table {
            title: title.to_string(),
            head,
            rows: rows
                .iter()
                .map(|r| {
                    let mut cells = vec![r.mib.to_string(), f(r.nccl)];
                    cells.extend(
                        pick(r)
                            .iter()
                            .map(|&(_, d)| format!("{} ({})", f(d), ratio(d, r))),
                    );
                    cells
                })
                .collect(),
        }
    };
    if !args.chunks.is_empty() {
        tables.push(sweep(
            "FixedOrder P = L by chunk count",
            &args.chunks,
            &|r: &Row| &r.sweep,
        ));
    }
    if !args.pipeline_chunks.is_empty() {
        tables.push(sweep(
            "FixedOrder L = 2P by chunk count",
            &args.pipeline_chunks,
            &|r: &Row| &r.pipeline_sweep,
        ));
    }
    let counts = args.grid_chunks();
    for (i, g) in args.fold_grids.iter().enumerate() {
        tables.push(sweep(
            &format!("FixedOrder P = L with fold grid {g} (one-chunk plans: full) by chunk count"),
            &counts,
            &|r: &Row| r.grid_sweeps.get(i).map_or(&[][..], |v| &v[..]),
        ));
    }
    if let Some(fl) = rows.iter().find_map(|r| r.floors.as_ref()) {
        let mut head: Vec<String> = [
            "MiB",
            "nccl ms",
            "p2p C=1 ms",
            "ratio",
            "p2p C=2 ms",
            "ratio",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        head.push("fold MiB".into());
        head.extend(fl.fold.iter().map(|(g, _)| format!("fold {g} ms (GB/s)")));
        let mut t = Table {
            title: "Floors: the sharded plan's transfers alone (no fold), and one chunk's fold \
                    alone (two-chunk plan) per fold grid"
                .into(),
            head,
            rows: Vec::new(),
        };
        for r in rows {
            let Some(fl) = &r.floors else { continue };
            let mut cells = vec![
                r.mib.to_string(),
                f(r.nccl),
                f(fl.p2p[0]),
                ratio(fl.p2p[0], r),
                f(fl.p2p[1]),
                ratio(fl.p2p[1], r),
                mib(fl.fold_bytes),
            ];
            cells.extend(fl.fold.iter().map(|&(_, d)| {
                let gbs = fl.fold_bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9;
                format!("{} ({gbs:.0})", f(d))
            }));
            t.rows.push(cells);
        }
        tables.push(t);
    }
    let plain = tables
        .iter()
        .map(Table::plain)
        .collect::<Vec<_>>()
        .join("\n");
    let md = tables
        .iter()
        .map(Table::markdown)
        .collect::<Vec<_>>()
        .join("\n");
    (plain, md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_have_one_cell_per_column() {
        let d = |us| Duration::from_micros(us);
        let row = Row {
            mib: 4,
            nccl: d(100),
            fixed: d(150),
            lib: d(110),
            serial: Some(d(200)),
            pipeline: Some((d(300), 2)),
            chunks: 1,
            groups: 2,
            launches: 1,
            sent: 2 << 20,
            fold_bytes: 6 << 20,
            sweep: vec![(1, d(150)), (2, d(170))],
            pipeline_sweep: vec![(4, d(310))],
            grid_sweeps: vec![vec![(1, d(150)), (2, d(140))]],
            floors: Some(Floors {
                p2p: [d(90), d(95)],
                fold: vec![(FoldGrid::Full, d(10)), (FoldGrid::DEFAULT, d(20))],
                fold_bytes: 3 << 20,
            }),
        };
        let mut args = default_args();
        args.serial = true;
        args.pipeline = true;
        args.chunks = vec![1, 2];
        args.pipeline_chunks = vec![4];
        args.fold_grids = vec![FoldGrid::SmFraction(0.25)];
        let (plain, md) = render(&[row], 2, &args);
        assert!(
            plain.contains("fold grid 0.25") && plain.contains("0.140 (1.40)"),
            "{plain}"
        );
        // 3 MiB in 20 us: 157 GB/s.
        assert!(plain.contains("0.020 (157)"), "{plain}");
        assert!(plain.contains("p2p C=2 ms"), "{plain}");
        assert!(plain.contains("FixedOrder P = L by chunk count"), "{plain}");
        assert!(plain.contains("0.170 (1.70)"), "{plain}");
        for table in md.split("\n\n").filter(|t| t.starts_with('|')) {
            let cols: Vec<usize> = table.lines().map(|l| l.matches('|').count()).collect();
            assert!(cols.windows(2).all(|w| w[0] == w[1]), "{table}");
        }
        assert!(md.contains("| 4 | 0.100 | 41.9 | 0.150 | 1.50 |"), "{md}");
        assert!(md.contains("| 1 | full | 2 | 1 | 2.0 | 6.0 |"), "{md}");
    }
}

//! Training-step benchmark of the CUDA model on one GPU, with its floor.
//!
//! ```text
//! cargo run --release -p mamba-train --example bench_cuda_step -- \
//!     [--sizes small,130m,long] [--steps 10] [--warmup 3] [--json FILE] \
//!     [--precision f32|tf32|bf16] [--recompute] [--f32-acts] [--gemm-detail]
//!     [--lt-candidates] [--no-cuda-graph]
//! ```
//!
//! The training pass replays as a CUDA graph (`CudaModel::set_cuda_graph`),
//! as the CLI's does; `--no-cuda-graph` (the CLI's flag) runs it eagerly.
//! Both run on a stream of the benchmark's own, so the two differ only in
//! the graph.
//!
//! `--precision` (default f32) builds the model in that precision
//! (`mamba_train::config::Precision`) and runs the GEMM-only timing and the
//! cuBLAS rate through a handle of the same precision. In bf16 the GEMM-only
//! timing casts both operands of every GEMM (it has no pre-cast weights), so
//! it includes the activation casts the step does and the weight casts the
//! step does once per pass; the floor's bytes stay the f32 step's.
//!
//! For each size it times, with CUDA events after warm-up (median of
//! `--steps`): the whole step (forward + backward + AdamW with clipping),
//! the forward pass alone, the optimizer alone, and the step's GEMMs alone
//! (the same shapes through the same cuBLAS configuration, on scratch
//! buffers), and reports tokens/s and the device-memory high-water mark.
//!
//! The floor (METHOD.md) is the larger of
//! - the step's GEMM flops over the cuBLAS f32 rate measured here (the best
//!   of a square 8192 product and the model's own largest shapes), and
//! - the step's minimal bytes over the device-to-device copy bandwidth
//!   measured here (read + write bytes of a 1 GiB copy). Minimal bytes: the
//!   parameter arena read twice (forward, backward) and written once, the
//!   gradients written and read, AdamW's moments read and written, every
//!   activation the backward pass keeps written once and read once, and the
//!   logits written, read by the loss, written as their gradient and read by
//!   the two head GEMMs.
//!
//! Sizes (vocabulary 50280 throughout, the GPT-NeoX tokenizer's):
//! - `small`: d_model 256, 4 layers, batch 8 x 1024 tokens;
//! - `130m`:  d_model 768, 24 layers (Mamba-130m's shape), batch 8 x 1024;
//! - `long`:  the 130m shape, batch 1 x 8192 tokens;
//! - `m2-130m`: Mamba-2 at the 130m shape (d_model 768, 24 layers, d_state
//!   128, head_dim 64, one group), batch 8 x 1024;
//! - `tiny`, `m2-tiny`:  d_model 64, 2 layers, vocab 512, batch 2 x 64 (smoke
//!   tests of each architecture).

use std::time::Instant;

use clap::Parser;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream};
use mamba_train::config::Precision;
use mamba_train::model::cuda::blas::{Blas, Elems, Operand};
use mamba_train::model::cuda::CudaModel;
use mamba_train::model::Batch;
use mamba_train::optim::{AdamWConfig, Optimizer, Schedule};
use mamba_train::seed::Rng;
use mamba_train::{ModelConfig, TrainError};

#[derive(Parser, Debug)]
struct Args {
    /// Comma-separated sizes: small, 130m, long, m2-130m (tiny, m2-tiny).
    #[arg(long, default_value = "small,130m,long")]
    sizes: String,
    /// Timed steps per size (the median is reported).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Untimed warm-up steps per size.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Override the batch size of every size.
    #[arg(long)]
    batch: Option<usize>,
    /// Override the sequence length of every size.
    #[arg(long)]
    seq_len: Option<usize>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Side of the square GEMM that measures the cuBLAS rate.
    #[arg(long, default_value_t = 8192)]
    gemm_side: usize,
    /// MiB copied to measure the copy bandwidth.
    #[arg(long, default_value_t = 1024)]
    copy_mib: usize,
    /// Also write the results as JSON lines to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// GEMM precision of the model and of the GEMM timings: f32, tf32, bf16.
    #[arg(long, default_value = "f32")]
    precision: Precision,
    /// Also time every distinct GEMM shape of the step alone (per call,
    /// TFLOP/s, calls a step; in bf16 with and without the operand casts).
    #[arg(long)]
    gemm_detail: bool,
    /// With `--gemm-detail` (tf32 or bf16): also time each shape's
    /// cuBLASLt heuristic candidates (up to 16), to compare with the
    /// `cublasGemmEx` default the model runs.
    #[arg(long)]
    lt_candidates: bool,
    /// Recompute each block's activations in the backward pass
    /// (`CudaModel::set_recompute`, the CLI's `--recompute`).
    #[arg(long)]
    recompute: bool,
    /// bf16 only: keep the scan's activations (u, dt, y) in f32 instead of
    /// bf16 (`CudaModel::set_bf16_acts(false)`, the earlier builds' bits),
    /// to compare the two in one run.
    #[arg(long)]
    f32_acts: bool,
    /// Run the training pass eagerly instead of replaying it as a CUDA
    /// graph (`CudaModel::set_cuda_graph`).
    #[arg(long)]
    no_cuda_graph: bool,
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

mod support {
    pub mod lt_candidates;
}

fn cuda_err(what: &str, e: impl std::fmt::Display) -> TrainError {
    TrainError::Cuda {
        what: what.to_string(),
        detail: e.to_string(),
    }
}

fn size(name: &str) -> Res<(ModelConfig, usize, usize)> {
    let v = 50280;
    Ok(match name {
        "small" => (ModelConfig::new(v, 256, 4), 8, 1024),
        "130m" => (ModelConfig::new(v, 768, 24), 8, 1024),
        "long" => (ModelConfig::new(v, 768, 24), 1, 8192),
        // Mamba-2 at the 130m shape: d_state 128, head_dim 64, one group.
        "m2-130m" => (ModelConfig::mamba2(v, 768, 24), 8, 1024),
        // Smoke-test sizes, not part of the report.
        "tiny" => (ModelConfig::new(512, 64, 2), 2, 64),
        "m2-tiny" => (ModelConfig::mamba2(512, 64, 2), 2, 64),
        other => {
            return Err(format!(
                "unknown size {other:?}; expected small, 130m, long, m2-130m, tiny or m2-tiny"
            )
            .into())
        }
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

/// Milliseconds of device time of `f`'s work on `stream`, by CUDA events.
fn timed(stream: &std::sync::Arc<CudaStream>, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream
        .record_event(flags)
        .map_err(|e| cuda_err("recording an event", e))?;
    f()?;
    let end = stream
        .record_event(flags)
        .map_err(|e| cuda_err("recording an event", e))?;
    Ok(start
        .elapsed_ms(&end)
        .map_err(|e| cuda_err("reading an event", e))? as f64)
}

fn random_dev(stream: &std::sync::Arc<CudaStream>, n: usize, seed: u64) -> Res<CudaSlice<f32>> {
    let mut r = Rng::new(seed);
    let host: Vec<f32> = (0..n).map(|_| (r.next_f64() * 2.0 - 1.0) as f32).collect();
    Ok(stream
        .clone_htod(&host)
        .map_err(|e| cuda_err("uploading", e))?)
}

/// One GEMM of the step: row-major `[m, n] = op(A)[m, k] op(B)[k, n]`.
#[derive(Clone, Copy, Debug)]
struct Shape {
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
}

/// Conv channels of a Mamba-2 block: x, then B and C of every group.
fn ssd_conv_channels(cfg: &ModelConfig) -> usize {
    cfg.d_inner() + 2 * cfg.ssd().map_or(1, |s| s.n_groups) * cfg.d_state
}

/// in_proj's output width of a Mamba-2 block (z, x B C, dt).
fn ssd_in_width(cfg: &ModelConfig) -> usize {
    cfg.d_inner() + ssd_conv_channels(cfg) + cfg.num_heads()
}

/// Every GEMM of one training step (forward and backward), in order.
fn step_gemms(cfg: &ModelConfig, rows: usize) -> Vec<Shape> {
    let (d, e, r, v) = (cfg.d_model, cfg.d_inner(), cfg.dt_rank, cfg.vocab_size);
    let ld = r + 2 * cfg.d_state;
    let s = |m, n, k, ta, tb| Shape { m, n, k, ta, tb };
    let mut out = Vec::new();
    if cfg.ssd().is_some() {
        // Mamba-2: in_proj and out_proj only.
        let w = ssd_in_width(cfg);
        for _ in 0..cfg.n_layer {
            out.extend([s(rows, w, d, false, true), s(rows, d, e, false, true)]);
        }
        out.push(s(rows, v, d, false, true));
        out.extend([s(rows, d, v, false, false), s(v, d, rows, true, false)]);
        for _ in 0..cfg.n_layer {
            out.extend([
                s(rows, e, d, false, false),
                s(d, e, rows, true, false),
                s(w, d, rows, true, false),
                s(rows, d, w, false, false),
            ]);
        }
        return out;
    }
    for _ in 0..cfg.n_layer {
        out.extend([
            s(rows, 2 * e, d, false, true),
            s(rows, ld, e, false, true),
            s(rows, e, r, false, true),
            s(rows, d, e, false, true),
        ]);
    }
    out.push(s(rows, v, d, false, true));
    out.extend([s(rows, d, v, false, false), s(v, d, rows, true, false)]);
    for _ in 0..cfg.n_layer {
        out.extend([
            s(d, e, rows, true, false),
            s(rows, e, d, false, false),
            s(e, r, rows, true, false),
            s(rows, r, e, false, false),
            s(ld, e, rows, true, false),
            s(rows, e, ld, false, false),
            s(2 * e, d, rows, true, false),
            s(rows, d, 2 * e, false, false),
        ]);
    }
    out
}

/// Run `shapes` once on scratch buffers large enough for every one.
fn run_gemms(
    blas: &Blas,
    shapes: &[Shape],
    a: &CudaSlice<f32>,
    b: &CudaSlice<f32>,
    c: &mut CudaSlice<f32>,
) -> Res<()> {
    for g in shapes {
        let lda = if g.ta { g.m } else { g.k };
        let ldb = if g.tb { g.k } else { g.n };
        blas.gemm(
            "bench",
            g.m,
            g.n,
            g.k,
            Operand {
                elems: Elems::F32(a.as_view()),
                ld: lda,
                trans: g.ta,
            },
            Operand {
                elems: Elems::F32(b.as_view()),
                ld: ldb,
                trans: g.tb,
            },
            0.0,
            &mut c.as_view_mut(),
            g.n,
        )?;
    }
    Ok(())
}

/// Print each distinct shape of `shapes` timed alone (median of `reps`):
/// per call, calls a step, the step's share and the rate; in bf16 also with
/// both operands already cast (the GEMM without its casts).
fn gemm_detail(
    stream: &std::sync::Arc<CudaStream>,
    blas: &Blas,
    shapes: &[Shape],
    reps: usize,
    lt: bool,
) -> Res<()> {
    let mut distinct: Vec<(Shape, usize)> = Vec::new();
    for g in shapes {
        let key = |s: &Shape| (s.m, s.n, s.k, s.ta, s.tb);
        match distinct.iter_mut().find(|(s, _)| key(s) == key(g)) {
            Some((_, n)) => *n += 1,
            None => distinct.push((*g, 1)),
        }
    }
    let bf16 = blas.precision() == Precision::Bf16;
    let kernels = if bf16 {
        Some(kernels::mamba::MambaKernels::load(stream.context())?)
    } else {
        None
    };
    println!(
        "  GEMM shapes alone ({}; m x n x k, A/B transposed):",
        blas.precision()
    );
    let mut total = (0.0, 0.0);
    for (g, calls) in distinct {
        let a = random_dev(stream, g.m * g.k, 4)?;
        let b = random_dev(stream, g.k * g.n, 5)?;
        let mut c = stream
            .alloc_zeros::<f32>(g.m * g.n)
            .map_err(|e| cuda_err("allocating", e))?;
        let half = |x: &CudaSlice<f32>| -> Res<Option<CudaSlice<u16>>> {
            let Some(k) = kernels.as_ref() else {
                return Ok(None);
            };
            let mut h = stream
                .alloc_zeros::<u16>(x.len())
                .map_err(|e| cuda_err("allocating", e))?;
            k.cast_bf16(stream, &x.as_view(), &mut h.as_view_mut(), x.len())?;
            Ok(Some(h))
        };
        let (ha, hb) = (half(&a)?, half(&b)?);
        let (lda, ldb) = (if g.ta { g.m } else { g.k }, if g.tb { g.k } else { g.n });
        let mut run = |precast: bool| -> Res<f64> {
            let mut t = Vec::new();
            for i in 0..reps + 1 {
                let ms = timed(stream, || {
                    blas.gemm(
                        "bench",
                        g.m,
                        g.n,
                        g.k,
                        Operand {
                            elems: Elems::F32(a.as_view()),
                            ld: lda,
                            trans: g.ta,
                        }
                        .with_bf16(ha.as_ref().filter(|_| precast).map(|h| h.as_view())),
                        Operand {
                            elems: Elems::F32(b.as_view()),
                            ld: ldb,
                            trans: g.tb,
                        }
                        .with_bf16(hb.as_ref().filter(|_| precast).map(|h| h.as_view())),
                        0.0,
                        &mut c.as_view_mut(),
                        g.n,
                    )?;
                    Ok(())
                })?;
                if i > 0 {
                    t.push(ms);
                }
            }
            Ok(median(t))
        };
        let with_casts = run(false)?;
        let bare = if bf16 { run(true)? } else { with_casts };
        let fl = 2.0 * (g.m * g.n * g.k) as f64;
        total.0 += with_casts * calls as f64;
        total.1 += bare * calls as f64;
        println!(
            "    {:>6} x {:>6} x {:>6} {}{}  x{calls:<3} {with_casts:8.3} ms/call \
             ({:6.1} TFLOP/s), without casts {bare:8.3} ms ({:6.1} TFLOP/s)",
            g.m,
            g.n,
            g.k,
            if g.ta { 'T' } else { 'N' },
            if g.tb { 'T' } else { 'N' },
            fl / (with_casts * 1e-3) / 1e12,
            fl / (bare * 1e-3) / 1e12,
        );
        if lt && blas.precision() != Precision::F32 {
            let ab = AB {
                a: &a,
                b: &b,
                ha: ha.as_ref(),
                hb: hb.as_ref(),
            };
            print_lt_candidates(stream, &g, ab, &mut c, reps)?;
        }
    }
    println!(
        "    sum over the step: {:.2} ms with casts, {:.2} ms without",
        total.0, total.1
    );
    Ok(())
}

/// The A and B of one shape: f32 values and, in bf16, their copies.
struct AB<'a> {
    a: &'a CudaSlice<f32>,
    b: &'a CudaSlice<f32>,
    ha: Option<&'a CudaSlice<u16>>,
    hb: Option<&'a CudaSlice<u16>>,
}

/// The cuBLASLt candidates of shape `g` (bf16 copies of A and B in bf16,
/// else the f32 values run as TF32), each timed as the median of `reps`
/// calls, in the heuristic's order.
fn print_lt_candidates(
    stream: &std::sync::Arc<CudaStream>,
    g: &Shape,
    ab: AB<'_>,
    c: &mut CudaSlice<f32>,
    reps: usize,
) -> Res<()> {
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    use support::lt_candidates::{candidates, Problem};
    const WS: usize = mamba_train::model::cuda::blas::WORKSPACE_BYTES;
    let mut ws = stream
        .alloc_zeros::<u8>(WS)
        .map_err(|e| cuda_err("allocating", e))?;
    let p = Problem {
        m: g.m,
        n: g.n,
        k: g.k,
        ta: g.ta,
        tb: g.tb,
        lda: if g.ta { g.m } else { g.k },
        ldb: if g.tb { g.k } else { g.n },
        ldc: g.n,
        bf16: ab.ha.is_some(),
    };
    let (pa, _ra) = match ab.ha {
        Some(h) => h.device_ptr(stream),
        None => ab.a.device_ptr(stream),
    };
    let (pb, _rb) = match ab.hb {
        Some(h) => h.device_ptr(stream),
        None => ab.b.device_ptr(stream),
    };
    let (pc, _rc) = c.device_ptr_mut(stream);
    let (pw, _rw) = ws.device_ptr_mut(stream);
    let mut time = |run: &mut support::lt_candidates::Call<'_>| -> Result<f64, String> {
        let mut t = Vec::new();
        for i in 0..reps + 1 {
            let ms = timed(stream, || run().map_err(|e| e.into())).map_err(|e| e.to_string())?;
            if i > 0 {
                t.push(ms);
            }
        }
        Ok(median(t))
    };
    // SAFETY: the pointers hold the shape's extents in their types (the
    // scratch buffers gemm_detail sized for it), the workspace WS bytes.
    let found = unsafe { candidates(stream, &p, (pa, pb, pc), (pw, WS), 16, &mut time) }?;
    let fl = 2.0 * (g.m * g.n * g.k) as f64;
    for (i, cand) in found.iter().enumerate() {
        println!(
            "      lt #{i:<2} algo {:>3} tile {:>3} stages {:>3} split-k {:>2} reduction {} \
             waves {:6.2} workspace {:>9} B: {:8.4} ms ({:6.1} TFLOP/s)",
            cand.algo_id,
            cand.tile,
            cand.stages,
            cand.split_k,
            cand.reduction,
            cand.waves,
            cand.workspace,
            cand.ms,
            fl / (cand.ms * 1e-3) / 1e12,
        );
    }
    Ok(())
}

fn used_bytes(model_ctx: &std::sync::Arc<cudarc::driver::CudaContext>) -> Res<usize> {
    let (free, total) = model_ctx
        .mem_get_info()
        .map_err(|e| cuda_err("reading memory use", e))?;
    Ok(total - free)
}

struct Ceilings {
    gemm_flops_per_s: f64,
    copy_bytes_per_s: f64,
    square_rate: f64,
}

/// Measure the copy bandwidth (1 GiB device-to-device, read + write bytes)
/// and the cuBLAS f32 rate (square 8192, random data).
fn ceilings(
    stream: &std::sync::Arc<CudaStream>,
    blas: &Blas,
    reps: usize,
    side: usize,
    copy_mib: usize,
) -> Res<Ceilings> {
    let n = (copy_mib << 20) / 4;
    let src = random_dev(stream, n, 1)?;
    let mut dst = stream
        .alloc_zeros::<f32>(n)
        .map_err(|e| cuda_err("allocating", e))?;
    for _ in 0..2 {
        stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| cuda_err("copying", e))?;
    }
    let mut t = Vec::new();
    for _ in 0..reps {
        t.push(timed(stream, || {
            Ok(stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(|e| cuda_err("copying", e))?)
        })?);
    }
    let copy = 2.0 * (n * 4) as f64 / (median(t) * 1e-3);
    drop((src, dst));
    let s = side;
    let a = random_dev(stream, s * s, 2)?;
    let b = random_dev(stream, s * s, 3)?;
    let mut c = stream
        .alloc_zeros::<f32>(s * s)
        .map_err(|e| cuda_err("allocating", e))?;
    let sq = [Shape {
        m: s,
        n: s,
        k: s,
        ta: false,
        tb: false,
    }];
    run_gemms(blas, &sq, &a, &b, &mut c)?;
    let mut t = Vec::new();
    for _ in 0..reps.max(3) {
        t.push(timed(stream, || run_gemms(blas, &sq, &a, &b, &mut c))?);
    }
    let square = 2.0 * (s * s * s) as f64 / (median(t) * 1e-3);
    Ok(Ceilings {
        gemm_flops_per_s: square,
        copy_bytes_per_s: copy,
        square_rate: square,
    })
}

/// One size's result, one JSON line of `--json`.
#[derive(serde::Serialize)]
struct StepRecord {
    size: String,
    precision: String,
    recompute: bool,
    f32_acts: bool,
    graph: bool,
    graph_replays: u64,
    d_model: usize,
    n_layer: usize,
    vocab: usize,
    batch: usize,
    seq_len: usize,
    step_ms: f64,
    wall_ms: f64,
    tokens_per_s: f64,
    forward_ms: f64,
    optimizer_ms: f64,
    gemm_ms: f64,
    gemm_flops: f64,
    floor_ms: f64,
    floor_gemm_ms: f64,
    floor_bytes_ms: f64,
    step_over_floor: f64,
    peak_bytes: usize,
    model_bytes: usize,
    copy_gbps: f64,
    cublas_tflops: f64,
    loss: f32,
}

fn main() -> Res<()> {
    let args = Args::parse();
    let ctx = kernels::open_context(args.device)?;
    // A stream of its own (not the legacy default stream): a graph can
    // capture only such a stream, and eager runs use one too, so the graph
    // changes nothing else.
    let stream = ctx
        .new_stream()
        .map_err(|e| cuda_err("creating the benchmark's stream", e))?;
    let name = ctx.name().unwrap_or_else(|_| "?".into());
    let blas = Blas::with_precision(
        &stream,
        args.precision,
        Some(kernels::mamba::MambaKernels::load(&ctx)?),
    )?;
    let mut ceil = ceilings(
        &stream,
        &blas,
        args.steps.max(3),
        args.gemm_side,
        args.copy_mib,
    )?;
    println!(
        "device {} ({name}); copy bandwidth {:.0} GB/s (read+write of {} MiB); cuBLAS {} {:.1} TFLOP/s ({}^3)",
        args.device,
        ceil.copy_bytes_per_s / 1e9,
        args.copy_mib,
        args.precision,
        ceil.square_rate / 1e12,
        args.gemm_side
    );
    let mut json = Vec::new();
    for sz in args
        .sizes
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let (cfg, b0, t0) = size(sz)?;
        let (nb, t) = (args.batch.unwrap_or(b0), args.seq_len.unwrap_or(t0));
        let rows = nb * t;

        // The step's GEMMs alone, and the best rate among its large shapes.
        let shapes = step_gemms(&cfg, rows);
        let (mut amax, mut bmax, mut cmax) = (0, 0, 0);
        for g in &shapes {
            amax = amax.max(g.m * g.k);
            bmax = bmax.max(g.k * g.n);
            cmax = cmax.max(g.m * g.n);
        }
        let flops: f64 = shapes.iter().map(|g| 2.0 * (g.m * g.n * g.k) as f64).sum();
        let gemm_ms = {
            let a = random_dev(&stream, amax, 4)?;
            let b = random_dev(&stream, bmax, 5)?;
            let mut c = stream
                .alloc_zeros::<f32>(cmax)
                .map_err(|e| cuda_err("allocating", e))?;
            run_gemms(&blas, &shapes, &a, &b, &mut c)?;
            let mut t = Vec::new();
            for _ in 0..args.steps.max(3) {
                t.push(timed(&stream, || {
                    run_gemms(&blas, &shapes, &a, &b, &mut c)
                })?);
            }
            median(t)
        };
        ceil.gemm_flops_per_s = ceil.square_rate.max(flops / (gemm_ms * 1e-3));
        if args.gemm_detail {
            gemm_detail(
                &stream,
                &blas,
                &shapes,
                args.steps.max(3),
                args.lt_candidates,
            )?;
        }
        // Freed pool memory goes back at a synchronization; measure from here.
        stream
            .synchronize()
            .map_err(|e| cuda_err("synchronizing", e))?;
        let baseline = used_bytes(&ctx)?;

        let mut model = CudaModel::with_stream_in(cfg.clone(), args.precision, stream.clone())?;
        model.set_recompute(args.recompute);
        model.set_bf16_acts(!args.f32_acts);
        // SAFETY: the model, its arenas and the optimizer work on `stream`
        // alone; the GEMM-only timings above finished at the synchronize.
        unsafe { model.set_cuda_graph(!args.no_cuda_graph)? };
        let mut params = model.init_params(1)?;
        let mut grads = model.zeros_arena()?;
        let sched = Schedule {
            peak_lr: 1e-3,
            warmup_steps: 10,
            total_steps: 1000,
            min_lr_frac: 0.1,
        };
        let fresh = |model: &CudaModel| -> Res<Optimizer<CudaSlice<f32>>> {
            let (m, v) = (model.zeros_arena()?, model.zeros_arena()?);
            Ok(Optimizer::fresh(
                AdamWConfig::default(),
                sched,
                model.layout(),
                m,
                v,
            )?)
        };
        let mut opt = fresh(&model)?;
        let mut r = Rng::new(7);
        let tokens: Vec<u32> = (0..rows)
            .map(|_| r.below(cfg.vocab_size as u64) as u32)
            .collect();
        let targets: Vec<i32> = (0..rows)
            .map(|i| {
                if (i + 1) % t == 0 {
                    -100
                } else {
                    tokens[i + 1] as i32
                }
            })
            .collect();
        let batch = Batch {
            tokens,
            targets,
            batch: nb,
            seq_len: t,
        };

        let mut step_no = 0u64;
        let mut step =
            |model: &mut CudaModel, p: &mut CudaSlice<f32>, g: &mut CudaSlice<f32>| -> Res<f32> {
                let loss = model.forward_backward(p, &batch, g)?;
                opt.step(model, step_no, p, g, loss.is_finite())?;
                step_no += 1;
                Ok(loss)
            };
        let mut peak = 0usize;
        for _ in 0..args.warmup {
            step(&mut model, &mut params, &mut grads)?;
            peak = peak.max(used_bytes(&ctx)?.saturating_sub(baseline));
        }
        let (mut step_ms, mut wall_ms, mut last_loss) = (Vec::new(), Vec::new(), 0.0);
        for _ in 0..args.steps {
            let w = Instant::now();
            step_ms.push(timed(&stream, || {
                last_loss = step(&mut model, &mut params, &mut grads)?;
                Ok(())
            })?);
            wall_ms.push(w.elapsed().as_secs_f64() * 1e3);
            peak = peak.max(used_bytes(&ctx)?.saturating_sub(baseline));
        }
        let mut fwd_ms = Vec::new();
        for _ in 0..args.steps {
            fwd_ms.push(timed(&stream, || {
                model.loss(&params, &batch)?;
                Ok(())
            })?);
        }
        let mut opt2 = fresh(&model)?;
        let mut opt_ms = Vec::new();
        for i in 0..args.steps {
            opt_ms.push(timed(&stream, || {
                opt2.step(&mut model, i as u64, &mut params, &grads, true)?;
                Ok(())
            })?);
        }

        // Minimal bytes of a step (see the module docs).
        let (d, e) = (cfg.d_model, cfg.d_inner());
        let ld = cfg.dt_rank + 2 * cfg.d_state;
        let chunks = t.div_ceil(kernels::mamba::SCAN_CHUNK);
        let states = nb * chunks * e * cfg.d_state;
        let per_layer = if cfg.ssd().is_some() {
            // Mamba-2's kept activations: rstd, zx, uc, dt, y, g, rstd_g;
            // plus the residual (the SSD keeps no states).
            let cd = ssd_conv_channels(&cfg);
            rows * (d + 1 + ssd_in_width(&cfg) + cd + cfg.num_heads() + 2 * e + 1)
        } else {
            rows * (2 * d + 2 * e + e + ld + 3 * e + 1) + states
        };
        let pn = model.layout().len();
        let bytes = 4.0
            * ((3 * pn + 2 * pn + 4 * pn) as f64
                + 2.0 * (cfg.n_layer * per_layer + rows * (d + 1)) as f64
                + 5.0 * (rows * cfg.vocab_size) as f64);
        let floor_gemm = flops / ceil.gemm_flops_per_s * 1e3;
        let floor_bytes = bytes / ceil.copy_bytes_per_s * 1e3;
        let floor = floor_gemm.max(floor_bytes);
        let (sm, fm, om, wm) = (
            median(step_ms),
            median(fwd_ms),
            median(opt_ms),
            median(wall_ms),
        );
        let tokps = rows as f64 / (sm * 1e-3);
        if args.gemm_detail {
            println!("  the model's GEMM algorithms (each chosen once, at its first call):");
            for line in model.gemm_algorithms() {
                println!("    {line}");
            }
        }
        let exact =
            model.workspace_bytes() + 4 * 4 * pn + mamba_train::model::cuda::blas::WORKSPACE_BYTES;
        println!(
            "{sz:>5}{}{}{}: d {} x {} layers, vocab {}, batch {nb} x {t}: step {sm:.2} ms (wall {:.2}), {:.0} tokens/s; \
             forward {fm:.2} ms, optimizer {om:.2} ms, GEMMs alone {gemm_ms:.2} ms ({:.1} TFLOP/s); \
             floor {floor:.2} ms (GEMM {floor_gemm:.2}, bytes {floor_bytes:.2}) -> step/floor {:.2}; \
             memory high-water {:.2} GiB (model-owned {:.2} GiB); loss {last_loss:.4}",
            if args.recompute { " (recompute)" } else { "" },
            if args.f32_acts { " (f32 activations)" } else { "" },
            if args.no_cuda_graph { String::new() } else { format!(" (graph, {} replays)", model.graph_stats().replays) },
            cfg.d_model,
            cfg.n_layer,
            cfg.vocab_size,
            wm,
            tokps,
            flops / (gemm_ms * 1e-3) / 1e12,
            sm / floor,
            peak as f64 / (1u64 << 30) as f64,
            exact as f64 / (1u64 << 30) as f64,
        );
        json.push(StepRecord {
            size: sz.to_string(),
            precision: args.precision.name().to_string(),
            recompute: args.recompute,
            f32_acts: args.f32_acts,
            graph: !args.no_cuda_graph,
            graph_replays: model.graph_stats().replays,
            d_model: cfg.d_model,
            n_layer: cfg.n_layer,
            vocab: cfg.vocab_size,
            batch: nb,
            seq_len: t,
            step_ms: sm,
            wall_ms: wm,
            tokens_per_s: tokps,
            forward_ms: fm,
            optimizer_ms: om,
            gemm_ms,
            gemm_flops: flops,
            floor_ms: floor,
            floor_gemm_ms: floor_gemm,
            floor_bytes_ms: floor_bytes,
            step_over_floor: sm / floor,
            peak_bytes: peak,
            model_bytes: exact,
            copy_gbps: ceil.copy_bytes_per_s / 1e9,
            cublas_tflops: ceil.gemm_flops_per_s / 1e12,
            loss: last_loss,
        });
        drop((opt2, params, grads, model));
    }
    if let Some(path) = &args.json {
        let mut lines = String::new();
        for r in &json {
            lines += &serde_json::to_string(r)?;
            lines.push('\n');
        }
        std::fs::write(path, lines)?;
    }
    Ok(())
}

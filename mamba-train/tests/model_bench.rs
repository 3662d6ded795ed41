//! Throughput of the CPU model's training step (forward + backward).
//!
//! Ignored by default (it measures, it does not check); run it in release:
//! `cargo test --release -p mamba-train --test model_bench -- --ignored --nocapture`
//! Set `MAMBA_BENCH_THREADS=N` to pin the rayon pool size, `MAMBA_BENCH_ONLY=i`
//! to run only the i-th size.

use std::time::Instant;

use mamba_train::model::cpu::CpuModel;
use mamba_train::model::Batch;
use mamba_train::seed::Rng;
use mamba_train::ModelConfig;

/// CPU seconds used by this process so far (all threads), from
/// `/proc/self/stat` (Linux; 10 ms ticks). `None` elsewhere.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields of the whole line.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

fn bench(d_model: usize, n_layer: usize, nseq: usize, l: usize, vocab: usize) {
    let cfg = ModelConfig::new(vocab, d_model, n_layer);
    let model = CpuModel::new(cfg).unwrap();
    let p = model.init_params(1);
    let mut r = Rng::new(2);
    let tokens: Vec<u32> = (0..nseq * l)
        .map(|_| r.below(vocab as u64) as u32)
        .collect();
    let targets: Vec<i32> = (0..nseq * l)
        .map(|_| r.below(vocab as u64) as i32)
        .collect();
    let b = Batch {
        tokens,
        targets,
        batch: nseq,
        seq_len: l,
    };
    let mut g = vec![0.0f32; p.len()];
    model.forward_backward(&p, &b, &mut g).unwrap(); // warm-up
    let reps = 10;
    let c0 = cpu_seconds();
    let t0 = Instant::now();
    for _ in 0..reps {
        model.forward_backward(&p, &b, &mut g).unwrap();
    }
    let fb = t0.elapsed().as_secs_f64() / reps as f64;
    let fb_cpu = cpu_seconds().zip(c0).map(|(a, b)| (a - b) / reps as f64);
    let t0 = Instant::now();
    for _ in 0..reps {
        model.loss(&p, &b).unwrap();
    }
    let fwd = t0.elapsed().as_secs_f64() / reps as f64;
    let toks = (nseq * l) as f64;
    eprintln!(
        "d_model {d_model:4} layers {n_layer} batch {nseq:3} seq {l:4} vocab {vocab:3} params {:8}: \
         forward_backward {:7.1} ms = {:8.0} tok/s (cpu {:7.1} ms); forward {:7.1} ms = {:8.0} tok/s ({} threads)",
        p.len(),
        fb * 1e3,
        toks / fb,
        fb_cpu.map_or(f64::NAN, |c| c * 1e3),
        fwd * 1e3,
        toks / fwd,
        rayon::current_num_threads()
    );
}

#[test]
#[ignore = "benchmark; run with --release -- --ignored --nocapture"]
fn cpu_training_step_throughput() {
    // The CLI's default run (selective copying, vocab 11), then the sizes the
    // performance notes quote.
    let sizes = [
        (64, 2, 16, 48, 11),
        (64, 2, 16, 128, 32),
        (128, 4, 16, 128, 32),
        (256, 4, 8, 256, 256),
    ];
    // MAMBA_BENCH_ONLY=i runs size i alone (for profiling).
    let only = std::env::var("MAMBA_BENCH_ONLY")
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    let run = || {
        for (i, &(d, layers, nseq, l, vocab)) in sizes.iter().enumerate() {
            if only.is_none_or(|o| o == i) {
                bench(d, layers, nseq, l, vocab);
            }
        }
    };
    match std::env::var("MAMBA_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        Some(n) => rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
            .install(run),
        None => run(),
    }
}

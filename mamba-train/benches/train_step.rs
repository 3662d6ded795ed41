//! CPU training-step throughput (tokens/s) at three model sizes.
//!
//! `cargo bench -p mamba-train --bench train_step` (all cores), or with
//! `RAYON_NUM_THREADS=N` for a fixed thread count. Each size runs a few
//! warm-up steps, then times whole steps (forward, backward, clip, AdamW) and
//! reports the median.

use std::time::Instant;

use mamba_train::config::ModelConfig;
use mamba_train::data::{SelectiveCopyConfig, TaskSpec};
use mamba_train::dp::{self, DpOptions};
use mamba_train::model::cpu::CpuModel;
use mamba_train::optim::{AdamWConfig, Schedule};
use mamba_train::train::{RunConfig, Trainer, DEFAULT_CONTRACT};

struct Size {
    name: &'static str,
    d_model: usize,
    layers: usize,
    batch: usize,
    seq_len: usize,
    steps: usize,
}

const SIZES: [Size; 3] = [
    Size {
        name: "default (cli)",
        d_model: 64,
        layers: 2,
        batch: 16,
        seq_len: 48,
        steps: 20,
    },
    Size {
        name: "medium",
        d_model: 128,
        layers: 4,
        batch: 8,
        seq_len: 128,
        steps: 8,
    },
    Size {
        name: "large",
        d_model: 256,
        layers: 4,
        batch: 8,
        seq_len: 256,
        steps: 4,
    },
];

fn main() {
    println!(
        "CPU training step, {} threads",
        rayon::current_num_threads()
    );
    println!(
        "{:<14} {:>8} {:>7} {:>6} {:>5} {:>10} {:>12} {:>12}",
        "size", "d_model", "layers", "batch", "seq", "params", "ms/step", "tokens/s"
    );
    for s in &SIZES {
        let task = TaskSpec::SelectiveCopy(SelectiveCopyConfig {
            seq_len: s.seq_len,
            n_memorize: 8,
            alphabet: 8,
        });
        let run = RunConfig {
            seed: 0,
            model: ModelConfig::new(task.vocab_size(), s.d_model, s.layers),
            task,
            batch: s.batch,
            logical_world: 1,
            contract: DEFAULT_CONTRACT,
            optimizer: AdamWConfig::default(),
            schedule: Schedule {
                peak_lr: 1e-3,
                warmup_steps: 0,
                total_steps: 1_000_000,
                min_lr_frac: 0.1,
            },
        };
        let model = match CpuModel::new(run.model.clone()) {
            Ok(m) => m,
            Err(e) => {
                eprintln!("{}: {e}", s.name);
                continue;
            }
        };
        let trainer = Trainer::new(model, run.clone());
        let mut t = match trainer.and_then(|t| dp::host::local(t, DpOptions::default())) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("{}: {e}", s.name);
                continue;
            }
        };
        let mut times = Vec::with_capacity(s.steps);
        for i in 0..s.steps + 2 {
            let t0 = Instant::now();
            if let Err(e) = t.step() {
                eprintln!("{}: {e}", s.name);
                break;
            }
            if i >= 2 {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        if times.is_empty() {
            continue;
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        println!(
            "{:<14} {:>8} {:>7} {:>6} {:>5} {:>10} {:>12.1} {:>12.0}",
            s.name,
            s.d_model,
            s.layers,
            s.batch,
            s.seq_len,
            t.trainer().arena_len(),
            median * 1e3,
            run.tokens_per_step() as f64 / median
        );
    }
}

//! Data-parallel scaling of `mamba-train train --device cuda`: the step
//! time on P GPUs against one, at a fixed batch per GPU (weak scaling).
//!
//! ```text
//! cargo run --release -p mamba-train --example dp_scaling -- [--world 2] [--steps 10] [--warmup 3]
//! # from a bundle (finds bin/mamba-train next to itself):
//! DIR/bin/dp_scaling [--world 2] [--steps 10] [--same-bits]
//! ```
//!
//! It runs the real CLI twice, `--world 1` and `--world P`, each with the
//! logical world `L = P` (one micro-batch of `--batch` rows per GPU), on the
//! 130m shape by default: d_model 768, 24 layers, vocabulary 50280
//! (selective copying with an alphabet of 50278 data tokens, which gives
//! exactly that vocabulary), 1024 tokens per row, 8 rows per GPU; periodic
//! checkpoints and replica checks off so that no step includes them. Rank 0
//! writes each step's wall time into `metrics.jsonl` (as tokens/s over the
//! step's tokens; the step includes forward/backward, the gradient
//! reduction and AdamW); this program drops the first `--warmup` steps and
//! prints the median step time of each run and
//!
//! `efficiency = t(P = 1) / t(P = P)`
//!
//! (1.0: the reduction costs nothing; the issue's goal is at least 0.9).
//! With `--same-bits` it also runs `--world 1 --logical-world P` (the same
//! global batch on one GPU) and checks that its weights digest equals the
//! `--world P` run's under the chosen contract (fixed-order promises it).
//!
//! The binary is `--bin PATH`, else `MAMBA_TRAIN_BIN`, else `mamba-train`
//! next to this program (a bundle's `bin/`, or cargo's target directory).
//! Run directories go to a temporary directory, removed at the end unless
//! `--keep DIR` names one to keep.

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "P-GPU vs 1-GPU step time of mamba-train at a fixed batch per GPU")]
struct Args {
    /// GPUs (processes) of the scaled run.
    #[arg(long, default_value_t = 2)]
    world: usize,
    /// Steps per run (the schedule's length).
    #[arg(long, default_value_t = 10)]
    steps: u64,
    /// Leading steps left out of the median (allocation, cuBLAS and NCCL
    /// warm-up).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Residual width.
    #[arg(long, default_value_t = 768)]
    d_model: usize,
    /// Mamba blocks.
    #[arg(long, default_value_t = 24)]
    layers: usize,
    /// Vocabulary (at least 4): selective copying with vocab - 2 data tokens.
    #[arg(long, default_value_t = 50280)]
    vocab: usize,
    /// Tokens per row.
    #[arg(long, default_value_t = 1024)]
    seq_len: usize,
    /// Rows per GPU (per logical rank) and step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// cuda (one GPU per process), or cpu to try the recipe on a machine
    /// without GPUs (CPU processes sharing its cores: not a scaling number).
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Reduction contract: fixed-order or nccl-sum.
    #[arg(long, default_value = "fixed-order")]
    contract: String,
    /// Also run P logical ranks on one GPU and compare the digests.
    #[arg(long)]
    same_bits: bool,
    /// The mamba-train binary.
    #[arg(long)]
    bin: Option<PathBuf>,
    /// Keep the run directories here.
    #[arg(long)]
    keep: Option<PathBuf>,
}

/// What one run reported.
struct RunResult {
    /// Per-step wall times (seconds), in step order.
    step_secs: Vec<f64>,
    /// Hex SHA-256 of the final weights.
    digest: String,
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("dp_scaling: error: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<(), String> {
    if args.world < 2 {
        return Err(format!("--world must be at least 2, got {}", args.world));
    }
    if args.vocab < 4 {
        return Err(format!("--vocab must be at least 4, got {}", args.vocab));
    }
    if (args.steps as usize) <= args.warmup {
        return Err(format!(
            "--steps {} leaves no step after --warmup {}",
            args.steps, args.warmup
        ));
    }
    let bin = binary(args)?;
    let tmp;
    let root = match &args.keep {
        Some(d) => d.clone(),
        None => {
            tmp = tempfile::tempdir().map_err(|e| format!("cannot make a temporary dir: {e}"))?;
            tmp.path().to_path_buf()
        }
    };
    let p = args.world;
    println!(
        "dp_scaling: {} --device {}: d_model {} x {} layers, vocab {}, {} rows x {} tokens per \
         process, {} steps ({} warm-up), contract {}",
        bin.display(),
        args.device,
        args.d_model,
        args.layers,
        args.vocab,
        args.batch,
        args.seq_len,
        args.steps,
        args.warmup,
        args.contract
    );
    let one = train(&bin, args, &root.join("p1"), 1, 1)?;
    let many = train(&bin, args, &root.join(format!("p{p}")), p, p)?;
    let t1 = median(&one.step_secs[args.warmup..]);
    let tp = median(&many.step_secs[args.warmup..]);
    let tokens = (args.batch * args.seq_len) as f64;
    println!(
        "P = 1: median step {:.2} ms ({:.0} tokens/s); steps {}",
        1e3 * t1,
        tokens / t1,
        ms_list(&one.step_secs)
    );
    println!(
        "P = {p}: median step {:.2} ms ({:.0} tokens/s); steps {}",
        1e3 * tp,
        p as f64 * tokens / tp,
        ms_list(&many.step_secs)
    );
    println!(
        "efficiency t(P=1)/t(P={p}) = {:.3} (throughput x{:.2} on {p} {})",
        t1 / tp,
        p as f64 * t1 / tp,
        if args.device == "cuda" {
            "GPUs"
        } else {
            "processes"
        }
    );
    if args.same_bits {
        let solo = train(&bin, args, &root.join(format!("p1-l{p}")), 1, p)?;
        let same = solo.digest == many.digest;
        println!(
            "same bits: --world 1 --logical-world {p} {} --world {p} ({} vs {})",
            if same { "EQUALS" } else { "DIFFERS FROM" },
            solo.digest,
            many.digest
        );
        if !same && args.contract == "fixed-order" {
            return Err("fixed-order promised the same bits for every P at fixed L".into());
        }
    }
    if let Some(d) = &args.keep {
        println!("run directories kept in {}", d.display());
    }
    Ok(())
}

/// The mamba-train binary to run (see the module docs).
fn binary(args: &Args) -> Result<PathBuf, String> {
    if let Some(b) = &args.bin {
        return Ok(b.clone());
    }
    if let Some(b) = std::env::var_os("MAMBA_TRAIN_BIN") {
        return Ok(b.into());
    }
    let me = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let dir = me.parent().unwrap_or(Path::new("."));
    // A bundle's bin/ holds both; cargo puts examples one level below.
    for cand in [dir.join("mamba-train"), dir.join("..").join("mamba-train")] {
        if cand.is_file() {
            return Ok(cand);
        }
    }
    Err(format!(
        "no mamba-train binary next to {} (nor one level up); pass --bin PATH or set \
         MAMBA_TRAIN_BIN (cargo build --release -p mamba-train builds it)",
        me.display()
    ))
}

/// Run `train` on `world` GPUs with logical world `logical` into `out`.
fn train(
    bin: &Path,
    args: &Args,
    out: &Path,
    world: usize,
    logical: usize,
) -> Result<RunResult, String> {
    let s = |v: usize| v.to_string();
    let mut c = Command::new(bin);
    c.arg("train")
        .args(["--device", &args.device, "--task", "selective-copy"])
        .args(["--alphabet", &s(args.vocab - 2)])
        .args(["--memorize", &s((args.seq_len / 2).clamp(1, 16))])
        .args(["--seq-len", &s(args.seq_len)])
        .args(["--batch", &s(args.batch)])
        .args(["--d-model", &s(args.d_model)])
        .args(["--layers", &s(args.layers)])
        .args(["--steps", &args.steps.to_string()])
        .args(["--world", &s(world), "--logical-world", &s(logical)])
        .args(["--contract", &args.contract])
        .args(["--checkpoint-every", "0", "--replica-check-every", "0"])
        .args(["--eval-batches", "1", "--log-every", "1"])
        .arg("--out")
        .arg(out);
    eprintln!("dp_scaling: running {c:?}");
    let o = c
        .output()
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    let stdout = String::from_utf8_lossy(&o.stdout);
    if !o.status.success() {
        return Err(format!(
            "--world {world} --logical-world {logical} failed ({}):\n{stdout}\n{}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        ));
    }
    let digest = stdout
        .lines()
        .last()
        .and_then(|l| l.strip_prefix("weights-digest: "))
        .ok_or_else(|| format!("no weights-digest line at the end of:\n{stdout}"))?
        .to_string();
    let metrics = out.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics)
        .map_err(|e| format!("cannot read {}: {e}", metrics.display()))?;
    let tokens = (args.batch * args.seq_len * logical) as f64;
    let mut step_secs = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| format!("{}: not JSON ({e}): {line}", metrics.display()))?;
        let tps = v["tokens_per_s"]
            .as_f64()
            .filter(|t| *t > 0.0)
            .ok_or_else(|| format!("{}: no tokens_per_s in {line}", metrics.display()))?;
        step_secs.push(tokens / tps);
    }
    if step_secs.len() as u64 != args.steps {
        return Err(format!(
            "{} logs {} steps, expected {}",
            metrics.display(),
            step_secs.len(),
            args.steps
        ));
    }
    Ok(RunResult { step_secs, digest })
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}

fn ms_list(v: &[f64]) -> String {
    v.iter()
        .map(|s| format!("{:.1}", 1e3 * s))
        .collect::<Vec<_>>()
        .join(" ")
}

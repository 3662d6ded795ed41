//! Logits and next-token loss of a checkpoint on given tokens, for the
//! cross-check against Hugging Face transformers (`scripts/hf_crosscheck.py`).
//!
//! ```text
//! hf_logits --checkpoint DIR --tokens FILE --batch B --seq-len T \
//!     [--device cpu|cuda] [--cuda-device N] [--precision f32|f64] --out FILE
//! ```
//!
//! **`--checkpoint DIR`**: a mamba-train checkpoint (a checkpoint directory,
//! or a run directory whose `checkpoints/LATEST` names one; loaded and
//! verified by `checkpoint::load`, digest included), or any directory holding
//! a Hugging Face Mamba or Mamba-2 `config.json` (`model_type` `mamba` or
//! `mamba2`) and an F32 `model.safetensors`, e.g. one written by
//! transformers' `save_pretrained` (loaded by `checkpoint::load_hf`; a
//! stored `lm_head.weight` must equal the embedding). Config fields this
//! model hard-codes are checked too: `layer_norm_epsilon` must be 1e-5 as an
//! f32, `hidden_act` silu, `intermediate_size` = `expand * hidden_size`
//! (Mamba-1), and Mamba-2's fixed fields (bias-free projections, conv bias,
//! the gated norm after the gate).
//!
//! A Mamba-2 model runs on the CPU reference (`Mamba2Model`), f32 or f64,
//! or with `--device cuda` on the CUDA model (f32, any `n_groups`).
//!
//! **`--tokens FILE`**: exactly `B * T` token ids as little-endian `u32`,
//! row-major `[B, T]`, no header (`numpy.asarray(ids, dtype="<u4").tofile`);
//! each id below the vocabulary size.
//!
//! **`--out FILE`**: a safetensors file with
//! - `logits`: `[B, T, V]`, F32 (F64 with `--precision f64`);
//! - `loss`: scalar (shape `[]`), same dtype: the mean cross-entropy of
//!   position `t` predicting token `t + 1` over the `B * (T - 1)` positions
//!   with a successor in their row, i.e. transformers'
//!   `model(input_ids=ids, labels=ids).loss` (0 when `T = 1`);
//! - `tokens`: `[B, T]`, U32, the ids as read (so a reader can check that
//!   both sides scored the same input);
//!
//! and metadata `source` (`mamba-train` or `hugging-face`), `checkpoint`
//! (the directory read), `device`, `precision` and `config` (the model shape
//! as JSON).
//!
//! `--precision f64` runs the CPU reference's f64 program (same operations,
//! same order, in f64) on the f32 weights: a higher-precision point to
//! measure either side's f32 rounding against. CUDA runs f32 only.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use mamba_train::checkpoint::{self, HF_CONFIG_FILE, LATEST, STATE_FILE};
use mamba_train::config::Arch;
use mamba_train::model::cpu::{CpuModel, Mamba2Model};
use mamba_train::model::cuda::CudaModel;
use mamba_train::model::{Batch, IGNORE};
use mamba_train::ModelConfig;
use safetensors::tensor::{Dtype, TensorView};

/// Where the forward pass runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// The CPU reference model.
    Cpu,
    /// The CUDA model.
    Cuda,
}

/// Arithmetic of the forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Precision {
    /// f32, as trained.
    F32,
    /// The CPU reference's f64 program (CPU only).
    F64,
}

/// Command line.
#[derive(Clone, Debug, Parser)]
#[command(
    name = "hf_logits",
    about = "Logits [B,T,V] and mean next-token loss of a checkpoint on given tokens, as safetensors"
)]
pub struct Args {
    /// mamba-train checkpoint or run directory, or a Hugging Face directory
    /// (config.json + model.safetensors).
    #[arg(long, value_name = "DIR")]
    pub checkpoint: PathBuf,
    /// B*T token ids, little-endian u32, row-major [B, T], no header.
    #[arg(long, value_name = "FILE")]
    pub tokens: PathBuf,
    /// Sequences (B).
    #[arg(long, value_name = "B")]
    pub batch: usize,
    /// Tokens per sequence (T).
    #[arg(long, value_name = "T")]
    pub seq_len: usize,
    /// Where to run.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// CUDA device ordinal (with --device cuda).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub cuda_device: usize,
    /// f32 (as trained) or f64 (CPU reference program in f64; CPU only).
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,
    /// Output safetensors file (tensors logits, loss, tokens).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

/// Which writer a checkpoint directory came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A mamba-train checkpoint (state.json, verified digest).
    MambaTrain,
    /// A Hugging Face directory (config.json + model.safetensors).
    HuggingFace,
}

impl Source {
    /// The `source` metadata value.
    pub fn name(self) -> &'static str {
        match self {
            Source::MambaTrain => "mamba-train",
            Source::HuggingFace => "hugging-face",
        }
    }
}

/// Weights read from a directory.
#[derive(Clone, Debug)]
pub struct Loaded {
    /// The model shape.
    pub cfg: ModelConfig,
    /// The weight arena (the shared [`mamba_train::ParamLayout`]).
    pub params: Vec<f32>,
    /// Who wrote it.
    pub source: Source,
    /// The directory the files were read from (the resolved checkpoint).
    pub dir: PathBuf,
}

/// Logits in the precision they were computed in.
#[derive(Clone, Debug, PartialEq)]
pub enum Logits {
    /// From the f32 models.
    F32(Vec<f32>),
    /// From the CPU reference's f64 program.
    F64(Vec<f64>),
}

/// What a run computed.
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    /// `[B, T, V]`, row-major.
    pub logits: Logits,
    /// Mean next-token loss (an f32 value widened, under [`Precision::F32`]).
    pub loss: f64,
}

/// Load the weights meant by `dir` (see the module docs).
pub fn load_model(dir: &Path) -> Result<Loaded, String> {
    let ours = dir.join(STATE_FILE).is_file()
        || dir.join(checkpoint::CHECKPOINTS_DIR).join(LATEST).is_file()
        || dir.join(LATEST).is_file();
    if ours {
        // load() checks config.json against the model, the fields it
        // hard-codes (activation, inner width, epsilon) included.
        let ck = checkpoint::load(dir).map_err(|e| e.to_string())?;
        return Ok(Loaded {
            cfg: ck.state.run.model.clone(),
            params: ck.params,
            source: Source::MambaTrain,
            dir: ck.dir,
        });
    }
    if dir.join(HF_CONFIG_FILE).is_file() {
        let (cfg, params) = checkpoint::load_hf(dir).map_err(|e| e.to_string())?;
        return Ok(Loaded {
            cfg,
            params,
            source: Source::HuggingFace,
            dir: dir.to_path_buf(),
        });
    }
    Err(format!(
        "{}: no model here; expected a mamba-train checkpoint or run directory ({STATE_FILE} or \
         checkpoints/{LATEST}) or a Hugging Face directory ({HF_CONFIG_FILE} + model.safetensors)",
        dir.display()
    ))
}

/// Read exactly `batch * seq_len` little-endian `u32` ids, each below `vocab`.
pub fn read_tokens(
    path: &Path,
    batch: usize,
    seq_len: usize,
    vocab: usize,
) -> Result<Vec<u32>, String> {
    let bytes = fs::read(path).map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    let n = batch
        .checked_mul(seq_len)
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("--batch {batch} x --seq-len {seq_len}: need at least one token"))?;
    if bytes.len() != 4 * n {
        return Err(format!(
            "{}: {} bytes, expected {} ({batch} x {seq_len} little-endian u32 token ids)",
            path.display(),
            bytes.len(),
            4 * n
        ));
    }
    let tokens: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    if let Some((i, &t)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab)
    {
        return Err(format!(
            "{}: token {t} at index {i} (row {}, position {}) is not below the vocabulary size {vocab}",
            path.display(),
            i / seq_len,
            i % seq_len
        ));
    }
    Ok(tokens)
}

/// The batch whose loss is transformers' `labels = input_ids` loss: the
/// target of position `t` is token `t + 1` of the same row; the last
/// position of each row has none ([`IGNORE`]).
pub fn next_token_batch(tokens: Vec<u32>, batch: usize, seq_len: usize) -> Batch {
    let targets = (0..tokens.len())
        .map(|i| {
            if (i + 1) % seq_len == 0 {
                IGNORE
            } else {
                tokens[i + 1] as i32
            }
        })
        .collect();
    Batch {
        tokens,
        targets,
        batch,
        seq_len,
    }
}

/// Run the forward pass of `m` on `batch`.
pub fn score(
    m: &Loaded,
    batch: &Batch,
    device: Device,
    cuda_device: usize,
    precision: Precision,
) -> Result<Scored, String> {
    let err = |e: mamba_train::TrainError| e.to_string();
    // The two CPU references share their API (`host::cpu_model_api!`), so
    // one body scores either.
    macro_rules! on_cpu {
        ($model:expr) => {{
            let model = $model.map_err(err)?;
            match precision {
                Precision::F32 => Scored {
                    logits: Logits::F32(model.logits(&m.params, batch).map_err(err)?),
                    loss: model.loss(&m.params, batch).map_err(err)? as f64,
                },
                Precision::F64 => {
                    let p: Vec<f64> = m.params.iter().map(|&x| x as f64).collect();
                    Scored {
                        logits: Logits::F64(model.logits_f64(&p, batch).map_err(err)?),
                        loss: model.loss_f64(&p, batch).map_err(err)?,
                    }
                }
            }
        }};
    }
    let mamba2 = matches!(m.cfg.arch, Arch::Mamba2(_));
    match (device, precision) {
        (Device::Cpu, _) if mamba2 => Ok(on_cpu!(Mamba2Model::new(m.cfg.clone()))),
        (Device::Cpu, _) => Ok(on_cpu!(CpuModel::new(m.cfg.clone()))),
        (Device::Cuda, Precision::F32) => {
            let mut model = CudaModel::new(m.cfg.clone(), cuda_device).map_err(err)?;
            let logits = model.logits_host(&m.params, batch).map_err(err)?;
            let loss = model.loss_host(&m.params, batch).map_err(err)?;
            Ok(Scored {
                logits: Logits::F32(logits),
                loss: loss as f64,
            })
        }
        (Device::Cuda, Precision::F64) => {
            Err("--precision f64 runs on the CPU only; use --device cpu".into())
        }
    }
}

/// Serialize `scored` (see the module docs for the file's contents).
pub fn encode_output(
    scored: &Scored,
    batch: &Batch,
    vocab: usize,
    metadata: HashMap<String, String>,
) -> Result<Vec<u8>, String> {
    let (b, t) = (batch.batch, batch.seq_len);
    let (dtype, logits, loss): (Dtype, Vec<u8>, Vec<u8>) = match &scored.logits {
        Logits::F32(v) => (
            Dtype::F32,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            (scored.loss as f32).to_le_bytes().to_vec(),
        ),
        Logits::F64(v) => (
            Dtype::F64,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            scored.loss.to_le_bytes().to_vec(),
        ),
    };
    let tokens: Vec<u8> = batch.tokens.iter().flat_map(|x| x.to_le_bytes()).collect();
    let view = |name: &str, dtype, shape: Vec<usize>, data| {
        TensorView::new(dtype, shape, data).map_err(|e| format!("tensor {name}: {e}"))
    };
    let views = vec![
        ("logits", view("logits", dtype, vec![b, t, vocab], &logits)?),
        ("loss", view("loss", dtype, vec![], &loss)?),
        ("tokens", view("tokens", Dtype::U32, vec![b, t], &tokens)?),
    ];
    safetensors::serialize(views, Some(metadata)).map_err(|e| format!("safetensors: {e}"))
}

/// What [`run`] did, for the summary line.
#[derive(Clone, Debug)]
pub struct Summary {
    /// The weights used.
    pub loaded: Loaded,
    /// The results written.
    pub scored: Scored,
}

/// Load, score, write `args.out`.
pub fn run(args: &Args) -> Result<Summary, String> {
    let loaded = load_model(&args.checkpoint)?;
    let tokens = read_tokens(
        &args.tokens,
        args.batch,
        args.seq_len,
        loaded.cfg.vocab_size,
    )?;
    let batch = next_token_batch(tokens, args.batch, args.seq_len);
    let scored = score(
        &loaded,
        &batch,
        args.device,
        args.cuda_device,
        args.precision,
    )?;
    let expect = args.batch * args.seq_len * loaded.cfg.vocab_size;
    let got = match &scored.logits {
        Logits::F32(v) => v.len(),
        Logits::F64(v) => v.len(),
    };
    if got != expect {
        return Err(format!(
            "the model returned {got} logits, expected B*T*V = {expect}"
        ));
    }
    let mut meta = HashMap::new();
    meta.insert("source".to_string(), loaded.source.name().to_string());
    meta.insert("checkpoint".to_string(), loaded.dir.display().to_string());
    let device = match args.device {
        Device::Cpu => "cpu".to_string(),
        Device::Cuda => format!("cuda:{}", args.cuda_device),
    };
    meta.insert("device".to_string(), device);
    let precision = match args.precision {
        Precision::F32 => "f32",
        Precision::F64 => "f64",
    };
    meta.insert("precision".to_string(), precision.to_string());
    meta.insert(
        "config".to_string(),
        serde_json::to_string(&loaded.cfg).map_err(|e| format!("encoding the config: {e}"))?,
    );
    let bytes = encode_output(&scored, &batch, loaded.cfg.vocab_size, meta)?;
    fs::write(&args.out, bytes)
        .map_err(|e| format!("{}: cannot write: {e}", args.out.display()))?;
    Ok(Summary { loaded, scored })
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(s) => {
            let c = &s.loaded.cfg;
            println!(
                "hf_logits: {} weights from {} (d_model {}, {} layers, d_state {}, vocab {}); \
                 {:?} {:?}, batch {} x {}: loss {:.7}; wrote {}",
                s.loaded.source.name(),
                s.loaded.dir.display(),
                c.d_model,
                c.n_layer,
                c.d_state,
                c.vocab_size,
                args.device,
                args.precision,
                args.batch,
                args.seq_len,
                s.scored.loss,
                args.out.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("hf_logits: {e}");
            ExitCode::FAILURE
        }
    }
}

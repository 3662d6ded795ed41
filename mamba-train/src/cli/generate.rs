//! `mamba-train generate`: prompt in, text out, by recurrent decoding on
//! the CPU or a GPU ([`crate::generate`]). The continuation goes to stdout
//! (followed by one newline); what was loaded and the prefill and decode
//! speeds go to stderr.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Args;

use super::args::Device;
use super::progress::{human, stderr_line};
use super::run_dir::io_err;
use super::source::load_model;
use crate::config::ModelConfig;
use crate::error::{Result, TrainError};
use crate::generate::text::{prompt_tokens, tokens_text};
use crate::generate::{generate as run_engine, GenerateOptions, Generation, Phase, Sampling};
use crate::model::cpu::CpuDecoder;
use crate::model::cuda::CudaDecoder;
use crate::model::{DecodeState, Decoder};

/// Default of `--max-new-tokens`.
pub const MAX_NEW_TOKENS: usize = 64;

/// `mamba-train generate` flags.
#[derive(Clone, Debug, Args)]
pub struct GenerateArgs {
    /// The model: a run directory, a checkpoint directory, or a Hugging
    /// Face directory (config.json + model.safetensors).
    #[arg(long, value_name = "DIR")]
    pub checkpoint: PathBuf,
    /// Text to continue, encoded with the model's tokenizer (the one the
    /// run trained with, or the Hugging Face directory's tokenizer.json;
    /// byte-level text otherwise).
    #[arg(long, value_name = "TEXT")]
    pub prompt: String,
    /// A tokenizer.json to use instead of the one the checkpoint holds
    /// (for a tokenized run it must be the run's own: its SHA-256 is
    /// checked).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Tokens to generate.
    #[arg(long, value_name = "N", default_value_t = MAX_NEW_TOKENS)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy (the most likely token, ties to
    /// the lowest id).
    #[arg(
        long,
        value_name = "T",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    pub temperature: f64,
    /// Sample among the K most likely tokens only (needs --temperature > 0).
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Sample among the most likely tokens whose probability mass reaches
    /// P, in (0, 1] (needs --temperature > 0).
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    pub top_p: Option<f64>,
    /// Seed of the sampled draws: the same seed gives the same text
    /// (needs --temperature > 0) [default: 0].
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,
    /// Where to run (cuda: GPU 0).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
}

impl GenerateArgs {
    /// The sampling settings, refusing sampling flags that greedy decoding
    /// would silently ignore.
    pub fn sampling(&self) -> Result<Sampling> {
        let s = Sampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p.unwrap_or(1.0),
            seed: self.seed.unwrap_or(0),
        };
        s.validate()?;
        if s.is_greedy() {
            for (flag, given) in [
                ("--top-k", self.top_k.is_some()),
                ("--top-p", self.top_p.is_some()),
                ("--seed", self.seed.is_some()),
            ] {
                if given {
                    return Err(TrainError::Config(format!(
                        "{flag} only applies to sampling, but --temperature is 0 (greedy, the \
                         default); pass --temperature T > 0 to sample"
                    )));
                }
            }
        }
        Ok(s)
    }
}

/// Run `generate`, writing the continuation to `out` (stdout in the binary).
pub fn generate(args: &GenerateArgs, out: &mut dyn Write) -> Result<Generation> {
    let sampling = args.sampling()?;
    let model = load_model(&args.checkpoint, args.tokenizer.as_deref())?;
    let codec = model.codec.clone();
    let described = model.describe();
    let cfg = model.cfg.clone();
    // The model first: one it cannot decode is refused whatever the prompt.
    let mut dec = decoder_for(&cfg, model.params, args.device, &model.dir)?;
    let prompt = prompt_tokens(&args.prompt, &codec, cfg.vocab_size)?;
    let opts = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        sampling,
        // A tokenizer's end-of-text token ends the continuation.
        stop_token: codec.eos(),
    };
    let how = if sampling.is_greedy() {
        "greedy".to_string()
    } else {
        format!(
            "sampled (temperature {}, top-k {}, top-p {}, seed {})",
            sampling.temperature,
            sampling.top_k.map_or("all".into(), |k| k.to_string()),
            sampling.top_p,
            sampling.seed
        )
    };
    stderr_line(&format!(
        "mamba-train generate: {} on {}; {how}; recurrent state {} floats per sequence at \
         every position",
        described,
        dec.device_name(),
        DecodeState::len_for(&cfg)
    ));
    let g = run_engine(dec.as_mut(), &prompt, &opts)?;
    let stdout = Path::new("<stdout>");
    writeln!(out, "{}", tokens_text(&g.tokens, &codec)?).map_err(|e| io_err(stdout, e))?;
    out.flush().map_err(|e| io_err(stdout, e))?;
    stderr_line(&format!(
        "prefill: {}; decode: {}",
        speed(&g.prefill),
        speed(&g.decode)
    ));
    Ok(g)
}

/// The recurrent decoder of the model `cfg` (weights `params`, read from
/// `dir`) on `device`: the one place a decoder is chosen, for either
/// architecture.
fn decoder_for(
    cfg: &ModelConfig,
    params: Vec<f32>,
    device: Device,
    dir: &Path,
) -> Result<Box<dyn Decoder>> {
    Ok(match device {
        Device::Cpu => Box::new(CpuDecoder::new(cfg.clone(), params)?),
        Device::Cuda => Box::new(
            CudaDecoder::on_device(cfg.clone(), &params, 0).map_err(|e| {
                TrainError::Config(format!(
                "--device cuda with --checkpoint {}: {e}; on a machine without a GPU use --device \
                 cpu",
                dir.display()
            ))
            })?,
        ),
    })
}

fn speed(p: &Phase) -> String {
    format!(
        "{} tokens in {:.3} s ({} tokens/s)",
        p.tokens,
        p.secs,
        human(p.tokens_per_s())
    )
}

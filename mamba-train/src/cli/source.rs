//! `--checkpoint DIR` of `generate` and `eval`: which model a directory
//! holds. A mamba-train checkpoint (a run directory, whose
//! `checkpoints/LATEST` names one, or a checkpoint directory with
//! `state.json`) is loaded and verified in full and brings its run (task,
//! seed); any other directory with a Hugging Face `config.json` and
//! `model.safetensors` brings weights only.

use std::path::{Path, PathBuf};

use crate::checkpoint::{self, HF_CONFIG_FILE, WEIGHTS_FILE};
use crate::config::ModelConfig;
use crate::data::{Codec, TaskKind};
use crate::error::{Result, TrainError};
use crate::run_config::RunConfig;

/// A model read from `--checkpoint`.
#[derive(Clone, Debug)]
pub struct LoadedModel {
    /// The model's shape.
    pub cfg: ModelConfig,
    /// The weight arena.
    pub params: Vec<f32>,
    /// The directory the weights came from.
    pub dir: PathBuf,
    /// For a mamba-train checkpoint: its run and step.
    pub run: Option<(RunConfig, u64)>,
    /// Text to tokens and back: the run's tokenizer (the checkpoint's copy,
    /// checked against the run's record), a Hugging Face directory's
    /// `tokenizer.json`, `--tokenizer`, or byte-level.
    pub codec: Codec,
}

impl LoadedModel {
    /// One line saying what was loaded, for stderr.
    pub fn describe(&self) -> String {
        let c = &self.cfg;
        let what = match &self.run {
            Some((run, step)) => format!("step {step} of a {} run", run.task.kind()),
            None => "Hugging Face weights".to_string(),
        };
        format!(
            "{} ({what}; {}d_model {} x {} layers, d_state {}, vocabulary {})",
            self.dir.display(),
            super::arch::shape_note(c),
            c.d_model,
            c.n_layer,
            c.d_state,
            c.vocab_size
        )
    }
}

/// The model `--checkpoint path` names (module docs); a path that is
/// neither kind is refused naming the flag and both layouts.
///
/// `tokenizer` (`--tokenizer`) overrides the tokenizer the directory holds;
/// a run trained without one (byte-level text) has no use for it.
pub fn load_model(path: &Path, tokenizer: Option<&Path>) -> Result<LoadedModel> {
    if !path.is_dir() {
        return Err(TrainError::Config(format!(
            "--checkpoint {}: no such directory; pass a run directory, a checkpoint directory \
             or a Hugging Face model directory",
            path.display()
        )));
    }
    let not_ours = match checkpoint::resolve(path) {
        Ok(_) => {
            let ck = checkpoint::load(path)?;
            let task = &ck.state.run.task;
            let codec = match tokenizer {
                Some(t) => {
                    let json = std::fs::read(t).map_err(|e| {
                        TrainError::Config(format!("--tokenizer {}: cannot read: {e}", t.display()))
                    })?;
                    task.codec(Some(&json), t)?
                }
                // Synthetic tasks have no text: their token ids are shown
                // as bytes.
                None if matches!(task.kind(), TaskKind::SelectiveCopy | TaskKind::Induction) => {
                    Codec::bytes()
                }
                None => task.codec(ck.tokenizer_json.as_deref(), &ck.dir)?,
            };
            return Ok(LoadedModel {
                cfg: ck.state.run.model.clone(),
                params: ck.params,
                dir: ck.dir,
                run: Some((ck.state.run, ck.state.step)),
                codec,
            });
        }
        Err(e) => e,
    };
    if path.join(HF_CONFIG_FILE).is_file() && path.join(WEIGHTS_FILE).is_file() {
        let (cfg, params) = checkpoint::load_hf(path)?;
        let own = path.join(crate::checkpoint::TOKENIZER_FILE);
        let codec = match tokenizer {
            Some(t) => Codec::from_file(t)?,
            None if own.is_file() => Codec::from_file(&own)?,
            None => Codec::bytes(),
        };
        return Ok(LoadedModel {
            cfg,
            params,
            dir: path.to_path_buf(),
            run: None,
            codec,
        });
    }
    Err(TrainError::Config(format!(
        "--checkpoint {}: holds no model ({not_ours}); nor is it a Hugging Face directory \
         (with {HF_CONFIG_FILE} and {WEIGHTS_FILE})",
        path.display()
    )))
}

//! `--checkpoint DIR` of `generate` and `eval`: which model a directory
//! holds. A mamba-train checkpoint (a run directory, whose
//! `checkpoints/LATEST` names one, or a checkpoint directory with
//! `state.json`) is loaded and verified in full and brings its run (task,
//! seed); any other directory with a Hugging Face `config.json` and
//! `model.safetensors` brings weights only.

use std::path::{Path, PathBuf};

use crate::checkpoint::{self, HF_CONFIG_FILE, WEIGHTS_FILE};
use crate::config::ModelConfig;
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
            "{} ({what}; d_model {} x {} layers, d_state {}, vocabulary {})",
            self.dir.display(),
            c.d_model,
            c.n_layer,
            c.d_state,
            c.vocab_size
        )
    }
}

/// The model `--checkpoint path` names (module docs); a path that is
/// neither kind is refused naming the flag and both layouts.
pub fn load_model(path: &Path) -> Result<LoadedModel> {
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
            return Ok(LoadedModel {
                cfg: ck.state.run.model.clone(),
                params: ck.params,
                dir: ck.dir,
                run: Some((ck.state.run, ck.state.step)),
            });
        }
        Err(e) => e,
    };
    if path.join(HF_CONFIG_FILE).is_file() && path.join(WEIGHTS_FILE).is_file() {
        let (cfg, params) = checkpoint::load_hf(path)?;
        return Ok(LoadedModel {
            cfg,
            params,
            dir: path.to_path_buf(),
            run: None,
        });
    }
    Err(TrainError::Config(format!(
        "--checkpoint {}: holds no model ({not_ours}); nor is it a Hugging Face directory \
         (with {HF_CONFIG_FILE} and {WEIGHTS_FILE})",
        path.display()
    )))
}

//! Reading a checkpoint: resolving a run or checkpoint path, verifying
//! every file against its digest, the resume checks, and Hugging Face
//! directories.

use crate::error::Result;
use crate::params::ParamLayout;
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use super::*;

/// The checkpoint directory meant by `path`: a checkpoint directory itself
/// (has `state.json`), or a run directory / `checkpoints` directory whose
/// `LATEST` names one.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join(STATE_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    for root in [path.join(CHECKPOINTS_DIR), path.to_path_buf()] {
        let latest = root.join(LATEST);
        if latest.is_file() {
            let name =
                fs::read_to_string(&latest).map_err(|e| io_err(&latest, "cannot read", e))?;
            let dir = root.join(name.trim());
            if !dir.join(STATE_FILE).is_file() {
                return Err(ck_err(
                    &latest,
                    format!("names {:?}, which holds no {STATE_FILE}", name.trim()),
                ));
            }
            return Ok(dir);
        }
    }
    Err(ck_err(
        path,
        format!(
            "no checkpoint here: expected a checkpoint directory (with {STATE_FILE}) or a run directory with {CHECKPOINTS_DIR}/{LATEST}"
        ),
    ))
}

/// Load the checkpoint meant by `path` (see [`resolve`]) and verify it:
/// format version, `state.json`'s own digest and the digest of every other
/// file (the error names the file), config.json against the state's model,
/// every tensor's name, dtype and shape, no extra tensors, and the weights
/// digest.
pub fn load(path: &Path) -> Result<Checkpoint> {
    let dir = resolve(path)?;
    let read = |file: &str| -> Result<Vec<u8>> {
        let p = dir.join(file);
        fs::read(&p).map_err(|e| io_err(&p, "cannot read", e))
    };
    let st_path = dir.join(STATE_FILE);
    let value: serde_json::Value = serde_json::from_slice(&read(STATE_FILE)?)
        .map_err(|e| ck_err(&st_path, format!("not a valid state file: {e}")))?;
    let version = value.get("format_version").and_then(|v| v.as_u64());
    if version != Some(u64::from(FORMAT_VERSION)) {
        let found = version.map_or("none".to_string(), |v| v.to_string());
        return Err(ck_err(
            &st_path,
            format!(
                "checkpoint format {found} is not supported: this build reads format \
                 {FORMAT_VERSION} only (format 1 had no digests of the optimizer moments); \
                 resume it with the build that wrote it, or start a new run"
            ),
        ));
    }
    let recorded = value.get(STATE_DIGEST).and_then(|v| v.as_str());
    let actual = state_json_digest(&value);
    if recorded != Some(actual.as_str()) {
        return Err(ck_err(
            &st_path,
            format!(
                "{STATE_FILE} digest {actual} does not match its recorded {STATE_DIGEST} {}: \
                 the file is corrupted or was edited",
                recorded.unwrap_or("(none)")
            ),
        ));
    }
    let state: RunState = serde_json::from_value(value.clone())
        .map_err(|e| ck_err(&st_path, format!("not a valid state file: {e}")))?;
    let meta: CheckpointMeta = serde_json::from_value(value.clone())
        .map_err(|e| ck_err(&st_path, format!("not a valid state file: {e}")))?;
    let digests: BTreeMap<String, String> = value
        .get(FILE_DIGESTS)
        .cloned()
        .map(serde_json::from_value)
        .transpose()
        .map_err(|e| ck_err(&st_path, format!("{FILE_DIGESTS} is not valid: {e}")))?
        .unwrap_or_default();
    // Every file, read once and checked against its recorded digest.
    let checked = |file: &str| -> Result<Vec<u8>> {
        let bytes = read(file)?;
        let p = dir.join(file);
        let want = digests
            .get(file)
            .ok_or_else(|| ck_err(&st_path, format!("records no digest of {file}")))?;
        let got = bytes_digest(&bytes);
        if &got != want {
            return Err(ck_err(
                &p,
                format!(
                    "{file} digest {got} does not match the {want} recorded in {STATE_FILE}: \
                     the file is corrupted or was changed"
                ),
            ));
        }
        Ok(bytes)
    };
    let hf_bytes = checked(HF_CONFIG_FILE)?;
    let w_bytes = checked(WEIGHTS_FILE)?;
    let o_bytes = checked(OPTIMIZER_FILE)?;
    let tokenizer_json = match (
        digests.contains_key(TOKENIZER_FILE),
        state.run.task.tokenizer(),
    ) {
        (true, Some(rec)) => {
            let bytes = checked(TOKENIZER_FILE)?;
            let sha = bytes_digest(&bytes);
            if sha != rec.sha256 {
                return Err(ck_err(
                    &dir.join(TOKENIZER_FILE),
                    format!(
                        "{TOKENIZER_FILE} has sha256 {sha} but the run's tokenizer has {}",
                        rec.sha256
                    ),
                ));
            }
            Some(bytes)
        }
        (false, Some(rec)) => {
            return Err(ck_err(
                &st_path,
                format!(
                    "the run was trained with the tokenizer {} but the checkpoint holds no \
                     {TOKENIZER_FILE}",
                    rec.path.display()
                ),
            ))
        }
        (true, None) => {
            return Err(ck_err(
                &st_path,
                format!("records a {TOKENIZER_FILE} but the run has no tokenizer"),
            ))
        }
        (false, None) => None,
    };
    state
        .run
        .model
        .validate()
        .map_err(|e| ck_err(&st_path, e.to_string()))?;
    let hf_path = dir.join(HF_CONFIG_FILE);
    let hf = super::config_json::parse(&hf_bytes)
        .map_err(|e| ck_err(&hf_path, format!("not valid JSON: {e}")))?;
    hf_config::check_hf_config(&hf, &state.run.model).map_err(|e| ck_err(&hf_path, e))?;

    let layout = ParamLayout::new(&state.run.model);
    let w_path = dir.join(WEIGHTS_FILE);
    let (mut w, _) = tensors::decode(&layout, &w_bytes, &[""]).map_err(|e| ck_err(&w_path, e))?;
    let params = w.pop().unwrap_or_default();
    let digest = arena_digest(&params);
    if digest != state.weights_digest {
        return Err(ck_err(
            &w_path,
            format!(
                "weights digest {digest} does not match state.json's {}",
                state.weights_digest
            ),
        ));
    }
    let o_path = dir.join(OPTIMIZER_FILE);
    let (mut moments, _) = tensors::decode(&layout, &o_bytes, &[EXP_AVG, EXP_AVG_SQ])
        .map_err(|e| ck_err(&o_path, e))?;
    let exp_avg_sq = moments.pop().unwrap_or_default();
    let exp_avg = moments.pop().unwrap_or_default();
    Ok(Checkpoint {
        dir,
        state,
        meta,
        params,
        exp_avg,
        exp_avg_sq,
        tokenizer_json,
    })
}

/// Check that the checkpoint `ck` may be resumed by a run on `device` in
/// `precision`: another precision is refused (it is part of the run's
/// bits), another device is allowed (same format) and gives a note, which
/// is returned.
pub fn check_resume(ck: &Checkpoint, device: &str, precision: &str) -> Result<Option<String>> {
    let m = &ck.meta;
    if m.precision != precision {
        return Err(ck_err(
            &ck.dir.join(STATE_FILE),
            format!(
                "--resume: the checkpoint was trained in precision {}, this run trains in {precision} \
                 (--precision {precision}); the precision is part of a run's bits, so a run \
                 cannot change it: resume it with --precision {} or start a new run",
                m.precision, m.precision
            ),
        ));
    }
    Ok((m.device != device).then(|| {
        format!(
            "note: resuming on {device} a checkpoint written on {} (same checkpoint format; \
             the bits may differ from an unbroken run on one device)",
            m.device
        )
    }))
}

/// The directory of Hugging Face files `path` names: `path` itself when it
/// holds a `config.json`, else the newest checkpoint of the run directory
/// `path` (see [`resolve`]).
pub fn hf_model_dir(path: &Path) -> Result<PathBuf> {
    if path.join(HF_CONFIG_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    if path.join(CHECKPOINTS_DIR).join(LATEST).is_file() {
        return resolve(path);
    }
    Err(ck_err(
        path,
        format!(
            "no model here: expected a directory with {HF_CONFIG_FILE} and {WEIGHTS_FILE} (a \
             Hugging Face model, or one of our checkpoints) or a run directory"
        ),
    ))
}

/// The model shape of the Hugging Face Mamba or Mamba-2 `config.json` in
/// `dir` (ours or one `transformers` wrote; the architecture is its
/// `model_type`), refused with the field named when this model cannot
/// honour it.
pub fn load_hf_config(dir: &Path) -> Result<crate::config::ModelConfig> {
    let hf_path = dir.join(HF_CONFIG_FILE);
    let bytes = fs::read(&hf_path).map_err(|e| io_err(&hf_path, "cannot read", e))?;
    let hf = super::config_json::parse(&bytes)
        .map_err(|e| ck_err(&hf_path, format!("not valid JSON: {e}")))?;
    let cfg = hf_config::model_config_from_hf(&hf).map_err(|e| ck_err(&hf_path, e))?;
    cfg.validate()
        .map_err(|e| ck_err(&hf_path, e.to_string()))?;
    Ok(cfg)
}

/// Weights only, from any directory holding a Hugging Face Mamba
/// `config.json` and `model.safetensors` (ours, or one written by
/// `transformers`' `save_pretrained` in F32): the model shape and the weight
/// arena. A stored `lm_head.weight` is accepted only if it equals the
/// embedding (the head is tied).
pub fn load_hf(dir: &Path) -> Result<(crate::config::ModelConfig, Vec<f32>)> {
    let cfg = load_hf_config(dir)?;
    let layout = ParamLayout::new(&cfg);
    let w_path = dir.join(WEIGHTS_FILE);
    let bytes = fs::read(&w_path).map_err(|e| io_err(&w_path, "cannot read", e))?;
    let (mut w, _) = tensors::decode_allowing(&layout, &bytes, &[""], &["lm_head.weight"])
        .map_err(|e| ck_err(&w_path, e))?;
    let params = w.pop().unwrap_or_default();
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| ck_err(&w_path, e.to_string()))?;
    if let Ok(head) = st.tensor("lm_head.weight") {
        let emb = &params[layout.embedding.clone()];
        let same = head.dtype() == safetensors::Dtype::F32
            && head.data().len() == emb.len() * 4
            && head
                .data()
                .chunks_exact(4)
                .zip(emb)
                .all(|(b, &e)| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) == e);
        if !same {
            return Err(ck_err(
                &w_path,
                "lm_head.weight differs from the embedding; this model ties them",
            ));
        }
    }
    Ok((cfg, params))
}

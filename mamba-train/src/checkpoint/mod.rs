//! Checkpoints: one directory per saved step, never half-written.
//!
//! Layout inside a run directory (`--out`):
//! ```text
//! checkpoints/LATEST                 name of the newest complete checkpoint
//! checkpoints/step-00000200/
//!     config.json                    Hugging Face MambaConfig
//!     model.safetensors              weights, Hugging Face names and shapes, F32
//!     optimizer.safetensors          exp_avg.<name>, exp_avg_sq.<name>
//!     state.json                     step, seed, data position, run identity, digest
//! ```
//! A checkpoint directory is itself loadable by
//! `transformers.MambaForCausalLM.from_pretrained`.
//!
//! **Atomicity.** Files are written into a private temp directory
//! (`checkpoints/.tmp-...`), each fsynced, the directory fsynced, then renamed
//! to its final name; only then is `LATEST` replaced (temp file, fsync,
//! rename). A crash or error at any point leaves `LATEST` naming the previous
//! complete checkpoint. Stale temp directories are removed by the next save.

pub mod atomic;
pub mod hf_config;
pub mod state;
pub mod tensors;

use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Result, TrainError};
use crate::params::ParamLayout;

pub use state::{DataPosition, RunState, FORMAT_VERSION};

/// Sub-directory of a run directory holding its checkpoints.
pub const CHECKPOINTS_DIR: &str = "checkpoints";
/// File in [`CHECKPOINTS_DIR`] naming the newest complete checkpoint.
pub const LATEST: &str = "LATEST";
/// Weights file name (the Hugging Face one).
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// Optimizer moments file name.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// Run state file name.
pub const STATE_FILE: &str = "state.json";
/// Hugging Face config file name.
pub const HF_CONFIG_FILE: &str = "config.json";
/// Name prefix of first-moment tensors in [`OPTIMIZER_FILE`].
pub const EXP_AVG: &str = "exp_avg.";
/// Name prefix of second-moment tensors in [`OPTIMIZER_FILE`].
pub const EXP_AVG_SQ: &str = "exp_avg_sq.";

/// Hex SHA-256 of an arena's little-endian bytes: the `weights-digest`.
pub fn arena_digest(arena: &[f32]) -> String {
    let mut h = Sha256::new();
    let mut buf = Vec::with_capacity(4 * 4096);
    for chunk in arena.chunks(4096) {
        buf.clear();
        for &x in chunk {
            buf.extend_from_slice(&x.to_le_bytes());
        }
        h.update(&buf);
    }
    hex::encode(h.finalize())
}

/// What a save writes; borrowed from the trainer.
#[derive(Clone, Copy, Debug)]
pub struct CheckpointRef<'a> {
    /// The JSON state (its `weights_digest` must be `arena_digest(params)`).
    pub state: &'a RunState,
    /// Weight arena.
    pub params: &'a [f32],
    /// AdamW first moments.
    pub exp_avg: &'a [f32],
    /// AdamW second moments.
    pub exp_avg_sq: &'a [f32],
}

/// A loaded and verified checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    /// The directory it was read from.
    pub dir: PathBuf,
    /// The JSON state.
    pub state: RunState,
    /// Weight arena.
    pub params: Vec<f32>,
    /// AdamW first moments.
    pub exp_avg: Vec<f32>,
    /// AdamW second moments.
    pub exp_avg_sq: Vec<f32>,
}

fn ck_err(path: &Path, detail: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.display().to_string(),
        detail: detail.into(),
    }
}

fn io_err(path: &Path, what: &str, e: io::Error) -> TrainError {
    ck_err(path, format!("{what}: {e}"))
}

/// Directory name of the checkpoint of step `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// Save into `run_dir/checkpoints/step-N`, publish it as `LATEST`, and keep
/// only the newest `keep` checkpoints (at least the new one). Returns the new
/// checkpoint's directory.
pub fn save(run_dir: &Path, ck: &CheckpointRef<'_>, keep: usize) -> Result<PathBuf> {
    save_with_hook(run_dir, ck, keep, &mut |_| Ok(()))
}

/// [`save`] with `before_file` called before each file is written (with the
/// file's temp path); an error from it aborts the save like a failed write.
/// This is how tests inject a failure mid-write.
pub fn save_with_hook(
    run_dir: &Path,
    ck: &CheckpointRef<'_>,
    keep: usize,
    before_file: &mut dyn FnMut(&Path) -> io::Result<()>,
) -> Result<PathBuf> {
    let state = ck.state;
    let layout = ParamLayout::new(&state.run.model);
    let digest = arena_digest(ck.params);
    if digest != state.weights_digest {
        return Err(ck_err(
            run_dir,
            "state.weights_digest does not match the weights being saved",
        ));
    }
    let root = run_dir.join(CHECKPOINTS_DIR);
    fs::create_dir_all(&root)
        .map_err(|e| io_err(&root, "cannot create the checkpoint directory", e))?;
    remove_stale_temps(&root);

    let mut meta = HashMap::new();
    meta.insert("step".to_string(), state.step.to_string());
    let weights = tensors::encode(&layout, &[("", ck.params)], meta.clone())
        .map_err(|e| ck_err(&root, format!("encoding weights: {e}")))?;
    let moments = tensors::encode(
        &layout,
        &[(EXP_AVG, ck.exp_avg), (EXP_AVG_SQ, ck.exp_avg_sq)],
        meta,
    )
    .map_err(|e| ck_err(&root, format!("encoding optimizer moments: {e}")))?;
    let hf = serde_json::to_vec_pretty(&hf_config::hf_config_json(&state.run.model))
        .map_err(|e| ck_err(&root, format!("encoding config.json: {e}")))?;
    let st = serde_json::to_vec_pretty(state)
        .map_err(|e| ck_err(&root, format!("encoding state.json: {e}")))?;

    let name = step_dir_name(state.step);
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    let written = (|| -> io::Result<()> {
        if tmp.exists() {
            fs::remove_dir_all(&tmp)?;
        }
        fs::create_dir(&tmp)?;
        // The state goes last: a directory with a state.json has everything.
        for (file, bytes) in [
            (HF_CONFIG_FILE, &hf),
            (WEIGHTS_FILE, &weights),
            (OPTIMIZER_FILE, &moments),
            (STATE_FILE, &st),
        ] {
            let p = tmp.join(file);
            before_file(&p)?;
            atomic::write_synced(&p, bytes)?;
        }
        atomic::sync_dir(&tmp)
    })();
    if let Err(e) = written {
        let _ = fs::remove_dir_all(&tmp);
        return Err(io_err(
            &tmp,
            "writing the checkpoint failed; the previous checkpoint is untouched",
            e,
        ));
    }

    let final_dir = root.join(&name);
    let publish = (|| -> io::Result<()> {
        if final_dir.exists() {
            // Same step saved again (e.g. a re-run into the same directory):
            // move the old one aside first; a directory cannot be renamed
            // over a non-empty one.
            let aside = root.join(format!(".tmp-old-{name}-{}", std::process::id()));
            fs::rename(&final_dir, &aside)?;
            fs::rename(&tmp, &final_dir)?;
            let _ = fs::remove_dir_all(&aside);
        } else {
            fs::rename(&tmp, &final_dir)?;
        }
        atomic::sync_dir(&root)?;
        atomic::replace_file(&root.join(LATEST), format!("{name}\n").as_bytes())
    })();
    if let Err(e) = publish {
        let _ = fs::remove_dir_all(&tmp);
        return Err(io_err(&final_dir, "publishing the checkpoint failed", e));
    }
    prune(&root, &name, keep.max(1));
    Ok(final_dir)
}

/// Remove leftovers of interrupted saves (best effort: they are ours, and a
/// failure to remove one only wastes space).
fn remove_stale_temps(root: &Path) {
    if let Ok(rd) = fs::read_dir(root) {
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with(".tmp-") {
                let p = e.path();
                let _ = if p.is_dir() {
                    fs::remove_dir_all(&p)
                } else {
                    fs::remove_file(&p)
                };
            }
        }
    }
}

/// Keep the newest `keep` `step-*` directories and always `latest`.
fn prune(root: &Path, latest: &str, keep: usize) {
    let Ok(rd) = fs::read_dir(root) else { return };
    let mut steps: Vec<(u64, PathBuf, String)> = rd
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            let s = n.strip_prefix("step-")?.parse::<u64>().ok()?;
            Some((s, e.path(), n))
        })
        .collect();
    steps.sort_by_key(|s| std::cmp::Reverse(s.0));
    for (_, path, name) in steps.into_iter().skip(keep) {
        if name != latest {
            let _ = fs::remove_dir_all(path);
        }
    }
}

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
/// format version, config.json against the state's model, every tensor's
/// name, dtype and shape, no extra tensors, and the weights digest.
pub fn load(path: &Path) -> Result<Checkpoint> {
    let dir = resolve(path)?;
    let read = |file: &str| -> Result<Vec<u8>> {
        let p = dir.join(file);
        fs::read(&p).map_err(|e| io_err(&p, "cannot read", e))
    };
    let st_path = dir.join(STATE_FILE);
    let state: RunState = serde_json::from_slice(&read(STATE_FILE)?)
        .map_err(|e| ck_err(&st_path, format!("not a valid state file: {e}")))?;
    if state.format_version != FORMAT_VERSION {
        return Err(ck_err(
            &st_path,
            format!(
                "format_version {} is not supported (this build reads {FORMAT_VERSION})",
                state.format_version
            ),
        ));
    }
    state
        .run
        .model
        .validate()
        .map_err(|e| ck_err(&st_path, e.to_string()))?;
    let hf_path = dir.join(HF_CONFIG_FILE);
    let hf: serde_json::Value = serde_json::from_slice(&read(HF_CONFIG_FILE)?)
        .map_err(|e| ck_err(&hf_path, format!("not valid JSON: {e}")))?;
    hf_config::check_hf_config(&hf, &state.run.model).map_err(|e| ck_err(&hf_path, e))?;

    let layout = ParamLayout::new(&state.run.model);
    let w_path = dir.join(WEIGHTS_FILE);
    let (mut w, _) =
        tensors::decode(&layout, &read(WEIGHTS_FILE)?, &[""]).map_err(|e| ck_err(&w_path, e))?;
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
    let (mut moments, _) = tensors::decode(&layout, &read(OPTIMIZER_FILE)?, &[EXP_AVG, EXP_AVG_SQ])
        .map_err(|e| ck_err(&o_path, e))?;
    let exp_avg_sq = moments.pop().unwrap_or_default();
    let exp_avg = moments.pop().unwrap_or_default();
    Ok(Checkpoint {
        dir,
        state,
        params,
        exp_avg,
        exp_avg_sq,
    })
}

/// Weights only, from any directory holding a Hugging Face Mamba
/// `config.json` and `model.safetensors` (ours, or one written by
/// `transformers`' `save_pretrained` in F32): the model shape and the weight
/// arena. A stored `lm_head.weight` is accepted only if it equals the
/// embedding (the head is tied).
pub fn load_hf(dir: &Path) -> Result<(crate::config::ModelConfig, Vec<f32>)> {
    let hf_path = dir.join(HF_CONFIG_FILE);
    let bytes = fs::read(&hf_path).map_err(|e| io_err(&hf_path, "cannot read", e))?;
    let hf: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| ck_err(&hf_path, format!("not valid JSON: {e}")))?;
    let cfg = hf_config::model_config_from_hf(&hf).map_err(|e| ck_err(&hf_path, e))?;
    cfg.validate()
        .map_err(|e| ck_err(&hf_path, e.to_string()))?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::testutil::{run_steps, toy_model, toy_run};
    use crate::train::Trainer;

    fn trained(steps: u64) -> Trainer<crate::train::testutil::ToyModel> {
        let run = toy_run(10);
        run_steps(Trainer::new(toy_model(&run), run).unwrap(), steps)
    }

    #[test]
    fn round_trip_is_exact_and_hugging_face_shaped() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = trained(2);
        let p = t.save_checkpoint(dir.path(), 2).unwrap();
        assert_eq!(p, dir.path().join("checkpoints/step-00000002"));
        let ck = load(dir.path()).unwrap();
        assert_eq!(&ck.params, t.params());
        assert_eq!(&ck.exp_avg, t.optimizer().adamw().exp_avg());
        assert_eq!(&ck.exp_avg_sq, t.optimizer().adamw().exp_avg_sq());
        assert_eq!(ck.state, t.run_state().unwrap());
        // Loading the checkpoint directory itself works too.
        assert_eq!(load(&p).unwrap(), ck);
        let hf: serde_json::Value =
            serde_json::from_slice(&fs::read(p.join(HF_CONFIG_FILE)).unwrap()).unwrap();
        assert_eq!(hf["model_type"], "mamba");
        assert_eq!(hf["hidden_size"], 8);
        let bytes = fs::read(p.join(WEIGHTS_FILE)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let emb = st.tensor("backbone.embeddings.weight").unwrap();
        assert_eq!(emb.shape(), &[7, 8]);
        assert_eq!(
            st.tensor("backbone.layers.0.mixer.conv1d.weight")
                .unwrap()
                .shape(),
            &[16, 1, 4]
        );
    }

    #[test]
    fn a_failure_mid_write_leaves_the_previous_checkpoint_loadable() {
        let dir = tempfile::tempdir().unwrap();
        let mut t2 = trained(2);
        t2.save_checkpoint(dir.path(), 2).unwrap();
        let mut t3 = trained(3);
        let state = t3.run_state().unwrap();
        let adamw = t3.optimizer().adamw();
        let ck = CheckpointRef {
            state: &state,
            params: t3.params(),
            exp_avg: adamw.exp_avg(),
            exp_avg_sq: adamw.exp_avg_sq(),
        };
        let mut files = Vec::new();
        let err = save_with_hook(dir.path(), &ck, 2, &mut |p| {
            files.push(p.file_name().unwrap().to_string_lossy().into_owned());
            if p.ends_with(OPTIMIZER_FILE) {
                // The weights are already on disk in the temp dir.
                Err(io::Error::other("disk full (injected)"))
            } else {
                Ok(())
            }
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("injected") && err.contains("previous checkpoint is untouched"),
            "{err}"
        );
        assert_eq!(files, [HF_CONFIG_FILE, WEIGHTS_FILE, OPTIMIZER_FILE]);
        let back = load(dir.path()).unwrap();
        assert_eq!(back.state.step, 2);
        assert_eq!(&back.params, t2.params());
        let names: Vec<String> = fs::read_dir(dir.path().join(CHECKPOINTS_DIR))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(!names.iter().any(|n| n.contains("00000003")), "{names:?}");

        // A crash (no cleanup) leaves a temp dir: ignored by load, removed by
        // the next save.
        let stale = dir
            .path()
            .join(CHECKPOINTS_DIR)
            .join(".tmp-step-00000009-1");
        fs::create_dir_all(&stale).unwrap();
        fs::write(stale.join(WEIGHTS_FILE), b"half").unwrap();
        assert_eq!(load(dir.path()).unwrap().state.step, 2);
        save(dir.path(), &ck, 2).unwrap();
        assert!(!stale.exists());
        assert_eq!(load(dir.path()).unwrap().state.step, 3);
    }

    #[test]
    fn keeps_the_newest_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        let run = toy_run(10);
        let mut t = Trainer::new(toy_model(&run), run).unwrap();
        for _ in 0..4 {
            t = run_steps(t, 1);
            t.save_checkpoint(dir.path(), 2).unwrap();
        }
        let mut names: Vec<String> = fs::read_dir(dir.path().join(CHECKPOINTS_DIR))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["LATEST", "step-00000003", "step-00000004"]);
    }

    #[test]
    fn corrupted_or_mismatched_files_are_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let p = trained(1).save_checkpoint(dir.path(), 2).unwrap();

        // Flip one weight byte: the digest check catches it.
        let w = p.join(WEIGHTS_FILE);
        let good = fs::read(&w).unwrap();
        let mut bad = good.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        fs::write(&w, &bad).unwrap();
        let e = load(&p).unwrap_err().to_string();
        assert!(e.contains("digest"), "{e}");
        fs::write(&w, &good).unwrap();

        // A config.json describing another model: the field is named.
        let c = p.join(HF_CONFIG_FILE);
        let mut hf: serde_json::Value = serde_json::from_slice(&fs::read(&c).unwrap()).unwrap();
        hf["num_hidden_layers"] = serde_json::json!(3);
        fs::write(&c, serde_json::to_vec(&hf).unwrap()).unwrap();
        let e = load(&p).unwrap_err().to_string();
        assert!(e.contains("num_hidden_layers is 3"), "{e}");

        let e = load(&dir.path().join("nowhere")).unwrap_err().to_string();
        assert!(e.contains("no checkpoint here"), "{e}");
    }

    #[test]
    fn weights_load_from_a_hugging_face_style_directory() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = trained(1);
        let p = t.save_checkpoint(dir.path(), 2).unwrap();
        let (cfg, params) = load_hf(&p).unwrap();
        assert_eq!(cfg, t.run_config().model);
        assert_eq!(&params, t.params());

        // A writer that stored the tied head too: accepted when equal to the
        // embedding, refused otherwise.
        let layout = ParamLayout::new(&cfg);
        let emb = params[layout.embedding.clone()].to_vec();
        let with_head = |head: &[f32]| {
            let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = layout
                .entries()
                .iter()
                .map(|e| {
                    (
                        e.name.clone(),
                        e.shape.clone(),
                        params[e.range()]
                            .iter()
                            .flat_map(|x| x.to_le_bytes())
                            .collect(),
                    )
                })
                .collect();
            let shape = layout
                .get("backbone.embeddings.weight")
                .unwrap()
                .shape
                .clone();
            tensors.push((
                "lm_head.weight".into(),
                shape,
                head.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ));
            let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
                .iter()
                .map(|(n, s, b)| {
                    (
                        n.clone(),
                        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                            .unwrap(),
                    )
                })
                .collect();
            fs::write(
                p.join(WEIGHTS_FILE),
                safetensors::serialize(views, None).unwrap(),
            )
            .unwrap();
        };
        with_head(&emb);
        assert_eq!(load_hf(&p).unwrap().1, params);
        let mut other = emb.clone();
        other[0] += 1.0;
        with_head(&other);
        let e = load_hf(&p).unwrap_err().to_string();
        assert!(e.contains("lm_head.weight differs"), "{e}");
    }

    #[test]
    fn digest_is_sha256_of_little_endian_bytes() {
        // sha256 of the 8 bytes 00 00 80 3f 00 00 00 c0 (1.0f32, -2.0f32).
        let want = hex::encode(Sha256::digest([
            0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0xc0,
        ]));
        assert_eq!(arena_digest(&[1.0, -2.0]), want);
        assert_ne!(arena_digest(&[1.0, -2.0]), arena_digest(&[-2.0, 1.0]));
    }
}

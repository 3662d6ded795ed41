//! Checkpoints: one directory per saved step, never half-written.
//!
//! Layout inside a run directory (`--out`):
//! ```text
//! checkpoints/LATEST                 name of the newest complete checkpoint
//! checkpoints/step-00000200/
//!     config.json                    Hugging Face MambaConfig
//!     model.safetensors              weights, Hugging Face names and shapes, F32
//!     optimizer.safetensors          exp_avg.<name>, exp_avg_sq.<name>
//!     state.json                     step, seed, data position, run identity,
//!                                    device, precision, schedule changes, and
//!                                    the SHA-256 of every other file and of itself
//! ```
//! Every file is covered by a digest checked on load: `state.json` records
//! the others' (`file_digests`) and its own (`state_digest`, over its JSON
//! without that key); a mismatch names the file.
//! A checkpoint directory is itself loadable by
//! `transformers.MambaForCausalLM.from_pretrained`.
//!
//! **Atomicity.** Files are written into a private temp directory
//! (`checkpoints/.tmp-...`), each fsynced, the directory fsynced, then renamed
//! to its final name; only then is `LATEST` replaced (temp file, fsync,
//! rename); only then are old checkpoints pruned. A crash or error at any
//! point leaves `LATEST` naming a complete checkpoint (the previous one, or
//! the new one), also when the same step is saved again. Stale temp
//! directories are removed by the next save.

pub mod atomic;
pub mod hf_config;
pub mod state;
pub mod tensors;

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Result, TrainError};
use crate::params::ParamLayout;

pub use state::{
    CheckpointMeta, DataPosition, RunState, ScheduleChange, FORMAT_VERSION, PRECISION_F32,
};

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
    /// How it was written: device, precision, schedule changes.
    pub meta: CheckpointMeta,
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
/// checkpoint's directory. Records the default [`CheckpointMeta`] (CPU, f32,
/// no schedule change); the command line saves with [`save_with_meta`].
pub fn save(run_dir: &Path, ck: &CheckpointRef<'_>, keep: usize) -> Result<PathBuf> {
    save_with_meta(run_dir, ck, &CheckpointMeta::default(), keep, &mut |_| {
        Ok(())
    })
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
    save_with_meta(run_dir, ck, &CheckpointMeta::default(), keep, before_file)
}

/// Hex SHA-256 of `bytes`.
pub fn bytes_digest(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Key of `state.json`'s own digest (over the rest of the file's JSON).
pub const STATE_DIGEST: &str = "state_digest";
/// Key of `state.json`'s map from file name to hex SHA-256.
pub const FILE_DIGESTS: &str = "file_digests";

/// The digest `state.json` records of itself: SHA-256 of the compact JSON
/// of `value` without its [`STATE_DIGEST`] key.
pub fn state_json_digest(value: &serde_json::Value) -> String {
    let mut v = value.clone();
    if let Some(o) = v.as_object_mut() {
        o.remove(STATE_DIGEST);
    }
    bytes_digest(&serde_json::to_vec(&v).unwrap_or_default())
}

/// Re-seal an edited `state.json` value: recompute its [`STATE_DIGEST`].
/// For tools and tests that edit a checkpoint's state on purpose.
pub fn seal_state_json(value: &mut serde_json::Value) {
    let d = state_json_digest(value);
    if let Some(o) = value.as_object_mut() {
        o.insert(STATE_DIGEST.into(), d.into());
    }
}

/// The bytes of `state.json`: the state, the meta, the digests of the other
/// files, and its own digest last.
fn state_json(
    state: &RunState,
    meta: &CheckpointMeta,
    files: &[(&str, &Vec<u8>)],
) -> serde_json::Result<Vec<u8>> {
    // Through bytes first, so numbers keep the writer's shortest form.
    let mut v: serde_json::Value = serde_json::from_slice(&serde_json::to_vec(state)?)?;
    let meta = serde_json::to_value(meta)?;
    let digests: BTreeMap<&str, String> =
        files.iter().map(|(n, b)| (*n, bytes_digest(b))).collect();
    if let (Some(o), Some(m)) = (v.as_object_mut(), meta.as_object()) {
        for (k, x) in m {
            o.insert(k.clone(), x.clone());
        }
        o.insert(FILE_DIGESTS.into(), serde_json::to_value(digests)?);
    }
    seal_state_json(&mut v);
    serde_json::to_vec_pretty(&v)
}

/// The name `root/LATEST` holds, if it can be read.
fn latest_name(root: &Path) -> Option<String> {
    fs::read_to_string(root.join(LATEST))
        .ok()
        .map(|s| s.trim().to_string())
}

/// [`save_with_hook`] recording `meta`. The hook is also called before each
/// publishing step, with the path about to change (the final directory, or
/// `LATEST`), so tests can check what a crash there would leave.
///
/// Order: write every file of the new checkpoint into a temp directory,
/// fsync them and it; rename it to `step-N` (fsync the parent); replace
/// `LATEST` atomically; only then prune old checkpoints. A re-save of a
/// step whose directory exists first points `LATEST` at the complete temp
/// directory, then swaps the new files in under the final name, so `LATEST`
/// never names a missing or partial directory.
pub fn save_with_meta(
    run_dir: &Path,
    ck: &CheckpointRef<'_>,
    meta: &CheckpointMeta,
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

    let mut tmeta = HashMap::new();
    tmeta.insert("step".to_string(), state.step.to_string());
    let weights = tensors::encode(&layout, &[("", ck.params)], tmeta.clone())
        .map_err(|e| ck_err(&root, format!("encoding weights: {e}")))?;
    let moments = tensors::encode(
        &layout,
        &[(EXP_AVG, ck.exp_avg), (EXP_AVG_SQ, ck.exp_avg_sq)],
        tmeta,
    )
    .map_err(|e| ck_err(&root, format!("encoding optimizer moments: {e}")))?;
    let hf = serde_json::to_vec_pretty(&hf_config::hf_config_json(&state.run.model))
        .map_err(|e| ck_err(&root, format!("encoding config.json: {e}")))?;
    let files = [
        (HF_CONFIG_FILE, &hf),
        (WEIGHTS_FILE, &weights),
        (OPTIMIZER_FILE, &moments),
    ];
    let st = state_json(state, meta, &files)
        .map_err(|e| ck_err(&root, format!("encoding state.json: {e}")))?;

    let name = step_dir_name(state.step);
    let pid = std::process::id();
    let tmp_name = format!(".tmp-{name}-{pid}");
    let tmp = root.join(&tmp_name);
    let written = (|| -> io::Result<()> {
        if tmp.exists() {
            fs::remove_dir_all(&tmp)?;
        }
        fs::create_dir(&tmp)?;
        // The state goes last: a directory with a state.json has everything.
        for (file, bytes) in files.iter().copied().chain([(STATE_FILE, &st)]) {
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
    let latest = root.join(LATEST);
    let aside = root.join(format!(".tmp-old-{name}-{pid}"));
    let linked = root.join(format!(".tmp-new-{name}-{pid}"));
    let publish = (|| -> io::Result<()> {
        if final_dir.exists() {
            // Same step saved again (e.g. a resume from an older checkpoint
            // of this directory). `LATEST` may name this step: point it at
            // the complete temp directory while the final name changes
            // hands, then at the final name again.
            before_file(&latest)?;
            atomic::replace_file(&latest, format!("{tmp_name}\n").as_bytes())?;
            // The new files under a second name (hard links: same data).
            if linked.exists() {
                fs::remove_dir_all(&linked)?;
            }
            fs::create_dir(&linked)?;
            for file in [HF_CONFIG_FILE, WEIGHTS_FILE, OPTIMIZER_FILE, STATE_FILE] {
                let (from, to) = (tmp.join(file), linked.join(file));
                if fs::hard_link(&from, &to).is_err() {
                    atomic::write_synced(&to, &fs::read(&from)?)?;
                }
            }
            atomic::sync_dir(&linked)?;
            before_file(&final_dir)?;
            fs::rename(&final_dir, &aside)?;
            fs::rename(&linked, &final_dir)?;
        } else {
            before_file(&final_dir)?;
            fs::rename(&tmp, &final_dir)?;
        }
        atomic::sync_dir(&root)?;
        before_file(&latest)?;
        atomic::replace_file(&latest, format!("{name}\n").as_bytes())
    })();
    // The temp directory may be what `LATEST` names after a failed re-save
    // (then it is the complete new checkpoint and stays).
    let keep_tmp = latest_name(&root).as_deref() == Some(tmp_name.as_str());
    if !keep_tmp {
        let _ = fs::remove_dir_all(&tmp);
    }
    let _ = fs::remove_dir_all(&linked);
    if let Err(e) = publish {
        if !final_dir.exists() && aside.exists() {
            let _ = fs::rename(&aside, &final_dir);
        }
        return Err(io_err(&final_dir, "publishing the checkpoint failed", e));
    }
    let _ = fs::remove_dir_all(&aside);
    prune(&root, &name, keep.max(1));
    Ok(final_dir)
}

/// Remove leftovers of interrupted saves (best effort: they are ours, and a
/// failure to remove one only wastes space), except what `LATEST` names (a
/// re-save interrupted while it pointed at its complete temp directory).
fn remove_stale_temps(root: &Path) {
    let latest = latest_name(root);
    if let Ok(rd) = fs::read_dir(root) {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with(".tmp-") && latest.as_deref() != Some(n.as_str()) {
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
    state
        .run
        .model
        .validate()
        .map_err(|e| ck_err(&st_path, e.to_string()))?;
    let hf_path = dir.join(HF_CONFIG_FILE);
    let hf: serde_json::Value = serde_json::from_slice(&hf_bytes)
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
                "--resume: the checkpoint was trained in precision {}, this run trains in {precision}; \
                 the precision is part of a run's bits, so a run cannot change it: resume it \
                 in {} or start a new run",
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

        // A config.json describing another model: its digest no longer
        // matches; with the digest updated too, the field is named.
        let c = p.join(HF_CONFIG_FILE);
        let mut hf: serde_json::Value = serde_json::from_slice(&fs::read(&c).unwrap()).unwrap();
        hf["num_hidden_layers"] = serde_json::json!(3);
        let bytes = serde_json::to_vec(&hf).unwrap();
        fs::write(&c, &bytes).unwrap();
        let e = load(&p).unwrap_err().to_string();
        assert!(e.contains("config.json digest"), "{e}");
        edit_state(&p, |st| {
            st[FILE_DIGESTS][HF_CONFIG_FILE] = bytes_digest(&bytes).into()
        });
        let e = load(&p).unwrap_err().to_string();
        assert!(e.contains("num_hidden_layers is 3"), "{e}");

        let e = load(&dir.path().join("nowhere")).unwrap_err().to_string();
        assert!(e.contains("no checkpoint here"), "{e}");
    }

    /// Edit `dir`'s state.json with `f` and re-seal its own digest.
    fn edit_state(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
        let sp = dir.join(STATE_FILE);
        let mut st: serde_json::Value = serde_json::from_slice(&fs::read(&sp).unwrap()).unwrap();
        f(&mut st);
        seal_state_json(&mut st);
        fs::write(&sp, serde_json::to_vec_pretty(&st).unwrap()).unwrap();
    }

    #[test]
    fn every_file_is_covered_by_a_digest_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = trained(2).save_checkpoint(dir.path(), 2).unwrap();
        let st: serde_json::Value =
            serde_json::from_slice(&fs::read(p.join(STATE_FILE)).unwrap()).unwrap();
        assert_eq!(st["format_version"], FORMAT_VERSION);
        assert_eq!(st["precision"], "f32");
        for f in [HF_CONFIG_FILE, WEIGHTS_FILE, OPTIMIZER_FILE] {
            assert_eq!(
                st[FILE_DIGESTS][f].as_str().unwrap(),
                bytes_digest(&fs::read(p.join(f)).unwrap()),
                "{f}"
            );
        }
        // A flipped bit in the optimizer moments (which no weights digest
        // covers) is refused, naming the file.
        let o = p.join(OPTIMIZER_FILE);
        let good = fs::read(&o).unwrap();
        let mut bad = good.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        fs::write(&o, &bad).unwrap();
        let e = load(&p).unwrap_err().to_string();
        assert!(
            e.contains("optimizer.safetensors digest") && e.contains("corrupted"),
            "{e}"
        );
        fs::write(&o, &good).unwrap();
        assert!(load(&p).is_ok());

        // An edited state.json (here the step) is refused by its own digest.
        let sp = p.join(STATE_FILE);
        let good = fs::read(&sp).unwrap();
        let text = String::from_utf8(good.clone()).unwrap();
        fs::write(&sp, text.replace("\"step\": 2", "\"step\": 3")).unwrap();
        let e = load(&p).unwrap_err().to_string();
        assert!(e.contains("state.json digest"), "{e}");
        fs::write(&sp, &good).unwrap();

        // A checkpoint of the previous format is refused with the versions.
        edit_state(&p, |st| st["format_version"] = 1.into());
        let e = load(&p).unwrap_err().to_string();
        assert!(
            e.contains("format 1 is not supported")
                && e.contains(&format!("format {FORMAT_VERSION}")),
            "{e}"
        );
    }

    #[test]
    fn a_resume_in_another_precision_is_refused_another_device_noted() {
        let dir = tempfile::tempdir().unwrap();
        let p = trained(1).save_checkpoint(dir.path(), 2).unwrap();
        let ck = load(&p).unwrap();
        assert_eq!(ck.meta, CheckpointMeta::default());
        assert_eq!(check_resume(&ck, "cpu", PRECISION_F32).unwrap(), None);
        let note = check_resume(&ck, "cuda", PRECISION_F32).unwrap().unwrap();
        assert!(
            note.contains("on cuda") && note.contains("written on cpu"),
            "{note}"
        );
        edit_state(&p, |st| st["precision"] = "bf16".into());
        let ck = load(&p).unwrap();
        let e = check_resume(&ck, "cpu", PRECISION_F32)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--resume") && e.contains("precision bf16") && e.contains("trains in f32"),
            "{e}"
        );
    }

    #[test]
    fn a_re_save_of_the_same_step_never_leaves_latest_dangling() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = trained(2);
        t.save_checkpoint(dir.path(), 2).unwrap();
        let state = t.run_state().unwrap();
        let params = t.params().clone();
        let adamw = t.optimizer().adamw();
        let ck = CheckpointRef {
            state: &state,
            params: &params,
            exp_avg: adamw.exp_avg(),
            exp_avg_sq: adamw.exp_avg_sq(),
        };
        let meta = CheckpointMeta::default();
        // At every step of the re-save, what LATEST names loads; and a
        // failure injected at any publishing step leaves it loadable.
        let mut points = 0;
        save_with_meta(dir.path(), &ck, &meta, 2, &mut |_| {
            points += 1;
            load(dir.path()).map(|_| ()).map_err(io::Error::other)
        })
        .unwrap();
        assert!(points >= 6, "{points}");
        for fail_at in 0..points {
            let mut n = 0;
            let r = save_with_meta(dir.path(), &ck, &meta, 2, &mut |_| {
                n += 1;
                if n > fail_at {
                    Err(io::Error::other("crash (injected)"))
                } else {
                    Ok(())
                }
            });
            assert!(r.is_err());
            let back = load(dir.path()).unwrap_or_else(|e| panic!("fail at {fail_at}: {e}"));
            assert_eq!(back.state.step, 2);
            assert_eq!(&back.params, &params);
        }
        save(dir.path(), &ck, 2).unwrap();
        assert_eq!(
            latest_name(&dir.path().join(CHECKPOINTS_DIR)).unwrap(),
            "step-00000002"
        );
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

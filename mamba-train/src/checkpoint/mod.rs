//! Checkpoints: one directory per saved step, never half-written.
//!
//! Layout inside a run directory (`--out`):
//! ```text
//! checkpoints/LATEST                 name of the newest complete checkpoint
//! checkpoints/step-00000200/
//!     config.json                    Hugging Face MambaConfig (Mamba2Config)
//!     model.safetensors              weights, Hugging Face names and shapes, F32
//!     optimizer.safetensors          exp_avg.<name>, exp_avg_sq.<name>
//!     tokenizer.json                 the run's tokenizer, when it has one
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
mod config_json;
pub mod hf_config;
mod hf_mamba2_config;
pub mod state;
pub mod tensors;

use std::io;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::TrainError;

pub use state::{
    CheckpointMeta, DataPosition, InitRecord, RunState, ScheduleChange, FORMAT_VERSION,
    PRECISION_F32,
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
/// The run's tokenizer, copied into each checkpoint of a tokenized run
/// (the name `transformers`' `AutoTokenizer` looks for).
pub const TOKENIZER_FILE: &str = "tokenizer.json";
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
    /// The bytes of the run's `tokenizer.json`, if it has one (its SHA-256
    /// must be the one the run's task records).
    pub tokenizer_json: Option<&'a [u8]>,
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
    /// The run's `tokenizer.json` ([`TOKENIZER_FILE`]), digest-checked and
    /// the one the run's task records; `None` for a run without one.
    pub tokenizer_json: Option<Vec<u8>>,
}

pub(crate) fn ck_err(path: &Path, detail: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.display().to_string(),
        detail: detail.into(),
    }
}

pub(crate) fn io_err(path: &Path, what: &str, e: io::Error) -> TrainError {
    ck_err(path, format!("{what}: {e}"))
}

/// Directory name of the checkpoint of step `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
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

mod load;
mod save;

pub use load::{check_resume, hf_model_dir, load, load_hf, load_hf_config, resolve};
pub use save::{save, save_with_hook, save_with_meta};

#[cfg(test)]
mod tests {
    use std::fs;

    use super::save::latest_name;
    use super::*;
    use crate::params::ParamLayout;
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
    fn the_same_state_gives_byte_identical_files() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let pa = trained(2).save_checkpoint(a.path(), 2).unwrap();
        let pb = trained(2).save_checkpoint(b.path(), 2).unwrap();
        for f in [WEIGHTS_FILE, OPTIMIZER_FILE, STATE_FILE, HF_CONFIG_FILE] {
            assert_eq!(
                std::fs::read(pa.join(f)).unwrap(),
                std::fs::read(pb.join(f)).unwrap(),
                "{f} differs between two saves of the same state"
            );
        }
        // Negative control: another step is other bytes.
        let pc = trained(3).save_checkpoint(b.path(), 2).unwrap();
        assert_ne!(
            std::fs::read(pa.join(WEIGHTS_FILE)).unwrap(),
            std::fs::read(pc.join(WEIGHTS_FILE)).unwrap()
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
            tokenizer_json: None,
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
            e.contains("--resume")
                && e.contains("precision bf16")
                && e.contains("trains in f32")
                && e.contains("--precision bf16"),
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
            tokenizer_json: None,
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

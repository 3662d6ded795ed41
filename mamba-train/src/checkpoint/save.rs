//! Writing a checkpoint: the temp directory, every file and its digest,
//! the atomic publish (rename, then `LATEST`), and pruning, in the order
//! that never leaves `LATEST` naming a missing directory.

use crate::error::Result;
use crate::params::ParamLayout;
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::*;

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

/// The bytes of `state.json`: the state, the meta, the digests of the other
/// files, and its own digest last.
pub(super) fn state_json(
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
pub(super) fn latest_name(root: &Path) -> Option<String> {
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

    // No metadata besides `format` (added by `encode`): the header's map
    // has no fixed key order, so a second key would make the bytes of one
    // checkpoint differ from run to run. The step lives in state.json.
    let tmeta = HashMap::new();
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
    let tokenizer = ck.tokenizer_json.map(<[u8]>::to_vec);
    let mut files = vec![
        (HF_CONFIG_FILE, &hf),
        (WEIGHTS_FILE, &weights),
        (OPTIMIZER_FILE, &moments),
    ];
    if let Some(t) = &tokenizer {
        files.push((TOKENIZER_FILE, t));
    }
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
            for file in files.iter().map(|f| f.0).chain([STATE_FILE]) {
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

//! ZeRO-1 (`--shard-optimizer`) through the binary, with real processes:
//! at a fixed logical world the sharded run is the unsharded run's bits
//! for P = 1, 2 and 4 (under fixed-order; under nccl-sum at the same P),
//! its checkpoints hold what the unsharded run's hold (every file; the
//! tensors and loaded state bit for bit), and a
//! checkpoint resumes sharded or not, at another P, onto the unbroken bits.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sha2::{Digest, Sha256};

mod common;

use common::{bin, last_line_digest, ok, text, world_digest};
use mamba_train::checkpoint;

/// A small real Mamba whose arena spans five norm chunks (16384 elements
/// each), so that every rank of a world of four owns a real shard.
const SMALL: &[&str] = &[
    "--d-model",
    "64",
    "--layers",
    "2",
    "--batch",
    "2",
    "--seq-len",
    "12",
    "--memorize",
    "3",
    "--alphabet",
    "4",
    "--eval-batches",
    "1",
    "--comm-timeout",
    "60",
    "--logical-world",
    "4",
];

fn train(out: &Path, extra: &[&str]) -> Output {
    Command::new(bin())
        .arg("train")
        .args(SMALL)
        .args(extra)
        .arg("--out")
        .arg(out)
        .output()
        .expect("the mamba-train binary runs")
}

/// What a checkpoint directory holds, file by file: each file's SHA-256,
/// except that a safetensors file is compared as its parsed header (the
/// writer's metadata map has no fixed key order, so its header bytes vary
/// from run to run, an unsharded run's too) plus the SHA-256 of its tensor
/// bytes, and `state.json` as what the loader reads (it records the other
/// files' byte digests). Also the loaded weights and moments, bit for bit.
fn contents(dir: &Path) -> Vec<(String, String)> {
    let sha = |b: &[u8]| format!("{:x}", Sha256::digest(b));
    let mut out: Vec<(String, String)> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let bytes = std::fs::read(&p).unwrap();
            let what = if name.ends_with(".safetensors") {
                let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
                let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
                format!("{header} {}", sha(&bytes[8 + n..]))
            } else if name == "state.json" {
                String::new()
            } else {
                sha(&bytes)
            };
            (name, what)
        })
        .collect();
    let ck = checkpoint::load(dir).expect("the checkpoint loads");
    let bits = |v: &[f32]| sha(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
    out.push((
        "loaded state".into(),
        format!("{:?} {:?}", ck.state, ck.meta),
    ));
    out.push(("loaded weights".into(), bits(&ck.params)));
    out.push(("loaded exp_avg".into(), bits(&ck.exp_avg)));
    out.push(("loaded exp_avg_sq".into(), bits(&ck.exp_avg_sq)));
    out.sort();
    out
}

fn checkpoint(run: &Path, step: u64) -> PathBuf {
    run.join("checkpoints").join(format!("step-{step:08}"))
}

#[test]
fn sharded_runs_are_the_unsharded_bits_and_files_for_every_p() {
    let dir = tempfile::tempdir().unwrap();
    let steps = ["--steps", "4", "--checkpoint-every", "2"];
    let whole_dir = dir.path().join("whole");
    let whole = last_line_digest(&ok(&train(&whole_dir, &steps)));
    for p in ["1", "2", "4"] {
        let out = dir.path().join(format!("zero{p}"));
        let o = train(
            &out,
            &[&steps[..], &["--world", p, "--shard-optimizer"]].concat(),
        );
        let world: usize = p.parse().unwrap();
        assert_eq!(world_digest(&o, world), whole, "P = {p}");
        let stderr = text(&o.stderr);
        if world > 1 {
            assert!(
                stderr.contains("keeps and updates its shard of the optimizer state"),
                "P = {p}: the run must say it is sharded:\n{stderr}"
            );
        } else {
            assert!(stderr.contains("stays whole"), "{stderr}");
        }
        for step in [2, 4] {
            assert_eq!(
                contents(&checkpoint(&out, step)),
                contents(&checkpoint(&whole_dir, step)),
                "P = {p}: checkpoint of step {step}"
            );
        }
    }
    // Negative control: the files and digests compared above do move with
    // the run (another seed), so their equality is not vacuous.
    let other = dir.path().join("other");
    let o = train(&other, &[&steps[..], &["--seed", "7"]].concat());
    assert_ne!(last_line_digest(&ok(&o)), whole);
    assert_ne!(
        contents(&checkpoint(&other, 2)),
        contents(&checkpoint(&whole_dir, 2))
    );
}

#[test]
fn checkpoints_resume_sharded_or_not_at_another_p_onto_the_unbroken_bits() {
    let dir = tempfile::tempdir().unwrap();
    let unbroken = last_line_digest(&ok(&train(&dir.path().join("u"), &["--steps", "5"])));
    // Unsharded on one process, stopped at 2; resumed sharded on two.
    let a = dir.path().join("a");
    ok(&train(&a, &["--steps", "5", "--stop-at", "2"]));
    let o = train(
        &dir.path().join("a2"),
        &[
            "--resume",
            checkpoint(&a, 2).to_str().unwrap(),
            "--world",
            "2",
            "--shard-optimizer",
        ],
    );
    assert_eq!(
        world_digest(&o, 2),
        unbroken,
        "P = 1 unsharded -> P = 2 sharded"
    );
    // Sharded on four, stopped at 3; resumed unsharded on one.
    let b = dir.path().join("b");
    let o = train(
        &b,
        &[
            "--steps",
            "5",
            "--stop-at",
            "3",
            "--world",
            "4",
            "--shard-optimizer",
        ],
    );
    world_digest(&o, 4);
    let o = train(
        &dir.path().join("b1"),
        &["--resume", checkpoint(&b, 3).to_str().unwrap()],
    );
    assert_eq!(
        last_line_digest(&ok(&o)),
        unbroken,
        "P = 4 sharded -> P = 1 unsharded"
    );
}

#[test]
fn nccl_sum_sharded_is_the_unsharded_library_sum_at_the_same_p() {
    let dir = tempfile::tempdir().unwrap();
    let base = ["--steps", "3", "--world", "2", "--contract", "nccl-sum"];
    let plain = world_digest(&train(&dir.path().join("plain"), &base), 2);
    let o = train(
        &dir.path().join("zero"),
        &[&base[..], &["--shard-optimizer"]].concat(),
    );
    assert_eq!(world_digest(&o, 2), plain);
}

#[test]
fn under_the_fixed_tree_sharded_runs_are_the_unsharded_bits_for_every_p() {
    let dir = tempfile::tempdir().unwrap();
    let tree = ["--logical-world", "4", "--contract", "fixed-tree"];
    let base = world_digest(&train(&dir.path().join("p1"), &tree), 1);
    for p in ["2", "4"] {
        let o = train(
            &dir.path().join(format!("z{p}")),
            &[&tree[..], &["--world", p, "--shard-optimizer"]].concat(),
        );
        assert_eq!(
            world_digest(&o, p.parse().unwrap()),
            base,
            "P = {p} sharded"
        );
    }
    // Negative control: the chain at the same L is another run.
    let chain = world_digest(
        &train(&dir.path().join("chain"), &["--logical-world", "4"]),
        1,
    );
    assert_ne!(chain, base);
}

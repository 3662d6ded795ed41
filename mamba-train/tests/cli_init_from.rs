//! `mamba-train train --init-from DIR`: fine-tuning a Hugging Face Mamba
//! checkpoint (one of ours, and the layout transformers writes, with a
//! vocabulary larger than the task's).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

use common::{bin, err, last_line_digest, ok, TINY};
use mamba_train::checkpoint::{self, tensors};
use mamba_train::{ModelConfig, ParamLayout};

fn train(out: &Path, extra: &[&str]) -> Output {
    let mut c = Command::new(bin());
    c.arg("train");
    for pair in TINY.chunks(2) {
        if !extra.contains(&pair[0]) {
            c.args(pair);
        }
    }
    c.arg("--out").arg(out).args(extra);
    c.output().expect("the mamba-train binary runs")
}

fn first_loss(run: &Path) -> f64 {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    first["loss"].as_f64().unwrap()
}

fn newest_checkpoint(run: &Path) -> PathBuf {
    checkpoint::resolve(run).unwrap()
}

/// A model directory as transformers' `save_pretrained` writes it for a
/// `MambaForCausalLM` with `vocab` tokens: `config.json` with its own extra
/// keys, `model.safetensors` without the tied `lm_head.weight`. Its weights
/// are `base`'s, the embedding padded with rows of small values.
fn transformers_layout(base: &Path, dir: &Path, vocab: usize) {
    let (cfg, w) = checkpoint::load_hf(base).unwrap();
    let big = ModelConfig {
        vocab_size: vocab,
        ..cfg.clone()
    };
    let (small_l, big_l) = (ParamLayout::new(&cfg), ParamLayout::new(&big));
    let mut arena = vec![0.0f32; big_l.len()];
    for e in big_l.entries() {
        let src = small_l.entries().iter().find(|s| s.name == e.name).unwrap();
        let dst = &mut arena[e.range()];
        let from = &w[src.range()];
        dst[..from.len()].copy_from_slice(from);
        for (i, x) in dst[from.len()..].iter_mut().enumerate() {
            *x = 0.001 * ((i % 17) as f32 - 8.0);
        }
    }
    std::fs::create_dir_all(dir).unwrap();
    let bytes = tensors::encode(&big_l, &[("", &arena)], Default::default()).unwrap();
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(base.join("config.json")).unwrap()).unwrap();
    json["vocab_size"] = vocab.into();
    json["transformers_version"] = "5.17.0".into();
    json["torch_dtype"] = "float32".into();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&json).unwrap(),
    )
    .unwrap();
}

#[test]
fn fine_tuning_our_checkpoint_starts_from_its_weights() {
    let dir = tempfile::tempdir().unwrap();
    let pre = dir.path().join("pre");
    let pre_digest = last_line_digest(&ok(&train(&pre, &["--steps", "60"])));
    let init = newest_checkpoint(&pre);
    let tuned = dir.path().join("tuned");
    let a = last_line_digest(&ok(&train(
        &tuned,
        &[
            "--steps",
            "4",
            "--seed",
            "5",
            "--init-from",
            init.to_str().unwrap(),
        ],
    )));
    let fresh = dir.path().join("fresh");
    let c = last_line_digest(&ok(&train(&fresh, &["--steps", "4", "--seed", "5"])));
    assert_ne!(
        a, c,
        "negative control: the pretrained start is another run"
    );
    // It started where the pretrained run ended: the first loss is the
    // trained model's, well below a fresh model's.
    let (l_tuned, l_fresh) = (first_loss(&tuned), first_loss(&fresh));
    assert!(
        l_tuned < l_fresh - 0.2,
        "first loss {l_tuned} vs fresh {l_fresh}"
    );
    // Deterministic, and the checkpoint records where it started.
    let again = dir.path().join("again");
    let b = last_line_digest(&ok(&train(
        &again,
        &[
            "--steps",
            "4",
            "--seed",
            "5",
            "--init-from",
            init.to_str().unwrap(),
        ],
    )));
    assert_eq!(a, b);
    let state: serde_json::Value = serde_json::from_slice(
        &std::fs::read(newest_checkpoint(&tuned).join("state.json")).unwrap(),
    )
    .unwrap();
    let text = state.to_string();
    assert!(
        text.contains(&pre_digest),
        "the start's digest is recorded: {text}"
    );
}

#[test]
fn a_transformers_model_with_a_larger_vocabulary_fine_tunes_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let pre = dir.path().join("pre");
    ok(&train(&pre, &["--steps", "3"]));
    let hf = dir.path().join("hf");
    transformers_layout(&newest_checkpoint(&pre), &hf, 40);
    let hf_s = hf.to_str().unwrap();
    let unbroken = last_line_digest(&ok(&train(
        &dir.path().join("u"),
        &["--steps", "6", "--init-from", hf_s],
    )));
    // The run keeps the pretrained vocabulary (40 > the task's 6).
    let run = dir.path().join("r");
    ok(&train(
        &run,
        &["--steps", "6", "--init-from", hf_s, "--stop-at", "3"],
    ));
    let cfg: serde_json::Value = serde_json::from_slice(
        &std::fs::read(newest_checkpoint(&run).join("config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["vocab_size"], 40);
    // Resuming a fine-tuning run lands on the unbroken run's bits.
    let resumed = Command::new(bin())
        .args(["train", "--resume"])
        .arg(&run)
        .output()
        .unwrap();
    assert_eq!(last_line_digest(&ok(&resumed)), unbroken);
}

#[test]
fn mismatched_pretrained_models_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let pre = dir.path().join("pre");
    ok(&train(&pre, &["--steps", "2"]));
    let init = newest_checkpoint(&pre);
    let init_s = init.to_str().unwrap();
    let e = err(&train(
        &dir.path().join("a"),
        &["--init-from", init_s, "--d-model", "32"],
    ));
    assert!(
        e.contains("--d-model 32 disagrees") && e.contains("has 16"),
        "{e}"
    );
    let e = err(&train(
        &dir.path().join("a2"),
        &["--init-from", init_s, "--d-state", "8"],
    ));
    assert!(
        e.contains("--d-state 8 disagrees") && e.contains("has 16"),
        "{e}"
    );
    // A task whose tokens do not fit the model's vocabulary.
    let e = err(&train(
        &dir.path().join("b"),
        &["--init-from", init_s, "--alphabet", "9"],
    ));
    assert!(
        e.contains("--init-from") && e.contains("vocabulary has 6 tokens"),
        "{e}"
    );
    let e = err(&train(
        &dir.path().join("c"),
        &["--init-from", init_s, "--resume", pre.to_str().unwrap()],
    ));
    assert!(e.contains("give one of them"), "{e}");
    let e = err(&train(
        &dir.path().join("d"),
        &["--init-from", "/nonexistent/model"],
    ));
    assert!(
        e.contains("/nonexistent/model") && e.contains("no model here"),
        "{e}"
    );
}

//! The `mamba-train train` binary, end to end, with tiny models.

use std::path::Path;
use std::process::{Command, Output};

mod common;

use common::{bin, err, last_line_digest, ok, TINY};

/// Run `train` with [`TINY`] (less the flags `extra` sets itself), `--out`, and `extra`.
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

/// The digest from the last stdout line, which must be the digest line
/// (64 lowercase hex digits).
fn digest(stdout: &str) -> String {
    let hex = last_line_digest(stdout);
    assert!(
        hex.chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()),
        "{hex}"
    );
    hex
}

#[test]
fn digest_is_the_last_line_and_repeats_across_runs_and_thread_counts() {
    let dir = tempfile::tempdir().unwrap();
    let a = digest(&ok(&train(
        &dir.path().join("a"),
        &["--steps", "6", "--threads", "1"],
    )));
    let b = digest(&ok(&train(
        &dir.path().join("b"),
        &["--steps", "6", "--threads", "2"],
    )));
    assert_eq!(a, b, "same run, 1 vs 2 threads");
    // Negative controls: another seed, or one more step, is another model.
    let c = digest(&ok(&train(
        &dir.path().join("c"),
        &["--steps", "6", "--seed", "1"],
    )));
    assert_ne!(a, c);
    let d = digest(&ok(&train(&dir.path().join("d"), &["--steps", "7"])));
    assert_ne!(a, d);
}

#[test]
fn writes_metrics_plot_and_a_hugging_face_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let stdout = ok(&train(&out, &["--steps", "5", "--checkpoint-every", "2"]));
    assert!(
        stdout.contains("accuracy:") && stdout.contains("chance 25.0%"),
        "{stdout}"
    );
    assert!(stdout.contains("final loss:"), "{stdout}");

    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 5);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["step"], i as u64 + 1);
        for key in ["loss", "lr", "grad_norm", "tokens_per_s"] {
            assert!(l[key].as_f64().is_some_and(f64::is_finite), "{key} in {l}");
        }
        assert_eq!(l["skipped_steps"], 0);
        assert_eq!(l["skipped"], false);
    }
    let svg = std::fs::read_to_string(out.join("loss.svg")).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("<polyline"),
        "{svg}"
    );

    // Checkpoints at 2 and 4 plus the final one at 5; the newest two kept.
    let ck = out.join("checkpoints");
    assert_eq!(
        std::fs::read_to_string(ck.join("LATEST")).unwrap().trim(),
        "step-00000005"
    );
    assert!(ck.join("step-00000004").is_dir() && !ck.join("step-00000002").exists());
    let last = ck.join("step-00000005");
    for f in [
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
    ] {
        assert!(last.join(f).is_file(), "{f} missing");
    }
    let hf: serde_json::Value =
        serde_json::from_slice(&std::fs::read(last.join("config.json")).unwrap()).unwrap();
    assert_eq!(hf["model_type"], "mamba");
    assert_eq!(hf["vocab_size"], 6);
    assert_eq!(hf["hidden_size"], 16);
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(last.join("state.json")).unwrap()).unwrap();
    assert_eq!(state["step"], 5);
    assert_eq!(state["weights_digest"].as_str().unwrap(), digest(&stdout));
}

#[test]
fn stop_and_resume_lands_on_the_unbroken_bits() {
    let dir = tempfile::tempdir().unwrap();
    let unbroken = digest(&ok(&train(&dir.path().join("whole"), &["--steps", "8"])));

    let out = dir.path().join("parts");
    let first = ok(&train(&out, &["--steps", "8", "--stop-at", "3"]));
    assert!(first.contains("stopped at step 3"), "{first}");
    assert_ne!(digest(&first), unbroken);
    // Resume with no run flags at all: the checkpoint's run continues.
    let o = Command::new(bin())
        .args(["train", "--eval-batches", "1", "--resume"])
        .arg(&out)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(digest(&ok(&o)), unbroken);
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(
        steps,
        (1..=8).collect::<Vec<_>>(),
        "the resumed log continues the first one"
    );

    // Resuming a finished run runs nothing and changes nothing.
    let o = Command::new(bin())
        .args(["train", "--eval-batches", "1", "--resume"])
        .arg(&out)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let again = ok(&o);
    assert!(again.contains("no step run"), "{again}");
    assert_eq!(digest(&again), unbroken);
    assert_eq!(
        std::fs::read_to_string(out.join("metrics.jsonl")).unwrap(),
        text
    );
}

#[test]
fn resume_into_another_directory_from_a_checkpoint_directory() {
    let dir = tempfile::tempdir().unwrap();
    let unbroken = digest(&ok(&train(&dir.path().join("whole"), &["--steps", "6"])));
    let src = dir.path().join("src");
    ok(&train(&src, &["--steps", "6", "--stop-at", "2"]));
    let ck = src.join("checkpoints").join("step-00000002");
    let dst = dir.path().join("dst");
    let o = train(&dst, &["--resume", ck.to_str().unwrap()]);
    assert_eq!(digest(&ok(&o)), unbroken);
    let text = std::fs::read_to_string(dst.join("metrics.jsonl")).unwrap();
    assert_eq!(
        text.lines().count(),
        4,
        "steps 3..=6 run in the new directory"
    );
}

#[test]
fn bad_input_gets_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x");
    let e = err(&train(&out, &["--batch", "0"]));
    assert!(e.contains("batch must be at least 1"), "{e}");

    let e = err(&Command::new(bin())
        .args(["train", "--task", "sorting"])
        .output()
        .unwrap());
    assert!(e.contains("sorting") && e.contains("selective-copy"), "{e}");

    // Without a GPU driver --device cuda says what is missing (with one,
    // tests/cuda_train.rs trains on it).
    if !kernels::driver_present() {
        let e = err(&train(&out, &["--device", "cuda"]));
        assert!(
            e.contains("--device cuda") && e.contains("--device cpu"),
            "{e}"
        );
    }

    let e = err(&train(&out, &["--steps", "4", "--stop-at", "9"]));
    assert!(e.contains("--stop-at"), "{e}");

    // A resume asking for another model names the setting.
    let run = dir.path().join("run");
    ok(&train(&run, &["--steps", "2"]));
    let e = err(&train(
        &run,
        &[
            "--resume",
            run.to_str().unwrap(),
            "--d-model",
            "24",
            "--steps",
            "2",
        ],
    ));
    assert!(e.contains("d_model: checkpoint 16, requested 24"), "{e}");

    let e = err(&train(
        &out,
        &["--resume", dir.path().join("nothing").to_str().unwrap()],
    ));
    assert!(e.contains("no checkpoint here"), "{e}");
}

#[test]
fn text_task_trains_and_refuses_missing_or_short_files() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(
        &corpus,
        "the quick brown fox jumps over the lazy dog. ".repeat(20),
    )
    .unwrap();
    let text_args = |steps: &'static str| -> Vec<String> {
        [
            "--task",
            "text",
            "--data",
            corpus.to_str().unwrap(),
            "--steps",
            steps,
            "--d-model",
            "16",
            "--layers",
            "1",
            "--batch",
            "2",
            "--seq-len",
            "16",
            "--eval-batches",
            "1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let run = |extra: &[String], out: &Path| {
        Command::new(bin())
            .arg("train")
            .args(extra)
            .arg("--out")
            .arg(out)
            .output()
            .unwrap()
    };
    let stdout = ok(&run(&text_args("3"), &dir.path().join("t")));
    assert!(
        stdout.contains("next-byte positions") && stdout.contains("chance 0.4%"),
        "{stdout}"
    );
    digest(&stdout);

    let e = err(&Command::new(bin())
        .args(["train", "--task", "text", "--data"])
        .arg(dir.path().join("missing.txt"))
        .output()
        .unwrap());
    assert!(
        e.contains("cannot read the text corpus") && e.contains("missing.txt"),
        "{e}"
    );
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "tiny").unwrap();
    let e = err(&Command::new(bin())
        .args(["train", "--task", "text", "--seq-len", "16", "--data"])
        .arg(&short)
        .output()
        .unwrap());
    assert!(e.contains("4 bytes") && e.contains("at least 17"), "{e}");
    let e = err(&Command::new(bin())
        .args(["train", "--task", "text"])
        .output()
        .unwrap());
    assert!(e.contains("--data PATH"), "{e}");
}

#[test]
fn induction_task_runs() {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(bin())
        .args([
            "train",
            "--task",
            "induction",
            "--steps",
            "3",
            "--d-model",
            "16",
            "--layers",
            "1",
            "--batch",
            "4",
            "--seq-len",
            "16",
            "--eval-batches",
            "1",
            "--out",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    let stdout = ok(&o);
    assert!(
        stdout.contains("recall positions") && stdout.contains("chance 12.5%"),
        "{stdout}"
    );
    digest(&stdout);
}

#[test]
fn a_config_file_is_the_same_run_as_its_flags_and_flags_override_it() {
    let dir = tempfile::tempdir().unwrap();
    // TINY as a TOML file, with a --steps the command line overrides.
    let mut toml = String::new();
    for pair in TINY.chunks(2) {
        toml.push_str(&format!(
            "{} = {}\n",
            pair[0].trim_start_matches("--"),
            pair[1]
        ));
    }
    toml.push_str("steps = 9\nseed = 3\n");
    let cfg = dir.path().join("run.toml");
    std::fs::write(&cfg, toml).unwrap();
    let by_flags = digest(&ok(&train(
        &dir.path().join("flags"),
        &["--steps", "5", "--seed", "3"],
    )));
    let by_file = Command::new(bin())
        .arg("train")
        .arg("--config")
        .arg(&cfg)
        .args(["--steps", "5", "--out"])
        .arg(dir.path().join("file"))
        .output()
        .unwrap();
    assert_eq!(digest(&ok(&by_file)), by_flags, "file + override == flags");
    // Negative control: the file's own --steps is another run.
    let file_steps = Command::new(bin())
        .arg("train")
        .arg("--config")
        .arg(&cfg)
        .arg("--out")
        .arg(dir.path().join("file9"))
        .output()
        .unwrap();
    assert_ne!(digest(&ok(&file_steps)), by_flags);
    // A key that is not a flag is named, with the file.
    std::fs::write(&cfg, "n_layer = 2\n").unwrap();
    let bad = Command::new(bin())
        .arg("train")
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    let e = err(&bad);
    assert!(
        e.contains("n_layer") && e.contains("run.toml") && e.contains("not a train flag"),
        "{e}"
    );
}

#[test]
fn invalid_settings_are_named_by_their_flag() {
    let dir = tempfile::tempdir().unwrap();
    for (flags, want) in [
        (&["--layers", "0"][..], "--layers must be at least 1"),
        (&["--min-lr-frac", "2"][..], "--min-lr-frac must be within"),
        (&["--memorize", "9"][..], "--seq-len must be at least twice"),
    ] {
        let e = err(&train(&dir.path().join("bad"), flags));
        assert!(e.contains(want), "{flags:?}: {e}");
        assert!(
            !e.contains("n_layer") && !e.contains("min_lr_frac"),
            "{flags:?}: {e}"
        );
    }
}

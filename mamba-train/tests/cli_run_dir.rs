//! The run directory cannot lose a run (issue 15): its lock, where a
//! resumed run continues, what a fresh run refuses, `--extend`, and the
//! checks on a resumed checkpoint's files, device and precision.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{bin, err, last_line_digest, ok, text, TINY};

/// `train` with [`TINY`] and `extra`, in `cwd` (no `--out` added).
fn command(cwd: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(bin());
    c.current_dir(cwd).arg("train").args(TINY).args(extra);
    c
}

fn run(cwd: &Path, extra: &[&str]) -> Output {
    command(cwd, extra).output().unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn metrics_steps(run_dir: &Path) -> Vec<u64> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

fn latest(run_dir: &Path) -> PathBuf {
    let ck = run_dir.join("checkpoints");
    ck.join(std::fs::read_to_string(ck.join("LATEST")).unwrap().trim())
}

#[test]
fn a_second_run_on_a_locked_directory_is_refused_naming_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut first = command(
        dir.path(),
        &[
            "--steps",
            "200",
            "--out",
            s(&out),
            "--checkpoint-every",
            "0",
        ],
    )
    .env("MAMBA_TEST_STEP_DELAY_MS", "50")
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let lock = out.join(".lock");
    let start = Instant::now();
    while !std::fs::read_to_string(&lock).is_ok_and(|t| t.contains("pid=")) {
        assert!(start.elapsed() < Duration::from_secs(60), "no lock taken");
        std::thread::sleep(Duration::from_millis(20));
    }
    let e = err(&run(dir.path(), &["--steps", "3", "--out", s(&out)]));
    assert!(
        e.contains("--out")
            && e.contains("in use by another run")
            && e.contains(&format!("pid {}", first.id()))
            && e.contains("on host ")
            && e.contains("started 20"),
        "{e}"
    );

    // Killed: the OS drops the lock; the next run takes it over with a note.
    first.kill().unwrap();
    first.wait().unwrap();
    let o = run(
        dir.path(),
        &["--steps", "3", "--out", s(&out), "--overwrite"],
    );
    ok(&o);
    let note = text(&o.stderr);
    assert!(
        note.contains("taking over the lock")
            && note.contains(&format!("pid {}", first.id()))
            && note.contains("no longer alive"),
        "{note}"
    );
    // A clean end leaves no holder behind: no note next time.
    let o = run(dir.path(), &["--resume", s(&out)]);
    ok(&o);
    assert!(
        !text(&o.stderr).contains("taking over"),
        "{}",
        text(&o.stderr)
    );
}

#[test]
fn resume_without_out_continues_in_the_checkpoints_run_directory() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path();
    let unbroken = last_line_digest(&ok(&run(cwd, &["--steps", "6", "--out", "whole"])));
    // Another run lives in the default directory.
    let other = cwd.join("runs/latest");
    ok(&run(cwd, &["--steps", "2", "--seed", "5"]));
    let other_ck = latest(&other);
    assert!(other_ck.ends_with("step-00000002"), "{other_ck:?}");

    let a = cwd.join("a");
    ok(&run(
        cwd,
        &["--steps", "6", "--stop-at", "3", "--out", s(&a)],
    ));
    let o = ok(&run(cwd, &["--resume", s(&a)]));
    assert_eq!(last_line_digest(&o), unbroken);
    assert!(
        o.contains(&format!("run directory: {}", a.display())),
        "{o}"
    );
    assert_eq!(metrics_steps(&a), (1..=6).collect::<Vec<_>>());
    // The run in runs/latest is untouched.
    assert_eq!(metrics_steps(&other), [1, 2]);
    assert!(other_ck.join("state.json").is_file());

    // From a checkpoint directory inside a run: the same run directory.
    let b = cwd.join("b");
    ok(&run(
        cwd,
        &["--steps", "6", "--stop-at", "2", "--out", s(&b)],
    ));
    let ck = b.join("checkpoints/step-00000002");
    assert_eq!(
        last_line_digest(&ok(&run(cwd, &["--resume", s(&ck)]))),
        unbroken
    );
    assert_eq!(metrics_steps(&b), (1..=6).collect::<Vec<_>>());
}

#[test]
fn a_fresh_run_refuses_another_runs_directory_unless_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path();
    let out = cwd.join("run");
    ok(&run(cwd, &["--steps", "3", "--out", s(&out)]));
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let before = std::fs::read(latest(&out).join("model.safetensors")).unwrap();

    let e = err(&run(
        cwd,
        &["--steps", "4", "--seed", "2", "--out", s(&out)],
    ));
    assert!(
        e.contains("holds another run")
            && e.contains("checkpoints/")
            && e.contains("step-00000003")
            && e.contains("metrics.jsonl")
            && e.contains("--overwrite")
            && e.contains(&format!("--resume {}", out.display()))
            && e.contains("another --out"),
        "{e}"
    );
    assert_eq!(
        std::fs::read(latest(&out).join("model.safetensors")).unwrap(),
        before
    );
    assert_eq!(metrics_steps(&out), [1, 2, 3]);

    // A resume from elsewhere into it is refused alike.
    let src = cwd.join("src");
    ok(&run(
        cwd,
        &["--steps", "4", "--stop-at", "2", "--out", s(&src)],
    ));
    let e = err(&run(cwd, &["--resume", s(&src), "--out", s(&out)]));
    assert!(e.contains("holds another run"), "{e}");
    // --overwrite on a run continuing in its own directory is refused.
    let e = err(&run(cwd, &["--resume", s(&out), "--overwrite"]));
    assert!(
        e.contains("--overwrite") && e.contains("being resumed"),
        "{e}"
    );

    let o = run(
        cwd,
        &[
            "--steps",
            "4",
            "--seed",
            "2",
            "--out",
            s(&out),
            "--overwrite",
        ],
    );
    ok(&o);
    let note = text(&o.stderr);
    assert!(
        note.contains("--overwrite: removed the previous run's"),
        "{note}"
    );
    assert_eq!(metrics_steps(&out), [1, 2, 3, 4]);
    assert!(latest(&out).ends_with("step-00000004"));
    assert!(!out.join("checkpoints/step-00000003").exists());
    assert_eq!(
        std::fs::read_to_string(out.join("notes.txt")).unwrap(),
        "mine"
    );
}

#[test]
fn extend_continues_past_the_planned_steps_and_records_it() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path();
    let out = cwd.join("run");
    ok(&run(cwd, &["--steps", "4", "--out", s(&out)]));
    let e = err(&run(cwd, &["--resume", s(&out), "--steps", "6"]));
    assert!(e.contains("--extend"), "{e}");
    let e = err(&run(
        cwd,
        &["--resume", s(&out), "--steps", "3", "--extend"],
    ));
    assert!(
        e.contains("--extend") && e.contains("planned 4 steps"),
        "{e}"
    );
    let e = err(&run(cwd, &["--steps", "6", "--extend", "--out", "x"]));
    assert!(e.contains("--extend") && e.contains("--resume"), "{e}");

    // A second copy, extended in two parts, must land on the same bits.
    let copy = cwd.join("copy");
    ok(&run(cwd, &["--steps", "4", "--out", s(&copy)]));

    let o = run(cwd, &["--resume", s(&out), "--steps", "7", "--extend"]);
    let whole = last_line_digest(&ok(&o));
    assert!(
        text(&o.stderr).contains("from 4 to 7 steps at step 4"),
        "{}",
        text(&o.stderr)
    );
    assert_eq!(metrics_steps(&out), (1..=7).collect::<Vec<_>>());
    let st: serde_json::Value =
        serde_json::from_slice(&std::fs::read(latest(&out).join("state.json")).unwrap()).unwrap();
    assert_eq!(st["step"], 7);
    assert_eq!(st["schedule"]["total_steps"], 7);
    assert_eq!(
        st["schedule_changes"],
        serde_json::json!([{"at_step": 4, "old_total": 4, "new_total": 7}])
    );

    ok(&run(
        cwd,
        &[
            "--resume",
            s(&copy),
            "--steps",
            "7",
            "--extend",
            "--stop-at",
            "5",
        ],
    ));
    // The later resume of the extended run needs no flag: it is a 7-step run.
    let parts = last_line_digest(&ok(&run(cwd, &["--resume", s(&copy)])));
    assert_eq!(parts, whole);
    let st: serde_json::Value =
        serde_json::from_slice(&std::fs::read(latest(&copy).join("state.json")).unwrap()).unwrap();
    assert_eq!(
        st["schedule_changes"],
        serde_json::json!([{"at_step": 4, "old_total": 4, "new_total": 7}])
    );
}

#[test]
fn a_corrupted_optimizer_file_or_another_precision_is_refused_on_resume() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path();
    let out = cwd.join("run");
    ok(&run(
        cwd,
        &["--steps", "5", "--stop-at", "2", "--out", s(&out)],
    ));
    let ck = latest(&out);
    let st: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ck.join("state.json")).unwrap()).unwrap();
    assert_eq!(
        (st["device"].as_str(), st["precision"].as_str()),
        (Some("cpu"), Some("f32"))
    );

    // One flipped bit of a moment: refused, naming the file.
    let o = ck.join("optimizer.safetensors");
    let good = std::fs::read(&o).unwrap();
    let mut bad = good.clone();
    let last = bad.len() - 1;
    bad[last] ^= 1;
    std::fs::write(&o, &bad).unwrap();
    let e = err(&run(cwd, &["--resume", s(&out)]));
    assert!(e.contains("optimizer.safetensors digest"), "{e}");
    std::fs::write(&o, &good).unwrap();

    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut v = st.clone();
        f(&mut v);
        mamba_train::checkpoint::seal_state_json(&mut v);
        std::fs::write(
            ck.join("state.json"),
            serde_json::to_vec_pretty(&v).unwrap(),
        )
        .unwrap();
    };
    edit(&|v| v["precision"] = "bf16".into());
    let e = err(&run(cwd, &["--resume", s(&out)]));
    assert!(e.contains("precision bf16") && e.contains("f32"), "{e}");

    // Another device: allowed, with a note.
    edit(&|v| v["device"] = "cuda".into());
    let o = run(cwd, &["--resume", s(&out)]);
    ok(&o);
    let note = text(&o.stderr);
    assert!(
        note.contains("resuming on cpu a checkpoint written on cuda"),
        "{note}"
    );
}

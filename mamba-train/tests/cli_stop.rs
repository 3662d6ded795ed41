//! Preemption: SIGTERM or SIGINT, to a single process, to the supervisor
//! of a world or to one of its ranks, stops the run at a step boundary
//! every rank agrees on; rank 0 checkpoints that step, every process exits
//! with `128 + signal` and says how to continue, and the continuation lands
//! on the unbroken run's bits. A second signal exits at once.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

mod common;

use common::{
    bin, last_line_digest, ok, send_signal, stopped_after_step, text, wait_for_steps, TINY,
};

const STEPS: &str = "24";

fn command(out: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(bin());
    c.arg("train")
        .args(TINY)
        .args(["--steps", STEPS])
        .args(extra)
        .arg("--out")
        .arg(out);
    c
}

/// Start a slowed run (every step sleeps `delay_ms`, a test hook).
fn start(out: &Path, extra: &[&str], delay_ms: u64) -> Child {
    command(out, extra)
        .env("MAMBA_TEST_STEP_DELAY_MS", delay_ms.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the mamba-train binary starts")
}

fn unbroken(dir: &Path, extra: &[&str]) -> String {
    last_line_digest(&ok(&command(&dir.join("unbroken"), extra)
        .output()
        .unwrap()))
}

/// Check a stopped run's exit and message; returns the step it stopped after.
fn check_stopped(o: &Output, signal: i32, run: &Path) -> u64 {
    let stderr = text(&o.stderr);
    assert_eq!(o.status.code(), Some(128 + signal), "stderr:\n{stderr}");
    assert!(
        stderr.contains(&format!(
            "continue with: mamba-train train --resume {}",
            run.display()
        )),
        "{stderr}"
    );
    let step = stopped_after_step(&stderr);
    assert!(
        (2..24).contains(&step),
        "stopped after step {step}:\n{stderr}"
    );
    let latest = std::fs::read_to_string(run.join("checkpoints/LATEST")).unwrap();
    assert_eq!(latest.trim(), format!("step-{step:08}"), "{stderr}");
    step
}

fn resume(run: &Path, extra: &[&str]) -> String {
    let o = Command::new(bin())
        .args(["train", "--resume"])
        .arg(run)
        .args(extra)
        .output()
        .unwrap();
    last_line_digest(&ok(&o))
}

#[test]
fn sigint_to_a_single_process_checkpoints_and_the_continuation_is_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let want = unbroken(dir.path(), &[]);
    let run = dir.path().join("run");
    let mut child = start(&run, &[], 60);
    wait_for_steps(&mut child, &run, 2);
    send_signal(child.id(), libc::SIGINT);
    let o = child.wait_with_output().unwrap();
    check_stopped(&o, libc::SIGINT, &run);
    assert_eq!(resume(&run, &[]), want);
}

#[test]
fn sigterm_to_the_supervisor_stops_every_rank_at_one_step() {
    let dir = tempfile::tempdir().unwrap();
    let world = ["--world", "2", "--logical-world", "2"];
    let want = unbroken(dir.path(), &world);
    let run = dir.path().join("run");
    let mut child = start(&run, &world, 60);
    wait_for_steps(&mut child, &run, 3);
    send_signal(child.id(), libc::SIGTERM);
    let o = child.wait_with_output().unwrap();
    let stderr = text(&o.stderr);
    check_stopped(&o, libc::SIGTERM, &run);
    assert!(stderr.contains("the world stopped on SIGTERM"), "{stderr}");
    assert!(
        stderr.contains("[rank 1 of 2] stopped by SIGTERM"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("error:"),
        "a stop is not an error:\n{stderr}"
    );
    // At a fixed logical world the continuation may run on any P.
    assert_eq!(resume(&run, &[]), want);
}

/// The pid of the rank `rank` among the children of `supervisor`.
fn rank_pid(supervisor: u32, rank: usize) -> u32 {
    let children =
        std::fs::read_to_string(format!("/proc/{supervisor}/task/{supervisor}/children"))
            .expect("/proc lists the supervisor's children");
    for pid in children.split_whitespace() {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let want = format!("MAMBA_RANK={rank}");
        if environ.split(|&b| b == 0).any(|kv| kv == want.as_bytes()) {
            return pid.parse().unwrap();
        }
    }
    panic!("no child of {supervisor} is rank {rank}: {children}");
}

#[test]
fn sigterm_to_one_rank_stops_the_whole_world_and_names_that_rank() {
    let dir = tempfile::tempdir().unwrap();
    let world = ["--world", "2", "--logical-world", "2"];
    let want = unbroken(dir.path(), &world);
    let run = dir.path().join("run");
    let mut child = start(&run, &world, 60);
    wait_for_steps(&mut child, &run, 3);
    send_signal(rank_pid(child.id(), 1), libc::SIGTERM);
    let o = child.wait_with_output().unwrap();
    let stderr = text(&o.stderr);
    check_stopped(&o, libc::SIGTERM, &run);
    assert!(
        stderr.contains("stopped by SIGTERM (received by rank 1)"),
        "{stderr}"
    );
    assert_eq!(resume(&run, &world), want);
}

#[test]
fn a_second_signal_exits_at_once_without_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    // Steps of 5 s: the first signal waits for the step to end, the second
    // (after the 1 s debounce) must not.
    let mut child = start(&run, &["--checkpoint-every", "0"], 5000);
    wait_for_steps(&mut child, &run, 1);
    send_signal(child.id(), libc::SIGTERM);
    std::thread::sleep(std::time::Duration::from_millis(1500));
    send_signal(child.id(), libc::SIGTERM);
    let o = child.wait_with_output().unwrap();
    let stderr = text(&o.stderr);
    assert_eq!(o.status.code(), Some(143), "{stderr}");
    assert!(
        !stderr.contains("continue with"),
        "no graceful stop ran:\n{stderr}"
    );
    assert!(
        !run.join("checkpoints/LATEST").exists(),
        "the second signal must not wait for a checkpoint"
    );
}

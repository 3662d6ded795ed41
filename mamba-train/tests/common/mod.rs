//! Helpers shared by the tests that run the `mamba-train` binary
//! (`cli_train.rs`, `dp_world.rs`, `cli_data.rs`): locating the binary and reading its
//! exit status, output and summary digest; and the fixed-order oracle
//! loop ([`train_by_definition`]); a BPE tokenizer trained on the spot
//! ([`bpe`]); the CPU models' central-difference gradient check
//! ([`gradcheck`]).
#![allow(dead_code)] // each test crate uses a different part

pub mod bpe;
pub mod gradcheck;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// A tiny selective-copy run: 1 block of width 16, a few tokens per row.
pub const TINY: &[&str] = &[
    "--d-model",
    "16",
    "--layers",
    "1",
    "--batch",
    "4",
    "--seq-len",
    "12",
    "--memorize",
    "3",
    "--alphabet",
    "4",
    "--eval-batches",
    "1",
];

/// The binary under test: cargo's path, or `MAMBA_TRAIN_BIN` when the test
/// runs from a bundle on a host where cargo's target directory does not exist.
pub fn bin() -> PathBuf {
    std::env::var_os("MAMBA_TRAIN_BIN")
        .map(Into::into)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_mamba-train").into())
}

/// Process output as text (lossy: a test must not fail on a stray byte).
pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Stdout of a run that must have succeeded (else fails showing both streams).
pub fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "failed: {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        text(&o.stdout),
        text(&o.stderr)
    );
    text(&o.stdout)
}

/// Stderr of a run that must have failed (else fails showing both streams).
pub fn err(o: &Output) -> String {
    assert!(
        !o.status.success(),
        "should have failed; stdout:\n{}\nstderr:\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    text(&o.stderr)
}

/// The hex digest of stdout's last line, which must be the
/// `weights-digest: <64 characters>` summary line.
pub fn last_line_digest(stdout: &str) -> String {
    let last = stdout.lines().last().unwrap_or_default();
    let hex = last
        .strip_prefix("weights-digest: ")
        .unwrap_or_else(|| panic!("last line is not the digest: {last:?}\n{stdout}"));
    assert_eq!(hex.len(), 64, "{hex}");
    hex.to_string()
}

/// `mamba-train train` with `base` flags, then `extra`, `--out out` and the
/// environment `env` added; its output.
pub fn run_train(base: &[&str], out: &Path, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(bin());
    c.arg("train").args(base).args(extra).arg("--out").arg(out);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("the mamba-train binary runs")
}

/// A world whose `world` ranks are started by their environment alone (no
/// supervisor: as a launcher that does not tear a world down would), in
/// `dir`, job `job`: `mamba-train train` with `base`, then `flags(rank)`,
/// `--out dir/out<rank>`, the `MAMBA_*` world contract (a file rendezvous
/// in `dir/rdv`, local rank = rank) and `env`; every rank's output, in rank
/// order.
pub fn env_launched_world(
    base: &[&str],
    dir: &Path,
    world: usize,
    job: &str,
    env: &[(&str, &str)],
    flags: impl Fn(usize) -> Vec<String>,
) -> Vec<Output> {
    let rdv = dir.join("rdv");
    let rdv = rdv.to_str().expect("a UTF-8 temporary directory");
    let world_size = world.to_string();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            let rank_text = rank.to_string();
            let flags = flags(rank);
            let mut c = Command::new(bin());
            c.arg("train")
                .args(base)
                .args(&flags)
                .arg("--out")
                .arg(dir.join(format!("out{rank}")))
                .env("MAMBA_RANK", &rank_text)
                .env("MAMBA_LOCAL_RANK", &rank_text)
                .env("MAMBA_WORLD_SIZE", &world_size)
                .env("MAMBA_JOB_ID", job)
                .env("MAMBA_RENDEZVOUS_DIR", rdv);
            for (k, v) in env {
                c.env(k, v);
            }
            c.stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("the mamba-train binary starts")
        })
        .collect();
    children
        .into_iter()
        .map(|c| c.wait_with_output().expect("a rank's output"))
        .collect()
}

/// The digest of a successful world of `world` ranks (stdout's last line,
/// its only summary), after checking that every other rank printed the same on stderr and
/// that no rank's communicator failed to shut down in order.
pub fn world_digest(o: &Output, world: usize) -> String {
    let stdout = ok(o);
    let hex = last_line_digest(&stdout);
    assert_eq!(
        stdout.matches("weights-digest:").count(),
        1,
        "one summary on stdout:\n{stdout}"
    );
    let stderr = text(&o.stderr);
    assert!(
        !stderr.contains("did not shut down cleanly"),
        "every rank's communicator must shut down in order:\n{stderr}"
    );
    for r in 1..world {
        let line = format!("[rank {r} of {world}] weights-digest: {hex}");
        assert!(stderr.contains(&line), "missing {line:?} in:\n{stderr}");
    }
    hex
}

/// Train `t` to the end by the fixed-order contract's definition, with no
/// reducer: each step, the gradients of the `L` logical micro-batches are
/// folded in ascending order and scaled by `fl(1/L)` on the host
/// (`mamba_reduce::host_mean`), the losses likewise, then the update (a
/// non-finite loss or gradient skips it). The oracle the CLI's worlds and
/// the library's one-process loop are compared with.
pub fn train_by_definition<B>(t: &mut mamba_train::train::Trainer<B>)
where
    B: mamba_train::train::Backend<Arena = Vec<f32>>,
{
    train_by_definition_with(t, mamba_reduce::host_mean)
}

/// [`train_by_definition`] with another definition of the gradient mean
/// over the `L` micro-batch gradients in logical order (e.g.
/// `mamba_reduce::host_tree_mean` for the fixed-tree contract); the loss is
/// the ascending fold under every contract.
pub fn train_by_definition_with<B>(
    t: &mut mamba_train::train::Trainer<B>,
    gradient_mean: fn(&[&[f32]]) -> mamba_reduce::Result<Vec<f32>>,
) where
    B: mamba_train::train::Backend<Arena = Vec<f32>>,
{
    let l = t.run_config().logical_world;
    let n = t.arena_len();
    while !t.finished() {
        let mut grads = vec![vec![0.0f32; n]; l];
        let mut losses = Vec::with_capacity(l);
        for (j, g) in grads.iter_mut().enumerate() {
            losses.push([t.micro_gradient(j as u64, g).expect("gradient")]);
        }
        let finite = losses.iter().all(|x| x[0].is_finite())
            && grads.iter().all(|g| g.iter().all(|x| x.is_finite()));
        let rows: Vec<&[f32]> = grads.iter().map(|g| &g[..]).collect();
        let mean = gradient_mean(&rows).expect("gradient mean");
        let rows: Vec<&[f32]> = losses.iter().map(|x| &x[..]).collect();
        let loss = mamba_reduce::host_mean(&rows).expect("loss mean")[0];
        t.apply(&mean, loss, finite).expect("update");
    }
}

/// Wait (up to a minute) until the run in `dir` has logged `steps` steps
/// in its metrics; panics with the run's stderr if it ended first.
pub fn wait_for_steps(child: &mut std::process::Child, dir: &std::path::Path, steps: usize) {
    let started = std::time::Instant::now();
    loop {
        let logged = std::fs::read_to_string(dir.join("metrics.jsonl"))
            .map(|t| t.lines().count())
            .unwrap_or(0);
        if logged >= steps {
            return;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the run ended ({status}) before logging {steps} steps");
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "the run logged only {logged} of {steps} steps in a minute"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Send `signal` to process `pid`.
pub fn send_signal(pid: u32, signal: i32) {
    // SAFETY: kill has no memory preconditions.
    let r = unsafe { libc::kill(pid as libc::pid_t, signal) };
    assert_eq!(r, 0, "kill({pid}, {signal}) failed");
}

/// The last completed step named by a stopped run's message
/// (`... after step N: ...`).
pub fn stopped_after_step(stderr: &str) -> u64 {
    let at = stderr
        .find(") after step ")
        .unwrap_or_else(|| panic!("no stop message in:\n{stderr}"));
    let rest = &stderr[at + ") after step ".len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("no step in:\n{stderr}"))
}

/// Run a `world`-rank env-launched world of `base` in which rank 1 fails
/// after step 2 outside any collective (`MAMBA_TEST_FAIL_AFTER_STEP`), with
/// a 600 s `--comm-timeout`, and check that rank 1 reports its own error,
/// every other rank names rank 1 (and `peer_says`, e.g. how it learned),
/// and the world ended well before the timeout would have ended it.
pub fn assert_between_collectives_failure_names_rank_1(
    base: &[&str],
    world: usize,
    job: &str,
    peer_says: &str,
) {
    let dir = tempfile::tempdir().unwrap();
    let start = std::time::Instant::now();
    let outs = env_launched_world(
        base,
        dir.path(),
        world,
        job,
        &[("MAMBA_TEST_FAIL_AFTER_STEP", "1:2")],
        |_| {
            [
                "--steps",
                "6",
                "--comm-timeout",
                "600",
                "--replica-check-every",
                "0",
            ]
            .map(String::from)
            .to_vec()
        },
    );
    let took = start.elapsed();
    for (r, o) in outs.iter().enumerate() {
        let e = err(o);
        if r == 1 {
            assert!(
                e.contains("injected failure on rank 1 after step 2"),
                "rank 1 reports its own error: {e}"
            );
        } else {
            assert!(
                e.contains("rank 1 failed") && e.contains(peer_says),
                "rank {r} names rank 1 ({peer_says:?}): {e}"
            );
        }
    }
    assert!(
        took < std::time::Duration::from_secs(120),
        "the peers waited {took:?}: the communication timeout, not the failure, ended them"
    );
}

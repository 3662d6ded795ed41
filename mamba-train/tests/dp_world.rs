//! Data-parallel training with real processes: the `mamba-train` binary
//! with `--world P` on the CPU (self-spawned ranks over loopback sockets),
//! under a hand-made launcher environment, with injected faults.
//!
//! The headline: at a fixed logical world L the final weights are the same
//! bits for P = 1, 2 and 4 processes, equal to the engine stepped by the
//! contract's definition (a host fold of the L micro-batches; `tests/tests/
//! dp_emulated.rs` pins it to mamba-reduce's EmulatedWorld), and a checkpoint written at P = 4
//! resumes at P = 2 onto the unbroken run's bits.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;

use clap::Parser;
use mamba_train::cli::{resolve::resolve_run, Cli, Command as Sub};
use mamba_train::model::cpu::CpuModel;
use mamba_train::train::Trainer;

use common::{
    bin, env_launched_world, err, last_line_digest, ok, text, train_by_definition, world_digest,
};

/// A tiny selective-copy run: 1 block of width 16, rows of 12 tokens.
const TINY: &[&str] = &[
    "--d-model",
    "16",
    "--layers",
    "1",
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
    "30",
];

/// `train` with [`TINY`], `extra`, `--out out`, and `env` added.
fn command(out: &Path, extra: &[&str], env: &[(&str, &str)]) -> Command {
    let mut c = Command::new(bin());
    c.arg("train").args(TINY).args(extra).arg("--out").arg(out);
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

fn train(out: &Path, extra: &[&str], env: &[(&str, &str)]) -> Output {
    command(out, extra, env)
        .output()
        .expect("the mamba-train binary runs")
}

/// The digest from the last stdout line, which must be the digest line,
/// and the only one on stdout (other ranks print theirs on stderr).
fn digest(stdout: &str) -> String {
    let hex = last_line_digest(stdout);
    assert_eq!(
        stdout.matches("weights-digest:").count(),
        1,
        "one summary on stdout:\n{stdout}"
    );
    hex
}

/// The in-process reference: the engine stepped by the fixed-order
/// contract's definition (a host fold of the L micro-batches, no reducer)
/// for the same flags.
fn reference_digest(extra: &[&str]) -> String {
    let mut argv = vec!["mamba-train", "train"];
    argv.extend_from_slice(TINY);
    argv.extend_from_slice(extra);
    let cli = Cli::try_parse_from(argv).expect("flags parse");
    let Sub::Train(args) = cli.command else {
        panic!("parsed as another command")
    };
    let run = resolve_run(&args, None).expect("run resolves").run;
    let mut t = Trainer::new(CpuModel::new(run.model.clone()).unwrap(), run).unwrap();
    train_by_definition(&mut t);
    t.weights_digest().unwrap()
}

fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .expect("metrics written")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

#[test]
fn one_two_and_four_processes_give_the_same_bits_and_another_l_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let l4 = ["--steps", "5", "--logical-world", "4"];
    let want = reference_digest(&l4);
    for p in ["1", "2", "4"] {
        let out = dir.path().join(format!("p{p}"));
        let o = train(&out, &[&l4[..], &["--world", p]].concat(), &[]);
        let got = world_digest(&o, p.parse().unwrap());
        assert_eq!(got, want, "P = {p}, L = 4");
        // Only rank 0 writes the run directory, and it holds every step.
        assert_eq!(metrics(&out).len(), 5, "P = {p}");
        let (stdout, stderr) = (text(&o.stdout), text(&o.stderr));
        if p == "1" {
            // One process, four logical ranks, the same reducer: no spawn.
            assert!(
                stdout.contains("world: 1 process x 4 micro-batches"),
                "{stdout}"
            );
            assert!(
                !stderr.contains("starting") && !stderr.contains("[rank"),
                "{stderr}"
            );
        } else {
            assert!(
                stdout.contains(&format!("world: {p} processes")),
                "{stdout}"
            );
            assert!(
                stderr.contains(&format!("starting {p} CPU processes")),
                "{stderr}"
            );
        }
    }
    // Negative controls: the logical world is part of the run's identity.
    let o = train(
        &dir.path().join("l2"),
        &["--steps", "5", "--world", "2"],
        &[],
    );
    assert_ne!(world_digest(&o, 2), want, "L = 2 must differ from L = 4");
    let l1 = digest(&ok(&train(&dir.path().join("l1"), &["--steps", "5"], &[])));
    assert_ne!(l1, want, "L = 1 must differ from L = 4");
}

#[test]
fn a_checkpoint_of_four_processes_resumes_on_two_onto_the_unbroken_bits() {
    let dir = tempfile::tempdir().unwrap();
    let unbroken = reference_digest(&["--steps", "6", "--logical-world", "4"]);
    let out = dir.path().join("run");
    let first = train(
        &out,
        &["--steps", "6", "--world", "4", "--stop-at", "3"],
        &[],
    );
    let first_stdout = ok(&first);
    assert!(first_stdout.contains("stopped at step 3"), "{first_stdout}");
    assert_ne!(digest(&first_stdout), unbroken);
    // Resume with two processes: L = 4 comes from the checkpoint.
    let o = Command::new(bin())
        .args(["train", "--eval-batches", "1", "--world", "2", "--resume"])
        .arg(&out)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(world_digest(&o, 2), unbroken);
    let steps: Vec<u64> = metrics(&out)
        .iter()
        .map(|m| m["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=6).collect::<Vec<_>>());
    // And once more on one process from the step-3 checkpoint, elsewhere.
    let ck = out.join("checkpoints").join("step-00000003");
    assert!(ck.is_dir(), "the newest two checkpoints are kept: 3 and 6");
    let o = train(
        &dir.path().join("solo"),
        &["--resume", ck.to_str().unwrap()],
        &[],
    );
    assert_eq!(digest(&ok(&o)), unbroken);
}

#[test]
fn nccl_sum_on_the_host_transport_differs_only_where_blocks_are_pre_summed() {
    // Documents the host transport's library sum (ascending ranks): equal
    // to fixed-order at P = 1 and P = L, different at 1 < P < L, where each
    // process adds its block first ((g0+g1)+(g2+g3) vs ((g0+g1)+g2)+g3).
    let dir = tempfile::tempdir().unwrap();
    let base = ["--steps", "4", "--logical-world", "4"];
    let fixed = reference_digest(&base);
    let mut got = Vec::new();
    for p in ["1", "2", "4"] {
        let o = train(
            &dir.path().join(format!("n{p}")),
            &[&base[..], &["--world", p, "--contract", "nccl-sum"]].concat(),
            &[],
        );
        let stderr = text(&o.stderr);
        assert!(stderr.contains("note: --contract nccl-sum"), "{stderr}");
        got.push(world_digest(&o, p.parse().unwrap()));
    }
    assert_eq!(got[0], fixed, "P = 1: one block, the ascending fold");
    assert_ne!(got[1], fixed, "P = 2 < L = 4: block sums are added");
    assert_eq!(
        got[2], fixed,
        "P = L: the host sums ranks in ascending order"
    );
    // The contract is recorded: resuming a nccl-sum run asks for it.
    let run = dir.path().join("n2");
    let e = err(&train(
        &run,
        &[
            "--resume",
            run.to_str().unwrap(),
            "--contract",
            "fixed-order",
        ],
        &[],
    ));
    assert!(
        e.contains("contract: checkpoint nccl-sum, requested fixed-order"),
        "{e}"
    );
}

#[test]
fn a_nan_on_one_rank_skips_the_step_on_every_rank_and_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let base = ["--steps", "5", "--logical-world", "2"];
    let clean = reference_digest(&base);
    let two = dir.path().join("two");
    let o = train(
        &two,
        &[&base[..], &["--world", "2"]].concat(),
        &[("MAMBA_TEST_INJECT_NAN", "1:3")],
    );
    let poisoned = world_digest(&o, 2);
    assert_ne!(poisoned, clean, "the skipped step must change the run");
    // The same skip from rank 0 of a one-process world: same bits, since
    // the whole world skips the whole step wherever the NaN was.
    let o = train(
        &dir.path().join("one"),
        &base,
        &[("MAMBA_TEST_INJECT_NAN", "0:3")],
    );
    assert_eq!(digest(&ok(&o)), poisoned);
    let m = metrics(&two);
    for (i, r) in m.iter().enumerate() {
        let step = i as u64 + 1;
        assert_eq!(r["skipped"], step == 3, "step {step}: {r}");
        assert_eq!(r["skipped_steps"], u64::from(step >= 3), "step {step}: {r}");
        assert!(r["loss"].as_f64().is_some_and(f64::is_finite), "{r}");
        assert_eq!(r["grad_norm"].is_null(), step == 3, "{r}");
    }
    assert!(ok(&o).contains("1 skipped"));
}

#[test]
fn a_diverged_replica_stops_every_rank_with_the_rank_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("div");
    let o = train(
        &out,
        &[
            "--steps",
            "6",
            "--world",
            "2",
            "--replica-check-every",
            "2",
            "--checkpoint-every",
            "2",
        ],
        &[("MAMBA_TEST_PERTURB_WEIGHTS", "1:3")],
    );
    let e = err(&o);
    for r in 0..2 {
        let line = format!("[rank {r} of 2] error: replica divergence: after step 4");
        assert!(e.contains(&line), "missing {line:?} in:\n{e}");
    }
    assert!(e.contains("rank 1 differs from the largest group"), "{e}");
    assert_eq!(text(&o.stdout), "", "no summary after a divergence");
    // The checkpoint of step 2 was checked and written; step 4's was not.
    let ck = out.join("checkpoints");
    assert_eq!(
        std::fs::read_to_string(ck.join("LATEST")).unwrap().trim(),
        "step-00000002"
    );
    mamba_train::checkpoint::load(&out).expect("the last checkpoint loads");

    // With periodic checks off, the check at the end still catches it.
    let o = train(
        &dir.path().join("end"),
        &[
            "--steps",
            "5",
            "--world",
            "3",
            "--replica-check-every",
            "0",
            "--checkpoint-every",
            "0",
        ],
        &[("MAMBA_TEST_PERTURB_WEIGHTS", "2:2")],
    );
    let e = err(&o);
    assert!(
        e.contains("replica divergence: at the end (step 5)")
            && e.contains("rank 2 differs from the largest group"),
        "{e}"
    );
    // Negative control: the same run without the hook passes its checks.
    let o = train(
        &dir.path().join("fine"),
        &["--steps", "5", "--world", "3", "--replica-check-every", "1"],
        &[],
    );
    let stdout = ok(&o);
    assert!(stdout.contains("6 replica checks passed"), "{stdout}");
}

/// Child pids of `pid` (all its threads' children), Linux only.
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
                out.extend(s.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
            }
        }
    }
    out
}

/// The `MAMBA_RANK` of process `pid`.
fn rank_of(pid: u32) -> Option<usize> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(b"MAMBA_RANK="))
        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
}

#[cfg(target_os = "linux")]
#[test]
fn a_killed_rank_ends_the_world_in_seconds_and_the_last_checkpoint_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let base = ["--steps", "40", "--logical-world", "6"];
    let unbroken = reference_digest(&base);
    let child = command(
        &out,
        &[&base[..], &["--world", "3", "--checkpoint-every", "4"]].concat(),
        &[("MAMBA_TEST_STEP_DELAY_MS", "60")],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // Wait until a checkpoint past the first one is published, then kill
    // rank 1 from outside.
    let latest = out.join("checkpoints").join("LATEST");
    let start = Instant::now();
    loop {
        let step = std::fs::read_to_string(&latest)
            .ok()
            .and_then(|s| s.trim().strip_prefix("step-")?.parse::<u64>().ok());
        if step.is_some_and(|s| s >= 8) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no checkpoint after 30 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let victim = children(child.id())
        .into_iter()
        .find(|&p| rank_of(p) == Some(1))
        .expect("rank 1 is a child of the supervisor");
    let killed = Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status()
        .unwrap();
    assert!(killed.success(), "kill -KILL {victim}");
    let killed = Instant::now();
    let o = child.wait_with_output().unwrap();
    let took = killed.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "the world took {took:?} to end"
    );
    let e = err(&o);
    assert!(
        e.contains("error: rank 1 failed") && e.contains("killed by signal 9"),
        "{e}"
    );
    // The survivors noticed by themselves and named the dead rank.
    for r in [0, 2] {
        let line = format!("[rank {r} of 3] error: rank 1 failed");
        assert!(e.contains(&line), "missing {line:?} in:\n{e}");
    }
    // The last checkpoint is intact, and resumes (on two processes now)
    // onto the unbroken run's bits.
    let ck = mamba_train::checkpoint::load(&out).expect("the last checkpoint loads");
    assert!(
        ck.state.step >= 8 && ck.state.step < 40,
        "{}",
        ck.state.step
    );
    let o = Command::new(bin())
        .args(["train", "--eval-batches", "1", "--world", "2", "--resume"])
        .arg(&out)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(world_digest(&o, 2), unbroken);
}

/// A free TCP port on loopback (bind to 0, read it, release it).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn a_torchrun_style_launch_trains_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    let base = ["--steps", "4", "--logical-world", "2"];
    let want = reference_digest(&base);
    let port = free_port().to_string();
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            let rank = r.to_string();
            let env = [
                ("RANK", rank.as_str()),
                ("LOCAL_RANK", rank.as_str()),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", port.as_str()),
                ("TORCHELASTIC_RUN_ID", "dp-world-test"),
            ];
            command(&dir.path().join("run"), &base, &env)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = ranks
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    assert_eq!(digest(&ok(&outs[0])), want);
    assert_eq!(ok(&outs[1]), "", "only rank 0 writes stdout");
    let e = text(&outs[1].stderr);
    assert!(
        e.contains(&format!("[rank 1 of 2] weights-digest: {want}")),
        "{e}"
    );
}

#[test]
fn ranks_started_with_different_settings_fail_the_agreement_check() {
    let dir = tempfile::tempdir().unwrap();
    let outs = env_launched_world(TINY, dir.path(), 2, "agreement", &[], |rank| {
        let seed = if rank == 0 { "0" } else { "7" };
        ["--steps", "3", "--seed", seed].map(String::from).to_vec()
    });
    for (r, o) in outs.iter().enumerate() {
        let e = err(o);
        assert!(
            e.contains(&format!("[rank {r} of 2] error:"))
                && e.contains("disagree")
                && e.contains("fingerprint"),
            "rank {r}: {e}"
        );
    }
}

/// A rank whose local phase fails tells the world in the step's first
/// collective: with no supervisor to kill them, the peers fail at once
/// naming it, not after the communication timeout with a transport error.
#[test]
fn a_rank_that_fails_locally_takes_its_peers_down_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let outs = env_launched_world(
        TINY,
        dir.path(),
        3,
        "local-failure",
        &[("MAMBA_TEST_FAIL_LOCAL", "1:2")],
        |_| {
            ["--steps", "4", "--comm-timeout", "600"]
                .map(String::from)
                .to_vec()
        },
    );
    for (r, o) in outs.iter().enumerate() {
        let e = err(o);
        if r == 1 {
            assert!(
                e.contains("injected local failure on rank 1 in step 2"),
                "rank 1 reports its own error: {e}"
            );
        } else {
            assert!(
                e.contains("rank 1 failed") && e.contains("local part of step 2"),
                "rank {r} names rank 1: {e}"
            );
        }
    }
}

/// A rank that fails between collectives (after its step was applied, as a
/// failed checkpoint write would) with no supervisor to kill its peers:
/// the host transport tells them in-band, naming it, long before the
/// communication timeout. (GPU worlds do it through the world abort:
/// `tests/cuda_train.rs`.)
#[test]
fn a_rank_that_fails_between_collectives_takes_its_peers_down_naming_it() {
    common::assert_between_collectives_failure_names_rank_1(TINY, 3, "between-collectives", "");
}

#[test]
fn world_flags_are_checked_with_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x");
    let e = err(&train(&out, &["--world", "3", "--logical-world", "4"], &[]));
    assert!(
        e.contains("3 processes does not divide the logical world 4") && e.contains("1, 2, 4"),
        "{e}"
    );
    let e = err(&train(&out, &["--world", "0"], &[]));
    assert!(e.contains("--world must be at least 1"), "{e}");
    let e = err(&train(&out, &["--contract", "fastest"], &[]));
    assert!(e.contains("fastest") && e.contains("nccl-sum"), "{e}");
    // Without a GPU driver --device cuda says what is missing (with one,
    // tests/cuda_train.rs covers GPU worlds).
    if !kernels::driver_present() {
        let e = err(&train(&out, &["--device", "cuda", "--world", "2"], &[]));
        assert!(
            e.contains("--device cuda") && e.contains("--device cpu"),
            "{e}"
        );
    }
    // A torchrun world of several ranks needs MASTER_ADDR/MASTER_PORT
    // (nothing listens there: the flag is refused before any meeting).
    let launcher = [
        ("RANK", "0"),
        ("WORLD_SIZE", "3"),
        ("TORCHELASTIC_RUN_ID", "flags"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29999"),
    ];
    let e = err(&train(&out, &["--world", "2"], &launcher));
    assert!(
        e.contains("--world 2") && e.contains("WORLD_SIZE") && e.contains("started 3"),
        "{e}"
    );
    // A checkpoint's L must be divisible by the new world, and kept.
    let run = dir.path().join("run");
    ok(&train(&run, &["--steps", "2", "--logical-world", "4"], &[]));
    let resume = ["--resume", run.to_str().unwrap()];
    let e = err(&train(
        &run,
        &[&resume[..], &["--world", "3"]].concat(),
        &[],
    ));
    assert!(
        e.contains("does not divide the logical world 4 (the checkpoint's logical world)"),
        "{e}"
    );
    let e = err(&train(
        &run,
        &[&resume[..], &["--logical-world", "2"]].concat(),
        &[],
    ));
    assert!(
        e.contains("logical_world: checkpoint 4, requested 2"),
        "{e}"
    );
    // MAMBA_SEED acts as --seed (the flag wins when both are given).
    let seeded = |extra: &[&str], env: &[(&str, &str)], name: &str| {
        digest(&ok(&train(
            &dir.path().join(name),
            &[&["--steps", "2"][..], extra].concat(),
            env,
        )))
    };
    let seven = seeded(&["--seed", "7"], &[], "s1");
    assert_eq!(seeded(&[], &[("MAMBA_SEED", "7")], "s2"), seven);
    assert_eq!(
        seeded(&["--seed", "7"], &[("MAMBA_SEED", "8")], "s3"),
        seven
    );
    assert_ne!(seeded(&[], &[], "s4"), seven);
    let e = err(&train(&out, &[], &[("MAMBA_TEST_INJECT_NAN", "one:3")]));
    assert!(e.contains("MAMBA_TEST_INJECT_NAN"), "{e}");
}

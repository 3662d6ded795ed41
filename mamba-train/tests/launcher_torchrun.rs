//! `mamba-train train` under a real `torchrun` (the CPU world, one rank per
//! torchrun worker, meeting through our TCP store beside the agent's own at
//! `MASTER_PORT`): the same weights digest as the self-spawned world and as
//! one process at the same logical world. Looks for `torchrun` on `PATH`
//! and at `/opt/torch/.venv/bin/torchrun` (where the GPU machines have it);
//! skips, saying why, where neither exists.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

use common::{bin, last_line_digest, ok, TINY};

/// Where the GPU machines keep PyTorch's launcher.
const VENV_TORCHRUN: &str = "/opt/torch/.venv/bin/torchrun";

/// A `torchrun` that answers `--help`, and how it was found.
fn torchrun() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("torchrun"))
            .find(|p| p.is_file())
    });
    let candidate = on_path.or_else(|| {
        let p = PathBuf::from(VENV_TORCHRUN);
        p.is_file().then_some(p)
    })?;
    let o = Command::new(&candidate).arg("--help").output().ok()?;
    o.status.success().then_some(candidate)
}

/// A port that was free a moment ago (torchrun's agent binds it; ours
/// takes the next one).
fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a probe port");
    l.local_addr().expect("probe address").port()
}

fn train(launcher: Option<(&Path, u16)>, out: &Path, extra: &[&str]) -> Output {
    let mut c = match launcher {
        Some((torchrun, port)) => {
            let mut c = Command::new(torchrun);
            c.args(["--nproc-per-node", "2", "--master-addr", "127.0.0.1"])
                .arg("--master-port")
                .arg(port.to_string())
                .arg("--no-python")
                .arg(bin());
            c
        }
        None => Command::new(bin()),
    };
    c.arg("train")
        .args(TINY)
        .args(["--steps", "8"])
        .args(extra)
        .arg("--out")
        .arg(out);
    c.output().expect("the launcher runs")
}

#[test]
fn a_real_torchrun_world_has_the_self_spawned_bits() {
    let Some(torchrun) = torchrun() else {
        eprintln!("skipping: torchrun is neither on PATH nor at {VENV_TORCHRUN}");
        return;
    };
    eprintln!("launcher: {}", torchrun.display());
    let dir = tempfile::tempdir().unwrap();
    let l4 = ["--logical-world", "4"];
    let under_torchrun = last_line_digest(&ok(&train(
        Some((&torchrun, free_port())),
        &dir.path().join("torchrun"),
        &l4,
    )));
    let spawned = last_line_digest(&ok(&train(
        None,
        &dir.path().join("spawned"),
        &[&l4[..], &["--world", "2"]].concat(),
    )));
    let single = last_line_digest(&ok(&train(None, &dir.path().join("one"), &l4)));
    assert_eq!(under_torchrun, spawned, "torchrun, 2 workers vs --world 2");
    assert_eq!(
        under_torchrun, single,
        "torchrun, 2 workers vs one process at L = 4"
    );
    // Negative control: another logical world is another run.
    let l2 = last_line_digest(&ok(&train(
        Some((&torchrun, free_port())),
        &dir.path().join("torchrun-l2"),
        &[],
    )));
    assert_ne!(l2, under_torchrun);
}

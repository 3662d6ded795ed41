//! `mamba-train train` under a real Open MPI `mpirun` (the CPU world, one
//! rank per MPI process, meeting through the rendezvous the OpenMPI
//! contract selects): the same weights digest as the self-spawned world
//! and as one process at the same logical world. Skips, saying why, where
//! `mpirun` is not installed (`.ci/run` installs Debian's openmpi-bin).

use std::path::Path;
use std::process::{Command, Output};

mod common;

use common::{bin, last_line_digest, ok, TINY};

fn mpirun() -> Option<String> {
    let o = Command::new("mpirun").arg("--version").output().ok()?;
    o.status.success().then(|| {
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .to_string()
    })
}

fn train(launcher: &[&str], out: &Path, extra: &[&str]) -> Output {
    let (prog, pre) = match launcher.split_first() {
        Some((p, rest)) => (p.to_string(), rest.to_vec()),
        None => (bin().display().to_string(), Vec::new()),
    };
    let mut c = Command::new(prog);
    c.args(pre);
    if !launcher.is_empty() {
        c.arg(bin());
    }
    c.arg("train")
        .args(TINY)
        .args(["--steps", "8"])
        .args(extra)
        .arg("--out")
        .arg(out)
        // Root in CI containers: Open MPI refuses root unless told.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    c.output().expect("the launcher runs")
}

#[test]
fn a_real_mpirun_world_has_the_self_spawned_bits() {
    let Some(version) = mpirun() else {
        eprintln!("skipping: mpirun (Open MPI) is not installed");
        return;
    };
    eprintln!("launcher: {version}");
    let dir = tempfile::tempdir().unwrap();
    let mpi = ["mpirun", "--oversubscribe", "-np", "2"];
    let l4 = ["--logical-world", "4"];
    let under_mpi = last_line_digest(&ok(&train(&mpi, &dir.path().join("mpi"), &l4)));
    let spawned = last_line_digest(&ok(&train(
        &[],
        &dir.path().join("spawned"),
        &[&l4[..], &["--world", "2"]].concat(),
    )));
    let single = last_line_digest(&ok(&train(&[], &dir.path().join("one"), &l4)));
    assert_eq!(under_mpi, spawned, "mpirun -np 2 vs --world 2");
    assert_eq!(under_mpi, single, "mpirun -np 2 vs one process at L = 4");
    // Negative control: another logical world is another run.
    let l2 = last_line_digest(&ok(&train(&mpi, &dir.path().join("mpi-l2"), &[])));
    assert_ne!(l2, under_mpi);
}

//! Helpers shared by the tests that run the `mamba-train` binary
//! (`cli_train.rs`, `dp_world.rs`, `cli_data.rs`): locating the binary and reading its
//! exit status, output and summary digest; and the fixed-order oracle
//! loop ([`train_by_definition`]); a BPE tokenizer trained on the spot
//! ([`bpe`]).
#![allow(dead_code)] // each test crate uses a different part

pub mod bpe;

use std::path::PathBuf;
use std::process::Output;

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
        let mean = mamba_reduce::host_mean(&rows).expect("gradient mean");
        let rows: Vec<&[f32]> = losses.iter().map(|x| &x[..]).collect();
        let loss = mamba_reduce::host_mean(&rows).expect("loss mean")[0];
        t.apply(&mean, loss, finite).expect("update");
    }
}

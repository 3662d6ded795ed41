//! `--contract fixed-tree` end to end on CPU worlds: the `mamba-train`
//! binary with `--world P` gives the bits of the engine stepped by the
//! tree's definition (`mamba_reduce::host_tree_mean` of the L micro-batch
//! gradients) for P = 1, 2 and 4 at L = 4, and differs from fixed-order
//! (negative control); a fixed-tree checkpoint resumes on another P onto
//! the unbroken bits; the engine's gradient memory is log2(L/P) + 1 arenas,
//! not L/P; an L that is not a power of two is refused by flag.

use std::path::Path;
use std::process::{Command, Output};

mod common;

use clap::Parser;
use mamba_train::cli::{resolve::resolve_run, Cli, Command as Sub};
use mamba_train::dp::{self, DpOptions};
use mamba_train::model::cpu::CpuModel;
use mamba_train::train::{RunConfig, Trainer};

use common::{
    bin, err, last_line_digest, ok, train_by_definition, train_by_definition_with, world_digest,
    TINY,
};

const TREE: &[&str] = &["--contract", "fixed-tree"];

fn train(out: &Path, extra: &[&str]) -> Output {
    train_env(out, extra, &[])
}

fn train_env(out: &Path, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(bin());
    c.arg("train")
        .args(TINY)
        .args(["--comm-timeout", "30"])
        .args(extra)
        .arg("--out")
        .arg(out);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("the mamba-train binary runs")
}

fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .expect("metrics written")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn resolve(extra: &[&str]) -> RunConfig {
    let mut argv = vec!["mamba-train", "train"];
    argv.extend_from_slice(TINY);
    argv.extend_from_slice(extra);
    let Sub::Train(args) = Cli::try_parse_from(argv).expect("flags parse").command else {
        panic!("not a train command")
    };
    resolve_run(&args, None).expect("run resolves").run
}

fn trainer(run: &RunConfig) -> Trainer<CpuModel> {
    Trainer::new(CpuModel::new(run.model.clone()).unwrap(), run.clone()).unwrap()
}

/// The engine stepped by the tree's definition for these flags, with no
/// reducer: per step the host tree mean of the L gradients.
fn tree_reference(extra: &[&str]) -> String {
    let run = resolve(extra);
    let mut t = trainer(&run);
    train_by_definition_with(&mut t, mamba_reduce::host_tree_mean);
    t.weights_digest().unwrap()
}

#[test]
fn one_two_and_four_processes_give_the_tree_bits_and_the_chain_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let l4 = [&["--steps", "4", "--logical-world", "4"][..], TREE].concat();
    let want = tree_reference(&l4);
    for p in ["1", "2", "4"] {
        let o = train(
            &dir.path().join(format!("p{p}")),
            &[&l4[..], &["--world", p]].concat(),
        );
        assert_eq!(world_digest(&o, p.parse().unwrap()), want, "P = {p}");
    }
    // Negative control: the same run under fixed-order (the chain) moves
    // other bits, live and by definition.
    let chain = ["--steps", "4", "--logical-world", "4"];
    let o = train(
        &dir.path().join("chain"),
        &[&chain[..], &["--world", "2"]].concat(),
    );
    let live_chain = world_digest(&o, 2);
    assert_ne!(live_chain, want, "fixed-order must differ from fixed-tree");
    let mut t = trainer(&resolve(&chain));
    train_by_definition(&mut t);
    assert_eq!(t.weights_digest().unwrap(), live_chain);
}

#[test]
fn a_fixed_tree_checkpoint_resumes_on_another_world_onto_the_unbroken_bits() {
    let dir = tempfile::tempdir().unwrap();
    let l4 = [&["--steps", "6", "--logical-world", "4"][..], TREE].concat();
    let unbroken = tree_reference(&l4);
    let out = dir.path().join("run");
    let first = ok(&train(
        &out,
        &[&l4[..], &["--world", "2", "--stop-at", "3"]].concat(),
    ));
    assert!(first.contains("stopped at step 3"), "{first}");
    assert_ne!(last_line_digest(&first), unbroken);
    // The contract and L come from the checkpoint; four processes now.
    let o = Command::new(bin())
        .args(["train", "--eval-batches", "1", "--world", "4", "--resume"])
        .arg(&out)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(world_digest(&o, 4), unbroken, "resumed at P = 4 from P = 2");
    // Resuming it as fixed-order is a different run, refused by name.
    let e = err(&Command::new(bin())
        .args([
            "train",
            "--eval-batches",
            "1",
            "--contract",
            "fixed-order",
            "--resume",
        ])
        .arg(&out)
        .arg("--out")
        .arg(dir.path().join("other"))
        .output()
        .unwrap());
    assert!(e.contains("contract") && e.contains("fixed-tree"), "{e}");
}

/// A NaN in one micro-batch gradient is seen before it is folded into the
/// counter: the step is skipped on every rank, and the counter's arenas
/// (one of them poisoned) serve the next steps as before.
#[test]
fn a_nan_under_the_tree_skips_the_step_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let base = [&["--steps", "5", "--logical-world", "4"][..], TREE].concat();
    let clean = tree_reference(&base);
    let two = dir.path().join("two");
    let o = train_env(
        &two,
        &[&base[..], &["--world", "2"]].concat(),
        &[("MAMBA_TEST_INJECT_NAN", "1:3")],
    );
    let poisoned = world_digest(&o, 2);
    assert_ne!(poisoned, clean, "the skipped step must change the run");
    for (i, r) in metrics(&two).iter().enumerate() {
        let step = i as u64 + 1;
        assert_eq!(r["skipped"], step == 3, "step {step}: {r}");
        assert_eq!(r["skipped_steps"], u64::from(step >= 3), "step {step}: {r}");
        assert!(r["loss"].as_f64().is_some_and(f64::is_finite), "{r}");
    }
    // The whole step is skipped wherever the NaN was: one process, rank 0.
    let o = train_env(
        &dir.path().join("one"),
        &base,
        &[("MAMBA_TEST_INJECT_NAN", "0:3")],
    );
    assert_eq!(world_digest(&o, 1), poisoned);
    assert!(ok(&o).contains("1 skipped"));
}

/// The engine's gradient memory: L/P arenas under the chain, log2(L/P) + 1
/// under the tree, the same after steps as at the start; and the tree
/// engine's bits are the tree's definition.
#[test]
fn tree_gradient_memory_is_logarithmic_in_the_block() {
    for (l, tree_arenas) in [(1usize, 1usize), (2, 2), (16, 5)] {
        let ls = l.to_string();
        let flags = ["--steps", "2", "--logical-world", &ls];
        let tree_flags = [&flags[..], TREE].concat();
        let mut w = dp::host::local(trainer(&resolve(&tree_flags)), DpOptions::default()).unwrap();
        assert_eq!(w.gradient_arenas(), tree_arenas, "tree, L = {l}");
        while !w.finished() {
            w.step().unwrap();
        }
        assert_eq!(
            w.gradient_arenas(),
            tree_arenas,
            "tree after steps, L = {l}"
        );
        let (mut t, _) = w.into_parts();
        assert_eq!(
            t.weights_digest().unwrap(),
            tree_reference(&tree_flags),
            "L = {l}"
        );

        let chain = dp::host::local(trainer(&resolve(&flags)), DpOptions::default()).unwrap();
        assert_eq!(chain.gradient_arenas(), l, "chain, L = {l}");
    }
}

#[test]
fn a_logical_world_that_is_not_a_power_of_two_is_refused_by_flag() {
    let dir = tempfile::tempdir().unwrap();
    for (extra, l) in [
        (&["--logical-world", "6"][..], 6),
        (&["--world", "3"][..], 3),
        (&["--world", "2", "--logical-world", "12"][..], 12),
    ] {
        let o = train(
            &dir.path().join("x"),
            &[extra, TREE, &["--steps", "1"]].concat(),
        );
        let e = err(&o);
        assert!(
            e.contains("--contract fixed-tree")
                && e.contains(&format!("the logical world is {l}"))
                && e.contains("--logical-world")
                && e.contains("--contract fixed-order"),
            "{extra:?}: {e}"
        );
        assert!(
            !e.contains("starting"),
            "refused before any rank starts: {e}"
        );
    }
    // A library user who builds the run by hand meets the reducer's own
    // check when the world forms.
    let mut run = resolve(&["--logical-world", "6"]);
    run.contract = mamba_reduce::ReduceContract::FixedTree;
    let e = dp::host::local(trainer(&run), DpOptions::default())
        .err()
        .expect("L = 6 under fixed-tree is refused")
        .to_string();
    assert!(e.contains("got L = 6") && e.contains("power of two"), "{e}");
}

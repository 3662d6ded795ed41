//! `mamba-train --arch mamba2`: Mamba-2 through the same binary, engine,
//! reducer and checkpoints as Mamba-1 — it learns, repeats bit for bit,
//! lands on one digest for every world at a fixed logical world, resumes
//! onto the unbroken run's bits, fine-tunes with `--init-from` — and every
//! flag that does not fit is refused by name. Tiny shapes, few steps.

use std::path::Path;
use std::process::{Command, Output};

mod common;

use common::{bin, err, last_line_digest, ok, run_train, text, world_digest, TINY};

/// [`TINY`] as Mamba-2: 2 x 16 = 32 inner channels in 4 heads of 8, and
/// 12-token rows in 3 chunks of 4 (so the scan carries state across
/// chunks). State size: Mamba-2's default, 128.
const M2: &[&str] = &["--arch", "mamba2", "--head-dim", "8", "--chunk-size", "4"];

/// `train` with [`TINY`], [`M2`], then `extra` (later flags win).
fn m2(out: &Path, extra: &[&str]) -> Output {
    run_train(&[TINY, M2].concat(), out, extra, &[])
}

/// A `mamba-train` subcommand's output.
fn run(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .output()
        .expect("the mamba-train binary runs")
}

/// The held-out loss of train's summary (`..., held-out loss X`).
fn held_out(stdout: &str) -> f64 {
    let at = stdout.find("held-out loss ").expect("a held-out loss") + 14;
    let num: String = stdout[at..]
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    num.parse().expect("a number")
}

/// The first step's training loss in a run directory's metrics.
fn first_loss(run: &Path) -> f64 {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    first["loss"].as_f64().unwrap()
}

/// The `config.json` of a run directory's newest checkpoint.
fn hf_config(run: &Path) -> serde_json::Value {
    let dir = mamba_train::checkpoint::resolve(run).unwrap();
    serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap()
}

/// Assert that the failed `o`'s stderr holds every one of `want`.
fn refused(o: &Output, want: &[&str]) -> String {
    let e = err(o);
    for w in want {
        assert!(e.contains(w), "want {w:?} in:\n{e}");
    }
    e
}

#[test]
fn mamba2_learns_repeats_bit_for_bit_and_evaluates() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    let barely = held_out(&ok(&m2(&p("barely"), &["--steps", "2"])));
    let trained = m2(&p("a"), &["--steps", "60", "--threads", "1"]);
    let out = ok(&trained);
    let learned = held_out(&out);
    assert!(
        learned < barely - 0.1,
        "held-out loss after 60 steps {learned} vs 2 steps {barely}"
    );
    assert!(
        text(&trained.stderr).contains("Mamba-2 (4 heads of 8, 1 group, chunk 4, d_state 128)"),
        "{}",
        text(&trained.stderr)
    );
    let digest = last_line_digest(&out);
    let again = ok(&m2(&p("b"), &["--steps", "60", "--threads", "2"]));
    assert_eq!(last_line_digest(&again), digest, "same command, same bits");
    let cfg = hf_config(&p("a"));
    assert_eq!(cfg["model_type"], "mamba2");
    assert_eq!(
        (cfg["head_dim"].clone(), cfg["num_heads"].clone()),
        (8.into(), 4.into())
    );
    // Negative control: the same flags as Mamba-1 are another model.
    let m1 = run_train(TINY, &p("m1"), &["--steps", "60"], &[]);
    assert_ne!(last_line_digest(&ok(&m1)), digest);
    // `eval` rebuilds the Mamba-2 model from the checkpoint and scores the
    // same held-out batches as the run's final evaluation.
    let a = p("a");
    let e = ok(&run(&[
        "eval",
        "--checkpoint",
        a.to_str().unwrap(),
        "--batches",
        "1",
    ]));
    let eval_loss: f64 = e
        .lines()
        .find_map(|l| l.strip_prefix("held-out loss: "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no loss in {e}"));
    assert_eq!(format!("{eval_loss:.4}"), format!("{learned:.4}"), "{e}");
}

#[test]
fn mamba2_digest_is_one_for_every_world_at_a_fixed_logical_world() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    // World 1 reads the architecture from a --config file (the same keys
    // as the flags); the others from flags.
    let toml = p("m2.toml");
    std::fs::write(&toml, "arch = \"mamba2\"\nhead-dim = 8\nchunk_size = 4\n").unwrap();
    let toml = toml.to_str().unwrap().to_string();
    let steps = ["--steps", "3"];
    let w1 = ok(&run_train(
        TINY,
        &p("w1"),
        &[&["--config", &toml, "--logical-world", "4"], &steps[..]].concat(),
        &[],
    ));
    let d1 = last_line_digest(&w1);
    for world in ["2", "4"] {
        let o = m2(
            &p(&format!("w{world}")),
            &[&["--world", world, "--logical-world", "4"], &steps[..]].concat(),
        );
        assert_eq!(
            world_digest(&o, world.parse().unwrap()),
            d1,
            "--world {world} at --logical-world 4"
        );
    }
    // Negative control: the logical world is part of the run's identity.
    let o = m2(
        &p("l2"),
        &[&["--world", "2", "--logical-world", "2"], &steps[..]].concat(),
    );
    assert_ne!(world_digest(&o, 2), d1, "--logical-world 2 is another run");
}

#[test]
fn mamba2_resumes_onto_the_unbroken_bits_and_fine_tunes() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    let full = p("full");
    let unbroken = last_line_digest(&ok(&m2(
        &full,
        &["--steps", "6", "--checkpoint-every", "3"],
    )));
    let part = p("part");
    ok(&m2(&part, &["--steps", "6", "--stop-at", "3"]));
    let part_s = part.to_str().unwrap();
    // Flags that contradict the checkpoint are refused before anything
    // changes (the run continues below).
    refused(
        &run_train(&[], &part, &["--resume", part_s, "--arch", "mamba1"], &[]),
        &[
            "--arch mamba1 disagrees with the checkpoint being resumed, a Mamba-2 model \
           (config.json model_type \"mamba2\"); omit --arch",
        ],
    );
    refused(
        &run_train(&[], &part, &["--resume", part_s, "--head-dim", "16"], &[]),
        &["--head-dim 16 disagrees with the checkpoint being resumed, whose config.json has 8"],
    );
    // No architecture flags: the checkpoint's.
    let resumed = ok(&run_train(&[], &part, &["--resume", part_s], &[]));
    assert!(resumed.contains("(3 run here"), "{resumed}");
    assert_eq!(
        last_line_digest(&resumed),
        unbroken,
        "stop + resume = unbroken"
    );

    // --init-from our Mamba-2 checkpoint: the architecture and shape come
    // from its config.json; it starts from the trained weights.
    let full_s = full.to_str().unwrap();
    let tuned = p("tuned");
    let t = run_train(TINY, &tuned, &["--init-from", full_s, "--steps", "3"], &[]);
    last_line_digest(&ok(&t));
    assert!(
        text(&t.stderr).contains("Mamba-2 (4 heads of 8"),
        "{}",
        text(&t.stderr)
    );
    assert_eq!(hf_config(&tuned)["model_type"], "mamba2");
    assert!(
        first_loss(&tuned) < first_loss(&full),
        "fine-tuning starts from the trained weights: {} vs a fresh start's {}",
        first_loss(&tuned),
        first_loss(&full)
    );
    let other = p("other");
    refused(
        &run_train(
            TINY,
            &other,
            &["--init-from", full_s, "--arch", "mamba1"],
            &[],
        ),
        &[&format!(
            "--arch mamba1 disagrees with --init-from {full_s}, a Mamba-2 model (config.json \
             model_type \"mamba2\"); omit --arch (a pretrained model's architecture and shape \
             come from its config.json)"
        )],
    );
    refused(
        &run_train(
            TINY,
            &other,
            &["--init-from", full_s, "--n-groups", "2"],
            &[],
        ),
        &[&format!(
            "--n-groups 2 disagrees with --init-from {full_s}, whose config.json has 1"
        )],
    );
    // generate decodes Mamba-2 on the CPU (the same greedy continuation
    // twice; cuda_train.rs decodes it on a GPU). The
    // synthetic task's 6 tokens are the bytes 0..6 to the byte-level codec.
    let gen = |device: &str| {
        run(&[
            "generate",
            "--checkpoint",
            full_s,
            "--prompt",
            "\u{1}\u{2}\u{3}",
            "--max-new-tokens",
            "6",
            "--device",
            device,
        ])
    };
    let first = ok(&gen("cpu"));
    assert!(!first.trim().is_empty(), "generate printed nothing");
    assert_eq!(ok(&gen("cpu")), first, "greedy decoding repeats");
}

#[test]
fn flags_that_do_not_fit_the_architecture_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    let bad = |flags: &[&str], want: &[&str]| {
        let e = refused(&run_train(TINY, &p("bad"), flags, &[]), want);
        for field in ["head_dim", "n_groups", "chunk_size", "d_inner"] {
            assert!(!e.contains(field), "internal name {field} in:\n{e}");
        }
    };
    bad(
        &["--head-dim", "8"],
        &[
            "--head-dim 8 applies only to Mamba-2 (--arch mamba2), but this run is Mamba-1 \
           (the default architecture); drop --head-dim or add --arch mamba2",
        ],
    );
    bad(
        &["--arch", "mamba1", "--n-groups", "2"],
        &[
            "--n-groups 2 applies only to Mamba-2 (--arch mamba2), but this run is Mamba-1 \
           (--arch mamba1)",
        ],
    );
    bad(
        &["--arch", "mamba2", "--head-dim", "12"],
        &[
            "--head-dim 12 must divide the inner width 2 x --d-model = 32",
            "e.g. --head-dim 8",
        ],
    );
    bad(
        &["--arch", "mamba2", "--head-dim", "8", "--n-groups", "3"],
        &["--n-groups 3 must divide the number of heads, 32 / --head-dim 8 = 4"],
    );
    bad(
        &["--arch", "mamba2", "--chunk-size", "0"],
        &["--chunk-size must be at least 1, got 0"],
    );
    bad(
        &["--arch", "mamba3"],
        &["invalid value 'mamba3' for '--arch", "mamba1", "mamba2"],
    );
    // A world refuses once, in the supervisor, before any rank starts.
    let o = run_train(
        TINY,
        &p("bad"),
        &["--world", "2", "--arch", "mamba2", "--head-dim", "12"],
        &[],
    );
    let e = refused(&o, &["--head-dim 12 must divide"]);
    assert_eq!(e.matches("must divide").count(), 1, "{e}");
    // A Mamba-1 model has no Mamba-2 shape to set.
    let m1 = p("m1");
    ok(&run_train(TINY, &m1, &["--steps", "1"], &[]));
    let m1_s = m1.to_str().unwrap();
    bad(
        &["--init-from", m1_s, "--head-dim", "8"],
        &[&format!(
            "--head-dim 8 applies only to Mamba-2 (--arch mamba2), but --init-from {m1_s} is a \
             Mamba-1 model (config.json model_type \"mamba\"); drop --head-dim"
        )],
    );
}

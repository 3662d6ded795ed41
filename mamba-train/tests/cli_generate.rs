//! `mamba-train generate` and `eval`, end to end through the binary: a tiny
//! byte-level model trained by `train` on a short repetitive text continues
//! it greedily; sampled output repeats for one seed and changes with
//! another; `eval` reproduces the training run's held-out loss and beats the
//! untrained model; bad flags and inputs are refused naming the flag. On a
//! GPU (skipped with a printed reason without one, unless
//! `MAMBA_REQUIRE_GPU=1`), `--device cuda` gives the CPU's greedy text and
//! held-out loss within f32 rounding.

use std::path::Path;
use std::process::{Command, Output};

mod common;
mod cuda_common;

use common::{bin, err, ok, text, TINY};
use mamba_train::model::cpu::CpuModel;
use mamba_train::train::Trainer;

/// One period of the training text (45 bytes).
const PERIOD: &str = "the quick brown fox jumps over the lazy dog. ";
const PROMPT: &str = "the quick brown";

fn run(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .output()
        .expect("the mamba-train binary runs")
}

/// Train the byte-level model on `PERIOD` x 40 (150 steps of 8 x 32 bytes,
/// d_model 32, 2 layers: a few seconds; its held-out next-byte accuracy
/// is ~99%). Returns the run directory and train's stdout.
fn train_text(dir: &Path) -> (std::path::PathBuf, String) {
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, PERIOD.repeat(40)).unwrap();
    let out = dir.join("run");
    let stdout = ok(&run(&[
        "train",
        "--task",
        "text",
        "--data",
        corpus.to_str().unwrap(),
        "--d-model",
        "32",
        "--layers",
        "2",
        "--batch",
        "8",
        "--seq-len",
        "32",
        "--steps",
        "150",
        "--lr",
        "0.01",
        "--warmup",
        "10",
        "--eval-batches",
        "2",
        "--checkpoint-every",
        "0",
        "--out",
        out.to_str().unwrap(),
    ]));
    (out, stdout)
}

/// The continuation printed by `generate` (stdout less its one newline).
fn continuation(o: &Output) -> String {
    let s = ok(o);
    s.strip_suffix('\n')
        .unwrap_or_else(|| panic!("no final newline: {s:?}"))
        .to_string()
}

fn generate(ck: &Path, extra: &[&str]) -> Output {
    let mut a = vec!["generate", "--checkpoint", ck.to_str().unwrap()];
    a.extend_from_slice(extra);
    run(&a)
}

#[test]
fn a_trained_text_model_continues_its_text_and_eval_reproduces_its_loss() {
    let dir = tempfile::tempdir().unwrap();
    let (run_dir, train_out) = train_text(dir.path());

    // Greedy: one whole period of the text after the prompt, exactly.
    let g = generate(&run_dir, &["--prompt", PROMPT, "--max-new-tokens", "45"]);
    let want: String = PERIOD.repeat(2)[PROMPT.len()..PROMPT.len() + 45].to_string();
    assert_eq!(continuation(&g), want);
    let log = text(&g.stderr);
    assert!(
        log.contains("prefill: 15 tokens") && log.contains("decode: 45 tokens"),
        "{log}"
    );
    assert!(log.contains("tokens/s") && log.contains("greedy"), "{log}");

    // Sampled: the same seed twice gives the same text, another seed
    // another (temperature 1.5 flattens the distribution enough that 60
    // draws from different seeds cannot all agree).
    let sampled = |seed: &str| {
        continuation(&generate(
            &run_dir,
            &[
                "--prompt",
                PROMPT,
                "--max-new-tokens",
                "60",
                "--temperature",
                "1.5",
                "--seed",
                seed,
            ],
        ))
    };
    let (a, b, c) = (sampled("1"), sampled("1"), sampled("2"));
    assert_eq!(a, b, "same seed, same text");
    assert_ne!(a, c, "another seed must sample another text");
    // top-k 1 is the argmax whatever the temperature: the greedy text.
    let k1 = continuation(&generate(
        &run_dir,
        &[
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "45",
            "--temperature",
            "3",
            "--top-k",
            "1",
            "--seed",
            "9",
        ],
    ));
    assert_eq!(k1, want);

    // The same weights as a Hugging Face directory (config.json and
    // model.safetensors only) give the same greedy text.
    let hf = dir.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    let ck = mamba_train::checkpoint::resolve(&run_dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(ck.join(f), hf.join(f)).unwrap();
    }
    let g = generate(&hf, &["--prompt", PROMPT, "--max-new-tokens", "45"]);
    assert_eq!(continuation(&g), want);
    assert!(text(&g.stderr).contains("Hugging Face weights"));

    // eval: the training run's final held-out loss (same batches), printed
    // by train to 4 decimals, and far below the untrained model's.
    let logged: f64 = train_out
        .lines()
        .find_map(|l| l.split("held-out loss ").nth(1))
        .unwrap_or_else(|| panic!("train printed no held-out loss:\n{train_out}"))
        .trim()
        .parse()
        .unwrap();
    let e = ok(&run(&[
        "eval",
        "--checkpoint",
        run_dir.to_str().unwrap(),
        "--batches",
        "2",
        "--json",
    ]));
    let j: serde_json::Value = serde_json::from_str(e.trim()).unwrap();
    let loss = j["loss"].as_f64().unwrap();
    assert_eq!(format!("{loss:.4}"), format!("{logged:.4}"), "{e}");
    assert!((j["perplexity"].as_f64().unwrap() - loss.exp()).abs() < 1e-12);
    assert_eq!(j["scored"], 2 * 32 * 32);
    let run_cfg = mamba_train::checkpoint::load(&run_dir).unwrap().state.run;
    let mut untrained =
        Trainer::new(CpuModel::new(run_cfg.model.clone()).unwrap(), run_cfg).unwrap();
    let base = untrained.evaluate(2, 32).unwrap().loss;
    assert!(loss < 0.2 * base, "trained {loss} vs untrained {base}");
    let e = ok(&run(&[
        "eval",
        "--checkpoint",
        run_dir.to_str().unwrap(),
        "--batches",
        "2",
    ]));
    assert!(
        e.contains("held-out loss: ") && e.contains("perplexity"),
        "{e}"
    );
    // eval needs the run (the task) a Hugging Face directory lacks.
    let e = err(&run(&["eval", "--checkpoint", hf.to_str().unwrap()]));
    assert!(e.contains("state.json"), "{e}");
}

#[test]
fn a_synthetic_checkpoint_is_scored_against_chance_and_bad_input_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sc");
    let mut a = vec!["train", "--steps", "4", "--out", out.to_str().unwrap()];
    a.extend_from_slice(TINY);
    ok(&run(&a));
    let ck = out.to_str().unwrap();
    let e = ok(&run(&[
        "eval",
        "--checkpoint",
        ck,
        "--batches",
        "1",
        "--json",
    ]));
    let j: serde_json::Value = serde_json::from_str(e.trim()).unwrap();
    assert_eq!(j["task"], "selective-copy");
    // Alphabet 4: chance is 1/4 on each of the 3 remembered tokens of 32 rows.
    assert_eq!(j["chance"], 0.25);
    assert_eq!(j["scored"], 32 * 3);

    // The selective-copy vocabulary is a few tokens, so text bytes are
    // outside it.
    let e = err(&generate(&out, &["--prompt", "z"]));
    assert!(e.contains("--prompt") && e.contains("outside"), "{e}");
    for (flags, named) in [
        (
            &["--prompt", "a", "--temperature", "-0.5"][..],
            "--temperature",
        ),
        (
            &["--prompt", "a", "--temperature", "1", "--top-p", "1.5"][..],
            "--top-p",
        ),
        (
            &["--prompt", "a", "--temperature", "1", "--top-p", "0"][..],
            "--top-p",
        ),
        (&["--prompt", "a", "--top-k", "3"][..], "--top-k"),
        (&["--prompt", ""][..], "--prompt is empty"),
    ] {
        let e = err(&generate(&out, flags));
        assert!(
            e.contains(named) && e.contains("invalid configuration"),
            "{flags:?}: {e}"
        );
    }
    let e = err(&generate(&dir.path().join("missing"), &["--prompt", "a"]));
    assert!(
        e.contains("--checkpoint") && e.contains("no such directory"),
        "{e}"
    );
    let e = err(&run(&["eval", "--checkpoint", ck, "--batches", "0"]));
    assert!(e.contains("--batches"), "{e}");
}

#[test]
fn on_a_gpu_generate_and_eval_agree_with_the_cpu() {
    if let Some(reason) = cuda_common::no_gpu_reason() {
        assert!(
            !cuda_common::gpu_required(),
            "MAMBA_REQUIRE_GPU=1 but {reason}"
        );
        eprintln!("skipping: {reason}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (run_dir, _) = train_text(dir.path());
    let greedy = |device: &str| {
        continuation(&generate(
            &run_dir,
            &[
                "--prompt",
                PROMPT,
                "--max-new-tokens",
                "45",
                "--device",
                device,
            ],
        ))
    };
    // The model is confident (next-byte accuracy ~99%), so f32 rounding
    // between devices cannot move an argmax: the texts are equal.
    assert_eq!(greedy("cuda"), greedy("cpu"));
    let sampled = || {
        continuation(&generate(
            &run_dir,
            &[
                "--prompt",
                PROMPT,
                "--max-new-tokens",
                "60",
                "--temperature",
                "1.5",
                "--seed",
                "1",
                "--device",
                "cuda",
            ],
        ))
    };
    assert_eq!(sampled(), sampled(), "same seed on the GPU, same text");
    let loss = |device: &str| {
        let e = ok(&run(&[
            "eval",
            "--checkpoint",
            run_dir.to_str().unwrap(),
            "--batches",
            "2",
            "--json",
            "--device",
            device,
        ]));
        let j: serde_json::Value = serde_json::from_str(e.trim()).unwrap();
        j["loss"].as_f64().unwrap()
    };
    let (cpu, gpu) = (loss("cpu"), loss("cuda"));
    // 1e-4 nats: the CUDA logits agree with the CPU's to ~1e-6 relative
    // (cuda_parity.rs), so each position's loss to ~1e-5.
    assert!((cpu - gpu).abs() <= 1e-4, "cpu {cpu} vs cuda {gpu}");
}

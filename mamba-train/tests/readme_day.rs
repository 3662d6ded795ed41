//! The README's "day end to end" block, run line by line exactly as
//! written: on the CPU, and on a GPU with `--device cuda` added to `train`,
//! `eval` and `generate` (skipped, with the reason, without one). The
//! README is compiled in, so the test runs from a GPU bundle too.

use std::path::Path;
use std::process::Command;

mod common;
mod cuda_common;

use common::bpe::corpus_line;
use common::{bin, last_line_digest, text};

const README: &str = include_str!("../../README.md");

/// The command lines of the README's day block.
fn day_lines() -> Vec<String> {
    let begin = README
        .find("<!-- day: begin -->")
        .expect("the README has the day block");
    let end = README
        .find("<!-- day: end -->")
        .expect("the day block ends");
    let lines: Vec<String> = README[begin..end]
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("mamba-train "))
        .map(str::to_owned)
        .collect();
    assert!(
        lines.len() >= 6,
        "the day block lost its commands: {lines:?}"
    );
    lines
}

/// A corpus of a few text files in `dir/corpus`.
fn write_corpus(dir: &Path) {
    let corpus = dir.join("corpus");
    std::fs::create_dir_all(corpus.join("more")).unwrap();
    for f in 0..4 {
        let text: String = (0..150).map(|i| corpus_line(f * 150 + i) + "\n").collect();
        let sub = if f % 2 == 0 { "" } else { "more/" };
        std::fs::write(corpus.join(format!("{sub}part-{f}.txt")), text).unwrap();
    }
}

/// Run every line in `dir` with `mamba-train` on the PATH (this build's
/// binary); `cuda` adds `--device cuda` to train, eval and generate.
fn run_day(dir: &Path, cuda: bool) -> Vec<String> {
    write_corpus(dir);
    let bin_dir = dir.join("bin");
    std::fs::create_dir_all(&bin_dir).unwrap();
    std::os::unix::fs::symlink(bin(), bin_dir.join("mamba-train")).unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut outputs = Vec::new();
    for line in day_lines() {
        let device_flag = [
            "mamba-train train ",
            "mamba-train eval ",
            "mamba-train generate ",
        ]
        .iter()
        .any(|p| line.starts_with(p));
        let line = if cuda && device_flag {
            format!("{line} --device cuda")
        } else {
            line
        };
        let o = Command::new("sh")
            .arg("-c")
            .arg(&line)
            .current_dir(dir)
            .env("PATH", &path)
            .output()
            .expect("sh runs");
        assert!(
            o.status.success(),
            "README line failed: {line}\nstdout:\n{}\nstderr:\n{}",
            text(&o.stdout),
            text(&o.stderr)
        );
        outputs.push(text(&o.stdout));
    }
    outputs
}

fn check_outputs(out: &[String]) {
    assert!(out[0].contains("tokenizer: tokenizer.json"), "{}", out[0]);
    let train = last_line_digest(&out[2]);
    let eval = &out[3];
    assert!(eval.contains("perplexity"), "{eval}");
    assert!(!out[4].trim().is_empty(), "generate printed nothing");
    let tuned = last_line_digest(&out[5]);
    assert_ne!(train, tuned, "the fine-tuning run trained");
}

#[test]
fn the_readme_day_runs_as_written_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_day(dir.path(), false);
    check_outputs(&out);
    // It learned: the held-out perplexity is far below the vocabulary's.
    let ppl: f64 = out[3]
        .split("perplexity")
        .nth(1)
        .and_then(|r| {
            r.trim_start_matches([' ', ':'])
                .split(|c: char| !(c.is_ascii_digit() || c == '.'))
                .next()
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or_else(|| panic!("no perplexity in {}", out[3]));
    assert!(ppl < 100.0, "held-out perplexity {ppl}: {}", out[3]);
}

#[test]
fn the_readme_day_runs_as_written_on_a_gpu() {
    if let Some(why) = cuda_common::no_gpu_reason() {
        assert!(
            !cuda_common::gpu_required(),
            "MAMBA_REQUIRE_GPU=1 but {why}"
        );
        eprintln!("skipping: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    check_outputs(&run_day(dir.path(), true));
}

//! Language-model data through the `mamba-train` binary: `tokenize`, the
//! token-file task, text with a tokenizer, their held-out splits, their
//! errors, and the world-size invariance of the sample stream. The
//! tokenizer is a small BPE trained here by the `tokenizers` crate, so
//! nothing is downloaded.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

use common::bpe::{corpus_line, train_tokenizer};
use common::{bin, err, last_line_digest, ok, text};

/// A small model and run for language-model data.
const SMALL: &[&str] = &[
    "--d-model",
    "16",
    "--layers",
    "1",
    "--batch",
    "4",
    "--seq-len",
    "24",
    "--eval-batches",
    "1",
    "--lr",
    "0.01",
    "--comm-timeout",
    "30",
];

/// A corpus directory of nested documents under `root` and a tokenizer
/// trained on the same kind of text; returns (corpus, tokenizer.json,
/// the documents' texts in sorted path order).
fn corpus(root: &Path) -> (PathBuf, PathBuf, Vec<String>) {
    let dir = root.join("corpus");
    let mut docs = Vec::new();
    for i in 0..6 {
        let path = dir
            .join(format!("part{}", i % 2))
            .join(format!("doc{i}.txt"));
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        let lines: Vec<String> = (0..30).map(|j| corpus_line(i * 30 + j)).collect();
        let text = lines.join("\n");
        fs::write(&path, &text).unwrap();
        docs.push((path, text));
    }
    docs.sort();
    let tok = root.join("bpe.json");
    train_tokenizer(&tok, &(0..300).map(corpus_line).collect::<Vec<_>>(), 320);
    (dir, tok, docs.into_iter().map(|d| d.1).collect())
}

fn tokenize(args: &[&str], inputs: &[&Path]) -> Output {
    Command::new(bin())
        .arg("tokenize")
        .args(args)
        .args(inputs)
        .output()
        .expect("the mamba-train binary runs")
}

fn train(out: &Path, extra: &[&str]) -> Output {
    Command::new(bin())
        .arg("train")
        .args(SMALL)
        .args(extra)
        .arg("--out")
        .arg(out)
        .output()
        .expect("the mamba-train binary runs")
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn u16s(path: &Path) -> Vec<u32> {
    fs::read(path)
        .unwrap()
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
        .collect()
}

fn losses(run: &Path) -> Vec<f64> {
    fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

#[test]
fn tokenize_writes_files_that_decode_back_to_the_corpus() {
    let root = tempfile::tempdir().unwrap();
    let (dir, tok, docs) = corpus(root.path());
    let out = root.path().join("tokens");
    let o = tokenize(&["--tokenizer", p(&tok), "--out", p(&out)], &[&dir]);
    let stdout = ok(&o);
    assert!(
        stdout.contains("tokenized 6 documents") && stdout.contains("u16"),
        "{stdout}"
    );
    assert!(
        text(&o.stderr).is_empty(),
        "no bar without a terminal: {}",
        text(&o.stderr)
    );
    let meta: serde_json::Value =
        serde_json::from_slice(&fs::read(out.join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta["dtype"], "u16");
    assert_eq!(meta["eos"], 0);
    assert_eq!(
        fs::read(out.join("tokenizer.json")).unwrap(),
        fs::read(&tok).unwrap()
    );
    let (train, val) = (u16s(&out.join("train.bin")), u16s(&out.join("val.bin")));
    assert_eq!(meta["val"]["tokens"], val.len() as u64);
    let n = train.len() + val.len();
    assert_eq!(
        val.len(),
        (n as f64 * 0.01).ceil() as usize,
        "the default 1% tail"
    );
    // Decode the stream document by document (split at the EOS, id 0).
    let codec = mamba_train::data::Codec::from_file(&tok).unwrap();
    let stream = [train, val].concat();
    let decoded: Vec<String> = stream
        .split(|&t| t == 0)
        .filter(|d| !d.is_empty())
        .map(|d| codec.decode(d).unwrap())
        .collect();
    assert_eq!(
        decoded, docs,
        "train.bin + val.bin decode back to the corpus, in order"
    );
    assert_eq!(stream.last(), Some(&0), "every document ends with the EOS");
    assert!(
        stream.len() < docs.iter().map(String::len).sum::<usize>() / 2,
        "BPE merges"
    );
}

#[test]
fn tokenize_refuses_bad_inputs_naming_them() {
    let root = tempfile::tempdir().unwrap();
    let (dir, tok, _) = corpus(root.path());
    let out = root.path().join("tokens");
    let args = ["--tokenizer", p(&tok), "--out", p(&out)];
    let e = err(&tokenize(&args, &[&root.path().join("missing.txt")]));
    assert!(e.contains("INPUT") && e.contains("missing.txt"), "{e}");
    let empty = root.path().join("empty");
    fs::create_dir(&empty).unwrap();
    let e = err(&tokenize(&args, &[&empty]));
    assert!(
        e.contains("holds no text files") && e.contains("empty"),
        "{e}"
    );
    let e = err(&tokenize(
        &["--tokenizer", p(&dir), "--out", p(&out)],
        &[&dir],
    ));
    assert!(e.contains("--tokenizer"), "{e}");
    let e = err(&tokenize(&args, &[]));
    assert!(e.contains("INPUT"), "{e}");
    let e = err(&tokenize(
        &[&args[..], &["--token-dtype", "u8"]].concat(),
        &[&dir],
    ));
    assert!(e.contains("u8") && e.contains("u16 or u32"), "{e}");
    ok(&tokenize(&args, &[&dir]));
    let e = err(&tokenize(&args, &[&dir]));
    assert!(e.contains("--overwrite"), "{e}");
    ok(&tokenize(&[&args[..], &["--overwrite"]].concat(), &[&dir]));
}

#[test]
fn a_token_run_learns_is_deterministic_and_checkpoints_its_tokenizer() {
    let root = tempfile::tempdir().unwrap();
    let (dir, tok, _) = corpus(root.path());
    let data = root.path().join("tokens");
    ok(&tokenize(
        &[
            "--tokenizer",
            p(&tok),
            "--out",
            p(&data),
            "--val-fraction",
            "0.1",
        ],
        &[&dir],
    ));
    let flags = ["--task", "tokens", "--data", p(&data), "--steps", "40"];
    let a = root.path().join("a");
    let stdout = ok(&train(&a, &flags));
    assert!(stdout.contains("next-token positions"), "{stdout}");
    let b = root.path().join("b");
    assert_eq!(
        last_line_digest(&stdout),
        last_line_digest(&ok(&train(&b, &flags)))
    );
    let l = losses(&a);
    let (first, last) = (
        l[..5].iter().sum::<f64>() / 5.0,
        l[35..].iter().sum::<f64>() / 5.0,
    );
    assert!(last < 0.7 * first, "the loss falls: {first} -> {last}");
    // The checkpoint holds the tokenizer; its vocabulary is the tokenizer's
    // rounded up to a multiple of 8.
    let ck = a.join("checkpoints/step-00000040");
    assert_eq!(
        fs::read(ck.join("tokenizer.json")).unwrap(),
        fs::read(&tok).unwrap()
    );
    let hf: serde_json::Value =
        serde_json::from_slice(&fs::read(ck.join("config.json")).unwrap()).unwrap();
    let codec = mamba_train::data::Codec::from_file(&tok).unwrap();
    let vocab = hf["vocab_size"].as_u64().unwrap() as usize;
    assert!(vocab % 8 == 0 && vocab >= codec.vocab_size() && vocab < codec.vocab_size() + 8);
    let loaded = mamba_train::checkpoint::load(&ck).unwrap();
    let back = loaded
        .state
        .run
        .task
        .codec(loaded.tokenizer_json.as_deref(), &ck)
        .unwrap();
    assert_eq!(
        back.encode("mamba scan").unwrap(),
        codec.encode("mamba scan").unwrap()
    );
    // Stopped at 20 and resumed (the tokenizer read back from the
    // checkpoint's record), the run lands on the unbroken bits.
    let c = root.path().join("c");
    ok(&train(&c, &[&flags[..], &["--stop-at", "20"]].concat()));
    let resumed = Command::new(bin())
        .args(["train", "--resume", p(&c)])
        .output()
        .unwrap();
    assert_eq!(last_line_digest(&ok(&resumed)), last_line_digest(&stdout));
    // A resume with another tokenizer, or other data, is refused by name.
    let other_tok = root.path().join("other.json");
    train_tokenizer(
        &other_tok,
        &(500..700).map(corpus_line).collect::<Vec<_>>(),
        300,
    );
    let resume = |extra: &[&str]| {
        Command::new(bin())
            .args(["train", "--steps", "40", "--resume", p(&a)])
            .args(extra)
            .output()
            .unwrap()
    };
    let e = err(&resume(&["--tokenizer", p(&other_tok)]));
    assert!(e.contains("--tokenizer"), "{e}");
    let other = root.path().join("other-tokens");
    ok(&tokenize(
        &[
            "--tokenizer",
            p(&tok),
            "--out",
            p(&other),
            "--val-fraction",
            "0.2",
        ],
        &[&dir],
    ));
    let e = err(&resume(&["--data", p(&other)]));
    assert!(e.contains("--data (train.bin)"), "{e}");
}

#[test]
fn token_files_with_bad_contents_are_refused_naming_the_flag() {
    let root = tempfile::tempdir().unwrap();
    let d = root.path().join("bins");
    fs::create_dir(&d).unwrap();
    let write = |name: &str, ids: &[u16]| {
        let b: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
        fs::write(d.join(name), b).unwrap();
    };
    let ids: Vec<u16> = (0..25).map(|i| i % 50).collect();
    write("train.bin", &ids);
    let base = [
        "--task",
        "tokens",
        "--data",
        p(&d),
        "--steps",
        "2",
        "--vocab-size",
        "64",
    ];
    let e = err(&train(&root.path().join("r0"), &base));
    assert!(e.contains("val.bin"), "{e}");
    write("val.bin", &ids);
    ok(&train(&root.path().join("r1"), &base));
    // Without meta.json or a tokenizer the vocabulary must be given.
    let e = err(&train(&root.path().join("r2"), &base[..6]));
    assert!(e.contains("--vocab-size"), "{e}");
    // A token at or above the vocabulary, in the only training window.
    let mut bad = ids.clone();
    bad[10] = 999;
    write("train.bin", &bad);
    let e = err(&train(&root.path().join("r3"), &base));
    assert!(e.contains("token id 999") && e.contains("train.bin"), "{e}");
    // A truncated file.
    let mut odd: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    odd.pop();
    fs::write(d.join("train.bin"), odd).unwrap();
    let e = err(&train(&root.path().join("r4"), &base));
    assert!(
        e.contains("not a multiple of 2") && e.contains("--token-dtype"),
        "{e}"
    );
    // Flags that do not apply.
    let e = err(&train(
        &root.path().join("r5"),
        &[&base[..], &["--val-fraction", "0.2"]].concat(),
    ));
    assert!(e.contains("--val-fraction") && e.contains("val.bin"), "{e}");
    let e = err(&train(
        &root.path().join("r6"),
        &["--task", "induction", "--tokenizer", "x.json"],
    ));
    assert!(
        e.contains("--tokenizer is only used by --task text and --task tokens"),
        "{e}"
    );
}

#[test]
fn text_with_a_tokenizer_trains_and_checks_the_vocabulary() {
    let root = tempfile::tempdir().unwrap();
    let (dir, tok, _) = corpus(root.path());
    let flags = [
        "--task",
        "text",
        "--data",
        p(&dir),
        "--tokenizer",
        p(&tok),
        "--steps",
        "3",
    ];
    let stdout = ok(&train(&root.path().join("t"), &flags));
    assert!(stdout.contains("next-token positions"), "{stdout}");
    let e = err(&train(
        &root.path().join("u"),
        &[&flags[..], &["--vocab-size", "100"]].concat(),
    ));
    assert!(
        e.contains("--vocab-size") && e.contains("--tokenizer") && e.contains("100"),
        "{e}"
    );
    let bytes = [
        "--task",
        "text",
        "--data",
        p(&dir),
        "--steps",
        "1",
        "--vocab-size",
        "300",
    ];
    let e = err(&train(&root.path().join("v"), &bytes));
    assert!(e.contains("--vocab-size is for tokenized runs"), "{e}");
}

#[test]
fn a_token_run_gives_the_same_bits_on_one_and_two_processes() {
    let root = tempfile::tempdir().unwrap();
    let (dir, tok, _) = corpus(root.path());
    let data = root.path().join("tokens");
    ok(&tokenize(
        &[
            "--tokenizer",
            p(&tok),
            "--out",
            p(&data),
            "--val-fraction",
            "0.1",
        ],
        &[&dir],
    ));
    let flags = [
        "--task",
        "tokens",
        "--data",
        p(&data),
        "--steps",
        "4",
        "--logical-world",
        "2",
    ];
    let one = last_line_digest(&ok(&train(
        &root.path().join("p1"),
        &[&flags[..], &["--world", "1"]].concat(),
    )));
    let two = last_line_digest(&ok(&train(
        &root.path().join("p2"),
        &[&flags[..], &["--world", "2"]].concat(),
    )));
    assert_eq!(one, two, "P = 1 and P = 2 at L = 2");
    // Negative control: another L is another run.
    let l1 = [
        "--task",
        "tokens",
        "--data",
        p(&data),
        "--steps",
        "4",
        "--logical-world",
        "1",
    ];
    assert_ne!(
        one,
        last_line_digest(&ok(&train(&root.path().join("l1"), &l1)))
    );
}

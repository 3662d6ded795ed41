//! The `hf_logits` example (the Rust side of `scripts/hf_crosscheck.py`),
//! run in-process on the CPU: what it loads, what it computes and the file
//! it writes. The CUDA case runs where a GPU is found (else it skips, or
//! fails under `MAMBA_REQUIRE_GPU=1`).

#[allow(dead_code)] // the example's `main` and CLI-only items
#[path = "../examples/hf_logits.rs"]
mod hf_logits;

mod cuda_common;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use hf_logits::{Args, Device, Precision};
use mamba_train::checkpoint::hf_config::{hf_config_json, model_config_from_hf};
use mamba_train::checkpoint::tensors;
use mamba_train::config::{Arch, SsdConfig};
use mamba_train::model::cpu::{CpuModel, Mamba2Model};
use mamba_train::model::IGNORE;
use mamba_train::seed::Rng;
use mamba_train::{ModelConfig, ParamLayout};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::json;

/// A shape with every non-default the Hugging Face config can carry.
fn odd_config() -> ModelConfig {
    ModelConfig {
        vocab_size: 19,
        d_model: 12,
        n_layer: 2,
        d_state: 5,
        d_conv: 3,
        expand: 3,
        dt_rank: 4,
        arch: Default::default(),
    }
}

/// Reference init plus N(0, 0.1) noise, so norms and D are not all 1.
fn weights(cfg: &ModelConfig, seed: u64) -> Vec<f32> {
    let layout = ParamLayout::new(cfg);
    let mut r = Rng::new(seed);
    mamba_train::model::init::init_params(cfg, &layout, seed)
        .iter()
        .map(|&p| (p as f64 + 0.1 * r.normal()) as f32)
        .collect()
}

/// Write a directory the way transformers' `save_pretrained` does: its own
/// config keys (`transformers_version`, `use_mambapy`) besides ours, and,
/// with `head`, a stored `lm_head.weight`.
fn write_hf_dir(dir: &Path, cfg: &ModelConfig, params: &[f32], head: Option<&[f32]>) {
    fs::create_dir_all(dir).unwrap();
    let mut c = hf_config_json(cfg);
    let obj = c.as_object_mut().unwrap();
    obj.insert("transformers_version".into(), json!("5.17.0"));
    obj.insert("use_mambapy".into(), json!(false));
    obj.insert("layer_norm_epsilon".into(), json!(1e-5));
    fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&c).unwrap(),
    )
    .unwrap();
    let layout = ParamLayout::new(cfg);
    let bytes = match head {
        None => tensors::encode(&layout, &[("", params)], HashMap::new()).unwrap(),
        Some(h) => {
            let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = layout
                .entries()
                .iter()
                .map(|e| (e.name.clone(), e.shape.clone(), le(&params[e.range()])))
                .collect();
            owned.push((
                "lm_head.weight".into(),
                vec![cfg.vocab_size, cfg.d_model],
                le(h),
            ));
            let views: Vec<(String, TensorView<'_>)> = owned
                .iter()
                .map(|(n, s, b)| {
                    (
                        n.clone(),
                        TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
                    )
                })
                .collect();
            safetensors::serialize(views, None).unwrap()
        }
    };
    fs::write(dir.join("model.safetensors"), bytes).unwrap();
}

fn le(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.below(vocab as u64) as u32).collect()
}

fn write_tokens(path: &Path, tokens: &[u32]) {
    fs::write(
        path,
        tokens
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect::<Vec<u8>>(),
    )
    .unwrap();
}

fn args(ck: &Path, tokens: &Path, b: usize, t: usize, out: &Path) -> Args {
    Args {
        checkpoint: ck.to_path_buf(),
        tokens: tokens.to_path_buf(),
        batch: b,
        seq_len: t,
        device: Device::Cpu,
        cuda_device: 0,
        precision: Precision::F32,
        out: out.to_path_buf(),
    }
}

/// The output file, parsed: (logits as f64, their dtype and shape, loss, tokens, metadata).
struct Out {
    logits: Vec<f64>,
    dtype: Dtype,
    shape: Vec<usize>,
    loss: f64,
    tokens: Vec<u32>,
    meta: HashMap<String, String>,
}

fn read_out(path: &Path) -> Out {
    let bytes = fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta = header.metadata().clone().unwrap_or_default();
    assert_eq!(st.len(), 3, "logits, loss, tokens and nothing else");
    let l = st.tensor("logits").unwrap();
    let floats = |t: &TensorView<'_>| -> Vec<f64> {
        match t.dtype() {
            Dtype::F32 => t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64)
                .collect(),
            Dtype::F64 => t
                .data()
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            d => panic!("unexpected dtype {d:?}"),
        }
    };
    let loss_t = st.tensor("loss").unwrap();
    assert_eq!(loss_t.shape(), &[] as &[usize], "the loss is a scalar");
    assert_eq!(loss_t.dtype(), l.dtype(), "loss and logits share a dtype");
    let tok = st.tensor("tokens").unwrap();
    assert_eq!(tok.dtype(), Dtype::U32);
    Out {
        logits: floats(&l),
        dtype: l.dtype(),
        shape: l.shape().to_vec(),
        loss: floats(&loss_t)[0],
        tokens: tok
            .data()
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        meta,
    }
}

/// Mean over positions with a successor of `logsumexp(row) - row[next]`,
/// in f64: transformers' `labels = input_ids` loss, computed independently
/// from the written logits.
fn next_token_loss(logits: &[f64], tokens: &[u32], b: usize, t: usize, v: usize) -> f64 {
    let (mut sum, mut n) = (0.0, 0usize);
    for row in 0..b {
        for s in 0..t - 1 {
            let i = row * t + s;
            let lg = &logits[i * v..(i + 1) * v];
            let m = lg.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + lg.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            sum += lse - lg[tokens[i + 1] as usize];
            n += 1;
        }
    }
    sum / n as f64
}

#[test]
fn hugging_face_directory_scores_exactly_like_the_cpu_model() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = odd_config();
    let params = weights(&cfg, 3);
    let hf = dir.path().join("hf");
    write_hf_dir(&hf, &cfg, &params, None);
    let (b, t) = (3, 21);
    let toks = random_tokens(b * t, cfg.vocab_size, 9);
    let tok_path = dir.path().join("tokens.bin");
    write_tokens(&tok_path, &toks);

    let out = dir.path().join("out.safetensors");
    let s = hf_logits::run(&args(&hf, &tok_path, b, t, &out)).unwrap();
    assert_eq!(s.loaded.cfg, cfg, "the shape comes from config.json");
    assert_eq!(s.loaded.source, hf_logits::Source::HuggingFace);
    let o = read_out(&out);
    assert_eq!(o.dtype, Dtype::F32);
    assert_eq!(o.shape, vec![b, t, cfg.vocab_size]);
    assert_eq!(o.tokens, toks);
    assert_eq!(
        o.meta.get("source").map(String::as_str),
        Some("hugging-face")
    );
    assert_eq!(o.meta.get("device").map(String::as_str), Some("cpu"));
    assert_eq!(o.meta.get("precision").map(String::as_str), Some("f32"));

    // Bit for bit the CPU model's logits and loss on the next-token batch.
    let model = CpuModel::new(cfg.clone()).unwrap();
    let batch = hf_logits::next_token_batch(toks.clone(), b, t);
    let want = model.logits(&params, &batch).unwrap();
    assert_eq!(o.logits, want.iter().map(|&x| x as f64).collect::<Vec<_>>());
    assert_eq!(o.loss, model.loss(&params, &batch).unwrap() as f64);
    // And that loss is the labels = input_ids loss of the written logits.
    let recomputed = next_token_loss(&o.logits, &toks, b, t, cfg.vocab_size);
    assert!(
        (o.loss - recomputed).abs() < 1e-5 * (1.0 + recomputed.abs()),
        "{} vs {recomputed}",
        o.loss
    );

    // A stored tied head (what some writers do) changes nothing.
    let emb = params[ParamLayout::new(&cfg)
        .get("backbone.embeddings.weight")
        .unwrap()
        .range()]
    .to_vec();
    let with_head = dir.path().join("hf_head");
    write_hf_dir(&with_head, &cfg, &params, Some(&emb));
    let out2 = dir.path().join("out2.safetensors");
    hf_logits::run(&args(&with_head, &tok_path, b, t, &out2)).unwrap();
    let o2 = read_out(&out2);
    assert_eq!((o2.logits, o2.loss), (o.logits.clone(), o.loss));

    // Negative control: other weights give other logits.
    let other = dir.path().join("hf_other");
    write_hf_dir(&other, &cfg, &weights(&cfg, 4), None);
    let out3 = dir.path().join("out3.safetensors");
    hf_logits::run(&args(&other, &tok_path, b, t, &out3)).unwrap();
    assert_ne!(read_out(&out3).logits, o.logits);

    // f64: the CPU reference's f64 program, written as F64.
    let out64 = dir.path().join("out64.safetensors");
    let mut a64 = args(&hf, &tok_path, b, t, &out64);
    a64.precision = Precision::F64;
    hf_logits::run(&a64).unwrap();
    let o64 = read_out(&out64);
    assert_eq!(o64.dtype, Dtype::F64);
    let p64: Vec<f64> = params.iter().map(|&x| x as f64).collect();
    assert_eq!(o64.logits, model.logits_f64(&p64, &batch).unwrap());
    let max_diff = o64
        .logits
        .iter()
        .zip(&o.logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(max_diff > 0.0 && max_diff < 1e-4, "f32 vs f64: {max_diff}");
}

/// A Mamba-2 shape with groups (3 heads of 4 channels, 3 groups), a state
/// of 5 and chunks of 8 (a sequence of 21 ends in a partial chunk).
fn mamba2_config() -> ModelConfig {
    let mut c = ModelConfig::new(13, 6, 2);
    c.d_state = 5;
    c.d_conv = 3;
    c.arch = Arch::Mamba2(SsdConfig {
        head_dim: 4,
        n_groups: 3,
        chunk_size: 8,
    });
    c
}

#[test]
fn a_mamba2_directory_scores_exactly_like_the_mamba2_cpu_model() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = mamba2_config();
    let params = weights(&cfg, 5);
    let hf = dir.path().join("hf2");
    write_hf_dir(&hf, &cfg, &params, None);
    let (b, t) = (2, 21);
    let toks = random_tokens(b * t, cfg.vocab_size, 11);
    let tok_path = dir.path().join("tokens.bin");
    write_tokens(&tok_path, &toks);

    let out = dir.path().join("out.safetensors");
    let s = hf_logits::run(&args(&hf, &tok_path, b, t, &out)).unwrap();
    assert_eq!(
        s.loaded.cfg, cfg,
        "the Mamba-2 shape comes from config.json"
    );
    let o = read_out(&out);
    assert_eq!(o.shape, vec![b, t, cfg.vocab_size]);
    let model = Mamba2Model::new(cfg.clone()).unwrap();
    let batch = hf_logits::next_token_batch(toks.clone(), b, t);
    let want = model.logits(&params, &batch).unwrap();
    assert_eq!(o.logits, want.iter().map(|&x| x as f64).collect::<Vec<_>>());
    assert_eq!(o.loss, model.loss(&params, &batch).unwrap() as f64);
    let recomputed = next_token_loss(&o.logits, &toks, b, t, cfg.vocab_size);
    assert!((o.loss - recomputed).abs() < 1e-5 * (1.0 + recomputed.abs()));

    // f64: the Mamba-2 reference's f64 program.
    let out64 = dir.path().join("out64.safetensors");
    let mut a64 = args(&hf, &tok_path, b, t, &out64);
    a64.precision = Precision::F64;
    hf_logits::run(&a64).unwrap();
    let p64: Vec<f64> = params.iter().map(|&x| x as f64).collect();
    assert_eq!(
        read_out(&out64).logits,
        model.logits_f64(&p64, &batch).unwrap()
    );

    // Negative control: other weights, other logits.
    let other = dir.path().join("hf2_other");
    write_hf_dir(&other, &cfg, &weights(&cfg, 6), None);
    let out3 = dir.path().join("out3.safetensors");
    hf_logits::run(&args(&other, &tok_path, b, t, &out3)).unwrap();
    assert_ne!(read_out(&out3).logits, o.logits);
}

#[test]
fn targets_are_the_next_token_of_the_same_row() {
    let batch = hf_logits::next_token_batch(vec![5, 6, 7, 8, 9, 10], 2, 3);
    assert_eq!(batch.targets, vec![6, 7, IGNORE, 9, 10, IGNORE]);
    assert_eq!((batch.batch, batch.seq_len), (2, 3));
}

fn mamba_train_bin() -> PathBuf {
    std::env::var_os("MAMBA_TRAIN_BIN")
        .map(Into::into)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_mamba-train").into())
}

#[test]
fn a_checkpoint_written_by_the_cli_loads_verified() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let st = Command::new(mamba_train_bin())
        .args([
            "train",
            "--steps",
            "2",
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
            "--out",
        ])
        .arg(&run)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "mamba-train train failed:\n{}",
        String::from_utf8_lossy(&st.stderr)
    );
    // The run directory resolves to its LATEST checkpoint, digest verified.
    let ck = mamba_train::checkpoint::load(&run).unwrap();
    let loaded = hf_logits::load_model(&run).unwrap();
    assert_eq!(loaded.source, hf_logits::Source::MambaTrain);
    assert_eq!(loaded.dir, ck.dir);
    assert_eq!(loaded.params, ck.params);
    assert_eq!(loaded.cfg, ck.state.run.model);

    let (b, t) = (2, 12);
    let toks = random_tokens(b * t, loaded.cfg.vocab_size, 1);
    let tok_path = dir.path().join("tokens.bin");
    write_tokens(&tok_path, &toks);
    let out = dir.path().join("out.safetensors");
    hf_logits::run(&args(&run, &tok_path, b, t, &out)).unwrap();
    let o = read_out(&out);
    assert_eq!(
        o.meta.get("source").map(String::as_str),
        Some("mamba-train")
    );
    let model = CpuModel::new(loaded.cfg.clone()).unwrap();
    let batch = hf_logits::next_token_batch(toks, b, t);
    let want: Vec<f64> = model
        .logits(&ck.params, &batch)
        .unwrap()
        .iter()
        .map(|&x| x as f64)
        .collect();
    assert_eq!(o.logits, want);

    // A tampered weights file is refused (the digest is checked).
    let w = ck.dir.join("model.safetensors");
    let mut bytes = fs::read(&w).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    fs::write(&w, bytes).unwrap();
    let e = hf_logits::load_model(&run).unwrap_err();
    assert!(e.contains("digest"), "{e}");
}

#[test]
fn bad_inputs_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = odd_config();
    let params = weights(&cfg, 3);
    let hf = dir.path().join("hf");
    write_hf_dir(&hf, &cfg, &params, None);
    let tok_path = dir.path().join("tokens.bin");
    let out = dir.path().join("out.safetensors");

    // Wrong length, out-of-vocabulary id, empty shape.
    write_tokens(&tok_path, &random_tokens(7, cfg.vocab_size, 1));
    let e = hf_logits::run(&args(&hf, &tok_path, 2, 4, &out)).unwrap_err();
    assert!(e.contains("28 bytes, expected 32"), "{e}");
    let mut toks = random_tokens(8, cfg.vocab_size, 1);
    toks[5] = cfg.vocab_size as u32;
    write_tokens(&tok_path, &toks);
    let e = hf_logits::run(&args(&hf, &tok_path, 2, 4, &out)).unwrap_err();
    assert!(
        e.contains("row 1, position 1") && e.contains("vocabulary size 19"),
        "{e}"
    );
    let e = hf_logits::run(&args(&hf, &tok_path, 0, 4, &out)).unwrap_err();
    assert!(e.contains("at least one token"), "{e}");
    assert!(!out.exists(), "nothing is written on an error");

    // A directory with no model.
    let e = hf_logits::load_model(dir.path()).unwrap_err();
    assert!(e.contains("no model here"), "{e}");

    // f64 is CPU-only.
    write_tokens(&tok_path, &random_tokens(8, cfg.vocab_size, 1));
    let mut a = args(&hf, &tok_path, 2, 4, &out);
    a.device = Device::Cuda;
    a.precision = Precision::F64;
    let e = hf_logits::run(&a).unwrap_err();
    assert!(e.contains("CPU only"), "{e}");

    // A head that is not the embedding.
    let mut head = params[ParamLayout::new(&cfg)
        .get("backbone.embeddings.weight")
        .unwrap()
        .range()]
    .to_vec();
    head[3] += 0.5;
    let untied = dir.path().join("untied");
    write_hf_dir(&untied, &cfg, &params, Some(&head));
    let e = hf_logits::load_model(&untied).unwrap_err();
    assert!(e.contains("lm_head.weight differs"), "{e}");
}

#[test]
fn config_fields_the_model_hard_codes_are_checked() {
    let cfg = odd_config();
    let base = hf_config_json(&cfg);
    assert_eq!(model_config_from_hf(&base).unwrap(), cfg);
    // Absent fields take transformers' defaults, which are the model's.
    let mut v = base.clone();
    for k in ["layer_norm_epsilon", "hidden_act", "intermediate_size"] {
        v.as_object_mut().unwrap().remove(k);
    }
    assert_eq!(model_config_from_hf(&v).unwrap(), cfg);
    for (key, bad, needle) in [
        ("layer_norm_epsilon", json!(1e-6), "layer_norm_epsilon"),
        ("layer_norm_epsilon", json!("1e-5"), "layer_norm_epsilon"),
        ("hidden_act", json!("gelu"), "silu"),
        ("intermediate_size", json!(cfg.d_model * 2), "= 36"),
    ] {
        let mut v = base.clone();
        v[key] = bad;
        let e = model_config_from_hf(&v).unwrap_err();
        assert!(e.contains(needle), "{key}: {e}");
        // And a whole directory with that config.json is refused on load.
        let dir = tempfile::tempdir().unwrap();
        write_hf_dir(dir.path(), &cfg, &weights(&cfg, 1), None);
        fs::write(
            dir.path().join("config.json"),
            serde_json::to_vec(&v).unwrap(),
        )
        .unwrap();
        let e = hf_logits::load_model(dir.path()).unwrap_err();
        assert!(e.contains(key), "{key}: {e}");
    }
}

/// `cfg`'s random weights scored from an HF directory by `hf_logits` on
/// the CPU and on CUDA: the two agree elementwise within `1e-4 + 1e-4 |cpu|`
/// and the losses within `1e-5 (1 + |cpu|)`. Skips (printing why) without a
/// GPU.
fn cuda_scores_match_the_cpu(cfg: &ModelConfig, (b, t): (usize, usize)) {
    if cuda_common::cuda_model(cfg).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let params = weights(cfg, 5);
    let hf = dir.path().join("hf");
    write_hf_dir(&hf, cfg, &params, None);
    let toks = random_tokens(b * t, cfg.vocab_size, 2);
    let tok_path = dir.path().join("tokens.bin");
    write_tokens(&tok_path, &toks);
    let (cpu, gpu) = (
        dir.path().join("cpu.safetensors"),
        dir.path().join("gpu.safetensors"),
    );
    hf_logits::run(&args(&hf, &tok_path, b, t, &cpu)).unwrap();
    let mut a = args(&hf, &tok_path, b, t, &gpu);
    a.device = Device::Cuda;
    hf_logits::run(&a).unwrap();
    let (c, g) = (read_out(&cpu), read_out(&gpu));
    assert_eq!(g.meta.get("device").map(String::as_str), Some("cuda:0"));
    assert_eq!(g.shape, c.shape);
    for (i, (x, y)) in g.logits.iter().zip(&c.logits).enumerate() {
        assert!(
            (x - y).abs() <= 1e-4 + 1e-4 * y.abs(),
            "logit {i}: cuda {x} vs cpu {y}"
        );
    }
    assert!((g.loss - c.loss).abs() <= 1e-5 * (1.0 + c.loss.abs()));
}

#[test]
fn cuda_logits_match_the_cpu_model() {
    cuda_scores_match_the_cpu(&odd_config(), (2, 37));
}

/// Mamba-2 with three groups of B and C on CUDA (the chunked SSD kernels)
/// against the CPU reference, over a sequence past one 64-token chunk.
#[test]
fn cuda_logits_of_a_grouped_mamba2_match_the_cpu_model() {
    cuda_scores_match_the_cpu(&mamba2_config(), (2, 70));
}

/// The `hf_logits` binary: beside `mamba-train` in a bundle (`bin/`), or
/// the example cargo built beside this test (`target/<profile>/examples`).
fn hf_logits_bin() -> Option<PathBuf> {
    let beside_cli = mamba_train_bin().with_file_name("hf_logits");
    let beside_test = std::env::current_exe()
        .ok()
        .and_then(|t| Some(t.parent()?.parent()?.join("examples").join("hf_logits")));
    [Some(beside_cli), beside_test]
        .into_iter()
        .flatten()
        .find(|p| p.is_file())
}

/// `scripts/hf_crosscheck.py` in a checkout or a bundle (`scripts/`).
fn crosscheck_script() -> Option<PathBuf> {
    let checkout = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/hf_crosscheck.py");
    let bundle = mamba_train_bin()
        .parent()
        .and_then(Path::parent)
        .map(|b| b.join("scripts/hf_crosscheck.py"));
    [Some(checkout), bundle]
        .into_iter()
        .flatten()
        .find(|p| p.is_file())
}

/// The cross-check's own self-test, which needs no torch: our checkpoints
/// (Mamba-1 and Mamba-2, trained by the CLI) and transformers-style
/// directories scored by `hf_logits` against the script's independent f64
/// references (transformers' slow path for Mamba-1, a plain sequential
/// recurrence for Mamba-2), with a one-token negative control each and the
/// refusals. The script exits 1 when any check or control fails.
#[test]
fn the_python_references_agree_with_hf_logits_on_mamba1_and_mamba2() {
    let python = Command::new("python3").arg("--version").output();
    if !python.is_ok_and(|o| o.status.success()) {
        eprintln!("skipping: python3 is not on PATH (the cross-check script is Python)");
        return;
    }
    let (Some(hf), Some(script)) = (hf_logits_bin(), crosscheck_script()) else {
        eprintln!(
            "skipping: the hf_logits example or scripts/hf_crosscheck.py was not found \
             (cargo test builds the example; a bundle has both)"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new("python3")
        .arg(&script)
        .arg(&hf)
        .arg(mamba_train_bin())
        .arg(dir.path())
        .arg("--self-test-format")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "hf_crosscheck.py --self-test-format failed:\n{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for row in [
        "mamba2 trained: ours cpu f32 vs Python f64",
        "mamba2 HF-style dir: ours cpu f32 vs Python f64",
        "mamba2 trained: ours vs Python, 1 token altered",
        "trained: ours cpu f32 vs Python f64",
    ] {
        assert!(out.contains(row), "no row {row:?}:\n{out}");
    }
    assert!(out.contains("all 8 checks and controls passed"), "{out}");
}

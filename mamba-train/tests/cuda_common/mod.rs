//! Shared helpers of the CUDA tests (`tests/cuda_*.rs`): GPU detection that
//! skips with a printed reason (or fails under `MAMBA_REQUIRE_GPU=1`),
//! random configs and batches, and error measures. `model_gradcheck.rs`
//! (CPU only) uses its [`batch`] too.
#![allow(dead_code)] // each test crate uses a different part

use mamba_train::model::cuda::CudaModel;
use mamba_train::model::{Batch, IGNORE};
use mamba_train::seed::Rng;
use mamba_train::ModelConfig;

/// True when `MAMBA_REQUIRE_GPU=1`: a missing GPU is then a failure.
pub fn gpu_required() -> bool {
    std::env::var("MAMBA_REQUIRE_GPU").is_ok_and(|v| v.trim() == "1")
}

/// Why no GPU test can run here, or `None` when one can.
pub fn no_gpu_reason() -> Option<String> {
    if !kernels::driver_present() {
        return Some("no CUDA driver (libcuda.so.1 not loadable)".into());
    }
    match kernels::device_count() {
        Ok(0) => return Some("the CUDA driver reports no device".into()),
        Err(e) => return Some(format!("cannot count CUDA devices: {e}")),
        Ok(_) => {}
    }
    if !kernels::available() {
        return Some(format!(
            "this build has no CUDA kernels: {}",
            kernels::HOW_TO_GET_KERNELS
        ));
    }
    None
}

/// Device 0's context and the Mamba kernels loaded into it, for tests of
/// single kernels; `None` (printing `skipping: <reason>`) without a GPU,
/// a failure instead under `MAMBA_REQUIRE_GPU=1`.
pub fn kernels_on_device0() -> Option<(
    std::sync::Arc<cudarc::driver::CudaContext>,
    kernels::mamba::MambaKernels,
)> {
    if let Some(reason) = no_gpu_reason() {
        assert!(!gpu_required(), "MAMBA_REQUIRE_GPU=1 but {reason}");
        eprintln!("skipping: {reason}");
        return None;
    }
    let ctx = kernels::open_context(0).expect("open device 0");
    let k = kernels::mamba::MambaKernels::load(&ctx).expect("load the Mamba kernels");
    Some((ctx, k))
}

/// A tiny selective-copy model on the GPU for CLI tests: 2 blocks of width
/// 32, 8 rows of 32 tokens with 8 answers each, vocabulary 10.
pub const CUDA_TINY: &[&str] = &[
    "--device",
    "cuda",
    "--d-model",
    "32",
    "--layers",
    "2",
    "--batch",
    "8",
    "--seq-len",
    "32",
    "--memorize",
    "8",
    "--alphabet",
    "8",
    "--eval-batches",
    "1",
    "--comm-timeout",
    "60",
];

/// Under `MAMBA_REQUIRE_GPU=1`, whether a test that needs `need` GPUs must
/// fail on a machine with `have`: always without any GPU; with too few,
/// only when `MAMBA_REQUIRE_GPUS` (which `run.sh` sets to the machine's
/// GPU count) is at least `need`, or is unset. So the suite passes on one
/// GPU with the two-GPU tests skipped and named, and requires them where
/// two are present.
pub fn too_few_gpus_fail(need: usize, have: usize) -> bool {
    let demanded = std::env::var("MAMBA_REQUIRE_GPUS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(usize::MAX);
    have == 0 || demanded >= need
}

/// Why this machine cannot run a test of `need` GPUs (with NCCL usable
/// too when `nccl`, as every `--device cuda` CLI world needs), if it
/// cannot, and whether that fails the test under `MAMBA_REQUIRE_GPU=1`.
pub fn missing(need: usize, nccl: bool) -> Option<(String, bool)> {
    if let Some(r) = no_gpu_reason() {
        return Some((r, true));
    }
    match kernels::device_count() {
        Ok(n) if n >= need => {}
        Ok(n) => {
            return Some((
                format!(
                    "needs {need} GPU{}, {n} visible",
                    if need == 1 { "" } else { "s" }
                ),
                too_few_gpus_fail(need, n),
            ))
        }
        Err(e) => return Some((format!("cannot count CUDA devices: {e}"), true)),
    }
    if nccl {
        if let Err(e) = mamba_comm::nccl::preflight() {
            return Some((format!("NCCL is not usable: {e}"), true));
        }
    }
    None
}

/// True when the test can run; otherwise prints why it skips, or fails
/// under `MAMBA_REQUIRE_GPU=1` (see [`too_few_gpus_fail`]).
pub fn can_run(need: usize, nccl: bool) -> bool {
    match missing(need, nccl) {
        None => true,
        Some((why, fails)) => {
            assert!(!(fails && gpu_required()), "MAMBA_REQUIRE_GPU=1 but {why}");
            eprintln!("skipping: {why}");
            false
        }
    }
}

/// A model on device 0, or `None` after printing why the test is skipped.
/// Panics instead of skipping when `MAMBA_REQUIRE_GPU=1`.
pub fn cuda_model(cfg: &ModelConfig) -> Option<CudaModel> {
    if let Some(reason) = no_gpu_reason() {
        assert!(!gpu_required(), "MAMBA_REQUIRE_GPU=1 but {reason}");
        eprintln!("skipping: {reason}");
        return None;
    }
    match CudaModel::new(cfg.clone(), 0) {
        Ok(m) => Some(m),
        Err(e) => {
            assert!(
                !gpu_required(),
                "MAMBA_REQUIRE_GPU=1 but the CUDA model cannot start: {e}"
            );
            eprintln!("skipping: the CUDA model cannot start: {e}");
            None
        }
    }
}

/// A batch of `nseq` sequences of `l` random tokens; every 4th target (from
/// the second) is ignored, so the ignore path is always exercised.
pub fn batch(cfg: &ModelConfig, nseq: usize, l: usize, seed: u64) -> Batch {
    let mut r = Rng::new(seed);
    let v = cfg.vocab_size as u64;
    let tokens: Vec<u32> = (0..nseq * l).map(|_| r.below(v) as u32).collect();
    let targets: Vec<i32> = (0..nseq * l)
        .map(|i| {
            if i % 4 == 1 {
                IGNORE
            } else {
                r.below(v) as i32
            }
        })
        .collect();
    Batch {
        tokens,
        targets,
        batch: nseq,
        seq_len: l,
    }
}

/// Reference init plus N(0, 0.1) noise, so that no gradient path sits at a
/// special point (norm weights exactly 1, D exactly 1, A_log = ln n).
pub fn perturbed(cfg: &ModelConfig, seed: u64) -> Vec<f32> {
    let layout = mamba_train::ParamLayout::new(cfg);
    let mut r = Rng::new(seed ^ 0x5eed);
    mamba_train::model::init::init_params(cfg, &layout, seed)
        .iter()
        .map(|&p| (p as f64 + 0.1 * r.normal()) as f32)
        .collect()
}

/// `||got - want|| / ||want||` (L2, in f64; `||want|| = 0` compares the
/// absolute norm), and whether `got` holds a non-finite value.
pub fn rel_l2(got: &[f32], want: &[f64]) -> (f64, bool) {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den, mut bad) = (0.0f64, 0.0f64, false);
    for (&g, &w) in got.iter().zip(want) {
        bad |= !g.is_finite();
        num += (g as f64 - w) * (g as f64 - w);
        den += w * w;
    }
    let err = if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    };
    (err, bad)
}

/// A random model shape and batch for the parity sweep: vocab 2..=80,
/// d_model 4..=40, 1..=3 layers, d_state 1..=64, d_conv 1..=5, expand
/// 1..=3, dt_rank 1..=6, 1..=3 sequences of 1..=45 tokens (so lengths that
/// are not a multiple of the scan's chunk of 16 are the common case).
pub fn random_case(seed: u64) -> (ModelConfig, usize, usize) {
    let mut r = Rng::new(seed);
    let mut pick = |lo: u64, hi: u64| (lo + r.below(hi - lo + 1)) as usize;
    let cfg = ModelConfig {
        vocab_size: pick(2, 80),
        d_model: pick(4, 40),
        n_layer: pick(1, 3),
        d_state: pick(1, 64),
        d_conv: pick(1, 5),
        expand: pick(1, 3),
        dt_rank: pick(1, 6),
        arch: Default::default(),
    };
    (cfg, pick(1, 3), pick(1, 45))
}

/// SHA-256 of the little-endian bytes of `v`, as hex.
pub fn digest(v: &[f32]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for x in v {
        h.update(x.to_le_bytes());
    }
    hex::encode(h.finalize())
}

/// Decoder logits `[l, vocab]` of `toks` fed one by one after a reset,
/// checking the position and the state size at every step (the CPU decode
/// tests of both architectures, `decode_parity.rs` and `mamba2_decode.rs`).
pub fn decode(dec: &mut dyn mamba_train::model::Decoder, toks: &[u32]) -> Vec<f32> {
    let cfg = dec.config().clone();
    dec.reset().unwrap();
    let mut out = Vec::new();
    for (i, &t) in toks.iter().enumerate() {
        assert_eq!(dec.position(), i as u64);
        out.extend_from_slice(dec.step(t).unwrap());
        let st = dec.snapshot().unwrap();
        assert_eq!(
            st.len(),
            mamba_train::model::DecodeState::len_for(&cfg),
            "state size at position {i} is not the shape's constant"
        );
    }
    out
}

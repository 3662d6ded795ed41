//! The CUDA model against the CPU reference, on the GPU: logits, loss and
//! every gradient tensor by name, over fixed edge-case shapes and a seeded
//! random sweep. Skips (printing why) without a GPU unless
//! `MAMBA_REQUIRE_GPU=1`.
//!
//! Reference: the CPU model's f64 program (same equations, same layout), so
//! the measured error is the CUDA path's own f32 error. The CPU's f32 error
//! against the same reference is printed next to it for scale.
//!
//! Tolerances, relative L2 (`||gpu - ref|| / ||ref||`), per quantity: the
//! GPU's f32 error may be at most 8x the CPU's own f32 error on the same
//! quantity (both programs round the same operations, in different orders:
//! cuBLAS blocking, the scan's sums over states and channels, fixed-tree column
//! sums), and never needs to be below a floor:
//! - logits: floor 5e-6 (observed ~2e-7 in a CPU emulation of the kernels);
//! - loss: floor 5e-6 relative (one fixed-order mean of per-row losses);
//! - every gradient tensor: floor 2e-5 (observed <= 2e-6; the CPU's own
//!   f32 error is 3e-7..4e-6 on the same tensors). A wrong formula or index
//!   gives O(1); the negative control below (one `A_log` entry moved by 0.2)
//!   gives ~2e-4 on the affected tensors.
//!
//! A non-finite value anywhere fails regardless.

mod cuda_common;

use cuda_common::{batch, cuda_model, perturbed, random_case, rel_l2};
use mamba_train::model::cpu::CpuModel;
use mamba_train::model::cuda::CudaModel;
use mamba_train::model::Batch;
use mamba_train::ModelConfig;

const FLOOR_LOGITS: f64 = 5e-6;
const FLOOR_LOSS: f64 = 5e-6;
const FLOOR_GRAD: f64 = 2e-5;
/// How many times the CPU's own f32 error the GPU may reach.
const CPU_FACTOR: f64 = 8.0;

fn tol(floor: f64, cpu_err: f64) -> f64 {
    floor.max(CPU_FACTOR * cpu_err)
}

/// One quantity that missed its tolerance.
#[derive(Debug)]
struct Miss {
    what: String,
    err: f64,
    tol: f64,
    non_finite: bool,
}

/// Compare the CUDA model (running `gpu_params`) with the CPU f64 program
/// (running `ref_params`); returns every miss and prints a one-line summary
/// plus the worst gradient tensors.
fn compare(
    gpu: &mut CudaModel,
    cfg: &ModelConfig,
    b: &Batch,
    gpu_params: &[f32],
    ref_params: &[f32],
    label: &str,
) -> Vec<Miss> {
    let cpu = CpuModel::new(cfg.clone()).expect("valid config");
    let p64: Vec<f64> = ref_params.iter().map(|&x| x as f64).collect();
    let n = p64.len();
    let mut misses = Vec::new();
    let miss = |misses: &mut Vec<Miss>, what: String, (err, non_finite): (f64, bool), tol: f64| {
        if non_finite || err > tol || err.is_nan() {
            misses.push(Miss {
                what,
                err,
                tol,
                non_finite,
            });
        }
    };

    // Logits.
    let want = cpu.logits_f64(&p64, b).expect("cpu logits");
    let got = gpu.logits_host(gpu_params, b).expect("gpu logits");
    let logits_err = rel_l2(&got, &want);
    let cpu_logits_err = rel_l2(&cpu.logits(ref_params, b).expect("cpu f32 logits"), &want).0;
    miss(
        &mut misses,
        "logits".into(),
        logits_err,
        tol(FLOOR_LOGITS, cpu_logits_err),
    );

    // Loss and gradients (poisoned first: every element must be written).
    let mut g64 = vec![0.0f64; n];
    let loss64 = cpu
        .forward_backward_f64(&p64, b, &mut g64)
        .expect("cpu f64 backward");
    let mut g32cpu = vec![0.0f32; n];
    let loss32 = cpu
        .forward_backward(ref_params, b, &mut g32cpu)
        .expect("cpu f32 backward");
    let cpu_loss_err = (loss32 as f64 - loss64).abs() / loss64.abs().max(1e-12);
    let mut ggpu = vec![f32::NAN; n];
    let p_dev = gpu.upload(gpu_params).expect("upload");
    let mut g_dev = gpu.upload(&ggpu).expect("upload poisoned grads");
    let loss = gpu
        .forward_backward(&p_dev, b, &mut g_dev)
        .expect("gpu backward");
    ggpu.copy_from_slice(&gpu.download(&g_dev).expect("download grads"));
    let loss_err = (
        (loss as f64 - loss64).abs() / loss64.abs().max(1e-12),
        !loss.is_finite(),
    );
    miss(
        &mut misses,
        "loss".into(),
        loss_err,
        tol(FLOOR_LOSS, cpu_loss_err),
    );
    let loss_only = gpu.loss(&p_dev, b).expect("gpu loss");
    if loss_only.to_bits() != loss.to_bits() {
        misses.push(Miss {
            what: format!("loss() = {loss_only} but forward_backward() = {loss}: the two paths must agree bit for bit"),
            err: f64::INFINITY,
            tol: 0.0,
            non_finite: false,
        });
    }

    let mut worst: Vec<(f64, f64, String)> = Vec::new();
    for e in gpu.layout().entries() {
        let r = e.range();
        let (err, bad) = rel_l2(&ggpu[r.clone()], &g64[r.clone()]);
        let (cpu_err, _) = rel_l2(&g32cpu[r.clone()], &g64[r.clone()]);
        worst.push((err, cpu_err, e.name.clone()));
        miss(
            &mut misses,
            format!("grad {}", e.name),
            (err, bad),
            tol(FLOOR_GRAD, cpu_err),
        );
    }
    worst.sort_by(|a, b| b.0.total_cmp(&a.0));
    eprintln!(
        "{label}: loss {loss:.6} (ref {loss64:.6}), logits err {:.2e}, worst grads: {}",
        logits_err.0,
        worst
            .iter()
            .take(3)
            .map(|(g, c, name)| format!("{name} {g:.2e} (cpu f32 {c:.2e})"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    misses
}

fn fail_on(misses: &[(String, Vec<Miss>)]) {
    let lines: Vec<String> = misses
        .iter()
        .flat_map(|(case, ms)| {
            ms.iter().map(move |m| {
                format!(
                    "  {case}: {}: relative error {:.3e} > tolerance {:.1e}{}",
                    m.what,
                    m.err,
                    m.tol,
                    if m.non_finite {
                        " (non-finite values: an element was not written or overflowed)"
                    } else {
                        ""
                    }
                )
            })
        })
        .collect();
    assert!(
        lines.is_empty(),
        "CUDA model disagrees with the CPU reference:\n{}",
        lines.join("\n")
    );
}

/// Fixed shapes for the edges: T not a multiple of the chunk (16), d_state
/// 64 and 33 (more than one warp per channel, ragged lanes), d_state 1,
/// batch 1, T = 1, conv width 1 and 3, expand 1, > 256 rows (several
/// column-sum slabs), and d_inner 512 (several backward channel rounds).
fn fixed_cases() -> Vec<(String, ModelConfig, usize, usize)> {
    let c = |v, d, l, n, k, e, r| ModelConfig {
        vocab_size: v,
        d_model: d,
        n_layer: l,
        d_state: n,
        d_conv: k,
        expand: e,
        dt_rank: r,
        arch: Default::default(),
    };
    vec![
        ("defaults, T 37".into(), ModelConfig::new(50, 32, 2), 2, 37),
        (
            "d_state 64, batch 1".into(),
            c(31, 16, 1, 64, 4, 2, 3),
            1,
            20,
        ),
        (
            "d_state 33, conv 3".into(),
            c(64, 24, 3, 33, 3, 2, 2),
            3,
            16,
        ),
        (
            "d_state 1, T 1, batch 1".into(),
            c(20, 8, 2, 1, 4, 2, 1),
            1,
            1,
        ),
        ("conv 1, expand 1".into(), c(17, 12, 2, 8, 1, 1, 2), 2, 33),
        ("300 rows".into(), c(40, 8, 1, 16, 4, 2, 1), 2, 150),
        ("d_inner 512".into(), ModelConfig::new(100, 256, 1), 2, 40),
        // 69 chunks: two time segments of the scan (64 + 5 chunks).
        (
            "T 1100, two scan segments".into(),
            c(40, 8, 1, 16, 4, 2, 1),
            1,
            1100,
        ),
    ]
}

#[test]
fn cuda_matches_cpu_reference_on_edge_shapes() {
    let mut failures = Vec::new();
    for (i, (label, cfg, nseq, l)) in fixed_cases().into_iter().enumerate() {
        let Some(mut gpu) = cuda_model(&cfg) else {
            return;
        };
        let b = batch(&cfg, nseq, l, 100 + i as u64);
        let p = perturbed(&cfg, 200 + i as u64);
        let label = format!("{label} ({cfg:?}, batch {nseq}, T {l})");
        let m = compare(&mut gpu, &cfg, &b, &p, &p, &label);
        failures.push((label, m));
    }
    fail_on(&failures);
}

#[test]
fn cuda_matches_cpu_reference_on_random_shapes() {
    let mut failures = Vec::new();
    for seed in 0..12u64 {
        let (cfg, nseq, l) = random_case(0xC0DA + seed);
        let Some(mut gpu) = cuda_model(&cfg) else {
            return;
        };
        let b = batch(&cfg, nseq, l, seed);
        let p = perturbed(&cfg, seed);
        let label = format!("random case {seed} ({cfg:?}, batch {nseq}, T {l})");
        let m = compare(&mut gpu, &cfg, &b, &p, &p, &label);
        failures.push((label, m));
    }
    fail_on(&failures);
}

/// The head and the loss over row chunks (`set_loss_chunk_rows`): chunks of
/// 1 row, of a size that does not divide the rows, and one chunk, each
/// within the same tolerances of the CPU reference (logits, loss, every
/// gradient; loss() and forward_backward() bit for bit), the same bits run
/// to run, and the logits buffer sized by the chunk, not the batch.
#[test]
fn the_loss_over_row_chunks_matches_the_cpu_reference() {
    let mut failures = Vec::new();
    for (i, (label, cfg, nseq, l)) in fixed_cases().into_iter().enumerate() {
        if !matches!(i, 0 | 5) {
            continue; // "defaults, T 37" (74 rows) and "300 rows"
        }
        let Some(mut gpu) = cuda_model(&cfg) else {
            return;
        };
        let b = batch(&cfg, nseq, l, 100 + i as u64);
        let p = perturbed(&cfg, 200 + i as u64);
        let rows = nseq * l;
        let p_dev = gpu.upload(&p).expect("upload");
        let mut g_dev = gpu.zeros_arena().expect("grads");
        let mut bytes = Vec::new();
        for chunk in [1, 7, rows] {
            gpu.set_loss_chunk_rows(chunk);
            assert_eq!(gpu.loss_chunk_rows(), chunk);
            let label = format!("{label}, loss chunks of {chunk} rows");
            failures.push((label.clone(), compare(&mut gpu, &cfg, &b, &p, &p, &label)));
            let first = gpu.forward_backward(&p_dev, &b, &mut g_dev).expect("step");
            let g1 = gpu.download(&g_dev).expect("grads");
            let again = gpu.forward_backward(&p_dev, &b, &mut g_dev).expect("step");
            let g2 = gpu.download(&g_dev).expect("grads");
            assert_eq!(first.to_bits(), again.to_bits(), "{label}: loss run to run");
            assert!(
                g1.iter().zip(&g2).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{label}: gradients run to run"
            );
            bytes.push(gpu.workspace_bytes());
        }
        // Only the logits buffer depends on the chunk: (7 - 1) and
        // (rows - 7) rows of vocab f32s more each time.
        let v = cfg.vocab_size * 4;
        assert_eq!(bytes[1] - bytes[0], 6 * v, "{label}: {bytes:?}");
        assert_eq!(bytes[2] - bytes[1], (rows - 7) * v, "{label}: {bytes:?}");
    }
    fail_on(&failures);
}

/// Two layouts of the workspace that must not change a bit: `--recompute`
/// (one block's activations, the others recomputed in the backward) and,
/// in bf16, the shared bf16 copies of the GEMM operands (against each GEMM
/// casting its own). In f32 and bf16, with loss chunks smaller than the
/// batch: the loss and every gradient the same bits as the plain layout,
/// over two steps (a kept workspace is reused), with less workspace memory
/// for recompute. Negative control: another batch changes the gradients
/// (so equal bits are not equal zeros).
#[test]
fn recompute_and_bf16_copies_keep_every_bit() {
    use mamba_train::config::Precision;
    let cfg = ModelConfig::new(60, 32, 3);
    if cuda_model(&cfg).is_none() {
        return;
    }
    let (b, other) = (batch(&cfg, 3, 29, 17), batch(&cfg, 3, 29, 18));
    let p = perturbed(&cfg, 19);
    for precision in [Precision::F32, Precision::Bf16] {
        let mut gpu = CudaModel::new_in(cfg.clone(), precision, 0).expect("model");
        gpu.set_loss_chunk_rows(40);
        let p_dev = gpu.upload(&p).expect("upload");
        let mut g_dev = gpu.zeros_arena().expect("grads");
        let mut step = |gpu: &mut CudaModel, b: &Batch| {
            let loss = gpu.forward_backward(&p_dev, b, &mut g_dev).expect("step");
            let g = gpu.download(&g_dev).expect("grads");
            (
                loss.to_bits(),
                g.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            )
        };
        let plain = step(&mut gpu, &b);
        let plain_bytes = gpu.workspace_bytes();
        assert!(
            plain.1.iter().any(|&x| x != 0),
            "{precision}: all-zero gradients"
        );
        assert_ne!(
            step(&mut gpu, &other).1,
            plain.1,
            "{precision}: another batch"
        );
        let mut layouts = vec![(true, true)];
        if precision == Precision::Bf16 {
            layouts.extend([(false, false), (true, false)]);
        }
        for (recompute, copies) in layouts {
            gpu.set_recompute(recompute);
            gpu.set_bf16_copies(copies);
            let label = format!("{precision}, recompute {recompute}, bf16 copies {copies}");
            for run in 0..2 {
                let got = step(&mut gpu, &b);
                assert_eq!(got.0, plain.0, "{label}: loss bits (pass {run})");
                let first = got.1.iter().zip(&plain.1).position(|(x, y)| x != y);
                assert_eq!(
                    first, None,
                    "{label}: first differing gradient (pass {run})"
                );
            }
            if recompute {
                let bytes = gpu.workspace_bytes();
                println!("{label}: workspace {bytes} bytes, {plain_bytes} without recompute");
                assert!(bytes < plain_bytes, "{label}: {bytes} >= {plain_bytes}");
            }
        }
    }
}

#[test]
fn the_comparison_catches_a_small_deviation() {
    // Negative control: the GPU runs parameters with one A_log entry of the
    // last layer moved by 0.2; the comparison against the unmodified
    // reference must flag it (so passing parity is not vacuous).
    let cfg = ModelConfig {
        d_state: 16,
        ..ModelConfig::new(40, 16, 2)
    };
    let Some(mut gpu) = cuda_model(&cfg) else {
        return;
    };
    let b = batch(&cfg, 2, 21, 5);
    let p = perturbed(&cfg, 6);
    let mut q = p.clone();
    let a_log = gpu
        .layout()
        .get("backbone.layers.1.mixer.A_log")
        .expect("A_log")
        .offset;
    q[a_log + 3] += 0.2;
    let misses = compare(&mut gpu, &cfg, &b, &q, &p, "negative control");
    assert!(
        !misses.is_empty(),
        "moving one A_log entry by 0.2 went unnoticed by every check"
    );
    eprintln!(
        "negative control flagged: {:?}",
        misses.iter().map(|m| &m.what).collect::<Vec<_>>()
    );
}

#[test]
fn empty_and_all_ignored_batches_give_zero_like_the_cpu() {
    let cfg = ModelConfig::new(30, 16, 1);
    let Some(mut gpu) = cuda_model(&cfg) else {
        return;
    };
    let p = gpu.init_params(1).expect("init");
    let n = gpu.layout().len();
    let mut g = gpu.upload(&vec![f32::NAN; n]).expect("upload");
    let mut b = batch(&cfg, 2, 9, 1);
    b.targets
        .iter_mut()
        .for_each(|t| *t = mamba_train::model::IGNORE);
    assert_eq!(
        gpu.forward_backward(&p, &b, &mut g).expect("all ignored"),
        0.0
    );
    assert!(
        gpu.download(&g)
            .expect("download")
            .iter()
            .all(|&x| x == 0.0),
        "grads must be zeroed"
    );
    let empty = Batch {
        tokens: vec![],
        targets: vec![],
        batch: 0,
        seq_len: 5,
    };
    assert_eq!(
        gpu.forward_backward(&p, &empty, &mut g).expect("empty"),
        0.0
    );
    assert!(gpu.logits(&p, &empty).expect("empty logits").is_empty());
}

#[test]
fn bad_batches_and_arenas_are_refused_before_any_launch() {
    let cfg = ModelConfig::new(30, 16, 1);
    let Some(mut gpu) = cuda_model(&cfg) else {
        return;
    };
    let p = gpu.init_params(1).expect("init");
    let mut g = gpu.zeros_arena().expect("zeros");
    let mut b = batch(&cfg, 1, 4, 1);
    b.tokens[2] = 30;
    let e = gpu
        .forward_backward(&p, &b, &mut g)
        .unwrap_err()
        .to_string();
    assert!(e.contains("token 30 at position 2"), "{e}");
    let mut b = batch(&cfg, 1, 4, 1);
    b.targets[0] = -3;
    let e = gpu
        .forward_backward(&p, &b, &mut g)
        .unwrap_err()
        .to_string();
    assert!(e.contains("target -3 at position 0"), "{e}");
    let e = gpu.upload(&[0.0; 3]).unwrap_err().to_string();
    assert!(e.contains("has 3 elements"), "{e}");
}

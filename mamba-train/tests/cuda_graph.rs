//! The training pass replayed as a CUDA graph (`CudaModel::set_cuda_graph`)
//! gives the eager pass's bits: over batches that change every pass (tokens,
//! the number of distinct tokens, the number of counted targets), in each
//! precision, with `--recompute`, and over two gradient arenas used in turn;
//! the graph is really replayed (captures and replays counted), and it
//! reads each new batch (consecutive batches' digests differ). Skips
//! (printing why) without a GPU unless `MAMBA_REQUIRE_GPU=1`.

mod cuda_common;

use cuda_common::{batch, digest, gpu_required, no_gpu_reason, perturbed};
use cudarc::driver::CudaSlice;
use mamba_train::model::cuda::{CudaModel, GraphStats, Precision};
use mamba_train::model::{Batch, IGNORE};
use mamba_train::ModelConfig;

/// Several scan chunks and backward channel rounds: d_inner 256.
fn cfg() -> ModelConfig {
    ModelConfig::new(300, 128, 2)
}

/// A model on a stream of its own in a context of its own (a graph cannot
/// capture the legacy default stream), with the graph on or off.
fn model(cfg: &ModelConfig, precision: Precision, graph: bool) -> Option<CudaModel> {
    if let Some(reason) = no_gpu_reason() {
        assert!(!gpu_required(), "MAMBA_REQUIRE_GPU=1 but {reason}");
        eprintln!("skipping: {reason}");
        return None;
    }
    let ctx = kernels::open_context(0).expect("open device 0");
    let stream = ctx.new_stream().expect("a stream");
    let mut m = CudaModel::with_stream_in(cfg.clone(), precision, stream).expect("model");
    // SAFETY: the test uses each model's buffers on its own stream only.
    unsafe { m.set_cuda_graph(graph).expect("graph setting") };
    Some(m)
}

/// Batch `i` of a sequence whose every element differs: other tokens, and
/// a number of ignored targets that grows with `i` (so the count the loss
/// divides by changes).
fn nth_batch(cfg: &ModelConfig, i: usize) -> Batch {
    let mut b = batch(cfg, 2, 150, 100 + i as u64);
    for t in b.targets.iter_mut().take(7 * i) {
        *t = IGNORE;
    }
    if i % 2 == 1 {
        // Fewer distinct tokens: the padded CSR's real rows change too.
        for t in b.tokens.iter_mut().step_by(3) {
            *t = 5;
        }
    }
    b
}

/// Loss bits and gradient digest of one pass into `grads`.
fn pass(
    m: &mut CudaModel,
    p: &CudaSlice<f32>,
    b: &Batch,
    grads: &mut CudaSlice<f32>,
) -> (u32, String) {
    let loss = m.forward_backward(p, b, grads).expect("forward_backward");
    (
        loss.to_bits(),
        digest(&m.download(grads).expect("download")),
    )
}

/// `passes` passes of the graph model and the eager model over the same
/// batches, the graph model alternating between `arenas` gradient arenas;
/// the two agree bit for bit every pass. Returns the graph model's stats.
fn compare(
    precision: Precision,
    recompute: bool,
    passes: usize,
    arenas: usize,
) -> Option<GraphStats> {
    let cfg = cfg();
    let mut eager = model(&cfg, precision, false)?;
    let mut graph = model(&cfg, precision, true)?;
    eager.set_recompute(recompute);
    graph.set_recompute(recompute);
    let host = perturbed(&cfg, 3);
    let (pe, pg) = (eager.upload(&host).unwrap(), graph.upload(&host).unwrap());
    let mut ge = eager.zeros_arena().unwrap();
    let mut gg: Vec<_> = (0..arenas).map(|_| graph.zeros_arena().unwrap()).collect();
    let mut previous: Option<String> = None;
    for i in 0..passes {
        let b = nth_batch(&cfg, i);
        let want = pass(&mut eager, &pe, &b, &mut ge);
        let got = pass(&mut graph, &pg, &b, &mut gg[i % arenas]);
        assert_eq!(
            got,
            want,
            "{precision} recompute={recompute}: pass {i} with the graph ({:?}) differs from \
             the eager pass",
            graph.graph_stats()
        );
        // Negative control: each batch's gradient is its own, so a graph
        // that replayed stale inputs could not match the eager pass.
        assert_ne!(
            previous.as_ref(),
            Some(&want.1),
            "batches {i} and {} gave one digest",
            i.max(1) - 1
        );
        previous = Some(want.1);
    }
    assert_eq!(
        eager.graph_stats(),
        GraphStats::default(),
        "the eager model replayed a graph"
    );
    Some(graph.graph_stats())
}

#[test]
fn graph_replays_give_the_eager_bits_in_every_precision() {
    for precision in [Precision::F32, Precision::Tf32, Precision::Bf16] {
        let Some(stats) = compare(precision, false, 5, 1) else {
            return;
        };
        // Pass 0 eager, pass 1 captured and replayed, passes 2..5 replayed.
        assert_eq!(
            stats,
            GraphStats {
                captures: 1,
                replays: 4
            },
            "{precision}"
        );
    }
}

#[test]
fn graph_replays_give_the_eager_bits_with_recompute() {
    let Some(stats) = compare(Precision::Bf16, true, 4, 1) else {
        return;
    };
    assert_eq!(
        stats,
        GraphStats {
            captures: 1,
            replays: 3
        }
    );
}

#[test]
fn each_gradient_arena_gets_its_own_graph() {
    // Arenas used in turn (a trainer's micro-batches): each is eager once,
    // then captured, then replayed.
    let Some(stats) = compare(Precision::Bf16, false, 8, 2) else {
        return;
    };
    assert_eq!(
        stats,
        GraphStats {
            captures: 2,
            replays: 6
        }
    );
}

#[test]
fn the_default_stream_cannot_capture() {
    let cfg = cfg();
    let Some(mut m) = cuda_common::cuda_model(&cfg) else {
        return;
    };
    // SAFETY: refused before it changes anything.
    let e = unsafe { m.set_cuda_graph(true) }.unwrap_err().to_string();
    assert!(e.contains("stream of its own"), "{e}");
    assert!(!m.cuda_graph());
}

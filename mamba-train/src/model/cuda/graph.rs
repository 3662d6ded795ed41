//! The training pass (`forward_backward`'s device work) captured once as a
//! CUDA graph and replayed for every later batch of the same shape.
//!
//! What makes a replay the eager pass: every kernel and GEMM the pass
//! enqueues has the same arguments for every batch of one shape, because
//! everything that varies with the batch lives in device buffers the
//! workspace owns and every pass uploads into (tokens, targets, the token
//! CSR padded to the shape's capacity, the loss scale: `workspace`'s
//! docs). So the graph is the eager pass's launches, in order, on the same
//! addresses, and gives the same bits (the GPU test `cuda_graph` compares
//! losses and every gradient bit with the eager pass over changing batches).
//!
//! What the graph is captured against ([`Key`]): the parameter and
//! gradient arenas' and the bf16 weight copy's addresses. A call with other
//! arenas has a graph of its own (up to [`MAX_GRAPHS`]: a trainer's
//! micro-batches write distinct arenas); the graphs are kept in the
//! workspace, so a new batch shape or workspace layout drops them. The first call with a key runs
//! eagerly: the GEMMs choose their algorithms and allocate their operand
//! buffers there, outside any capture, so the capture allocates nothing.
//!
//! Why capture needs cudarc's event tracking off ([`super::CudaModel::set_cuda_graph`]
//! is `unsafe` for that reason): with it on, every launch first makes the
//! stream wait on each argument's last-use event, and waiting inside a
//! capture on an event recorded outside it is an error
//! (`CUDA_ERROR_STREAM_CAPTURE_ISOLATION`).

use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, DevicePtr};

use crate::error::{Result, TrainError};

/// The addresses a captured pass reads and writes outside the workspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Key {
    params: u64,
    grads: u64,
    params_bf16: u64,
}

impl Key {
    pub(super) fn of(
        stream: &CudaStream,
        params: &CudaSlice<f32>,
        grads: &CudaSlice<f32>,
        params_bf16: Option<&CudaSlice<u16>>,
    ) -> Key {
        Key {
            params: params.device_ptr(stream).0,
            grads: grads.device_ptr(stream).0,
            params_bf16: params_bf16.map_or(0, |p| p.device_ptr(stream).0),
        }
    }
}

/// Graphs one workspace keeps at most: one per gradient arena a trainer
/// cycles through (its micro-batches' arenas, or the fold tree's spares),
/// each holding only launch records, no buffers. Past it, the oldest is
/// dropped.
const MAX_GRAPHS: usize = 16;

/// The graph state a workspace keeps: the keys whose first (eager) pass
/// has run, and the graphs captured for keys seen twice.
#[derive(Default)]
pub(super) struct PassGraph {
    warm: Vec<Key>,
    captured: Vec<(Key, CudaGraph)>,
}

/// How many passes were captured and replayed (replays include the one
/// right after each capture: a capture only records).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Graphs captured.
    pub captures: u64,
    /// Passes run by replaying a graph.
    pub replays: u64,
}

/// Run one pass on `stream`: `enqueue` eagerly on the first call with
/// `key`, else the graph of `key` (captured from `enqueue` on the second
/// call, replayed after). `enqueue` must enqueue only device work on
/// `stream`, with no allocation and no host synchronization, and the same
/// launches for every call with one key: the training pass's contract.
pub(super) fn run(
    stream: &Arc<CudaStream>,
    state: &mut PassGraph,
    stats: &mut GraphStats,
    key: Key,
    mut enqueue: impl FnMut() -> Result<()>,
) -> Result<()> {
    if !state.captured.iter().any(|(k, _)| *k == key) {
        if !state.warm.contains(&key) {
            if state.warm.len() == MAX_GRAPHS {
                state.warm.remove(0);
            }
            state.warm.push(key);
            return enqueue();
        }
        let graph = capture(stream, &mut enqueue)?;
        if state.captured.len() == MAX_GRAPHS {
            state.captured.remove(0);
        }
        state.captured.push((key, graph));
        stats.captures += 1;
    }
    if let Some((_, graph)) = state.captured.iter().find(|(k, _)| *k == key) {
        graph
            .launch()
            .map_err(|e| cuda("replaying the pass's CUDA graph", e))?;
        stats.replays += 1;
    }
    Ok(())
}

/// `enqueue`'s work recorded (not run) into an instantiated graph. A failed
/// capture still ends it, so the stream is usable afterwards.
fn capture(
    stream: &Arc<CudaStream>,
    enqueue: &mut impl FnMut() -> Result<()>,
) -> Result<CudaGraph> {
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| cuda("starting the pass's CUDA graph capture", e))?;
    let enqueued = enqueue();
    let ended = stream.end_capture(CUgraphInstantiate_flags(0));
    enqueued.map_err(|e| TrainError::Cuda {
        what: "capturing the pass as a CUDA graph".to_string(),
        detail: e.to_string(),
    })?;
    match ended {
        Ok(Some(graph)) => Ok(graph),
        Ok(None) => Err(cuda(
            "capturing the pass as a CUDA graph",
            "the capture recorded nothing",
        )),
        Err(e) => Err(cuda("ending the pass's CUDA graph capture", e)),
    }
}

fn cuda(what: &str, detail: impl std::fmt::Display) -> TrainError {
    TrainError::Cuda {
        what: what.to_string(),
        detail: detail.to_string(),
    }
}

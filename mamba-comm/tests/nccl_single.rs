//! NCCL on one GPU, in one process: the init deadline against a peer that
//! never arrives, a world of one (every operation, errors that leave the
//! communicator usable, moving it between threads), one communicator per
//! process, and shutdown.
//!
//! Skips (prints `skipping: ...`) without a GPU or NCCL unless
//! `MAMBA_REQUIRE_GPU=1`. Everything runs in one `#[test]` because a process
//! holds at most one communicator at a time.
//!
//! Run on a GPU machine:
//! `MAMBA_REQUIRE_GPU=1 cargo test -p mamba-comm --test nccl_single`

use std::time::{Duration, Instant};

use mamba_comm::nccl::{self, NcclComm, NcclOptions, MIN_VERSION};
use mamba_comm::rendezvous::MemoryRendezvous;
use mamba_comm::{CommError, Transport};

fn gpu_ready() -> bool {
    let reason = match (nccl::preflight(), nccl::visible_devices()) {
        (Err(e), _) => format!("NCCL is not usable here: {e}"),
        (_, Err(e)) => format!("no CUDA here: {e}"),
        (_, Ok(0)) => "no GPU visible".to_string(),
        _ => return true,
    };
    if std::env::var("MAMBA_REQUIRE_GPU").as_deref() == Ok("1") {
        panic!("MAMBA_REQUIRE_GPU=1 but {reason}");
    }
    eprintln!("skipping: {reason}");
    false
}

#[test]
fn nccl_on_one_gpu() {
    if !gpu_ready() {
        return;
    }
    let version = nccl::preflight().expect("preflight");
    assert!(version >= MIN_VERSION);
    eprintln!("NCCL {version}");

    init_deadline_with_a_missing_peer();
    world_of_one();
}

/// Rank 0 of 2 with no rank 1: an error after the deadline (+1 s at most),
/// the half-made communicator aborted, and the process free to try again.
fn init_deadline_with_a_missing_peer() {
    let mut rdvs = MemoryRendezvous::world(2);
    let rank0 = rdvs.remove(0);
    let timeout = Duration::from_secs(3);
    let opts = NcclOptions {
        init_timeout: timeout,
        collective_timeout: Duration::from_secs(10),
    };
    let start = Instant::now();
    let err = NcclComm::init(0, 2, 0, &rank0, opts).expect_err("rank 1 never arrives");
    let took = start.elapsed();
    eprintln!("init without a peer failed after {took:?}: {err}");
    assert!(took >= timeout, "gave up early: {took:?}");
    assert!(took <= timeout + Duration::from_secs(1), "took {took:?}");
    let text = err.to_string();
    assert!(matches!(err, CommError::Transport { .. }), "{err:?}");
    assert!(
        text.contains("did not complete within") && text.contains("aborted"),
        "{text}"
    );
}

fn world_of_one() {
    let rdv = MemoryRendezvous::solo();
    let opts = NcclOptions {
        init_timeout: Duration::from_secs(30),
        collective_timeout: Duration::from_secs(30),
    };
    let mut comm = NcclComm::init(0, 1, 0, &rdv, opts).expect("init a world of one");
    assert_eq!((comm.rank(), comm.world()), (0, 1));
    assert_eq!(comm.context().ordinal(), 0);

    // One communicator per process.
    let second =
        NcclComm::init(0, 1, 0, &MemoryRendezvous::solo(), opts).expect_err("second communicator");
    assert!(
        second.to_string().contains("one communicator per process"),
        "{second}"
    );

    // Every operation on a world of one is the identity.
    let n = 1000;
    let input: Vec<f32> = (0..n).map(|i| i as f32 - 0.5).collect();
    let mut buf = comm.alloc(n).expect("alloc");
    comm.upload(&input, &mut buf, 0).expect("upload");
    comm.all_reduce_sum_f32(&mut buf, 0..n).expect("sum");
    comm.broadcast(&mut buf, 10..20, 0).expect("broadcast");
    let mut out = vec![0.0f32; n];
    comm.download(&buf, 0, &mut out).expect("download");
    assert_eq!(out, input);
    let mut flags = [3, -4, i32::MAX];
    comm.all_reduce_max_i32(&mut flags).expect("max");
    assert_eq!(flags, [3, -4, i32::MAX]);
    comm.barrier().expect("barrier");
    let mut empty = comm.alloc(0).expect("alloc of zero elements");
    comm.upload(&[], &mut empty, 0).expect("empty upload");
    comm.all_reduce_sum_f32(&mut empty, 0..0)
        .expect("empty sum is a no-op");

    // Caller mistakes: config errors before any NCCL call; still usable.
    let e = comm.send(&buf, 0..n, 0).unwrap_err();
    assert!(matches!(e, CommError::Config(_)), "{e}");
    let e = comm.all_reduce_sum_f32(&mut buf, 5..n + 1).unwrap_err();
    assert!(matches!(e, CommError::Config(_)), "{e}");
    // A group names only the buffers lent to it.
    let e = comm
        .group(&mut [&mut buf], |g| g.recv(1, 0..n, 0))
        .unwrap_err();
    assert!(e.to_string().contains("1 buffer(s) were lent"), "{e}");
    assert!(!comm.is_aborted());

    // The communicator moves to another thread, works there, and comes back.
    let (comm, buf) = std::thread::spawn(move || {
        let (mut comm, mut buf) = (comm, buf);
        comm.all_reduce_sum_f32(&mut buf, 0..n)
            .expect("sum on another thread");
        (comm, buf)
    })
    .join()
    .expect("worker thread");
    let mut comm = comm;
    comm.download(&buf, 0, &mut out).expect("download");
    assert_eq!(out, input);

    comm.shutdown().expect("orderly shutdown");
    // The slot is free again after shutdown.
    let again =
        NcclComm::init(0, 1, 0, &MemoryRendezvous::solo(), opts).expect("init after shutdown");
    drop(again); // Drop aborts a live communicator, without panicking.
}

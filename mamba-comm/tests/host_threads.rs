//! The host transport in thread worlds: collectives, point-to-point,
//! deadlines and fail-fast behaviour, all within one process.

use std::thread;
use std::time::{Duration, Instant};

use mamba_comm::host::{HostOptions, HostTransport};
use mamba_comm::{CommError, Transport};
use proptest::prelude::*;

/// Run `f` on every rank of a thread world, each on its own thread, and
/// collect the results in rank order.
fn run_world<R: Send + 'static>(
    world: usize,
    timeout: Duration,
    f: impl Fn(HostTransport) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let ts = HostTransport::thread_world(world, HostOptions::with_timeout(timeout)).expect("world");
    let handles: Vec<_> = ts
        .into_iter()
        .map(|t| {
            let f = f.clone();
            thread::spawn(move || f(t))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

fn value(rank: usize, i: usize) -> f32 {
    (rank as f32 + 1.0) * 0.1 + i as f32 * 0.37
}

#[test]
fn collectives_agree_on_every_rank() {
    let world = 4;
    let n = 1000;
    let results = run_world(world, Duration::from_secs(10), move |mut t| {
        let r = t.rank();
        let mut buf: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
        t.all_reduce_sum_f32(&mut buf, 0..n).expect("sum");
        let mut flags = vec![r as i32 - 2, -(r as i32), 7];
        t.all_reduce_max_i32(&mut flags).expect("max");
        let mut b = if r == 2 {
            vec![1.5f32, -0.0, f32::NAN]
        } else {
            vec![0.0; 3]
        };
        t.broadcast(&mut b, 0..3, 2).expect("broadcast");
        t.barrier().expect("barrier");
        (
            buf,
            flags,
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        )
    });
    // Ascending-order reference (what the host's library-sum does today).
    let expect: Vec<f32> = (0..n)
        .map(|i| {
            let mut acc = value(0, i);
            for r in 1..world {
                acc += value(r, i);
            }
            acc
        })
        .collect();
    for (r, (sum, flags, b)) in results.iter().enumerate() {
        assert_eq!(
            sum.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            expect.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "rank {r} sum"
        );
        assert_eq!(flags, &vec![1, 0, 7], "rank {r} max");
        assert_eq!(
            b,
            &vec![1.5f32.to_bits(), (-0.0f32).to_bits(), f32::NAN.to_bits()],
            "rank {r} bcast"
        );
    }
}

#[test]
fn ring_exchange_in_a_group_with_subranges() {
    let world = 5;
    let results = run_world(world, Duration::from_secs(10), move |mut t| {
        let (r, w) = (t.rank(), t.world());
        let mut send = vec![r as f32; 8];
        let mut recv = vec![-1.0f32; 8];
        t.group(&mut [&mut send, &mut recv], |g| {
            g.send(0, 2..6, (r + 1) % w)?;
            g.recv(1, 4..8, (r + w - 1) % w)
        })
        .expect("group");
        recv
    });
    for (r, recv) in results.iter().enumerate() {
        let from = ((r + world - 1) % world) as f32;
        assert_eq!(recv, &vec![-1.0, -1.0, -1.0, -1.0, from, from, from, from]);
    }
}

#[test]
fn single_rank_world_is_a_no_op() {
    let mut ts = HostTransport::thread_world(1, HostOptions::with_timeout(Duration::from_secs(1)))
        .expect("world");
    let mut t = ts.remove(0);
    let mut v = vec![1.0f32, 2.0];
    t.all_reduce_sum_f32(&mut v, 0..2).expect("sum");
    t.broadcast(&mut v, 0..2, 0).expect("bcast");
    t.barrier().expect("barrier");
    assert_eq!(v, vec![1.0, 2.0]);
    assert!(HostTransport::thread_world(0, HostOptions::default()).is_err());
}

#[test]
fn bad_arguments_are_config_errors() {
    let mut ts = HostTransport::thread_world(2, HostOptions::with_timeout(Duration::from_secs(1)))
        .expect("world");
    let mut t = ts.remove(0);
    let buf = vec![0.0f32; 4];
    assert!(matches!(t.send(&buf, 2..5, 1), Err(CommError::Config(_))));
    let mut ts = HostTransport::thread_world(2, HostOptions::with_timeout(Duration::from_secs(1)))
        .expect("world");
    let mut t = ts.remove(0);
    assert!(
        matches!(t.send(&buf, 0..1, 0), Err(CommError::Config(_))),
        "self is not a peer"
    );
    let mut dst = vec![0.0f32; 2];
    assert!(matches!(
        t.upload(&[1.0; 3], &mut dst, 0),
        Err(CommError::Config(_))
    ));
    assert!(matches!(
        t.download(&dst, 1, &mut [0.0; 2]),
        Err(CommError::Config(_))
    ));
    t.upload(&[3.0], &mut dst, 1).expect("fits");
    let mut out = [0.0f32; 1];
    t.download(&dst, 1, &mut out).expect("fits");
    assert_eq!(out, [3.0]);
}

/// Does `e` name rank `r` as the one at fault?
fn names_rank(e: &CommError, r: usize) -> bool {
    match e {
        CommError::PeerFailed { rank, .. } => *rank == r,
        CommError::Transport { detail, .. } => detail.contains(&format!("for rank {r} ")),
        _ => false,
    }
}

#[test]
fn a_silent_rank_is_a_deadline_error_naming_it_and_everyone_stops() {
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let results = run_world(4, timeout, move |mut t| {
        if t.rank() == 2 {
            // Stops answering: never enters the collective, keeps its transport.
            thread::sleep(Duration::from_secs(2));
            return None;
        }
        let mut v = vec![1.0f32; 16];
        let e = t
            .all_reduce_sum_f32(&mut v, 0..16)
            .expect_err("must not complete");
        Some((e, start.elapsed()))
    });
    for (r, res) in results.iter().enumerate() {
        if let Some((e, ended)) = res {
            assert!(names_rank(e, 2), "rank {r} error does not name rank 2: {e}");
            // Deadline 0.3 s (followers 0.425 s): well before the silent
            // rank wakes up at 2 s.
            assert!(
                *ended < Duration::from_millis(1500),
                "rank {r} ended after {ended:?}"
            );
            assert!(
                *ended >= timeout,
                "rank {r} ended before the deadline: {ended:?}"
            );
        }
    }
    // The leader's own error is the deadline error naming the op.
    match &results[0] {
        Some((CommError::Transport { op, detail }, _)) => {
            assert_eq!(op, "all_reduce_sum_f32");
            assert!(detail.contains("deadline"), "{detail}");
        }
        other => panic!("leader got {other:?}"),
    }
}

#[test]
fn a_rank_that_leaves_is_named_at_once_not_at_the_deadline() {
    let start = Instant::now();
    let results = run_world(3, Duration::from_secs(20), move |mut t| {
        if t.rank() == 1 {
            drop(t); // leaves in order, without joining the barrier
            return None;
        }
        Some((t.barrier().expect_err("rank 1 is gone"), Instant::now()))
    });
    for (e, _) in results.iter().flatten() {
        assert!(names_rank(e, 1), "error does not name rank 1: {e}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
fn a_panicking_rank_is_named_by_its_peers() {
    let ts = HostTransport::thread_world(3, HostOptions::with_timeout(Duration::from_secs(20)))
        .expect("world");
    let start = Instant::now();
    let handles: Vec<_> = ts
        .into_iter()
        .map(|mut t| {
            thread::spawn(move || {
                if t.rank() == 0 {
                    panic!("deliberate panic in rank 0");
                }
                let mut v = vec![0i32; 1];
                t.all_reduce_max_i32(&mut v).expect_err("rank 0 panicked")
            })
        })
        .collect();
    let mut results = handles.into_iter().map(|h| h.join());
    assert!(results.next().expect("rank 0").is_err(), "rank 0 panicked");
    for e in results {
        let e = e.expect("peer thread");
        assert!(names_rank(&e, 0), "error does not name rank 0: {e}");
    }
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn mismatched_collectives_are_named_not_mixed() {
    let results = run_world(2, Duration::from_secs(5), move |mut t| {
        let mut v = vec![1.0f32; 4];
        if t.rank() == 0 {
            t.all_reduce_sum_f32(&mut v, 0..4)
        } else {
            t.all_reduce_sum_f32(&mut v, 0..3)
        }
    });
    let e = results[0].as_ref().expect_err("sizes differ");
    assert!(e.to_string().contains("different sizes"), "{e}");
    assert!(results[1].is_err());

    let results = run_world(2, Duration::from_secs(5), move |mut t| {
        let mut v = vec![1.0f32; 4];
        if t.rank() == 0 {
            t.barrier()
        } else {
            t.broadcast(&mut v, 0..4, 1)
        }
    });
    let e = results[0].as_ref().expect_err("ops differ");
    assert!(e.to_string().contains("different operations"), "{e}");
}

#[test]
fn after_an_error_the_transport_refuses_work() {
    let results = run_world(2, Duration::from_millis(100), move |mut t| {
        if t.rank() == 1 {
            thread::sleep(Duration::from_millis(400));
            return true;
        }
        let first = t.barrier();
        let second = t.barrier();
        first.is_err()
            && matches!(second, Err(CommError::Transport { detail, .. }) if detail.contains("earlier error"))
    });
    assert!(results[0]);
}

#[test]
fn recv_first_on_both_sides_fails_at_the_deadline_instead_of_hanging() {
    // Documented limitation: host groups run eagerly, so two ranks that each
    // wait before sending cannot be matched; it must end in an error.
    let start = Instant::now();
    let results = run_world(2, Duration::from_millis(200), move |mut t| {
        let peer = 1 - t.rank();
        let mut buf = vec![0.0f32; 2];
        let mut send = vec![1.0f32; 2];
        t.group(&mut [&mut buf, &mut send], |g| {
            g.recv(0, 0..2, peer)?;
            g.send(1, 0..2, peer)
        })
    });
    assert!(results.iter().all(|r| r.is_err()));
    assert!(start.elapsed() < Duration::from_secs(3));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn sum_and_broadcast_match_a_serial_reference(
        world in 1usize..6,
        len in 0usize..40,
        root_pick in 0usize..6,
        seed in any::<u32>(),
    ) {
        let root = root_pick % world;
        let gen = move |r: usize, i: usize| ((seed as usize ^ (r * 7919 + i * 104729)) % 2001) as f32 / 7.0 - 100.0;
        let results = run_world(world, Duration::from_secs(10), move |mut t| {
            let r = t.rank();
            let mut s: Vec<f32> = (0..len).map(|i| gen(r, i)).collect();
            t.all_reduce_sum_f32(&mut s, 0..len).expect("sum");
            let mut b: Vec<f32> = (0..len).map(|i| gen(r + 100, i)).collect();
            t.broadcast(&mut b, 0..len, root).expect("bcast");
            (s, b)
        });
        for (s, b) in &results {
            for i in 0..len {
                let mut acc = gen(0, i);
                for r in 1..world { acc += gen(r, i); }
                prop_assert_eq!(s[i].to_bits(), acc.to_bits());
                prop_assert_eq!(b[i].to_bits(), gen(root + 100, i).to_bits());
            }
        }
    }
}

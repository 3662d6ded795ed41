//! The host transport over loopback sockets, with ranks on threads of this
//! process (real sockets, real reader/writer threads); the process-level
//! faults are in `world_processes.rs`.

use std::thread;
use std::time::{Duration, Instant};

use mamba_comm::host::{HostOptions, HostTransport};
use mamba_comm::rendezvous::{LaunchSecret, MemoryRendezvous, TcpRendezvous};
use mamba_comm::{CommError, Rendezvous, Transport};

fn secret() -> LaunchSecret {
    LaunchSecret::of_job("host-socket-tests")
}

fn socket_world<R: Send + 'static>(
    world: usize,
    timeout: Duration,
    f: impl Fn(HostTransport) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let rdvs = MemoryRendezvous::world(world);
    let hs: Vec<_> = rdvs
        .into_iter()
        .map(|rdv| {
            let f = f.clone();
            thread::spawn(move || {
                let t = HostTransport::connect(&rdv, HostOptions::with_timeout(timeout))
                    .expect("connect");
                f(t)
            })
        })
        .collect();
    hs.into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

#[test]
fn sockets_and_threads_give_the_same_bits() {
    let n = 4097;
    let work = move |mut t: HostTransport| {
        let r = t.rank();
        let mut v: Vec<f32> = (0..n)
            .map(|i| ((r * 31 + i) % 97) as f32 * 0.013 - 0.5)
            .collect();
        t.all_reduce_sum_f32(&mut v, 0..n).expect("sum");
        let mut m = vec![r as i32 * 10 - 15];
        t.all_reduce_max_i32(&mut m).expect("max");
        let mut b = vec![r as f32; 5];
        t.broadcast(&mut b, 1..4, 3).expect("broadcast");
        t.barrier().expect("barrier");
        t.shutdown().expect("orderly shutdown");
        (v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), m, b)
    };
    let sockets = socket_world(4, Duration::from_secs(10), work);
    let threads: Vec<_> =
        HostTransport::thread_world(4, HostOptions::with_timeout(Duration::from_secs(10)))
            .expect("world")
            .into_iter()
            .map(|t| thread::spawn(move || work(t)))
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect();
    assert_eq!(sockets, threads);
    assert_eq!(sockets[0].1, vec![15]);
    assert_eq!(sockets[1].2, vec![1.0, 3.0, 3.0, 3.0, 1.0]);
}

#[test]
fn big_simultaneous_sends_do_not_deadlock() {
    // Both ranks push 16 MiB at each other before either receives: a
    // blocking send would fill both socket buffers and hang.
    let n = 4 << 20;
    let got = socket_world(2, Duration::from_secs(20), move |mut t| {
        let peer = 1 - t.rank();
        let mut out = vec![t.rank() as f32 + 0.5; n];
        let mut inb = vec![0.0f32; n];
        t.group(&mut [&mut out, &mut inb], |g| {
            g.send(0, 0..n, peer)?;
            g.recv(1, 0..n, peer)
        })
        .expect("exchange");
        inb.iter().all(|&x| x == peer as f32 + 0.5)
    });
    assert_eq!(got, vec![true, true]);
}

#[test]
fn a_missing_rank_fails_connect_naming_it() {
    let mut rdvs = MemoryRendezvous::world(3);
    let r2 = rdvs.pop().expect("rank 2 never connects");
    let start = Instant::now();
    let errs: Vec<CommError> = rdvs
        .into_iter()
        .map(|rdv| {
            thread::spawn(move || {
                HostTransport::connect(&rdv, HostOptions::with_timeout(Duration::from_millis(400)))
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().expect("thread").expect_err("rank 2 is missing"))
        .collect();
    drop(r2);
    assert!(start.elapsed() < Duration::from_secs(3));
    // Rank 0 and 1 wait to accept rank 2, or for its address.
    for e in &errs {
        let s = e.to_string();
        assert!(s.contains("[2]") || s.contains("host-addr-2"), "{s}");
    }
}

#[test]
fn over_a_tcp_rendezvous_with_tags() {
    let r0 =
        TcpRendezvous::new("127.0.0.1", 0, 0, 3, secret(), Duration::from_secs(10)).expect("store");
    let port = r0.store_port().expect("port");
    let h0 = thread::spawn(move || {
        let rdv: &dyn Rendezvous = &r0;
        let mut a = HostTransport::connect(rdv, HostOptions::with_timeout(Duration::from_secs(10)))
            .expect("a");
        let mut opts = HostOptions::with_timeout(Duration::from_secs(10));
        opts.tag = "second".into();
        let mut b = HostTransport::connect(rdv, opts).expect("b");
        let mut v = vec![1.0f32];
        a.all_reduce_sum_f32(&mut v, 0..1).expect("a sum");
        b.all_reduce_sum_f32(&mut v, 0..1).expect("b sum");
        v[0]
    });
    let hs: Vec<_> = (1..3)
        .map(|r| {
            thread::spawn(move || {
                let rdv =
                    TcpRendezvous::new("127.0.0.1", port, r, 3, secret(), Duration::from_secs(10))
                        .expect("join");
                let mut a = HostTransport::connect(
                    &rdv,
                    HostOptions::with_timeout(Duration::from_secs(10)),
                )
                .expect("a");
                let mut opts = HostOptions::with_timeout(Duration::from_secs(10));
                opts.tag = "second".into();
                let mut b = HostTransport::connect(&rdv, opts).expect("b");
                let mut v = vec![1.0f32];
                a.all_reduce_sum_f32(&mut v, 0..1).expect("a sum");
                b.all_reduce_sum_f32(&mut v, 0..1).expect("b sum");
                v[0]
            })
        })
        .collect();
    let mut all = vec![h0.join().expect("rank 0")];
    all.extend(hs.into_iter().map(|h| h.join().expect("rank")));
    assert_eq!(all, vec![9.0; 3], "(1+1+1) then (3+3+3)");
}

#[test]
fn a_message_larger_than_the_receivers_bound_is_refused_naming_the_peer() {
    // Rank 1 receives at most 100 values per message; rank 0 sends 1000.
    let rdvs = MemoryRendezvous::world(2);
    let hs: Vec<_> = rdvs
        .into_iter()
        .enumerate()
        .map(|(rank, rdv)| {
            thread::spawn(move || {
                let opts = HostOptions {
                    max_values: if rank == 1 { 100 } else { 1 << 20 },
                    ..HostOptions::with_timeout(Duration::from_secs(10))
                };
                let mut t = HostTransport::connect(&rdv, opts).expect("connect");
                let mut v = vec![0.5f32; 1000];
                if rank == 0 {
                    // Its peer fails; whatever this rank sees, it must end.
                    let _ = t.send(&v, 0..1000, 1);
                    let _ = t.barrier();
                    Ok(())
                } else {
                    t.recv(&mut v, 0..1000, 0).map_err(|e| e.to_string())
                }
            })
        })
        .collect();
    let results: Vec<_> = hs.into_iter().map(|h| h.join().expect("rank")).collect();
    let e = results[1]
        .clone()
        .expect_err("rank 1 must refuse the frame");
    assert!(
        e.contains("rank 0") && e.contains("1000 values") && e.contains("100"),
        "{e}"
    );
}

/// A large message queued behind small ones of other collectives is read
/// for its own receive (the pattern of a trainer's step: small flags and
/// loss values, then the arena), not compared with whichever receive
/// happens to wait when it arrives.
#[test]
fn a_large_message_behind_small_ones_reaches_its_own_receive() {
    let n = 100_000;
    let got = socket_world(2, Duration::from_secs(10), move |mut t| {
        let mut flags = [t.rank() as i32];
        let mut big = vec![t.rank() as f32 + 0.5; n];
        if t.rank() == 0 {
            t.send(&vec![7.0; 2], 0..2, 1).expect("small");
            t.send(&big, 0..n, 1).expect("large");
        } else {
            // Let both frames arrive before any receive is posted.
            thread::sleep(Duration::from_millis(100));
            let mut small = vec![0.0f32; 2];
            t.recv(&mut small, 0..2, 0).expect("small");
            assert_eq!(small, vec![7.0; 2]);
            t.recv(&mut big, 0..n, 0).expect("large");
        }
        t.all_reduce_max_i32(&mut flags).expect("max");
        (flags[0], big.iter().all(|&x| x == 0.5))
    });
    assert_eq!(got, vec![(1, true), (1, true)]);
}

/// A peer whose large message is longer than the receive it belongs to is
/// refused before its payload is read, naming the peer and both lengths.
#[test]
fn a_large_message_longer_than_its_receive_is_refused_naming_the_peer() {
    let n = 100_000;
    let results = socket_world(2, Duration::from_secs(10), move |mut t| {
        let mut v = vec![0.5f32; n];
        if t.rank() == 0 {
            t.send(&v, 0..n, 1).map_err(|e| e.to_string())?;
            // Its peer fails; whatever this rank sees, it must end.
            let _ = t.barrier();
            Ok(())
        } else {
            t.recv(&mut v, 0..10, 0).map_err(|e| e.to_string())
        }
    });
    let e = results[1]
        .clone()
        .expect_err("rank 1 must refuse the frame");
    assert!(
        e.contains("rank 0") && e.contains("100000 values") && e.contains("at most 10"),
        "{e}"
    );
}

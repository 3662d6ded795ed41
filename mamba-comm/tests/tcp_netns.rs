//! The TCP store across two "nodes": two network namespaces joined by a
//! veth pair on this machine, each with its own address and its own
//! `/etc/hosts` (`ip netns exec` bind-mounts `/etc/netns/<ns>/hosts`). On
//! node A the master's name resolves to 127.0.1.1, as Ubuntu resolves a
//! host's own name; on node B to A's veth address. Rank 0 (node A) must
//! listen where node B's rank 1 reaches it, and a process of another job
//! must be refused.
//!
//! Needs root and `ip` (iproute2); skips with the reason otherwise (`.ci/run`
//! runs as root and installs iproute2). The namespaces, the veth pair and
//! the hosts files exist only for the test and are removed when it ends,
//! also when it fails; the traffic stays on the veth pair.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use mamba_comm::bootstrap::{detect, ProcessEnv};
use mamba_comm::rendezvous;

/// The master's host name in both namespaces' hosts files.
const MASTER: &str = "mamba-node-a";
const ROLE: &str = "MAMBA_NETNS_ROLE";

/// What this test needs that the machine may lack.
fn missing() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (ip netns)".into());
    }
    match Command::new("ip").arg("-V").output() {
        Ok(o) if o.status.success() => None,
        _ => Some("needs the ip command (iproute2)".into()),
    }
}

fn ip(args: &[&str]) {
    let o = Command::new("ip").args(args).output().expect("ip runs");
    assert!(
        o.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Two namespaces and a veth pair, removed on drop (also on panic).
struct TwoNodes {
    ns: [String; 2],
}

impl TwoNodes {
    fn new() -> Self {
        let tag = std::process::id() % 100_000;
        let nodes = TwoNodes {
            ns: [format!("mamba-a-{tag}"), format!("mamba-b-{tag}")],
        };
        let (va, vb) = (format!("mva{tag}"), format!("mvb{tag}"));
        for ns in &nodes.ns {
            ip(&["netns", "add", ns]);
        }
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb]);
        ip(&["link", "set", &va, "netns", &nodes.ns[0]]);
        ip(&["link", "set", &vb, "netns", &nodes.ns[1]]);
        for (ns, dev, addr, master) in [
            (&nodes.ns[0], &va, "10.77.0.1/24", "127.0.1.1"),
            (&nodes.ns[1], &vb, "10.77.0.2/24", "10.77.0.1"),
        ] {
            ip(&["-n", ns, "addr", "add", addr, "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
            let etc = PathBuf::from("/etc/netns").join(ns);
            std::fs::create_dir_all(&etc).expect("/etc/netns/<ns>");
            std::fs::write(
                etc.join("hosts"),
                format!("127.0.0.1 localhost\n{master} {MASTER}\n"),
            )
            .expect("hosts file");
        }
        nodes
    }

    /// Run this test's rank side in namespace `node` as torchrun would
    /// start rank `rank` of job `job`.
    fn rank(&self, node: usize, rank: usize, job: &str) -> std::process::Child {
        let exe = std::env::current_exe().expect("test binary");
        Command::new("ip")
            .args(["netns", "exec", &self.ns[node]])
            .arg(exe)
            .args([
                "two_namespaces_meet_in_the_store_and_another_job_is_refused",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE, "rank")
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", "0")
            .env("WORLD_SIZE", "2")
            .env("LOCAL_WORLD_SIZE", "1")
            .env("MASTER_ADDR", MASTER)
            .env("MASTER_PORT", "29617")
            .env("TORCHELASTIC_RUN_ID", job)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("ip netns exec starts")
    }
}

impl Drop for TwoNodes {
    fn drop(&mut self) {
        for ns in &self.ns {
            // Deleting a namespace deletes the veth end inside it, and so
            // the pair.
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
            let _ = std::fs::remove_dir_all(PathBuf::from("/etc/netns").join(ns));
        }
    }
}

fn text(o: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The rank side: meet through the store, exchange a value, barrier.
fn rank_side() {
    let place = detect(&ProcessEnv)
        .expect("a valid torchrun contract")
        .expect("a rank has a place");
    let rdv = rendezvous::open(&place, Duration::from_secs(20)).expect("rendezvous");
    let me = place.rank;
    rdv.publish(&format!("hello-{me}"), format!("from {me}").as_bytes())
        .expect("publish");
    let other = 1 - me;
    let got = rdv
        .fetch(&format!("hello-{other}"), 6, Duration::from_secs(20))
        .expect("fetch the peer's value");
    assert_eq!(got, format!("from {other}").as_bytes());
    rdv.barrier("done", Duration::from_secs(20))
        .expect("barrier");
    // Rank 0 serves the store: it leaves only after rank 1's last request.
    if me == 1 {
        rdv.publish("bye", b"1").expect("publish bye");
    } else {
        rdv.fetch("bye", 1, Duration::from_secs(20))
            .expect("rank 1's bye");
    }
    println!("netns-rank-ok {me}");
}

#[test]
fn two_namespaces_meet_in_the_store_and_another_job_is_refused() {
    if std::env::var(ROLE).as_deref() == Ok("rank") {
        rank_side();
        return;
    }
    if let Some(why) = missing() {
        eprintln!("skipping: {why}");
        return;
    }
    let nodes = TwoNodes::new();
    let r0 = nodes.rank(0, 0, "netns-job");
    std::thread::sleep(Duration::from_millis(300));
    // A process of another job claiming rank 1 is refused, and does not
    // take this job's rank 1.
    let intruder = nodes.rank(1, 1, "another-job").wait_with_output().unwrap();
    assert!(!intruder.status.success(), "{}", text(&intruder));
    assert!(
        text(&intruder).contains("launch secret does not match"),
        "{}",
        text(&intruder)
    );
    let r1 = nodes.rank(1, 1, "netns-job");
    let (o0, o1) = (
        r0.wait_with_output().unwrap(),
        r1.wait_with_output().unwrap(),
    );
    assert!(o0.status.success(), "rank 0: {}", text(&o0));
    assert!(o1.status.success(), "rank 1: {}", text(&o1));
    assert!(text(&o1).contains("netns-rank-ok 1"), "{}", text(&o1));
    drop(nodes);
}

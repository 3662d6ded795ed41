//! Passing a file descriptor to the peers of one node: Linux abstract Unix
//! sockets and `SCM_RIGHTS`, each connection checked against the pid the
//! peer announced through the world's own channel.
//!
//! Why the pid check: an abstract socket name is visible to every process
//! in the network namespace, so without it a stranger could connect and be
//! handed the pool (and read the gradients), or squat a name and hand out
//! its own. The kernel reports the connecting process's pid (`SO_PEERCRED`);
//! a pid other than the expected one is refused on both ends.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

use crate::{CommError, Result};

/// The greeting a server writes along with the descriptor.
const MAGIC: &[u8; 8] = b"mambafd1";

fn io_err(op: &str, name: &str, e: std::io::Error) -> CommError {
    CommError::transport(
        format!("passing a file descriptor ({op})"),
        format!("abstract socket {name:?}: {e}"),
    )
}

fn address(name: &str) -> Result<SocketAddr> {
    SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| io_err("naming", name, e))
}

/// The pid of the process at the other end of `s`.
fn peer_pid(s: &UnixStream, name: &str) -> Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes a ucred of `len` bytes into `cred`.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io_err("SO_PEERCRED", name, std::io::Error::last_os_error()));
    }
    Ok(cred.pid as u32)
}

/// One descriptor as `SCM_RIGHTS`, with the magic as the payload.
fn send_fd(s: &UnixStream, fd: BorrowedFd<'_>, name: &str) -> Result<()> {
    let raw = fd.as_raw_fd();
    // Space for one int of ancillary data, aligned for cmsghdr.
    let mut control = [0u64; 8];
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<i32>() as u32) } as usize;
    let mut iov = libc::iovec {
        iov_base: MAGIC.as_ptr() as *mut libc::c_void,
        iov_len: MAGIC.len(),
    };
    // SAFETY: all-zero is a valid msghdr to fill in.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg_control holds `space` >= CMSG_SPACE(int) bytes, so the
    // first header and its int of data lie inside it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<i32>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<i32>(), raw);
    }
    // SAFETY: msg points at live buffers for the whole call.
    let sent = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if sent != MAGIC.len() as isize {
        return Err(io_err("sendmsg", name, std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Receive one descriptor sent by [`send_fd`] (blocking under the stream's
/// read timeout).
fn recv_fd(s: &UnixStream, name: &str) -> Result<OwnedFd> {
    let mut payload = [0u8; 8];
    let mut control = [0u64; 8];
    let mut iov = libc::iovec {
        iov_base: payload.as_mut_ptr().cast(),
        iov_len: payload.len(),
    };
    // SAFETY: all-zero is a valid msghdr to fill in.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: msg points at live buffers for the whole call; CLOEXEC so
    // the descriptor does not leak into spawned children.
    let got = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if got < 0 {
        return Err(io_err("recvmsg", name, std::io::Error::last_os_error()));
    }
    // SAFETY: the kernel filled msg_control up to msg_controllen; the
    // header macros walk only inside it.
    let fd = unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        if c.is_null() || (*c).cmsg_level != libc::SOL_SOCKET || (*c).cmsg_type != libc::SCM_RIGHTS
        {
            None
        } else {
            Some(std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<i32>()))
        }
    };
    let Some(fd) = fd.filter(|&fd| fd >= 0) else {
        return Err(CommError::transport(
            "passing a file descriptor (recvmsg)",
            format!("abstract socket {name:?} answered without a descriptor"),
        ));
    };
    // SAFETY: SCM_RIGHTS installed a fresh descriptor in this process.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    if got as usize != MAGIC.len() || &payload != MAGIC {
        return Err(CommError::transport(
            "passing a file descriptor (recvmsg)",
            format!(
                "abstract socket {name:?} sent {got} bytes that are not this protocol's greeting"
            ),
        ));
    }
    Ok(owned)
}

/// A listening abstract socket that hands one descriptor to each allowed
/// peer that connects.
#[derive(Debug)]
pub struct FdListener {
    listener: UnixListener,
    name: String,
}

impl FdListener {
    /// Listen at abstract name `name` (unique per world and rank; a name in
    /// use is an error, so two worlds can never cross).
    pub fn bind(name: &str) -> Result<FdListener> {
        let listener =
            UnixListener::bind_addr(&address(name)?).map_err(|e| io_err("bind", name, e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err("bind", name, e))?;
        Ok(FdListener {
            listener,
            name: name.to_owned(),
        })
    }

    /// The abstract name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Accept `connections` connections before `deadline`, each from a
    /// process whose pid is in `allowed` (each pid once), and send `fd` on
    /// each. A stranger's connection is refused and is an error naming its
    /// pid; a missed deadline is an error saying how many came.
    pub fn serve(
        &self,
        fd: BorrowedFd<'_>,
        allowed: &[u32],
        connections: usize,
        deadline: Instant,
    ) -> Result<()> {
        let mut served: Vec<u32> = Vec::with_capacity(connections);
        while served.len() < connections {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    stream
                        .set_nonblocking(false)
                        .map_err(|e| io_err("accept", &self.name, e))?;
                    let pid = peer_pid(&stream, &self.name)?;
                    if !allowed.contains(&pid) || served.contains(&pid) {
                        return Err(CommError::transport(
                            "passing a file descriptor (accept)",
                            format!(
                                "abstract socket {:?}: a connection from pid {pid}, which is not \
                                 one of the world's peers on this node ({allowed:?}) or came \
                                 twice; refused",
                                self.name
                            ),
                        ));
                    }
                    send_fd(&stream, fd, &self.name)?;
                    served.push(pid);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(CommError::transport(
                            "passing a file descriptor (accept)",
                            format!(
                                "abstract socket {:?}: {} of {connections} peers connected \
                                 before the deadline (served pids {served:?})",
                                self.name,
                                served.len()
                            ),
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(io_err("accept", &self.name, e)),
            }
        }
        Ok(())
    }
}

/// Connect to the [`FdListener`] at `name`, check that it is process
/// `expected_pid`, and receive its descriptor before `deadline`.
pub fn fetch_fd(name: &str, expected_pid: u32, deadline: Instant) -> Result<OwnedFd> {
    let addr = address(name)?;
    let stream = loop {
        match UnixStream::connect_addr(&addr) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(io_err("connect", name, e)),
        }
    };
    let pid = peer_pid(&stream, name)?;
    if pid != expected_pid {
        return Err(CommError::transport(
            "passing a file descriptor (connect)",
            format!(
                "abstract socket {name:?} is held by pid {pid}, but the peer announced pid \
                 {expected_pid}; refused"
            ),
        ));
    }
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream
        .set_read_timeout(Some(left))
        .map_err(|e| io_err("connect", name, e))?;
    recv_fd(&stream, name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsFd;

    fn unique(tag: &str) -> String {
        format!(
            "mamba-test-{tag}-{}-{:?}",
            std::process::id(),
            Instant::now()
        )
    }

    #[test]
    fn a_descriptor_crosses_and_stays_usable() {
        let name = unique("cross");
        let listener = FdListener::bind(&name).expect("bind");
        let mut file = tempfile::tempfile().expect("temp file");
        file.write_all(b"before").unwrap();
        let me = std::process::id();
        let deadline = Instant::now() + Duration::from_secs(10);
        let fd = std::thread::scope(|s| {
            let server = s.spawn(|| listener.serve(file.as_fd(), &[me], 1, deadline));
            let fd = fetch_fd(&name, me, deadline).expect("fetch");
            server.join().unwrap().expect("serve");
            fd
        });
        // The received descriptor is the same open file (shared offset).
        let mut got = File::from(fd);
        got.write_all(b" after").unwrap();
        file.rewind().unwrap();
        let mut all = String::new();
        file.read_to_string(&mut all).unwrap();
        assert_eq!(all, "before after");
    }

    #[test]
    fn a_stranger_is_refused_on_both_ends() {
        let name = unique("stranger");
        let listener = FdListener::bind(&name).expect("bind");
        let file = tempfile::tempfile().expect("temp file");
        let me = std::process::id();
        let deadline = Instant::now() + Duration::from_secs(10);
        // The server allows another pid only: this process is a stranger.
        let (served, fetched) = std::thread::scope(|s| {
            let server = s.spawn(|| listener.serve(file.as_fd(), &[me + 1], 1, deadline));
            let fetched = fetch_fd(&name, me, deadline);
            (server.join().unwrap(), fetched)
        });
        let e = served.expect_err("a stranger must be refused").to_string();
        assert!(
            e.contains(&format!("pid {me}")) && e.contains("refused"),
            "{e}"
        );
        assert!(fetched.is_err(), "the stranger got a descriptor");
        // The client side: the listener is not the announced pid.
        let name2 = unique("squat");
        let squatter = FdListener::bind(&name2).expect("bind");
        let e = fetch_fd(&name2, me + 1, deadline).expect_err("a squatter must be refused");
        assert!(e.to_string().contains(&format!("held by pid {me}")), "{e}");
        drop(squatter);
    }

    #[test]
    fn a_missing_listener_and_a_missed_deadline_are_errors() {
        let name = unique("missing");
        let soon = Instant::now() + Duration::from_millis(50);
        let e = fetch_fd(&name, 1, soon).expect_err("nobody listens");
        assert!(e.to_string().contains(&name), "{e}");
        let listener = FdListener::bind(&name).expect("bind");
        let file = tempfile::tempfile().expect("temp file");
        let soon = Instant::now() + Duration::from_millis(50);
        let e = listener
            .serve(file.as_fd(), &[1], 1, soon)
            .expect_err("nobody connects");
        assert!(e.to_string().contains("0 of 1 peers"), "{e}");
        // The name is taken while the listener lives.
        assert!(FdListener::bind(&name).is_err());
    }
}

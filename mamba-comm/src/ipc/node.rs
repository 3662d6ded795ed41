//! Which node, and which namespaces, a process runs in: the peer fold's
//! sharing works only between processes that see each other's abstract
//! Unix sockets (one network namespace) and each other's pids (one pid
//! namespace) on one running kernel (one boot). Comparing these up front
//! turns a world that spans nodes or containers into one clear error
//! instead of a socket that never answers until the timeout.

use std::os::unix::fs::MetadataExt;

use crate::{CommError, Result};

/// Where a process runs, as far as sharing device memory is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NodeIdentity {
    /// The kernel's boot id (`/proc/sys/kernel/random/boot_id`): different
    /// on every machine and after every reboot.
    pub boot: [u8; 16],
    /// The inode of `/proc/self/ns/net` (abstract sockets live there).
    pub net_ns: u64,
    /// The inode of `/proc/self/ns/pid` (the descriptor exchange checks
    /// the peer's pid).
    pub pid_ns: u64,
}

impl NodeIdentity {
    /// Bytes of [`NodeIdentity::to_bytes`].
    pub const BYTES: usize = 32;

    /// This process's identity, read from `/proc`.
    pub fn of_this_process() -> Result<NodeIdentity> {
        let path = "/proc/sys/kernel/random/boot_id";
        let text = std::fs::read_to_string(path)
            .map_err(|e| CommError::config(format!("cannot read {path}: {e} (Linux only)")))?;
        let boot = parse_boot_id(&text)
            .ok_or_else(|| CommError::config(format!("{path} holds {text:?}, not a UUID")))?;
        let ns = |name: &str| {
            let p = format!("/proc/self/ns/{name}");
            std::fs::metadata(&p)
                .map(|m| m.ino())
                .map_err(|e| CommError::config(format!("cannot stat {p}: {e}")))
        };
        Ok(NodeIdentity {
            boot,
            net_ns: ns("net")?,
            pid_ns: ns("pid")?,
        })
    }

    /// The identity as [`NodeIdentity::BYTES`] bytes (for any channel).
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        out[..16].copy_from_slice(&self.boot);
        out[16..24].copy_from_slice(&self.net_ns.to_le_bytes());
        out[24..].copy_from_slice(&self.pid_ns.to_le_bytes());
        out
    }

    /// The inverse of [`NodeIdentity::to_bytes`]; `None` for another length.
    pub fn from_bytes(bytes: &[u8]) -> Option<NodeIdentity> {
        let bytes: &[u8; Self::BYTES] = bytes.try_into().ok()?;
        let (boot, rest) = bytes.split_at(16);
        let (net, pid) = rest.split_at(8);
        Some(NodeIdentity {
            boot: boot.try_into().ok()?,
            net_ns: u64::from_le_bytes(net.try_into().ok()?),
            pid_ns: u64::from_le_bytes(pid.try_into().ok()?),
        })
    }

    /// Short text for messages: the boot id's first 8 hex digits and the
    /// two namespaces.
    pub fn describe(&self) -> String {
        let boot: String = self.boot[..4].iter().map(|b| format!("{b:02x}")).collect();
        format!(
            "boot {boot}…, net namespace {}, pid namespace {}",
            self.net_ns, self.pid_ns
        )
    }
}

/// The 16 bytes of a UUID's 32 hex digits (dashes and whitespace ignored).
fn parse_boot_id(text: &str) -> Option<[u8; 16]> {
    let digits: Vec<u8> = text
        .chars()
        .filter(|c| !c.is_whitespace() && *c != '-')
        .map(|c| c.to_digit(16).map(|d| d as u8))
        .collect::<Option<_>>()?;
    if digits.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (k, pair) in digits.chunks(2).enumerate() {
        out[k] = pair[0] << 4 | pair[1];
    }
    Some(out)
}

/// `Ok` when every rank's identity (`ids[r]` is rank `r`'s) is the same;
/// otherwise the groups of ranks that share one, each named with its
/// identity, in order of their lowest rank.
pub fn one_node(ids: &[NodeIdentity]) -> std::result::Result<(), String> {
    let mut groups: Vec<(NodeIdentity, Vec<usize>)> = Vec::new();
    for (rank, id) in ids.iter().enumerate() {
        match groups.iter_mut().find(|(g, _)| g == id) {
            Some((_, ranks)) => ranks.push(rank),
            None => groups.push((*id, vec![rank])),
        }
    }
    if groups.len() <= 1 {
        return Ok(());
    }
    Err(groups
        .iter()
        .map(|(id, ranks)| format!("ranks {ranks:?} on {}", id.describe()))
        .collect::<Vec<_>>()
        .join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(boot: u8, net: u64, pid: u64) -> NodeIdentity {
        NodeIdentity {
            boot: [boot; 16],
            net_ns: net,
            pid_ns: pid,
        }
    }

    #[test]
    fn this_process_has_a_stable_identity_that_round_trips() {
        let a = NodeIdentity::of_this_process().expect("read /proc");
        let b = NodeIdentity::of_this_process().expect("read /proc");
        assert_eq!(a, b);
        assert_ne!(a.boot, [0; 16]);
        assert_ne!(a.net_ns, 0);
        assert_eq!(NodeIdentity::from_bytes(&a.to_bytes()), Some(a));
        assert_eq!(NodeIdentity::from_bytes(&a.to_bytes()[..31]), None);
    }

    #[test]
    fn boot_ids_parse_as_uuids_and_nothing_else() {
        let got = parse_boot_id("0123abcd-4567-89ef-0123-456789abcdef\n").unwrap();
        assert_eq!(got[0], 0x01);
        assert_eq!(got[3], 0xcd);
        assert_eq!(got[15], 0xef);
        assert_eq!(parse_boot_id("0123"), None);
        assert_eq!(parse_boot_id("zz23abcd-4567-89ef-0123-456789abcdef"), None);
    }

    #[test]
    fn one_node_names_every_group_of_ranks() {
        assert_eq!(one_node(&[id(1, 5, 6), id(1, 5, 6), id(1, 5, 6)]), Ok(()));
        assert_eq!(one_node(&[]), Ok(()));
        // Two nodes, and on one of them a rank in its own container.
        let text = one_node(&[id(1, 5, 6), id(1, 5, 6), id(2, 5, 6), id(1, 7, 6)]).unwrap_err();
        assert!(text.starts_with("ranks [0, 1] on boot 01010101…"), "{text}");
        assert!(text.contains("ranks [2] on boot 02020202…"), "{text}");
        assert!(
            text.contains("ranks [3] on boot 01010101…, net namespace 7"),
            "{text}"
        );
        // A pid namespace alone also splits (the pid check would fail).
        assert!(one_node(&[id(1, 5, 6), id(1, 5, 8)]).is_err());
    }
}

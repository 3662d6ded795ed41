//! The recorder's words: calls as text, short lists of ranks, atomic
//! writes.

use std::io::Write;
use std::path::Path;

use super::{CallRecord, CallState};

/// Calls a dump prints to stderr (the file holds the whole ring).
pub(crate) const STDERR_CALLS: usize = 16;

/// Ranks a summarised list names before "and N more".
const SHOWN_RANKS: usize = 8;

/// `ns` before `now` as seconds ("12.345s ago"), or "at once" when later.
fn ago(ns: u64, now: u64) -> String {
    let d = now.saturating_sub(ns);
    format!("{:.3}s ago", d as f64 / 1e9)
}

/// One line per call: `#seq kind bytes peer ops, enqueued .., completed ..`.
pub fn format_calls(calls: &[CallRecord], now_ns: u64) -> String {
    let mut out = String::new();
    for c in calls {
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str(&format!("  #{} {}", c.seq, describe(c)));
        out.push_str(&format!(", enqueued {}", ago(c.enqueued_ns, now_ns)));
        match (c.state, c.completed_ns) {
            (CallState::Completed, Some(t)) => {
                out.push_str(&format!(", completed {}", ago(t, now_ns)))
            }
            (CallState::Failed, Some(t)) => out.push_str(&format!(", FAILED {}", ago(t, now_ns))),
            _ => out.push_str(", NOT COMPLETED"),
        }
    }
    out
}

/// The call without its times: `all_reduce_sum_f32 (40000 bytes)`.
pub(crate) fn describe(c: &CallRecord) -> String {
    let mut s = format!("{} ({} bytes", c.kind.name(), c.bytes);
    if let Some(p) = c.peer {
        s.push_str(&format!(", peer {p}"));
    }
    if c.ops != 1 {
        s.push_str(&format!(", {} ops", c.ops));
    }
    s.push(')');
    s
}

/// `ranks` as a short list: all of them up to a few, else the first few
/// and "and N more" (a world of 100000 ranks stays one short line).
pub fn summarise_ranks(ranks: &[usize]) -> String {
    let shown: Vec<String> = ranks
        .iter()
        .take(SHOWN_RANKS)
        .map(|r| r.to_string())
        .collect();
    let mut s = shown.join(", ");
    if ranks.len() > SHOWN_RANKS {
        s.push_str(&format!(" and {} more", ranks.len() - SHOWN_RANKS));
    }
    s
}

/// Write `bytes` to `path` by a temporary name in the same directory and a
/// rename, so a reader sees the old file or all of the new one.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let res = std::fs::File::create(&tmp)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, path));
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

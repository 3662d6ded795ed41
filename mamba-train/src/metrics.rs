//! The JSON-lines metrics log: one object per step, flushed as written, so a
//! run killed mid-way leaves every finished step on disk.
//!
//! Fields: `step` (steps completed), `loss`, `lr`, `grad_norm`,
//! `tokens_per_s` (wall-clock throughput of that step), `skipped` (this step)
//! and `skipped_steps` (run total). A non-finite loss or norm is written as
//! `null`.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// One line of the metrics file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MetricsRecord {
    /// Steps completed after this one.
    pub step: u64,
    /// Mean training loss of the step (`null` in JSON when not finite).
    #[serde(with = "finite_or_null")]
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping (`null` when not finite).
    #[serde(with = "finite_or_null")]
    pub grad_norm: f64,
    /// Tokens per second of this step.
    pub tokens_per_s: f64,
    /// Whether this step's update was skipped.
    pub skipped: bool,
    /// Skipped steps so far in the run.
    pub skipped_steps: u64,
}

/// Non-finite floats as JSON `null` (JSON has no NaN), read back as NaN.
mod finite_or_null {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else {
            s.serialize_none()
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }
}

fn io_err(path: &Path, source: std::io::Error) -> TrainError {
    TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// An open metrics file.
pub struct MetricsLog {
    path: PathBuf,
    file: File,
}

impl MetricsLog {
    /// Start a new log at `path` (truncating an old one).
    pub fn create(path: &Path) -> Result<Self> {
        let file = File::create(path).map_err(|e| io_err(path, e))?;
        Ok(MetricsLog {
            path: path.to_path_buf(),
            file,
        })
    }

    /// Continue the log at `path` after a resume from step `through`: lines
    /// of later steps (written after that checkpoint by the interrupted run)
    /// are dropped, so the file tells the history of the resumed run. A
    /// missing file starts empty.
    pub fn resume(path: &Path, through: u64) -> Result<Self> {
        // Keep the kept lines byte for byte (a parse/print round trip of a
        // float need not reproduce its text).
        let mut kept = String::new();
        if path.exists() {
            let text = std::fs::read_to_string(path).map_err(|e| io_err(path, e))?;
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let r: MetricsRecord = parse_line(path, i, line)?;
                if r.step <= through {
                    kept.push_str(line);
                    kept.push('\n');
                }
            }
        }
        let mut log = MetricsLog::create(path)?;
        log.file
            .write_all(kept.as_bytes())
            .map_err(|e| io_err(path, e))?;
        log.file.flush().map_err(|e| io_err(path, e))?;
        Ok(log)
    }

    /// Append one record and flush it.
    pub fn append(&mut self, r: &MetricsRecord) -> Result<()> {
        let mut line =
            serde_json::to_string(r).map_err(|e| io_err(&self.path, std::io::Error::other(e)))?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .map_err(|e| io_err(&self.path, e))?;
        self.file.flush().map_err(|e| io_err(&self.path, e))
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Read every record of a metrics file; a malformed line is an error that
/// names its line number.
pub fn read_records(path: &Path) -> Result<Vec<MetricsRecord>> {
    let f = OpenOptions::new()
        .read(true)
        .open(path)
        .map_err(|e| io_err(path, e))?;
    let mut out = Vec::new();
    for (i, line) in BufReader::new(f).lines().enumerate() {
        let line = line.map_err(|e| io_err(path, e))?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(parse_line(path, i, &line)?);
    }
    Ok(out)
}

fn parse_line(path: &Path, index: usize, line: &str) -> Result<MetricsRecord> {
    serde_json::from_str(line).map_err(|e| {
        TrainError::Data(format!(
            "{} line {}: not a metrics record: {e}",
            path.display(),
            index + 1
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(step: u64, loss: f64) -> MetricsRecord {
        MetricsRecord {
            step,
            loss,
            lr: 1e-3,
            grad_norm: 0.5,
            tokens_per_s: 100.0,
            skipped: !loss.is_finite(),
            skipped_steps: 0,
        }
    }

    #[test]
    fn lines_round_trip_and_resume_drops_later_steps() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("metrics.jsonl");
        let mut log = MetricsLog::create(&p).unwrap();
        for s in 1..=5 {
            log.append(&rec(s, 1.0 / s as f64)).unwrap();
        }
        log.append(&rec(6, f64::NAN)).unwrap();
        drop(log);
        let text = std::fs::read_to_string(&p).unwrap();
        assert_eq!(text.lines().count(), 6);
        assert!(
            text.lines().last().unwrap().contains("\"loss\":null"),
            "{text}"
        );
        let back = read_records(&p).unwrap();
        assert_eq!(
            back[..5],
            (1..=5).map(|s| rec(s, 1.0 / s as f64)).collect::<Vec<_>>()[..]
        );
        assert!(back[5].loss.is_nan());

        let before = std::fs::read_to_string(&p).unwrap();
        let mut log = MetricsLog::resume(&p, 3).unwrap();
        let kept = std::fs::read_to_string(&p).unwrap();
        assert_eq!(
            kept,
            before
                .lines()
                .take(3)
                .map(|l| format!("{l}\n"))
                .collect::<String>(),
            "kept byte for byte"
        );
        log.append(&rec(4, 9.0)).unwrap();
        let back = read_records(&p).unwrap();
        assert_eq!(
            back.iter().map(|r| r.step).collect::<Vec<_>>(),
            [1, 2, 3, 4]
        );
        assert_eq!(back[3].loss, 9.0);
    }

    #[test]
    fn a_malformed_line_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.jsonl");
        std::fs::write(&p, "{\"step\":1}\n").unwrap();
        let e = read_records(&p).unwrap_err().to_string();
        assert!(e.contains("line 1"), "{e}");
    }
}

//! Progress on stderr: an indicatif bar (loss, tokens/s) on a terminal, or a
//! plain line every N steps when stderr is a file or a pipe. Stdout is kept
//! for the final summary, whose last line is the weights digest.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::train::StepStats;

/// Reports training progress.
pub struct Progress {
    bar: Option<ProgressBar>,
    total: u64,
    log_every: u64,
    /// Exponential moving average of tokens/s, for display only.
    rate: Option<f64>,
}

impl Progress {
    /// A reporter for a run ending at step `total`, starting at `start`.
    /// `log_every` applies only without a terminal (`None`: ~20 lines).
    pub fn new(start: u64, total: u64, log_every: Option<u64>) -> Self {
        let log_every = log_every.unwrap_or((total / 20).max(1)).max(1);
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar =
                ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr_with_hz(4));
            let style = ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg} (eta {eta})",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar.set_position(start);
            bar.enable_steady_tick(Duration::from_millis(250));
            bar
        });
        Progress {
            bar,
            total,
            log_every,
            rate: None,
        }
    }

    /// Report one finished step that took `secs`.
    pub fn step(&mut self, s: &StepStats, secs: f64) {
        let now = s.tokens as f64 / secs.max(1e-9);
        let rate = match self.rate {
            Some(r) => 0.9 * r + 0.1 * now,
            None => now,
        };
        self.rate = Some(rate);
        let skipped = if s.skipped_total > 0 {
            format!(" | {} skipped", s.skipped_total)
        } else {
            String::new()
        };
        match &self.bar {
            Some(bar) => {
                bar.set_position(s.step);
                bar.set_message(format!(
                    "loss {:.4} | {} tok/s{skipped}",
                    s.loss,
                    human(rate)
                ));
            }
            None => {
                if s.step % self.log_every == 0 || s.step == self.total || s.step == 1 {
                    stderr_line(&format!(
                        "step {}/{}  loss {:.4}  lr {:.2e}  grad-norm {:.3}  {} tok/s{skipped}",
                        s.step,
                        self.total,
                        s.loss,
                        s.lr,
                        s.grad_norm,
                        human(rate)
                    ));
                }
            }
        }
    }

    /// Remove the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// `12345.0` -> `12.3k`.
pub fn human(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

/// Write `line` and a newline to stderr in one `write` call, so lines of
/// several ranks sharing one stderr (a pipe or a terminal) never
/// interleave mid-line (`eprintln!` may write a line in pieces). Errors
/// writing to stderr are ignored: there is nowhere left to report them.
pub fn stderr_line(line: &str) {
    use std::io::Write;
    let mut buf = String::with_capacity(line.len() + 1);
    buf.push_str(line);
    buf.push('\n');
    let _ = std::io::stderr().lock().write_all(buf.as_bytes());
}

//! Rank 0's run directory: the metrics log, the loss plot, and where
//! checkpoints go; what a fresh run replaces and what a resumed run keeps.

use std::fs;
use std::path::{Path, PathBuf};

use super::context::RankContext;
use super::progress::stderr_line;
use crate::checkpoint::{atomic, CHECKPOINTS_DIR};
use crate::error::{Result, TrainError};
use crate::metrics::{read_records, MetricsLog};
use crate::plot::loss_svg;
use crate::train::RunConfig;

/// Metrics file name in the run directory.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// Loss plot file name in the run directory.
pub const PLOT_FILE: &str = "loss.svg";
pub(crate) fn io_err(path: &Path, source: std::io::Error) -> TrainError {
    TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Rank 0's run directory: metrics log and where checkpoints go.
pub(crate) struct RunDir {
    pub(crate) path: PathBuf,
    pub(crate) metrics: MetricsLog,
    pub(crate) last_ck: Option<PathBuf>,
}

impl RunDir {
    /// Open (resumed in place) or start fresh (replacing a previous run's
    /// artifacts) the run directory of `ctx`, at `step`.
    pub(crate) fn open(ctx: &RankContext<'_>, step: u64) -> Result<RunDir> {
        let path = ctx.args.out.clone();
        fs::create_dir_all(&path).map_err(|e| io_err(&path, e))?;
        let in_place = ctx
            .resumed_from
            .as_ref()
            .is_some_and(|ck| same_run_dir(ck, &path));
        let metrics_path = path.join(METRICS_FILE);
        let metrics = if in_place {
            MetricsLog::resume(&metrics_path, step)?
        } else {
            clear_run_dir(&path)?;
            MetricsLog::create(&metrics_path)?
        };
        // A run resumed in its own directory already has this step's
        // checkpoint.
        let last_ck = ctx.resumed_from.clone().filter(|_| in_place);
        Ok(RunDir {
            path,
            metrics,
            last_ck,
        })
    }
}

/// True when the checkpoint `ck_dir` lives in `run_dir`'s checkpoints, i.e.
/// the run continues in its own directory.
fn same_run_dir(ck_dir: &Path, run_dir: &Path) -> bool {
    match (
        ck_dir.canonicalize(),
        run_dir.join(CHECKPOINTS_DIR).canonicalize(),
    ) {
        (Ok(a), Ok(b)) => a.starts_with(b),
        _ => false,
    }
}

/// A fresh run in an existing directory replaces the previous run's
/// artifacts (only the files this program writes; anything else stays).
fn clear_run_dir(run_dir: &Path) -> Result<()> {
    let ck = run_dir.join(CHECKPOINTS_DIR);
    let had = ck.exists() || run_dir.join(METRICS_FILE).exists();
    if ck.exists() {
        fs::remove_dir_all(&ck).map_err(|e| io_err(&ck, e))?;
    }
    for f in [METRICS_FILE, PLOT_FILE] {
        let p = run_dir.join(f);
        if p.exists() {
            fs::remove_file(&p).map_err(|e| io_err(&p, e))?;
        }
    }
    if had {
        stderr_line(&format!(
            "note: starting a fresh run in {} (the previous run's checkpoints and metrics there are replaced; use --resume to continue one)",
            run_dir.display()
        ));
    }
    Ok(())
}

pub(crate) fn write_plot(run_dir: &Path, run: &RunConfig) -> Result<()> {
    let records = read_records(&run_dir.join(METRICS_FILE))?;
    let pts: Vec<(u64, f64)> = records.iter().map(|r| (r.step, r.loss)).collect();
    let title = format!(
        "{}: d_model {}, {} layers, batch {} x {}, seed {}",
        run.task.kind(),
        run.model.d_model,
        run.model.n_layer,
        run.batch,
        run.logical_world,
        run.seed
    );
    let path = run_dir.join(PLOT_FILE);
    atomic::replace_file(&path, loss_svg(&title, &pts).as_bytes()).map_err(|e| io_err(&path, e))
}

//! `cargo xtask kernels`: compile every `kernels/cuda/*.cu` for sm_90 with
//! the build's own flags and print ptxas resource usage per kernel
//! (registers, shared memory, stack, spills, constant memory).
//!
//! nvcc is found exactly as `kernels/build.rs` finds it (the search and the
//! flags live in `kernels/build/nvcc.rs`, shared by `#[path]`); a missing
//! nvcc is an error that says how to install it.

#[path = "../../kernels/build/nvcc.rs"]
mod nvcc;

use std::path::Path;
use std::process::Command;

use crate::util::{workspace_root, TaskResult};

/// The architecture the report is for (the H200s are sm_90).
const REPORT_ARCH: &str = "sm_90";

pub fn run() -> TaskResult {
    let env = |k: &str| std::env::var_os(k);
    let nvcc_path = match nvcc::find(&env, None, None)? {
        nvcc::Search::Found { nvcc, .. } => nvcc,
        nvcc::Search::Absent { looked } => {
            return Err(format!(
                "no nvcc found (looked at: {}). Run scripts/install-nvcc.sh and set NVCC to the \
                 path it prints",
                looked.join("; ")
            ))
        }
    };
    let cuda_dir = workspace_root().join("kernels").join("cuda");
    let sources = nvcc::cuda_sources(&cuda_dir)?;
    if sources.is_empty() {
        return Err(format!("no .cu files in {}", cuda_dir.display()));
    }
    // The cubins stay there for inspection (cuobjdump/nvdisasm elsewhere).
    let scratch = workspace_root().join("target").join("xtask-kernels");
    std::fs::create_dir_all(&scratch)
        .map_err(|e| format!("cannot create {}: {e}", scratch.display()))?;
    println!("nvcc: {}", nvcc_path.display());
    println!(
        "ptxas resource usage for {REPORT_ARCH} (build flags: -O3, IEEE div/sqrt; --fmad per \
         file: true for {:?}, false for the rest)\n",
        nvcc::FMA_CONTRACTED
    );

    let mut rows = Vec::new();
    for source in &sources {
        let module = nvcc::module_name(source)?;
        let log = ptxas_report(
            &nvcc_path,
            &cuda_dir,
            source,
            &module,
            &scratch.join(format!("{module}.cubin")),
        )?;
        let kernels = parse_ptxas(&log);
        if kernels.is_empty() {
            println!("{module}: no kernels");
        }
        rows.extend(kernels.into_iter().map(|k| (module.clone(), k)));
    }
    print!("{}", render_table(&rows));
    let spilling: Vec<&str> = rows
        .iter()
        .filter(|(_, k)| k.spill_stores > 0 || k.spill_loads > 0)
        .map(|(_, k)| k.name.as_str())
        .collect();
    println!(
        "\n{} kernel(s) in {} file(s); {} with spills{}",
        rows.len(),
        sources.len(),
        spilling.len(),
        if spilling.is_empty() {
            String::new()
        } else {
            format!(": {}", spilling.join(", "))
        }
    );
    Ok(())
}

/// Compile one file to an sm_90 cubin with `-Xptxas -v`; returns ptxas'
/// report (nvcc prints it on stderr).
fn ptxas_report(
    nvcc_path: &Path,
    include_dir: &Path,
    source: &Path,
    module: &str,
    cubin: &Path,
) -> Result<String, String> {
    let mut cmd = Command::new(nvcc_path);
    cmd.arg("--cubin")
        .args(nvcc::common_flags(include_dir, module))
        .arg("-gencode")
        .arg(format!(
            "arch={},code={REPORT_ARCH}",
            REPORT_ARCH.replace("sm_", "compute_")
        ))
        .args(["-Xptxas", "-v"])
        .arg("-o")
        .arg(cubin)
        .arg(source);
    let output = cmd
        .output()
        .map_err(|e| format!("cannot run {}: {e}", nvcc_path.display()))?;
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    if !output.status.success() {
        return Err(format!(
            "{} did not compile ({}):\n{}{stderr}",
            source.display(),
            output.status,
            String::from_utf8_lossy(&output.stdout)
        ));
    }
    Ok(stderr)
}

/// One kernel's line of the report.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct KernelUsage {
    pub name: String,
    pub registers: u32,
    pub shared_bytes: u64,
    pub stack_bytes: u64,
    pub spill_stores: u64,
    pub spill_loads: u64,
    pub constant_bytes: u64,
}

/// Parse `ptxas -v` output: a "Compiling entry function 'NAME'" line opens
/// a kernel, "N bytes stack frame, N bytes spill stores, N bytes spill
/// loads" and "Used N registers, ..., N bytes smem, N bytes cmem\[0\]" fill it.
pub fn parse_ptxas(log: &str) -> Vec<KernelUsage> {
    let mut kernels: Vec<KernelUsage> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or(rest).to_string();
            kernels.push(KernelUsage {
                name,
                ..KernelUsage::default()
            });
            continue;
        }
        let Some(current) = kernels.last_mut() else {
            continue;
        };
        if line.contains("bytes stack frame") {
            for part in line.split(',') {
                let n = leading_number(part);
                if part.contains("stack frame") {
                    current.stack_bytes = n;
                } else if part.contains("spill stores") {
                    current.spill_stores = n;
                } else if part.contains("spill loads") {
                    current.spill_loads = n;
                }
            }
        } else if let Some(used) = line.split("Used ").nth(1) {
            for part in used.split(',') {
                let n = leading_number(part);
                if part.contains("registers") {
                    current.registers = u32::try_from(n).unwrap_or(u32::MAX);
                } else if part.contains("smem") {
                    current.shared_bytes += n;
                } else if part.contains("cmem") {
                    current.constant_bytes += n;
                }
            }
        }
    }
    kernels
}

fn leading_number(text: &str) -> u64 {
    let digits: String = text
        .trim()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().unwrap_or(0)
}

fn render_table(rows: &[(String, KernelUsage)]) -> String {
    let header = [
        "module",
        "kernel",
        "regs",
        "smem B",
        "stack B",
        "spill st B",
        "spill ld B",
        "cmem B",
    ];
    let mut lines: Vec<[String; 8]> = vec![header.map(String::from)];
    for (module, k) in rows {
        lines.push([
            module.clone(),
            k.name.clone(),
            k.registers.to_string(),
            k.shared_bytes.to_string(),
            k.stack_bytes.to_string(),
            k.spill_stores.to_string(),
            k.spill_loads.to_string(),
            k.constant_bytes.to_string(),
        ]);
    }
    let mut widths = [0usize; 8];
    for line in &lines {
        for (w, cell) in widths.iter_mut().zip(line) {
            *w = (*w).max(cell.len());
        }
    }
    let mut out = String::new();
    for line in &lines {
        let cells: Vec<String> = line
            .iter()
            .zip(widths)
            .enumerate()
            .map(|(i, (cell, w))| {
                if i < 2 {
                    format!("{cell:<w$}")
                } else {
                    format!("{cell:>w$}")
                }
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'det_accumulate_ranks_f32' for 'sm_90'
ptxas info    : Function properties for det_accumulate_ranks_f32
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 44 registers, used 0 barriers
ptxas info    : Compiling entry function '_Z4scanILi16EEvPf' for 'sm_90'
ptxas info    : Function properties for _Z4scanILi16EEvPf
    24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 4096 bytes smem, 392 bytes cmem[0]
";

    #[test]
    fn parses_ptxas_verbose_output() {
        let kernels = parse_ptxas(LOG);
        assert_eq!(
            kernels,
            vec![
                KernelUsage {
                    name: "det_accumulate_ranks_f32".into(),
                    registers: 44,
                    ..Default::default()
                },
                KernelUsage {
                    name: "_Z4scanILi16EEvPf".into(),
                    registers: 255,
                    shared_bytes: 4096,
                    stack_bytes: 24,
                    spill_stores: 8,
                    spill_loads: 12,
                    constant_bytes: 392,
                },
            ]
        );
        assert!(parse_ptxas("ptxas info    : 0 bytes gmem\n").is_empty());
    }

    #[test]
    fn table_has_a_row_per_kernel() {
        let rows: Vec<(String, KernelUsage)> = parse_ptxas(LOG)
            .into_iter()
            .map(|k| ("fold".to_string(), k))
            .collect();
        let table = render_table(&rows);
        assert_eq!(table.lines().count(), 3, "{table}");
        assert!(table
            .lines()
            .nth(2)
            .is_some_and(|l| l.contains("_Z4scanILi16EEvPf") && l.contains("255")));
    }
}

//! Finding nvcc and the device flags every kernel is compiled with.
//!
//! This file is shared, by `#[path]`, between `kernels/build.rs` and
//! `xtask/src/kernels.rs`, so the embedded fatbins and the resource report of
//! `cargo xtask kernels` come from the same compiler and the same flags. It
//! uses only `std`.
//!
//! Search order (the one `cc` documents for CUDA, extended with the CUDA
//! toolkit variables and the project's own install location):
//! 1. `NVCC` (and its target-prefixed forms `NVCC_<target>`, as `cc` reads
//!    them): the whole value is the path. Set but not a file is an error,
//!    never a silent fallback: the user asked for that compiler.
//! 2. `CUDA_HOME`, then `CUDA_PATH`: `<dir>/bin/nvcc` when that file exists
//!    (these are often set for the run-time libraries alone, so a toolkit
//!    without nvcc falls through).
//! 3. `nvcc` on `PATH`.
//! 4. [`FALLBACK_NVCC`], where `scripts/install-nvcc.sh` installs it.

#![allow(dead_code)] // each includer uses a different part

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Where `scripts/install-nvcc.sh` puts its venv by default.
pub const FALLBACK_PREFIX: &str = "/opt/nvcc";

/// nvcc inside that venv with GPU.md's Python 3.11; another Python 3 minor
/// version is found too (see [`fallback_path`]).
pub const FALLBACK_NVCC: &str = "/opt/nvcc/lib/python3.11/site-packages/nvidia/cu13/bin/nvcc";

/// The CUDA release the GPU machines run (driver and toolkit 13.0). A newer
/// nvcc emits PTX whose `.version` that driver rejects.
pub const EXPECTED_RELEASE: &str = "13.0";

/// Environment variables that decide which nvcc is found (besides PATH,
/// which matters only when none of them does).
pub const DISCOVERY_VARS: &[&str] = &["NVCC", "CUDA_HOME", "CUDA_PATH"];

/// Real GPU architectures that get SASS, and the virtual one whose PTX is
/// embedded for the driver to JIT on newer GPUs.
pub const SASS_ARCHS: &[&str] = &["sm_80", "sm_90"];
pub const PTX_ARCH: &str = "compute_90";

/// How nvcc was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Via {
    /// An `NVCC` variable (named).
    Var(String),
    /// `<CUDA_HOME or CUDA_PATH>/bin/nvcc` (the variable named).
    Toolkit(String),
    /// A directory on `PATH`.
    Path,
    /// [`FALLBACK_NVCC`].
    Fallback,
}

/// The outcome of a search that did not hit a hard error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Search {
    Found {
        nvcc: PathBuf,
        via: Via,
    },
    /// Nothing found; one line per place looked at, for the error message.
    Absent {
        looked: Vec<String>,
    },
}

/// The `NVCC` variable names `cc` consults, most specific first:
/// `NVCC_<target>`, `NVCC_<target with underscores>`, `HOST_NVCC` (or
/// `TARGET_NVCC` when cross compiling), `NVCC`.
pub fn nvcc_var_names(target: Option<&str>, host: Option<&str>) -> Vec<String> {
    let mut names = Vec::new();
    if let Some(t) = target {
        names.push(format!("NVCC_{t}"));
        names.push(format!("NVCC_{}", t.replace('-', "_")));
        let kind = if host.is_none_or(|h| h == t) {
            "HOST"
        } else {
            "TARGET"
        };
        names.push(format!("{kind}_NVCC"));
    }
    names.push("NVCC".to_string());
    names
}

/// Overrides [`FALLBACK_NVCC`]: another path, or `off` to skip the fallback
/// (how to test a build without nvcc on a machine that has /opt/nvcc).
pub const FALLBACK_VAR: &str = "MAMBA_NVCC_FALLBACK";

/// The fallback nvcc path: [`FALLBACK_VAR`] if set and not empty (`None`
/// for `off`), else nvcc in the venv at [`FALLBACK_PREFIX`] under whichever
/// `lib/python3.*` it has ([`FALLBACK_NVCC`] when there is none, for the
/// message).
pub fn fallback_path(env: &dyn Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    match non_empty(env(FALLBACK_VAR)) {
        Some(v) if v == "off" => None,
        Some(v) => Some(PathBuf::from(v)),
        None => Some(
            venv_nvcc(Path::new(FALLBACK_PREFIX)).unwrap_or_else(|| PathBuf::from(FALLBACK_NVCC)),
        ),
    }
}

/// `<prefix>/lib/python3.*/site-packages/nvidia/cu13/bin/nvcc`, the first
/// that exists in name order.
pub fn venv_nvcc(prefix: &Path) -> Option<PathBuf> {
    let mut libs: Vec<PathBuf> = std::fs::read_dir(prefix.join("lib"))
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("python3"))
        })
        .collect();
    libs.sort();
    libs.into_iter()
        .map(|lib| lib.join("site-packages/nvidia/cu13/bin").join(exe("nvcc")))
        .find(|nvcc| nvcc.is_file())
}

fn non_empty(v: Option<OsString>) -> Option<OsString> {
    v.filter(|s| !s.is_empty())
}

/// Search for nvcc. `env` reads one variable, `target`/`host` are Cargo's
/// triples when known (`None` outside a build script).
///
/// Errors: an `NVCC` variable that names no file.
pub fn find(
    env: &dyn Fn(&str) -> Option<OsString>,
    target: Option<&str>,
    host: Option<&str>,
) -> Result<Search, String> {
    let mut looked = Vec::new();
    for var in nvcc_var_names(target, host) {
        if let Some(value) = non_empty(env(&var)) {
            let path = PathBuf::from(&value);
            if path.is_file() {
                return Ok(Search::Found {
                    nvcc: path,
                    via: Via::Var(var),
                });
            }
            return Err(format!(
                "{var}={} does not name a file; expected the path of nvcc \
                 (scripts/install-nvcc.sh prints it), or unset {var}",
                path.display()
            ));
        }
    }
    looked.push("NVCC: unset".to_string());
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        match non_empty(env(var)) {
            Some(dir) => {
                let candidate = Path::new(&dir).join("bin").join(exe("nvcc"));
                if candidate.is_file() {
                    return Ok(Search::Found {
                        nvcc: candidate,
                        via: Via::Toolkit(var.into()),
                    });
                }
                looked.push(format!("{var}: {} does not exist", candidate.display()));
            }
            None => looked.push(format!("{var}: unset")),
        }
    }
    match non_empty(env("PATH")) {
        Some(path) => {
            for dir in std::env::split_paths(&path) {
                let candidate = dir.join(exe("nvcc"));
                if candidate.is_file() {
                    return Ok(Search::Found {
                        nvcc: candidate,
                        via: Via::Path,
                    });
                }
            }
            looked.push("PATH: no nvcc in any of its directories".to_string());
        }
        None => looked.push("PATH: unset".to_string()),
    }
    match fallback_path(env) {
        Some(fallback) if fallback.is_file() => {
            return Ok(Search::Found {
                nvcc: fallback,
                via: Via::Fallback,
            });
        }
        Some(fallback) => looked.push(format!("{}: does not exist", fallback.display())),
        None => looked.push(format!("the fallback: {FALLBACK_VAR}=off")),
    }
    Ok(Search::Absent { looked })
}

fn exe(name: &str) -> String {
    format!("{name}{}", std::env::consts::EXE_SUFFIX)
}

/// What a kernel file promises about its bits, which decides whether nvcc
/// may contract `a * b + c` into one FMA there (the `--fmad` table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Contract {
    /// Bit-equal to a CPU twin (the host fold, the host optimizer): no
    /// contraction, so every `a * b + c` is the two roundings the CPU code
    /// performs.
    BitEqualToHost,
    /// Within a stated tolerance of the CPU model (and the same bits run to
    /// run: contraction is decided at compile time): FMA contraction on.
    Tolerance,
}

/// The kernel files whose contract is [`Contract::Tolerance`]; every other
/// file (a new one included) is [`Contract::BitEqualToHost`], so a file
/// gains contraction only by being listed here:
/// - `mamba_ops`, `mamba_scan`, `mamba_ssd`, `mamba_ssd_tc`: the CUDA
///   model's forward and backward, pinned to the CPU f32/f64 model by the
///   `cuda_parity`/`cuda_scan`/`cuda_mamba2` tolerances (and the SSD files
///   by their emulated check against an f64 recurrence);
/// - `mamba_decode`: the recurrent decoder, pinned by `cuda_decode`'s
///   tolerance against the CPU decoder.
///
/// `fold` (the reducer's fold, bit-equal to the host fold and the emulated
/// oracle) and `mamba_optim` (AdamW and the gradient-norm sums, bit-equal to
/// the CPU optimizer) are not listed.
pub const FMA_CONTRACTED: &[&str] = &[
    "mamba_ops",
    "mamba_scan",
    "mamba_ssd",
    "mamba_ssd_tc",
    "mamba_decode",
];

/// The contract of the kernel file with stem `module` (file name without
/// `.cu`).
pub fn contract(module: &str) -> Contract {
    if FMA_CONTRACTED.contains(&module) {
        Contract::Tolerance
    } else {
        Contract::BitEqualToHost
    }
}

/// Device-side flags for the kernel file with stem `module`, after the
/// compiler itself and before `-o OUT SRC`: [`common_flags`] then
/// [`gencode_flags`].
pub fn device_flags(include_dir: &Path, module: &str) -> Vec<OsString> {
    let mut flags = common_flags(include_dir, module);
    flags.extend(gencode_flags());
    flags
}

/// Everything but the target architectures.
///
/// Determinism: `--fmad` follows the file's [`contract`]: `false` where a
/// CPU twin needs the same bits (a kernel there that wants an FMA writes
/// `__fmaf_rn` explicitly), `true` where the contract is a tolerance
/// (contraction is a compile-time decision, so the bits are still the same
/// run to run). The IEEE defaults are spelled out (`--ftz=false`,
/// `--prec-div=true`, `--prec-sqrt=true`) so they hold whatever nvcc's
/// defaults become. There is no `--use_fast_math`.
pub fn common_flags(include_dir: &Path, module: &str) -> Vec<OsString> {
    let fmad = match contract(module) {
        Contract::BitEqualToHost => "--fmad=false",
        Contract::Tolerance => "--fmad=true",
    };
    let mut flags: Vec<OsString> = [
        "-std=c++17",
        "-O3",
        fmad,
        "--ftz=false",
        "--prec-div=true",
        "--prec-sqrt=true",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    flags.push("-I".into());
    flags.push(include_dir.as_os_str().to_owned());
    flags
}

/// SASS for each of [`SASS_ARCHS`] and PTX for [`PTX_ARCH`].
pub fn gencode_flags() -> Vec<OsString> {
    let mut flags = Vec::new();
    for sm in SASS_ARCHS {
        let compute = sm.replace("sm_", "compute_");
        flags.push("-gencode".into());
        flags.push(format!("arch={compute},code={sm}").into());
    }
    flags.push("-gencode".into());
    flags.push(format!("arch={PTX_ARCH},code={PTX_ARCH}").into());
    flags
}

/// Every `*.cu` file directly inside `dir`, sorted by name so the embedded
/// table's order does not depend on the file system.
pub fn cuda_sources(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("cannot list {}: {e}", dir.display())),
    };
    let mut sources = Vec::new();
    for entry in entries {
        let path = entry
            .map_err(|e| format!("cannot list {}: {e}", dir.display()))?
            .path();
        if path.extension().is_some_and(|e| e == "cu") && path.is_file() {
            sources.push(path);
        }
    }
    sources.sort();
    Ok(sources)
}

/// The module name of a kernel file: its stem, which must be a plain
/// identifier (`[A-Za-z0-9_]`, not starting with a digit) so it can be named
/// from Rust and printed unambiguously.
pub fn module_name(source: &Path) -> Result<String, String> {
    let stem = source
        .file_stem()
        .and_then(|s| s.to_str())
        .ok_or_else(|| format!("{}: file name is not UTF-8", source.display()))?;
    let ok = !stem.is_empty()
        && !stem.starts_with(|c: char| c.is_ascii_digit())
        && stem.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ok {
        Ok(stem.to_string())
    } else {
        Err(format!(
            "{}: kernel file names must be identifiers ([A-Za-z0-9_], not starting \
             with a digit), so the module can be named as `kernels::load_module(ctx, \"{stem}\")`",
            source.display()
        ))
    }
}

/// `release X.Y` from `nvcc --version` output.
pub fn release_of(version_output: &str) -> Option<String> {
    let at = version_output.find("release ")? + "release ".len();
    let rest = &version_output[at..];
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    let release = &rest[..end];
    (!release.is_empty()).then(|| release.to_string())
}

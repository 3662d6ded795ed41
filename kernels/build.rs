//! Compiles every `kernels/cuda/*.cu` into a fatbin and embeds the lot.
//!
//! - nvcc is found as `build/nvcc.rs` describes (`NVCC`, `CUDA_HOME`,
//!   `CUDA_PATH`, `PATH`, then `/opt/nvcc` unless `MAMBA_NVCC_FALLBACK=off`),
//!   and is then driven through
//!   `cc` (`cc::Build::cuda`), which adds the host compiler (`-ccbin`, from
//!   `CXX`) and honours `NVCC_PREPEND_FLAGS`/`NVCC_APPEND_FLAGS`.
//! - Each file becomes `OUT_DIR/<stem>.fatbin` holding SASS for sm_80 and
//!   sm_90 plus compute_90 PTX, without fast math; FMA contraction
//!   (`--fmad`) per the file's bit contract (`nvcc::contract`: off where a
//!   CPU twin needs the same bits, on where the contract is a tolerance).
//! - `OUT_DIR/kernels_table.rs` (included by `src/embedded.rs`) lists every
//!   module with its image through `include_bytes!`, 16-byte aligned.
//! - Without nvcc the build still succeeds with an empty table and a reason
//!   string that the run-time error repeats; with `MAMBA_REQUIRE_KERNELS=1`
//!   a missing nvcc fails the build instead. A kernel that does not compile
//!   always fails the build.

#[path = "build/nvcc.rs"]
mod nvcc;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

const REQUIRE_VAR: &str = "MAMBA_REQUIRE_KERNELS";

/// First four bytes of every fatbin (the little-endian magic 0xBA55ED50).
const FATBIN_MAGIC: [u8; 4] = [0x50, 0xED, 0x55, 0xBA];

fn main() {
    if let Err(message) = run() {
        eprintln!("error: kernels build failed: {message}");
        std::process::exit(1);
    }
}

fn var(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|e| format!("cargo did not set {name}: {e}"))
}

fn run() -> Result<(), String> {
    let manifest = PathBuf::from(var("CARGO_MANIFEST_DIR")?);
    let out_dir = PathBuf::from(var("OUT_DIR")?);
    let target = std::env::var("TARGET").ok();
    let host = std::env::var("HOST").ok();
    let cuda_dir = manifest.join("cuda");

    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=build/nvcc.rs");
    // A directory: cargo rescans everything below it, so a new .cu or .cuh
    // file triggers a rebuild as well as an edited one.
    println!("cargo:rerun-if-changed=cuda");
    for name in nvcc::nvcc_var_names(target.as_deref(), host.as_deref()) {
        println!("cargo:rerun-if-env-changed={name}");
    }
    for name in ["CUDA_HOME", "CUDA_PATH", nvcc::FALLBACK_VAR, REQUIRE_VAR] {
        println!("cargo:rerun-if-env-changed={name}");
    }

    let sources = nvcc::cuda_sources(&cuda_dir)?;
    let names = sources
        .iter()
        .map(|s| nvcc::module_name(s))
        .collect::<Result<Vec<_>, _>>()?;
    for source in &sources {
        println!("cargo:rerun-if-changed={}", source.display());
    }
    let require = require_kernels()?;

    let env = |k: &str| std::env::var_os(k);
    let search = nvcc::find(&env, target.as_deref(), host.as_deref())?;
    match search {
        nvcc::Search::Absent { looked } => {
            // Installing nvcc onto PATH must be noticed by the next build.
            println!("cargo:rerun-if-env-changed=PATH");
            let looked = looked.join("; ");
            if require {
                return Err(format!(
                    "{REQUIRE_VAR}=1 but no nvcc was found (looked at: {looked}). Run \
                     scripts/install-nvcc.sh and set NVCC to the path it prints (or set \
                     CUDA_HOME, or put nvcc on PATH), or unset {REQUIRE_VAR} to build \
                     without kernels"
                ));
            }
            println!(
                "cargo:warning=no nvcc found, so the {} CUDA kernel file(s) are not embedded and \
                 GPU calls will fail with KernelError::NotBuilt; run scripts/install-nvcc.sh and \
                 set NVCC to the path it prints",
                sources.len()
            );
            let reason = format!("this build found no nvcc (looked at: {looked})");
            write_table(&out_dir, &names, None, &reason)
        }
        nvcc::Search::Found {
            nvcc: nvcc_path,
            via,
        } => {
            // PATH decided the outcome unless a variable named the compiler.
            if matches!(via, nvcc::Via::Path | nvcc::Via::Fallback) {
                println!("cargo:rerun-if-env-changed=PATH");
            }
            // A different nvcc at the same path (an upgrade) recompiles.
            println!("cargo:rerun-if-changed={}", nvcc_path.display());
            let release = nvcc_release(&nvcc_path)?;
            if release != nvcc::EXPECTED_RELEASE {
                println!(
                    "cargo:warning={} is CUDA {release}; the GPU machines run CUDA {} and may \
                     reject its PTX (scripts/install-nvcc.sh installs the pinned one)",
                    nvcc_path.display(),
                    nvcc::EXPECTED_RELEASE
                );
            }
            let nvcc_var_set = matches!(via, nvcc::Via::Var(_));
            let tool = cc_tool(&nvcc_path, nvcc_var_set)?;
            let fatbins = compile_all(&tool, &cuda_dir, &sources, &names, &out_dir)?;
            write_table(&out_dir, &names, Some((&fatbins, &release)), "")
        }
    }
}

/// `MAMBA_REQUIRE_KERNELS`: unset, empty, 0/false/no/off mean no; 1/true/yes/on
/// mean yes; anything else is an error rather than a guess.
fn require_kernels() -> Result<bool, String> {
    let Some(value) = std::env::var_os(REQUIRE_VAR) else {
        return Ok(false);
    };
    let value = value.to_string_lossy().trim().to_ascii_lowercase();
    match value.as_str() {
        "" | "0" | "false" | "no" | "off" => Ok(false),
        "1" | "true" | "yes" | "on" => Ok(true),
        other => Err(format!("{REQUIRE_VAR}={other:?}: expected 1 or 0")),
    }
}

fn nvcc_release(nvcc_path: &Path) -> Result<String, String> {
    let output = Command::new(nvcc_path)
        .arg("--version")
        .output()
        .map_err(|e| format!("cannot run {} --version: {e}", nvcc_path.display()))?;
    let text = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!(
            "{} --version failed with {}: {}{}",
            nvcc_path.display(),
            output.status,
            text,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    nvcc::release_of(&text).ok_or_else(|| {
        format!(
            "{} --version printed no `release X.Y`: {text}",
            nvcc_path.display()
        )
    })
}

/// nvcc as `cc` configures it. `cc` reads nvcc from `NVCC` (else `nvcc` on
/// PATH); when our search found it elsewhere, `NVCC` is set in this build
/// script's own environment (single-threaded at this point) so `cc` runs the
/// same binary.
fn cc_tool(nvcc_path: &Path, nvcc_var_set: bool) -> Result<cc::Tool, String> {
    if !nvcc_var_set {
        std::env::set_var("NVCC", nvcc_path);
    }
    let mut build = cc::Build::new();
    build
        .cuda(true)
        .debug(false)
        .opt_level(3)
        .no_default_flags(true);
    build
        .try_get_compiler()
        .map_err(|e| format!("cc could not configure nvcc: {e}"))
}

/// Compile every source to `OUT_DIR/<name>.fatbin`, in parallel (cargo's
/// `NUM_JOBS`), and check each image starts with the fatbin magic. Stale
/// images of removed files are never listed: the table names only `names`.
fn compile_all(
    tool: &cc::Tool,
    include_dir: &Path,
    sources: &[PathBuf],
    names: &[String],
    out_dir: &Path,
) -> Result<Vec<PathBuf>, String> {
    let jobs = std::env::var("NUM_JOBS")
        .ok()
        .and_then(|j| j.parse::<usize>().ok())
        .unwrap_or(1)
        .clamp(1, sources.len().max(1));
    let outputs: Vec<PathBuf> = names
        .iter()
        .map(|n| out_dir.join(format!("{n}.fatbin")))
        .collect();
    let shared = shared_inputs(include_dir)?;
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::<(usize, String)>::new());
    let warnings = Mutex::new(Vec::<(usize, String)>::new());
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= sources.len() {
                    break;
                }
                match compile_one(
                    tool,
                    include_dir,
                    &shared,
                    &sources[i],
                    &names[i],
                    &outputs[i],
                ) {
                    Ok(stderr) if stderr.trim().is_empty() => {}
                    Ok(stderr) => push(&warnings, i, stderr),
                    Err(e) => push(&failures, i, e),
                }
            });
        }
    });
    let mut warnings = warnings.into_inner().unwrap_or_else(|p| p.into_inner());
    warnings.sort();
    for (_, text) in warnings {
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            println!("cargo:warning={line}");
        }
    }
    let mut failures = failures.into_inner().unwrap_or_else(|p| p.into_inner());
    failures.sort();
    if !failures.is_empty() {
        let all: Vec<String> = failures.into_iter().map(|(_, e)| e).collect();
        return Err(all.join("\n\n"));
    }
    Ok(outputs)
}

fn push(list: &Mutex<Vec<(usize, String)>>, i: usize, text: String) {
    list.lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((i, text));
}

/// One nvcc run; Ok carries nvcc's stderr (warnings) for the caller to show.
///
/// A fatbin whose inputs ([`cache_key`]) are byte-identical to those of
/// the previous build is reused, so editing one kernel file recompiles only
/// that file (plus all of them when a shared header changes).
fn compile_one(
    tool: &cc::Tool,
    include_dir: &Path,
    shared: &[u8],
    source: &Path,
    module: &str,
    output: &Path,
) -> Result<String, String> {
    let mut cmd = tool.to_command();
    cmd.arg("--fatbin");
    cmd.args(nvcc::device_flags(include_dir, module));
    cmd.arg("-o").arg(output).arg(source);
    let shown = render(&cmd);
    let key = cache_key(&shown, tool.path(), source, shared)?;
    let key_path = output.with_extension("fatbin.inputs");
    let cached = std::fs::read(&key_path).is_ok_and(|old| old == key);
    if cached && std::fs::read(output).is_ok_and(|image| is_fatbin(&image)) {
        return Ok(String::new());
    }
    // A failed or interrupted compile must not leave a key behind.
    let _ = std::fs::remove_file(&key_path);
    let result = cmd
        .output()
        .map_err(|e| format!("cannot start {shown}: {e}"))?;
    let stderr = String::from_utf8_lossy(&result.stderr).into_owned();
    if !result.status.success() {
        return Err(format!(
            "{} did not compile ({}):\n{}{}\ncommand: {shown}",
            source.display(),
            result.status,
            String::from_utf8_lossy(&result.stdout),
            stderr
        ));
    }
    let image = std::fs::read(output)
        .map_err(|e| format!("nvcc wrote no {}: {e} (command: {shown})", output.display()))?;
    if !is_fatbin(&image) {
        return Err(format!(
            "{} is not a fatbin (first bytes {:02x?}, expected {:02x?}); command: {shown}",
            output.display(),
            &image[..image.len().min(4)],
            FATBIN_MAGIC
        ));
    }
    std::fs::write(&key_path, &key)
        .map_err(|e| format!("cannot write {}: {e}", key_path.display()))?;
    Ok(stderr)
}

fn is_fatbin(image: &[u8]) -> bool {
    image.len() >= 16 && image[..4] == FATBIN_MAGIC
}

/// Every input of one compile, as bytes: the command line, the environment
/// nvcc reads itself, the size and modification time of the nvcc binary,
/// the source, and `shared` (the other files of `kernels/cuda`, which the
/// source may include).
fn cache_key(
    shown: &str,
    nvcc_path: &Path,
    source: &Path,
    shared: &[u8],
) -> Result<Vec<u8>, String> {
    let mut key = Vec::new();
    key.extend_from_slice(shown.as_bytes());
    for var in ["NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN"] {
        key.extend_from_slice(format!("\0{var}={:?}", std::env::var_os(var)).as_bytes());
    }
    let meta = std::fs::metadata(nvcc_path)
        .map_err(|e| format!("cannot stat {}: {e}", nvcc_path.display()))?;
    key.extend_from_slice(
        format!(
            "\0nvcc {} bytes, modified {:?}\0",
            meta.len(),
            meta.modified().ok()
        )
        .as_bytes(),
    );
    key.extend_from_slice(
        &std::fs::read(source).map_err(|e| format!("cannot read {}: {e}", source.display()))?,
    );
    key.push(0);
    key.extend_from_slice(shared);
    Ok(key)
}

/// Names and contents of every file below `dir` that is not itself a
/// kernel file (`.cu`), in path order: the headers kernels may include.
fn shared_inputs(dir: &Path) -> Result<Vec<u8>, String> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        let entries =
            std::fs::read_dir(&d).map_err(|e| format!("cannot list {}: {e}", d.display()))?;
        for entry in entries {
            let path = entry
                .map_err(|e| format!("cannot list {}: {e}", d.display()))?
                .path();
            if path.is_dir() {
                pending.push(path);
            } else if d != dir || path.extension().is_none_or(|e| e != "cu") {
                files.push(path);
            }
        }
    }
    files.sort();
    let mut bytes = Vec::new();
    for file in files {
        bytes.extend_from_slice(file.to_string_lossy().as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(
            &std::fs::read(&file).map_err(|e| format!("cannot read {}: {e}", file.display()))?,
        );
        bytes.push(0);
    }
    Ok(bytes)
}

/// `program arg arg ...` (cc's commands carry a whole environment, which
/// `{:?}` would print too).
fn render(cmd: &Command) -> String {
    let mut shown = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        shown.push(' ');
        shown.push_str(&arg.to_string_lossy());
    }
    shown
}

/// Write `OUT_DIR/kernels_table.rs`. `built` is `Some((fatbins, release))`
/// when nvcc ran; `absent_reason` explains an empty table.
fn write_table(
    out_dir: &Path,
    names: &[String],
    built: Option<(&[PathBuf], &str)>,
    absent_reason: &str,
) -> Result<(), String> {
    let mut code = String::from("// @generated by kernels/build.rs: do not edit.\n");
    let (fatbins, release) = match built {
        Some((fatbins, release)) => (fatbins, release),
        None => (&[][..], ""),
    };
    let _ = writeln!(
        code,
        "pub(crate) const BUILT_WITH_NVCC: bool = {};",
        built.is_some()
    );
    let _ = writeln!(code, "pub(crate) const NVCC_RELEASE: &str = {release:?};");
    let _ = writeln!(
        code,
        "pub(crate) const ABSENT_REASON: &str = {absent_reason:?};"
    );
    let _ = writeln!(code, "pub(crate) static SOURCES: &[&str] = &{names:?};");
    for (i, path) in fatbins.iter().enumerate() {
        let path = path
            .to_str()
            .ok_or_else(|| format!("OUT_DIR path is not UTF-8: {}", path.display()))?;
        let _ = writeln!(
            code,
            "const FATBIN_{i}: &Aligned<[u8]> = &Aligned(*include_bytes!({path:?}));"
        );
    }
    code.push_str("pub(crate) static EMBEDDED: &[EmbeddedKernel] = &[\n");
    for (i, name) in names.iter().enumerate().take(fatbins.len()) {
        let _ = writeln!(
            code,
            "    EmbeddedKernel {{ name: {name:?}, fatbin: &FATBIN_{i}.0 }},"
        );
    }
    code.push_str("];\n");
    let table = out_dir.join("kernels_table.rs");
    write_if_changed(&table, &code)
}

fn write_if_changed(path: &Path, contents: &str) -> Result<(), String> {
    if std::fs::read_to_string(path).is_ok_and(|old| old == contents) {
        return Ok(());
    }
    std::fs::write(path, contents).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

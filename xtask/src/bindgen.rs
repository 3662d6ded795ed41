//! `cargo xtask bindgen --header PATH`: regenerate `nccl-sys-min`'s committed
//! bindings (`nccl-sys-min/src/bindings.rs`) from a real `nccl.h`.
//!
//! What is generated, and why this way:
//! - Only the allowlisted subset of `nccl.h` the project calls (SPEC.md,
//!   "nccl-sys-min"); everything else stays out so a newer header changes
//!   the file only where the project is affected.
//! - bindgen's dynamic-library mode (`NcclLib`), with every symbol required:
//!   nothing links NCCL at build time, and a library missing one of the
//!   symbols is refused as a whole when it is opened, never at a call.
//! - C enums as `#[repr(transparent)]` newtypes with associated constants, so
//!   a code a newer library returns that this header does not know is still a
//!   valid value (a Rust `enum` would make it undefined behaviour).
//! - `nccl.h` includes the CUDA runtime headers but needs only `cudaStream_t`
//!   from them, so small stand-ins are written to a temporary directory: the
//!   output is the same whether or not a CUDA toolkit is installed.
//! - `NCCL_CONFIG_INITIALIZER` is a brace initialiser macro that bindgen
//!   cannot translate; it is parsed here, checked field by field against the
//!   `ncclConfig_t` declaration, and emitted as `ncclConfig_t::initializer()`.
//!
//! The result is formatted with `rustfmt` so the committed file is already
//! `cargo fmt` clean, and regenerating from the same header is byte-identical.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::util::{workspace_root, TaskResult};

/// The committed output, relative to the workspace root.
pub const OUTPUT: &str = "nccl-sys-min/src/bindings.rs";

/// Functions the project calls (SPEC.md's list).
const FUNCTIONS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommInitRankConfig",
    "ncclCommFinalize",
    "ncclCommDestroy",
    "ncclCommAbort",
    "ncclCommGetAsyncError",
    "ncclGetErrorString",
    "ncclGetLastError",
    "ncclCommCount",
    "ncclCommCuDevice",
    "ncclCommUserRank",
    "ncclAllReduce",
    "ncclBroadcast",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
];

/// Types used by those functions (pulled in anyway) plus the ones the
/// project names directly.
const TYPES: &[&str] = &[
    "ncclResult_t",
    "ncclDataType_t",
    "ncclRedOp_t",
    "ncclConfig_t",
    "ncclUniqueId",
    "ncclComm_t",
    "cudaStream_t",
];

/// Enums emitted as newtypes (see the module docs).
const ENUMS: &[&str] = &["ncclResult_t", "ncclDataType_t", "ncclRedOp_t"];

/// `#define`d constants.
const VARS: &[&str] = &[
    "NCCL_MAJOR",
    "NCCL_MINOR",
    "NCCL_PATCH",
    "NCCL_VERSION_CODE",
    "NCCL_UNIQUE_ID_BYTES",
];

/// Stand-ins for the CUDA headers `nccl.h` includes.
const CUDA_STUBS: &[(&str, &str)] = &[
    (
        "cuda_runtime.h",
        "/* Stand-in written by cargo xtask bindgen: nccl.h needs only cudaStream_t. */\n\
         #include <stddef.h>\n\
         #define CUDART_VERSION 13000\n\
         typedef struct CUstream_st *cudaStream_t;\n",
    ),
    (
        "cuda_fp16.h",
        "/* Stand-in written by cargo xtask bindgen. */\n",
    ),
    (
        "cuda_bf16.h",
        "/* Stand-in written by cargo xtask bindgen. */\n",
    ),
];

/// Regenerate the committed bindings from `header` and report whether the
/// file changed.
pub fn run(header: &Path) -> TaskResult {
    let text = generate(header)?;
    let out = workspace_root().join(OUTPUT);
    let old = std::fs::read_to_string(&out).ok();
    if old.as_deref() == Some(text.as_str()) {
        println!("{OUTPUT} is up to date with {}", header.display());
        return Ok(());
    }
    std::fs::write(&out, &text).map_err(|e| format!("could not write {}: {e}", out.display()))?;
    println!(
        "wrote {OUTPUT} from {} ({} bytes)",
        header.display(),
        text.len()
    );
    Ok(())
}

/// The full text of the bindings file for `header`.
pub fn generate(header: &Path) -> Result<String, String> {
    let source = std::fs::read_to_string(header)
        .map_err(|e| format!("could not read NCCL header {}: {e}", header.display()))?;
    let version = header_version(&source)?;
    let initializer = config_initializer(&source)?;

    let stubs = StubDir::create()?;
    let mut builder = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .clang_arg(format!("-I{}", stubs.path.display()))
        .dynamic_library_name("NcclLib")
        .dynamic_link_require_all(true)
        .ctypes_prefix("::core::ffi")
        .use_core()
        .generate_comments(true)
        .disable_header_comment()
        .layout_tests(true)
        .derive_default(false)
        .formatter(bindgen::Formatter::None);
    for f in FUNCTIONS {
        builder = builder.allowlist_function(f);
    }
    for t in TYPES {
        builder = builder.allowlist_type(t);
    }
    for e in ENUMS {
        builder = builder.newtype_enum(e);
    }
    for v in VARS {
        builder = builder.allowlist_var(v);
    }
    let bindings = builder
        .generate()
        .map_err(|e| {
            format!(
                "bindgen failed on {}: {e} (bindgen needs libclang at run time: apt-get install libclang-dev)",
                header.display()
            )
        })?;

    let mut text = String::new();
    let _ = writeln!(
        text,
        "//! Generated by `cargo xtask bindgen --header PATH` from nccl.h {version}\n\
         //! with bindgen {}. Do not edit by hand: regenerate instead.\n",
        bindgen_version()
    );
    text.push_str(&bindings.to_string());
    text.push('\n');
    text.push_str(&initializer);
    rustfmt(&text)
}

/// `MAJOR.MINOR.PATCH` as `#define`d in the header.
fn header_version(source: &str) -> Result<String, String> {
    let get = |name: &str| {
        define_value(source, name)
            .ok_or_else(|| format!("nccl.h has no `#define {name}`; is this really nccl.h?"))
    };
    Ok(format!(
        "{}.{}.{}",
        get("NCCL_MAJOR")?,
        get("NCCL_MINOR")?,
        get("NCCL_PATCH")?
    ))
}

/// The value of a one-line `#define NAME VALUE`.
fn define_value<'a>(source: &'a str, name: &str) -> Option<&'a str> {
    source.lines().find_map(|line| {
        let rest = line.trim().strip_prefix("#define")?.trim_start();
        let rest = rest.strip_prefix(name)?;
        if !rest.starts_with(char::is_whitespace) {
            return None;
        }
        Some(rest.trim())
    })
}

/// Field names of `ncclConfig_t`, in declaration order.
fn config_fields(source: &str) -> Result<Vec<String>, String> {
    let end = source
        .find("} ncclConfig_t;")
        .ok_or("nccl.h declares no `} ncclConfig_t;`")?;
    let start = source[..end]
        .rfind("typedef struct")
        .ok_or("nccl.h: no `typedef struct` before `} ncclConfig_t;`")?;
    let body = &source[start..end];
    let body = &body[body.find('{').ok_or("nccl.h: ncclConfig_t has no `{`")? + 1..];
    let mut fields = Vec::new();
    for line in body.lines() {
        let code = strip_comments(line);
        let code = code.trim();
        if code.is_empty() {
            continue;
        }
        let decl = code
            .strip_suffix(';')
            .ok_or_else(|| format!("nccl.h: unexpected line in ncclConfig_t: {line:?}"))?;
        let name = decl
            .rsplit(|c: char| c.is_whitespace() || c == '*')
            .next()
            .filter(|n| !n.is_empty())
            .ok_or_else(|| format!("nccl.h: no field name in {line:?}"))?;
        fields.push(name.to_string());
    }
    Ok(fields)
}

fn strip_comments(line: &str) -> String {
    let mut out = line.to_string();
    while let Some(a) = out.find("/*") {
        match out[a..].find("*/") {
            Some(b) => out.replace_range(a..a + b + 2, ""),
            None => out.truncate(a),
        }
    }
    if let Some(a) = out.find("//") {
        out.truncate(a);
    }
    out
}

/// Translate `NCCL_CONFIG_INITIALIZER` into Rust: a const fn
/// `ncclConfig_t::initializer()` plus the constants it needs.
///
/// Every entry of the macro is written `VALUE, /* field */` on its own line;
/// the field comments must name exactly the fields of `ncclConfig_t` in
/// order, and every value must be one of the forms known here, or the task
/// fails rather than guess.
fn config_initializer(source: &str) -> Result<String, String> {
    let fields = config_fields(source)?;
    let start = source
        .find("#define NCCL_CONFIG_INITIALIZER")
        .ok_or("nccl.h defines no NCCL_CONFIG_INITIALIZER")?;
    let mut entries = Vec::new();
    for line in source[start..].lines().skip(1) {
        let line = line.trim().trim_end_matches('\\').trim();
        if line.starts_with('}') {
            break;
        }
        let (value, rest) = line.split_once("/*").ok_or_else(|| {
            format!("NCCL_CONFIG_INITIALIZER entry without a field comment: {line:?}")
        })?;
        let field = rest.split("*/").next().unwrap_or("").trim().to_string();
        let value = value.trim().trim_end_matches(',').trim().to_string();
        entries.push((field, value));
    }
    let named: Vec<&str> = entries.iter().map(|(f, _)| f.as_str()).collect();
    if named != fields.iter().map(String::as_str).collect::<Vec<_>>() {
        return Err(format!(
            "NCCL_CONFIG_INITIALIZER names fields {named:?} but ncclConfig_t declares {fields:?}"
        ));
    }
    let undef_int = define_value(source, "NCCL_CONFIG_UNDEF_INT")
        .ok_or("nccl.h defines no NCCL_CONFIG_UNDEF_INT")?;
    if undef_int != "INT_MIN" {
        return Err(format!(
            "NCCL_CONFIG_UNDEF_INT is {undef_int:?}; this task knows only INT_MIN"
        ));
    }
    let undef_ptr = define_value(source, "NCCL_CONFIG_UNDEF_PTR")
        .ok_or("nccl.h defines no NCCL_CONFIG_UNDEF_PTR")?;
    if undef_ptr != "NULL" {
        return Err(format!(
            "NCCL_CONFIG_UNDEF_PTR is {undef_ptr:?}; this task knows only NULL"
        ));
    }

    let mut out = String::new();
    out.push_str(
        "/// `NCCL_CONFIG_UNDEF_INT`: an integer field of `ncclConfig_t` left to NCCL's default.\n\
         pub const NCCL_CONFIG_UNDEF_INT: ::core::ffi::c_int = ::core::ffi::c_int::MIN;\n\n\
         /// `NCCL_VERSION(X, Y, Z)`: the version code NCCL uses (the old encoding below 2.9).\n\
         pub const fn nccl_version_code(x: u32, y: u32, z: u32) -> u32 {\n\
         if x <= 2 && y <= 8 { x * 1000 + y * 100 + z } else { x * 10000 + y * 100 + z }\n}\n\n",
    );
    let mut magic = None;
    let mut body = String::new();
    for (field, value) in &entries {
        let rust = match value.as_str() {
            "sizeof(ncclConfig_t)" => "::core::mem::size_of::<ncclConfig_t>()".to_string(),
            "NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH)" => {
                "nccl_version_code(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH)".to_string()
            }
            "NCCL_CONFIG_UNDEF_INT" => "NCCL_CONFIG_UNDEF_INT".to_string(),
            "NCCL_CONFIG_UNDEF_PTR" => "::core::ptr::null()".to_string(),
            v if v.starts_with("0x") && u32::from_str_radix(&v[2..], 16).is_ok() => {
                if field == "magic" {
                    magic = Some(v.to_string());
                    "NCCL_CONFIG_MAGIC".to_string()
                } else {
                    v.to_string()
                }
            }
            v => {
                return Err(format!(
                "NCCL_CONFIG_INITIALIZER sets {field} to {v:?}, a form this task cannot translate"
            ))
            }
        };
        let _ = writeln!(body, "{field}: {rust},");
    }
    let magic = magic.ok_or("NCCL_CONFIG_INITIALIZER sets no hexadecimal `magic`")?;
    let _ = write!(
        out,
        "/// The `magic` value of `NCCL_CONFIG_INITIALIZER`.\n\
         pub const NCCL_CONFIG_MAGIC: ::core::ffi::c_uint = {magic};\n\n\
         impl ncclConfig_t {{\n\
         /// `NCCL_CONFIG_INITIALIZER`, field for field: every configuration must\n\
         /// start from this value (NCCL rejects a configuration without its size,\n\
         /// magic and version).\n\
         pub const fn initializer() -> Self {{\n\
         ncclConfig_t {{\n{body}}}\n}}\n}}\n"
    );
    Ok(out)
}

/// The bindgen crate version compiled into this task (recorded in the file).
fn bindgen_version() -> &'static str {
    // Kept in step with xtask/Cargo.toml; the file records it so a diff made
    // by a different bindgen is explained by its first line.
    "0.72"
}

/// Format `text` with `rustfmt --edition 2021` (stdin to stdout).
fn rustfmt(text: &str) -> Result<String, String> {
    // Run from the workspace root so rustfmt finds the same configuration
    // `cargo fmt` uses for the committed file.
    let mut child = Command::new("rustfmt")
        .current_dir(workspace_root())
        .args(["--edition", "2021", "--emit", "stdout"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not start rustfmt (rustup component add rustfmt): {e}"))?;
    let mut stdin = child.stdin.take().ok_or("rustfmt has no stdin")?;
    let input = text.to_string();
    // Write from a thread so a large output cannot deadlock against a full pipe.
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let output = child
        .wait_with_output()
        .map_err(|e| format!("rustfmt did not finish: {e}"))?;
    writer
        .join()
        .map_err(|_| "rustfmt writer thread panicked".to_string())?
        .map_err(|e| format!("could not write to rustfmt: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "rustfmt failed ({}) on the generated bindings: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    String::from_utf8(output.stdout).map_err(|e| format!("rustfmt wrote non-UTF-8: {e}"))
}

/// A private temporary directory holding the CUDA header stand-ins, removed
/// on drop.
struct StubDir {
    path: PathBuf,
}

impl StubDir {
    fn create() -> Result<Self, String> {
        let path = std::env::temp_dir().join(format!("mamba-xtask-bindgen-{}", std::process::id()));
        std::fs::create_dir_all(&path)
            .map_err(|e| format!("could not create {}: {e}", path.display()))?;
        let dir = StubDir { path };
        for (name, text) in CUDA_STUBS {
            let p = dir.path.join(name);
            std::fs::write(&p, text)
                .map_err(|e| format!("could not write {}: {e}", p.display()))?;
        }
        Ok(dir)
    }
}

impl Drop for StubDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINI: &str = "#define NCCL_MAJOR 2\n#define NCCL_MINOR 28\n#define NCCL_PATCH 3\n\
        #define NCCL_CONFIG_UNDEF_INT INT_MIN\n#define NCCL_CONFIG_UNDEF_PTR NULL\n\
        typedef struct ncclConfig_v1 {\n  /* never touch */\n  size_t size;\n  unsigned int magic;\n\
        unsigned int version;\n  int blocking;\n  const char *netName;\n} ncclConfig_t;\n\
        #define NCCL_CONFIG_INITIALIZER {   \\\n  sizeof(ncclConfig_t), /* size */ \\\n\
        0xcafebeef, /* magic */ \\\n  NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH), /* version */ \\\n\
        NCCL_CONFIG_UNDEF_INT, /* blocking */ \\\n  NCCL_CONFIG_UNDEF_PTR, /* netName */ \\\n}\n";

    #[test]
    fn parses_fields_and_initializer() {
        assert_eq!(
            config_fields(MINI).unwrap(),
            ["size", "magic", "version", "blocking", "netName"]
        );
        let init = config_initializer(MINI).unwrap();
        assert!(init.contains("pub const NCCL_CONFIG_MAGIC: ::core::ffi::c_uint = 0xcafebeef;"));
        assert!(init.contains("netName: ::core::ptr::null(),"));
        assert!(init.contains("blocking: NCCL_CONFIG_UNDEF_INT,"));
        assert_eq!(header_version(MINI).unwrap(), "2.28.3");
    }

    #[test]
    fn refuses_initializer_that_disagrees_with_struct() {
        let bad = MINI.replace("/* netName */", "/* commName */");
        let err = config_initializer(&bad).unwrap_err();
        assert!(err.contains("commName"), "{err}");
        let bad = MINI.replace(
            "NCCL_CONFIG_UNDEF_INT, /* blocking */",
            "42 + 1, /* blocking */",
        );
        assert!(config_initializer(&bad)
            .unwrap_err()
            .contains("cannot translate"));
    }
}

//! Tests of `build/nvcc.rs` (the build script's nvcc search and flags),
//! compiled into the library's unit tests because build scripts have none.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::nvcc_discovery::*;

struct FakeEnv(HashMap<&'static str, OsString>);

impl FakeEnv {
    fn new(vars: &[(&'static str, &Path)]) -> Self {
        let mut map: HashMap<&'static str, OsString> = vars
            .iter()
            .map(|(k, v)| (*k, v.as_os_str().to_owned()))
            .collect();
        // Never fall through to this machine's real /opt/nvcc or PATH.
        map.entry("PATH")
            .or_insert_with(|| OsString::from("/nonexistent-dir"));
        map.entry(FALLBACK_VAR)
            .or_insert_with(|| OsString::from("off"));
        FakeEnv(map)
    }

    fn get(&self, k: &str) -> Option<OsString> {
        self.0.get(k).cloned()
    }

    fn find(&self) -> Result<Search, String> {
        find(
            &|k| self.get(k),
            Some("x86_64-unknown-linux-gnu"),
            Some("x86_64-unknown-linux-gnu"),
        )
    }
}

/// `<root>/<dir>/nvcc` as an empty file.
fn fake_nvcc(root: &Path, dir: &str) -> PathBuf {
    let d = root.join(dir);
    std::fs::create_dir_all(&d).expect("mkdir");
    let nvcc = d.join("nvcc");
    std::fs::write(&nvcc, b"").expect("write");
    nvcc
}

fn found(search: Result<Search, String>) -> (PathBuf, Via) {
    match search {
        Ok(Search::Found { nvcc, via }) => (nvcc, via),
        other => panic!("expected Found, got {other:?}"),
    }
}

#[test]
fn search_order_is_nvcc_toolkit_path_fallback() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path();
    let explicit = fake_nvcc(root, "explicit");
    let home = root.join("home");
    let home_nvcc = fake_nvcc(&home, "bin");
    let cpath = root.join("cpath");
    let cpath_nvcc = fake_nvcc(&cpath, "bin");
    let on_path = fake_nvcc(root, "onpath");
    let fallback = fake_nvcc(root, "venv");
    let path_var = std::env::join_paths([root.join("empty"), root.join("onpath")]).expect("join");
    let path_var = PathBuf::from(path_var);

    let mut vars: Vec<(&'static str, &Path)> = vec![
        ("NVCC", &explicit),
        ("CUDA_HOME", &home),
        ("CUDA_PATH", &cpath),
        ("PATH", &path_var),
        (FALLBACK_VAR, &fallback),
    ];
    // Each source in turn wins once those before it are removed.
    let expected = [
        (explicit.clone(), Via::Var("NVCC".into())),
        (home_nvcc, Via::Toolkit("CUDA_HOME".into())),
        (cpath_nvcc, Via::Toolkit("CUDA_PATH".into())),
        (on_path, Via::Path),
        (fallback.clone(), Via::Fallback),
    ];
    for want in expected {
        assert_eq!(found(FakeEnv::new(&vars).find()), want);
        vars.remove(0);
    }
    match FakeEnv::new(&vars).find() {
        Ok(Search::Absent { looked }) => {
            let text = looked.join("; ");
            for place in ["NVCC", "CUDA_HOME", "CUDA_PATH", "PATH", FALLBACK_VAR] {
                assert!(text.contains(place), "{place} missing from {text}");
            }
        }
        other => panic!("expected Absent, got {other:?}"),
    }
}

#[test]
fn target_specific_variable_beats_plain_nvcc() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let plain = fake_nvcc(tmp.path(), "plain");
    let specific = fake_nvcc(tmp.path(), "specific");
    let env = FakeEnv::new(&[
        ("NVCC", &plain),
        ("NVCC_x86_64_unknown_linux_gnu", &specific),
    ]);
    assert_eq!(
        found(env.find()),
        (specific, Via::Var("NVCC_x86_64_unknown_linux_gnu".into()))
    );
    let names = nvcc_var_names(
        Some("aarch64-unknown-linux-gnu"),
        Some("x86_64-unknown-linux-gnu"),
    );
    assert!(names.contains(&"TARGET_NVCC".to_string()), "{names:?}");
    let names = nvcc_var_names(
        Some("x86_64-unknown-linux-gnu"),
        Some("x86_64-unknown-linux-gnu"),
    );
    assert!(names.contains(&"HOST_NVCC".to_string()), "{names:?}");
    assert_eq!(names.last().map(String::as_str), Some("NVCC"));
}

#[test]
fn a_wrong_nvcc_variable_is_an_error_but_empty_is_unset() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let missing = tmp.path().join("no-such-nvcc");
    let err = FakeEnv::new(&[("NVCC", &missing)]).find().unwrap_err();
    assert!(
        err.contains("NVCC=") && err.contains("does not name a file"),
        "{err}"
    );
    // Empty counts as unset: the search goes on (and here finds nothing).
    let empty = PathBuf::new();
    let search = FakeEnv::new(&[("NVCC", &empty), ("CUDA_HOME", &empty)]).find();
    assert!(matches!(search, Ok(Search::Absent { .. })), "{search:?}");
    // A toolkit variable without bin/nvcc falls through instead.
    let search = FakeEnv::new(&[("CUDA_HOME", tmp.path())]).find();
    match search {
        Ok(Search::Absent { looked }) => {
            assert!(looked.iter().any(|l| l.contains("bin/nvcc does not exist")))
        }
        other => panic!("expected Absent, got {other:?}"),
    }
}

#[test]
fn fallback_finds_any_python3_venv() {
    let tmp = tempfile::tempdir().expect("tempdir");
    assert_eq!(venv_nvcc(tmp.path()), None);
    let nvcc = fake_nvcc(tmp.path(), "lib/python3.12/site-packages/nvidia/cu13/bin");
    assert_eq!(venv_nvcc(tmp.path()), Some(nvcc));
    let off = |k: &str| (k == FALLBACK_VAR).then(|| OsString::from("off"));
    assert_eq!(fallback_path(&off), None);
    let unset = |_: &str| None;
    assert!(fallback_path(&unset).is_some_and(|p| p.starts_with(FALLBACK_PREFIX)));
}

fn flags_of(module: &str) -> Vec<String> {
    device_flags(Path::new("/inc"), module)
        .iter()
        .map(|f| f.to_string_lossy().into_owned())
        .collect()
}

#[test]
fn flags_are_deterministic_and_cover_the_architectures() {
    // The bit-equal files (and any file not in the table) never contract;
    // the tolerance files do; nothing ever gets fast math or flush-to-zero.
    for (module, fmad) in [
        ("fold", "--fmad=false"),
        ("mamba_optim", "--fmad=false"),
        ("a_new_kernel_file", "--fmad=false"),
        ("mamba_ops", "--fmad=true"),
        ("mamba_scan", "--fmad=true"),
        ("mamba_ssd", "--fmad=true"),
        ("mamba_ssd_tc", "--fmad=true"),
        ("mamba_decode", "--fmad=true"),
    ] {
        let flags = flags_of(module);
        for required in [fmad, "--ftz=false", "--prec-div=true", "--prec-sqrt=true"] {
            assert!(
                flags.iter().any(|f| f == required),
                "{module}: {required} missing: {flags:?}"
            );
        }
        assert_eq!(
            flags.iter().filter(|f| f.starts_with("--fmad")).count(),
            1,
            "{module}: {flags:?}"
        );
        for banned in ["fast", "ftz=true"] {
            assert!(
                !flags.iter().any(|f| f.contains(banned)),
                "{module}: {banned} present: {flags:?}"
            );
        }
    }
    assert_eq!(contract("fold"), Contract::BitEqualToHost);
    assert_eq!(contract("mamba_scan"), Contract::Tolerance);
    let joined = flags_of("fold").join(" ");
    for gencode in [
        "-gencode arch=compute_80,code=sm_80",
        "-gencode arch=compute_90,code=sm_90",
        "-gencode arch=compute_90,code=compute_90",
    ] {
        assert!(joined.contains(gencode), "{gencode} missing: {joined}");
    }
    assert!(joined.contains("-I /inc"), "{joined}");
}

/// Every file the table lists exists, so a renamed kernel file cannot
/// silently fall back to the other contract.
#[test]
fn the_fmad_table_names_existing_kernel_files() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
    let names: Vec<String> = cuda_sources(&dir)
        .expect("kernels/cuda")
        .iter()
        .map(|s| module_name(s).expect("name"))
        .collect();
    for listed in FMA_CONTRACTED {
        assert!(
            names.iter().any(|n| n == listed),
            "{listed} not in {names:?}"
        );
    }
}

#[test]
fn sources_are_sorted_cu_files_with_identifier_names() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for name in ["b.cu", "a.cu", "common.cuh", "notes.txt"] {
        std::fs::write(tmp.path().join(name), b"").expect("write");
    }
    std::fs::create_dir(tmp.path().join("sub.cu")).expect("mkdir");
    let sources = cuda_sources(tmp.path()).expect("list");
    let names: Vec<String> = sources
        .iter()
        .map(|s| module_name(s).expect("name"))
        .collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(
        cuda_sources(&tmp.path().join("missing")).expect("missing dir"),
        Vec::<PathBuf>::new()
    );
    for bad in ["1x.cu", "a-b.cu", "a b.cu", ".cu"] {
        assert!(module_name(Path::new(bad)).is_err(), "{bad} accepted");
    }
    assert_eq!(
        module_name(Path::new("/x/mamba_scan.cu")).as_deref(),
        Ok("mamba_scan")
    );
}

#[test]
fn release_is_parsed_from_nvcc_version() {
    let text =
        "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 13.0, V13.0.88\n";
    assert_eq!(release_of(text).as_deref(), Some("13.0"));
    assert_eq!(release_of("no version here"), None);
    assert_eq!(release_of("release , V1"), None);
}

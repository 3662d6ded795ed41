//! The table of fatbins that `build.rs` compiled and embedded.
//!
//! Every `kernels/cuda/<name>.cu` becomes one module named `<name>`. The
//! images live in the binary's read-only data for the life of the process
//! and are 16-byte aligned; loading one copies it into the driver.

use crate::error::{KernelError, HOW_TO_GET_KERNELS};

/// The first four bytes of every fatbin image (magic 0xBA55ED50,
/// little-endian). The build checks every image against it.
pub const FATBIN_MAGIC: [u8; 4] = [0x50, 0xED, 0x55, 0xBA];

/// One embedded module: the stem of its `.cu` file and its fatbin (SASS for
/// sm_80 and sm_90, PTX for compute_90).
#[derive(Debug, Clone, Copy)]
pub struct EmbeddedKernel {
    pub name: &'static str,
    pub fatbin: &'static [u8],
}

/// Aligns `include_bytes!` data (driver image loaders read it as words).
/// Unused in a build without nvcc, whose table is empty.
#[allow(dead_code)]
#[repr(C, align(16))]
struct Aligned<B: ?Sized>(B);

include!(concat!(env!("OUT_DIR"), "/kernels_table.rs"));

/// Whether this build embedded kernels (nvcc was found when it was built).
/// When false, every GPU entry point returns [`KernelError::NotBuilt`].
pub fn available() -> bool {
    BUILT_WITH_NVCC
}

/// Every embedded module, in file-name order; empty without nvcc.
pub fn embedded() -> &'static [EmbeddedKernel] {
    EMBEDDED
}

/// The module names the build saw in `kernels/cuda/` (compiled or not).
pub fn source_names() -> &'static [&'static str] {
    SOURCES
}

/// The CUDA release of the nvcc that compiled the kernels (`"13.0"`), or
/// `None` in a build without nvcc.
pub fn nvcc_release() -> Option<&'static str> {
    BUILT_WITH_NVCC.then_some(NVCC_RELEASE)
}

/// The fatbin of module `name`; `None` when there is no such module or the
/// build had no nvcc.
pub fn fatbin(name: &str) -> Option<&'static [u8]> {
    EMBEDDED.iter().find(|k| k.name == name).map(|k| k.fatbin)
}

/// The fatbin of module `name`, or the error that explains its absence.
pub fn require_fatbin(name: &str) -> Result<&'static [u8], KernelError> {
    if let Some(image) = fatbin(name) {
        return Ok(image);
    }
    Err(missing(name, BUILT_WITH_NVCC, ABSENT_REASON, EMBEDDED))
}

/// The error for a module that is not in `table`. Split out so both cases
/// can be tested in either kind of build.
pub(crate) fn missing(
    name: &str,
    built_with_nvcc: bool,
    absent_reason: &'static str,
    table: &'static [EmbeddedKernel],
) -> KernelError {
    if built_with_nvcc {
        KernelError::UnknownModule {
            module: name.to_string(),
            available: table.iter().map(|k| k.name).collect(),
        }
    } else {
        KernelError::NotBuilt {
            module: name.to_string(),
            reason: absent_reason,
            how: HOW_TO_GET_KERNELS,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_matches_the_build() {
        // Every .cu file the build saw is embedded exactly when nvcc ran.
        if available() {
            let names: Vec<&str> = embedded().iter().map(|k| k.name).collect();
            assert_eq!(
                names,
                source_names(),
                "one module per kernels/cuda/*.cu, in order"
            );
            assert!(ABSENT_REASON.is_empty());
            assert!(nvcc_release().is_some_and(|r| !r.is_empty()));
        } else {
            assert!(embedded().is_empty());
            assert!(
                ABSENT_REASON.contains("nvcc"),
                "reason names nvcc: {ABSENT_REASON}"
            );
            assert_eq!(nvcc_release(), None);
        }
        assert!(
            source_names().contains(&"fold"),
            "kernels/cuda/fold.cu is always seen"
        );
    }

    #[test]
    fn embedded_images_are_aligned_fatbins() {
        for k in embedded() {
            assert!(k.fatbin.len() > 16, "{}: {} bytes", k.name, k.fatbin.len());
            assert_eq!(k.fatbin[..4], FATBIN_MAGIC, "{}: not a fatbin", k.name);
            assert_eq!(
                k.fatbin.as_ptr() as usize % 16,
                0,
                "{}: not 16-byte aligned",
                k.name
            );
            assert_eq!(fatbin(k.name).map(<[u8]>::as_ptr), Some(k.fatbin.as_ptr()));
        }
        if available() {
            let fold = fatbin("fold");
            assert!(fold.is_some(), "built with nvcc but no fold module");
        } else {
            assert_eq!(fatbin("fold"), None);
        }
    }

    #[test]
    fn embedded_fold_names_its_kernels() {
        // The function names are stored as plain strings in the cubins'
        // symbol tables; a fatbin without them would fail at load_function.
        let Some(image) = fatbin("fold") else {
            assert!(!available());
            return;
        };
        for symbol in ["det_chain_f32", "det_scale_f32"] {
            let found = image.windows(symbol.len()).any(|w| w == symbol.as_bytes());
            assert!(found, "fold fatbin lacks the symbol {symbol}");
        }
    }

    #[test]
    fn unknown_names_are_none() {
        assert_eq!(fatbin("no_such_module"), None);
        assert_eq!(fatbin(""), None);
        let err = require_fatbin("no_such_module").unwrap_err();
        let text = err.to_string();
        assert!(text.contains("no_such_module"), "{text}");
        if available() {
            assert!(matches!(err, KernelError::UnknownModule { .. }), "{err:?}");
            assert!(
                text.contains("fold"),
                "lists the modules that exist: {text}"
            );
        } else {
            assert!(matches!(err, KernelError::NotBuilt { .. }), "{err:?}");
        }
    }

    #[test]
    fn error_without_nvcc_says_how_to_get_kernels() {
        // The NotBuilt branch, whatever this build had.
        let err = missing(
            "fold",
            false,
            "this build found no nvcc (looked at: PATH)",
            &[],
        );
        let text = err.to_string();
        for needle in [
            "`fold`",
            "no nvcc",
            "scripts/install-nvcc.sh",
            "NVCC=",
            "MAMBA_REQUIRE_KERNELS",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in: {text}");
        }
        // And the other branch lists what exists instead.
        static TABLE: &[EmbeddedKernel] = &[EmbeddedKernel {
            name: "fold",
            fatbin: &[],
        }];
        let text = missing("flod", true, "", TABLE).to_string();
        assert!(
            text.contains("`flod`") && text.contains("\"fold\""),
            "{text}"
        );
        assert!(!text.contains("install-nvcc"), "{text}");
    }
}

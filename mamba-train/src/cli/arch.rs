//! `--arch mamba1|mamba2` and Mamba-2's shape flags (`--head-dim`,
//! `--n-groups`, `--chunk-size`): the model shape of a fresh run, the
//! checks of those flags against a checkpoint's architecture (`--resume`,
//! `--init-from`), and the one place that picks the model an architecture
//! trains with on the CPU ([`cpu_model`]).
//!
//! A run's architecture is `--arch`, else (with `--resume` or
//! `--init-from`) the checkpoint's — its `config.json` `model_type`,
//! `mamba` or `mamba2` — else Mamba-1. A flag that contradicts the
//! checkpoint, or a Mamba-2 flag on a Mamba-1 run, is an error naming the
//! flag; so are Mamba-2 shapes that cannot work (they are checked here,
//! in the flags' terms, before [`ModelConfig::validate`]).

use super::args::{CliArch, TrainArgs};
use crate::checkpoint::hf_config::hf_model_type;
use crate::config::{Arch, ModelConfig, SsdConfig};
use crate::error::{Result, TrainError};
use crate::model::cpu::{CpuModel, Mamba2Model};
use crate::model::HostModel;

/// The model of `cfg` on the CPU: the Mamba-1 reference or the Mamba-2 one,
/// behind one type so that `train` and `eval` have one code path.
pub fn cpu_model(cfg: &ModelConfig) -> Result<Box<dyn HostModel + Send>> {
    Ok(match cfg.arch {
        Arch::Mamba1 => Box::new(CpuModel::new(cfg.clone())?),
        Arch::Mamba2(_) => Box::new(Mamba2Model::new(cfg.clone())?),
    })
}

/// "Mamba-1" or "Mamba-2", for messages.
fn title(arch: &Arch) -> &'static str {
    match arch {
        Arch::Mamba1 => "Mamba-1",
        Arch::Mamba2(_) => "Mamba-2",
    }
}

/// `a Mamba-2 model (config.json model_type "mamba2")`.
fn described(arch: &Arch) -> String {
    format!(
        "a {} model (config.json model_type \"{}\")",
        title(arch),
        hf_model_type(arch)
    )
}

/// A Mamba-2 field of [`SsdConfig`].
type SsdField = fn(&SsdConfig) -> usize;

/// Mamba-2's shape flags and the field each sets, in the order of
/// [`ssd_given`].
const SSD_FLAGS: [(&str, SsdField); 3] = [
    ("--head-dim", |s| s.head_dim),
    ("--n-groups", |s| s.n_groups),
    ("--chunk-size", |s| s.chunk_size),
];

/// The values of [`SSD_FLAGS`] as given.
fn ssd_given(args: &TrainArgs) -> [Option<usize>; 3] {
    [args.head_dim, args.n_groups, args.chunk_size]
}

/// The architecture of a fresh run: `--arch`, else Mamba-1.
fn requested(args: &TrainArgs) -> CliArch {
    args.arch.unwrap_or(CliArch::Mamba1)
}

/// The shape of a fresh run (or of a resumed one whose shape flags differ
/// from the checkpoint's `recorded` model, which the run's comparison then
/// reports): `vocab` tokens, `d_model` wide, `layers` deep, of the run's
/// architecture; `--d-state` and the Mamba-2 fields from their flags, else
/// the recorded model's (of the same architecture), else the defaults
/// ([`ModelConfig::new`], [`ModelConfig::mamba2`]).
pub(super) fn fresh_model(
    args: &TrainArgs,
    recorded: Option<&ModelConfig>,
    vocab: usize,
    d_model: usize,
    layers: usize,
) -> Result<ModelConfig> {
    let arch = match recorded {
        Some(m) => CliArch::of(&m.arch),
        None => requested(args),
    };
    if arch == CliArch::Mamba1 {
        let why = match args.arch {
            Some(_) => "this run is Mamba-1 (--arch mamba1)",
            None => "this run is Mamba-1 (the default architecture)",
        };
        refuse_ssd_flags(args, why, true)?;
        let mut cfg = ModelConfig::new(vocab, d_model, layers);
        cfg.d_state = state_size(args, recorded, arch, cfg.d_state);
        return Ok(cfg);
    }
    let mut cfg = ModelConfig::mamba2(vocab, d_model, layers);
    cfg.d_state = state_size(args, recorded, arch, cfg.d_state);
    let fallback = recorded.and_then(ModelConfig::ssd).copied();
    if let Arch::Mamba2(s) = &mut cfg.arch {
        let default = fallback.unwrap_or(*s);
        *s = SsdConfig {
            head_dim: args.head_dim.unwrap_or(default.head_dim),
            n_groups: args.n_groups.unwrap_or(default.n_groups),
            chunk_size: args.chunk_size.unwrap_or(default.chunk_size),
        };
    }
    check_ssd_shape(&cfg)?;
    Ok(cfg)
}

/// `--d-state`, else the recorded model's if it is of `arch`, else `default`.
fn state_size(
    args: &TrainArgs,
    recorded: Option<&ModelConfig>,
    arch: CliArch,
    default: usize,
) -> usize {
    let same_arch = recorded.filter(|m| CliArch::of(&m.arch) == arch);
    args.d_state
        .or(same_arch.map(|m| m.d_state))
        .unwrap_or(default)
}

/// Refuse any Mamba-2 shape flag on a Mamba-1 run (`why` says where the
/// architecture came from; `may_switch`: `--arch mamba2` is a remedy).
fn refuse_ssd_flags(args: &TrainArgs, why: &str, may_switch: bool) -> Result<()> {
    let given = SSD_FLAGS.iter().zip(ssd_given(args));
    match given.filter_map(|((flag, _), v)| Some((flag, v?))).next() {
        Some((flag, v)) => Err(TrainError::Config(format!(
            "{flag} {v} applies only to Mamba-2 (--arch mamba2), but {why}; drop {flag}{}",
            if may_switch {
                " or add --arch mamba2"
            } else {
                ""
            }
        ))),
        None => Ok(()),
    }
}

/// Check the architecture flags against the model of a checkpoint
/// (`source`: "--init-from DIR", "the checkpoint being resumed"): `--arch`
/// must be its architecture, a Mamba-2 shape flag needs a Mamba-2 model
/// and must equal its value. `keep`: why a flag cannot change it.
pub(super) fn check_against(
    args: &TrainArgs,
    theirs: &ModelConfig,
    source: &str,
    keep: &str,
) -> Result<()> {
    let arch = CliArch::of(&theirs.arch);
    if let Some(given) = args.arch.filter(|&a| a != arch) {
        return Err(TrainError::Config(format!(
            "--arch {} disagrees with {source}, {}; omit --arch ({keep})",
            given.name(),
            described(&theirs.arch)
        )));
    }
    let Some(s) = theirs.ssd() else {
        return refuse_ssd_flags(
            args,
            &format!("{source} is {}", described(&theirs.arch)),
            false,
        );
    };
    for ((flag, field), given) in SSD_FLAGS.iter().zip(ssd_given(args)) {
        check_given(flag, given, field(s), source, keep)?;
    }
    Ok(())
}

/// Refuse a shape flag `flag` given as `given` when `theirs` (the value of
/// the checkpoint `source`) differs, naming both.
pub(super) fn check_given(
    flag: &str,
    given: Option<usize>,
    theirs: usize,
    source: &str,
    keep: &str,
) -> Result<()> {
    match given.filter(|&g| g != theirs) {
        Some(g) => Err(TrainError::Config(format!(
            "{flag} {g} disagrees with {source}, whose config.json has {theirs}; omit {flag} \
             ({keep})"
        ))),
        None => Ok(()),
    }
}

/// Mamba-2 shapes that cannot work, in the flags' terms: a zero field, a
/// `--head-dim` that does not divide the inner width, a `--n-groups` that
/// does not divide the heads.
fn check_ssd_shape(cfg: &ModelConfig) -> Result<()> {
    let Some(s) = cfg.ssd() else { return Ok(()) };
    for (flag, field) in SSD_FLAGS {
        if field(s) == 0 {
            return Err(TrainError::Config(format!(
                "{flag} must be at least 1, got 0"
            )));
        }
    }
    let inner = cfg.d_inner();
    if inner % s.head_dim != 0 {
        let fits = (1..=s.head_dim.min(inner))
            .rev()
            .find(|h| inner % h == 0)
            .unwrap_or(1);
        return Err(TrainError::Config(format!(
            "--head-dim {} must divide the inner width {} x --d-model = {inner} (the heads \
             split it evenly); e.g. --head-dim {fits}",
            s.head_dim, cfg.expand
        )));
    }
    let heads = cfg.num_heads();
    if heads % s.n_groups != 0 {
        return Err(TrainError::Config(format!(
            "--n-groups {} must divide the number of heads, {inner} / --head-dim {} = {heads} \
             (each group's heads share one B and C); e.g. --n-groups 1",
            s.n_groups, s.head_dim
        )));
    }
    Ok(())
}

/// The architecture part of a description line: empty for Mamba-1 (whose
/// lines read as before), `Mamba-2 (4 heads of 8, 1 group, chunk 4,
/// d_state 128); ` for Mamba-2.
pub fn shape_note(cfg: &ModelConfig) -> String {
    match cfg.ssd() {
        None => String::new(),
        Some(s) => format!(
            "Mamba-2 ({} heads of {}, {} group{}, chunk {}, d_state {}); ",
            cfg.num_heads(),
            s.head_dim,
            s.n_groups,
            if s.n_groups == 1 { "" } else { "s" },
            s.chunk_size,
            cfg.d_state
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(arch: Option<CliArch>, ssd: [Option<usize>; 3]) -> TrainArgs {
        TrainArgs {
            arch,
            head_dim: ssd[0],
            n_groups: ssd[1],
            chunk_size: ssd[2],
            ..TrainArgs::default()
        }
    }

    fn fresh(a: &TrainArgs) -> std::result::Result<ModelConfig, String> {
        fresh_model(a, None, 6, 16, 1).map_err(|e| e.to_string())
    }

    #[test]
    fn fresh_shapes_take_flags_then_defaults() {
        let m1 = fresh(&args(None, [None; 3])).unwrap();
        assert_eq!(m1, ModelConfig::new(6, 16, 1), "Mamba-1 by default");
        let m2 = fresh(&args(Some(CliArch::Mamba2), [None; 3])).unwrap();
        assert_eq!(m2, ModelConfig::mamba2(6, 16, 1));
        let m2 = fresh(&args(Some(CliArch::Mamba2), [Some(8), Some(2), Some(4)])).unwrap();
        let s = m2.ssd().unwrap();
        assert_eq!((s.head_dim, s.n_groups, s.chunk_size), (8, 2, 4));
        assert_eq!((m2.num_heads(), m2.d_state), (4, 128));
        m2.validate().unwrap();
        assert!(shape_note(&m2).starts_with("Mamba-2 (4 heads of 8, 2 groups, chunk 4"));
        assert_eq!(shape_note(&m1), "");
        // A resumed run with another width keeps the checkpoint's Mamba-2
        // fields (the comparison then names the width).
        let wide = fresh_model(&args(None, [None; 3]), Some(&m2), 6, 32, 1).unwrap();
        assert_eq!(wide.ssd(), m2.ssd());
    }

    #[test]
    fn bad_flags_are_named_with_what_was_expected() {
        let m2 = Some(CliArch::Mamba2);
        let cases = [
            (
                args(None, [Some(8), None, None]),
                "--head-dim 8 applies only to Mamba-2 (--arch mamba2), but this run is Mamba-1",
            ),
            (
                args(Some(CliArch::Mamba1), [None, None, Some(4)]),
                "--chunk-size 4 applies only to Mamba-2",
            ),
            (
                args(m2, [Some(12), None, None]),
                "--head-dim 12 must divide the inner width 2 x --d-model = 32",
            ),
            (
                args(m2, [Some(8), Some(3), None]),
                "--n-groups 3 must divide the number of heads, 32 / --head-dim 8 = 4",
            ),
            (
                args(m2, [None, None, Some(0)]),
                "--chunk-size must be at least 1, got 0",
            ),
            (
                args(m2, [Some(0), None, None]),
                "--head-dim must be at least 1, got 0",
            ),
        ];
        for (a, want) in cases {
            let e = fresh(&a).unwrap_err();
            assert!(e.contains(want), "want {want:?} in {e:?}");
            for field in ["head_dim", "n_groups", "chunk_size", "d_inner", "d_model "] {
                assert!(!e.contains(field), "{field} in {e:?}");
            }
        }
        assert!(fresh(&args(m2, [Some(12), None, None]))
            .unwrap_err()
            .contains("e.g. --head-dim 8"));
    }

    #[test]
    fn checkpoints_decide_the_architecture() {
        let m1 = ModelConfig::new(6, 16, 1);
        let m2 = fresh(&args(Some(CliArch::Mamba2), [Some(8), None, Some(4)])).unwrap();
        let check = |a: &TrainArgs, m: &ModelConfig| {
            check_against(a, m, "--init-from x", "keep it").map_err(|e| e.to_string())
        };
        check(&args(None, [None; 3]), &m2).unwrap();
        check(
            &args(Some(CliArch::Mamba2), [Some(8), Some(1), Some(4)]),
            &m2,
        )
        .unwrap();
        let e = check(&args(Some(CliArch::Mamba1), [None; 3]), &m2).unwrap_err();
        assert!(
            e.contains("--arch mamba1 disagrees with --init-from x, a Mamba-2 model (config.json model_type \"mamba2\")"),
            "{e}"
        );
        let e = check(&args(Some(CliArch::Mamba2), [None; 3]), &m1).unwrap_err();
        assert!(e.contains("model_type \"mamba\")"), "{e}");
        let e = check(&args(None, [Some(4), None, None]), &m2).unwrap_err();
        assert!(
            e.contains("--head-dim 4 disagrees with --init-from x, whose config.json has 8"),
            "{e}"
        );
        let e = check(&args(None, [None, Some(2), None]), &m1).unwrap_err();
        assert!(
            e.contains("--n-groups 2 applies only to Mamba-2") && !e.contains("add --arch"),
            "{e}"
        );
    }

    #[test]
    fn the_cpu_model_follows_the_architecture() {
        let m2 = ModelConfig::mamba2(6, 16, 1);
        assert_eq!(cpu_model(&m2).unwrap().config(), &m2);
        let m1 = ModelConfig::new(6, 16, 1);
        assert_eq!(cpu_model(&m1).unwrap().config(), &m1);
    }
}

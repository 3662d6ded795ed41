//! `--config run.toml`: a file of `train` flags.
//!
//! The file is a flat TOML table whose keys are the `train` flags' long
//! names without the dashes (`layers = 4`, `d-model = 128`; `d_model` is
//! accepted too), values are strings, numbers or booleans (`true` for a
//! switch such as `overwrite`; `false` leaves it off). It is expanded into
//! flags placed *before* the command line's own, and a later flag
//! overrides an earlier one, so flags on the command line override the
//! file. Keys that are not flags, nested tables, arrays and `config`
//! itself are errors naming the file and the key; a bad value is reported
//! by the flag's own parser, prefixed with the file.
//!
//! Ranks a supervisor spawns get the same argument list, so each reads the
//! same file; the agreement check of the world catches a file that changed
//! in between.

use std::ffi::OsString;
use std::path::Path;

use clap::{ArgAction, CommandFactory};

use super::args::Cli;
use crate::error::{Result, TrainError};

/// The long name of the flag that names the file.
pub const CONFIG_FLAG: &str = "config";

/// `argv` with the `train` command's `--config FILE` expanded: the file's
/// flags inserted right after `train`, ahead of the given ones (which
/// therefore win). Any other argument list comes back unchanged.
pub fn expand(argv: Vec<OsString>) -> Result<Vec<OsString>> {
    let Some(train_at) = argv.iter().position(|a| a == "train") else {
        return Ok(argv);
    };
    if argv[1..train_at].iter().any(|a| !is_global_flag(a)) {
        return Ok(argv);
    }
    let Some(path) = config_path(&argv[train_at + 1..])? else {
        return Ok(argv);
    };
    let from_file = flags_from_file(Path::new(&path))?;
    // Parse the file's flags alone first, so that a bad value is blamed on
    // the file rather than on the command line.
    let mut alone: Vec<OsString> = argv[..=train_at].to_vec();
    alone.extend(from_file.iter().cloned());
    if let Err(e) = Cli::command()
        .args_override_self(true)
        .try_get_matches_from(&alone)
    {
        let rendered = e.render().to_string();
        let first = rendered.lines().next().unwrap_or_default();
        return Err(TrainError::Config(format!(
            "--config {}: {}",
            Path::new(&path).display(),
            first.strip_prefix("error: ").unwrap_or(first)
        )));
    }
    let mut out: Vec<OsString> = argv[..=train_at].to_vec();
    out.extend(from_file);
    out.extend(argv[train_at + 1..].iter().cloned());
    Ok(out)
}

fn is_global_flag(a: &OsString) -> bool {
    a.to_str().is_some_and(|s| s.starts_with('-'))
}

/// The value of `--config` among `train`'s arguments (`--config F` or
/// `--config=F`); the last one wins as for every other flag.
fn config_path(args: &[OsString]) -> Result<Option<OsString>> {
    let flag = format!("--{CONFIG_FLAG}");
    let mut found = None;
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        if a == "--" {
            break;
        }
        if *a == *flag {
            let value = args.get(i + 1).ok_or_else(|| {
                TrainError::Config(format!("{flag} needs a file: {flag} run.toml"))
            })?;
            found = Some(value.clone());
            i += 2;
            continue;
        }
        if let Some(v) = a.to_str().and_then(|s| s.strip_prefix(&format!("{flag}="))) {
            found = Some(OsString::from(v));
        }
        i += 1;
    }
    Ok(found)
}

/// The flags `path` holds, in the file's key order.
pub fn flags_from_file(path: &Path) -> Result<Vec<OsString>> {
    let shown = path.display();
    let text = std::fs::read_to_string(path)
        .map_err(|e| TrainError::Config(format!("--config {shown}: cannot read the file: {e}")))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| TrainError::Config(format!("--config {shown}: not valid TOML: {e}")))?;
    let cmd = Cli::command();
    let train = cmd
        .find_subcommand("train")
        .ok_or_else(|| TrainError::Config("the train command is missing".into()))?;
    let mut flags = Vec::new();
    for (key, value) in &table {
        let long = key.replace('_', "-");
        let arg = train
            .get_arguments()
            .find(|a| a.get_long() == Some(long.as_str()))
            .filter(|_| long != CONFIG_FLAG)
            .ok_or_else(|| {
                TrainError::Config(format!(
                    "--config {shown}: {key:?} is not a train flag (keys are the flags' names \
                     without dashes, e.g. layers = 4; see mamba-train train --help)"
                ))
            })?;
        let switch = matches!(arg.get_action(), ArgAction::SetTrue);
        let flag = format!("--{long}");
        let text = match value {
            toml::Value::Boolean(b) if switch => {
                if *b {
                    flags.push(OsString::from(&flag));
                }
                continue;
            }
            _ if switch => {
                return Err(TrainError::Config(format!(
                    "--config {shown}: {key} is a switch; give true or false"
                )))
            }
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            other => {
                return Err(TrainError::Config(format!(
                    "--config {shown}: {key} must be a string, number or boolean, got a {}",
                    other.type_str()
                )))
            }
        };
        flags.push(OsString::from(flag));
        flags.push(OsString::from(text));
    }
    Ok(flags)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Command;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    fn parse(argv: Vec<OsString>) -> crate::cli::TrainArgs {
        let cli = Cli::command()
            .args_override_self(true)
            .try_get_matches_from(argv)
            .unwrap();
        let cli = <Cli as clap::FromArgMatches>::from_arg_matches(&cli).unwrap();
        let Command::Train(a) = cli.command else {
            panic!("not a train command")
        };
        a
    }

    fn file(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    #[test]
    fn the_file_sets_flags_and_the_command_line_overrides_it() {
        let f =
            file("layers = 3\nd_model = 32\nlr = 0.002\noverwrite = true\ntask = \"induction\"\n");
        let p = f.path().to_str().unwrap();
        let argv = expand(os(&[
            "mamba-train",
            "train",
            "--config",
            p,
            "--layers",
            "5",
        ]))
        .unwrap();
        let a = parse(argv);
        assert_eq!(a.layers, Some(5), "the command line wins");
        assert_eq!(a.d_model, Some(32));
        assert_eq!(a.lr, Some(0.002));
        assert!(a.overwrite);
        assert_eq!(a.task, Some(crate::cli::args::CliTask::Induction));
        // Without the file nothing is set.
        let a = parse(os(&["mamba-train", "train"]));
        assert_eq!((a.layers, a.d_model), (None, None));
        // `--config=FILE` works the same.
        let a = parse(expand(os(&["mamba-train", "train", &format!("--config={p}")])).unwrap());
        assert_eq!(a.layers, Some(3));
    }

    #[test]
    fn the_architecture_and_its_shape_come_from_the_file_too() {
        let f = file("arch = \"mamba2\"\nhead-dim = 8\nn_groups = 2\nchunk-size = 4\n");
        let p = f.path().to_str().unwrap();
        let a = parse(expand(os(&["mamba-train", "train", "--config", p])).unwrap());
        assert_eq!(a.arch, Some(crate::cli::CliArch::Mamba2));
        assert_eq!(
            (a.head_dim, a.n_groups, a.chunk_size),
            (Some(8), Some(2), Some(4))
        );
        let f = file("arch = \"mamba3\"\n");
        let p = f.path().to_str().unwrap();
        let e = expand(os(&["mamba-train", "train", "--config", p]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--config") && e.contains("mamba3"), "{e}");
    }

    #[test]
    fn bad_files_are_named_with_the_key() {
        let cases = [
            ("n_layer = 3\n", "\"n_layer\" is not a train flag"),
            (
                "layers = [1, 2]\n",
                "layers must be a string, number or boolean",
            ),
            ("overwrite = 1\n", "overwrite is a switch"),
            ("layers = \"many\"\n", "--layers"),
            (
                "config = \"other.toml\"\n",
                "\"config\" is not a train flag",
            ),
            ("layers = \n", "not valid TOML"),
        ];
        for (text, want) in cases {
            let f = file(text);
            let p = f.path().to_str().unwrap();
            let e = expand(os(&["mamba-train", "train", "--config", p]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{text:?}: {e}");
            assert!(e.contains("--config"), "{text:?}: {e}");
        }
        let e = expand(os(&[
            "mamba-train",
            "train",
            "--config",
            "/nonexistent/run.toml",
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("cannot read") && e.contains("/nonexistent/run.toml"),
            "{e}"
        );
        let e = expand(os(&["mamba-train", "train", "--config"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs a file"), "{e}");
    }

    #[test]
    fn argument_lists_without_a_config_are_unchanged() {
        let v = os(&["mamba-train", "train", "--layers", "2"]);
        assert_eq!(expand(v.clone()).unwrap(), v);
        let v = os(&["mamba-train", "--help"]);
        assert_eq!(expand(v.clone()).unwrap(), v);
    }
}

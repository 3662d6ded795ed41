//! The command line's names for the library's settings.
//!
//! The library names a bad setting by its field ([`TrainError::Setting`]:
//! `n_layer`, `peak_lr`); a user of the command line typed `--layers` or
//! `--lr`, so errors shown by the CLI are re-rendered with the flag. Fields
//! without a flag (`d_conv`, `beta1`, ...) can only come from a model
//! config or a checkpoint and keep their field name.

use crate::error::TrainError;

/// `(field, flag)` for every setting the `train` command sets by a flag.
/// A test checks that each flag exists.
pub const SETTING_FLAGS: &[(&str, &str)] = &[
    ("d_model", "--d-model"),
    ("n_layer", "--layers"),
    ("d_state", "--d-state"),
    ("head_dim", "--head-dim"),
    ("n_groups", "--n-groups"),
    ("chunk_size", "--chunk-size"),
    ("batch", "--batch"),
    ("logical_world", "--logical-world"),
    ("seq_len", "--seq-len"),
    ("n_memorize", "--memorize"),
    ("alphabet", "--alphabet"),
    ("peak_lr", "--lr"),
    ("warmup_steps", "--warmup"),
    ("min_lr_frac", "--min-lr-frac"),
    ("total_steps", "--steps"),
    ("weight_decay", "--weight-decay"),
    ("clip_norm", "--clip"),
    ("seed", "--seed"),
];

/// The flag that sets `setting`, if the command line has one.
pub fn flag_for(setting: &str) -> Option<&'static str> {
    SETTING_FLAGS
        .iter()
        .find(|(field, _)| *field == setting)
        .map(|(_, flag)| *flag)
}

/// `e` as the command line shows it: a [`TrainError::Setting`] names the
/// flag instead of the field.
pub fn user_message(e: &TrainError) -> String {
    match e {
        TrainError::Setting { setting, detail } => match flag_for(setting) {
            Some(flag) => format!("invalid configuration: {flag} {detail}"),
            None => e.to_string(),
        },
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Cli;
    use clap::CommandFactory;

    #[test]
    fn every_mapped_flag_exists_on_train() {
        let cmd = Cli::command();
        let train = cmd.find_subcommand("train").expect("train subcommand");
        let longs: Vec<String> = train
            .get_arguments()
            .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
            .collect();
        for (field, flag) in SETTING_FLAGS {
            assert!(
                longs.iter().any(|l| l == flag),
                "{field}: {flag} is not a train flag"
            );
        }
    }

    #[test]
    fn settings_are_shown_with_their_flag() {
        let e = TrainError::setting("n_layer", "must be at least 1, got 0");
        assert_eq!(
            user_message(&e),
            "invalid configuration: --layers must be at least 1, got 0"
        );
        assert!(
            e.to_string().contains("n_layer"),
            "the library keeps the field"
        );
        let unmapped = TrainError::setting("d_conv", "must be at least 1, got 0");
        assert_eq!(user_message(&unmapped), unmapped.to_string());
        let other = TrainError::Config("x".into());
        assert_eq!(user_message(&other), other.to_string());
    }
}

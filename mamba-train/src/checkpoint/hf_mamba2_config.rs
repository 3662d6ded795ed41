//! The Hugging Face `Mamba2Config` JSON of a Mamba-2 checkpoint, and the
//! check that a checkpoint's `config.json` describes its run's model.
//!
//! Written for `Mamba2ForCausalLM` (transformers' field names) and read
//! back by [`mamba2_config_from_hf`] (`--init-from`, `generate`/`eval` of a
//! model directory). Reading asks for every shape field to be present
//! (transformers' own defaults differ from ours, e.g. `n_groups` 8, so a
//! missing one is not guessed). transformers 5.17 loads what this writes
//! (every tensor bit for bit) and `save_pretrained`'s files load here, with
//! logits and loss within tolerance both ways: `scripts/hf_crosscheck.py`
//! parts (c) and (d), run on the GPU machine (docs/HF_CROSSCHECK.md).

use serde_json::{json, Value};

use crate::config::{Arch, ModelConfig, SsdConfig};
use crate::model::init::{DT_FLOOR, DT_MAX, DT_MIN, EMBED_STD};

/// The `Mamba2Config` JSON for `cfg` with Mamba-2 fields `s` (keys sorted
/// by `serde_json`, so the file is deterministic). `time_step_limit` is
/// left to its default `(0, inf)` (no clamp; JSON has no infinity).
pub(super) fn mamba2_config_json(cfg: &ModelConfig, s: &SsdConfig) -> Value {
    json!({
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "state_size": cfg.d_state,
        "num_hidden_layers": cfg.n_layer,
        "conv_kernel": cfg.d_conv,
        "expand": cfg.expand,
        "num_heads": cfg.num_heads(),
        "head_dim": s.head_dim,
        "n_groups": s.n_groups,
        "chunk_size": s.chunk_size,
        "time_step_rank": cfg.dt_rank,
        "layer_norm_epsilon": super::hf_config::LAYER_NORM_EPSILON,
        "rms_norm": true,
        "norm_before_gate": false,
        "use_bias": false,
        "use_conv_bias": true,
        "hidden_act": "silu",
        "residual_in_fp32": true,
        // See RESCALE_PRENORM_RESIDUAL: true makes transformers re-draw
        // the loaded out_proj weights.
        "rescale_prenorm_residual": super::hf_config::RESCALE_PRENORM_RESIDUAL,
        "tie_word_embeddings": true,
        "time_step_min": DT_MIN,
        "time_step_max": DT_MAX,
        "time_step_floor": DT_FLOOR,
        "initializer_range": EMBED_STD,
        "pad_token_id": 0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": true,
        "dtype": "float32",
    })
}

/// The [`ModelConfig`] of a `Mamba2Config` JSON (`model_type` `"mamba2"`):
/// every shape field must be present, and the fields this model fixes
/// (bias-free projections, conv bias, tied head, SiLU, the RMSNorm epsilon,
/// the gated norm after the gate, `num_heads = d_inner / head_dim`) must
/// have the value it supports; each refusal names the field.
pub(super) fn mamba2_config_from_hf(json: &Value) -> std::result::Result<ModelConfig, String> {
    let int = |name: &str| -> std::result::Result<usize, String> {
        match json.get(name) {
            Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| {
                format!("config.json {name} is {v}, expected a non-negative integer")
            }),
            None => Err(format!(
                "config.json has no {name} (a Mamba-2 config needs it)"
            )),
        }
    };
    let d_model = int("hidden_size")?;
    let ssd = SsdConfig {
        head_dim: int("head_dim")?,
        n_groups: int("n_groups")?,
        chunk_size: int("chunk_size")?,
    };
    let cfg = ModelConfig {
        vocab_size: int("vocab_size")?,
        d_model,
        n_layer: int("num_hidden_layers")?,
        d_state: int("state_size")?,
        d_conv: int("conv_kernel")?,
        expand: int("expand")?,
        // Unused by Mamba-2; kept as written ("auto" or absent: the default).
        dt_rank: match json.get("time_step_rank") {
            Some(Value::String(s)) if s == "auto" => d_model.div_ceil(16),
            None => d_model.div_ceil(16),
            Some(_) => int("time_step_rank")?,
        },
        arch: Arch::Mamba2(ssd),
    };
    let want = mamba2_config_json(&cfg, &ssd);
    let fixed = [
        "num_heads",
        "layer_norm_epsilon",
        "rms_norm",
        "norm_before_gate",
        "use_bias",
        "use_conv_bias",
        "hidden_act",
        "tie_word_embeddings",
    ];
    if let Some((name, got)) = first_difference(json, &want, &fixed) {
        return Err(format!(
            "config.json {name} is {got}; this Mamba-2 model supports only {}{}",
            want[name],
            if name == "num_heads" {
                " (expand x hidden_size / head_dim)"
            } else {
                ""
            }
        ));
    }
    check_time_step_limit(json)?;
    Ok(cfg)
}

/// transformers clamps `dt` to `time_step_limit` unless it is `(0, inf)`
/// (its default, saved as `[0.0, Infinity]` in any of the spellings
/// [`non_finite`](super::config_json::non_finite) reads); this model never
/// clamps, so any other limit would silently give other logits: refused.
fn check_time_step_limit(json: &Value) -> std::result::Result<(), String> {
    let Some(v) = json.get("time_step_limit") else {
        return Ok(());
    };
    let bound = |x: &Value| x.as_f64().or_else(|| super::config_json::non_finite(x));
    let no_clamp = match v.as_array().map(Vec::as_slice) {
        Some([lo, hi]) => bound(lo) == Some(0.0) && bound(hi) == Some(f64::INFINITY),
        _ => false,
    };
    if no_clamp {
        Ok(())
    } else {
        Err(format!(
            "config.json time_step_limit is {v}; this Mamba-2 model does not clamp dt, so it \
             supports only [0.0, Infinity] (no limit, transformers' default)"
        ))
    }
}

/// The first of `names` whose value in `json` is not the one in `want`,
/// with what `json` has there (`missing` when absent).
fn first_difference<'a>(
    json: &Value,
    want: &Value,
    names: &[&'a str],
) -> Option<(&'a str, String)> {
    let name = *names.iter().find(|n| json.get(**n) != want.get(**n))?;
    let got = json
        .get(name)
        .map_or_else(|| "missing".to_string(), Value::to_string);
    Some((name, got))
}

/// Check that `json` is the `Mamba2Config` of `cfg` (fields `s`); on a
/// mismatch, name the field and both values.
pub(super) fn check_mamba2_config(
    json: &Value,
    cfg: &ModelConfig,
    s: &SsdConfig,
) -> std::result::Result<(), String> {
    let want = mamba2_config_json(cfg, s);
    let fields = [
        "model_type",
        "vocab_size",
        "hidden_size",
        "state_size",
        "num_hidden_layers",
        "conv_kernel",
        "expand",
        "num_heads",
        "head_dim",
        "n_groups",
        "chunk_size",
        "layer_norm_epsilon",
        "use_bias",
        "use_conv_bias",
        "hidden_act",
        "tie_word_embeddings",
    ];
    match first_difference(json, &want, &fields) {
        Some((name, got)) => Err(format!(
            "config.json {name} is {got}, but state.json's Mamba-2 model has {}",
            want[name]
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::super::hf_config::{check_hf_config, hf_config_json};
    use crate::config::ModelConfig;

    #[test]
    fn time_step_limit_is_read_in_every_spelling_of_no_limit_and_a_real_limit_is_refused() {
        use super::super::hf_config::model_config_from_hf;
        let cfg = ModelConfig::mamba2(10, 32, 2);
        let with = |limit: &str| -> serde_json::Value {
            let mut text = hf_config_json(&cfg).to_string();
            text.insert_str(1, &format!("\"time_step_limit\": {limit}, "));
            super::super::config_json::parse(text.as_bytes()).expect("parses")
        };
        for ok in [
            "[0.0, Infinity]",
            "[0.0, \"Infinity\"]",
            "[0, {\"__float__\": \"Infinity\"}]",
        ] {
            assert_eq!(model_config_from_hf(&with(ok)), Ok(cfg.clone()), "{ok}");
        }
        for bad in ["[0.0, 100.0]", "[0.001, Infinity]", "[0.0]", "\"none\""] {
            let e = model_config_from_hf(&with(bad)).unwrap_err();
            assert!(
                e.contains("time_step_limit") && e.contains("[0.0, Infinity]"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn mamba2_configs_are_written_as_mamba2_and_checked_field_by_field() {
        let cfg = ModelConfig::mamba2(10, 32, 2);
        let j = hf_config_json(&cfg);
        assert_eq!(j["model_type"], "mamba2");
        assert_eq!(j["architectures"][0], "Mamba2ForCausalLM");
        assert_eq!(
            (j["num_heads"].clone(), j["head_dim"].clone()),
            (1.into(), 64.into())
        );
        assert_eq!(j["state_size"], 128);
        check_hf_config(&j, &cfg).unwrap();
        let mut bad = j.clone();
        bad["n_groups"] = 2.into();
        let e = check_hf_config(&bad, &cfg).unwrap_err();
        assert!(e.contains("n_groups is 2") && e.contains("has 1"), "{e}");
        // A Mamba-1 config.json does not describe a Mamba-2 run, nor the
        // other way round.
        let m1 = ModelConfig::new(10, 32, 2);
        assert!(check_hf_config(&hf_config_json(&m1), &cfg).is_err());
        assert!(check_hf_config(&j, &m1).unwrap_err().contains("model_type"));
    }

    #[test]
    fn mamba2_configs_read_back_and_unsupported_fields_are_named() {
        use super::super::hf_config::{hf_model_type, model_config_from_hf};
        let mut cfg = ModelConfig::mamba2(10, 32, 2);
        if let crate::config::Arch::Mamba2(s) = &mut cfg.arch {
            s.head_dim = 16;
            s.n_groups = 2;
            s.chunk_size = 8;
        }
        let j = hf_config_json(&cfg);
        assert_eq!(model_config_from_hf(&j).unwrap(), cfg);
        assert_eq!(hf_model_type(&cfg.arch), "mamba2");
        assert_eq!(hf_model_type(&crate::config::Arch::Mamba1), "mamba");
        for (field, value, want) in [
            ("num_heads", 3.into(), "num_heads is 3"),
            ("norm_before_gate", true.into(), "norm_before_gate"),
            ("tie_word_embeddings", false.into(), "tie_word_embeddings"),
            ("head_dim", "x".into(), "head_dim is \"x\""),
        ] {
            let mut bad = j.clone();
            bad[field] = value;
            let e = model_config_from_hf(&bad).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        let mut sparse = j.clone();
        sparse.as_object_mut().unwrap().remove("n_groups");
        let e = model_config_from_hf(&sparse).unwrap_err();
        assert!(e.contains("no n_groups"), "{e}");
        let mut other = j.clone();
        other["model_type"] = "jamba".into();
        let e = model_config_from_hf(&other).unwrap_err();
        assert!(e.contains("\"jamba\"") && e.contains("\"mamba2\""), "{e}");
    }
}

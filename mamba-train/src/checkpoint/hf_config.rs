//! The Hugging Face `config.json` of a checkpoint, so that
//! `transformers.MambaForCausalLM.from_pretrained(dir)` loads the weights.

use serde_json::{json, Value};

use crate::config::{ModelConfig, RMS_EPS};

/// The `MambaConfig` JSON for `cfg` (keys sorted, so the file is
/// deterministic). The LM head is tied to the embedding; projections have no
/// bias, the conv has one; dt init constants are the reference's.
pub fn hf_config_json(cfg: &ModelConfig) -> Value {
    json!({
        "architectures": ["MambaForCausalLM"],
        "model_type": "mamba",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "state_size": cfg.d_state,
        "num_hidden_layers": cfg.n_layer,
        "conv_kernel": cfg.d_conv,
        "expand": cfg.expand,
        "intermediate_size": cfg.d_inner(),
        "time_step_rank": cfg.dt_rank,
        "layer_norm_epsilon": RMS_EPS,
        "use_bias": false,
        "use_conv_bias": true,
        "hidden_act": "silu",
        "residual_in_fp32": true,
        "rescale_prenorm_residual": false,
        "tie_word_embeddings": true,
        "time_step_scale": 1.0,
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_floor": 0.0001,
        "time_step_init_scheme": "random",
        "initializer_range": 0.1,
        "pad_token_id": 0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": true,
        "torch_dtype": "float32",
    })
}

/// The [`ModelConfig`] a Hugging Face `MambaConfig` JSON describes (e.g. one
/// written by `transformers`' `save_pretrained`). Refuses what this model
/// does not implement (untied head, projection biases, no conv bias), naming
/// the field. `time_step_rank: "auto"` is `ceil(hidden_size / 16)`.
pub fn model_config_from_hf(json: &Value) -> std::result::Result<ModelConfig, String> {
    match json.get("model_type").and_then(Value::as_str) {
        Some("mamba") => {}
        other => {
            return Err(format!(
                "config.json model_type is {other:?}, expected \"mamba\""
            ))
        }
    }
    let int = |name: &str, default: Option<u64>| -> std::result::Result<usize, String> {
        match json.get(name) {
            Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| {
                format!("config.json {name} is {v}, expected a non-negative integer")
            }),
            None => default
                .map(|d| d as usize)
                .ok_or_else(|| format!("config.json has no {name}")),
        }
    };
    let d_model = int("hidden_size", None)?;
    let dt_rank = match json.get("time_step_rank") {
        Some(Value::String(s)) if s == "auto" => d_model.div_ceil(16),
        _ => int("time_step_rank", Some(d_model.div_ceil(16) as u64))?,
    };
    let cfg = ModelConfig {
        vocab_size: int("vocab_size", None)?,
        d_model,
        n_layer: int("num_hidden_layers", None)?,
        d_state: int("state_size", Some(16))?,
        d_conv: int("conv_kernel", Some(4))?,
        expand: int("expand", Some(2))?,
        dt_rank,
    };
    // Hugging Face defaults: use_bias false, use_conv_bias true, tied head.
    for (name, want) in [
        ("use_bias", false),
        ("use_conv_bias", true),
        ("tie_word_embeddings", true),
    ] {
        let got = json.get(name).map_or(Some(want), Value::as_bool);
        if got != Some(want) {
            return Err(format!(
                "config.json {name} is {:?}; this model supports only {want}",
                json[name]
            ));
        }
    }
    Ok(cfg)
}

/// Check that a `config.json` describes `cfg`; on a mismatch, say which
/// Hugging Face field differs and both values.
pub fn check_hf_config(json: &Value, cfg: &ModelConfig) -> std::result::Result<(), String> {
    match json.get("model_type").and_then(Value::as_str) {
        Some("mamba") => {}
        other => {
            return Err(format!(
                "config.json model_type is {other:?}, expected \"mamba\""
            ))
        }
    }
    let fields = [
        ("vocab_size", cfg.vocab_size),
        ("hidden_size", cfg.d_model),
        ("state_size", cfg.d_state),
        ("num_hidden_layers", cfg.n_layer),
        ("conv_kernel", cfg.d_conv),
        ("expand", cfg.expand),
        ("time_step_rank", cfg.dt_rank),
    ];
    for (name, want) in fields {
        let got = json.get(name).and_then(Value::as_u64);
        if got != Some(want as u64) {
            return Err(format!(
                "config.json {name} is {}, but state.json's model has {want}",
                got.map_or_else(|| "missing".to_string(), |v| v.to_string())
            ));
        }
    }
    for (name, want) in [
        ("use_bias", false),
        ("use_conv_bias", true),
        ("tie_word_embeddings", true),
    ] {
        let got = json.get(name).and_then(Value::as_bool);
        if got != Some(want) {
            return Err(format!("config.json {name} is {got:?}, expected {want}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_names_a_mismatched_field() {
        let cfg = ModelConfig::new(10, 32, 2);
        let j = hf_config_json(&cfg);
        assert_eq!(j["hidden_size"], 32);
        assert_eq!(j["time_step_rank"], 2);
        assert_eq!(j["intermediate_size"], 64);
        check_hf_config(&j, &cfg).unwrap();
        let other = ModelConfig::new(10, 32, 3);
        let e = check_hf_config(&j, &other).unwrap_err();
        assert!(e.contains("num_hidden_layers"), "{e}");
        assert_eq!(model_config_from_hf(&j).unwrap(), cfg);
        let mut auto = j.clone();
        auto["time_step_rank"] = json!("auto");
        assert_eq!(model_config_from_hf(&auto).unwrap().dt_rank, 2);
        let mut untied = j.clone();
        untied["tie_word_embeddings"] = json!(false);
        assert!(model_config_from_hf(&untied)
            .unwrap_err()
            .contains("tie_word_embeddings"));
        let mut bad = j.clone();
        bad["model_type"] = json!("llama");
        assert!(check_hf_config(&bad, &cfg)
            .unwrap_err()
            .contains("model_type"));
    }
}

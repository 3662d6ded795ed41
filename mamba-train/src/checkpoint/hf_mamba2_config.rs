//! The Hugging Face `Mamba2Config` JSON of a Mamba-2 checkpoint, and the
//! check that a checkpoint's `config.json` describes its run's model.
//!
//! Written for `Mamba2ForCausalLM` (transformers' field names); loading a
//! Mamba-2 `config.json` from elsewhere (`--init-from`) is not supported
//! yet, and the file has not yet been loaded by transformers itself (the
//! cross-check runs on the GPU machine).

use serde_json::{json, Value};

use crate::config::{ModelConfig, SsdConfig};
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
        "rescale_prenorm_residual": true,
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

/// Check that `json` is the `Mamba2Config` of `cfg` (fields `s`); on a
/// mismatch, name the field and both values.
pub(super) fn check_mamba2_config(
    json: &Value,
    cfg: &ModelConfig,
    s: &SsdConfig,
) -> std::result::Result<(), String> {
    let want = mamba2_config_json(cfg, s);
    for name in [
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
    ] {
        let got = json.get(name);
        if got != want.get(name) {
            return Err(format!(
                "config.json {name} is {}, but state.json's Mamba-2 model has {}",
                got.map_or_else(|| "missing".to_string(), Value::to_string),
                want[name]
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::hf_config::{check_hf_config, hf_config_json};
    use crate::config::ModelConfig;

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
}

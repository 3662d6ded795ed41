//! The Hugging Face `config.json` of a checkpoint, so that
//! `transformers.MambaForCausalLM.from_pretrained(dir)` loads the weights.

use serde_json::{json, Value};

use crate::config::{Arch, ModelConfig, RMS_EPS};

/// [`RMS_EPS`] as the decimal it stands for.
pub(super) const LAYER_NORM_EPSILON: f64 = 1e-5;
const _: () = assert!(LAYER_NORM_EPSILON as f32 == RMS_EPS);

/// transformers' `model_type` of a Mamba-1 `config.json`.
pub const MODEL_TYPE_MAMBA1: &str = "mamba";
/// transformers' `model_type` of a Mamba-2 `config.json`.
pub const MODEL_TYPE_MAMBA2: &str = "mamba2";

/// The `model_type` a `config.json` of `arch` has.
pub fn hf_model_type(arch: &Arch) -> &'static str {
    match arch {
        Arch::Mamba1 => MODEL_TYPE_MAMBA1,
        Arch::Mamba2(_) => MODEL_TYPE_MAMBA2,
    }
}

/// Fields whose value this model fixes: `(name, the only value supported)`.
/// A config that omits one gets the Hugging Face default, which is the
/// supported value for each.
fn fixed_fields() -> [(&'static str, Value); 4] {
    [
        ("use_bias", json!(false)),
        ("use_conv_bias", json!(true)),
        ("tie_word_embeddings", json!(true)),
        ("hidden_act", json!("silu")),
    ]
}

/// Refuse a config whose fixed fields, `intermediate_size` or
/// `layer_norm_epsilon` this model cannot honour (each named, with what is
/// supported). `missing_ok`: an absent field means its Hugging Face default
/// (a config written by someone else) rather than an error (ours).
fn check_supported(
    json: &Value,
    cfg: &ModelConfig,
    missing_ok: bool,
) -> std::result::Result<(), String> {
    for (name, want) in fixed_fields() {
        match json.get(name) {
            Some(got) if *got == want => {}
            None if missing_ok => {}
            got => {
                return Err(format!(
                    "config.json {name} is {}; this model supports only {want}",
                    got.map_or_else(|| "missing".to_string(), Value::to_string)
                ))
            }
        }
    }
    match json.get("intermediate_size") {
        Some(v) if v.as_u64() == Some(cfg.d_inner() as u64) => {}
        None if missing_ok => {}
        got => {
            return Err(format!(
                "config.json intermediate_size is {}, but this model's inner width is expand x \
                 hidden_size = {} x {} = {}",
                got.map_or_else(|| "missing".to_string(), Value::to_string),
                cfg.expand,
                cfg.d_model,
                cfg.d_inner()
            ))
        }
    }
    match json.get("layer_norm_epsilon") {
        Some(v) if v.as_f64().is_some_and(|e| e as f32 == RMS_EPS) => {}
        None if missing_ok => {}
        got => {
            return Err(format!(
                "config.json layer_norm_epsilon is {}; this model's RMSNorm uses only \
                 {LAYER_NORM_EPSILON:e}",
                got.map_or_else(|| "missing".to_string(), Value::to_string)
            ))
        }
    }
    Ok(())
}

/// `rescale_prenorm_residual` as config.json writes it: `false`, although
/// [`crate::model::init`] does divide `out_proj` by `sqrt(n_layer)`.
/// transformers (5.17, measured by `scripts/hf_crosscheck.py` on the GPU
/// machine, 2026-12-02) runs that init rule inside `from_pretrained` on the
/// *loaded* `out_proj.weight` of every block when the flag is true, so a
/// checkpoint saying `true` loads into `MambaForCausalLM` /
/// `Mamba2ForCausalLM` with every `out_proj` re-drawn (other logits, no
/// warning). The flag only describes an initialisation, which a trained
/// checkpoint is past; `false` is transformers' own default. Files written
/// with `true` (before this) still load here: the field is not checked.
pub const RESCALE_PRENORM_RESIDUAL: bool = false;

/// The `MambaConfig` JSON for `cfg` (keys sorted, so the file is
/// deterministic). The LM head is tied to the embedding; projections have no
/// bias, the conv has one; the init fields describe the initialisation the
/// weights were made with ([`crate::model::init`]: embeddings N(0, 0.02),
/// the reference's dt constants) except `rescale_prenorm_residual`
/// ([`RESCALE_PRENORM_RESIDUAL`]); `dtype` is the key transformers 5
/// writes.
/// A Mamba-2 config gets the `Mamba2Config` of
/// `checkpoint::hf_mamba2_config` instead.
pub fn hf_config_json(cfg: &ModelConfig) -> Value {
    if let Some(s) = cfg.ssd() {
        return super::hf_mamba2_config::mamba2_config_json(cfg, s);
    }
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
        // Written as the decimal 1e-5 the model means, not the f32's
        // widened value (9.99999974e-6).
        "layer_norm_epsilon": LAYER_NORM_EPSILON,
        "use_bias": false,
        "use_conv_bias": true,
        "hidden_act": "silu",
        "residual_in_fp32": true,
        // False although our init does rescale out_proj: see
        // RESCALE_PRENORM_RESIDUAL.
        "rescale_prenorm_residual": RESCALE_PRENORM_RESIDUAL,
        "tie_word_embeddings": true,
        "time_step_scale": 1.0,
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_floor": 0.0001,
        "time_step_init_scheme": "random",
        "initializer_range": 0.02,
        "pad_token_id": 0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": true,
        "dtype": "float32",
    })
}

/// The [`ModelConfig`] a Hugging Face `MambaConfig` JSON describes (e.g. one
/// written by `transformers`' `save_pretrained`). Refuses what this model
/// does not implement (untied head, projection biases, no conv bias, an
/// activation other than SiLU, an `intermediate_size` other than `expand x
/// hidden_size`, another RMSNorm epsilon), naming the field. `time_step_rank: "auto"` is `ceil(hidden_size / 16)`.
///
/// A `Mamba2Config` (`model_type` `"mamba2"`) is read by
/// `checkpoint::hf_mamba2_config`: the architecture comes from `model_type`.
pub fn model_config_from_hf(json: &Value) -> std::result::Result<ModelConfig, String> {
    match json.get("model_type").and_then(Value::as_str) {
        Some(MODEL_TYPE_MAMBA1) => {}
        Some(MODEL_TYPE_MAMBA2) => return super::hf_mamba2_config::mamba2_config_from_hf(json),
        other => {
            return Err(format!(
                "config.json model_type is {other:?}, expected \"{MODEL_TYPE_MAMBA1}\" (Mamba) or \
                 \"{MODEL_TYPE_MAMBA2}\" (Mamba-2)"
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
        arch: Default::default(),
    };
    check_supported(json, &cfg, true)?;
    Ok(cfg)
}

/// Check that a `config.json` describes `cfg`; on a mismatch, say which
/// Hugging Face field differs and both values.
pub fn check_hf_config(json: &Value, cfg: &ModelConfig) -> std::result::Result<(), String> {
    if let Some(s) = cfg.ssd() {
        return super::hf_mamba2_config::check_mamba2_config(json, cfg, s);
    }
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
    check_supported(json, cfg, false)
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
        // What the model cannot honour is refused, naming the field.
        for (field, value) in [
            ("hidden_act", json!("gelu")),
            ("intermediate_size", json!(65)),
            ("layer_norm_epsilon", json!(1e-6)),
            ("use_bias", json!(true)),
        ] {
            let mut other = j.clone();
            other[field] = value;
            let e = model_config_from_hf(&other).unwrap_err();
            assert!(e.contains(field), "{e}");
            let e = check_hf_config(&other, &cfg).unwrap_err();
            assert!(e.contains(field), "{e}");
        }
        // Someone else's config may omit them (the defaults are ours) ...
        let mut sparse = j.clone();
        for field in ["hidden_act", "intermediate_size", "layer_norm_epsilon"] {
            sparse.as_object_mut().unwrap().remove(field);
        }
        assert_eq!(model_config_from_hf(&sparse).unwrap(), cfg);
        // ... but a checkpoint of ours must carry them.
        assert!(check_hf_config(&sparse, &cfg)
            .unwrap_err()
            .contains("missing"));
        // The init it describes, and the dtype key of transformers 5.
        assert_eq!(j["initializer_range"], 0.02);
        // transformers re-draws a loaded out_proj when this is true.
        assert_eq!(j["rescale_prenorm_residual"], false);
        assert_eq!(j["layer_norm_epsilon"], 1e-5);
        assert_eq!(j["dtype"], "float32");
        let mut bad = j.clone();
        bad["model_type"] = json!("llama");
        assert!(check_hf_config(&bad, &cfg)
            .unwrap_err()
            .contains("model_type"));
    }
}

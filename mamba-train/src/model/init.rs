//! Reference initialisation (the Mamba / Hugging Face `MambaPreTrainedModel`
//! rules), a pure function of `(config, seed)`.
//!
//! Tensor number `i` of the layout (its position in
//! [`ParamLayout::entries`]) draws from its own stream
//! `Rng::new(derive(seed, Domain::Init, &[i]))`, element by element in arena
//! order, in f64, rounded to f32 once. So the weights do not depend on the
//! thread count, the world size, or which other tensors exist before it in a
//! stream.
//!
//! Rules (fan_in = columns of the weight):
//! - `embeddings.weight`: N(0, 0.02);
//! - `in_proj`, `x_proj`: U(+-1/sqrt(fan_in)) (nn.Linear's
//!   kaiming_uniform(a=sqrt 5));
//! - `out_proj`: the same, then divided by sqrt(n_layer)
//!   (the reference's `rescale_prenorm_residual`; config.json still says
//!   `false`, see [`crate::checkpoint::hf_config::RESCALE_PRENORM_RESIDUAL`]);
//! - `conv1d.weight` and `conv1d.bias`: U(+-1/sqrt(d_conv)) (nn.Conv1d,
//!   depthwise so fan_in = d_conv);
//! - `dt_proj.weight`: U(+-dt_rank^-0.5);
//! - `dt_proj.bias`: `dt + ln(-expm1(-dt))` (inverse softplus) with
//!   `dt = max(exp(U(0,1) * (ln 0.1 - ln 1e-3) + ln 1e-3), 1e-4)`;
//! - `A_log[c, n] = ln(n + 1)`; `D = 1`; norm weights = 1.
//!
//! Mamba-2 (the `Mamba2` module of state-spaces/mamba, `A_init_range`
//! (1, 16)), with the same embedding, in_proj, conv1d, out_proj and norm
//! rules:
//! - `dt_bias[h]`: the inverse softplus of the same log-uniform dt;
//! - `A_log[h] = ln(U(1, 16))`; `D[h] = 1`; `mixer.norm.weight` = 1.
//!
//! (Hugging Face's `Mamba2PreTrainedModel` differs in two places that
//! `from_pretrained` overwrites anyway: `A_log[h] = ln(h + 1)` and a zero
//! conv bias.)

use crate::config::ModelConfig;
use crate::params::ParamLayout;
use crate::seed::{derive, Domain, Rng};

/// Smallest initial dt (`time_step_min`).
pub const DT_MIN: f64 = 1e-3;
/// Largest initial dt (`time_step_max`).
pub const DT_MAX: f64 = 0.1;
/// Floor applied to the sampled dt (`time_step_floor`).
pub const DT_FLOOR: f64 = 1e-4;
/// Standard deviation of the embedding (`initializer_range`).
pub const EMBED_STD: f64 = 0.02;

/// How one tensor is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Rule {
    Normal(f64),
    Uniform(f64),
    Const(f64),
    DtBias,
    ALog {
        d_state: usize,
    },
    /// `ln(U(lo, hi))`, Mamba-2's per-head `A_log`.
    LnUniform(f64, f64),
}

/// Mamba-2's `A_init_range`: `-A` is drawn uniformly from it.
pub const SSD_A_INIT_RANGE: (f64, f64) = (1.0, 16.0);

/// The rule for a Hugging Face tensor name, or `None` for a name the model
/// does not have.
fn rule(name: &str, cfg: &ModelConfig) -> Option<Rule> {
    let inv_sqrt = |f: usize| 1.0 / (f as f64).sqrt();
    let leaf = name.rsplit_once("layers.").map_or(name, |(_, rest)| {
        rest.split_once('.').map_or(rest, |(_, l)| l)
    });
    Some(match leaf {
        "backbone.embeddings.weight" => Rule::Normal(EMBED_STD),
        "backbone.norm_f.weight" | "norm.weight" => Rule::Const(1.0),
        "mixer.in_proj.weight" => Rule::Uniform(inv_sqrt(cfg.d_model)),
        "mixer.conv1d.weight" | "mixer.conv1d.bias" => Rule::Uniform(inv_sqrt(cfg.d_conv)),
        "mixer.x_proj.weight" => Rule::Uniform(inv_sqrt(cfg.d_inner())),
        "mixer.dt_proj.weight" => Rule::Uniform(inv_sqrt(cfg.dt_rank)),
        "mixer.dt_proj.bias" => Rule::DtBias,
        "mixer.A_log" if cfg.ssd().is_none() => Rule::ALog {
            d_state: cfg.d_state,
        },
        "mixer.D" => Rule::Const(1.0),
        // Mamba-2 only.
        "mixer.dt_bias" if cfg.ssd().is_some() => Rule::DtBias,
        "mixer.A_log" => Rule::LnUniform(SSD_A_INIT_RANGE.0, SSD_A_INIT_RANGE.1),
        "mixer.norm.weight" if cfg.ssd().is_some() => Rule::Const(1.0),
        "mixer.out_proj.weight" => {
            Rule::Uniform(inv_sqrt(cfg.d_inner()) / (cfg.n_layer as f64).sqrt())
        }
        _ => return None,
    })
}

/// Inverse of softplus: the `x` with `ln(1 + e^x) = dt`.
pub fn inverse_softplus(dt: f64) -> f64 {
    dt + (-(-dt).exp_m1()).ln()
}

/// The initial parameter arena of `cfg` (laid out by `layout`, which must
/// be `ParamLayout::new(cfg)`) for master seed `seed`.
pub fn init_params(cfg: &ModelConfig, layout: &ParamLayout, seed: u64) -> Vec<f32> {
    let mut p = vec![0.0f32; layout.len()];
    for (i, entry) in layout.entries().iter().enumerate() {
        let rule = rule(&entry.name, cfg)
            .unwrap_or_else(|| panic!("no initialisation rule for layout tensor {}", entry.name));
        let mut rng = Rng::new(derive(seed, Domain::Init, &[i as u64]));
        let out = &mut p[entry.range()];
        match rule {
            Rule::Normal(std) => out
                .iter_mut()
                .for_each(|v| *v = (rng.normal() * std) as f32),
            Rule::Uniform(b) => out
                .iter_mut()
                .for_each(|v| *v = ((rng.next_f64() * 2.0 - 1.0) * b) as f32),
            Rule::Const(c) => out.fill(c as f32),
            Rule::DtBias => out.iter_mut().for_each(|v| {
                let (lo, hi) = (DT_MIN.ln(), DT_MAX.ln());
                let dt = (rng.next_f64() * (hi - lo) + lo).exp().max(DT_FLOOR);
                *v = inverse_softplus(dt) as f32;
            }),
            Rule::LnUniform(lo, hi) => out
                .iter_mut()
                .for_each(|v| *v = (rng.next_f64() * (hi - lo) + lo).ln() as f32),
            Rule::ALog { d_state } => {
                for (j, v) in out.iter_mut().enumerate() {
                    *v = (((j % d_state) + 1) as f64).ln() as f32;
                }
            }
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layout_tensor_has_a_rule() {
        let cfg = ModelConfig::new(20, 32, 3);
        for e in ParamLayout::new(&cfg).entries() {
            assert!(rule(&e.name, &cfg).is_some(), "{}", e.name);
        }
        assert_eq!(rule("backbone.layers.0.mixer.bogus", &cfg), None);
        assert_eq!(
            rule("backbone.layers.12.mixer.D", &cfg),
            Some(Rule::Const(1.0))
        );
    }

    #[test]
    fn mamba2_tensors_follow_the_reference_rules() {
        let mut cfg = ModelConfig::mamba2(20, 32, 3);
        if let crate::config::Arch::Mamba2(s) = &mut cfg.arch {
            s.head_dim = 4; // 16 heads: enough draws to see the ranges
        }
        let lay = ParamLayout::new(&cfg);
        for e in lay.entries() {
            assert!(rule(&e.name, &cfg).is_some(), "{}", e.name);
        }
        let p = init_params(&cfg, &lay, 7);
        let get = |n: &str| &p[lay.get(n).unwrap().range()];
        let a_log = get("backbone.layers.2.mixer.A_log");
        assert_eq!(a_log.len(), 16);
        assert!(
            a_log.iter().all(|&a| (0.0..=16f32.ln()).contains(&a)),
            "{a_log:?}"
        );
        assert!(
            a_log.windows(2).any(|w| w[0] != w[1]),
            "drawn, not constant"
        );
        for &b in get("backbone.layers.0.mixer.dt_bias") {
            let dt = (b as f64).exp().ln_1p();
            assert!((DT_MIN * 0.999..=DT_MAX * 1.001).contains(&dt), "{dt}");
        }
        assert!(get("backbone.layers.1.mixer.D").iter().all(|&d| d == 1.0));
        assert!(get("backbone.layers.1.mixer.norm.weight")
            .iter()
            .all(|&d| d == 1.0));
        // A Mamba-1 model has no dt_bias or gated norm.
        let m1 = ModelConfig::new(20, 32, 3);
        assert_eq!(rule("backbone.layers.0.mixer.dt_bias", &m1), None);
        assert_eq!(rule("backbone.layers.0.mixer.norm.weight", &m1), None);
    }

    #[test]
    fn inverse_softplus_inverts_softplus() {
        for dt in [1e-4, 1e-3, 0.01, 0.1, 3.0] {
            let x = inverse_softplus(dt);
            assert!(((x.exp()).ln_1p() - dt).abs() < 1e-12 * dt.max(1.0), "{dt}");
        }
    }
}

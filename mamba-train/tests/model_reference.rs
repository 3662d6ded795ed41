//! The CPU model's forward pass against an independent, deliberately naive
//! f64 transcription of Hugging Face's `MambaForCausalLM` slow path: plain
//! index loops over the tensors looked up by their Hugging Face names. Gradient
//! checks cannot catch a wrong but self-consistent forward (x and z swapped,
//! B and C swapped, a conv tap reversed); this test can.

use mamba_train::config::RMS_EPS;
use mamba_train::model::cpu::CpuModel;
use mamba_train::model::{Batch, IGNORE};
use mamba_train::params::ParamLayout;
use mamba_train::seed::Rng;
use mamba_train::ModelConfig;

fn silu(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

/// torch.nn.functional.softplus(beta=1, threshold=20).
fn softplus(v: f64) -> f64 {
    if v > 20.0 {
        v
    } else {
        v.exp().ln_1p()
    }
}

fn rmsnorm(x: &[f64], w: &[f64]) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + RMS_EPS as f64).sqrt();
    x.iter().zip(w).map(|(v, w)| v * r * w).collect()
}

/// `W x` for a row-major `[out, in]` weight.
fn linear(w: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks_exact(x.len())
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

/// Logits of one sequence, `[l][vocab]`.
/// `reverse_taps` flips the conv kernel (a plausible bug, for the negative
/// control).
fn naive_logits(
    cfg: &ModelConfig,
    lay: &ParamLayout,
    p: &[f64],
    tokens: &[u32],
    reverse_taps: bool,
) -> Vec<Vec<f64>> {
    let get = |name: String| -> &[f64] {
        let e = lay.get(&name).unwrap_or_else(|| panic!("no tensor {name}"));
        &p[e.range()]
    };
    let (d, e, n, r, k) = (
        cfg.d_model,
        cfg.d_inner(),
        cfg.d_state,
        cfg.dt_rank,
        cfg.d_conv,
    );
    let l = tokens.len();
    let emb = get("backbone.embeddings.weight".into());
    let mut x: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| emb[t as usize * d..(t as usize + 1) * d].to_vec())
        .collect();
    for i in 0..cfg.n_layer {
        let m = |s: &str| format!("backbone.layers.{i}.mixer.{s}");
        let norm_w = get(format!("backbone.layers.{i}.norm.weight"));
        let in_proj = get(m("in_proj.weight"));
        let conv_w = get(m("conv1d.weight"));
        let conv_b = get(m("conv1d.bias"));
        let x_proj = get(m("x_proj.weight"));
        let dt_w = get(m("dt_proj.weight"));
        let dt_b = get(m("dt_proj.bias"));
        let a_log = get(m("A_log"));
        let d_skip = get(m("D"));
        let out_proj = get(m("out_proj.weight"));
        // in_proj: hidden_states, gate = projected.chunk(2) (x first, z second).
        let xz: Vec<Vec<f64>> = x
            .iter()
            .map(|row| linear(in_proj, &rmsnorm(row, norm_w)))
            .collect();
        // conv1d(padding = k - 1)[..., :l]: output t sees inputs t-k+1 ..= t,
        // weight tap j multiplying input t - (k - 1) + j.
        let u: Vec<Vec<f64>> = (0..l)
            .map(|t| {
                (0..e)
                    .map(|c| {
                        let mut acc = conv_b[c];
                        for j in 0..k {
                            if let Some(s) = (t + j).checked_sub(k - 1) {
                                let tap = if reverse_taps { k - 1 - j } else { j };
                                acc += conv_w[c * k + tap] * xz[s][c];
                            }
                        }
                        silu(acc)
                    })
                    .collect()
            })
            .collect();
        // x_proj -> (time_step, B, C) = split([dt_rank, d_state, d_state]).
        let mut h = vec![vec![0.0f64; n]; e];
        for t in 0..l {
            let dbc = linear(x_proj, &u[t]);
            let (dt_raw, bm, cm) = (&dbc[..r], &dbc[r..r + n], &dbc[r + n..r + 2 * n]);
            let dt: Vec<f64> = linear(dt_w, dt_raw)
                .iter()
                .zip(dt_b)
                .map(|(v, b)| softplus(v + b))
                .collect();
            let mut g = vec![0.0; e];
            for c in 0..e {
                let mut y = 0.0;
                for s in 0..n {
                    let a = -a_log[c * n + s].exp();
                    h[c][s] = (dt[c] * a).exp() * h[c][s] + dt[c] * bm[s] * u[t][c];
                    y += h[c][s] * cm[s];
                }
                y += d_skip[c] * u[t][c];
                g[c] = y * silu(xz[t][e + c]);
            }
            let o = linear(out_proj, &g);
            for (xv, ov) in x[t].iter_mut().zip(o) {
                *xv += ov;
            }
        }
    }
    let norm_f = get("backbone.norm_f.weight".into());
    x.iter()
        .map(|row| linear(emb, &rmsnorm(row, norm_f)))
        .collect()
}

#[test]
fn forward_matches_a_naive_transcription_of_the_reference() {
    let cfg = ModelConfig {
        vocab_size: 13,
        d_model: 12,
        n_layer: 2,
        d_state: 5,
        d_conv: 4,
        expand: 2,
        dt_rank: 2,
        arch: Default::default(),
    };
    let model = CpuModel::new(cfg.clone()).unwrap();
    // Perturbed reference init so that every parameter matters.
    let mut rng = Rng::new(3);
    let p: Vec<f64> = model
        .init_params(8)
        .iter()
        .map(|&v| v as f64 + 0.2 * rng.normal())
        .collect();
    let (nseq, l) = (2, 11);
    let tokens: Vec<u32> = (0..nseq * l).map(|_| rng.below(13) as u32).collect();
    let targets: Vec<i32> = (0..nseq * l)
        .map(|i| {
            if i % 5 == 0 {
                IGNORE
            } else {
                rng.below(13) as i32
            }
        })
        .collect();
    let b = Batch {
        tokens: tokens.clone(),
        targets: targets.clone(),
        batch: nseq,
        seq_len: l,
    };
    let got = model.logits_f64(&p, &b).unwrap();
    let (mut loss_sum, mut count) = (0.0, 0);
    for s in 0..nseq {
        let want = naive_logits(&cfg, model.layout(), &p, &tokens[s * l..(s + 1) * l], false);
        for (t, row) in want.iter().enumerate() {
            for (v, w) in row.iter().enumerate() {
                let g = got[(s * l + t) * 13 + v];
                assert!(
                    (g - w).abs() <= 1e-12 * (1.0 + w.abs()),
                    "seq {s} pos {t} logit {v}: {g} vs naive {w}"
                );
            }
            let tgt = targets[s * l + t];
            if tgt != IGNORE {
                let lse = row.iter().map(|z| z.exp()).sum::<f64>().ln();
                loss_sum += lse - row[tgt as usize];
                count += 1;
            }
        }
    }
    let loss = model.loss_f64(&p, &b).unwrap();
    assert!(
        (loss - loss_sum / count as f64).abs() < 1e-12,
        "loss {loss} vs naive {}",
        loss_sum / count as f64
    );
    // Negative control: a plausible bug in the transcription is visible.
    let wrong = naive_logits(&cfg, model.layout(), &p, &tokens[..l], true);
    let moved = wrong
        .iter()
        .flatten()
        .zip(&got[..l * 13])
        .any(|(w, g)| (w - g).abs() > 1e-6);
    assert!(moved, "reversing the conv taps went unnoticed");
    // And the f32 model agrees with both to f32 accuracy.
    let p32: Vec<f32> = p.iter().map(|&v| v as f32).collect();
    let got32 = model.logits(&p32, &b).unwrap();
    for (a, w) in got32.iter().zip(&got) {
        assert!(
            (*a as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()),
            "f32 logit {a} vs f64 {w}"
        );
    }
}

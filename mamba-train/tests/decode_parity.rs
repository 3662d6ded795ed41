//! Recurrent decoding (`CpuDecoder`, one token per step, conv and SSM state
//! carried between steps) against the full forward pass over the same
//! prefix (`CpuModel::logits`), over random small shapes and token
//! sequences.
//!
//! Tolerance: none — the logits must be the same bits. The step runs the
//! forward pass's operations in the forward pass's order (one-row `gemm`,
//! whose every output is the same ascending chain as with many rows; the
//! conv over the same taps in the same order; the scan's per-lane recurrence
//! unchanged; the same fixed `exp`), so any difference at all is a bug, and
//! an f32 tolerance would only hide one. The CUDA step is compared with
//! this one within a stated tolerance in `cuda_decode.rs`.
//!
//! Negative controls: the step's logits compared with the forward pass's at
//! the previous position, and after a corrupted conv or SSM state, differ
//! by far more than f32 rounding (so the comparison can fail, and both
//! parts of the state are read).

mod cuda_common;

use cuda_common::{decode, perturbed, random_case};
use mamba_train::model::cpu::{CpuDecoder, CpuModel};
use mamba_train::model::{Batch, DecodeState, Decoder, IGNORE};
use mamba_train::seed::Rng;
use mamba_train::ModelConfig;

fn tokens(cfg: &ModelConfig, l: usize, seed: u64) -> Vec<u32> {
    let mut r = Rng::new(seed ^ 0xdec0de);
    (0..l)
        .map(|_| r.below(cfg.vocab_size as u64) as u32)
        .collect()
}

/// Full-forward logits `[l, vocab]` of one sequence.
fn forward(cfg: &ModelConfig, params: &[f32], toks: &[u32]) -> Vec<f32> {
    let model = CpuModel::new(cfg.clone()).unwrap();
    let b = Batch {
        tokens: toks.to_vec(),
        targets: vec![IGNORE; toks.len()],
        batch: 1,
        seq_len: toks.len(),
    };
    model.logits(params, &b).unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn recurrent_logits_are_the_full_forward_bits_at_every_position() {
    let mut positions = 0;
    for seed in 0..40u64 {
        let (cfg, _, l) = random_case(seed);
        let params = perturbed(&cfg, seed);
        let toks = tokens(&cfg, l, seed);
        let want = forward(&cfg, &params, &toks);
        let mut dec = CpuDecoder::new(cfg.clone(), params).unwrap();
        let got = decode(&mut dec, &toks);
        let v = cfg.vocab_size;
        for t in 0..l {
            let (g, w) = (&got[t * v..(t + 1) * v], &want[t * v..(t + 1) * v]);
            let gb: Vec<u32> = g.iter().map(|x| x.to_bits()).collect();
            let wb: Vec<u32> = w.iter().map(|x| x.to_bits()).collect();
            assert!(
                gb == wb,
                "seed {seed} {cfg:?}: position {t} of {l} differs (max |diff| {:e})",
                max_abs_diff(g, w)
            );
        }
        // A second pass after reset gives the same bits (the state is
        // really cleared).
        assert_eq!(decode(&mut dec, &toks), got, "seed {seed}: after reset");
        positions += l;
    }
    assert!(
        positions > 400,
        "the sweep covered only {positions} positions"
    );
}

#[test]
fn a_shifted_position_or_a_corrupted_state_differs_far_beyond_rounding() {
    // Shapes with a conv state (d_conv 4) and enough positions.
    let cfg = ModelConfig {
        vocab_size: 37,
        d_model: 24,
        n_layer: 2,
        d_state: 8,
        d_conv: 4,
        expand: 2,
        dt_rank: 2,
        arch: Default::default(),
    };
    let params = perturbed(&cfg, 5);
    let toks = tokens(&cfg, 20, 5);
    let want = forward(&cfg, &params, &toks);
    let v = cfg.vocab_size;
    let row = |t: usize| &want[t * v..(t + 1) * v];
    // Rounding-level differences would be ~1e-6; a real one is >= 1e-3.
    const FAR: f32 = 1e-3;

    let mut dec = CpuDecoder::new(cfg.clone(), params).unwrap();
    let got = decode(&mut dec, &toks);
    let shifted = (1..20)
        .map(|t| max_abs_diff(&got[t * v..(t + 1) * v], row(t - 1)))
        .fold(f32::INFINITY, f32::min);
    assert!(shifted > FAR, "position t matched t-1 ({shifted:e})");

    // Decode the first 10, corrupt one part of the state, step the 11th.
    for part in ["ssm", "conv"] {
        dec.reset().unwrap();
        for &t in &toks[..10] {
            dec.step(t).unwrap();
        }
        let mut st = dec.snapshot().unwrap();
        let clean = st.clone();
        let target = if part == "ssm" {
            &mut st.ssm
        } else {
            &mut st.conv
        };
        target.iter_mut().for_each(|x| *x += 0.5);
        dec.restore(&st, 10).unwrap();
        let bad = max_abs_diff(dec.step(toks[10]).unwrap(), row(10));
        assert!(
            bad > FAR,
            "a corrupted {part} state changed nothing ({bad:e})"
        );
        // Control of the control: the clean state restored gives the bits.
        dec.restore(&clean, 10).unwrap();
        assert_eq!(
            dec.step(toks[10]).unwrap(),
            row(10),
            "{part}: clean restore"
        );
    }
}

#[test]
fn bad_tokens_and_states_are_refused_naming_what_was_expected() {
    let cfg = ModelConfig::new(11, 8, 1);
    let mut dec = CpuDecoder::new(cfg.clone(), perturbed(&cfg, 1)).unwrap();
    let e = dec.step(11).unwrap_err().to_string();
    assert!(e.contains("token 11") && e.contains("size 11"), "{e}");
    assert!(dec.step(10).is_ok());
    let mut st = DecodeState::zeros(&cfg);
    st.ssm.pop();
    let e = dec.restore(&st, 0).unwrap_err().to_string();
    assert!(e.contains("SSM") && e.contains("needs"), "{e}");
    let e = CpuDecoder::new(cfg.clone(), vec![0.0; 3])
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("params arena has 3 elements"), "{e}");
}

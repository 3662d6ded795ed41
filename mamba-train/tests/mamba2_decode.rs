//! Recurrent decoding of Mamba-2 on the CPU (`CpuDecoder` for a Mamba-2
//! config: conv window over x, B, C and a `[H, P, N]` SSM state per layer,
//! one token per step) against the full forward pass over the same prefix
//! (`Mamba2Model::logits`), at every position.
//!
//! Tolerance: the step runs the forward's norms, one-row matrix products,
//! conv, softplus and gate in the forward's order, but its scan is the
//! sequential recurrence while the forward's is the chunked SSD, which
//! reassociates the sums (intra-chunk quadratic term plus decayed chunk
//! state). So the logits agree to rounding, not bit for bit. The measure is
//! per position `max_j |dec_j - fwd_j| / max(1, max_j |fwd_j|)`; the bounds
//! are [`TOL_F64`] and [`TOL_F32`], each far above the error observed (the
//! test prints the worst) and far below the negative controls' (an A_log
//! entry moved, observed 1.6e-6 for +1e-3 in f64; a conv window shifted by
//! one row, observed 0.37), which must fail the comparison.

mod cuda_common;

use cuda_common::{decode, perturbed};
use mamba_train::config::{Arch, SsdConfig};
use mamba_train::model::cpu::{cpu_decoder, decode_logits_f64, CpuDecoder, Mamba2Model};
use mamba_train::model::{Batch, DecodeState, Decoder, IGNORE};
use mamba_train::seed::Rng;
use mamba_train::{ModelConfig, ParamLayout};

/// f64 bound (observed 2.6e-16: reassociation error only).
const TOL_F64: f64 = 1e-10;
/// f32 bound (observed 3.0e-7).
const TOL_F32: f64 = 1e-5;

/// `(vocab, d_model, n_layer, d_state, d_conv, head_dim, n_groups,
/// chunk_size, seq_len)`.
type Shape = (
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
);

/// One group and two; chunks that do not divide T (and one longer than
/// T); conv windows of 0 to 3 kept rows.
const SHAPES: [Shape; 5] = [
    (13, 8, 2, 5, 4, 4, 1, 7, 40),
    (11, 10, 2, 3, 3, 5, 2, 4, 37),
    (17, 8, 1, 4, 2, 2, 2, 6, 23),
    (9, 6, 3, 2, 1, 3, 2, 5, 19),
    (7, 4, 1, 6, 4, 8, 1, 64, 30),
];

fn config(s: Shape) -> (ModelConfig, usize) {
    let (vocab, d_model, n_layer, d_state, d_conv, head_dim, n_groups, chunk_size, l) = s;
    let mut c = ModelConfig::mamba2(vocab, d_model, n_layer);
    c.d_state = d_state;
    c.d_conv = d_conv;
    c.arch = Arch::Mamba2(SsdConfig {
        head_dim,
        n_groups,
        chunk_size,
    });
    c.validate().unwrap();
    (c, l)
}

fn tokens(cfg: &ModelConfig, l: usize, seed: u64) -> Vec<u32> {
    let mut r = Rng::new(seed ^ 0xdec0de);
    (0..l)
        .map(|_| r.below(cfg.vocab_size as u64) as u32)
        .collect()
}

fn one_sequence(toks: &[u32]) -> Batch {
    Batch {
        tokens: toks.to_vec(),
        targets: vec![IGNORE; toks.len()],
        batch: 1,
        seq_len: toks.len(),
    }
}

/// The worst per-position error (module docs) of `got` against `want`,
/// both `[l, vocab]`.
fn worst_error(got: &[f64], want: &[f64], v: usize) -> f64 {
    assert_eq!(got.len(), want.len());
    got.chunks(v)
        .zip(want.chunks(v))
        .map(|(g, w)| {
            let scale = w.iter().fold(1.0f64, |m, x| m.max(x.abs()));
            let diff = g
                .iter()
                .zip(w)
                .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
            diff / scale
        })
        .fold(0.0, f64::max)
}

fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// Reference init plus N(0, 0.1) noise, in f64.
fn perturbed_f64(cfg: &ModelConfig, seed: u64) -> Vec<f64> {
    widen(&perturbed(cfg, seed))
}

#[test]
fn the_state_is_the_conv_window_over_x_b_c_and_one_matrix_per_head() {
    let (cfg, _) = config(SHAPES[1]);
    // d_inner 20 = 4 heads of 5, 2 groups of d_state 3: conv_dim 32.
    assert_eq!(DecodeState::conv_dim(&cfg), 20 + 2 * 2 * 3);
    assert_eq!(DecodeState::conv_len(&cfg), 2 * 2 * 32);
    assert_eq!(DecodeState::ssm_len(&cfg), 2 * 4 * 5 * 3);
    // Mamba-1's layout is unchanged.
    let m1 = ModelConfig::new(11, 10, 2);
    assert_eq!(DecodeState::conv_dim(&m1), m1.d_inner());
    assert_eq!(
        DecodeState::len_for(&m1),
        m1.n_layer * m1.d_inner() * (m1.d_conv - 1 + m1.d_state)
    );
}

#[test]
fn f64_recurrent_logits_match_the_chunked_forward_at_every_position() {
    let mut worst = 0.0f64;
    for (i, &s) in SHAPES.iter().enumerate() {
        let (cfg, l) = config(s);
        let p = perturbed_f64(&cfg, 10 + i as u64);
        let toks = tokens(&cfg, l, i as u64);
        let model = Mamba2Model::new(cfg.clone()).unwrap();
        let want = model.logits_f64(&p, &one_sequence(&toks)).unwrap();
        let got = decode_logits_f64(&cfg, &p, &toks).unwrap();
        let err = worst_error(&got, &want, cfg.vocab_size);
        assert!(err <= TOL_F64, "shape {s:?}: error {err:e}");
        worst = worst.max(err);
    }
    eprintln!("f64: worst error {worst:e} (bound {TOL_F64:e})");
}

#[test]
fn f32_recurrent_logits_match_the_chunked_forward_at_every_position() {
    let mut worst = 0.0f64;
    for (i, &s) in SHAPES.iter().enumerate() {
        let (cfg, l) = config(s);
        let p = perturbed(&cfg, 20 + i as u64);
        let toks = tokens(&cfg, l, 7 + i as u64);
        let model = Mamba2Model::new(cfg.clone()).unwrap();
        let want = model.logits(&p, &one_sequence(&toks)).unwrap();
        let mut dec = CpuDecoder::new(cfg.clone(), p).unwrap();
        let got = decode(&mut dec, &toks);
        let err = worst_error(&widen(&got), &widen(&want), cfg.vocab_size);
        assert!(err <= TOL_F32, "shape {s:?}: error {err:e}");
        worst = worst.max(err);
        // After a reset, the same bits (the state is really cleared).
        assert_eq!(decode(&mut dec, &toks), got, "shape {s:?}: after reset");
    }
    eprintln!("f32: worst error {worst:e} (bound {TOL_F32:e})");
}

#[test]
fn a_moved_a_log_entry_fails_the_comparison() {
    let (cfg, l) = config(SHAPES[1]);
    let p = perturbed_f64(&cfg, 3);
    let toks = tokens(&cfg, l, 3);
    let want = Mamba2Model::new(cfg.clone())
        .unwrap()
        .logits_f64(&p, &one_sequence(&toks))
        .unwrap();
    let mut bad = p.clone();
    // Head 2 of layer 1 (of the second group).
    let a_log = ParamLayout::new(&cfg).ssd_layers[1].a_log.clone();
    bad[a_log.start + 2] += 1e-3;
    let got = decode_logits_f64(&cfg, &bad, &toks).unwrap();
    let err = worst_error(&got, &want, cfg.vocab_size);
    eprintln!("A_log + 1e-3: error {err:e}");
    assert!(err > 1e3 * TOL_F64, "the control is not detected: {err:e}");
    // The f32 path too, at its own bound: there the entry moves by 0.5
    // (1e-3 moves the logits by ~2e-6 only, below the f32 bound).
    bad[a_log.start + 2] += 0.5 - 1e-3;
    let p32: Vec<f32> = bad.iter().map(|&x| x as f32).collect();
    let mut dec = CpuDecoder::new(cfg.clone(), p32).unwrap();
    let got = widen(&decode(&mut dec, &toks));
    let err = worst_error(&got, &want, cfg.vocab_size);
    eprintln!("A_log + 0.5, f32: error {err:e}");
    assert!(err > 10.0 * TOL_F32, "f32 control not detected: {err:e}");
}

#[test]
fn a_conv_window_shifted_by_one_row_fails_the_comparison() {
    let (cfg, l) = config(SHAPES[0]);
    let p = perturbed(&cfg, 4);
    let toks = tokens(&cfg, l, 4);
    let want = Mamba2Model::new(cfg.clone())
        .unwrap()
        .logits(&p, &one_sequence(&toks))
        .unwrap();
    let (v, k, cd) = (cfg.vocab_size, 10, DecodeState::conv_dim(&cfg));
    let rows = cfg.d_conv - 1;
    let mut dec = CpuDecoder::new(cfg.clone(), p).unwrap();
    decode(&mut dec, &toks[..k]);
    let mut st = dec.snapshot().unwrap();
    // Each layer's window one row off: oldest first becomes newest first
    // by one position (a rotation), as an off-by-one index would read.
    for layer in st.conv.chunks_mut(rows * cd) {
        layer.rotate_left(cd);
    }
    dec.restore(&st, k as u64).unwrap();
    let mut got = Vec::new();
    for &t in &toks[k..] {
        got.extend_from_slice(dec.step(t).unwrap());
    }
    let err = worst_error(&widen(&got[..v]), &widen(&want[k * v..(k + 1) * v]), v);
    eprintln!("conv window off by one row: error {err:e}");
    assert!(err > 10.0 * TOL_F32, "the control is not detected: {err:e}");
}

#[test]
fn snapshot_and_restore_continue_identically() {
    let (cfg, l) = config(SHAPES[1]);
    let p = perturbed(&cfg, 5);
    let toks = tokens(&cfg, l, 5);
    let k = 15;
    let mut a = CpuDecoder::new(cfg.clone(), p.clone()).unwrap();
    decode(&mut a, &toks[..k]);
    let st = a.snapshot().unwrap();
    let mut rest = Vec::new();
    for &t in &toks[k..] {
        rest.extend_from_slice(a.step(t).unwrap());
    }
    // A fresh decoder (through the trait-object builder) restored there.
    let mut b = cpu_decoder(cfg.clone(), p).unwrap();
    b.restore(&st, k as u64).unwrap();
    assert_eq!(b.position(), k as u64);
    assert_eq!(b.snapshot().unwrap(), st);
    let mut again = Vec::new();
    for &t in &toks[k..] {
        again.extend_from_slice(b.step(t).unwrap());
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&again), bits(&rest));
    // A state of another shape (Mamba-1's of the same widths) is refused.
    let mut m1 = cfg.clone();
    m1.arch = Arch::Mamba1;
    let e = b.restore(&DecodeState::zeros(&m1), 0).unwrap_err();
    assert!(e.to_string().contains("conv_dim"), "{e}");
}

#[test]
fn a_token_outside_the_vocabulary_is_an_error_and_changes_nothing() {
    let (cfg, l) = config(SHAPES[2]);
    let p = perturbed(&cfg, 6);
    let toks = tokens(&cfg, l, 6);
    let mut dec = CpuDecoder::new(cfg.clone(), p.clone()).unwrap();
    let want = decode(&mut dec, &toks);
    dec.reset().unwrap();
    let v = cfg.vocab_size;
    let mut got = Vec::new();
    for (i, &t) in toks.iter().enumerate() {
        if i == 5 {
            let before = dec.snapshot().unwrap();
            for bad in [v as u32, u32::MAX] {
                let e = dec.step(bad).unwrap_err();
                assert!(e.to_string().contains("outside the vocabulary"), "{e}");
            }
            assert_eq!(dec.position(), 5);
            assert_eq!(dec.snapshot().unwrap(), before);
        }
        got.extend_from_slice(dec.step(t).unwrap());
    }
    assert_eq!(got, want);
    // Weights of the wrong length are refused too.
    assert!(CpuDecoder::new(cfg, p[1..].to_vec()).is_err());
}

//! Properties of the CPU model: causality, loss at init, the reference
//! initialisation, thread-count independence of the bits, input validation.

use mamba_train::model::cpu::CpuModel;
use mamba_train::model::init::{inverse_softplus, DT_MAX, DT_MIN, EMBED_STD};
use mamba_train::model::{Batch, IGNORE};
use mamba_train::params::ParamLayout;
use mamba_train::seed::Rng;
use mamba_train::{ModelConfig, TrainError};

fn random_batch(vocab: usize, nseq: usize, l: usize, seed: u64) -> Batch {
    let mut r = Rng::new(seed);
    let tokens: Vec<u32> = (0..nseq * l)
        .map(|_| r.below(vocab as u64) as u32)
        .collect();
    let targets: Vec<i32> = (0..nseq * l)
        .map(|_| r.below(vocab as u64) as i32)
        .collect();
    Batch {
        tokens,
        targets,
        batch: nseq,
        seq_len: l,
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn logits_at_t_do_not_depend_on_later_tokens() {
    let cfg = ModelConfig {
        vocab_size: 13,
        d_model: 16,
        n_layer: 2,
        d_state: 8,
        d_conv: 4,
        expand: 2,
        dt_rank: 1,
        arch: Default::default(),
    };
    let model = CpuModel::new(cfg).unwrap();
    let p = model.init_params(4);
    let (l, v, t0) = (24, 13, 10);
    let a = random_batch(v, 2, l, 1);
    let mut b = a.clone();
    for t in t0 + 1..l {
        b.tokens[t] = (a.tokens[t] + 1 + t as u32 % 5) % v as u32;
    }
    let la = model.logits(&p, &a).unwrap();
    let lb = model.logits(&p, &b).unwrap();
    let row = |x: &[f32], s: usize, t: usize| bits(&x[(s * l + t) * v..(s * l + t + 1) * v]);
    for t in 0..=t0 {
        assert_eq!(
            row(&la, 0, t),
            row(&lb, 0, t),
            "position {t} saw a later token"
        );
    }
    for t in 0..l {
        assert_eq!(row(&la, 1, t), row(&lb, 1, t), "sequence 1 saw sequence 0");
    }
    // Negative control: positions at and after the first change do move.
    for t in t0 + 1..l {
        assert_ne!(
            row(&la, 0, t),
            row(&lb, 0, t),
            "position {t} ignored its own input"
        );
    }
}

#[test]
fn loss_at_init_is_near_ln_vocab() {
    for (vocab, d_model) in [(32usize, 64usize), (256, 32)] {
        let model = CpuModel::new(ModelConfig::new(vocab, d_model, 2)).unwrap();
        let p = model.init_params(7);
        let b = random_batch(vocab, 4, 32, 2);
        let loss = model.loss(&p, &b).unwrap() as f64;
        let want = (vocab as f64).ln();
        assert!(
            (loss - want).abs() < 0.02 * want,
            "loss {loss} vs ln {vocab} = {want}"
        );
    }
}

#[test]
fn reference_initialisation_statistics() {
    let cfg = ModelConfig::new(50, 64, 4);
    let model = CpuModel::new(cfg.clone()).unwrap();
    let p = model.init_params(123);
    let lay = model.layout();
    let (e, n) = (cfg.d_inner(), cfg.d_state);
    assert_eq!(
        bits(&p),
        bits(&model.init_params(123)),
        "a pure function of (config, seed)"
    );
    assert_ne!(bits(&p), bits(&model.init_params(124)), "the seed matters");

    let uniform_within = |name: &str, bound: f64| {
        let w = &p[lay.get(name).unwrap().range()];
        let max = w.iter().fold(0.0f64, |m, &x| m.max((x as f64).abs()));
        assert!(max <= bound, "{name}: |w| up to {max}, bound {bound}");
        assert!(
            max > 0.9 * bound,
            "{name}: |w| only up to {max}, bound {bound}"
        );
        let mean = w.iter().map(|&x| x as f64).sum::<f64>() / w.len() as f64;
        assert!(mean.abs() < 0.1 * bound, "{name}: mean {mean}");
    };
    for i in 0..cfg.n_layer {
        let m = |s: &str| format!("backbone.layers.{i}.mixer.{s}");
        let a_log = &p[lay.layers[i].a_log.clone()];
        for c in 0..e {
            for s in 0..n {
                assert_eq!(
                    a_log[c * n + s],
                    ((s + 1) as f64).ln() as f32,
                    "A_log[{c},{s}]"
                );
            }
        }
        assert!(
            p[lay.layers[i].d.clone()].iter().all(|&x| x == 1.0),
            "D = 1"
        );
        assert!(
            p[lay.layers[i].norm.clone()].iter().all(|&x| x == 1.0),
            "norm = 1"
        );
        // dt = softplus(bias) is log-uniform in [1e-3, 1e-1].
        let dt: Vec<f64> = p[lay.layers[i].dt_proj_b.clone()]
            .iter()
            .map(|&b| (b as f64).exp().ln_1p())
            .collect();
        let (lo, hi) = dt
            .iter()
            .fold((f64::MAX, 0.0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        assert!(
            lo >= DT_MIN * (1.0 - 1e-5) && hi <= DT_MAX * (1.0 + 1e-5),
            "dt range [{lo}, {hi}]"
        );
        assert!(
            lo < 2.0 * DT_MIN && hi > 0.5 * DT_MAX,
            "dt does not span its range: [{lo}, {hi}]"
        );
        let mean_ln = dt.iter().map(|x| x.ln()).sum::<f64>() / dt.len() as f64;
        let mid = 0.5 * (DT_MIN.ln() + DT_MAX.ln());
        assert!(
            (mean_ln - mid).abs() < 0.5,
            "mean ln dt {mean_ln}, log-uniform midpoint {mid}"
        );
        uniform_within(&m("in_proj.weight"), 1.0 / (cfg.d_model as f64).sqrt());
        uniform_within(&m("x_proj.weight"), 1.0 / (e as f64).sqrt());
        uniform_within(&m("dt_proj.weight"), 1.0 / (cfg.dt_rank as f64).sqrt());
        uniform_within(&m("conv1d.weight"), 1.0 / (cfg.d_conv as f64).sqrt());
        uniform_within(&m("conv1d.bias"), 1.0 / (cfg.d_conv as f64).sqrt());
        uniform_within(
            &m("out_proj.weight"),
            1.0 / (e as f64).sqrt() / (cfg.n_layer as f64).sqrt(),
        );
    }
    let emb = &p[lay.embedding.clone()];
    let mean = emb.iter().map(|&x| x as f64).sum::<f64>() / emb.len() as f64;
    let std =
        (emb.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / emb.len() as f64).sqrt();
    assert!(
        (std - EMBED_STD).abs() < 0.05 * EMBED_STD && mean.abs() < 0.1 * EMBED_STD,
        "embedding N({mean}, {std})"
    );
    assert!(
        p[lay.norm_f.clone()].iter().all(|&x| x == 1.0),
        "norm_f = 1"
    );
    assert!((inverse_softplus(0.01).exp().ln_1p() - 0.01).abs() < 1e-15);
}

/// Different shapes lay their tensors out differently but every one is
/// initialised (no tensor left at zero).
#[test]
fn every_tensor_is_initialised() {
    let cfg = ModelConfig {
        vocab_size: 7,
        d_model: 12,
        n_layer: 3,
        d_state: 3,
        d_conv: 2,
        expand: 3,
        dt_rank: 5,
        arch: Default::default(),
    };
    let model = CpuModel::new(cfg.clone()).unwrap();
    let p = model.init_params(0);
    for e in ParamLayout::new(&cfg).entries() {
        assert!(
            p[e.range()].iter().any(|&x| x != 0.0),
            "{} left at zero",
            e.name
        );
    }
}

fn grads_with_threads(model: &CpuModel, p: &[f32], b: &Batch, threads: usize) -> (u32, Vec<u32>) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        let mut g = vec![f32::NAN; p.len()];
        let loss = model.forward_backward(p, b, &mut g).unwrap();
        (loss.to_bits(), bits(&g))
    })
}

#[test]
fn gradient_bits_do_not_depend_on_the_thread_count() {
    // Large enough that every parallel split (token chunks, GEMM row
    // blocks, channel chunks, sequences) has several pieces.
    let cfg = ModelConfig {
        vocab_size: 24,
        d_model: 40,
        n_layer: 2,
        d_state: 8,
        d_conv: 4,
        expand: 2,
        dt_rank: 3,
        arch: Default::default(),
    };
    let model = CpuModel::new(cfg).unwrap();
    let p = model.init_params(31);
    let mut b = random_batch(24, 5, 50, 6);
    b.targets[3] = IGNORE;
    let one = grads_with_threads(&model, &p, &b, 1);
    for threads in [2, 4, 7] {
        assert_eq!(
            one,
            grads_with_threads(&model, &p, &b, threads),
            "{threads} threads changed the bits"
        );
    }
    // Negative control: the same gradient summed in another order (the
    // sequences reversed) differs in its bits while agreeing in value, so
    // equal bits above are a real test of the summation order.
    let mut rev = b.clone();
    let l = b.seq_len;
    for s in 0..b.batch {
        let d = b.batch - 1 - s;
        rev.tokens[d * l..(d + 1) * l].copy_from_slice(&b.tokens[s * l..(s + 1) * l]);
        rev.targets[d * l..(d + 1) * l].copy_from_slice(&b.targets[s * l..(s + 1) * l]);
    }
    let other = grads_with_threads(&model, &p, &rev, 1);
    assert_ne!(
        one.1, other.1,
        "reordering sequences left every gradient bit unchanged"
    );
    let close = one.1.iter().zip(&other.1).all(|(&a, &b)| {
        let (a, b) = (f32::from_bits(a) as f64, f32::from_bits(b) as f64);
        (a - b).abs() <= 1e-6 + 1e-3 * a.abs()
    });
    assert!(
        close,
        "reordered sequences should give the same gradient up to rounding"
    );
}

/// The model caches its buffers; concurrent calls must neither block nor
/// disturb each other's results.
#[test]
fn concurrent_calls_on_one_model_give_the_sequential_results() {
    let model = CpuModel::new(ModelConfig::new(17, 24, 2)).unwrap();
    let p = model.init_params(2);
    let batches: Vec<Batch> = (0..4)
        .map(|i| random_batch(17, 2 + i, 9 + 3 * i, i as u64))
        .collect();
    let want: Vec<_> = batches
        .iter()
        .map(|b| grads_with_threads(&model, &p, b, 2))
        .collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = batches
            .iter()
            .map(|b| {
                let (model, p) = (&model, &p);
                s.spawn(move || {
                    (0..3)
                        .map(|_| grads_with_threads(model, p, b, 2))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for (h, w) in handles.into_iter().zip(&want) {
            for got in h.join().unwrap() {
                assert!(got == *w, "a concurrent call changed the bits");
            }
        }
    });
}

#[test]
fn no_counted_target_gives_zero_loss_and_zero_gradients() {
    let model = CpuModel::new(ModelConfig::new(9, 16, 1)).unwrap();
    let p = model.init_params(1);
    let mut b = random_batch(9, 2, 5, 3);
    b.targets.iter_mut().for_each(|t| *t = IGNORE);
    let mut g = vec![f32::NAN; p.len()];
    assert_eq!(model.forward_backward(&p, &b, &mut g).unwrap(), 0.0);
    assert!(g.iter().all(|&x| x == 0.0));
    assert_eq!(model.loss(&p, &b).unwrap(), 0.0);
    // An empty batch is the same.
    let empty = Batch {
        tokens: vec![],
        targets: vec![],
        batch: 0,
        seq_len: 5,
    };
    g.fill(f32::NAN);
    assert_eq!(model.forward_backward(&p, &empty, &mut g).unwrap(), 0.0);
    assert!(g.iter().all(|&x| x == 0.0));
}

#[test]
fn ignored_targets_do_not_count() {
    let model = CpuModel::new(ModelConfig::new(9, 16, 1)).unwrap();
    let p = model.init_params(1);
    let b = random_batch(9, 1, 6, 3);
    let mut masked = b.clone();
    masked.targets[4] = IGNORE;
    masked.targets[5] = IGNORE;
    let mut head = b.clone();
    head.tokens.truncate(4);
    head.targets.truncate(4);
    head.seq_len = 4;
    // Causality makes the first 4 positions identical, so the masked mean
    // equals the mean over the truncated sequence.
    let lm = model.loss(&p, &masked).unwrap();
    let lh = model.loss(&p, &head).unwrap();
    assert!((lm - lh).abs() < 1e-6, "{lm} vs {lh}");
    assert!(
        (lm - model.loss(&p, &b).unwrap()).abs() > 1e-6,
        "negative control: unmasked loss differs"
    );
}

#[test]
fn bad_inputs_are_errors_naming_the_problem() {
    let model = CpuModel::new(ModelConfig::new(9, 16, 1)).unwrap();
    let p = model.init_params(1);
    let mut g = vec![0.0f32; p.len()];
    let b = random_batch(9, 2, 5, 3);
    let err = |r: Result<f32, TrainError>| r.unwrap_err().to_string();

    let mut bad = b.clone();
    bad.tokens[7] = 9;
    assert!(err(model.loss(&p, &bad)).contains("token 9 at position 7"));
    let mut bad = b.clone();
    bad.targets[2] = -1;
    assert!(err(model.loss(&p, &bad)).contains("target -1 at position 2"));
    let mut bad = b.clone();
    bad.targets[2] = 9;
    assert!(err(model.loss(&p, &bad)).contains("target 9"));
    let mut bad = b.clone();
    bad.tokens.pop();
    assert!(err(model.loss(&p, &bad)).contains("needs 10 tokens"));
    assert!(err(model.loss(&p[1..], &b)).contains("params arena has"));
    assert!(err(model.forward_backward(&p, &b, &mut g[1..])).contains("grads arena has"));
    assert!(CpuModel::new(ModelConfig {
        d_state: 0,
        ..ModelConfig::new(9, 16, 1)
    })
    .is_err());
}

//! Tests of [`super::sample`]: each filter on hand-made logits with the
//! exact expected sets, and properties over random logits.

use proptest::prelude::*;

use super::sample::{argmax, exp_nonpositive, Sampling};

fn ids(s: &Sampling, logits: &[f32]) -> Vec<u32> {
    s.kept(logits).unwrap().iter().map(|c| c.id).collect()
}

fn sampled(temperature: f64, top_k: Option<usize>, top_p: f64) -> Sampling {
    Sampling {
        temperature,
        top_k,
        top_p,
        seed: 11,
    }
}

#[test]
fn greedy_is_the_argmax_with_ties_to_the_lowest_id() {
    let logits = [1.0, 3.0, 2.0, 3.0, 0.0];
    assert_eq!(argmax(&logits), 1);
    let g = Sampling::default();
    assert!(g.is_greedy());
    for i in 0..5 {
        assert_eq!(g.choose(&logits, i).unwrap(), 1);
    }
    assert_eq!(ids(&g, &logits), [1]);
    assert_eq!(argmax(&[-5.0, -1.0, -1.0]), 1);
}

#[test]
fn top_k_keeps_the_k_most_likely_in_order_ties_to_the_lower_id() {
    let logits = [1.0, 3.0, 2.0, 3.0, 0.0];
    assert_eq!(ids(&sampled(1.0, Some(1), 1.0), &logits), [1]);
    assert_eq!(ids(&sampled(1.0, Some(2), 1.0), &logits), [1, 3]);
    assert_eq!(ids(&sampled(1.0, Some(3), 1.0), &logits), [1, 3, 2]);
    assert_eq!(ids(&sampled(1.0, None, 1.0), &logits), [1, 3, 2, 0, 4]);
    // k beyond the vocabulary keeps everything.
    assert_eq!(ids(&sampled(1.0, Some(50), 1.0), &logits).len(), 5);
}

#[test]
fn top_p_keeps_the_shortest_prefix_reaching_p() {
    // Probabilities 1/2, 1/4, 1/8, 1/8 (ids 0..4 in that order).
    let logits = [0.5f64, 0.25, 0.125, 0.125].map(|p| p.ln() as f32);
    let at = |p: f64| ids(&sampled(1.0, None, p), &logits);
    assert_eq!(at(0.3), [0]);
    assert_eq!(at(0.45), [0]);
    assert_eq!(at(0.7), [0, 1]);
    assert_eq!(
        at(0.8),
        [0, 1, 2],
        "tie between 2 and 3 goes to the lower id"
    );
    assert_eq!(at(0.9), [0, 1, 2, 3]);
    assert_eq!(at(1.0), [0, 1, 2, 3]);
    // After top-k the mass is renormalised over the kept tokens:
    // {1/2, 1/4} -> {2/3, 1/3}, so p = 0.6 keeps only id 0, 0.7 both.
    assert_eq!(ids(&sampled(1.0, Some(2), 0.6), &logits), [0]);
    assert_eq!(ids(&sampled(1.0, Some(2), 0.7), &logits), [0, 1]);
    let d = sampled(1.0, None, 1.0).distribution(&logits).unwrap();
    let probs: Vec<f64> = d.iter().map(|c| c.weight).collect();
    for (got, want) in probs.iter().zip([0.5, 0.25, 0.125, 0.125]) {
        assert!((got - want).abs() < 1e-6, "{probs:?}");
    }
}

#[test]
fn temperature_sharpens_and_flattens() {
    let logits = [2.0f32, 1.0, 0.0];
    let p0 = |t: f64| sampled(t, None, 1.0).distribution(&logits).unwrap()[0].weight;
    let (cold, one, hot) = (p0(0.25), p0(1.0), p0(4.0));
    assert!(cold > one && one > hot, "{cold} {one} {hot}");
    let want = 1.0 / (1.0 + (-1.0f64).exp() + (-2.0f64).exp());
    assert!((one - want).abs() < 1e-12);
}

#[test]
fn bad_settings_name_their_flag() {
    let e = |s: Sampling| s.validate().unwrap_err().to_string();
    assert!(e(sampled(-0.5, None, 1.0)).contains("--temperature"));
    assert!(e(sampled(f64::NAN, None, 1.0)).contains("--temperature"));
    assert!(e(sampled(1.0, None, 0.0)).contains("--top-p"));
    assert!(e(sampled(1.0, None, 1.5)).contains("--top-p"));
    assert!(e(sampled(1.0, Some(0), 1.0)).contains("--top-k"));
    assert!(sampled(1.0, Some(1), 1.0).validate().is_ok());
    assert!(Sampling::default().validate().is_ok());
    let nan = Sampling::default()
        .choose(&[0.0, f32::NAN], 0)
        .unwrap_err()
        .to_string();
    assert!(nan.contains("token 1") && nan.contains("NaN"), "{nan}");
}

#[test]
fn draws_depend_on_seed_and_index_only() {
    let logits: Vec<f32> = (0..40).map(|i| ((i * 7) % 13) as f32 * 0.1).collect();
    let s = sampled(1.0, None, 1.0);
    let a: Vec<u32> = (0..64).map(|i| s.choose(&logits, i).unwrap()).collect();
    let b: Vec<u32> = (0..64).map(|i| s.choose(&logits, i).unwrap()).collect();
    assert_eq!(a, b);
    // Draw 5 alone is draw 5 of the sequence (no hidden stream position).
    assert_eq!(s.choose(&logits, 5).unwrap(), a[5]);
    // Negative control: another seed draws another sequence.
    let other = Sampling { seed: 12, ..s };
    let c: Vec<u32> = (0..64).map(|i| other.choose(&logits, i).unwrap()).collect();
    assert_ne!(a, c);
    // A flat distribution over 40 tokens is actually sampled (not stuck).
    let mut distinct = a.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert!(distinct.len() > 5, "{distinct:?}");
}

#[test]
fn exp_matches_std_within_a_few_ulp() {
    let mut worst = 0.0f64;
    for i in 0..=20_000 {
        let x = -(i as f64) * 0.0371;
        let (got, want) = (exp_nonpositive(x), x.exp());
        if want > 1e-300 {
            worst = worst.max(((got - want) / want).abs());
        }
    }
    assert!(worst < 4.0 * f64::EPSILON, "relative error {worst}");
    assert_eq!(exp_nonpositive(0.0), 1.0);
    assert_eq!(exp_nonpositive(-800.0), 0.0);
    assert!(exp_nonpositive(-744.0) > 0.0);
}

fn logits_strategy() -> impl Strategy<Value = Vec<f32>> {
    // Coarse values so ties are common.
    prop::collection::vec((-20i32..20).prop_map(|v| v as f32 * 0.25), 1..60)
}

proptest! {
    #[test]
    fn top_p_keeps_the_smallest_prefix_whose_mass_reaches_p(
        logits in logits_strategy(), p in 0.01f64..=1.0, t in 0.2f64..3.0,
    ) {
        let all = sampled(t, None, 1.0).distribution(&logits).unwrap();
        let kept = sampled(t, None, p).kept(&logits).unwrap();
        let n = kept.len();
        prop_assert!(n >= 1);
        // The kept tokens are the n most likely (same order).
        let want: Vec<u32> = all[..n].iter().map(|c| c.id).collect();
        let got: Vec<u32> = kept.iter().map(|c| c.id).collect();
        prop_assert_eq!(got, want);
        let mass = |m: usize| all[..m].iter().map(|c| c.weight).sum::<f64>();
        prop_assert!(mass(n) >= p - 1e-9, "mass {} < p {}", mass(n), p);
        if n > 1 {
            prop_assert!(mass(n - 1) < p + 1e-9, "prefix of {} already reaches {}", n - 1, p);
        }
    }

    #[test]
    fn top_k_keeps_k(logits in logits_strategy(), k in 1usize..80) {
        let kept = sampled(1.0, Some(k), 1.0).kept(&logits).unwrap();
        prop_assert_eq!(kept.len(), k.min(logits.len()));
        // Every kept logit is >= every dropped one.
        let min_kept = kept.iter().map(|c| logits[c.id as usize]).fold(f32::INFINITY, f32::min);
        for (i, &l) in logits.iter().enumerate() {
            if !kept.iter().any(|c| c.id as usize == i) {
                prop_assert!(l <= min_kept);
            }
        }
    }

    #[test]
    fn temperature_zero_is_greedy_and_a_draw_is_always_kept(
        logits in logits_strategy(), seed in any::<u64>(), index in 0u64..1000,
        k in 1usize..10, p in 0.05f64..=1.0,
    ) {
        let g = Sampling { temperature: 0.0, top_k: Some(k), top_p: p, seed };
        prop_assert_eq!(g.choose(&logits, index).unwrap(), argmax(&logits));
        let s = Sampling { temperature: 0.7, top_k: Some(k), top_p: p, seed };
        let tok = s.choose(&logits, index).unwrap();
        prop_assert!(s.kept(&logits).unwrap().iter().any(|c| c.id == tok));
    }
}

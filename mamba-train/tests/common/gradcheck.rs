//! Central-difference gradient checks of the CPU models, shared by
//! `model_gradcheck.rs` (Mamba-1) and `mamba2_cpu.rs` (Mamba-2): the same
//! perturbed starting point, the same sampling of every tensor, the same
//! step and tolerance, so the two architectures are held to one standard.

use mamba_train::seed::Rng;
use mamba_train::ParamLayout;

/// Reference init `init` (made from `seed`) plus N(0, 0.1) noise from
/// `Rng::new(seed)`, in f64, so that no gradient path sits at a special
/// point (norm weights exactly 1, D exactly 1, ...).
pub fn perturbed(init: &[f32], seed: u64) -> Vec<f64> {
    let mut r = Rng::new(seed);
    init.iter().map(|&p| p as f64 + 0.1 * r.normal()).collect()
}

/// Check the analytic gradient `g` at `p` against central differences of
/// `loss`, for every tensor of `layout`: its first and last element and
/// `extra` more drawn from `Rng::new(9)`. Fails on an element outside the
/// tolerance, or on a tensor whose sampled gradients are all ~0 (the check
/// would be vacuous). `p` is restored. Returns the worst error as a
/// fraction of the tolerance and the number of tensors checked.
///
/// Step 1e-5: truncation ~1e-10 * f''' and rounding ~1e-16 / 1e-5 =
/// 1e-11 on an O(1) loss, hence `|fd - g| <= 2e-9 + 1e-6 |g|`.
pub fn check_sampled(
    layout: &ParamLayout,
    p: &mut [f64],
    g: &[f64],
    extra: usize,
    loss: impl Fn(&[f64]) -> f64,
) -> (f64, usize) {
    let h = 1e-5;
    let (atol, rtol) = (2e-9, 1e-6);
    let mut rng = Rng::new(9);
    let mut worst = 0.0f64;
    let mut tensors = 0;
    for e in layout.entries() {
        let len = e.len();
        let mut picks = vec![e.offset, e.offset + len - 1];
        picks.extend((0..extra).map(|_| e.offset + rng.below(len as u64) as usize));
        let mut nonzero = 0;
        for i in picks {
            let orig = p[i];
            p[i] = orig + h;
            let up = loss(p);
            p[i] = orig - h;
            let dn = loss(p);
            p[i] = orig;
            let fd = (up - dn) / (2.0 * h);
            let err = (fd - g[i]).abs();
            worst = worst.max(err / (atol + rtol * g[i].abs()));
            assert!(
                err <= atol + rtol * g[i].abs(),
                "{} element {}: analytic {:e}, numeric {:e}",
                e.name,
                i - e.offset,
                g[i],
                fd
            );
            if g[i].abs() > 1e-6 {
                nonzero += 1;
            }
        }
        assert!(
            nonzero > 0,
            "{}: every sampled gradient is ~0, the check would be vacuous",
            e.name
        );
        tensors += 1;
    }
    (worst, tensors)
}

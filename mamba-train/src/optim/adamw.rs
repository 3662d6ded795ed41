//! AdamW with decoupled weight decay, as `torch.optim.AdamW`.
//!
//! Per element, with `g = grad * clip_scale` (f32 throughout):
//! ```text
//! m = b1*m + (1-b1)*g;   v = b2*v + (1-b2)*g*g
//! p = p * (1 - lr*wd)                      (ParamKind::Matrix only)
//! p = p - (lr / (1-b1^t)) * (m / (sqrt(v) / sqrt(1-b2^t) + eps))
//! ```
//! The bias corrections are computed once per step in f64 and rounded to f32
//! ([`AdamWStep`]); the per-element arithmetic is an [`ArenaMath`]'s (the
//! host's is in [`super::math`]).

use std::ops::Range;

use serde::{Deserialize, Serialize};

use kernels::mamba::AdamWStep;

use super::math::ArenaMath;
use crate::error::{Result, TrainError};
use crate::params::{ParamKind, ParamLayout};

/// AdamW hyper-parameters (everything but the learning rate, which comes
/// from the [`Schedule`](super::Schedule)).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// Decoupled decay of `ParamKind::Matrix` tensors.
    pub weight_decay: f32,
    /// Global-norm clipping threshold; 0 disables clipping.
    pub clip_norm: f32,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            clip_norm: 1.0,
        }
    }
}

impl AdamWConfig {
    /// Refuse settings that cannot work, naming the field.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(TrainError::setting(
                    name,
                    format!("must be within [0, 1), got {v}"),
                ));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(TrainError::setting(
                "eps",
                format!("must be positive, got {}", self.eps),
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(TrainError::setting(
                "weight_decay",
                format!("must be a non-negative number, got {}", self.weight_decay),
            ));
        }
        if !(self.clip_norm.is_finite() && self.clip_norm >= 0.0) {
            return Err(TrainError::setting(
                "clip_norm",
                format!(
                    "must be a non-negative number (0 disables clipping), got {}",
                    self.clip_norm
                ),
            ));
        }
        Ok(())
    }
}

/// Optimizer state: the two moment arenas (in whatever memory `A` is: host
/// `Vec<f32>` or device memory) over the arena elements [`Self::shard`]
/// (the whole arena, or one ZeRO-1 owner's part), and the number of
/// updates applied so far (`t`, for bias correction).
///
/// The arithmetic is not here but in an [`ArenaMath`] (the CPU's
/// [`HostMath`](super::HostMath), or a device model's kernels), which every backend
/// implements with the same per-element formula and the same per-step
/// constants ([`AdamWStep`], computed once, here), so one state machine
/// serves every device.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW<A = Vec<f32>> {
    cfg: AdamWConfig,
    /// Arena ranges that are decayed (`ParamKind::Matrix`), ascending.
    decayed: Vec<Range<usize>>,
    /// The arena elements the moments cover (`m[i]` is element
    /// `shard.start + i`); `0..len` unless sharded.
    shard: Range<usize>,
    m: A,
    v: A,
    t: u64,
}

impl AdamW<Vec<f32>> {
    /// Fresh host state (zero moments, `t = 0`) for `layout`.
    pub fn new(cfg: AdamWConfig, layout: &ParamLayout) -> Result<Self> {
        let n = layout.len();
        Self::from_state(cfg, layout, vec![0.0; n], vec![0.0; n], 0)
    }

    /// Host state restored from a checkpoint.
    pub fn from_state(
        cfg: AdamWConfig,
        layout: &ParamLayout,
        m: Vec<f32>,
        v: Vec<f32>,
        t: u64,
    ) -> Result<Self> {
        if m.len() != layout.len() || v.len() != layout.len() {
            return Err(TrainError::Config(format!(
                "optimizer moments have {} and {} elements; the model has {}",
                m.len(),
                v.len(),
                layout.len()
            )));
        }
        Self::from_arenas(cfg, layout, m, v, t)
    }
}

impl<A> AdamW<A> {
    /// State over moment arenas `m`, `v` of `layout`'s length (the caller's
    /// memory; length-checked by the arithmetic at every update) after `t`
    /// updates.
    pub fn from_arenas(cfg: AdamWConfig, layout: &ParamLayout, m: A, v: A, t: u64) -> Result<Self> {
        Self::from_shard(cfg, layout, 0..layout.len(), m, v, t)
    }

    /// State of one shard (ZeRO-1): moment arenas `m`, `v` over the arena
    /// elements `shard` (within `layout`), after `t` updates.
    pub fn from_shard(
        cfg: AdamWConfig,
        layout: &ParamLayout,
        shard: Range<usize>,
        m: A,
        v: A,
        t: u64,
    ) -> Result<Self> {
        cfg.validate()?;
        if shard.start > shard.end || shard.end > layout.len() {
            return Err(TrainError::Config(format!(
                "an optimizer shard of elements {shard:?} lies outside the {}-element arena",
                layout.len()
            )));
        }
        Ok(AdamW {
            cfg,
            decayed: decayed_ranges(layout),
            shard,
            m,
            v,
            t,
        })
    }

    /// Hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }
    /// First moments.
    pub fn exp_avg(&self) -> &A {
        &self.m
    }
    /// Second moments.
    pub fn exp_avg_sq(&self) -> &A {
        &self.v
    }
    /// The arena elements the moments cover.
    pub fn shard(&self) -> Range<usize> {
        self.shard.clone()
    }
    /// Updates applied so far.
    pub fn updates(&self) -> u64 {
        self.t
    }
    /// The decayed arena ranges (`ParamKind::Matrix` tensors, merged where
    /// adjacent, ascending).
    pub fn decayed(&self) -> &[Range<usize>] {
        &self.decayed
    }

    /// Apply one update of [`Self::shard`] with learning rate `lr`, using
    /// `grads * clip_scale`, through `math` (`params` and `grads` are whole
    /// arenas). The update counter advances only when the update
    /// was applied (a refused one, e.g. of a wrong length, does not count).
    pub fn update<M: ArenaMath<Arena = A> + ?Sized>(
        &mut self,
        math: &mut M,
        params: &mut A,
        grads: &A,
        clip_scale: f32,
        lr: f32,
    ) -> Result<()> {
        let c = self.cfg;
        let k = AdamWStep::new(
            c.beta1,
            c.beta2,
            c.eps,
            c.weight_decay,
            lr,
            self.t + 1,
            clip_scale,
        );
        math.adamw(
            &k,
            &self.decayed,
            self.shard.clone(),
            params,
            grads,
            &mut self.m,
            &mut self.v,
        )?;
        self.t += 1;
        Ok(())
    }

    /// The same state over other arenas (e.g. the moments moved to or from
    /// a device): `f` converts each moment arena.
    pub fn map_arenas<B>(self, mut f: impl FnMut(A) -> Result<B>) -> Result<AdamW<B>> {
        Ok(AdamW {
            cfg: self.cfg,
            decayed: self.decayed,
            shard: self.shard,
            m: f(self.m)?,
            v: f(self.v)?,
            t: self.t,
        })
    }

    /// [`Self::map_arenas`] by reference.
    pub fn try_map_ref<B>(&self, mut f: impl FnMut(&A) -> Result<B>) -> Result<AdamW<B>> {
        Ok(AdamW {
            cfg: self.cfg,
            decayed: self.decayed.clone(),
            shard: self.shard.clone(),
            m: f(&self.m)?,
            v: f(&self.v)?,
            t: self.t,
        })
    }
}

/// The arena ranges of `ParamKind::Matrix` tensors, merged where adjacent:
/// the one definition of which weights decay, for every device.
pub fn decayed_ranges(layout: &ParamLayout) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for e in layout.entries() {
        if e.kind != ParamKind::Matrix || e.is_empty() {
            continue;
        }
        let r = e.range();
        match out.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.push(r),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::optim::math::UPDATE_CHUNK;
    use crate::optim::HostMath;
    use crate::seed::Rng;

    fn layout() -> ParamLayout {
        ParamLayout::new(&ModelConfig::new(11, 16, 2))
    }

    fn random(n: usize, seed: u64, scale: f64) -> Vec<f32> {
        let mut r = Rng::new(seed);
        (0..n).map(|_| (r.normal() * scale) as f32).collect()
    }

    /// A plain sequential AdamW written from the formula, element by element
    /// with a per-element kind lookup: the oracle for the chunked version.
    struct Reference {
        p: Vec<f32>,
        m: Vec<f32>,
        v: Vec<f32>,
        t: i32,
    }

    impl Reference {
        fn update(
            &mut self,
            cfg: &AdamWConfig,
            layout: &ParamLayout,
            g: &[f32],
            scale: f32,
            lr: f32,
        ) {
            self.t += 1;
            let step_size = (lr as f64 / (1.0 - (cfg.beta1 as f64).powi(self.t))) as f32;
            let bc2_sqrt = (1.0 - (cfg.beta2 as f64).powi(self.t)).sqrt() as f32;
            let (p, m, v) = (&mut self.p, &mut self.m, &mut self.v);
            for e in layout.entries() {
                for i in e.range() {
                    let gi = g[i] * scale;
                    m[i] = cfg.beta1 * m[i] + (1.0 - cfg.beta1) * gi;
                    v[i] = cfg.beta2 * v[i] + (1.0 - cfg.beta2) * gi * gi;
                    if e.kind == ParamKind::Matrix {
                        p[i] *= 1.0 - lr * cfg.weight_decay;
                    }
                    p[i] -= step_size * (m[i] / (v[i].sqrt() / bc2_sqrt + cfg.eps));
                }
            }
        }
    }

    #[test]
    fn chunked_parallel_update_equals_the_sequential_formula_for_any_thread_count() {
        // Large enough to span several update chunks, with tensor boundaries
        // falling inside chunks.
        let l = ParamLayout::new(&ModelConfig::new(300, 64, 2));
        assert!(l.len() > 3 * UPDATE_CHUNK);
        let n = l.len();
        let cfg = AdamWConfig::default();
        let mut results = Vec::new();
        for threads in [1, 4] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut opt = AdamW::new(cfg, &l).unwrap();
            let mut p = random(n, 1, 0.1);
            pool.install(|| {
                for step in 0..3u64 {
                    let g = random(n, 10 + step, 1.0);
                    opt.update(&mut HostMath, &mut p, &g, 0.5, 1e-2).unwrap();
                }
            });
            results.push((p, opt));
        }
        let mut r = Reference {
            p: random(n, 1, 0.1),
            m: vec![0.0; n],
            v: vec![0.0; n],
            t: 0,
        };
        for step in 0..3u64 {
            r.update(&cfg, &l, &random(n, 10 + step, 1.0), 0.5, 1e-2);
        }
        let (p, m, v) = (&r.p, &r.m, &r.v);
        for (pp, opt) in &results {
            assert!(
                pp.iter().zip(p).all(|(a, b)| a.to_bits() == b.to_bits()),
                "params differ"
            );
            assert!(opt
                .exp_avg()
                .iter()
                .zip(m)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            assert!(opt
                .exp_avg_sq()
                .iter()
                .zip(v)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            assert_eq!(opt.updates(), 3);
        }
    }

    #[test]
    fn decay_touches_matrices_only() {
        let l = layout();
        let n = l.len();
        let mut opt = AdamW::new(AdamWConfig::default(), &l).unwrap();
        let p0 = random(n, 2, 1.0);
        let mut p = p0.clone();
        // Zero gradients: the Adam term is 0 / (0 + eps) = 0, so only decay acts.
        opt.update(&mut HostMath, &mut p, &vec![0.0; n], 1.0, 0.5)
            .unwrap();
        let factor = 1.0f32 - 0.5 * 0.1;
        let mut saw = [false, false];
        for e in l.entries() {
            for i in e.range() {
                match e.kind {
                    ParamKind::Matrix => {
                        assert_eq!(p[i], p0[i] * factor, "{} not decayed", e.name);
                        saw[0] = true;
                    }
                    ParamKind::NoDecay => {
                        assert_eq!(p[i], p0[i], "{} decayed", e.name);
                        saw[1] = true;
                    }
                }
            }
        }
        assert_eq!(saw, [true, true]);
        for name in [
            "backbone.layers.1.mixer.A_log",
            "backbone.layers.0.mixer.D",
            "backbone.norm_f.weight",
        ] {
            let r = l.get(name).unwrap().range();
            assert_eq!(&p[r.clone()], &p0[r], "{name} must not decay");
        }
    }

    #[test]
    fn first_step_moves_each_weight_by_lr_against_its_gradient() {
        let l = layout();
        let n = l.len();
        let cfg = AdamWConfig {
            weight_decay: 0.0,
            ..AdamWConfig::default()
        };
        let mut opt = AdamW::new(cfg, &l).unwrap();
        let g = random(n, 3, 1.0);
        let mut p = vec![0.0f32; n];
        opt.update(&mut HostMath, &mut p, &g, 1.0, 1e-3).unwrap();
        for i in 0..n {
            if g[i].abs() > 1e-3 {
                assert!(
                    (p[i] + 1e-3 * g[i].signum()).abs() < 1e-6,
                    "{i}: g {} p {}",
                    g[i],
                    p[i]
                );
            }
        }
    }

    #[test]
    fn wrong_lengths_and_bad_settings_are_errors() {
        let l = layout();
        let mut opt = AdamW::new(AdamWConfig::default(), &l).unwrap();
        let mut p = vec![0.0; l.len()];
        assert!(opt
            .update(&mut HostMath, &mut p, &vec![0.0; 3], 1.0, 1e-3)
            .is_err());
        assert_eq!(opt.updates(), 0, "a refused update must not count");
        let e = AdamW::new(
            AdamWConfig {
                beta2: 1.0,
                ..AdamWConfig::default()
            },
            &l,
        )
        .unwrap_err();
        assert!(e.to_string().contains("beta2"), "{e}");
        assert!(
            AdamW::from_state(AdamWConfig::default(), &l, vec![0.0; 2], vec![0.0; 2], 1).is_err()
        );
    }

    #[test]
    fn decayed_ranges_are_the_matrices_merged() {
        let l = layout();
        let r = decayed_ranges(&l);
        for w in r.windows(2) {
            assert!(w[0].end < w[1].start, "ascending, disjoint, merged: {r:?}");
        }
        for e in l.entries() {
            for i in [e.offset, e.offset + e.len() - 1] {
                let inside = r.iter().any(|x| x.contains(&i));
                assert_eq!(
                    inside,
                    e.kind == ParamKind::Matrix,
                    "{} element {i}",
                    e.name
                );
            }
        }
        // The norm between the embedding and layer 0's in_proj is not
        // decayed, so the ranges are not all one.
        assert!(r.len() > 1);
    }
}

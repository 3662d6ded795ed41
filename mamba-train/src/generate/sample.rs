//! Choosing the next token from the logits: greedy, or sampled with
//! temperature, top-k and top-p (nucleus), from a seed.
//!
//! **Reproducible.** The same logits bits, settings, seed and draw index
//! give the same token on every machine: the arithmetic is f64 in one fixed
//! order, the exponential is [`exp_nonpositive`] (only `+ - * /` and
//! rounding, which IEEE fixes, not the platform's libm), and the random
//! number of draw `i` is the first output of
//! `Rng::new(derive(seed, Domain::Sample, &[i]))` (the seed law), so it does
//! not depend on how many draws came before.
//!
//! **The filters, in order.** Candidates are all token ids sorted by
//! scaled logit `z = logit / temperature` descending, ties to the lower id
//! (the same order everywhere below); top-k keeps the first `k`; the
//! weights are `exp(z - z_max)` and their total is summed in that order;
//! top-p keeps the shortest prefix whose weight reaches `p` times the total
//! (at least one token). A draw `u` uniform in `[0, kept total)` picks the
//! first kept candidate whose running weight exceeds `u`. Temperature 0 is
//! greedy: the argmax, ties to the lowest id, no draw.

use crate::error::{Result, TrainError};
use crate::seed::{derive, Domain, Rng};

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Divides the logits; 0 means greedy (the other settings are unused).
    pub temperature: f64,
    /// Keep only the `k` most likely tokens (`None`: all).
    pub top_k: Option<usize>,
    /// Keep the most likely tokens whose mass reaches `top_p`, in `(0, 1]`
    /// (1: all).
    pub top_p: f64,
    /// Seed of the draws.
    pub seed: u64,
}

impl Default for Sampling {
    /// Greedy.
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: None,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl Sampling {
    /// Refuse settings that mean nothing, naming the command-line flag.
    pub fn validate(&self) -> Result<()> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(TrainError::Config(format!(
                "--temperature must be a finite number >= 0 (0 is greedy), got {t}"
            )));
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return Err(TrainError::Config(format!(
                "--top-p must lie in (0, 1] (1 keeps every token), got {p}"
            )));
        }
        if self.top_k == Some(0) {
            return Err(TrainError::Config(
                "--top-k must be at least 1 (omit it to keep every token), got 0".into(),
            ));
        }
        Ok(())
    }

    /// Whether this is greedy decoding (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The token for draw number `index` (the generated token's index)
    /// from `logits`. Errors on a non-finite logit (a broken model), naming
    /// the token id.
    pub fn choose(&self, logits: &[f32], index: u64) -> Result<u32> {
        check_finite(logits)?;
        if self.is_greedy() {
            return Ok(argmax(logits));
        }
        let kept = self.kept(logits)?;
        let total = kept.iter().fold(0.0f64, |a, c| a + c.weight);
        let mut rng = Rng::new(derive(self.seed, Domain::Sample, &[index]));
        let u = rng.next_f64() * total;
        let mut run = 0.0f64;
        for c in &kept {
            run += c.weight;
            if u < run {
                return Ok(c.id);
            }
        }
        // u < total = the last running weight, so only rounding gets here.
        Ok(kept.last().map_or(0, |c| c.id))
    }

    /// The candidates that survive the filters, most likely first, with
    /// their unnormalised weights (module docs). For greedy settings, the
    /// argmax alone.
    pub fn kept(&self, logits: &[f32]) -> Result<Vec<Candidate>> {
        check_finite(logits)?;
        if logits.is_empty() {
            return Err(TrainError::Data("no logits to sample from".into()));
        }
        if self.is_greedy() {
            return Ok(vec![Candidate {
                id: argmax(logits),
                weight: 1.0,
            }]);
        }
        let mut c = sorted(logits, self.temperature);
        if let Some(k) = self.top_k {
            c.truncate(k.max(1));
        }
        let zmax = c[0].weight;
        for x in c.iter_mut() {
            x.weight = exp_nonpositive(x.weight - zmax);
        }
        let keep = nucleus_len(&c, self.top_p);
        c.truncate(keep);
        Ok(c)
    }

    /// [`Self::kept`] with the weights normalised to probabilities (their
    /// f64 sum in the kept order is 1 up to rounding).
    pub fn distribution(&self, logits: &[f32]) -> Result<Vec<Candidate>> {
        let mut c = self.kept(logits)?;
        let total = c.iter().fold(0.0f64, |a, x| a + x.weight);
        c.iter_mut().for_each(|x| x.weight /= total);
        Ok(c)
    }
}

/// A token id and its weight.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// Token id.
    pub id: u32,
    /// Weight (unnormalised unless said otherwise).
    pub weight: f64,
}

/// The first index of the largest logit (ties to the lowest id).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn check_finite(logits: &[f32]) -> Result<()> {
    match logits.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(TrainError::Data(format!(
            "the model's logit of token {i} is {}; a finite value is needed to choose a token \
             (the weights are broken)",
            logits[i]
        ))),
        None => Ok(()),
    }
}

/// Every id with `weight = logit / temperature`, sorted by that descending,
/// ties to the lower id.
fn sorted(logits: &[f32], temperature: f64) -> Vec<Candidate> {
    let mut c: Vec<Candidate> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| Candidate {
            id: i as u32,
            weight: l as f64 / temperature,
        })
        .collect();
    // Finite values (checked), so the comparison is a total order.
    c.sort_by(|a, b| b.weight.total_cmp(&a.weight).then(a.id.cmp(&b.id)));
    c
}

/// Length of the shortest prefix of `c` (weights, most likely first) whose
/// running sum reaches `p` times the total, at least 1.
fn nucleus_len(c: &[Candidate], p: f64) -> usize {
    if p >= 1.0 {
        return c.len();
    }
    let total = c.iter().fold(0.0f64, |a, x| a + x.weight);
    let target = p * total;
    let mut run = 0.0f64;
    for (i, x) in c.iter().enumerate() {
        run += x.weight;
        if run >= target {
            return i + 1;
        }
    }
    c.len()
}

/// `exp(x)` for `x <= 0` from IEEE operations only, so every machine gets
/// the same bits (std's `exp` is the platform libm's). `x = k ln2 + r` with
/// `|r| <= ln2 / 2` (ln2 split in two so `k ln2` is exact), a degree-13
/// Taylor polynomial in `r` by Horner (truncation below 1e-17 relative),
/// times `2^k` built from its bits. Relative error within a few ulp
/// (tested against std); 0 below `-745`; NaN for NaN.
pub fn exp_nonpositive(x: f64) -> f64 {
    // fdlibm's split of ln 2: the high part has 32 trailing zero bits.
    const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
    const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
    // 1 / i! for i = 0..=13.
    const INV_FACT: [f64; 14] = [
        1.0,
        1.0,
        1.0 / 2.0,
        1.0 / 6.0,
        1.0 / 24.0,
        1.0 / 120.0,
        1.0 / 720.0,
        1.0 / 5_040.0,
        1.0 / 40_320.0,
        1.0 / 362_880.0,
        1.0 / 3_628_800.0,
        1.0 / 39_916_800.0,
        1.0 / 479_001_600.0,
        1.0 / 6_227_020_800.0,
    ];
    if x.is_nan() {
        return x;
    }
    if x < -745.0 {
        return 0.0;
    }
    let x = x.min(0.0);
    let k = (x * std::f64::consts::LOG2_E).round();
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let mut poly = INV_FACT[13];
    for &c in INV_FACT[..13].iter().rev() {
        poly = poly * r + c;
    }
    // 2^k for k in -1075..=0, in at most two exact factors.
    let k = k as i64;
    let pow2 = |e: i64| f64::from_bits(((e + 1023) as u64) << 52);
    if k >= -1022 {
        poly * pow2(k)
    } else {
        poly * pow2(-1022) * pow2(k + 1022)
    }
}

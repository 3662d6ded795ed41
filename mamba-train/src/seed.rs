//! The rank-free seed law.
//!
//! Every random number in a run derives from one master seed through
//! [`derive()`], a splitmix64-style mixer keyed by a *domain* (what the
//! randomness is for) and an index path (step, logical micro-batch, sample,
//! layer...). Nothing here takes a physical rank or world size, so the sample
//! stream and the initial weights are the same on 1 or 8 processes.

/// Domains keep streams for different purposes independent even when their
/// index paths coincide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub enum Domain {
    /// Initial weights.
    Init = 0x1a17_0000_0000_0001,
    /// Training samples.
    Data = 0x1a17_0000_0000_0002,
    /// Held-out evaluation samples.
    Eval = 0x1a17_0000_0000_0003,
    /// Token draws of sampled generation (`generate::sample`).
    Sample = 0x1a17_0000_0000_0004,
}

/// One splitmix64 output step (Steele, Lea, Flood 2014).
#[inline]
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Seed for `(master, domain, path)`: each path component is absorbed by one
/// splitmix round, so `derive(s, d, &[a, b]) != derive(s, d, &[b, a])`.
pub fn derive(master: u64, domain: Domain, path: &[u64]) -> u64 {
    let mut h = splitmix64(master ^ domain as u64);
    for &p in path {
        h = splitmix64(h ^ splitmix64(p.wrapping_add(0x632b_e59b_d9b4_e019)));
    }
    h
}

/// A small deterministic generator (splitmix64 stream) for sampling.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A stream starting from `seed` (usually a [`derive()`] output).
    pub fn new(seed: u64) -> Self {
        Rng { state: seed }
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    /// Uniform integer in `0..n` (`n > 0`), by rejection so it is unbiased.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "Rng::below(0)");
        let zone = u64::MAX - (u64::MAX % n);
        loop {
            let v = self.next_u64();
            if v < zone {
                return v % n;
            }
        }
    }
    /// Standard normal by Box-Muller (f64, deterministic across platforms
    /// given IEEE `ln`/`cos`, which Rust's std takes from the system libm).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64();
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn domains_and_paths_separate_streams() {
        let a = derive(7, Domain::Data, &[1, 2]);
        assert_ne!(a, derive(7, Domain::Data, &[2, 1]));
        assert_ne!(a, derive(7, Domain::Init, &[1, 2]));
        assert_ne!(a, derive(8, Domain::Data, &[1, 2]));
        assert_eq!(a, derive(7, Domain::Data, &[1, 2]));
    }

    #[test]
    fn below_stays_in_range() {
        let mut r = Rng::new(3);
        for n in 1..50 {
            assert!(r.below(n) < n);
        }
    }
}

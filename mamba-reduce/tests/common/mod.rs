//! Shared helpers of the integration tests: value sets on which the order
//! of addition changes the bits, and bitwise comparison.
#![allow(dead_code)]

/// A small deterministic generator (splitmix64).
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// A finite f32 with a random sign, a random 23-bit mantissa and an
    /// exponent spread over 2^-24 .. 2^24, plus a sprinkling of zeros of
    /// both signs, subnormals and large cancelling values: sums of these
    /// depend on the association almost everywhere.
    pub fn wide(&mut self) -> f32 {
        let r = self.next_u64();
        let sign = if r & 1 == 0 { 1.0f32 } else { -1.0 };
        match (r >> 1) % 64 {
            0 => 0.0 * sign,
            1 => sign * f32::from_bits(((r >> 8) as u32) & 0x007f_ffff | 1), // subnormal
            2 => sign * 16_777_216.0, // 2^24: absorbs small addends
            _ => {
                let exp = ((r >> 8) % 49) as i32 - 24;
                let mant = 1.0 + ((r >> 16) & 0x7f_ffff) as f32 / 8_388_608.0;
                sign * mant * 2f32.powi(exp)
            }
        }
    }
}

/// `logical` arenas of `len` wide values from `seed`.
pub fn arenas(seed: u64, logical: usize, len: usize) -> Vec<Vec<f32>> {
    let mut rng = Rng(seed);
    (0..logical)
        .map(|_| (0..len).map(|_| rng.wide()).collect())
        .collect()
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Panic with the first differing element when `a` and `b` differ in any bit.
pub fn assert_bits_eq(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        panic!(
            "{what}: element {i} differs: {:e} ({:#010x}) vs {:e} ({:#010x})",
            a[i],
            a[i].to_bits(),
            b[i],
            b[i].to_bits()
        );
    }
}

/// Number of elements whose bits differ.
pub fn differing(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

/// Run `f(rank, reducer)` on a live host world of `world` threads (one
/// [`HostReducer`](mamba_reduce::HostReducer) each, over channels);
/// results in rank order.
pub fn run_world<R: Send>(
    world: usize,
    opts: mamba_reduce::ReducerOptions,
    f: impl Fn(usize, &mut mamba_reduce::HostReducer) -> R + Sync,
) -> Vec<R> {
    use mamba_comm::host::{HostOptions, HostTransport};
    let transports = HostTransport::thread_world(
        world,
        HostOptions::with_timeout(std::time::Duration::from_secs(30)),
    )
    .unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = transports
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let f = &f;
                s.spawn(move || {
                    let mut r = mamba_reduce::HostReducer::new(t, opts);
                    f(rank, &mut r)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Divisors of `n`, ascending.
pub fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n % d == 0).collect()
}

/// The skip-or-fail rule for tests that need a GPU: returns `false` (after
/// printing why) when `MAMBA_REQUIRE_GPU` is not `1`; panics when it is.
pub fn gpu_missing(reason: &str) -> bool {
    if std::env::var("MAMBA_REQUIRE_GPU").as_deref() == Ok("1") {
        panic!("MAMBA_REQUIRE_GPU=1 but {reason}");
    }
    eprintln!("skipping: {reason}");
    true
}

/// A stream on CUDA device 0 with kernels loadable, or `None` (skipped,
/// after saying why) when this machine or build cannot run them.
pub fn gpu_stream() -> Option<std::sync::Arc<cudarc::driver::CudaStream>> {
    if !kernels::driver_present() {
        gpu_missing("no CUDA driver (libcuda.so.1) on this machine");
        return None;
    }
    match kernels::device_count() {
        Ok(n) if n > 0 => {}
        Ok(_) => {
            gpu_missing("no CUDA device visible");
            return None;
        }
        Err(e) => {
            gpu_missing(&format!("cannot count CUDA devices: {e}"));
            return None;
        }
    }
    if !kernels::available() {
        gpu_missing("this build has no kernels (nvcc was not found when it was built)");
        return None;
    }
    let ctx = kernels::open_context(0).expect("open device 0");
    Some(ctx.new_stream().expect("a stream on device 0"))
}

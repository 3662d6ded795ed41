//! GPU tests of the fold kernels: every launch is compared bit for bit with
//! a serial host chain written here.
//!
//! Without a CUDA driver, a device or an nvcc-built kernel table these tests
//! print why and pass, unless `MAMBA_REQUIRE_GPU=1` (then they fail).

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use kernels::{FoldKernel, KernelError, LaunchShape};

// ---------------------------------------------------------------- harness

fn gpu_required() -> bool {
    std::env::var("MAMBA_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// Skip (or, when a GPU is required, fail) with `why`.
fn unavailable(why: &str) -> Option<Gpu> {
    assert!(!gpu_required(), "MAMBA_REQUIRE_GPU=1 but {why}");
    eprintln!("skipping: {why}");
    None
}

#[derive(Clone)]
struct Gpu {
    ctx: Arc<CudaContext>,
    fold: FoldKernel,
}

/// The shared device-0 context with the fold module, once per process.
fn gpu() -> Option<Gpu> {
    static GPU: OnceLock<Result<Gpu, String>> = OnceLock::new();
    let got = GPU.get_or_init(|| {
        if !kernels::driver_present() {
            return Err("no CUDA driver library (libcuda.so.1) on this machine".into());
        }
        match kernels::device_count() {
            Ok(0) => return Err("the CUDA driver reports no device".into()),
            Ok(_) => {}
            Err(e) => return Err(format!("cannot count CUDA devices: {e}")),
        }
        let ctx = kernels::open_context(0).map_err(|e| format!("cannot open device 0: {e}"))?;
        if !kernels::available() {
            // The GPU is here but the kernels are not: the error must say so.
            let err = FoldKernel::load(&ctx).expect_err("a build without nvcc loaded kernels");
            assert!(matches!(err, KernelError::NotBuilt { .. }), "{err:?}");
            assert!(err.to_string().contains("scripts/install-nvcc.sh"), "{err}");
            return Err(format!("this test binary was built without nvcc ({err})"));
        }
        let fold = FoldKernel::load(&ctx).map_err(|e| format!("FoldKernel::load failed: {e}"));
        // A GPU with kernels built must load them: that is a failure, not a skip.
        let fold = fold.unwrap_or_else(|e| panic!("{e}"));
        Ok(Gpu { ctx, fold })
    });
    match got {
        Ok(gpu) => Some(gpu.clone()),
        Err(why) => unavailable(why),
    }
}

// ------------------------------------------------------- host reference

/// out[i] = ((s0[i] + s1[i]) + ...) in f32, the contract written out.
fn host_sum(slots: &[f32], n_slots: usize, stride: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let mut acc = slots[i];
            for k in 1..n_slots {
                acc += slots[k * stride + i];
            }
            acc
        })
        .collect()
}

/// The same addends in descending slot order: a negative control showing the
/// data can tell orders apart.
fn host_sum_reversed(slots: &[f32], n_slots: usize, stride: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let mut acc = slots[(n_slots - 1) * stride + i];
            for k in (0..n_slots - 1).rev() {
                acc += slots[k * stride + i];
            }
            acc
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn assert_bits_eq(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got
        .iter()
        .zip(want)
        .position(|(g, w)| g.to_bits() != w.to_bits())
    {
        panic!(
            "{what}: element {i} differs: gpu {} ({:#010x}) vs host {} ({:#010x})",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

/// xorshift64*: reproducible data without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Values that make the order of addition visible: wide exponents
    /// (cancellation, absorption), exact zeros of both signs, subnormals and
    /// integers around 2^24. Never NaN or infinite.
    fn value(&mut self) -> f32 {
        let r = self.next();
        let mantissa = (r >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
        match r % 16 {
            0 => 0.0,
            1 => -0.0,
            2 => {
                f32::from_bits((r >> 40) as u32 & 0x007F_FFFF) * if r & 1 == 0 { 1.0 } else { -1.0 }
            }
            3 => ((r >> 20) % 64) as f32 + 16_777_216.0,
            4 => -16_777_216.0,
            5..=7 => (mantissa * 2f64.powi(((r >> 5) % 48) as i32 - 24)) as f32,
            // Similar magnitudes: most sums round, differently per order.
            _ => (mantissa * 2f64.powi(((r >> 5) % 4) as i32)) as f32,
        }
    }

    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.value()).collect()
    }
}

fn upload(stream: &Arc<CudaStream>, v: &[f32]) -> CudaSlice<f32> {
    stream.clone_htod(v).expect("upload")
}

fn download(stream: &Arc<CudaStream>, s: &CudaSlice<f32>) -> Vec<f32> {
    stream.clone_dtoh(s).expect("download")
}

#[test]
fn the_data_distinguishes_orders() {
    // Negative control for every comparison below: with this data a kernel
    // that summed in another order would give other bits. (Host only; two
    // addends commute exactly, so from three on.)
    let mut rng = Rng(7);
    for &n in &[3usize, 5, 17] {
        let len = 4099;
        let slots = rng.values(n * len);
        let forward = bits(&host_sum(&slots, n, len, len));
        let backward = bits(&host_sum_reversed(&slots, n, len, len));
        let differing = forward
            .iter()
            .zip(&backward)
            .filter(|(f, b)| f != b)
            .count();
        assert!(
            differing > len / 10,
            "{n} slots: only {differing} of {len} sums depend on the order"
        );
    }
}

/// The host chain of `det_chain`: `srcs` with `dst0` (dst's values before
/// the call) inserted at `dst_at`, folded left to right, then scaled.
fn host_chain(
    dst0: &[f32],
    dst_at: Option<usize>,
    srcs: &[Vec<f32>],
    len: usize,
    factor: Option<f32>,
) -> Vec<f32> {
    let mut order: Vec<&[f32]> = srcs.iter().map(|v| &v[..len]).collect();
    if let Some(k) = dst_at {
        order.insert(k, &dst0[..len]);
    }
    (0..len)
        .map(|i| {
            let mut acc = order[0][i];
            for a in &order[1..] {
                acc += a[i];
            }
            factor.map_or(acc, |f| acc * f)
        })
        .collect()
}

/// One det_chain case: `n_srcs` separate buffers (each starting `offset`
/// elements in), dst at `dst_at`, dst starting `dst_offset` elements into
/// its buffer with sentinels after len that must survive.
#[allow(clippy::too_many_arguments)]
fn check_chain(
    gpu: &Gpu,
    fold: &FoldKernel,
    rng: &mut Rng,
    n_srcs: usize,
    dst_at: Option<usize>,
    len: usize,
    offset: usize,
    dst_offset: usize,
    factor: Option<f32>,
) {
    let stream = gpu.ctx.default_stream();
    let srcs_h: Vec<Vec<f32>> = (0..n_srcs).map(|_| rng.values(offset + len + 1)).collect();
    let dst_h = rng.values(dst_offset + len + 3);
    let srcs_d: Vec<CudaSlice<f32>> = srcs_h.iter().map(|v| upload(&stream, v)).collect();
    let mut dst_d = upload(&stream, &dst_h);
    {
        let views: Vec<_> = srcs_d.iter().map(|b| b.slice(offset..)).collect();
        let mut dst = dst_d.slice_mut(dst_offset..);
        fold.det_chain(&stream, &mut dst, dst_at, &views, len, factor)
            .unwrap_or_else(|e| panic!("{n_srcs} sources, dst at {dst_at:?}, len {len}: {e}"));
    }
    let got = download(&stream, &dst_d);
    let shifted: Vec<Vec<f32>> = srcs_h.iter().map(|v| v[offset..].to_vec()).collect();
    let mut want = dst_h.clone();
    let chain = host_chain(&dst_h[dst_offset..], dst_at, &shifted, len, factor);
    want[dst_offset..dst_offset + len].copy_from_slice(&chain);
    let what = format!(
        "det_chain {n_srcs} sources dst_at={dst_at:?} len={len} offsets={offset}/{dst_offset} \
         factor={factor:?} shape={:?}",
        fold.shape()
    );
    assert_bits_eq(&got, &want, &what);
}

#[test]
fn chain_loops_beyond_one_grid() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(0x6E1D);
    // 3 blocks of 64 threads for ~100k elements: every thread loops.
    let tiny = gpu
        .fold
        .clone()
        .with_shape(LaunchShape::new(64, 3).expect("shape"));
    for &(n, len) in &[(3usize, 100_003usize), (4, 100_000), (17, 9_973)] {
        check_chain(&gpu, &tiny, &mut rng, n, None, len, 0, 0, None);
        check_chain(&gpu, &tiny, &mut rng, n, Some(1), len, 1, 1, None);
    }
    // The default shape past its own grid (16 blocks/SM x 256 threads x 4).
    let cap = u64::from(gpu.fold.shape().max_blocks()) * 256 * 4;
    let len = usize::try_from(cap).expect("fits") + 1_000_003;
    check_chain(&gpu, &gpu.fold, &mut rng, 2, None, len, 0, 0, None);
    check_chain(&gpu, &gpu.fold, &mut rng, 1, Some(0), len, 1, 0, Some(0.5));
}

#[test]
fn chain_refuses_a_stream_of_another_context() {
    // A non-primary context on the same device has another CUcontext.
    let Some(gpu) = gpu() else { return };
    let stream = gpu.ctx.default_stream();
    let a = upload(&stream, &[1.0; 10]);
    let mut dst = upload(&stream, &[5.0; 10]);
    let other = CudaContext::new_non_primary(0, 0).expect("second context");
    let foreign = other.default_stream();
    let err = gpu
        .fold
        .det_chain(
            &foreign,
            &mut dst.as_view_mut(),
            None,
            &[a.as_view()],
            10,
            None,
        )
        .unwrap_err();
    assert!(
        matches!(err, KernelError::InvalidArgument { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("context"), "{err}");
    assert_eq!(
        download(&stream, &dst),
        vec![5.0; 10],
        "a refused call wrote"
    );
}

#[test]
fn chain_matches_host_chain_across_shapes() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(0xC4A1);
    // Up to 41 sources: chains longer than one launch (32 addends) too.
    for &n in &[1usize, 2, 3, 4, 7, 8, 9, 16, 31, 32, 33, 41] {
        for &len in &[0usize, 1, 3, 4, 5, 8, 97, 1021, 4099, 65_537] {
            let mut positions = vec![None, Some(0), Some(1), Some(n / 2)];
            if n < kernels::MAX_CHAIN_ADDENDS {
                positions.push(Some(n)); // dst last
            }
            positions.dedup();
            for dst_at in positions {
                // Aligned (float4 path), a misaligned source, a misaligned dst.
                for (offset, dst_offset) in [(0, 0), (1, 0), (4, 2)] {
                    for factor in [None, Some(1.0 / 3.0)] {
                        check_chain(
                            &gpu, &gpu.fold, &mut rng, n, dst_at, len, offset, dst_offset, factor,
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn chain_bits_do_not_depend_on_the_shape_or_the_pair_path() {
    // Chains of at most four addends take two float4 groups per thread and
    // iteration (v and v + grid), with one group left over on odd counts;
    // longer ones take one. Grids far smaller than the data make every
    // thread loop an even or an odd number of times; the 1024-thread shapes
    // are the reducer's fold beside NCCL (one block per SM on part of the
    // GPU), which must launch (the kernel's launch bounds) and agree.
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(0x9A125);
    let sms = gpu.fold.multiprocessors();
    let shapes = [
        LaunchShape::new(64, 3).expect("shape"),
        LaunchShape::new(32, 1).expect("shape"),
        LaunchShape::new(1024, 1).expect("shape"),
        LaunchShape::new(1024, 3).expect("shape"),
        LaunchShape::for_sm_fraction(1024, sms, 0.5).expect("shape"),
        LaunchShape::for_sm_fraction(1024, sms, 1.0).expect("shape"),
    ];
    // 192 threads of the first shape: float4 counts of 0..6 grids and a bit.
    let lens = [
        3usize,
        4,
        767,
        768,
        772,
        1537,
        4 * 192 * 3 + 7,
        4 * 192 * 4,
        100_003,
    ];
    for shape in shapes {
        let fold = gpu.fold.clone().with_shape(shape);
        for n in 1usize..=5 {
            for &len in &lens {
                for dst_at in [None, Some(0), Some(n)] {
                    for (offset, dst_offset) in [(0, 0), (1, 0)] {
                        for factor in [None, Some(1.0 / 3.0)] {
                            check_chain(
                                &gpu, &fold, &mut rng, n, dst_at, len, offset, dst_offset, factor,
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn fused_scale_equals_a_separate_scale_pass() {
    // The reducer's claim: scaling inside det_chain gives the bits of the
    // unscaled chain followed by det_scale, on data where the scale rounds
    // (factor 1/3) and on subnormal-producing data (factor 2^-3).
    let Some(gpu) = gpu() else { return };
    let stream = gpu.ctx.default_stream();
    let mut rng = Rng(0x5CA1E);
    let len = 100_003;
    let srcs: Vec<CudaSlice<f32>> = (0..5).map(|_| upload(&stream, &rng.values(len))).collect();
    for factor in [1.0f32 / 3.0, 0.125, 1.0 / 7.0] {
        let views: Vec<_> = srcs.iter().map(|b| b.as_view()).collect();
        let mut fused = stream.alloc_zeros::<f32>(len).expect("alloc");
        gpu.fold
            .det_chain(
                &stream,
                &mut fused.as_view_mut(),
                None,
                &views,
                len,
                Some(factor),
            )
            .expect("fused");
        let mut separate = stream.alloc_zeros::<f32>(len).expect("alloc");
        gpu.fold
            .det_chain(
                &stream,
                &mut separate.as_view_mut(),
                None,
                &views,
                len,
                None,
            )
            .expect("chain");
        let unscaled = download(&stream, &separate);
        gpu.fold
            .det_scale(&stream, &mut separate.as_view_mut(), len, factor)
            .expect("scale");
        let (f, s) = (download(&stream, &fused), download(&stream, &separate));
        assert_bits_eq(&f, &s, &format!("fused vs separate scale by {factor}"));
        // Negative control: the scale did change the bits.
        assert!(
            bits(&f) != bits(&unscaled),
            "factor {factor} changed nothing"
        );
        let host: Vec<f32> = unscaled.iter().map(|&x| x * factor).collect();
        assert_bits_eq(&s, &host, &format!("det_scale by {factor} vs host"));
    }
    // det_scale on a misaligned view and odd length: scalar path.
    let mut buf = upload(&stream, &rng.values(1031));
    let before = download(&stream, &buf);
    gpu.fold
        .det_scale(&stream, &mut buf.slice_mut(1..), 1029, 1.0 / 3.0)
        .expect("scale misaligned");
    let got = download(&stream, &buf);
    let mut want = before.clone();
    for x in &mut want[1..1030] {
        *x *= 1.0 / 3.0;
    }
    assert_bits_eq(&got, &want, "det_scale misaligned");
}

#[test]
fn chain_refuses_bad_arguments_without_launching() {
    let Some(gpu) = gpu() else { return };
    let stream = gpu.ctx.default_stream();
    let a = upload(&stream, &[1.0; 16]);
    let short = upload(&stream, &[1.0; 8]);
    let mut dst = upload(&stream, &[5.0; 16]);
    let fold = &gpu.fold;
    let invalid = |r: Result<(), KernelError>, what: &str| match r {
        Err(KernelError::InvalidArgument { message, .. }) => message,
        other => panic!("{what}: expected InvalidArgument, got {other:?}"),
    };
    let m = invalid(
        fold.det_chain(&stream, &mut dst.as_view_mut(), None, &[], 16, None),
        "no addends",
    );
    assert!(m.contains("no addends"), "{m}");
    let m = invalid(
        fold.det_chain(
            &stream,
            &mut dst.as_view_mut(),
            Some(2),
            &[a.as_view()],
            16,
            None,
        ),
        "dst_at",
    );
    assert!(m.contains("dst_at"), "{m}");
    let m = invalid(
        fold.det_chain(
            &stream,
            &mut dst.as_view_mut(),
            None,
            &[a.as_view(), short.as_view()],
            16,
            None,
        ),
        "short source",
    );
    assert!(m.contains("source 1 holds 8"), "{m}");
    let views: Vec<_> = (0..40).map(|_| a.as_view()).collect();
    let m = invalid(
        fold.det_chain(&stream, &mut dst.as_view_mut(), Some(35), &views, 16, None),
        "dst past the first launch",
    );
    assert!(m.contains("first 32"), "{m}");
    let mut short_mut = upload(&stream, &[1.0; 8]);
    let m = invalid(
        fold.det_scale(&stream, &mut short_mut.as_view_mut(), 9, 0.5),
        "short scale",
    );
    assert!(m.contains("holds 8"), "{m}");
    assert_eq!(
        download(&stream, &dst),
        vec![5.0; 16],
        "a refused call wrote"
    );
}

#[test]
fn indexes_past_2_pow_31() {
    // slot 1 starts past 2^31 elements and the tail elements have i > 2^31:
    // 32-bit indexing anywhere would read or write the wrong addresses.
    let Some(gpu) = gpu() else { return };
    let stream = gpu.ctx.new_stream().expect("stream");
    let edge = 4096;
    // A multiple of 4 (float4 path) whose tail (the last `edge` elements)
    // starts past 2^31 + 8, so the zeros checked around 2^31 are not part
    // of it. (An earlier len of 2^31 + 2052 put the tail's random values at
    // 2^31 - 2044.., over the checked "middle": the kernel was right there,
    // the expectation was not.)
    let len: usize = (1 << 31) + 2 * edge + 4;
    assert!(len - edge > (1 << 31) + 8 && len % 4 == 0);
    let needed_bytes = 3 * len * 4 + (1 << 30);
    let (free, _) = gpu.ctx.mem_get_info().expect("mem info");
    if free < needed_bytes {
        eprintln!("skipping: needs {needed_bytes} free bytes of GPU memory, {free} free");
        return;
    }
    let mut rng = Rng(31);
    let mut d_slots = stream.alloc_zeros::<f32>(2 * len).expect("alloc slots");
    let mut d_out = stream.alloc_zeros::<f32>(len).expect("alloc out");
    // Random data at both ends of both slots; zeros in between.
    let host: Vec<Vec<f32>> = (0..2).map(|_| rng.values(2 * edge)).collect();
    for (k, h) in host.iter().enumerate() {
        let base = k * len;
        stream
            .memcpy_htod(&h[..edge], &mut d_slots.slice_mut(base..base + edge))
            .expect("head");
        stream
            .memcpy_htod(
                &h[edge..],
                &mut d_slots.slice_mut(base + len - edge..base + len),
            )
            .expect("tail");
    }
    let want: Vec<f32> = (0..2 * edge).map(|j| host[0][j] + host[1][j]).collect();

    // Zeros (both slots are zero there) around 2^31, where a 32-bit index
    // would wrap, and just before the tail: nothing may land in between.
    let assert_zeros_between_the_ends = |d_out: &CudaSlice<f32>, what: &str| {
        for start in [edge, (1 << 31) - 8, len - edge - 16] {
            let got = stream
                .clone_dtoh(&d_out.slice(start..start + 16))
                .expect("middle");
            assert!(
                got.iter().all(|&x| x.to_bits() == 0),
                "{what}: elements {start}..{} should be +0.0: {got:?}",
                start + 16
            );
        }
    };
    let check = |d_out: &CudaSlice<f32>, what: &str| {
        let head = stream.clone_dtoh(&d_out.slice(..edge)).expect("head");
        let tail = stream.clone_dtoh(&d_out.slice(len - edge..)).expect("tail");
        assert_bits_eq(&head, &want[..edge], &format!("{what}: head"));
        assert_bits_eq(&tail, &want[edge..], &format!("{what}: tail"));
        assert_zeros_between_the_ends(d_out, what);
    };
    // Scalar path first: shift both slots by one element (misaligned) and
    // sum len - 1 elements.
    gpu.fold
        .det_chain(
            &stream,
            &mut d_out.slice_mut(1..),
            None,
            &[d_slots.slice(1..len), d_slots.slice(len + 1..)],
            len - 1,
            None,
        )
        .expect("chain shifted");
    // Element j of the shifted sum is element j + 1 of the unshifted one,
    // written to out[j + 1]: the same positions as before, except out[0].
    let head = stream.clone_dtoh(&d_out.slice(..edge)).expect("head");
    assert_eq!(head[0].to_bits(), 0, "scalar path wrote before its view");
    assert_bits_eq(&head[1..], &want[1..edge], "det_chain (scalar path): head");
    let tail = stream.clone_dtoh(&d_out.slice(len - edge..)).expect("tail");
    assert_bits_eq(&tail, &want[edge..], "det_chain (scalar path): tail");
    assert_zeros_between_the_ends(&d_out, "det_chain (scalar path)");

    // The pointer chain over the same two slots, slot 1 passed at its
    // 2^31 + 8196-element offset: float4 path, then the scaled variant in
    // place (dst = slot 0 itself, its own values the first addend).
    stream.memset_zeros(&mut d_out).expect("clear");
    {
        let (s0, s1) = d_slots.split_at(len);
        gpu.fold
            .det_chain(
                &stream,
                &mut d_out.as_view_mut(),
                None,
                &[s0, s1],
                len,
                None,
            )
            .expect("chain");
    }
    check(&d_out, "det_chain (float4 path)");
    {
        let (mut s0, s1) = d_slots.split_at_mut(len);
        gpu.fold
            .det_chain(&stream, &mut s0, Some(0), &[s1.as_view()], len, Some(0.5))
            .expect("chain in place, scaled");
    }
    let halves: Vec<f32> = want.iter().map(|&w| w * 0.5).collect();
    let head = stream.clone_dtoh(&d_slots.slice(..edge)).expect("head");
    let tail = stream
        .clone_dtoh(&d_slots.slice(len - edge..len))
        .expect("tail");
    assert_bits_eq(&head, &halves[..edge], "det_chain in place: head");
    assert_bits_eq(&tail, &halves[edge..], "det_chain in place: tail");
}

mod random {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        /// Random addend counts, lengths, dst positions and offsets against
        /// the host chain.
        #[test]
        fn chain(n in 1usize..40, len in 0usize..3000, at in 0usize..40,
                 offset in 0usize..4, scaled in any::<bool>(), seed in any::<u64>()) {
            let Some(gpu) = gpu() else { return Ok(()) };
            let mut rng = Rng(seed | 1);
            let dst_at = (at < n.min(kernels::MAX_CHAIN_ADDENDS)).then_some(at);
            let factor = scaled.then_some(1.0 / 3.0);
            check_chain(&gpu, &gpu.fold, &mut rng, n, dst_at, len, offset, (offset * 3) % 4, factor);
        }
    }
}

// ------------------------------------------------------------ peer kernels

mod peer {
    use super::*;
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    use kernels::{PeerKernels, PeerStatus, ABORT_FLAG, MAX_CHAIN_ADDENDS, MAX_PEERS};
    use std::time::{Duration, Instant};

    fn status_of(stream: &Arc<CudaStream>, s: &CudaSlice<u32>) -> PeerStatus {
        PeerStatus::decode(stream.clone_dtoh(s).expect("status")[0])
    }

    /// The fanned-out fold: every destination holds the host chain, bits
    /// and all, at vector and scalar alignments, with a destination that is
    /// also an addend; the words past `len` stay; a failed status writes
    /// nothing.
    #[test]
    fn fold_fanout_writes_the_chain_to_every_destination() {
        let Some(gpu) = gpu() else { return };
        let peer = PeerKernels::load(&gpu.ctx).expect("load the peer kernels");
        let stream = gpu.ctx.default_stream();
        let mut rng = Rng(0x9e37);
        for (n, n_dst, len, offset) in [
            (1, 1, 1, 0),
            (2, 2, 4099, 0),
            (3, 8, 3, 1),
            (MAX_CHAIN_ADDENDS, 3, 70_001, 2),
            (7, MAX_PEERS, 1024, 3),
        ] {
            let srcs_h: Vec<Vec<f32>> = (0..n).map(|_| rng.values(offset + len + 2)).collect();
            let dst_h: Vec<Vec<f32>> = (0..n_dst).map(|_| rng.values(offset + len + 2)).collect();
            let mut srcs: Vec<CudaSlice<f32>> = srcs_h.iter().map(|v| upload(&stream, v)).collect();
            let mut dsts: Vec<CudaSlice<f32>> = dst_h.iter().map(|v| upload(&stream, v)).collect();
            let status = stream.alloc_zeros::<u32>(1).expect("status");
            let shifted: Vec<Vec<f32>> = srcs_h.iter().map(|v| v[offset..].to_vec()).collect();
            let chain = host_chain(&[], None, &shifted, len, Some(0.25));
            {
                let at = |p: u64| p + offset as u64 * 4;
                let (s_ptrs, _g1): (Vec<u64>, Vec<_>) = srcs
                    .iter_mut()
                    .map(|s| s.device_ptr_mut(&stream))
                    .map(|(p, g)| (at(p), g))
                    .unzip();
                let (mut d_ptrs, _g2): (Vec<u64>, Vec<_>) = dsts
                    .iter_mut()
                    .map(|d| d.device_ptr_mut(&stream))
                    .map(|(p, g)| (at(p), g))
                    .unzip();
                // The last destination is the first addend itself.
                *d_ptrs.last_mut().unwrap() = s_ptrs[0];
                let (st, _g3) = status.device_ptr(&stream);
                // SAFETY: every pointer addresses offset + len + 2 live f32 of
                // this context; no other work runs on them.
                unsafe { peer.fold_fanout(&stream, &d_ptrs, &s_ptrs, len, Some(0.25), st) }
                    .expect("fold_fanout");
            }
            let what = format!("fold_fanout n={n} dsts={n_dst} len={len} offset={offset}");
            for (d, buf) in dsts.iter().enumerate().take(n_dst - 1) {
                let mut want = dst_h[d].clone();
                want[offset..offset + len].copy_from_slice(&chain);
                assert_bits_eq(
                    &download(&stream, buf),
                    &want,
                    &format!("{what}: destination {d}"),
                );
            }
            let mut want = srcs_h[0].clone();
            want[offset..offset + len].copy_from_slice(&chain);
            assert_bits_eq(
                &download(&stream, &srcs[0]),
                &want,
                &format!("{what}: the addend as destination"),
            );
        }
        // A failed status: the launch returns without writing.
        let a = upload(&stream, &[1.0, 2.0]);
        let mut d = upload(&stream, &[7.0, 7.0]);
        let failed = upload_u32(&stream, 1 << 28);
        {
            let (pa, _g) = a.device_ptr(&stream);
            let (pd, _h) = d.device_ptr_mut(&stream);
            let (st, _i) = failed.device_ptr(&stream);
            // SAFETY: two live f32 each.
            unsafe { peer.fold_fanout(&stream, &[pd], &[pa, pa], 2, None, st) }.expect("launch");
        }
        assert_eq!(
            download(&stream, &d),
            vec![7.0, 7.0],
            "a failed status must write nothing"
        );
        // Refusals before any launch.
        let e =
            unsafe { peer.fold_fanout(&stream, &[0; 9], &[0], 1, None, 0) }.expect_err("9 dsts");
        assert!(e.to_string().contains("expected 1..=8"), "{e}");
        let e = unsafe { peer.fold_fanout(&stream, &[0], &[0; 33], 1, None, 0) }
            .expect_err("33 addends");
        assert!(e.to_string().contains("expected 1..=32"), "{e}");
    }

    fn upload_u32(stream: &Arc<CudaStream>, v: u32) -> CudaSlice<u32> {
        stream.clone_htod(&[v]).expect("upload")
    }

    /// The barrier in one process, rank 0 of two with rank 1's flag array
    /// beside it: rank 1 arrived (ok, and rank 0's arrival lands in rank
    /// 1's array), rank 1 absent (timed out after the deadline, naming it),
    /// rank 1 aborted (at once, naming it), and a world of one.
    #[test]
    fn barrier_completes_times_out_and_aborts_naming_the_peer() {
        let Some(gpu) = gpu() else { return };
        let peer = PeerKernels::load(&gpu.ctx).expect("load the peer kernels");
        let stream = gpu.ctx.default_stream();
        let run = |own_slot1: u64, epoch: u64, timeout: Duration| {
            let own = stream.clone_htod(&[0u64, own_slot1]).expect("own flags");
            let theirs = stream.alloc_zeros::<u64>(2).expect("peer flags");
            let status = stream.alloc_zeros::<u32>(1).expect("status");
            let start = Instant::now();
            {
                let (po, _a) = own.device_ptr(&stream);
                let (pt, _b) = theirs.device_ptr(&stream);
                let (st, _c) = status.device_ptr(&stream);
                // SAFETY: two live u64 each, a live u32.
                unsafe { peer.barrier(&stream, &[po, pt], 0, epoch, timeout, st) }
                    .expect("barrier");
            }
            let got = status_of(&stream, &status);
            let took = start.elapsed();
            let theirs = stream.clone_dtoh(&theirs).expect("peer flags");
            (got, took, theirs)
        };
        let (s, _, theirs) = run(5, 5, Duration::from_secs(10));
        assert_eq!(s, PeerStatus::Ok);
        assert_eq!(
            theirs,
            vec![5, 0],
            "rank 0's arrival goes to slot 0 of rank 1's array"
        );
        let (s, _, _) = run(6, 5, Duration::from_secs(10));
        assert_eq!(
            s,
            PeerStatus::Ok,
            "a peer already at the next epoch has arrived"
        );
        let (s, took, _) = run(4, 5, Duration::from_millis(200));
        assert_eq!(s, PeerStatus::TimedOut { peer: 1 });
        assert!(
            took >= Duration::from_millis(200),
            "timed out early: {took:?}"
        );
        let (s, took, _) = run(ABORT_FLAG | 4, 5, Duration::from_secs(30));
        assert_eq!(s, PeerStatus::Aborted { peer: 1 });
        assert!(
            took < Duration::from_secs(10),
            "an abort must end the wait at once: {took:?}"
        );
        // One rank: its own arrival completes the barrier.
        let own = stream.alloc_zeros::<u64>(1).expect("flags");
        let status = stream.alloc_zeros::<u32>(1).expect("status");
        {
            let (po, _a) = own.device_ptr(&stream);
            let (st, _c) = status.device_ptr(&stream);
            // SAFETY: one live u64, a live u32.
            unsafe { peer.barrier(&stream, &[po], 0, 1, Duration::from_secs(10), st) }
                .expect("barrier");
        }
        assert_eq!(status_of(&stream, &status), PeerStatus::Ok);
        let e = unsafe { peer.barrier(&stream, &[0, 0], 2, 1, Duration::ZERO, 0) }
            .expect_err("rank 2 of 2");
        assert!(e.to_string().contains("rank 2 of 2"), "{e}");
    }
}

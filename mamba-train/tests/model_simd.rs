//! The CPU model's bits do not depend on the instruction set its hot loops
//! were dispatched to. (Its own test binary: `set_max_simd` is process-wide.)

use mamba_train::model::cpu::{set_max_simd, CpuModel, SimdLevel};
use mamba_train::model::Batch;
use mamba_train::seed::Rng;
use mamba_train::ModelConfig;

#[test]
fn portable_avx2_and_avx512_paths_give_the_same_bits() {
    // d_inner = 44: a partial scan block and a partial GEMM panel.
    let cfg = ModelConfig {
        vocab_size: 19,
        d_model: 22,
        n_layer: 2,
        d_state: 5,
        d_conv: 4,
        expand: 2,
        dt_rank: 3,
        arch: Default::default(),
    };
    let model = CpuModel::new(cfg).unwrap();
    let p = model.init_params(77);
    let mut r = Rng::new(5);
    let (nseq, l) = (3, 37);
    let tokens = (0..nseq * l).map(|_| r.below(19) as u32).collect();
    let targets = (0..nseq * l).map(|_| r.below(19) as i32).collect();
    let b = Batch {
        tokens,
        targets,
        batch: nseq,
        seq_len: l,
    };
    let run = |level: SimdLevel| {
        set_max_simd(level);
        let mut g = vec![f32::NAN; p.len()];
        let loss = model.forward_backward(&p, &b, &mut g).unwrap();
        let logits = model.logits(&p, &b).unwrap();
        (
            loss.to_bits(),
            g.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            logits.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        )
    };
    let portable = run(SimdLevel::Portable);
    for level in [SimdLevel::Avx2, SimdLevel::Avx512] {
        assert!(portable == run(level), "{level:?} changed the bits");
    }
    set_max_simd(SimdLevel::Avx512);
    #[cfg(target_arch = "x86_64")]
    eprintln!(
        "cpu has avx2: {}, avx512f: {}",
        std::arch::is_x86_feature_detected!("avx2"),
        std::arch::is_x86_feature_detected!("avx512f")
    );
}

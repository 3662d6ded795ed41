//! The flat parameter arena and its named views.
//!
//! All parameters live in one `Vec<f32>` (and all gradients in another of the
//! same length and layout) so that the reducer sees exactly one contiguous
//! arena. The layout is a pure function of [`ModelConfig`]: names are the
//! Hugging Face Mamba names, shapes are the Hugging Face shapes (row-major,
//! `[out, in]` for linear weights), and offsets follow the order of
//! [`ParamLayout::new`]. Changing the order changes checkpoints' arena digest
//! and the reducer's shard boundaries, so it is part of the format.

use std::ops::Range;

use crate::config::ModelConfig;

/// What kind of tensor a parameter is; decides weight decay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// Linear / conv weight matrices and the embedding: decayed.
    Matrix,
    /// Biases, norm weights, `A_log`, `D`: never decayed.
    NoDecay,
}

/// One named tensor inside the arena.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamEntry {
    /// Hugging Face name, e.g. `backbone.layers.0.mixer.in_proj.weight`.
    pub name: String,
    /// Row-major shape.
    pub shape: Vec<usize>,
    /// First element in the arena.
    pub offset: usize,
    /// Whether AdamW decays it.
    pub kind: ParamKind,
}

impl ParamEntry {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    /// True for a zero-element tensor (never produced by a valid config).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Element range in the arena.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len()
    }
}

/// Offsets of one block's tensors, for the model's hot loops.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerOffsets {
    pub norm: Range<usize>,
    pub in_proj: Range<usize>,
    pub conv_w: Range<usize>,
    pub conv_b: Range<usize>,
    pub x_proj: Range<usize>,
    pub dt_proj_w: Range<usize>,
    pub dt_proj_b: Range<usize>,
    pub a_log: Range<usize>,
    pub d: Range<usize>,
    pub out_proj: Range<usize>,
}

/// Offsets of one Mamba-2 block's tensors (Hugging Face `Mamba2Block`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SsdLayerOffsets {
    /// `norm.weight` `[d_model]` (the block's pre-norm).
    pub norm: Range<usize>,
    /// `mixer.in_proj.weight` `[2*d_inner + 2*G*N + H, d_model]`: rows z,
    /// then x, B, C (the conv's input), then dt.
    pub in_proj: Range<usize>,
    /// `mixer.conv1d.weight` `[d_inner + 2*G*N, 1, d_conv]`.
    pub conv_w: Range<usize>,
    /// `mixer.conv1d.bias` `[d_inner + 2*G*N]`.
    pub conv_b: Range<usize>,
    /// `mixer.dt_bias` `[H]`.
    pub dt_bias: Range<usize>,
    /// `mixer.A_log` `[H]`.
    pub a_log: Range<usize>,
    /// `mixer.D` `[H]`.
    pub d: Range<usize>,
    /// `mixer.norm.weight` `[d_inner]` (the gated RMSNorm).
    pub norm_gated: Range<usize>,
    /// `mixer.out_proj.weight` `[d_model, d_inner]`.
    pub out_proj: Range<usize>,
}

/// The arena layout of a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamLayout {
    entries: Vec<ParamEntry>,
    total: usize,
    /// Range of `backbone.embeddings.weight` (`[vocab, d_model]`).
    pub embedding: Range<usize>,
    /// Per-block offsets of a Mamba-1 model (empty for Mamba-2).
    pub layers: Vec<LayerOffsets>,
    /// Per-block offsets of a Mamba-2 model (empty for Mamba-1).
    pub ssd_layers: Vec<SsdLayerOffsets>,
    /// Range of `backbone.norm_f.weight`.
    pub norm_f: Range<usize>,
}

impl ParamLayout {
    /// The layout of `cfg`: embedding, then each block's tensors in the order
    /// norm, in_proj, conv1d.weight, conv1d.bias, x_proj, dt_proj.weight,
    /// dt_proj.bias, A_log, D, out_proj, then norm_f. A Mamba-2 block's
    /// order is norm, in_proj, conv1d.weight, conv1d.bias, dt_bias, A_log,
    /// D, norm (gated), out_proj (the order of the data flow).
    pub fn new(cfg: &ModelConfig) -> Self {
        let mut entries = Vec::new();
        let mut total = 0usize;
        let mut push = |name: String, shape: Vec<usize>, kind: ParamKind| -> Range<usize> {
            let e = ParamEntry {
                name,
                shape,
                offset: total,
                kind,
            };
            let r = e.range();
            total += e.len();
            entries.push(e);
            r
        };
        let (d, di, n, r, k) = (
            cfg.d_model,
            cfg.d_inner(),
            cfg.d_state,
            cfg.dt_rank,
            cfg.d_conv,
        );
        let embedding = push(
            "backbone.embeddings.weight".into(),
            vec![cfg.vocab_size, d],
            ParamKind::Matrix,
        );
        let mut layers = Vec::new();
        let mut ssd_layers = Vec::new();
        let heads = cfg.num_heads();
        let n_layer_mamba1 = if cfg.ssd().is_some() { 0 } else { cfg.n_layer };
        if let Some(ssd) = cfg.ssd() {
            let (h, conv_dim) = (heads, di + 2 * ssd.n_groups * n);
            for i in 0..cfg.n_layer {
                let p = |s: &str| format!("backbone.layers.{i}.{s}");
                ssd_layers.push(SsdLayerOffsets {
                    norm: push(p("norm.weight"), vec![d], ParamKind::NoDecay),
                    in_proj: push(
                        p("mixer.in_proj.weight"),
                        vec![di + conv_dim + h, d],
                        ParamKind::Matrix,
                    ),
                    conv_w: push(
                        p("mixer.conv1d.weight"),
                        vec![conv_dim, 1, k],
                        ParamKind::Matrix,
                    ),
                    conv_b: push(p("mixer.conv1d.bias"), vec![conv_dim], ParamKind::NoDecay),
                    dt_bias: push(p("mixer.dt_bias"), vec![h], ParamKind::NoDecay),
                    a_log: push(p("mixer.A_log"), vec![h], ParamKind::NoDecay),
                    d: push(p("mixer.D"), vec![h], ParamKind::NoDecay),
                    norm_gated: push(p("mixer.norm.weight"), vec![di], ParamKind::NoDecay),
                    out_proj: push(p("mixer.out_proj.weight"), vec![d, di], ParamKind::Matrix),
                });
            }
        }
        for i in 0..n_layer_mamba1 {
            let p = |s: &str| format!("backbone.layers.{i}.{s}");
            layers.push(LayerOffsets {
                norm: push(p("norm.weight"), vec![d], ParamKind::NoDecay),
                in_proj: push(
                    p("mixer.in_proj.weight"),
                    vec![2 * di, d],
                    ParamKind::Matrix,
                ),
                conv_w: push(p("mixer.conv1d.weight"), vec![di, 1, k], ParamKind::Matrix),
                conv_b: push(p("mixer.conv1d.bias"), vec![di], ParamKind::NoDecay),
                x_proj: push(
                    p("mixer.x_proj.weight"),
                    vec![r + 2 * n, di],
                    ParamKind::Matrix,
                ),
                dt_proj_w: push(p("mixer.dt_proj.weight"), vec![di, r], ParamKind::Matrix),
                dt_proj_b: push(p("mixer.dt_proj.bias"), vec![di], ParamKind::NoDecay),
                a_log: push(p("mixer.A_log"), vec![di, n], ParamKind::NoDecay),
                d: push(p("mixer.D"), vec![di], ParamKind::NoDecay),
                out_proj: push(p("mixer.out_proj.weight"), vec![d, di], ParamKind::Matrix),
            });
        }
        let norm_f = push("backbone.norm_f.weight".into(), vec![d], ParamKind::NoDecay);
        ParamLayout {
            entries,
            total,
            embedding,
            layers,
            ssd_layers,
            norm_f,
        }
    }

    /// Total number of f32 elements in the arena.
    pub fn len(&self) -> usize {
        self.total
    }
    /// True only for an empty model (never produced by a valid config).
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }
    /// All tensors in arena order.
    pub fn entries(&self) -> &[ParamEntry] {
        &self.entries
    }
    /// Look a tensor up by its Hugging Face name.
    pub fn get(&self, name: &str) -> Option<&ParamEntry> {
        self.entries.iter().find(|e| e.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_contiguous_and_named_like_hugging_face() {
        let cfg = ModelConfig::new(50, 32, 2);
        let l = ParamLayout::new(&cfg);
        let mut next = 0;
        for e in l.entries() {
            assert_eq!(e.offset, next, "{} is not contiguous", e.name);
            next += e.len();
        }
        assert_eq!(next, l.len());
        let x = l.get("backbone.layers.1.mixer.x_proj.weight").unwrap();
        assert_eq!(x.shape, vec![cfg.dt_rank + 2 * cfg.d_state, cfg.d_inner()]);
        assert_eq!(
            l.get("backbone.layers.0.mixer.A_log").unwrap().kind,
            ParamKind::NoDecay
        );
        assert_eq!(l.layers[1].x_proj, x.range());
        assert!(
            l.get("lm_head.weight").is_none(),
            "the LM head is tied to the embedding"
        );
    }

    #[test]
    fn mamba2_layout_has_the_hugging_face_names_and_shapes() {
        let mut cfg = ModelConfig::mamba2(50, 32, 2);
        cfg.d_state = 8;
        if let crate::config::Arch::Mamba2(s) = &mut cfg.arch {
            s.head_dim = 16;
            s.n_groups = 2;
        }
        let (di, h, gn) = (64, 4, 16);
        let l = ParamLayout::new(&cfg);
        assert!(l.layers.is_empty());
        assert_eq!(l.ssd_layers.len(), 2);
        let mut next = 0;
        for e in l.entries() {
            assert_eq!(e.offset, next, "{} is not contiguous", e.name);
            next += e.len();
        }
        assert_eq!(next, l.len());
        let shape = |n: &str| {
            l.get(&format!("backbone.layers.1.{n}"))
                .unwrap()
                .shape
                .clone()
        };
        assert_eq!(shape("mixer.in_proj.weight"), vec![2 * di + 2 * gn + h, 32]);
        assert_eq!(shape("mixer.conv1d.weight"), vec![di + 2 * gn, 1, 4]);
        assert_eq!(shape("mixer.conv1d.bias"), vec![di + 2 * gn]);
        for n in ["mixer.dt_bias", "mixer.A_log", "mixer.D"] {
            assert_eq!(shape(n), vec![h], "{n}");
            assert_eq!(
                l.get(&format!("backbone.layers.0.{n}")).unwrap().kind,
                ParamKind::NoDecay
            );
        }
        assert_eq!(shape("mixer.norm.weight"), vec![di]);
        assert_eq!(shape("mixer.out_proj.weight"), vec![32, di]);
        assert_eq!(shape("norm.weight"), vec![32]);
        assert_eq!(l.entries().len(), 2 + 2 * 9);
        assert_eq!(
            l.ssd_layers[1].a_log,
            l.get("backbone.layers.1.mixer.A_log").unwrap().range()
        );
        assert!(l.get("backbone.layers.0.mixer.x_proj.weight").is_none());
    }
}

//! Arenas to and from safetensors files, one tensor per [`ParamLayout`]
//! entry, F32 little-endian, in the layout's (Hugging Face) shapes.

use std::collections::HashMap;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::params::ParamLayout;

/// Serialize `arenas` (each the layout's length) into one safetensors file.
/// Tensor `e.name` of arena `k` is stored as `prefixes[k] + e.name`.
/// `metadata` gets `format = pt` added (transformers checks it).
pub fn encode(
    layout: &ParamLayout,
    arenas: &[(&str, &[f32])],
    mut metadata: HashMap<String, String>,
) -> std::result::Result<Vec<u8>, String> {
    let mut bytes: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (prefix, arena) in arenas {
        if arena.len() != layout.len() {
            return Err(format!(
                "arena {prefix:?} has {} elements, the layout {}",
                arena.len(),
                layout.len()
            ));
        }
        for e in layout.entries() {
            let mut b = Vec::with_capacity(e.len() * 4);
            for &x in &arena[e.range()] {
                b.extend_from_slice(&x.to_le_bytes());
            }
            bytes.push((format!("{prefix}{}", e.name), e.shape.clone(), b));
        }
    }
    let mut views = Vec::with_capacity(bytes.len());
    for (name, shape, b) in &bytes {
        let v = TensorView::new(Dtype::F32, shape.clone(), b)
            .map_err(|e| format!("tensor {name}: {e}"))?;
        views.push((name.clone(), v));
    }
    metadata.insert("format".into(), "pt".into());
    safetensors::serialize(views, Some(metadata)).map_err(|e| format!("safetensors: {e}"))
}

/// Decoded arenas (one per prefix) and the file's metadata.
pub type Decoded = (Vec<Vec<f32>>, HashMap<String, String>);

/// Parse a safetensors file holding exactly the tensors `encode` wrote for
/// `prefixes`: every name present, F32, the layout's shape, nothing extra.
/// Returns one arena per prefix and the file's metadata.
pub fn decode(
    layout: &ParamLayout,
    bytes: &[u8],
    prefixes: &[&str],
) -> std::result::Result<Decoded, String> {
    decode_allowing(layout, bytes, prefixes, &[])
}

/// [`decode`], also accepting (and ignoring) the tensors named in
/// `ignored`, e.g. a tied `lm_head.weight` that another writer stored.
pub fn decode_allowing(
    layout: &ParamLayout,
    bytes: &[u8],
    prefixes: &[&str],
    ignored: &[&str],
) -> std::result::Result<Decoded, String> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| format!("not a safetensors file: {e}"))?;
    let (_, meta) =
        SafeTensors::read_metadata(bytes).map_err(|e| format!("bad safetensors header: {e}"))?;
    let metadata = meta.metadata().clone().unwrap_or_default();
    let expected = layout.entries().len() * prefixes.len();
    let mut arenas = Vec::with_capacity(prefixes.len());
    for prefix in prefixes {
        let mut arena = vec![0.0f32; layout.len()];
        for e in layout.entries() {
            let name = format!("{prefix}{}", e.name);
            let t = st
                .tensor(&name)
                .map_err(|_| format!("tensor {name} is missing"))?;
            if t.dtype() != Dtype::F32 {
                return Err(format!(
                    "tensor {name} has dtype {:?}, expected F32",
                    t.dtype()
                ));
            }
            if t.shape() != e.shape.as_slice() {
                return Err(format!(
                    "tensor {name} has shape {:?}, expected {:?}",
                    t.shape(),
                    e.shape
                ));
            }
            for (dst, src) in arena[e.range()].iter_mut().zip(t.data().chunks_exact(4)) {
                *dst = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
            }
        }
        arenas.push(arena);
    }
    let present_ignored = ignored.iter().filter(|n| st.tensor(n).is_ok()).count();
    if st.len() != expected + present_ignored {
        let mut extra: Vec<String> = st
            .names()
            .into_iter()
            .filter(|n| !ignored.contains(n))
            .filter(|n| {
                !prefixes.iter().any(|p| {
                    n.strip_prefix(p)
                        .is_some_and(|rest| layout.get(rest).is_some())
                })
            })
            .map(str::to_string)
            .collect();
        extra.sort();
        return Err(format!(
            "file has {} tensors, expected {expected}; unexpected: {}",
            st.len(),
            extra.join(", ")
        ));
    }
    Ok((arenas, metadata))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    #[test]
    fn round_trip_and_refusals() {
        let layout = ParamLayout::new(&ModelConfig::new(9, 16, 1));
        let a: Vec<f32> = (0..layout.len()).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = a.iter().map(|x| -x).collect();
        let bytes = encode(&layout, &[("m.", &a), ("v.", &b)], HashMap::new()).unwrap();
        let (back, meta) = decode(&layout, &bytes, &["m.", "v."]).unwrap();
        assert_eq!(back, vec![a.clone(), b]);
        assert_eq!(meta.get("format").map(String::as_str), Some("pt"));

        // Another model's layout: a shape mismatch, named.
        let other = ParamLayout::new(&ModelConfig::new(9, 32, 1));
        let e = decode(&other, &bytes, &["m.", "v."]).unwrap_err();
        assert!(
            e.contains("shape") && e.contains("backbone.embeddings.weight"),
            "{e}"
        );
        // Asking for a prefix that is not there: missing, named.
        let e = decode(&layout, &bytes, &["w."]).unwrap_err();
        assert!(e.contains("missing"), "{e}");
        // Extra tensors are refused.
        let e = decode(&layout, &bytes, &["m."]).unwrap_err();
        assert!(e.contains("unexpected") && e.contains("v.backbone"), "{e}");
        assert!(decode(&layout, b"junk", &["m."]).is_err());
    }
}

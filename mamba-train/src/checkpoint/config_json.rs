//! Reading a Hugging Face `config.json` as the files in the wild are
//! written. Python's `json.dumps` writes a float infinity as the bare token
//! `Infinity` (transformers' `Mamba2Config` default `time_step_limit` is
//! `(0.0, inf)`, saved as `[0.0, Infinity]`), which is not JSON, so a strict
//! parser refuses the very files `save_pretrained` writes. Other writers
//! spell it `"Infinity"` or, in transformers 5, `{"__float__": "Infinity"}`.
//! [`parse`] accepts the bare tokens (turned into the string spelling);
//! [`non_finite`] reads any of the three spellings back.

use serde_json::Value;

/// Parse `bytes` as JSON; where strict parsing fails, again with the bare
/// tokens `Infinity`, `-Infinity` and `NaN` outside strings read as the
/// strings `"Infinity"`, `"-Infinity"` and `"NaN"`. The error is the strict
/// parser's when both fail.
pub(super) fn parse(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    match serde_json::from_slice(bytes) {
        Ok(v) => Ok(v),
        Err(strict) => serde_json::from_slice(&quote_bare_non_finite(bytes)).map_err(|_| strict),
    }
}

/// `bytes` with every bare `Infinity` / `-Infinity` / `NaN` token outside a
/// string literal wrapped in quotes.
fn quote_bare_non_finite(bytes: &[u8]) -> Vec<u8> {
    const TOKENS: [&[u8]; 3] = [b"-Infinity", b"Infinity", b"NaN"];
    let mut out = Vec::with_capacity(bytes.len() + 16);
    let (mut i, mut in_string, mut escaped) = (0, false, false);
    while i < bytes.len() {
        let b = bytes[i];
        if in_string {
            out.push(b);
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            i += 1;
            continue;
        }
        if b == b'"' {
            in_string = true;
            out.push(b);
            i += 1;
            continue;
        }
        if let Some(t) = TOKENS.iter().find(|t| bytes[i..].starts_with(t)) {
            out.push(b'"');
            out.extend_from_slice(t);
            out.push(b'"');
            i += t.len();
            continue;
        }
        out.push(b);
        i += 1;
    }
    out
}

/// The non-finite float `v` spells (`"Infinity"`, `"-Infinity"`, `"NaN"`,
/// `"inf"`, `"-inf"`, `"nan"`, or `{"__float__": ...}` around one of them),
/// or `None` when `v` is not one of these spellings.
pub(super) fn non_finite(v: &Value) -> Option<f64> {
    let s = match v {
        Value::String(s) => s.as_str(),
        Value::Object(o) if o.len() == 1 => o.get("__float__")?.as_str()?,
        _ => return None,
    };
    match s {
        "Infinity" | "inf" => Some(f64::INFINITY),
        "-Infinity" | "-inf" => Some(f64::NEG_INFINITY),
        "NaN" | "nan" => Some(f64::NAN),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_non_finite_tokens_outside_strings_are_read_as_strings() {
        let text = br#"{"a": [0.0, Infinity], "b": -Infinity, "c": NaN, "d": "x Infinity \" NaN"}"#;
        let v = parse(text).unwrap();
        assert_eq!(v["a"][1], "Infinity");
        assert_eq!(v["b"], "-Infinity");
        assert_eq!(v["c"], "NaN");
        assert_eq!(v["d"], "x Infinity \" NaN");
        assert_eq!(non_finite(&v["a"][1]), Some(f64::INFINITY));
        assert_eq!(non_finite(&v["b"]), Some(f64::NEG_INFINITY));
    }

    #[test]
    fn strict_json_is_untouched_and_broken_json_keeps_the_strict_error() {
        let v = parse(br#"{"a": "Infinity", "b": 1}"#).unwrap();
        assert_eq!(v["b"], 1);
        let strict = serde_json::from_slice::<Value>(b"{\"a\": [1,}").unwrap_err();
        let ours = parse(b"{\"a\": [1,}").unwrap_err();
        assert_eq!(ours.to_string(), strict.to_string());
        // Not a bare token: an identifier that only starts like one.
        assert!(parse(b"{\"a\": Infinityx}").is_err());
    }

    #[test]
    fn every_spelling_of_infinity_is_read_and_others_are_not() {
        for v in [
            serde_json::json!("Infinity"),
            serde_json::json!("inf"),
            serde_json::json!({"__float__": "Infinity"}),
        ] {
            assert_eq!(non_finite(&v), Some(f64::INFINITY), "{v}");
        }
        for v in [
            serde_json::json!(1.0),
            serde_json::json!("infinite"),
            serde_json::json!({"__float__": "Infinity", "x": 1}),
        ] {
            assert_eq!(non_finite(&v), None, "{v}");
        }
    }
}

//! Minimal JSON writing helpers for the hot path: no intermediate values, no
//! re-parsing, output appended straight into the message buffer.

use serde_json::value::RawValue;

/// Whether any of the 8 bytes in `v` needs escaping in a JSON string
/// (a control byte, `"` or `\`). Bit tricks on a u64 ("SWAR"): plain text
/// is skipped eight bytes at a time.
#[inline]
fn chunk_needs_escape(v: u64) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    let zero_byte = |x: u64| x.wrapping_sub(ONES) & !x & HIGHS;
    let below_space = v.wrapping_sub(ONES * 0x20) & !v & HIGHS;
    (below_space | zero_byte(v ^ (ONES * b'"' as u64)) | zero_byte(v ^ (ONES * b'\\' as u64))) != 0
}

/// Appends `s` as a JSON string literal.
pub fn push_str(out: &mut String, s: &str) {
    out.push('"');
    let bytes = s.as_bytes();
    // Fast path: the longest prefix of whole 8-byte chunks that need no escaping.
    let mut clean = 0;
    while clean + 8 <= bytes.len() {
        let chunk = u64::from_le_bytes(bytes[clean..clean + 8].try_into().expect("8 bytes"));
        if chunk_needs_escape(chunk) {
            break;
        }
        clean += 8;
    }
    // A chunk may end inside a multi-byte character.
    while !s.is_char_boundary(clean) {
        clean -= 1;
    }
    out.push_str(&s[..clean]);
    let mut start = clean;
    for (i, &b) in bytes.iter().enumerate().skip(clean) {
        let escape = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0x00..=0x1f => "",
            _ => continue,
        };
        out.push_str(&s[start..i]);
        if escape.is_empty() {
            out.push_str(&format!("\\u{b:04x}"));
        } else {
            out.push_str(escape);
        }
        start = i + 1;
    }
    out.push_str(&s[start..]);
    out.push('"');
}

pub fn push_i64(out: &mut String, v: i64) {
    out.push_str(itoa::Buffer::new().format(v));
}

pub fn push_u64(out: &mut String, v: u64) {
    out.push_str(itoa::Buffer::new().format(v));
}

/// Finite floats as JSON numbers; NaN and the infinities, which JSON cannot
/// express, as the strings Postgres uses for them.
pub fn push_f64(out: &mut String, v: f64) {
    if v.is_finite() && v.fract() == 0.0 && v.abs() < 9_007_199_254_740_992.0 {
        // Whole numbers as JSON.stringify writes them (1000, not 1000.0).
        out.push_str(itoa::Buffer::new().format(v as i64));
    } else if v.is_finite() {
        out.push_str(ryu::Buffer::new().format_finite(v));
    } else if v.is_nan() {
        out.push_str("\"NaN\"");
    } else if v > 0.0 {
        out.push_str("\"Infinity\"");
    } else {
        out.push_str("\"-Infinity\"");
    }
}

/// Validates `text` as one JSON document and returns it without surrounding
/// whitespace, ready to embed.
pub fn validate(text: &str) -> Result<&str, String> {
    let trimmed = text.trim();
    serde_json::from_str::<&RawValue>(trimmed).map(|raw| raw.get()).map_err(|e| format!("invalid JSON ({e})"))
}

/// Validates `text` as a JSON object and returns its members without braces
/// (`{"a":1}` -> `"a":1`), for appending to another object.
pub fn object_members(text: &str) -> Result<&str, String> {
    let doc = validate(text)?;
    if !doc.starts_with('{') {
        return Err("expected a JSON object".into());
    }
    Ok(doc[1..doc.len() - 1].trim())
}

/// Validates `text` as a bare JSON number (for exact decimals).
pub fn number(text: &str) -> Result<&str, String> {
    let doc = validate(text).map_err(|_| format!("{text:?} is not a decimal number"))?;
    if doc.starts_with(|c: char| c == '-' || c.is_ascii_digit()) {
        Ok(doc)
    } else {
        Err(format!("{text:?} is not a decimal number"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_escaped_as_json() {
        let samples = ["plain", "quote\" back\\slash", "nl\n tab\t nul\u{0} bell\u{7}", "ünïcødé ✓"];
        for s in samples {
            let mut out = String::new();
            push_str(&mut out, s);
            let back: String = serde_json::from_str(&out).unwrap();
            assert_eq!(back, s);
        }
    }

    #[test]
    fn escaping_matches_serde_json_for_every_byte_position() {
        // Each special character at each offset of a 20-byte string, so both
        // the 8-byte fast path and the byte loop see it.
        for special in ['"', '\\', '\n', '\u{0}', '\u{1f}', ' ', '~', 'é'] {
            for at in 0..20 {
                let mut s: String = "abcdefghijklmnopqrst".into();
                s.replace_range(at..at + 1, &special.to_string());
                let mut out = String::new();
                push_str(&mut out, &s);
                assert_eq!(serde_json::from_str::<String>(&out).unwrap(), s, "{special:?} at {at}: {out}");
            }
        }
    }

    #[test]
    fn numbers_and_validation() {
        let mut out = String::new();
        push_i64(&mut out, i64::MIN);
        out.push(' ');
        push_f64(&mut out, 1.5);
        out.push(' ');
        push_f64(&mut out, f64::NAN);
        assert_eq!(out, "-9223372036854775808 1.5 \"NaN\"");
        assert_eq!(number(" 12.50 ").unwrap(), "12.50");
        assert!(number("\"12\"").is_err());
        assert!(number("12abc").is_err());
        assert_eq!(object_members(" {\"a\": 1} ").unwrap(), "\"a\": 1");
        assert!(object_members("[1]").is_err());
        assert!(validate("{").is_err());
    }
}

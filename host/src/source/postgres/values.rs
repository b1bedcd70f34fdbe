//! Postgres text values to typed [`Value`]s, the way Zero's change source
//! types them: integers stay exact (int8 beyond 2^53 included), numeric is
//! an exact number, json is embedded, bytea is bytes, timestamps and dates
//! are milliseconds since the epoch (fractional for microseconds), times are
//! milliseconds since midnight, and arrays of built-in types are JSON arrays.
//! Anything else (enums, intervals, ranges, user types) is its text.
//!
//! The text forms assume the session settings the source sets on both of its
//! connections: DateStyle ISO, TimeZone UTC, bytea_output hex.

use crate::change::json;
use crate::source::model::Value;

pub mod oid {
    pub const BOOL: u32 = 16;
    pub const BYTEA: u32 = 17;
    pub const INT8: u32 = 20;
    pub const INT2: u32 = 21;
    pub const INT4: u32 = 23;
    pub const OID: u32 = 26;
    pub const JSON: u32 = 114;
    pub const FLOAT4: u32 = 700;
    pub const FLOAT8: u32 = 701;
    pub const DATE: u32 = 1082;
    pub const TIME: u32 = 1083;
    pub const TIMESTAMP: u32 = 1114;
    pub const TIMESTAMPTZ: u32 = 1184;
    pub const TIMETZ: u32 = 1266;
    pub const NUMERIC: u32 = 1700;
    pub const JSONB: u32 = 3802;
}

/// The element type of a built-in array type.
fn array_element(type_oid: u32) -> Option<u32> {
    Some(match type_oid {
        1000 => oid::BOOL,
        1001 => oid::BYTEA,
        1005 => oid::INT2,
        1007 => oid::INT4,
        1016 => oid::INT8,
        1028 => oid::OID,
        1021 => oid::FLOAT4,
        1022 => oid::FLOAT8,
        1231 => oid::NUMERIC,
        199 => oid::JSON,
        3807 => oid::JSONB,
        1182 => oid::DATE,
        1183 => oid::TIME,
        1115 => oid::TIMESTAMP,
        1185 => oid::TIMESTAMPTZ,
        1270 => oid::TIMETZ,
        // text, varchar, bpchar, name, char, uuid: elements are strings.
        1009 | 1015 | 1014 | 1003 | 1002 | 2951 => 25,
        _ => return None,
    })
}

/// Types `text` (a value in Postgres' text output form) by its type.
pub fn from_text(type_oid: u32, text: &str) -> Value {
    match type_oid {
        oid::BOOL => Value::Boolean(text == "t"),
        oid::INT2 | oid::INT4 | oid::INT8 => match text.parse::<i64>() {
            Ok(n) => Value::Int(n),
            Err(_) => Value::Other(text.to_string()),
        },
        oid::OID => match text.parse::<u64>() {
            Ok(n) => Value::Uint(n),
            Err(_) => Value::Other(text.to_string()),
        },
        oid::FLOAT4 | oid::FLOAT8 => match text.parse::<f64>() {
            Ok(f) => Value::Float(f),
            Err(_) => Value::Other(text.to_string()),
        },
        oid::NUMERIC => {
            if json::number(text).is_ok() {
                Value::Numeric(text.to_string())
            } else {
                // NaN and the infinities have no JSON number form.
                Value::Other(text.to_string())
            }
        }
        oid::JSON | oid::JSONB => Value::Json(text.to_string()),
        oid::BYTEA => match decode_hex_bytea(text) {
            Some(b) => Value::Bytes(b),
            None => Value::Other(text.to_string()),
        },
        oid::TIMESTAMP | oid::TIMESTAMPTZ => float_or_text(timestamp_millis(text), text),
        oid::DATE => float_or_text(date_millis(text), text),
        oid::TIME | oid::TIMETZ => float_or_text(time_millis(text), text),
        _ => match array_element(type_oid) {
            Some(elem) => match array_json(elem, text) {
                Some(j) => Value::Json(j),
                None => Value::Other(text.to_string()),
            },
            None => Value::Text(text.to_string()),
        },
    }
}

fn float_or_text(v: Option<f64>, text: &str) -> Value {
    match v {
        Some(f) => Value::Float(f),
        None => Value::Other(text.to_string()),
    }
}

fn decode_hex_bytea(text: &str) -> Option<Vec<u8>> {
    let hex = text.strip_prefix("\\x")?.as_bytes();
    if hex.len() % 2 != 0 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    hex.chunks(2).map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

/// Days from 1970-01-01 to a proleptic Gregorian date.
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn num(s: &str) -> Option<i64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// `YYYY-MM-DD[ BC]` to milliseconds at UTC midnight.
fn date_millis(text: &str) -> Option<f64> {
    let (body, bc) = match infinite_or_era(text) {
        Err(infinite) => return Some(infinite),
        Ok(split) => split,
    };
    let mut parts = body.splitn(3, '-');
    let mut year = num(parts.next()?)?;
    let month = num(parts.next()?)?;
    let day = num(parts.next()?)?;
    if bc {
        year = 1 - year;
    }
    Some((days_from_civil(year, month, day) * 86_400_000) as f64)
}

/// `HH:MM:SS[.ffffff][+HH[:MM[:SS]]]` to milliseconds; returns the time and
/// the offset in milliseconds.
fn clock_millis(text: &str) -> Option<(f64, f64)> {
    let split = text.find(['+', '-']).unwrap_or(text.len());
    let (clock, zone) = text.split_at(split);
    let mut parts = clock.splitn(3, ':');
    let h = num(parts.next()?)?;
    let m = num(parts.next()?)?;
    let sec = parts.next()?;
    let (s, frac) = match sec.split_once('.') {
        Some((s, f)) => (num(s)?, f),
        None => (num(sec)?, ""),
    };
    let micros = if frac.is_empty() {
        0
    } else {
        if frac.len() > 6 {
            return None;
        }
        num(frac)? * 10i64.pow(6 - frac.len() as u32)
    };
    let ms = ((h * 3600 + m * 60 + s) * 1000) as f64 + micros as f64 / 1000.0;
    let mut offset = 0.0;
    if !zone.is_empty() {
        let sign = if zone.starts_with('-') { -1.0 } else { 1.0 };
        let mut z = zone[1..].split(':');
        let zh = num(z.next()?)?;
        let zm = z.next().map(num).unwrap_or(Some(0))?;
        let zs = z.next().map(num).unwrap_or(Some(0))?;
        offset = sign * ((zh * 3600 + zm * 60 + zs) * 1000) as f64;
    }
    Some((ms, offset))
}

fn time_millis(text: &str) -> Option<f64> {
    let (ms, offset) = clock_millis(text)?;
    Some((ms - offset).rem_euclid(86_400_000.0))
}

/// `Err` with the value of `infinity` / `-infinity`; else the text without
/// a trailing ` BC`, and whether it had one.
fn infinite_or_era(text: &str) -> Result<(&str, bool), f64> {
    match text {
        "infinity" => Err(f64::INFINITY),
        "-infinity" => Err(f64::NEG_INFINITY),
        _ => Ok(match text.strip_suffix(" BC") {
            Some(b) => (b, true),
            None => (text, false),
        }),
    }
}

fn timestamp_millis(text: &str) -> Option<f64> {
    let (body, bc) = match infinite_or_era(text) {
        Err(infinite) => return Some(infinite),
        Ok(split) => split,
    };
    let (date, clock) = body.split_once(' ')?;
    let day = if bc { date_millis(&format!("{date} BC"))? } else { date_millis(date)? };
    let (ms, offset) = clock_millis(clock)?;
    Some(day + ms - offset)
}

/// An array's text form (`{1,2,NULL}`, `{"a b",c}`, nested braces) as a JSON
/// array with typed elements.
fn array_json(elem: u32, text: &str) -> Option<String> {
    // A dimension decoration like `[0:1]={...}` comes first when the lower
    // bound is not 1.
    let body = match text.find('=') {
        Some(i) if text.starts_with('[') => &text[i + 1..],
        _ => text,
    };
    let bytes = body.as_bytes();
    let mut out = String::with_capacity(body.len() + 8);
    let mut i = 0;
    let mut element = String::new();
    let mut depth = 0usize;
    while i < bytes.len() {
        match bytes[i] {
            b'{' => {
                out.push('[');
                depth += 1;
                i += 1;
            }
            b'}' => {
                out.push(']');
                depth = depth.checked_sub(1)?;
                i += 1;
            }
            b',' => {
                out.push(',');
                i += 1;
            }
            b'"' => {
                element.clear();
                i += 1;
                loop {
                    match *bytes.get(i)? {
                        b'\\' => {
                            element.push(*bytes.get(i + 1)? as char);
                            i += 2;
                        }
                        b'"' => {
                            i += 1;
                            break;
                        }
                        _ => {
                            // Copy a whole UTF-8 run at once.
                            let start = i;
                            while i < bytes.len() && bytes[i] != b'\\' && bytes[i] != b'"' {
                                i += 1;
                            }
                            element.push_str(&body[start..i]);
                        }
                    }
                }
                push_element(&mut out, elem, &element, false);
            }
            _ => {
                let start = i;
                while i < bytes.len() && !matches!(bytes[i], b',' | b'}') {
                    i += 1;
                }
                let raw = body[start..i].trim();
                push_element(&mut out, elem, raw, raw.eq_ignore_ascii_case("NULL"));
            }
        }
    }
    (depth == 0 && out.starts_with('[')).then_some(out)
}

fn push_element(out: &mut String, elem: u32, text: &str, null: bool) {
    if null {
        out.push_str("null");
        return;
    }
    match from_text(elem, text) {
        Value::Null | Value::Absent => out.push_str("null"),
        Value::Boolean(b) => out.push_str(if b { "true" } else { "false" }),
        Value::Int(n) => out.push_str(itoa::Buffer::new().format(n)),
        Value::Uint(n) => out.push_str(itoa::Buffer::new().format(n)),
        Value::Float(f) => json::push_f64(out, f),
        Value::Numeric(n) | Value::Json(n) => out.push_str(&n),
        Value::Text(s) | Value::Other(s) => json::push_str(out, &s),
        Value::Bytes(_) => json::push_str(out, text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_stay_exact() {
        assert!(matches!(from_text(oid::INT8, "9007199254740993"), Value::Int(9007199254740993)));
        assert!(matches!(from_text(oid::INT2, "-5"), Value::Int(-5)));
    }

    #[test]
    fn numeric_json_bytea() {
        assert!(
            matches!(from_text(oid::NUMERIC, "12345678901234567890.123"), Value::Numeric(n) if n == "12345678901234567890.123")
        );
        assert!(matches!(from_text(oid::NUMERIC, "NaN"), Value::Other(_)));
        assert!(matches!(from_text(oid::JSONB, "{\"a\": 1}"), Value::Json(_)));
        assert!(matches!(from_text(oid::BYTEA, "\\x00ff"), Value::Bytes(b) if b == vec![0, 255]));
    }

    #[test]
    fn timestamps_are_epoch_millis() {
        let Value::Float(t) = from_text(oid::TIMESTAMPTZ, "2024-03-01 12:34:56.789123+00") else { panic!() };
        assert!((t - 1_709_296_496_789.123).abs() < 1e-3, "{t}");
        let Value::Float(t) = from_text(oid::TIMESTAMPTZ, "2024-03-01 14:34:56+02") else { panic!() };
        assert_eq!(t, 1_709_296_496_000.0);
        let Value::Float(t) = from_text(oid::TIMESTAMP, "1969-12-31 23:59:59") else { panic!() };
        assert_eq!(t, -1000.0);
        let Value::Float(d) = from_text(oid::DATE, "2000-01-01") else { panic!() };
        assert_eq!(d, 946_684_800_000.0);
        let Value::Float(d) = from_text(oid::TIME, "01:02:03.5") else { panic!() };
        assert_eq!(d, 3_723_500.0);
        assert!(matches!(from_text(oid::TIMESTAMP, "infinity"), Value::Float(f) if f.is_infinite()));
    }

    #[test]
    fn arrays_are_json() {
        assert!(
            matches!(from_text(1016, "{1,NULL,9007199254740993}"), Value::Json(j) if j == "[1,null,9007199254740993]")
        );
        assert!(
            matches!(from_text(1009, r#"{"a b",c,"q\"x",NULL}"#), Value::Json(j) if j == r#"["a b","c","q\"x",null]"#)
        );
        assert!(matches!(from_text(1007, "{{1,2},{3,4}}"), Value::Json(j) if j == "[[1,2],[3,4]]"));
        assert!(matches!(from_text(1007, "[0:1]={5,6}"), Value::Json(j) if j == "[5,6]"));
        assert!(matches!(from_text(1007, "{1,2"), Value::Other(_)));
    }
}

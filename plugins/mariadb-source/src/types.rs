//! Column types and their values, from the binlog's binary row images and
//! from the text protocol (the initial snapshot). Both paths give the same
//! value for the same stored datum, so a replica cannot tell whether a row
//! came from the snapshot or from the stream.
//!
//! Text forms: DATE `2024-01-31`, DATETIME `2024-01-31 12:34:56.789` (as
//! many fraction digits as the column has), TIMESTAMP the same in UTC with
//! `+00` appended, TIME `-838:59:59.000000`; DECIMAL keeps its scale.

use crate::wire::{Cursor, Res};
use crate::Value;

#[derive(Clone, Debug, PartialEq)]
pub enum ColType {
    Int {
        bytes: u8,
        unsigned: bool,
    },
    Year,
    Float,
    Double,
    Decimal {
        precision: u8,
        scale: u8,
    },
    Date,
    DateTime {
        fsp: u8,
    },
    Timestamp {
        fsp: u8,
    },
    Time {
        fsp: u8,
    },
    /// Pre-5.6 temporal formats (no fractions).
    DateTimeV1,
    TimestampV1,
    TimeV1,
    /// VARCHAR / VARBINARY.
    VarString {
        max_len: u16,
        binary: bool,
        latin1: bool,
    },
    /// CHAR / BINARY.
    Char {
        max_len: u16,
        binary: bool,
        latin1: bool,
    },
    /// TEXT / BLOB (and MariaDB's JSON, which is LONGTEXT).
    Blob {
        len_bytes: u8,
        binary: bool,
        latin1: bool,
    },
    Bit {
        bytes: usize,
    },
    Enum {
        pack: u8,
        labels: Vec<String>,
    },
    Set {
        pack: u8,
        labels: Vec<String>,
    },
}

impl ColType {
    /// The type name replicas see, in Postgres' spelling where one fits, so
    /// Zero's replica maps it to the right value type.
    pub fn pg_name(&self) -> &'static str {
        match self {
            ColType::Int { bytes: 1 | 2, .. } => "int2",
            ColType::Int { bytes: 3, .. } | ColType::Int { bytes: 4, unsigned: false } => "int4",
            ColType::Int { .. } => "int8",
            ColType::Year => "int2",
            ColType::Float => "float4",
            ColType::Double => "float8",
            ColType::Decimal { .. } => "numeric",
            ColType::Date => "date",
            ColType::DateTime { .. } | ColType::DateTimeV1 => "timestamp",
            ColType::Timestamp { .. } | ColType::TimestampV1 => "timestamptz",
            ColType::Time { .. } | ColType::TimeV1 => "time",
            ColType::VarString { binary: true, .. }
            | ColType::Char { binary: true, .. }
            | ColType::Blob { binary: true, .. } => "bytea",
            ColType::VarString { .. } => "varchar",
            ColType::Char { .. } => "bpchar",
            ColType::Blob { .. } => "text",
            ColType::Bit { .. } => "int8",
            ColType::Enum { .. } | ColType::Set { .. } => "text",
        }
    }

    pub fn char_max_len(&self) -> Option<i32> {
        match self {
            ColType::VarString { max_len, .. } | ColType::Char { max_len, .. } => Some(*max_len as i32),
            _ => None,
        }
    }

    /// The same kind of type, ignoring lengths and labels: used to tell a
    /// column that was only renamed from one that was replaced.
    pub fn same_kind(&self, other: &ColType) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }

    /// From information_schema.COLUMNS (DATA_TYPE, COLUMN_TYPE, precision
    /// fields), for the snapshot's text values and its create-table.
    pub fn from_information_schema(
        data_type: &str,
        column_type: &str,
        numeric_precision: Option<u64>,
        numeric_scale: Option<u64>,
        datetime_precision: Option<u64>,
        char_max: Option<u64>,
        charset: Option<&str>,
    ) -> Res<ColType> {
        let unsigned = column_type.contains("unsigned");
        let fsp = datetime_precision.unwrap_or(0) as u8;
        let len = char_max.unwrap_or(0).min(u16::MAX as u64) as u16;
        let latin1 = charset == Some("latin1");
        Ok(match data_type {
            "tinyint" | "bool" | "boolean" => ColType::Int { bytes: 1, unsigned },
            "smallint" => ColType::Int { bytes: 2, unsigned },
            "mediumint" => ColType::Int { bytes: 3, unsigned },
            "int" | "integer" => ColType::Int { bytes: 4, unsigned },
            "bigint" => ColType::Int { bytes: 8, unsigned },
            "year" => ColType::Year,
            "float" => ColType::Float,
            "double" | "real" => ColType::Double,
            "decimal" | "numeric" => ColType::Decimal {
                precision: numeric_precision.unwrap_or(10) as u8,
                scale: numeric_scale.unwrap_or(0) as u8,
            },
            "date" => ColType::Date,
            "datetime" => ColType::DateTime { fsp },
            "timestamp" => ColType::Timestamp { fsp },
            "time" => ColType::Time { fsp },
            "varchar" => ColType::VarString { max_len: len, binary: false, latin1 },
            "varbinary" => ColType::VarString { max_len: len, binary: true, latin1: false },
            "char" => ColType::Char { max_len: len, binary: false, latin1 },
            "binary" => ColType::Char { max_len: len, binary: true, latin1: false },
            "tinytext" | "text" | "mediumtext" | "longtext" | "json" => {
                ColType::Blob { len_bytes: 4, binary: false, latin1 }
            }
            "tinyblob" | "blob" | "mediumblob" | "longblob" | "geometry" | "point" | "linestring" | "polygon"
            | "multipoint" | "multilinestring" | "multipolygon" | "geometrycollection" => {
                ColType::Blob { len_bytes: 4, binary: true, latin1: false }
            }
            "bit" => ColType::Bit { bytes: (numeric_precision.unwrap_or(1) as usize).div_ceil(8) },
            "enum" => ColType::Enum { pack: 2, labels: labels(column_type) },
            "set" => ColType::Set { pack: 8, labels: labels(column_type) },
            other => return Err(format!("column type {other} ({column_type}) is not supported")),
        })
    }
}

/// `enum('a','b')` -> ["a", "b"].
fn labels(column_type: &str) -> Vec<String> {
    let inner = column_type.find('(').map(|i| &column_type[i + 1..]).unwrap_or("");
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = inner.chars().peekable();
    let mut in_q = false;
    while let Some(c) = chars.next() {
        match (in_q, c) {
            (false, '\'') => in_q = true,
            (true, '\'') if chars.peek() == Some(&'\'') => {
                chars.next();
                cur.push('\'');
            }
            (true, '\'') => {
                in_q = false;
                out.push(std::mem::take(&mut cur));
            }
            (true, '\\') => {
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
            }
            (true, c) => cur.push(c),
            _ => {}
        }
    }
    out
}

/// One value of a binlog row image.
pub fn decode_binary(c: &mut Cursor, ty: &ColType) -> Res<Value> {
    Ok(match ty {
        ColType::Int { bytes, unsigned } => {
            let n = *bytes as usize;
            let raw = c.uint_le(n)?;
            if *unsigned {
                Value::Uint(raw)
            } else {
                let shift = 64 - 8 * n as u32;
                Value::Int(((raw << shift) as i64) >> shift)
            }
        }
        ColType::Year => {
            let y = c.u8()? as i64;
            Value::Int(if y == 0 { 0 } else { 1900 + y })
        }
        ColType::Float => {
            let f = f32::from_le_bytes(c.bytes(4)?.try_into().map_err(|_| "float")?);
            Value::Float(float32(f))
        }
        ColType::Double => Value::Float(f64::from_le_bytes(c.bytes(8)?.try_into().map_err(|_| "double")?)),
        ColType::Decimal { precision, scale } => Value::Numeric(decimal(c, *precision, *scale)?),
        ColType::Date => {
            let v = c.u24()?;
            Value::Other(format!("{:04}-{:02}-{:02}", v >> 9, (v >> 5) & 15, v & 31))
        }
        ColType::DateTime { fsp } => {
            let packed = c.uint_be(5)? as i64 - 0x80_0000_0000;
            let frac = fraction(c, *fsp)?;
            let ymd = packed >> 17;
            let ym = ymd >> 5;
            let hms = packed & 0x1_ffff;
            Value::Other(format!(
                "{:04}-{:02}-{:02} {:02}:{:02}:{:02}{}",
                ym / 13,
                ym % 13,
                ymd & 31,
                hms >> 12,
                (hms >> 6) & 63,
                hms & 63,
                frac_text(frac, *fsp)
            ))
        }
        ColType::Timestamp { fsp } => {
            let secs = c.uint_be(4)? as i64;
            let frac = fraction(c, *fsp)?;
            Value::Other(timestamp_text(secs, frac, *fsp))
        }
        ColType::Time { fsp } => Value::Other(time2(c, *fsp)?),
        ColType::DateTimeV1 => {
            let v = c.u64()?;
            let (d, t) = (v / 1_000_000, v % 1_000_000);
            Value::Other(format!(
                "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
                d / 10000,
                d / 100 % 100,
                d % 100,
                t / 10000,
                t / 100 % 100,
                t % 100
            ))
        }
        ColType::TimestampV1 => Value::Other(timestamp_text(c.u32()? as i64, 0, 0)),
        ColType::TimeV1 => {
            let v = c.u24()?;
            Value::Other(format!("{:02}:{:02}:{:02}", v / 10000, v / 100 % 100, v % 100))
        }
        ColType::VarString { max_len, binary, latin1 } => {
            let n = if *max_len > 255 { c.u16()? as usize } else { c.u8()? as usize };
            string(c.bytes(n)?, *binary, *latin1, None)
        }
        ColType::Char { max_len, binary, latin1 } => {
            let n = if *max_len > 255 { c.u16()? as usize } else { c.u8()? as usize };
            // BINARY(n) is stored without its trailing zero padding; the
            // text protocol returns it padded.
            string(c.bytes(n)?, *binary, *latin1, binary.then_some(*max_len as usize))
        }
        ColType::Blob { len_bytes, binary, latin1 } => {
            let n = c.uint_le((*len_bytes).clamp(1, 4) as usize)? as usize;
            string(c.bytes(n)?, *binary, *latin1, None)
        }
        ColType::Bit { bytes } => Value::Uint(c.uint_be((*bytes).clamp(1, 8))?),
        ColType::Enum { pack, labels } => {
            let i = c.uint_le((*pack).clamp(1, 2) as usize)? as usize;
            Value::Text(if i == 0 { String::new() } else { labels.get(i - 1).cloned().unwrap_or_default() })
        }
        ColType::Set { pack, labels } => {
            let bits = c.uint_le((*pack).clamp(1, 8) as usize)?;
            let picked: Vec<&str> =
                labels.iter().enumerate().filter(|(i, _)| bits & (1u64 << i) != 0).map(|(_, l)| l.as_str()).collect();
            Value::Text(picked.join(","))
        }
    })
}

/// One value of a text-protocol row (the snapshot's `SELECT`).
pub fn decode_text(raw: Option<&[u8]>, ty: &ColType) -> Res<Value> {
    let Some(raw) = raw else { return Ok(Value::Null) };
    let s = || std::str::from_utf8(raw).map_err(|_| "not UTF-8".to_string());
    Ok(match ty {
        ColType::Int { unsigned: true, .. } => Value::Uint(s()?.parse().map_err(|e| format!("{e}"))?),
        ColType::Int { .. } | ColType::Year => Value::Int(s()?.parse().map_err(|e| format!("{e}"))?),
        ColType::Float | ColType::Double => Value::Float(s()?.parse().map_err(|e| format!("{e}"))?),
        ColType::Decimal { .. } => Value::Numeric(s()?.to_string()),
        ColType::Timestamp { .. } | ColType::TimestampV1 => Value::Other(format!("{}+00", s()?)),
        ColType::Date | ColType::DateTime { .. } | ColType::Time { .. } | ColType::DateTimeV1 | ColType::TimeV1 => {
            Value::Other(s()?.to_string())
        }
        ColType::VarString { binary: true, .. }
        | ColType::Char { binary: true, .. }
        | ColType::Blob { binary: true, .. } => Value::Bytes(raw.to_vec()),
        ColType::VarString { .. }
        | ColType::Char { .. }
        | ColType::Blob { .. }
        | ColType::Enum { .. }
        | ColType::Set { .. } => Value::Text(String::from_utf8_lossy(raw).into_owned()),
        ColType::Bit { .. } => Value::Uint(raw.iter().take(8).fold(0u64, |a, &b| (a << 8) | b as u64)),
    })
}

/// A FLOAT as the server prints it (shortest text that reads back as the
/// same f32), widened to f64.
fn float32(f: f32) -> f64 {
    format!("{f}").parse().unwrap_or(f as f64)
}

fn string(b: &[u8], binary: bool, latin1: bool, pad_to: Option<usize>) -> Value {
    if binary {
        let mut v = b.to_vec();
        if let Some(n) = pad_to {
            if v.len() < n {
                v.resize(n, 0);
            }
        }
        Value::Bytes(v)
    } else if latin1 {
        Value::Text(b.iter().map(|&c| c as char).collect())
    } else {
        Value::Text(String::from_utf8_lossy(b).into_owned())
    }
}

/// Microseconds from the fractional part that follows DATETIME2,
/// TIMESTAMP2 and TIME2 values.
fn fraction(c: &mut Cursor, fsp: u8) -> Res<u64> {
    Ok(match fsp {
        0 => 0,
        1 | 2 => c.uint_be(1)? * 10_000,
        3 | 4 => c.uint_be(2)? * 100,
        5 | 6 => c.uint_be(3)?,
        n => return Err(format!("fractional precision {n}")),
    })
}

fn frac_text(micros: u64, fsp: u8) -> String {
    if fsp == 0 {
        return String::new();
    }
    let digits = format!("{micros:06}");
    format!(".{}", &digits[..(fsp as usize).min(6)])
}

fn timestamp_text(secs: i64, micros: u64, fsp: u8) -> String {
    if secs == 0 && micros == 0 {
        return format!("0000-00-00 00:00:00{}+00", frac_text(0, fsp));
    }
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}{}+00", rem / 3600, rem / 60 % 60, rem % 60, frac_text(micros, fsp))
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn time2(c: &mut Cursor, fsp: u8) -> Res<String> {
    // MariaDB's packed TIME2: a 24-bit biased integer part and a fraction
    // whose encoding depends on the precision.
    let packed: i64 = match fsp {
        0 => (c.uint_be(3)? as i64 - 0x80_0000) << 24,
        1 | 2 => {
            let mut int = c.uint_be(3)? as i64 - 0x80_0000;
            let mut frac = c.u8()? as i64;
            if int < 0 && frac != 0 {
                int += 1;
                frac -= 0x100;
            }
            (int << 24) + frac * 10_000
        }
        3 | 4 => {
            let mut int = c.uint_be(3)? as i64 - 0x80_0000;
            let mut frac = c.uint_be(2)? as i64;
            if int < 0 && frac != 0 {
                int += 1;
                frac -= 0x10000;
            }
            (int << 24) + frac * 100
        }
        5 | 6 => c.uint_be(6)? as i64 - 0x8000_0000_0000,
        n => return Err(format!("fractional precision {n}")),
    };
    let neg = packed < 0;
    let abs = packed.unsigned_abs();
    let hms = abs >> 24;
    let micros = abs % (1 << 24);
    Ok(format!(
        "{}{:02}:{:02}:{:02}{}",
        if neg { "-" } else { "" },
        (hms >> 12) % (1 << 10),
        (hms >> 6) % 64,
        hms % 64,
        frac_text(micros, fsp)
    ))
}

/// MariaDB's binary DECIMAL: groups of nine digits in four bytes, a shorter
/// leading and trailing group, sign in the top bit, negatives inverted.
fn decimal(c: &mut Cursor, precision: u8, scale: u8) -> Res<String> {
    const DIG2BYTES: [usize; 10] = [0, 1, 1, 2, 2, 3, 3, 4, 4, 4];
    if scale > precision || precision > 65 {
        return Err(format!("DECIMAL({precision},{scale})"));
    }
    let intg = (precision - scale) as usize;
    let (intg0, intg0x) = (intg / 9, intg % 9);
    let (frac0, frac0x) = (scale as usize / 9, scale as usize % 9);
    let size = intg0 * 4 + DIG2BYTES[intg0x] + frac0 * 4 + DIG2BYTES[frac0x];
    let mut b = c.bytes(size)?.to_vec();
    if b.is_empty() {
        return Ok("0".into());
    }
    let negative = b[0] & 0x80 == 0;
    b[0] ^= 0x80;
    if negative {
        for x in &mut b {
            *x = !*x;
        }
    }
    let mut d = Cursor::new(&b);
    let mut int = String::new();
    if intg0x > 0 {
        int.push_str(&d.uint_be(DIG2BYTES[intg0x])?.to_string());
    }
    for _ in 0..intg0 {
        let g = d.uint_be(4)?;
        if int.is_empty() {
            int.push_str(&g.to_string());
        } else {
            int.push_str(&format!("{g:09}"));
        }
    }
    let int = int.trim_start_matches('0');
    let mut out = String::new();
    if negative {
        out.push('-');
    }
    out.push_str(if int.is_empty() { "0" } else { int });
    if scale > 0 {
        out.push('.');
        for _ in 0..frac0 {
            out.push_str(&format!("{:09}", d.uint_be(4)?));
        }
        if frac0x > 0 {
            let g = d.uint_be(DIG2BYTES[frac0x])?;
            out.push_str(&format!("{g:0width$}", width = frac0x));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dec(bytes: &[u8], p: u8, s: u8) -> String {
        decimal(&mut Cursor::new(bytes), p, s).unwrap()
    }

    #[test]
    fn decimals() {
        // DECIMAL(10,2): 8 integer digits (4 bytes: 0 groups of 9 + 8 digits) and 2 fraction digits (1 byte).
        // 1234.56 -> int part 1234 in 4 bytes, frac 56 in 1 byte, sign bit set.
        let mut b = vec![0x80, 0x00, 0x04, 0xd2, 0x38];
        assert_eq!(dec(&b, 10, 2), "1234.56");
        for x in &mut b {
            *x = !*x;
        }
        assert_eq!(dec(&b, 10, 2), "-1234.56");
        assert_eq!(dec(&[0x80, 0, 0, 0, 0], 10, 2), "0.00");
    }

    #[test]
    fn days_to_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(timestamp_text(1_704_067_200 + 3661, 123_000, 3), "2024-01-01 01:01:01.123+00");
    }

    #[test]
    fn enum_labels() {
        assert_eq!(labels("enum('a','it''s','c')"), vec!["a", "it's", "c"]);
    }

    #[test]
    fn signed_ints_sign_extend() {
        let v = decode_binary(&mut Cursor::new(&[0xff, 0xff, 0xff]), &ColType::Int { bytes: 3, unsigned: false });
        assert!(matches!(v, Ok(Value::Int(-1))));
        let v = decode_binary(&mut Cursor::new(&[0xff; 8]), &ColType::Int { bytes: 8, unsigned: true });
        assert!(matches!(v, Ok(Value::Uint(u64::MAX))));
    }
}

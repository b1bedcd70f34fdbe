//! Column types and their values, from the binlog's binary row images and
//! from the text protocol (the initial snapshot). Both paths give the same
//! value for the same stored datum, so a replica cannot tell whether a row
//! came from the snapshot or from the stream.
//!
//! Dates and times are numbers, as Zero's replicas read them and as the
//! Postgres source sends them: DATE, DATETIME and TIMESTAMP are milliseconds
//! since the epoch (fractional for microseconds; DATETIME has no zone and
//! is read as UTC, TIMESTAMP is UTC), TIME is milliseconds since midnight
//! (negative and beyond 24 hours as MariaDB allows). MariaDB's zero dates
//! (`0000-00-00`, and dates with a zero month or day) have no instant and
//! stay text. DECIMAL keeps its scale.

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
            let v = c.u24()? as i64;
            DateTime::at((v >> 9, (v >> 5) & 15, v & 31), (0, 0, 0), 0).value(0)
        }
        ColType::DateTime { fsp } => {
            let packed = c.uint_be(5)? as i64 - 0x80_0000_0000;
            let micros = fraction(c, *fsp)?;
            let ymd = packed >> 17;
            let ym = ymd >> 5;
            let hms = packed & 0x1_ffff;
            DateTime::at((ym / 13, ym % 13, ymd & 31), (hms >> 12, (hms >> 6) & 63, hms & 63), micros).value(*fsp)
        }
        ColType::Timestamp { fsp } => {
            let secs = c.uint_be(4)? as i64;
            let micros = fraction(c, *fsp)?;
            timestamp(secs, micros, *fsp)
        }
        ColType::Time { fsp } => Value::Float(time2_millis(c, *fsp)?),
        ColType::DateTimeV1 => {
            let v = c.u64()? as i64;
            let (d, t) = (v / 1_000_000, v % 1_000_000);
            DateTime::at((d / 10000, d / 100 % 100, d % 100), (t / 10000, t / 100 % 100, t % 100), 0).value(0)
        }
        ColType::TimestampV1 => timestamp(c.u32()? as i64, 0, 0),
        ColType::TimeV1 => {
            let v = c.u24()? as i64;
            Value::Float(((v / 10000 * 3600 + v / 100 % 100 * 60 + v % 100) * 1000) as f64)
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
        // The snapshot's session reads TIMESTAMPs in UTC, so all three are
        // the same calendar text.
        ColType::Date
        | ColType::DateTime { .. }
        | ColType::DateTimeV1
        | ColType::Timestamp { .. }
        | ColType::TimestampV1 => {
            let text = s()?;
            match DateTime::parse(text) {
                Some(at) => at.value(0),
                None => Value::Other(text.to_string()),
            }
        }
        ColType::Time { .. } | ColType::TimeV1 => {
            let text = s()?;
            Value::Float(time_text_millis(text).ok_or_else(|| format!("TIME {text:?}"))?)
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

/// A calendar date and time of day (UTC) with microseconds, as MariaDB
/// stores DATETIME and shows TIMESTAMP.
#[derive(Clone, Copy, Debug, PartialEq)]
struct DateTime {
    ymd: (i64, i64, i64),
    hms: (i64, i64, i64),
    micros: u64,
}

impl DateTime {
    fn at(ymd: (i64, i64, i64), hms: (i64, i64, i64), micros: u64) -> DateTime {
        DateTime { ymd, hms, micros }
    }

    /// `YYYY-MM-DD[ HH:MM:SS[.ffffff]]`.
    fn parse(text: &str) -> Option<DateTime> {
        let (date, clock) = text.split_once(' ').unwrap_or((text, "00:00:00"));
        let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
        let ymd = (d.next()??, d.next()??, d.next()??);
        let (clock, frac) = clock.split_once('.').unwrap_or((clock, ""));
        let mut t = clock.splitn(3, ':').map(|p| p.parse::<i64>().ok());
        let hms = (t.next()??, t.next()??, t.next()??);
        Some(DateTime { ymd, hms, micros: micros_of(frac)? })
    }

    /// Milliseconds since the epoch, or the text for a zero date, which
    /// names no instant.
    fn value(self, fsp: u8) -> Value {
        let (y, m, d) = self.ymd;
        if m == 0 || d == 0 {
            let (h, mi, s) = self.hms;
            let frac =
                if fsp == 0 { String::new() } else { format!(".{:06}", self.micros)[..=fsp as usize].to_string() };
            return Value::Other(format!("{y:04}-{m:02}-{d:02} {h:02}:{mi:02}:{s:02}{frac}"));
        }
        let (h, mi, s) = self.hms;
        let secs = days_from_civil(y, m, d) * 86_400 + h * 3600 + mi * 60 + s;
        Value::Float(millis(secs, self.micros))
    }
}

/// A TIMESTAMP's seconds since the epoch; zero is MariaDB's zero timestamp.
fn timestamp(secs: i64, micros: u64, fsp: u8) -> Value {
    if secs == 0 && micros == 0 {
        return DateTime::at((0, 0, 0), (0, 0, 0), 0).value(fsp);
    }
    Value::Float(millis(secs, micros))
}

fn millis(secs: i64, micros: u64) -> f64 {
    // Exact up to 2^53 microseconds (the year 2255), then rounded once.
    (secs as f64 * 1_000_000.0 + micros as f64) / 1000.0
}

/// Fraction digits (up to six) to microseconds.
fn micros_of(frac: &str) -> Option<u64> {
    if frac.len() > 6 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(format!("{frac:0<6}").parse().unwrap_or(0))
}

/// `[-]HHH:MM:SS[.ffffff]` to milliseconds.
fn time_text_millis(text: &str) -> Option<f64> {
    let (neg, body) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (clock, frac) = body.split_once('.').unwrap_or((body, ""));
    let mut t = clock.splitn(3, ':').map(|p| p.parse::<i64>().ok());
    let secs = t.next()?? * 3600 + t.next()?? * 60 + t.next()??;
    let ms = millis(secs, micros_of(frac)?);
    Some(if neg { -ms } else { ms })
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

fn time2_millis(c: &mut Cursor, fsp: u8) -> Res<f64> {
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
    let hms = (abs >> 24) as i64;
    let micros = abs % (1 << 24);
    let secs = (hms >> 12) % (1 << 10) * 3600 + (hms >> 6) % 64 * 60 + hms % 64;
    let ms = millis(secs, micros);
    Ok(if neg { -ms } else { ms })
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
    fn dates_and_times_are_milliseconds() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2024, 1, 1), 19_723);
        let at = DateTime::parse("2024-01-02 03:04:05.678").unwrap();
        assert!(matches!(at.value(3), Value::Float(ms) if ms == 1_704_164_645_678.0));
        assert!(matches!(timestamp(1_704_067_200 + 3661, 123_456, 6), Value::Float(ms) if ms == 1_704_070_861_123.456));
        assert!(
            matches!(DateTime::parse("2024-02-29").unwrap().value(0), Value::Float(ms) if ms == 1_709_164_800_000.0)
        );
        assert!(
            matches!(DateTime::parse("0000-00-00 00:00:00").unwrap().value(0), Value::Other(t) if t == "0000-00-00 00:00:00")
        );
        assert!(matches!(timestamp(0, 0, 2), Value::Other(t) if t == "0000-00-00 00:00:00.00"));
        assert_eq!(time_text_millis("-838:59:59"), Some(-3_020_399_000.0));
        assert_eq!(time_text_millis("12:34:56.78"), Some(45_296_780.0));
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

//! MariaDB binlog events: the header, the events a row-based reader needs
//! (format description, GTID, XID, QUERY, TABLE_MAP with FULL row metadata,
//! v1 rows events, rotate, heartbeat) and checksum checking.
//!
//! No published crate decodes MariaDB's GTID events and builds for
//! wasm32-wasip2 without C (see docs/sources/mariadb.md), so this is written here.

use crate::types::ColType;
use crate::wire::{Cursor, Res};

pub const HEADER_LEN: usize = 19;

pub mod kind {
    pub const QUERY: u8 = 0x02;
    pub const STOP: u8 = 0x03;
    pub const ROTATE: u8 = 0x04;
    pub const FORMAT_DESCRIPTION: u8 = 0x0f;
    pub const XID: u8 = 0x10;
    pub const TABLE_MAP: u8 = 0x13;
    pub const WRITE_ROWS_V1: u8 = 0x17;
    pub const UPDATE_ROWS_V1: u8 = 0x18;
    pub const DELETE_ROWS_V1: u8 = 0x19;
    pub const HEARTBEAT: u8 = 0x1b;
    pub const WRITE_ROWS_V2: u8 = 0x1e;
    pub const UPDATE_ROWS_V2: u8 = 0x1f;
    pub const DELETE_ROWS_V2: u8 = 0x20;
    pub const GTID: u8 = 0xa2;
    pub const GTID_LIST: u8 = 0xa3;
    pub const WRITE_ROWS_COMPRESSED_V1: u8 = 0xa9;
    pub const DELETE_ROWS_COMPRESSED_V1: u8 = 0xab;
    pub const QUERY_COMPRESSED: u8 = 0xa5;
}

pub struct Header {
    /// When the event was written upstream (seconds since the Unix epoch).
    pub timestamp: u32,
    pub kind: u8,
    pub server_id: u32,
    pub log_pos: u32,
}

/// Splits an event into its header and body, checking and removing the
/// CRC32 when the stream carries checksums.
pub fn split(event: &[u8], checksums: bool) -> Res<(Header, &[u8])> {
    if event.len() < HEADER_LEN {
        return Err(format!("binlog event of {} bytes is shorter than its header", event.len()));
    }
    let mut c = Cursor::new(event);
    let timestamp = c.u32()?;
    let kind = c.u8()?;
    let server_id = c.u32()?;
    let size = c.u32()? as usize;
    let log_pos = c.u32()?;
    if size != event.len() {
        return Err(format!("binlog event type 0x{kind:02x} says {size} bytes but has {}", event.len()));
    }
    let mut body = &event[HEADER_LEN..];
    if checksums && kind != kind::FORMAT_DESCRIPTION {
        body = strip_crc(event, body, kind)?;
    } else if kind == kind::FORMAT_DESCRIPTION {
        // The FDE always carries the algorithm byte and (when on) a CRC.
        if let Some(n) = body.len().checked_sub(5) {
            if body[n] == 1 {
                body = strip_crc(event, body, kind)?;
            }
        }
    }
    Ok((Header { timestamp, kind, server_id, log_pos }, body))
}

fn strip_crc<'a>(event: &'a [u8], body: &'a [u8], kind: u8) -> Res<&'a [u8]> {
    let n = event.len().checked_sub(4).filter(|&n| n >= HEADER_LEN).ok_or("binlog event too short for its CRC")?;
    let want = u32::from_le_bytes([event[n], event[n + 1], event[n + 2], event[n + 3]]);
    let got = crc32fast::hash(&event[..n]);
    if want != got {
        return Err(format!("binlog event type 0x{kind:02x}: CRC32 mismatch (corrupt stream)"));
    }
    Ok(&body[..body.len() - 4])
}

/// Whether the format description says events carry CRC32 checksums.
pub fn fde_checksums(event: &[u8]) -> bool {
    let n = event.len();
    n >= HEADER_LEN + 5 && event[n - 5] == 1
}

pub struct Gtid {
    pub domain: u32,
    pub server: u32,
    pub seq: u64,
    /// A statement outside any transaction (DDL): no XID follows.
    pub standalone: bool,
}

pub fn gtid(h: &Header, body: &[u8]) -> Res<Gtid> {
    let mut c = Cursor::new(body);
    let seq = c.u64()?;
    let domain = c.u32()?;
    let flags = c.u8()?;
    Ok(Gtid { domain, server: h.server_id, seq, standalone: flags & 1 != 0 })
}

pub struct Query {
    pub db: String,
    pub sql: String,
}

pub fn query(body: &[u8]) -> Res<Query> {
    let mut c = Cursor::new(body);
    c.skip(4 + 4)?; // thread id, exec time
    let db_len = c.u8()? as usize;
    c.skip(2)?; // error code
    let vars = c.u16()? as usize;
    c.skip(vars)?;
    let db = String::from_utf8_lossy(c.bytes(db_len)?).into_owned();
    c.skip(1)?; // NUL
    let sql = String::from_utf8_lossy(c.rest()).into_owned();
    Ok(Query { db, sql })
}

pub fn rotate(body: &[u8]) -> Res<(u64, String)> {
    let mut c = Cursor::new(body);
    let pos = c.u64()?;
    Ok((pos, String::from_utf8_lossy(c.rest()).into_owned()))
}

/// A TABLE_MAP event: the table a following rows event refers to, with its
/// column types and (binlog_row_metadata=FULL) names, signedness, charsets,
/// enum/set labels and primary key.
#[derive(Clone, Debug)]
pub struct TableMap {
    pub table_id: u64,
    pub db: String,
    pub table: String,
    pub columns: Vec<Column>,
    /// Indexes into `columns`.
    pub primary_key: Vec<usize>,
    /// The metadata carried column names (binlog_row_metadata=FULL).
    pub has_names: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Column {
    pub name: String,
    pub ty: ColType,
    pub nullable: bool,
}

mod t {
    pub const DECIMAL: u8 = 0;
    pub const TINY: u8 = 1;
    pub const SHORT: u8 = 2;
    pub const LONG: u8 = 3;
    pub const FLOAT: u8 = 4;
    pub const DOUBLE: u8 = 5;
    pub const TIMESTAMP: u8 = 7;
    pub const LONGLONG: u8 = 8;
    pub const INT24: u8 = 9;
    pub const DATE: u8 = 10;
    pub const TIME: u8 = 11;
    pub const DATETIME: u8 = 12;
    pub const YEAR: u8 = 13;
    pub const NEWDATE: u8 = 14;
    pub const VARCHAR: u8 = 15;
    pub const BIT: u8 = 16;
    pub const TIMESTAMP2: u8 = 17;
    pub const DATETIME2: u8 = 18;
    pub const TIME2: u8 = 19;
    pub const JSON: u8 = 245;
    pub const NEWDECIMAL: u8 = 246;
    pub const ENUM: u8 = 247;
    pub const SET: u8 = 248;
    pub const TINY_BLOB: u8 = 249;
    pub const MEDIUM_BLOB: u8 = 250;
    pub const LONG_BLOB: u8 = 251;
    pub const BLOB: u8 = 252;
    pub const VAR_STRING: u8 = 253;
    pub const STRING: u8 = 254;
    pub const GEOMETRY: u8 = 255;
}

/// binlog collation id of the binary "charset".
const BINARY: u64 = 63;

/// Per column while parsing: the wire type and its metadata.
struct Raw {
    /// The type after STRING's real-type is applied.
    ty: u8,
    meta: u16,
}

impl Raw {
    /// The columns SIGNEDNESS has a bit for: MariaDB leaves out FLOAT,
    /// DOUBLE, YEAR and BIT (measured against 10.11).
    fn numeric(&self) -> bool {
        matches!(self.ty, t::TINY | t::SHORT | t::INT24 | t::LONG | t::LONGLONG | t::NEWDECIMAL | t::DECIMAL)
    }
    fn character(&self) -> bool {
        matches!(
            self.ty,
            t::STRING | t::VAR_STRING | t::VARCHAR | t::BLOB | t::TINY_BLOB | t::MEDIUM_BLOB | t::LONG_BLOB
        )
    }
}

pub fn table_map(body: &[u8]) -> Res<TableMap> {
    let mut c = Cursor::new(body);
    let table_id = c.u48()?;
    c.skip(2)?; // flags
    let n = c.u8()? as usize;
    let db = String::from_utf8_lossy(c.bytes(n)?).into_owned();
    c.skip(1)?;
    let n = c.u8()? as usize;
    let table = String::from_utf8_lossy(c.bytes(n)?).into_owned();
    c.skip(1)?;
    let count = c.lenenc_int()? as usize;
    if count > 4096 {
        return Err(format!("table map for {db}.{table} claims {count} columns"));
    }
    let types = c.bytes(count)?.to_vec();
    let meta_len = c.lenenc_int()? as usize;
    let mut m = Cursor::new(c.bytes(meta_len)?);
    let mut raws = Vec::with_capacity(count);
    for &ty in &types {
        let (ty, meta) = match ty {
            t::FLOAT
            | t::DOUBLE
            | t::BLOB
            | t::TINY_BLOB
            | t::MEDIUM_BLOB
            | t::LONG_BLOB
            | t::GEOMETRY
            | t::JSON
            | t::TIMESTAMP2
            | t::DATETIME2
            | t::TIME2 => (ty, m.u8()? as u16),
            t::VARCHAR => (ty, m.u16()?),
            t::BIT | t::NEWDECIMAL | t::ENUM | t::SET => {
                let a = m.u8()? as u16;
                let b = m.u8()? as u16;
                (ty, (a << 8) | b)
            }
            t::STRING | t::VAR_STRING => {
                let real = m.u8()?;
                let len = m.u8()? as u16;
                if real == t::ENUM || real == t::SET {
                    (real, len)
                } else if (real as u16 & 0x30) != 0x30 {
                    // Lengths over 255 borrow two bits of the real type.
                    let len = len | ((((real as u16) & 0x30) ^ 0x30) << 4);
                    (t::STRING, len)
                } else {
                    (ty, len)
                }
            }
            _ => (ty, 0),
        };
        raws.push(Raw { ty, meta });
    }
    let nulls = c.bytes(count.div_ceil(8))?.to_vec();

    // Optional metadata (binlog_row_metadata=MINIMAL or FULL).
    let mut unsigned = vec![false; count];
    let mut charsets: Vec<Option<u64>> = vec![None; count];
    let mut names: Vec<String> = Vec::new();
    let mut enum_values: Vec<Vec<String>> = Vec::new();
    let mut set_values: Vec<Vec<String>> = Vec::new();
    let mut primary_key = Vec::new();
    let char_cols: Vec<usize> = (0..count).filter(|&i| raws[i].character()).collect();
    while !c.is_empty() {
        let field = c.u8()?;
        let len = c.lenenc_int()? as usize;
        let mut f = Cursor::new(c.bytes(len)?);
        match field {
            1 => {
                // SIGNEDNESS: a bit per numeric column, most significant first.
                let bits = f.rest();
                for (k, i) in (0..count).filter(|&i| raws[i].numeric()).enumerate() {
                    unsigned[i] = bits.get(k / 8).is_some_and(|b| b & (0x80 >> (k % 8)) != 0);
                }
            }
            2 => {
                // DEFAULT_CHARSET: a default, then (char column index, collation) pairs.
                let default = f.lenenc_int()?;
                for &i in &char_cols {
                    charsets[i] = Some(default);
                }
                while !f.is_empty() {
                    let k = f.lenenc_int()? as usize;
                    let coll = f.lenenc_int()?;
                    if let Some(&i) = char_cols.get(k) {
                        charsets[i] = Some(coll);
                    }
                }
            }
            3 => {
                // COLUMN_CHARSET: one collation per character column.
                for &i in &char_cols {
                    if f.is_empty() {
                        break;
                    }
                    charsets[i] = Some(f.lenenc_int()?);
                }
            }
            4 => {
                while !f.is_empty() {
                    names.push(f.lenenc_str()?);
                }
            }
            5 | 6 => {
                let mut all = Vec::new();
                while !f.is_empty() {
                    let n = f.lenenc_int()? as usize;
                    let mut labels = Vec::with_capacity(n.min(1024));
                    for _ in 0..n {
                        labels.push(f.lenenc_str()?);
                    }
                    all.push(labels);
                }
                if field == 5 {
                    set_values = all;
                } else {
                    enum_values = all;
                }
            }
            8 => {
                while !f.is_empty() {
                    primary_key.push(f.lenenc_int()? as usize);
                }
            }
            9 => {
                while !f.is_empty() {
                    primary_key.push(f.lenenc_int()? as usize);
                    f.lenenc_int()?; // prefix length
                }
            }
            _ => {}
        }
    }
    if primary_key.iter().any(|&i| i >= count) {
        return Err(format!("table map for {db}.{table}: primary key column out of range"));
    }
    let has_names = names.len() == count;
    let mut enums = enum_values.into_iter();
    let mut sets = set_values.into_iter();
    let mut columns = Vec::with_capacity(count);
    for (i, raw) in raws.iter().enumerate() {
        let binary = charsets[i] == Some(BINARY);
        let ty = match raw.ty {
            t::TINY => ColType::Int { bytes: 1, unsigned: unsigned[i] },
            t::SHORT => ColType::Int { bytes: 2, unsigned: unsigned[i] },
            t::INT24 => ColType::Int { bytes: 3, unsigned: unsigned[i] },
            t::LONG => ColType::Int { bytes: 4, unsigned: unsigned[i] },
            t::LONGLONG => ColType::Int { bytes: 8, unsigned: unsigned[i] },
            t::YEAR => ColType::Year,
            t::FLOAT => ColType::Float,
            t::DOUBLE => ColType::Double,
            t::NEWDECIMAL => ColType::Decimal { precision: (raw.meta >> 8) as u8, scale: raw.meta as u8 },
            t::DATE | t::NEWDATE => ColType::Date,
            t::DATETIME2 => ColType::DateTime { fsp: raw.meta as u8 },
            t::TIMESTAMP2 => ColType::Timestamp { fsp: raw.meta as u8 },
            t::TIME2 => ColType::Time { fsp: raw.meta as u8 },
            t::DATETIME => ColType::DateTimeV1,
            t::TIMESTAMP => ColType::TimestampV1,
            t::TIME => ColType::TimeV1,
            t::VARCHAR | t::VAR_STRING => {
                ColType::VarString { max_len: raw.meta, binary, latin1: is_latin1(charsets[i]) }
            }
            t::STRING => ColType::Char { max_len: raw.meta, binary, latin1: is_latin1(charsets[i]) },
            t::BLOB | t::TINY_BLOB | t::MEDIUM_BLOB | t::LONG_BLOB => {
                ColType::Blob { len_bytes: raw.meta as u8, binary, latin1: is_latin1(charsets[i]) }
            }
            t::JSON => ColType::Blob { len_bytes: raw.meta as u8, binary: false, latin1: false },
            t::GEOMETRY => ColType::Blob { len_bytes: raw.meta as u8, binary: true, latin1: false },
            t::BIT => {
                let (bits, bytes) = ((raw.meta >> 8) as usize, (raw.meta & 0xff) as usize);
                ColType::Bit { bytes: bytes + usize::from(bits > 0) }
            }
            t::ENUM => ColType::Enum { pack: raw.meta as u8, labels: enums.next().unwrap_or_default() },
            t::SET => ColType::Set { pack: raw.meta as u8, labels: sets.next().unwrap_or_default() },
            other => return Err(format!("{db}.{table}: column {} has binlog type {other}, not supported", i + 1)),
        };
        let name = names.get(i).cloned().unwrap_or_else(|| format!("col{}", i + 1));
        let nullable = nulls.get(i / 8).is_some_and(|b| b & (1 << (i % 8)) != 0);
        columns.push(Column { name, ty, nullable });
    }
    Ok(TableMap { table_id, db, table, columns, primary_key, has_names })
}

fn is_latin1(coll: Option<u64>) -> bool {
    matches!(coll, Some(5 | 8 | 15 | 31 | 47 | 48 | 49 | 94))
}

/// A decoded rows event.
pub struct Rows {
    pub table_id: u64,
    pub kind: RowsKind,
    /// Each row image (for updates: before, after, before, after, ...),
    /// with `None` for columns the image leaves out.
    pub images: Vec<Vec<Option<crate::Value>>>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum RowsKind {
    Insert,
    Update,
    Delete,
}

/// Reads the table id a rows event refers to (to find its TABLE_MAP).
pub fn rows_table_id(body: &[u8]) -> Res<u64> {
    Cursor::new(body).u48()
}

pub fn rows(event_kind: u8, body: &[u8], map: &TableMap) -> Res<Rows> {
    let kind = match event_kind {
        kind::WRITE_ROWS_V1 | kind::WRITE_ROWS_V2 => RowsKind::Insert,
        kind::UPDATE_ROWS_V1 | kind::UPDATE_ROWS_V2 => RowsKind::Update,
        kind::DELETE_ROWS_V1 | kind::DELETE_ROWS_V2 => RowsKind::Delete,
        other => return Err(format!("event 0x{other:02x} is not a rows event")),
    };
    let v2 = matches!(event_kind, kind::WRITE_ROWS_V2 | kind::UPDATE_ROWS_V2 | kind::DELETE_ROWS_V2);
    let mut c = Cursor::new(body);
    let table_id = c.u48()?;
    c.skip(2)?; // flags
    if v2 {
        let extra = c.u16()? as usize;
        c.skip(extra.saturating_sub(2))?;
    }
    let count = c.lenenc_int()? as usize;
    if count != map.columns.len() {
        return Err(format!(
            "rows event for {}.{} has {count} columns, its table map {}",
            map.db,
            map.table,
            map.columns.len()
        ));
    }
    let present = c.bytes(count.div_ceil(8))?.to_vec();
    let present_after = if kind == RowsKind::Update { c.bytes(count.div_ceil(8))?.to_vec() } else { present.clone() };
    let mut images = Vec::new();
    let mut after = false;
    while !c.is_empty() {
        let bits = if after { &present_after } else { &present };
        let at = c.pos;
        images.push(image(&mut c, bits, map)?);
        if c.pos == at {
            return Err(format!("rows event for {}.{} has an empty row image", map.db, map.table));
        }
        if kind == RowsKind::Update {
            after = !after;
        }
    }
    if after {
        return Err(format!("update rows event for {}.{} ends after a before image", map.db, map.table));
    }
    Ok(Rows { table_id, kind, images })
}

fn image(c: &mut Cursor, present: &[u8], map: &TableMap) -> Res<Vec<Option<crate::Value>>> {
    let bit = |bits: &[u8], i: usize| bits.get(i / 8).is_some_and(|b| b & (1 << (i % 8)) != 0);
    let n_present = (0..map.columns.len()).filter(|&i| bit(present, i)).count();
    let nulls = c.bytes(n_present.div_ceil(8))?.to_vec();
    let mut out = Vec::with_capacity(map.columns.len());
    let mut k = 0;
    for (i, col) in map.columns.iter().enumerate() {
        if !bit(present, i) {
            out.push(None);
            continue;
        }
        let null = bit(&nulls, k);
        k += 1;
        if null {
            out.push(Some(crate::Value::Null));
            continue;
        }
        let v = crate::types::decode_binary(c, &col.ty)
            .map_err(|e| format!("{}.{} column {}: {e}", map.db, map.table, col.name))?;
        out.push(Some(v));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TABLE_MAP for `shop.items (id INT PRIMARY KEY, n VARCHAR(20), d DECIMAL(10,2))`
    /// with FULL metadata, and a write-rows event for it.
    fn samples() -> (Vec<u8>, Vec<u8>) {
        let mut map = vec![7, 0, 0, 0, 0, 0, 1, 0];
        map.extend_from_slice(&[4, b's', b'h', b'o', b'p', 0, 5, b'i', b't', b'e', b'm', b's', 0]);
        map.extend_from_slice(&[3, t::LONG, t::VARCHAR, t::NEWDECIMAL]);
        map.extend_from_slice(&[4, 20, 0, 10, 2]);
        map.push(0b110);
        map.extend_from_slice(&[4, 7, 2, b'i', b'd', 1, b'n', 1, b'd']);
        map.extend_from_slice(&[8, 1, 0]);
        let mut rows = vec![7, 0, 0, 0, 0, 0, 1, 0, 3, 0b111, 0];
        rows.extend_from_slice(&42u32.to_le_bytes());
        rows.extend_from_slice(&[3, b'a', b'b', b'c']);
        rows.extend_from_slice(&[0x80, 0x00, 0x04, 0xd2, 0x38]);
        (map, rows)
    }

    #[test]
    fn a_table_map_and_its_rows_decode() {
        let (map, rows) = samples();
        let m = table_map(&map).unwrap();
        assert_eq!((m.db.as_str(), m.table.as_str(), m.table_id), ("shop", "items", 7));
        let names: Vec<_> = m.columns.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["id", "n", "d"]);
        assert_eq!(m.primary_key, vec![0]);
        let r = super::rows(kind::WRITE_ROWS_V1, &rows, &m).unwrap();
        assert_eq!(
            r.images,
            vec![vec![
                Some(crate::Value::Int(42)),
                Some(crate::Value::Text("abc".into())),
                Some(crate::Value::Numeric("1234.56".into()))
            ]]
        );
    }

    /// Mutated, truncated and random inputs give errors, never panics.
    #[test]
    fn corrupt_events_are_errors_not_panics() {
        let (map, rows) = samples();
        let good = table_map(&map).unwrap();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for i in 0..200_000 {
            let base = if i % 2 == 0 { &map } else { &rows };
            let mut b = base.clone();
            match next() % 4 {
                0 => b.truncate((next() as usize) % (b.len() + 1)),
                1 => {
                    let at = (next() as usize) % b.len();
                    b[at] = next() as u8;
                }
                2 => b.extend((0..next() % 16).map(|_| next() as u8)),
                _ => b = (0..next() % 64).map(|_| next() as u8).collect(),
            }
            let _ = table_map(&b);
            let _ = super::rows(kind::UPDATE_ROWS_V1, &b, &good);
            let _ = super::rows(kind::WRITE_ROWS_V2, &b, &good);
            let _ = query(&b);
            let _ = split(&b, i % 3 == 0);
            let _ = crate::ddl::parse(&String::from_utf8_lossy(&b), "db");
        }
    }
}

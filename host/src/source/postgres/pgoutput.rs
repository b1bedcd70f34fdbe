//! Decoding of pgoutput messages (protocol versions 1 and 2), borrowing from
//! the frame so tuple values are not copied before they are typed.

use std::fmt;

#[derive(Debug)]
pub struct DecodeError(pub String);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "bad pgoutput message: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

/// One column of a tuple.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Datum<'a> {
    Null,
    /// An unchanged TOASTed value that the server did not send.
    Unchanged,
    Text(&'a [u8]),
    Binary(&'a [u8]),
}

#[derive(Debug, Clone, PartialEq)]
pub struct RelationColumn {
    pub key: bool,
    pub name: String,
    pub type_oid: u32,
    pub type_modifier: i32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RelationMsg {
    pub oid: u32,
    pub schema: String,
    pub name: String,
    /// `d` default, `n` nothing, `f` full, `i` index.
    pub identity: u8,
    pub columns: Vec<RelationColumn>,
}

/// Which old image an update or delete carries: `K` key only, `O` full row.
pub type OldKind = u8;

#[derive(Debug)]
pub enum PgOutput<'a> {
    Begin {
        final_lsn: u64,
        commit_time: i64,
        xid: u32,
    },
    Commit {
        commit_lsn: u64,
        end_lsn: u64,
        commit_time: i64,
    },
    Relation(RelationMsg),
    Insert {
        relation: u32,
        new: Vec<Datum<'a>>,
    },
    Update {
        relation: u32,
        old: Option<(OldKind, Vec<Datum<'a>>)>,
        new: Vec<Datum<'a>>,
    },
    Delete {
        relation: u32,
        old: (OldKind, Vec<Datum<'a>>),
    },
    Truncate {
        relations: Vec<u32>,
    },
    Message {
        transactional: bool,
        prefix: &'a str,
        content: &'a [u8],
    },
    StreamStart {
        xid: u32,
    },
    StreamStop,
    StreamCommit {
        xid: u32,
        commit_lsn: u64,
        end_lsn: u64,
        commit_time: i64,
    },
    StreamAbort {
        xid: u32,
        subxid: u32,
    },
    /// Origin, Type and anything else the stream does not need.
    Ignored(u8),
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError(format!("needed {n} more bytes, {} left", self.buf.len())));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn i16(&mut self) -> Result<i16, DecodeError> {
        let b = self.take(2)?;
        Ok(i16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn i32(&mut self) -> Result<i32, DecodeError> {
        Ok(self.u32()? as i32)
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }
    fn cstr(&mut self) -> Result<&'a str, DecodeError> {
        let end = self.buf.iter().position(|b| *b == 0).ok_or_else(|| DecodeError("unterminated string".into()))?;
        let s = std::str::from_utf8(&self.buf[..end]).map_err(|_| DecodeError("string is not UTF-8".into()))?;
        self.buf = &self.buf[end + 1..];
        Ok(s)
    }
    fn tuple(&mut self) -> Result<Vec<Datum<'a>>, DecodeError> {
        let n = self.i16()?;
        let mut out = Vec::with_capacity(n.max(0) as usize);
        for _ in 0..n {
            out.push(match self.u8()? {
                b'n' => Datum::Null,
                b'u' => Datum::Unchanged,
                kind @ (b't' | b'b') => {
                    let len = self.i32()?;
                    if len < 0 {
                        return Err(DecodeError(format!("negative value length {len}")));
                    }
                    let bytes = self.take(len as usize)?;
                    if kind == b't' {
                        Datum::Text(bytes)
                    } else {
                        Datum::Binary(bytes)
                    }
                }
                other => return Err(DecodeError(format!("unknown tuple column kind {:?}", other as char))),
            });
        }
        Ok(out)
    }
}

/// Decodes one pgoutput message. `in_stream` says whether it arrived between
/// Stream Start and Stream Stop, where data messages carry a leading xid.
/// Returns the message and that xid.
pub fn decode(buf: &[u8], in_stream: bool) -> Result<(PgOutput<'_>, Option<u32>), DecodeError> {
    let mut r = Reader { buf };
    let tag = r.u8()?;
    let has_xid = in_stream && matches!(tag, b'R' | b'Y' | b'I' | b'U' | b'D' | b'T' | b'M');
    let xid = if has_xid { Some(r.u32()?) } else { None };
    let msg = match tag {
        b'B' => PgOutput::Begin { final_lsn: r.u64()?, commit_time: r.u64()? as i64, xid: r.u32()? },
        b'C' => {
            r.u8()?;
            PgOutput::Commit { commit_lsn: r.u64()?, end_lsn: r.u64()?, commit_time: r.u64()? as i64 }
        }
        b'R' => {
            let oid = r.u32()?;
            let schema = r.cstr()?.to_string();
            let name = r.cstr()?.to_string();
            let identity = r.u8()?;
            let n = r.i16()?;
            let mut columns = Vec::with_capacity(n.max(0) as usize);
            for _ in 0..n {
                let flags = r.u8()?;
                let name = r.cstr()?.to_string();
                columns.push(RelationColumn { key: flags & 1 == 1, name, type_oid: r.u32()?, type_modifier: r.i32()? });
            }
            PgOutput::Relation(RelationMsg { oid, schema, name, identity, columns })
        }
        b'I' => {
            let relation = r.u32()?;
            match r.u8()? {
                b'N' => PgOutput::Insert { relation, new: r.tuple()? },
                other => return Err(DecodeError(format!("insert without a new tuple ({:?})", other as char))),
            }
        }
        b'U' => {
            let relation = r.u32()?;
            let mut old = None;
            let mut kind = r.u8()?;
            if kind == b'K' || kind == b'O' {
                old = Some((kind, r.tuple()?));
                kind = r.u8()?;
            }
            if kind != b'N' {
                return Err(DecodeError(format!("update without a new tuple ({:?})", kind as char)));
            }
            PgOutput::Update { relation, old, new: r.tuple()? }
        }
        b'D' => {
            let relation = r.u32()?;
            let kind = r.u8()?;
            if kind != b'K' && kind != b'O' {
                return Err(DecodeError(format!("delete without an old tuple ({:?})", kind as char)));
            }
            PgOutput::Delete { relation, old: (kind, r.tuple()?) }
        }
        b'T' => {
            let n = r.u32()?;
            r.u8()?;
            let mut relations = Vec::with_capacity(n.min(1 << 16) as usize);
            for _ in 0..n {
                relations.push(r.u32()?);
            }
            PgOutput::Truncate { relations }
        }
        b'M' => {
            let transactional = r.u8()? & 1 == 1;
            r.u64()?;
            let prefix = r.cstr()?;
            let len = r.u32()? as usize;
            PgOutput::Message { transactional, prefix, content: r.take(len)? }
        }
        b'S' => PgOutput::StreamStart { xid: r.u32()? },
        b'E' => PgOutput::StreamStop,
        b'c' => {
            let xid = r.u32()?;
            r.u8()?;
            PgOutput::StreamCommit { xid, commit_lsn: r.u64()?, end_lsn: r.u64()?, commit_time: r.u64()? as i64 }
        }
        b'A' => PgOutput::StreamAbort { xid: r.u32()?, subxid: r.u32()? },
        other => PgOutput::Ignored(other),
    };
    Ok((msg, xid))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tuple(cols: &[Option<&str>]) -> Vec<u8> {
        let mut out = (cols.len() as i16).to_be_bytes().to_vec();
        for c in cols {
            match c {
                None => out.push(b'n'),
                Some("<u>") => out.push(b'u'),
                Some(t) => {
                    out.push(b't');
                    out.extend((t.len() as i32).to_be_bytes());
                    out.extend(t.as_bytes());
                }
            }
        }
        out
    }

    #[test]
    fn update_with_old_key_in_a_stream() {
        let mut m = vec![b'U'];
        m.extend(7u32.to_be_bytes()); // xid
        m.extend(42u32.to_be_bytes());
        m.push(b'K');
        m.extend(tuple(&[Some("1"), None]));
        m.push(b'N');
        m.extend(tuple(&[Some("2"), Some("<u>")]));
        let (msg, xid) = decode(&m, true).unwrap();
        assert_eq!(xid, Some(7));
        match msg {
            PgOutput::Update { relation, old: Some((b'K', old)), new } => {
                assert_eq!(relation, 42);
                assert_eq!(old, vec![Datum::Text(b"1"), Datum::Null]);
                assert_eq!(new, vec![Datum::Text(b"2"), Datum::Unchanged]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn truncated_messages_are_errors() {
        let mut m = vec![b'I'];
        m.extend(42u32.to_be_bytes());
        m.push(b'N');
        m.extend(tuple(&[Some("hello")]));
        m.truncate(m.len() - 2);
        assert!(decode(&m, false).is_err());
        assert!(decode(b"B\0\0", false).is_err());
    }
}

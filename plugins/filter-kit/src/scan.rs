//! A JSON scanner for change objects: walks the members of an object and
//! hands out each value's raw text without parsing or allocating, so a filter
//! parses only the few values it needs. The host only sends valid JSON
//! (changes it encoded, or replacements it validated); on anything else the
//! scanner returns `None` and the caller falls back to a full parse.

#[inline(always)]
fn ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

// The scanner's inner loops are written out by hand: in a plugin, `memchr`,
// `memcmp` and iterator chains become calls and byte loops that cost several
// times their native price (measured with callgrind on the row-filter plugin).

/// Bit 7 of each byte of `w` that equals `byte` (exact for the lowest
/// match; bytes above it may show false positives, which callers ignore).
#[inline]
fn bytes_equal(w: u64, byte: u8) -> u64 {
    const LO: u64 = 0x0101_0101_0101_0101;
    const HI: u64 = 0x8080_8080_8080_8080;
    let x = w ^ (LO * byte as u64);
    x.wrapping_sub(LO) & !x & HI
}

#[inline]
fn word(b: &[u8], i: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[i..i + 8]);
    u64::from_le_bytes(w)
}

/// The index of the first `"` or `\` at or after `i`.
#[inline(always)]
fn quote_or_backslash(b: &[u8], mut i: usize) -> Option<usize> {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    {
        use core::arch::wasm32::{u8x16_bitmask, u8x16_eq, u8x16_splat, v128, v128_load, v128_or};
        while i + 16 <= b.len() {
            // SAFETY: the 16 bytes at `i` are inside `b` (checked above);
            // wasm loads need no alignment.
            let v = unsafe { v128_load(b.as_ptr().add(i) as *const v128) };
            let hits = u8x16_bitmask(v128_or(u8x16_eq(v, u8x16_splat(b'"')), u8x16_eq(v, u8x16_splat(b'\\'))));
            if hits != 0 {
                return Some(i + hits.trailing_zeros() as usize);
            }
            i += 16;
        }
    }
    while i + 8 <= b.len() {
        let w = word(b, i);
        let hits = bytes_equal(w, b'"') | bytes_equal(w, b'\\');
        if hits != 0 {
            return Some(i + hits.trailing_zeros() as usize / 8);
        }
        i += 8;
    }
    while i < b.len() {
        if matches!(b[i], b'"' | b'\\') {
            return Some(i);
        }
        i += 1;
    }
    None
}

/// Byte equality, eight bytes at a time.
#[inline]
pub fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i + 8 <= a.len() {
        if word(a, i) != word(b, i) {
            return false;
        }
        i += 8;
    }
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Whether a raw key or string body has escapes.
#[inline]
#[allow(clippy::manual_contains)] // `contains` on bytes is a memchr call: see above.
pub fn has_escape(raw: &str) -> bool {
    raw.as_bytes().iter().any(|b| *b == b'\\')
}

/// The index after the string starting at `i` (which is a quote).
#[inline(always)]
fn skip_string(b: &[u8], mut i: usize) -> Option<usize> {
    i += 1;
    loop {
        i = quote_or_backslash(b, i)?;
        if b[i] == b'"' {
            return Some(i + 1);
        }
        i += 2;
    }
}

/// The index after the value starting at `i`.
#[inline(always)]
fn skip_value(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => skip_string(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                match b[j] {
                    b'"' => {
                        j = skip_string(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            None
        }
        _ => {
            // A number or a literal: up to the next delimiter.
            let mut j = i;
            while j < b.len() && b[j] > b' ' && !matches!(b[j], b',' | b'}' | b']') {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

/// A walk over one object's members that leaves each value to the caller:
/// skip it, or take it apart and report where it ended, so nested objects are
/// walked once.
pub struct Cursor<'a> {
    text: &'a str,
    i: usize,
    closed: bool,
}

impl<'a> Cursor<'a> {
    /// A cursor on the object starting at `at` (after white space).
    pub fn enter(text: &'a str, at: usize) -> Option<Self> {
        let b = text.as_bytes();
        let i = ws(b, at);
        (b.get(i) == Some(&b'{')).then(|| Cursor { text, i: ws(b, i + 1), closed: false })
    }

    /// The next member's raw key (without quotes), leaving the cursor on its
    /// value; `Some(None)` at the end of the object (the cursor is then past
    /// its closing brace); `None` on malformed text.
    #[inline(always)]
    pub fn key(&mut self) -> Option<Option<&'a str>> {
        if self.closed {
            return Some(None);
        }
        let b = self.text.as_bytes();
        match *b.get(self.i)? {
            b'}' => {
                self.i += 1;
                self.closed = true;
                Some(None)
            }
            b'"' => {
                let key_end = skip_string(b, self.i)?;
                let key = self.text.get(self.i + 1..key_end - 1)?;
                let colon = ws(b, key_end);
                if b.get(colon) != Some(&b':') {
                    return None;
                }
                self.i = ws(b, colon + 1);
                Some(Some(key))
            }
            _ => None,
        }
    }

    /// Where the current value starts (past the object once closed).
    pub fn at(&self) -> usize {
        self.i
    }

    /// Skips the members left and the closing brace; returns the index after it.
    pub fn finish(&mut self) -> Option<usize> {
        while self.key()?.is_some() {
            self.value()?;
        }
        Some(self.i)
    }

    /// Skips the current value and returns its raw text.
    #[inline(always)]
    pub fn value(&mut self) -> Option<&'a str> {
        let start = self.i;
        let end = skip_value(self.text.as_bytes(), start)?;
        self.ended(end)?;
        self.text.get(start..end)
    }

    /// The caller read the current value up to `end`; moves to the next member.
    #[inline(always)]
    pub fn ended(&mut self, end: usize) -> Option<()> {
        let b = self.text.as_bytes();
        let i = ws(b, end);
        match *b.get(i)? {
            b',' => self.i = ws(b, i + 1),
            b'}' => self.i = i,
            _ => return None,
        }
        Some(())
    }
}

/// The members of an object, one (raw key without quotes, raw value) pair at
/// a time, allocating nothing. A key with escapes is returned as written (with
/// its backslashes). Malformed text yields `Some(Err(()))` once and then ends.
pub struct Members<'a> {
    cursor: Cursor<'a>,
    done: bool,
}

impl<'a> Members<'a> {
    /// `None` when `text` does not start (after white space) with `{`.
    pub fn of(text: &'a str) -> Option<Self> {
        Some(Members { cursor: Cursor::enter(text, 0)?, done: false })
    }

    fn step(&mut self) -> Option<Option<(&'a str, &'a str)>> {
        match self.cursor.key()? {
            None => Some(None),
            Some(key) => Some(Some((key, self.cursor.value()?))),
        }
    }
}

impl<'a> Iterator for Members<'a> {
    type Item = Result<(&'a str, &'a str), ()>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        match self.step() {
            Some(Some(member)) => Some(Ok(member)),
            Some(None) => {
                self.done = true;
                None
            }
            None => {
                self.done = true;
                Some(Err(()))
            }
        }
    }
}

/// The members of the object `text` as (raw key without quotes, raw value).
/// A key with escapes is returned as written (with its backslashes).
pub fn members(text: &str) -> Option<Vec<(&str, &str)>> {
    Members::of(text)?.collect::<Result<Vec<_>, ()>>().ok()
}

/// The raw value of member `name` of the object `text`.
pub fn member<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    Members::of(text)?.map_while(Result::ok).find(|(k, _)| *k == name).map(|(_, v)| v)
}

/// The text of a raw key (as [`members`] returns it), unescaped if needed.
pub fn key_text(raw: &str) -> Option<std::borrow::Cow<'_, str>> {
    if raw.contains('\\') {
        serde_json::from_str::<String>(&format!("\"{raw}\"")).ok().map(Into::into)
    } else {
        Some(raw.into())
    }
}

/// A row change's parts as raw JSON: `relation`, the old `key` (absent or
/// null: `None`) and the `new` row.
pub struct RowParts<'a> {
    pub relation: &'a str,
    pub key: Option<&'a str>,
    pub new: Option<&'a str>,
}

pub fn row_parts(json: &str) -> Option<RowParts<'_>> {
    Some(read_row(json, |_| None, |c| c.finish())?.parts)
}

/// A row change read in one pass: its parts, and what the caller's row
/// visitor made of the old key or row (`key`) and of the new row (`new`).
pub struct ReadRow<'a, T> {
    pub parts: RowParts<'a>,
    pub key: Option<T>,
    pub new: Option<T>,
}

/// The members of a row change that [`read_row`] looks at.
#[derive(Clone, Copy, PartialEq)]
enum Member {
    Relation,
    Key,
    New,
    Other,
}

impl Member {
    /// Compared by length first: most keys are decided without a byte compare.
    fn of(raw_key: &str) -> Member {
        let k = raw_key.as_bytes();
        match k.len() {
            3 if same(k, b"key") => Member::Key,
            3 if same(k, b"new") => Member::New,
            8 if same(k, b"relation") => Member::Relation,
            _ => Member::Other,
        }
    }
}

/// Walks a row change once. `relation` may skip the relation object itself
/// (returning where it ends); `row` is handed a cursor inside each object
/// value of `key` and `new` and may stop early; the rest of it is skipped.
fn read_row<'a, T>(
    json: &'a str,
    mut relation: impl FnMut(&mut Cursor<'a>) -> Option<usize>,
    mut row: impl FnMut(&mut Cursor<'a>) -> Option<T>,
) -> Option<ReadRow<'a, T>> {
    let mut c = Cursor::enter(json, 0)?;
    let mut out = ReadRow { parts: RowParts { relation: "{}", key: None, new: None }, key: None, new: None };
    while let Some(k) = c.key()? {
        let start = c.at();
        let object = json.as_bytes().get(start) == Some(&b'{');
        match Member::of(k) {
            Member::Relation => {
                let end = match relation(&mut c) {
                    Some(end) => end,
                    None => skip_value(json.as_bytes(), start)?,
                };
                c.ended(end)?;
                out.parts.relation = json.get(start..end)?;
            }
            role @ (Member::Key | Member::New) if object => {
                let mut inner = Cursor::enter(json, start)?;
                let seen = row(&mut inner)?;
                let end = inner.finish()?;
                c.ended(end)?;
                let raw = json.get(start..end)?;
                if role == Member::Key {
                    (out.parts.key, out.key) = (Some(raw), Some(seen));
                } else {
                    (out.parts.new, out.new) = (Some(raw), Some(seen));
                }
            }
            Member::Key => {
                let v = c.value()?;
                out.parts.key = (v != "null").then_some(v);
            }
            Member::New => out.parts.new = Some(c.value()?),
            Member::Other => {
                c.value()?;
            }
        }
    }
    Some(out)
}

/// Reads row changes like [`row_parts`], in one pass and faster for a stream
/// of them.
///
/// A row change is mostly its `relation` object and its row, and the relation
/// is the same text for every change of a table. The reader remembers the
/// last relation text; a relation with those bytes is skipped with one
/// comparison instead of being walked. (Only an object is self-delimiting by
/// its bytes: `12` is a prefix of `123`, `{..}` of nothing longer.)
#[derive(Default)]
pub struct RowReader {
    relation: std::cell::RefCell<String>,
}

impl RowReader {
    pub fn read<'a, T>(&self, json: &'a str, row: impl FnMut(&mut Cursor<'a>) -> Option<T>) -> Option<ReadRow<'a, T>> {
        read_row(
            json,
            |c| {
                let (start, b) = (c.at(), json.as_bytes());
                if b.get(start) != Some(&b'{') {
                    return None;
                }
                let mut known = self.relation.borrow_mut();
                if !known.is_empty()
                    && b.len() - start >= known.len()
                    && same(&b[start..start + known.len()], known.as_bytes())
                {
                    return Some(start + known.len());
                }
                let end = skip_value(b, start)?;
                known.clear();
                known.push_str(json.get(start..end)?);
                Some(end)
            },
            row,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walks_members_with_nesting_and_escapes() {
        let t = r#"{"tag":"update","relation":{"schema":"p","name":"t","rowKey":{"columns":["id"]}},"key":null,"new":{"id":1,"s":"a\"},{b","n":[1,{"x":2}],"f":-1.5e3}}"#;
        let m = members(t).unwrap();
        let keys: Vec<&str> = m.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, ["tag", "relation", "key", "new"]);
        assert_eq!(member(t, "key"), Some("null"));
        let new = members(member(t, "new").unwrap()).unwrap();
        assert_eq!(new[1], ("s", r#""a\"},{b""#));
        assert_eq!(new[2], ("n", r#"[1,{"x":2}]"#));
        assert_eq!(new[3], ("f", "-1.5e3"));
        assert_eq!(members(r#"{ "a" : 1 , "b":{} }"#).unwrap(), vec![("a", "1"), ("b", "{}")]);
        assert!(members("{\"a\":").is_none());
        assert!(members("[1]").is_none());
        assert_eq!(members("{}").unwrap(), vec![]);
        // Cut short right where a row would start: no part, no panic.
        assert!(row_parts(r#"{"tag":"insert","relation":{},"new":"#).is_none());
        assert!(RowReader::default().read(r#"{"tag":"insert","relation":{},"new":"#, |c| c.finish()).is_none());
    }
}

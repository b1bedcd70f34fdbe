//! A JSON scanner for change objects: walks the members of an object and
//! hands out each value's raw text without parsing or allocating, so a filter
//! parses only the few values it needs. The host only sends valid JSON
//! (changes it encoded, or replacements it validated); on anything else the
//! scanner returns `None` and the caller falls back to a full parse.
//!
//! Shared by the host (routing changes to filters, reading tags back from the
//! change log) and the filter plugins; it has no dependencies, so it builds
//! natively and for `wasm32-wasip2` alike.

/// The `tag` of a change object, read from its front (`{"tag":"insert",...`).
pub fn tag_of(json: &str) -> &str {
    // Written out for plugins: `strip_prefix` and `position` become a
    // `memcmp` call and an iterator chain there, several times the cost.
    const PREFIX: &[u8; 8] = b"{\"tag\":\"";
    let b = json.as_bytes();
    if b.len() < 8 || !same(&b[..8], PREFIX) {
        return "";
    }
    // Row changes, the bulk of a stream, by one 8-byte comparison each.
    if b.len() >= 16 {
        const ROWS: [(&[u8; 8], &str); 3] =
            [(b"insert\",", "insert"), (b"update\",", "update"), (b"delete\",", "delete")];
        for (word, tag) in ROWS {
            if same(&b[8..16], word) {
                return tag;
            }
        }
    }
    let mut end = 8;
    while end < b.len() && end < 40 {
        match b[end] {
            b'"' => return json.get(8..end).unwrap_or(""),
            b'\\' => return "",
            _ => end += 1,
        }
    }
    ""
}

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
    #[cfg(target_arch = "x86_64")]
    {
        // SSE2 is part of x86_64: the host's locator skips strings 16 bytes
        // at a time too.
        use std::arch::x86_64::{
            __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_or_si128, _mm_set1_epi8,
        };
        while i + 16 <= b.len() {
            // SAFETY: the 16 bytes at `i` are inside `b` (checked above);
            // `loadu` needs no alignment; SSE2 is always present on x86_64.
            let hits = unsafe {
                let v = _mm_loadu_si128(b.as_ptr().add(i) as *const __m128i);
                _mm_movemask_epi8(_mm_or_si128(
                    _mm_cmpeq_epi8(v, _mm_set1_epi8(b'"' as i8)),
                    _mm_cmpeq_epi8(v, _mm_set1_epi8(b'\\' as i8)),
                ))
            };
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
    #[cfg(target_arch = "x86_64")]
    {
        // The host compares remembered relation texts (about 100 bytes)
        // with each change's: 16 bytes a step.
        use std::arch::x86_64::{__m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8};
        while i + 16 <= a.len() {
            // SAFETY: both slices have 16 bytes at `i` (same length, checked
            // above); `loadu` needs no alignment; SSE2 is part of x86_64.
            let equal = unsafe {
                let x = _mm_loadu_si128(a.as_ptr().add(i) as *const __m128i);
                let y = _mm_loadu_si128(b.as_ptr().add(i) as *const __m128i);
                _mm_movemask_epi8(_mm_cmpeq_epi8(x, y))
            };
            if equal != 0xffff {
                return false;
            }
            i += 16;
        }
    }
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
            // A number or a literal: up to the next delimiter (one table
            // lookup per byte instead of four comparisons).
            let mut j = i;
            while j < b.len() && !ENDS_SCALAR[b[j] as usize] {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

/// The bytes that end a number or a literal: white space, control bytes and
/// `,` `}` `]`.
const ENDS_SCALAR: [bool; 256] = {
    let mut t = [false; 256];
    let mut c = 0;
    while c <= b' ' as usize {
        t[c] = true;
        c += 1;
    }
    t[b',' as usize] = true;
    t[b'}' as usize] = true;
    t[b']' as usize] = true;
    t
};

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
        unescape(raw).map(Into::into)
    } else {
        Some(raw.into())
    }
}

/// Four hex digits of a `\\u` escape.
fn hex4(chars: &mut std::str::Chars<'_>) -> Option<u32> {
    let digits: String = chars.take(4).collect();
    if digits.len() != 4 {
        return None;
    }
    u32::from_str_radix(&digits, 16).ok()
}

/// The text of a JSON string's contents (without its quotes); `None` for a
/// malformed escape or a lone surrogate.
pub fn unescape(raw: &str) -> Option<String> {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        let decoded = match chars.next()? {
            '"' => '"',
            '\\' => '\\',
            '/' => '/',
            'b' => '\u{8}',
            'f' => '\u{c}',
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            'u' => {
                let first = hex4(&mut chars)?;
                let code = if (0xD800..0xDC00).contains(&first) {
                    // A high surrogate: its low half must follow as \uXXXX.
                    if chars.next()? != '\\' || chars.next()? != 'u' {
                        return None;
                    }
                    let low = hex4(&mut chars)?;
                    if !(0xDC00..0xE000).contains(&low) {
                        return None;
                    }
                    0x10000 + ((first - 0xD800) << 10) + (low - 0xDC00)
                } else {
                    first
                };
                char::from_u32(code)?
            }
            _ => return None,
        };
        out.push(decoded);
    }
    Some(out)
}

/// A row change's parts as raw JSON: `relation`, the old `key` (absent or
/// null: `None`) and the `new` row.
pub struct RowParts<'a> {
    pub relation: &'a str,
    pub key: Option<&'a str>,
    pub new: Option<&'a str>,
}

pub fn row_parts(json: &str) -> Option<RowParts<'_>> {
    Some(read_row(json, |_| None, |c, _| c.finish())?.parts)
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
/// value of `key` and `new` (and whether it is `new`) and may stop early;
/// the rest of it is skipped.
fn read_row<'a, T>(
    json: &'a str,
    mut relation: impl FnMut(&mut Cursor<'a>) -> Option<usize>,
    mut row: impl FnMut(&mut Cursor<'a>, bool) -> Option<T>,
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
                let seen = row(&mut inner, role == Member::New)?;
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
/// relation texts of the last few tables; a relation with the bytes of one of
/// them is skipped with a comparison instead of being walked. (Only an object
/// is self-delimiting by its bytes: `12` is a prefix of `123`, `{..}` of
/// nothing longer.)
#[derive(Default)]
pub struct RowReader {
    relations: std::cell::RefCell<Vec<Vec<u8>>>,
}

/// The index of the quote that ends the string whose body starts at `i`;
/// `None` if it has an escape before that quote. Keys and names are short,
/// but one 16-byte step of [`quote_or_backslash`] still beats a byte loop
/// with a bounds check per byte.
#[inline(always)]
pub fn plain_string_end(b: &[u8], i: usize) -> Option<usize> {
    let end = quote_or_backslash(b, i)?;
    (b[end] == b'"').then_some(end)
}

/// At `"key":` (compact, unescaped): the key's bytes and where its value starts.
#[inline(always)]
fn compact_key(b: &[u8], i: usize) -> Option<(&[u8], usize)> {
    if *b.get(i)? != b'"' {
        return None;
    }
    let end = plain_string_end(b, i + 1)?;
    (*b.get(end + 1)? == b':').then(|| (&b[i + 1..end], end + 2))
}

/// How many relation texts a [`RowReader`] remembers (transactions that
/// touch a few tables in turn skip them all).
const RELATIONS: usize = 8;

impl RowReader {
    pub fn read<'a, T>(
        &self,
        json: &'a str,
        row: impl FnMut(&mut Cursor<'a>, bool) -> Option<T>,
    ) -> Option<ReadRow<'a, T>> {
        read_row(json, |c| self.skip_relation(json.as_bytes(), c.at()), row)
    }

    /// The index after the relation object starting at `start`: one of the
    /// remembered texts, or walked and remembered.
    fn skip_relation(&self, b: &[u8], start: usize) -> Option<usize> {
        if b.get(start) != Some(&b'{') {
            return None;
        }
        let rest = &b[start..];
        let mut known = self.relations.borrow_mut();
        if let Some(r) = known.iter().find(|r| rest.len() >= r.len() && same(&rest[..r.len()], r)) {
            return Some(start + r.len());
        }
        let end = skip_value(b, start)?;
        if known.len() == RELATIONS {
            known.remove(0);
        }
        known.push(b[start..end].to_vec());
        Some(end)
    }
}

/// Finds where the values of a few columns are in row changes: what the host
/// passes a filter that names `row-columns` (`batch.spans` in the WIT), so
/// the plugin reads those values without walking the JSON itself.
///
/// For each change, four numbers per column: for each column in order, the
/// start and end byte offsets of its raw value in the `new` row, then the same
/// in the `key` (old key or old row); `0, 0` where the change has no such row
/// or the row lacks the column (a value never starts at offset 0: the change
/// does, with `{`). Changes that are not row changes, and text the scanner
/// cannot read, get zeros only.
pub struct ColumnLocator {
    columns: Vec<String>,
    reader: RowReader,
}

impl ColumnLocator {
    pub fn new(columns: Vec<String>) -> Self {
        ColumnLocator { columns, reader: RowReader::default() }
    }

    pub fn columns(&self) -> &[String] {
        &self.columns
    }

    /// Appends the spans of `json` (a change object) to `out`.
    pub fn locate(&self, json: &str, out: &mut Vec<u32>) {
        let k = self.columns.len();
        let base = out.len();
        out.resize(base + 4 * k, 0);
        if k == 0 {
            return;
        }
        let spans = &mut out[base..];
        if self.locate_compact(json, spans).is_none() {
            spans.fill(0);
            self.locate_general(json, spans);
        }
    }

    /// The fast path, for text as the host's encoder writes it: no white
    /// space and no escapes in keys. `None` on anything else (the general
    /// path then reads it).
    fn locate_compact(&self, json: &str, spans: &mut [u32]) -> Option<()> {
        let k = self.columns.len();
        // Row tags are read by word comparison; other tags have no rows.
        let tag = tag_of(json);
        if !matches!(tag, "insert" | "update" | "delete") {
            return if tag.is_empty() { None } else { Some(()) };
        }
        let b = json.as_bytes();
        let mut i = 8 + tag.len() + 1;
        loop {
            match *b.get(i)? {
                b',' => i += 1,
                b'}' => return Some(()),
                _ => return None,
            }
            let (key, value) = compact_key(b, i)?;
            i = match key {
                b"relation" => self.reader.skip_relation(b, value)?,
                b"new" | b"key" if b.get(value) == Some(&b'{') => {
                    let half = if key == b"new" { 0 } else { 2 * k };
                    self.walk_row(b, value, &mut spans[half..half + 2 * k])?
                }
                _ => skip_value(b, value)?,
            };
        }
    }

    /// Records the spans of a compact row object starting at `i`; returns
    /// the index after it.
    fn walk_row(&self, b: &[u8], mut i: usize, spans: &mut [u32]) -> Option<usize> {
        i += 1;
        if *b.get(i)? == b'}' {
            return Some(i + 1);
        }
        loop {
            let (key, value) = compact_key(b, i)?;
            let end = skip_value(b, value)?;
            if let Some(c) = self.columns.iter().position(|c| same(c.as_bytes(), key)) {
                record(spans, c, value, end);
            }
            i = end + 1;
            match *b.get(end)? {
                b',' => {}
                b'}' => return Some(i),
                _ => return None,
            }
        }
    }

    /// Any JSON text: white space, escaped keys, members in any order.
    fn locate_general(&self, json: &str, spans: &mut [u32]) {
        let k = self.columns.len();
        if !matches!(tag_of(json), "insert" | "update" | "delete") {
            return;
        }
        let read = self.reader.read(json, |row, new| {
            let half = if new { 0 } else { 2 * k };
            let mut found = 0;
            while let Some(key) = row.key()? {
                let start = row.at();
                let value = row.value()?;
                let Some(i) = self.index_of(key) else { continue };
                if record(&mut spans[half..], i, start, start + value.len()) {
                    found += 1;
                    if found == k {
                        break;
                    }
                }
            }
            Some(())
        });
        if read.is_none() {
            spans.fill(0);
        }
    }

    #[inline(always)]
    fn index_of(&self, raw_key: &str) -> Option<usize> {
        let at = self.columns.iter().position(|c| same(c.as_bytes(), raw_key.as_bytes()));
        if at.is_some() || !has_escape(raw_key) {
            return at;
        }
        let key = key_text(raw_key)?;
        self.columns.iter().position(|c| *c == *key)
    }
}

/// Records where column `i`'s value is, unless the row named it before (the
/// first member of a name counts); whether it did.
#[inline(always)]
fn record(spans: &mut [u32], i: usize, start: usize, end: usize) -> bool {
    if spans[2 * i + 1] != 0 {
        return false;
    }
    spans[2 * i] = start as u32;
    spans[2 * i + 1] = end as u32;
    true
}

/// The raw value a span pair points at (`spans[2 * i]`, `spans[2 * i + 1]`),
/// or `None` for `0, 0` and for pairs outside the text.
#[inline(always)]
pub fn spanned<'a>(json: &'a str, spans: &[u32], i: usize) -> Option<&'a str> {
    let (start, end) = (*spans.get(2 * i)? as usize, *spans.get(2 * i + 1)? as usize);
    if end == 0 {
        return None;
    }
    json.get(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unescapes_like_json() {
        assert_eq!(unescape(r#"a\"b\\c\/\n\t"#).as_deref(), Some("a\"b\\c/\n\t"));
        assert_eq!(unescape(r"\u00e9\u20ac").as_deref(), Some("\u{e9}\u{20ac}"));
        assert_eq!(unescape(r"\ud83d\ude00").as_deref(), Some("\u{1f600}"), "a surrogate pair");
        assert_eq!(unescape(r"\ud83d"), None, "a lone high surrogate");
        assert_eq!(unescape(r"\x"), None);
        assert_eq!(unescape(r"\u12"), None);
        assert_eq!(key_text(r#"a\"b"#).as_deref(), Some("a\"b"));
    }

    #[test]
    fn tags_are_read_from_the_front() {
        assert_eq!(tag_of(r#"{"tag":"insert","relation":{}}"#), "insert");
        assert_eq!(tag_of(r#"{"tag":"create-table","spec":{}}"#), "create-table");
        assert_eq!(tag_of(r#"{"relation":{},"tag":"insert"}"#), "", "not at the front");
    }

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
        assert!(RowReader::default().read(r#"{"tag":"insert","relation":{},"new":"#, |c, _| c.finish()).is_none());
    }

    #[test]
    fn the_locator_finds_values_in_new_and_old_rows() {
        let loc = ColumnLocator::new(vec!["n".into(), "a\"b".into(), "gone".into()]);
        let t = r#"{"tag":"update","relation":{"schema":"p","name":"t"},"key":{"n":1,"x":[1,{"n":9}]},"new":{"s":"n\"","a\"b":"q","n":-2.5e1}}"#;
        let mut spans = vec![7];
        loc.locate(t, &mut spans);
        assert_eq!(spans.len(), 1 + 12, "four numbers per column, appended");
        let s = &spans[1..];
        let (new, old) = (&s[..6], &s[6..]);
        assert_eq!(spanned(t, new, 0), Some("-2.5e1"));
        assert_eq!(spanned(t, new, 1), Some("\"q\""), "a key with an escape matches its text");
        assert_eq!(spanned(t, new, 2), None);
        assert_eq!(spanned(t, old, 0), Some("1"), "a nested member of the same name is not the column");
        assert_eq!(spanned(t, old, 1), None);
        // Not a row change, a null key, malformed text: zeros.
        for other in [r#"{"tag":"truncate","relations":[]}"#, r#"{"tag":"insert","relation":{},"new":{"n":"#] {
            let mut spans = Vec::new();
            loc.locate(other, &mut spans);
            assert_eq!(spans, vec![0; 12], "{other}");
        }
        let mut spans = Vec::new();
        loc.locate(r#"{"tag":"update","relation":{},"key":null,"new":{"n":3}}"#, &mut spans);
        assert_eq!((spans[0], spans[1], spans[6], spans[7]), (52, 53, 0, 0));
    }

    #[test]
    fn the_fast_and_the_general_locator_agree() {
        let loc = ColumnLocator::new(vec!["n".into(), "s".into()]);
        let rel = |t: &str| format!(r#"{{"schema":"p","name":"{t}","rowKey":{{"columns":["n"]}}}}"#);
        let changes = [
            format!(r#"{{"tag":"insert","relation":{},"new":{{"n":1,"s":"a\"b","x":{{"n":2}}}}}}"#, rel("a")),
            format!(r#"{{"tag":"delete","relation":{},"key":{{"s":null,"n":-1}}}}"#, rel("b")),
            // The same relation texts again (remembered), in turn.
            format!(r#"{{"tag":"update","relation":{},"key":{{"n":5}},"new":{{"s":"z","n":6}}}}"#, rel("a")),
            format!(r#"{{"tag":"insert","relation":{},"new":{{}}}}"#, rel("b")),
            format!(r#"{{"tag":"insert","relation":{},"new":{{"n":1,"n":2}}}}"#, rel("a")),
            format!(r#"{{"tag":"insert","relation":{},"new":null}}"#, rel("a")),
            r#"{"tag":"create-table","spec":{"n":1}}"#.to_string(),
        ];
        for change in &changes {
            let mut fast = Vec::new();
            loc.locate(change, &mut fast);
            let mut general = vec![0; 8];
            loc.locate_general(change, &mut general);
            assert_eq!(fast, general, "{change}");
            // White space takes the general path, to the same values.
            let spaced = change.replacen(r#""new":"#, r#""new" : "#, 1).replacen(r#""key":"#, r#""key" :"#, 1);
            let mut slow = Vec::new();
            loc.locate(&spaced, &mut slow);
            let values = |t: &str, s: &[u32]| (0..4).map(|i| spanned(t, s, i).map(str::to_string)).collect::<Vec<_>>();
            assert_eq!(values(change, &fast), values(&spaced, &slow), "{spaced}");
        }
        let mut spans = Vec::new();
        loc.locate(&changes[0], &mut spans);
        assert_eq!(spanned(&changes[0], &spans, 1), Some("\"a\\\"b\""));
        assert_eq!(spanned(&changes[0], &spans, 0), Some("1"), "the first member named n, not a nested one");
    }
}

//! A JSON scanner for change objects: walks the members of an object and
//! hands out each value's raw text without parsing or allocating, so a filter
//! parses only the few values it needs. The host only sends valid JSON
//! (changes it encoded, or replacements it validated); on anything else the
//! scanner returns `None` and the caller falls back to a full parse.

fn ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

/// The index after the string starting at `i` (which is a quote).
fn skip_string(b: &[u8], mut i: usize) -> Option<usize> {
    i += 1;
    while i < b.len() {
        match b[i] {
            b'"' => return Some(i + 1),
            b'\\' => i += 2,
            _ => i += 1,
        }
    }
    None
}

/// The index after the value starting at `i`.
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
            let mut j = i;
            while j < b.len() && !matches!(b[j], b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

/// The members of the object `text` as (raw key without quotes, raw value).
/// A key with escapes is returned as written (with its backslashes).
pub fn members(text: &str) -> Option<Vec<(&str, &str)>> {
    let b = text.as_bytes();
    let mut i = ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i = ws(b, i + 1);
    let mut out = Vec::new();
    if b.get(i) == Some(&b'}') {
        return Some(out);
    }
    loop {
        if b.get(i) != Some(&b'"') {
            return None;
        }
        let key_end = skip_string(b, i)?;
        let key = text.get(i + 1..key_end - 1)?;
        i = ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        let start = ws(b, i + 1);
        let end = skip_value(b, start)?;
        out.push((key, text.get(start..end)?));
        i = ws(b, end);
        match b.get(i) {
            Some(b',') => i = ws(b, i + 1),
            Some(b'}') => return Some(out),
            _ => return None,
        }
    }
}

/// The raw value of member `name` of the object `text`.
pub fn member<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    members(text)?.into_iter().find(|(k, _)| *k == name).map(|(_, v)| v)
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
    let mut p = RowParts { relation: "{}", key: None, new: None };
    for (k, v) in members(json)? {
        match k {
            "relation" => p.relation = v,
            "key" if v != "null" => p.key = Some(v),
            "new" => p.new = Some(v),
            _ => {}
        }
    }
    Some(p)
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
    }
}

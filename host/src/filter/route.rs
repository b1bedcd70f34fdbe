//! Which table a change object is about, read from the front of its JSON
//! without parsing the rest. The encoder writes row changes as
//! `{"tag":"insert","relation":{"schema":"S","name":"N",...` and replays them
//! byte for byte, so the fast path covers every row change; anything else
//! (schema changes, truncate, names with escapes) goes to the filter.

#[derive(Clone, Copy)]
pub enum Route<'a> {
    /// An insert, update or delete of `schema.name`.
    Row {
        tag: &'a str,
        schema: &'a str,
        name: &'a str,
    },
    Other,
}

/// A JSON string's contents up to its closing quote, if it has no escapes.
fn plain_string(s: &str) -> Option<(&str, &str)> {
    let end = json_scan::plain_string_end(s.as_bytes(), 0)?;
    Some((s.get(..end)?, s.get(end + 1..)?))
}

pub fn route(inner: &str) -> Route<'_> {
    let row = || -> Option<Route<'_>> {
        // Row tags by word comparison (`json_scan::tag_of`), then the
        // relation's names where the encoder puts them.
        let tag = json_scan::tag_of(inner);
        if !matches!(tag, "insert" | "update" | "delete") {
            return None;
        }
        const RELATION: &[u8] = b"\",\"relation\":{\"schema\":\"";
        let at = 8 + tag.len();
        let rest = inner.get(at..)?;
        if rest.len() < RELATION.len() || !json_scan::same(&rest.as_bytes()[..RELATION.len()], RELATION) {
            return None;
        }
        let (schema, rest) = plain_string(&rest[RELATION.len()..])?;
        let (name, _) = plain_string(rest.strip_prefix(",\"name\":\"")?)?;
        Some(Route::Row { tag, schema, name })
    };
    row().unwrap_or(Route::Other)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_route_by_table() {
        let insert = r#"{"tag":"insert","relation":{"schema":"public","name":"items","rowKey":{}},"new":{}}"#;
        assert!(matches!(route(insert), Route::Row { tag: "insert", schema: "public", name: "items" }));
        let escaped = r#"{"tag":"delete","relation":{"schema":"pub\"lic","name":"x"},"key":{}}"#;
        assert!(matches!(route(escaped), Route::Other));
        let ddl = r#"{"tag":"create-table","spec":{"schema":"public","name":"t"}}"#;
        assert!(matches!(route(ddl), Route::Other));
    }
}

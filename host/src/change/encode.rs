//! Encoding source messages into canonical JSON, once per change.

use std::collections::HashMap;
use std::sync::Arc;

use super::json::{self, push_str};
use super::{finish_tuple, Change, Kind};
use crate::source::model::{
    ColumnSpec, Control, KeyType, Message, Relation, SchemaChange, SortOrder, TableName, Value,
};

/// A message after encoding.
#[derive(Debug)]
pub enum Event {
    /// Part of a transaction (begin, commit, rollback, data or schema change).
    Change(Change),
    /// A status from the source (acked upstream when `ack`, never stored).
    Status {
        watermark: String,
        ack: bool,
    },
    Control(Control),
    /// A relation was declared; nothing to store or forward.
    Declared,
}

/// A message the source sent that cannot be encoded. The source is at fault;
/// the text names the message and the cause.
#[derive(Debug, thiserror::Error)]
#[error("bad message from source: {0}")]
pub struct EncodeError(pub String);

/// A relation declared by the source, with its JSON pre-rendered once.
struct DeclaredRelation {
    /// `schema.name`, for error messages.
    display: String,
    /// `{"schema":..,"name":..,"rowKey":{...},...}`
    json: String,
    /// Each column name as a JSON key with its colon: `"id":`.
    column_keys: Vec<String>,
}

/// Turns one stream's messages into [`Change`]s. Holds the relations the
/// stream declared, so it lives exactly as long as one open stream.
#[derive(Default)]
pub struct Encoder {
    relations: HashMap<u32, DeclaredRelation>,
    buf: String,
}

impl Encoder {
    pub fn encode(&mut self, msg: Message) -> Result<Event, EncodeError> {
        let mut out = std::mem::take(&mut self.buf);
        out.clear();
        let (kind, tag, head) = match &msg {
            Message::Relation(r) => {
                self.declare(r);
                self.buf = out;
                return Ok(Event::Declared);
            }
            Message::Status(s) => {
                self.buf = out;
                return Ok(Event::Status { watermark: s.watermark.clone(), ack: s.ack });
            }
            Message::Control(c) => {
                self.buf = out;
                return Ok(Event::Control(c.clone()));
            }
            Message::Begin(_) => (Kind::Begin, "begin", "[\"begin\","),
            Message::Commit(_) => (Kind::Commit, "commit", "[\"commit\","),
            Message::Rollback => (Kind::Rollback, "rollback", "[\"rollback\","),
            Message::Insert(_) => (Kind::Data, "insert", "[\"data\","),
            Message::Update(_) => (Kind::Data, "update", "[\"data\","),
            Message::Delete(_) => (Kind::Data, "delete", "[\"data\","),
            Message::Truncate(_) => (Kind::Data, "truncate", "[\"data\","),
            Message::Schema(s) => (Kind::Data, schema_tag(s), "[\"data\","),
        };
        out.push_str(head);
        let start = out.len();
        out.push_str("{\"tag\":\"");
        out.push_str(tag);
        out.push('"');
        let watermark = match &msg {
            Message::Begin(b) => {
                push_extra(&mut out, b.extra.as_deref(), "begin")?;
                Some(b.commit_watermark.as_str())
            }
            Message::Commit(c) => {
                push_extra(&mut out, c.extra.as_deref(), "commit")?;
                Some(c.watermark.as_str())
            }
            Message::Rollback => None,
            Message::Insert(i) => {
                let rel = self.relation(i.relation, tag)?;
                out.push_str(",\"relation\":");
                out.push_str(&rel.json);
                out.push_str(",\"new\":");
                push_row(&mut out, rel, &i.new, "new")?;
                None
            }
            Message::Update(u) => {
                let rel = self.relation(u.relation, tag)?;
                out.push_str(",\"relation\":");
                out.push_str(&rel.json);
                out.push_str(",\"key\":");
                match &u.old {
                    Some(old) => push_row(&mut out, rel, old, "old")?,
                    None => out.push_str("null"),
                }
                out.push_str(",\"new\":");
                push_row(&mut out, rel, &u.new, "new")?;
                None
            }
            Message::Delete(d) => {
                let rel = self.relation(d.relation, tag)?;
                out.push_str(",\"relation\":");
                out.push_str(&rel.json);
                out.push_str(",\"key\":");
                push_row(&mut out, rel, &d.old, "old")?;
                None
            }
            Message::Truncate(t) => {
                out.push_str(",\"relations\":[");
                for (i, id) in t.relations.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&self.relation(*id, tag)?.json);
                }
                out.push(']');
                None
            }
            Message::Schema(s) => {
                push_schema_change(&mut out, s)?;
                None
            }
            Message::Relation(_) | Message::Status(_) | Message::Control(_) => unreachable!(),
        };
        out.push('}');
        let end = out.len();
        finish_tuple(&mut out, kind, watermark.unwrap_or(""));
        let json: Arc<str> = Arc::from(out.as_str());
        self.buf = out;
        Ok(Event::Change(Change { kind, tag, json, inner: start..end }))
    }

    fn declare(&mut self, r: &Relation) {
        let mut json = String::with_capacity(64);
        json.push_str("{\"schema\":");
        push_str(&mut json, &r.schema);
        json.push_str(",\"name\":");
        push_str(&mut json, &r.name);
        json.push_str(",\"rowKey\":{\"columns\":");
        push_str_list(&mut json, &r.key_columns);
        json.push_str(",\"type\":\"");
        json.push_str(key_type(r.key_type));
        json.push_str("\"}}");
        let column_keys = r
            .columns
            .iter()
            .map(|c| {
                let mut k = String::with_capacity(c.len() + 3);
                push_str(&mut k, c);
                k.push(':');
                k
            })
            .collect();
        self.relations
            .insert(r.id, DeclaredRelation { display: format!("{}.{}", r.schema, r.name), json, column_keys });
    }

    fn relation(&self, id: u32, tag: &str) -> Result<&DeclaredRelation, EncodeError> {
        self.relations
            .get(&id)
            .ok_or_else(|| EncodeError(format!("{tag} refers to relation {id}, which the stream never declared")))
    }
}

fn key_type(k: KeyType) -> &'static str {
    match k {
        KeyType::Default => "default",
        KeyType::Nothing => "nothing",
        KeyType::Full => "full",
        KeyType::Index => "index",
    }
}

fn push_extra(out: &mut String, extra: Option<&str>, what: &str) -> Result<(), EncodeError> {
    if let Some(text) = extra {
        let members = json::object_members(text).map_err(|e| EncodeError(format!("{what}.extra: {e}")))?;
        if !members.is_empty() {
            out.push(',');
            out.push_str(members);
        }
    }
    Ok(())
}

fn push_row(out: &mut String, rel: &DeclaredRelation, values: &[Value], what: &str) -> Result<(), EncodeError> {
    if values.len() != rel.column_keys.len() {
        return Err(EncodeError(format!(
            "{what} row for {} has {} values but the relation declares {} columns",
            rel.display,
            values.len(),
            rel.column_keys.len()
        )));
    }
    out.push('{');
    let mut first = true;
    for (key, value) in rel.column_keys.iter().zip(values) {
        if matches!(value, Value::Absent) {
            continue;
        }
        if !first {
            out.push(',');
        }
        first = false;
        out.push_str(key);
        push_value(out, value).map_err(|e| {
            EncodeError(format!("{what} row for {}, column {}: {e}", rel.display, key.trim_end_matches(':')))
        })?;
    }
    out.push('}');
    Ok(())
}

fn push_value(out: &mut String, v: &Value) -> Result<(), String> {
    match v {
        Value::Null | Value::Absent => out.push_str("null"),
        Value::Boolean(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Int(i) => json::push_i64(out, *i),
        Value::Uint(u) => json::push_u64(out, *u),
        Value::Float(f) => json::push_f64(out, *f),
        Value::Numeric(n) => out.push_str(json::number(n)?),
        Value::Text(s) | Value::Other(s) => push_str(out, s),
        Value::Bytes(b) => {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.reserve(b.len() * 2 + 6);
            out.push_str("\"\\\\x");
            for byte in b {
                out.push(HEX[(byte >> 4) as usize] as char);
                out.push(HEX[(byte & 15) as usize] as char);
            }
            out.push('"');
        }
        Value::Json(text) => out.push_str(json::validate(text)?),
    }
    Ok(())
}

fn push_str_list(out: &mut String, items: &[String]) {
    out.push('[');
    for (i, s) in items.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_str(out, s);
    }
    out.push(']');
}

/// Zero's tag of a schema change.
pub fn schema_tag(s: &SchemaChange) -> &'static str {
    match s {
        SchemaChange::CreateTable(_) => "create-table",
        SchemaChange::RenameTable(_) => "rename-table",
        SchemaChange::AddColumn(_) => "add-column",
        SchemaChange::UpdateColumn(_) => "update-column",
        SchemaChange::DropColumn(_) => "drop-column",
        SchemaChange::DropTable(_) => "drop-table",
        SchemaChange::CreateIndex(_) => "create-index",
        SchemaChange::DropIndex(_) => "drop-index",
        SchemaChange::UpdateTableMetadata(_) => "update-table-metadata",
    }
}

fn push_table_name(out: &mut String, t: &TableName) {
    out.push_str("{\"schema\":");
    push_str(out, &t.schema);
    out.push_str(",\"name\":");
    push_str(out, &t.name);
    out.push('}');
}

/// `{"pos":1,"dataType":"int8",...}`: Zero's ColumnSpec, without the name.
fn push_column_spec(out: &mut String, c: &ColumnSpec) {
    out.push_str("{\"pos\":");
    json::push_i64(out, c.pos.into());
    out.push_str(",\"dataType\":");
    push_str(out, &c.data_type);
    if let Some(class) = &c.pg_type_class {
        out.push_str(",\"pgTypeClass\":");
        push_str(out, class);
    }
    if let Some(class) = &c.elem_pg_type_class {
        out.push_str(",\"elemPgTypeClass\":");
        push_str(out, class);
    }
    if let Some(len) = c.character_max_length {
        out.push_str(",\"characterMaximumLength\":");
        json::push_i64(out, len.into());
    }
    if let Some(nn) = c.not_null {
        out.push_str(if nn { ",\"notNull\":true" } else { ",\"notNull\":false" });
    }
    if let Some(d) = &c.default {
        out.push_str(",\"dflt\":");
        push_str(out, d);
    }
    out.push('}');
}

/// `{"name":"c","spec":{...}}`
fn push_named_column(out: &mut String, c: &ColumnSpec) {
    out.push_str("{\"name\":");
    push_str(out, &c.name);
    out.push_str(",\"spec\":");
    push_column_spec(out, c);
    out.push('}');
}

fn push_metadata(out: &mut String, key: &str, text: Option<&str>) -> Result<(), EncodeError> {
    if let Some(text) = text {
        let doc = json::validate(text).map_err(|e| EncodeError(format!("{key}: {e}")))?;
        if !doc.starts_with('{') {
            return Err(EncodeError(format!("{key}: expected a JSON object")));
        }
        out.push_str(",\"");
        out.push_str(key);
        out.push_str("\":");
        out.push_str(doc);
    }
    Ok(())
}

fn push_schema_change(out: &mut String, s: &SchemaChange) -> Result<(), EncodeError> {
    match s {
        SchemaChange::CreateTable(t) => {
            out.push_str(",\"spec\":{\"schema\":");
            push_str(out, &t.spec.schema);
            out.push_str(",\"name\":");
            push_str(out, &t.spec.name);
            out.push_str(",\"columns\":{");
            for (i, c) in t.spec.columns.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                push_str(out, &c.name);
                out.push(':');
                push_column_spec(out, c);
            }
            out.push('}');
            if let Some(pk) = &t.spec.primary_key {
                out.push_str(",\"primaryKey\":");
                push_str_list(out, pk);
            }
            out.push('}');
            push_metadata(out, "metadata", t.metadata.as_deref())?;
        }
        SchemaChange::RenameTable(r) => {
            out.push_str(",\"old\":");
            push_table_name(out, &r.old);
            out.push_str(",\"new\":");
            push_table_name(out, &r.new);
        }
        SchemaChange::AddColumn(a) => {
            out.push_str(",\"table\":");
            push_table_name(out, &a.table);
            out.push_str(",\"column\":");
            push_named_column(out, &a.column);
            push_metadata(out, "tableMetadata", a.table_metadata.as_deref())?;
        }
        SchemaChange::UpdateColumn(u) => {
            out.push_str(",\"table\":");
            push_table_name(out, &u.table);
            out.push_str(",\"old\":");
            push_named_column(out, &u.old);
            out.push_str(",\"new\":");
            push_named_column(out, &u.new);
        }
        SchemaChange::DropColumn(d) => {
            out.push_str(",\"table\":");
            push_table_name(out, &d.table);
            out.push_str(",\"column\":");
            push_str(out, &d.column);
        }
        SchemaChange::DropTable(t) => {
            out.push_str(",\"id\":");
            push_table_name(out, t);
        }
        SchemaChange::CreateIndex(ix) => {
            out.push_str(",\"spec\":{\"schema\":");
            push_str(out, &ix.schema);
            out.push_str(",\"name\":");
            push_str(out, &ix.name);
            out.push_str(",\"tableName\":");
            push_str(out, &ix.table_name);
            out.push_str(if ix.unique { ",\"unique\":true" } else { ",\"unique\":false" });
            out.push_str(",\"columns\":{");
            for (i, (col, order)) in ix.columns.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                push_str(out, col);
                out.push_str(match order {
                    SortOrder::Asc => ":\"ASC\"",
                    SortOrder::Desc => ":\"DESC\"",
                });
            }
            out.push_str("}}");
        }
        SchemaChange::DropIndex(t) => {
            out.push_str(",\"id\":");
            push_table_name(out, t);
        }
        SchemaChange::UpdateTableMetadata(u) => {
            out.push_str(",\"table\":");
            push_table_name(out, &u.table);
            push_metadata(out, "old", Some(&u.old))?;
            push_metadata(out, "new", Some(&u.new))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::model::{Begin, Commit, Insert, Update};

    fn rel() -> Message {
        Message::Relation(Relation {
            id: 3,
            schema: "public".into(),
            name: "users".into(),
            columns: vec!["id".into(), "big".into(), "name".into(), "doc".into()],
            key_columns: vec!["id".into()],
            key_type: KeyType::Default,
        })
    }

    fn change(e: Event) -> Change {
        match e {
            Event::Change(c) => c,
            other => panic!("expected a change, got {other:?}"),
        }
    }

    #[test]
    fn encodes_zero_shaped_tuples() {
        let mut enc = Encoder::default();
        assert!(matches!(enc.encode(rel()).unwrap(), Event::Declared));
        let b = change(
            enc.encode(Message::Begin(Begin { commit_watermark: "0b".into(), extra: Some("{\"xid\":7}".into()) }))
                .unwrap(),
        );
        assert_eq!(&*b.json, "[\"begin\",{\"tag\":\"begin\",\"xid\":7},{\"commitWatermark\":\"0b\"}]");
        assert_eq!(b.stored(), "{\"tag\":\"begin\",\"xid\":7}");
        let i = change(
            enc.encode(Message::Insert(Insert {
                relation: 3,
                new: vec![
                    Value::Int(1),
                    Value::Int(987654321987654321),
                    Value::Text("a\"b".into()),
                    Value::Json("{\"k\": [1, 2]}".into()),
                ],
            }))
            .unwrap(),
        );
        assert_eq!(
            &*i.json,
            "[\"data\",{\"tag\":\"insert\",\"relation\":{\"schema\":\"public\",\"name\":\"users\",\
             \"rowKey\":{\"columns\":[\"id\"],\"type\":\"default\"}},\
             \"new\":{\"id\":1,\"big\":987654321987654321,\"name\":\"a\\\"b\",\"doc\":{\"k\": [1, 2]}}}]"
        );
        let u = change(
            enc.encode(Message::Update(Update {
                relation: 3,
                old: Some(vec![Value::Int(0), Value::Absent, Value::Absent, Value::Absent]),
                new: vec![Value::Int(1), Value::Null, Value::Absent, Value::Bytes(vec![0, 255])],
            }))
            .unwrap(),
        );
        assert!(
            u.json.contains("\"key\":{\"id\":0},\"new\":{\"id\":1,\"big\":null,\"doc\":\"\\\\x00ff\"}"),
            "{}",
            u.json
        );
        let c = change(enc.encode(Message::Commit(Commit { watermark: "0b".into(), extra: None })).unwrap());
        assert_eq!(&*c.json, "[\"commit\",{\"tag\":\"commit\"},{\"watermark\":\"0b\"}]");
        // Everything parses as JSON, and replaying the stored part gives the same bytes.
        for ch in [&b, &i, &u, &c] {
            serde_json::from_str::<serde_json::Value>(&ch.json).unwrap();
            let replayed = Change::from_stored(ch.tag, ch.stored(), "0b");
            assert_eq!(replayed.json, ch.json);
        }
    }

    #[test]
    fn rejects_bad_messages_with_a_reason() {
        let mut enc = Encoder::default();
        let err = enc.encode(Message::Insert(Insert { relation: 9, new: vec![] })).unwrap_err();
        assert!(err.to_string().contains("relation 9"), "{err}");
        enc.encode(rel()).unwrap();
        let err = enc.encode(Message::Insert(Insert { relation: 3, new: vec![Value::Int(1)] })).unwrap_err();
        assert!(err.to_string().contains("has 1 values but the relation declares 4 columns"), "{err}");
        let err = enc
            .encode(Message::Insert(Insert {
                relation: 3,
                new: vec![Value::Int(1), Value::Numeric("1e".into()), Value::Null, Value::Null],
            }))
            .unwrap_err();
        assert!(err.to_string().contains("column \"big\""), "{err}");
        let err =
            enc.encode(Message::Begin(Begin { commit_watermark: "01".into(), extra: Some("[1]".into()) })).unwrap_err();
        assert!(err.to_string().contains("begin.extra"), "{err}");
    }
}

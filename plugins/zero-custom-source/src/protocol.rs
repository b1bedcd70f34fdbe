//! Zero's custom change-source protocol: one `ChangeStreamMessage` per text
//! frame (`["begin", {...}, {"commitWatermark": ...}]`, `["data", {...}]`,
//! ...), turned into the host's WIT messages.
//!
//! Rows arrive as JSON objects keyed by column name; the WIT wants positional
//! rows of a declared relation. Each distinct relation object gets an id, its
//! columns grow as rows name new ones (the relation is then declared again),
//! and a column a row does not mention is `absent`, never NULL. Values are
//! classified from their JSON text: nested JSON and numbers too big for 64
//! bits pass on verbatim, so nothing is rounded or re-encoded.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use sluice_plugin_sdk::types::{
    AddColumn, Begin, ColumnSpec, Commit, Control, CreateTable, Delete, DropColumn, IndexSpec, Insert, KeyType,
    Message, Relation, RenameTable, SchemaChange, SortOrder, TableName, TableSpec, Truncate, Update, UpdateColumn,
    UpdateTableMetadata, Value,
};

/// Distinct relation objects remembered per connection.
const MAX_RELATIONS: usize = 4096;

/// Why a frame was refused. `unsupported` marks features Zero's custom
/// sources do not have either (backfill): retrying cannot help.
#[derive(Debug)]
pub struct FrameError {
    pub message: String,
    pub unsupported: bool,
}

fn bad(message: impl Into<String>) -> FrameError {
    FrameError { message: message.into(), unsupported: false }
}

fn json_err(what: &str, e: serde_json::Error) -> FrameError {
    bad(format!("{what}: {e}"))
}

/// What a frame was, for the stream's protocol-order checks.
#[derive(Debug, PartialEq)]
pub enum Kind {
    Begin { watermark: String, skip_ack: bool },
    Commit { watermark: String },
    Rollback,
    Change,
    Status { watermark: String, ack: bool },
    ResetRequired,
}

/// Relation ids and their columns, for one connection.
#[derive(Default)]
pub struct Converter {
    /// Relation objects' JSON texts (as the upstream wrote them) to ids, so a
    /// row of a known table costs a lookup, not a parse.
    ids: HashMap<String, u32>,
    tables: Vec<Relation>,
}

impl Converter {
    /// Converts one frame, appending its WIT messages to `out`.
    pub fn convert(&mut self, frame: &str, out: &mut Vec<Message>) -> Result<Kind, FrameError> {
        let parts: Vec<&RawValue> = serde_json::from_str(frame).map_err(|e| json_err("not a JSON array", e))?;
        let tag: Cow<str> = match parts.first() {
            Some(t) => serde_json::from_str(t.get()).map_err(|e| json_err("the message type is not a string", e))?,
            None => return Err(bad("an empty array")),
        };
        let body = parts.get(1).ok_or_else(|| bad(format!("a {tag} message without a body")))?;
        let watermark = |key: &str| -> Result<String, FrameError> {
            let raw = parts.get(2).ok_or_else(|| bad(format!("a {tag} message without its {{{key}}}")))?;
            let fields: Fields = serde_json::from_str(raw.get()).map_err(|e| json_err(&format!("{tag} {key}"), e))?;
            fields
                .0
                .into_iter()
                .find(|(k, _)| k == key)
                .and_then(|(_, v)| serde_json::from_str::<String>(v.get()).ok())
                .ok_or_else(|| bad(format!("a {tag} message without a string {key}")))
        };
        match tag.as_ref() {
            "begin" => {
                let fields: Fields = serde_json::from_str(body.get()).map_err(|e| json_err("begin", e))?;
                let skip_ack = fields.get("skipAck").is_some_and(|v| v.get() == "true");
                let watermark = watermark("commitWatermark")?;
                out.push(Message::Begin(Begin { commit_watermark: watermark.clone(), extra: fields.extra() }));
                Ok(Kind::Begin { watermark, skip_ack })
            }
            "commit" => {
                let fields: Fields = serde_json::from_str(body.get()).map_err(|e| json_err("commit", e))?;
                let watermark = watermark("watermark")?;
                out.push(Message::Commit(Commit { watermark: watermark.clone(), extra: fields.extra() }));
                Ok(Kind::Commit { watermark })
            }
            "rollback" => {
                out.push(Message::Rollback);
                Ok(Kind::Rollback)
            }
            "status" => {
                let fields: Fields = serde_json::from_str(body.get()).map_err(|e| json_err("status", e))?;
                // `ack` defaults to true, as in Zero.
                let ack = fields.get("ack").is_none_or(|v| v.get() != "false");
                Ok(Kind::Status { watermark: watermark("watermark")?, ack })
            }
            "control" => {
                let control: ControlJson = serde_json::from_str(body.get()).map_err(|e| json_err("control", e))?;
                if control.tag != "reset-required" {
                    return Err(bad(format!("unknown control message {:?}", control.tag)));
                }
                out.push(Message::Control(Control::ResetRequired(control.message)));
                Ok(Kind::ResetRequired)
            }
            "data" => {
                self.data(body.get(), out)?;
                Ok(Kind::Change)
            }
            other => Err(bad(format!("unknown message type {other:?}"))),
        }
    }

    fn data(&mut self, body: &str, out: &mut Vec<Message>) -> Result<(), FrameError> {
        // Relation texts that vary from row to row (an upstream that puts
        // something changing into them) must not grow the map without bound:
        // start over, and relations are declared again as they are seen.
        if self.tables.len() >= MAX_RELATIONS {
            self.ids.clear();
            self.tables.clear();
        }
        let b: Body = serde_json::from_str(body).map_err(|e| json_err("data", e))?;
        let tag = b.tag.as_ref();
        fn need<'r>(field: Option<&'r RawValue>, tag: &str, name: &str) -> Result<&'r RawValue, FrameError> {
            field.ok_or_else(|| bad(format!("{tag} without `{name}`")))
        }
        match tag {
            "insert" => {
                let id = self.relation(need(b.relation, tag, "relation")?, out)?;
                let row = parse_row(need(b.new, tag, "new")?, "insert new")?;
                let new = self.values(id, &row, out)?;
                out.push(Message::Insert(Insert { relation: id, new: self.pad(id, new) }));
            }
            "update" => {
                let id = self.relation(need(b.relation, tag, "relation")?, out)?;
                let new_row = parse_row(need(b.new, tag, "new")?, "update new")?;
                let new = self.values(id, &new_row, out)?;
                let old = match b.key {
                    Some(k) if k.get() != "null" => {
                        let key_row = parse_row(k, "update key")?;
                        Some(self.values(id, &key_row, out)?)
                    }
                    _ => None,
                };
                let old = old.map(|o| self.pad(id, o));
                out.push(Message::Update(Update { relation: id, old, new: self.pad(id, new) }));
            }
            "delete" => {
                let id = self.relation(need(b.relation, tag, "relation")?, out)?;
                let key_row = parse_row(need(b.key, tag, "key")?, "delete key")?;
                let old = self.values(id, &key_row, out)?;
                out.push(Message::Delete(Delete { relation: id, old: self.pad(id, old) }));
            }
            "truncate" => {
                let rels: Vec<&RawValue> = serde_json::from_str(need(b.relations, tag, "relations")?.get())
                    .map_err(|e| json_err("truncate relations", e))?;
                let mut relations = Vec::with_capacity(rels.len());
                for r in rels {
                    relations.push(self.relation(r, out)?);
                }
                out.push(Message::Truncate(Truncate { relations }));
            }
            "backfill" | "backfill-completed" => {
                return Err(FrameError {
                    message: format!("{tag}: backfill is not supported by custom change sources (nor by zero-cache)"),
                    unsupported: true,
                })
            }
            _ => out.push(Message::Schema(schema_change(&b)?)),
        }
        Ok(())
    }

    /// The id of a relation object, declaring it on first sight.
    fn relation(&mut self, raw: &RawValue, out: &mut Vec<Message>) -> Result<u32, FrameError> {
        if let Some(id) = self.ids.get(raw.get()) {
            return Ok(*id);
        }
        let r: RelationJson = serde_json::from_str(raw.get()).map_err(|e| json_err("relation", e))?;
        let (key_columns, key_type) = match r.row_key {
            Some(k) => (k.columns, k.kind),
            None => match r.key_columns {
                Some(cols) => (cols, r.replica_identity),
                None => return Err(bad(format!("relation {}.{} has neither rowKey nor keyColumns", r.schema, r.name))),
            },
        };
        let key_type = match key_type.as_deref() {
            None | Some("default") => KeyType::Default,
            Some("nothing") => KeyType::Nothing,
            Some("full") => KeyType::Full,
            Some("index") => KeyType::Index,
            Some(other) => return Err(bad(format!("relation {}.{}: unknown key type {other:?}", r.schema, r.name))),
        };
        let id = u32::try_from(self.tables.len()).map_err(|_| bad("too many relations"))?;
        let rel = Relation {
            id,
            schema: r.schema,
            name: r.name,
            // Key columns first, so key images map onto the front.
            columns: key_columns.clone(),
            key_columns,
            key_type,
        };
        out.push(Message::Relation(rel.clone()));
        self.tables.push(rel);
        self.ids.insert(raw.get().to_string(), id);
        Ok(id)
    }

    /// A row's values in the relation's column order, growing (and
    /// re-declaring) the relation when the row names a new column.
    fn values(
        &mut self,
        id: u32,
        row: &[(Cow<str>, &RawValue)],
        out: &mut Vec<Message>,
    ) -> Result<Vec<Value>, FrameError> {
        let rel = &mut self.tables[id as usize];
        let mut values: Vec<Value> = (0..rel.columns.len()).map(|_| Value::Absent).collect();
        let mut grew = false;
        for (i, (name, raw)) in row.iter().enumerate() {
            let at = if rel.columns.get(i).is_some_and(|c| c == name) {
                i
            } else if let Some(p) = rel.columns.iter().position(|c| c == name) {
                p
            } else {
                rel.columns.push(name.to_string());
                values.push(Value::Absent);
                grew = true;
                rel.columns.len() - 1
            };
            values[at] = value(raw).map_err(|e| bad(format!("{}.{} column {name}: {e}", rel.schema, rel.name)))?;
        }
        if grew {
            out.push(Message::Relation(rel.clone()));
        }
        Ok(values)
    }

    /// Pads a row made before its relation grew.
    fn pad(&self, id: u32, mut values: Vec<Value>) -> Vec<Value> {
        let n = self.tables[id as usize].columns.len();
        while values.len() < n {
            values.push(Value::Absent);
        }
        values
    }
}

/// One column value from its JSON text.
fn value(raw: &RawValue) -> Result<Value, String> {
    let text = raw.get();
    Ok(match text.as_bytes().first() {
        Some(b'n') => Value::Null,
        Some(b't') => Value::Boolean(true),
        Some(b'f') => Value::Boolean(false),
        Some(b'"') => {
            let body = &text[1..text.len() - 1];
            if body.contains('\\') {
                Value::Text(serde_json::from_str::<String>(text).map_err(|e| e.to_string())?)
            } else {
                Value::Text(body.to_string())
            }
        }
        Some(b'{' | b'[') => Value::Json(text.to_string()),
        Some(_) if text.bytes().all(|b| b.is_ascii_digit() || b == b'-') => match text.parse::<i64>() {
            Ok(i) => Value::Int(i),
            Err(_) => match text.parse::<u64>() {
                Ok(u) => Value::Uint(u),
                // A big integer (BigIntJSON): exact, as written.
                Err(_) => Value::Numeric(text.to_string()),
            },
        },
        // Fractions and exponents stay as the upstream wrote them.
        Some(_) => Value::Numeric(text.to_string()),
        None => return Err("empty value".into()),
    })
}

fn schema_change(b: &Body) -> Result<SchemaChange, FrameError> {
    let tag = b.tag.as_ref();
    let field = |f: Option<&RawValue>, name: &str| -> Result<String, FrameError> {
        f.map(|r| r.get().to_string()).ok_or_else(|| bad(format!("{tag} without `{name}`")))
    };
    fn parse<'a, T: Deserialize<'a>>(tag: &str, name: &str, f: Option<&'a RawValue>) -> Result<T, FrameError> {
        let raw = f.ok_or_else(|| bad(format!("{tag} without `{name}`")))?;
        serde_json::from_str(raw.get()).map_err(|e| json_err(&format!("{tag} {name}"), e))
    }
    fn id(tag: &str, name: &str, f: Option<&RawValue>) -> Result<TableName, FrameError> {
        parse::<TableId>(tag, name, f).map(|id| TableName { schema: id.schema, name: id.name })
    }
    let unsupported_backfill = |f: Option<&RawValue>| -> Result<(), FrameError> {
        match f.map(|r| r.get()) {
            None | Some("null") | Some("{}") => Ok(()),
            Some(_) => Err(FrameError {
                message: format!("{tag} asks for a backfill, which custom change sources do not support"),
                unsupported: true,
            }),
        }
    };
    Ok(match tag {
        "create-table" => {
            unsupported_backfill(b.backfill)?;
            let spec: TableSpecJson = parse(tag, "spec", b.spec)?;
            SchemaChange::CreateTable(CreateTable {
                spec: TableSpec {
                    schema: spec.schema,
                    name: spec.name,
                    columns: spec.columns.0.into_iter().map(|(name, c)| c.into_wit(name)).collect(),
                    primary_key: spec.primary_key,
                },
                metadata: b.metadata.map(|m| m.get().to_string()),
            })
        }
        "rename-table" => {
            SchemaChange::RenameTable(RenameTable { old: id(tag, "old", b.old)?, new: id(tag, "new", b.new)? })
        }
        "update-table-metadata" => SchemaChange::UpdateTableMetadata(UpdateTableMetadata {
            table: id(tag, "table", b.table)?,
            old: field(b.old, "old")?,
            new: field(b.new, "new")?,
        }),
        "add-column" => {
            unsupported_backfill(b.backfill)?;
            let column: NamedColumn = parse(tag, "column", b.column)?;
            SchemaChange::AddColumn(AddColumn {
                table: id(tag, "table", b.table)?,
                column: column.spec.into_wit(column.name),
                table_metadata: b.table_metadata.map(|m| m.get().to_string()),
            })
        }
        "update-column" => {
            let old: NamedColumn = parse(tag, "old", b.old)?;
            let new: NamedColumn = parse(tag, "new", b.new)?;
            SchemaChange::UpdateColumn(UpdateColumn {
                table: id(tag, "table", b.table)?,
                old: old.spec.into_wit(old.name),
                new: new.spec.into_wit(new.name),
            })
        }
        "drop-column" => SchemaChange::DropColumn(DropColumn {
            table: id(tag, "table", b.table)?,
            column: parse(tag, "column", b.column)?,
        }),
        "drop-table" => SchemaChange::DropTable(id(tag, "id", b.id)?),
        "create-index" => {
            let ix: IndexSpecJson = parse(tag, "spec", b.spec)?;
            let mut columns = Vec::with_capacity(ix.columns.0.len());
            for (col, order) in ix.columns.0 {
                let order = match order.as_str() {
                    "ASC" => SortOrder::Asc,
                    "DESC" => SortOrder::Desc,
                    other => return Err(bad(format!("create-index {}: column {col} has order {other:?}", ix.name))),
                };
                columns.push((col, order));
            }
            SchemaChange::CreateIndex(IndexSpec {
                schema: ix.schema,
                name: ix.name,
                table_name: ix.table_name,
                unique: ix.unique,
                columns,
            })
        }
        "drop-index" => SchemaChange::DropIndex(id(tag, "id", b.id)?),
        other => return Err(bad(format!("unknown data change {other:?}"))),
    })
}

/// A data message's body. Fields whose shape depends on the tag stay raw.
#[derive(Deserialize)]
struct Body<'a> {
    #[serde(borrow)]
    tag: Cow<'a, str>,
    #[serde(borrow, default)]
    relation: Option<&'a RawValue>,
    #[serde(borrow, default)]
    new: Option<&'a RawValue>,
    #[serde(borrow, default)]
    key: Option<&'a RawValue>,
    #[serde(borrow, default)]
    relations: Option<&'a RawValue>,
    #[serde(borrow, default)]
    spec: Option<&'a RawValue>,
    #[serde(borrow, default)]
    metadata: Option<&'a RawValue>,
    #[serde(borrow, default)]
    backfill: Option<&'a RawValue>,
    #[serde(borrow, default)]
    old: Option<&'a RawValue>,
    #[serde(borrow, default)]
    table: Option<&'a RawValue>,
    #[serde(borrow, default)]
    column: Option<&'a RawValue>,
    #[serde(borrow, default, rename = "tableMetadata")]
    table_metadata: Option<&'a RawValue>,
    #[serde(borrow, default)]
    id: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct ControlJson {
    tag: String,
    #[serde(default)]
    message: Option<String>,
}

#[derive(Deserialize)]
struct RelationJson {
    schema: String,
    name: String,
    #[serde(default, rename = "rowKey")]
    row_key: Option<RowKeyJson>,
    #[serde(default, rename = "keyColumns")]
    key_columns: Option<Vec<String>>,
    #[serde(default, rename = "replicaIdentity")]
    replica_identity: Option<String>,
}

#[derive(Deserialize)]
struct RowKeyJson {
    columns: Vec<String>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ColumnSpecJson {
    pos: i32,
    data_type: String,
    #[serde(default)]
    pg_type_class: Option<String>,
    #[serde(default)]
    elem_pg_type_class: Option<String>,
    #[serde(default)]
    character_maximum_length: Option<i32>,
    #[serde(default)]
    not_null: Option<bool>,
    #[serde(default)]
    dflt: Option<String>,
}

impl ColumnSpecJson {
    fn into_wit(self, name: String) -> ColumnSpec {
        ColumnSpec {
            name,
            pos: self.pos,
            data_type: self.data_type,
            not_null: self.not_null,
            default: self.dflt,
            character_max_length: self.character_maximum_length,
            pg_type_class: self.pg_type_class,
            elem_pg_type_class: self.elem_pg_type_class,
        }
    }
}

#[derive(Deserialize)]
struct NamedColumn {
    name: String,
    spec: ColumnSpecJson,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct TableSpecJson {
    schema: String,
    name: String,
    columns: Ordered<ColumnSpecJson>,
    #[serde(default)]
    primary_key: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct IndexSpecJson {
    schema: String,
    name: String,
    table_name: String,
    unique: bool,
    columns: Ordered<String>,
}

/// `{"schema":..,"name":..}`: a table's (or an index's) name.
#[derive(Deserialize)]
struct TableId {
    schema: String,
    name: String,
}

/// A JSON object's entries in document order (column order matters).
struct Ordered<T>(Vec<(String, T)>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Ordered<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = Ordered<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::with_capacity(map.size_hint().unwrap_or(0));
                while let Some((k, v)) = map.next_entry::<String, T>()? {
                    out.push((k, v));
                }
                Ok(Ordered(out))
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

/// A JSON object's entries, borrowed from the frame: keys (unescaped only
/// when they hold escapes) and raw values.
struct Fields<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'a> Fields<'a> {
    fn get(&self, key: &str) -> Option<&'a RawValue> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }

    /// Every field but `tag`, as a JSON object's text (`None` when empty).
    fn extra(&self) -> Option<String> {
        let mut out = String::from("{");
        for (k, v) in self.0.iter().filter(|(k, _)| k != "tag") {
            if out.len() > 1 {
                out.push(',');
            }
            out.push_str(&serde_json::to_string(k.as_ref()).unwrap_or_default());
            out.push(':');
            out.push_str(v.get());
        }
        out.push('}');
        (out.len() > 2).then_some(out)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Fields<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Fields<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some(k) = map.next_key::<Key<'de>>()? {
                    let v: &'de RawValue = map.next_value()?;
                    out.push((k.0, v));
                }
                Ok(Fields(out))
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

/// A map key, borrowed when it needs no unescaping.
struct Key<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Key(Cow::Owned(v.to_string())))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(Key(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

fn parse_row<'a>(raw: &'a RawValue, what: &str) -> Result<Vec<(Cow<'a, str>, &'a RawValue)>, FrameError> {
    let fields: Fields<'a> = serde_json::from_str(raw.get()).map_err(|e| json_err(what, e))?;
    Ok(fields.0)
}

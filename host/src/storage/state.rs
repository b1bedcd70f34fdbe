//! The compacted table state: the latest row of every key of every table,
//! and the schema changes that built the tables, as of the log's last
//! watermark.
//!
//! The log alone cannot give a new consumer the current data once it has
//! been purged. The state can: each change log keeps it beside `changeLog`
//! and updates it in the same storage transaction as the rows it appends,
//! so it is consistent at `lastWatermark` and rolls back with them. A
//! consumer that starts from nothing (a zero-cache initial sync) replays
//! the schema history, then the rows.
//!
//! This module turns one stored change into [`StateOp`]s; the change logs
//! apply them with their own SQL.

use serde::Deserialize;
use serde_json::value::RawValue;

/// A table's (or an index's) identity in the state: `["schema","name"]`,
/// JSON text, so no name can be mistaken for another.
pub fn object_key(schema: &str, name: &str) -> String {
    serde_json::to_string(&(schema, name)).unwrap_or_default()
}

/// What one change does to the state.
#[derive(Debug, PartialEq, Eq)]
pub enum StateOp<'a> {
    /// Stores `row` (a JSON object) under `key`. A row that is already there
    /// keeps the members `row` lacks: an update may leave out columns whose
    /// values did not change (Postgres' unchanged TOAST values). `relation`
    /// is the change's relation object, kept per table to describe its rows.
    /// `whole`: an insert's row, which replaces any stored one outright.
    Upsert {
        table: String,
        key: String,
        row: &'a str,
        relation: &'a str,
        whole: bool,
    },
    /// The row under `old` moves to `new` (an update that changed the key),
    /// before the upsert of its new values.
    Rekey {
        table: String,
        old: String,
        new: String,
    },
    Delete {
        table: String,
        key: String,
    },
    /// These tables lose every row.
    Truncate {
        tables: Vec<String>,
    },
    /// A schema change appended to `table`'s history (for `create-index`,
    /// `index` names the index, so that `drop-index` can take it out).
    Schema {
        table: String,
        index: Option<String>,
        change: &'a str,
    },
    /// The table's rows, history and indexes go.
    DropTable {
        table: String,
    },
    /// The index's `create-index` goes.
    DropIndex {
        index: String,
    },
    /// Rows and history move to the new name; the change is appended.
    RenameTable {
        old: String,
        new: String,
        change: &'a str,
    },
    /// The column leaves every row of the table (so that a column added
    /// later under the same name starts empty); the change is appended.
    DropColumn {
        table: String,
        column: String,
        change: &'a str,
    },
    /// The column is renamed in every row; the change is appended.
    RenameColumn {
        table: String,
        old: String,
        new: String,
        change: &'a str,
    },
}

#[derive(Deserialize)]
struct Name<'a> {
    #[serde(borrow)]
    schema: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    name: std::borrow::Cow<'a, str>,
}

impl Name<'_> {
    fn key(&self) -> String {
        object_key(&self.schema, &self.name)
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RowKey {
    columns: Vec<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Relation<'a> {
    #[serde(borrow)]
    schema: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    name: std::borrow::Cow<'a, str>,
    row_key: Option<RowKey>,
    /// Older senders name the key columns here.
    key_columns: Option<Vec<String>>,
}

impl Relation<'_> {
    fn table(&self) -> String {
        object_key(&self.schema, &self.name)
    }

    fn key_columns(&self) -> Result<&[String], String> {
        match (&self.row_key, &self.key_columns) {
            (Some(k), _) if !k.columns.is_empty() => Ok(&k.columns),
            (_, Some(k)) if !k.is_empty() => Ok(k),
            _ => Err(format!("{}.{} has no row key: its rows cannot be kept by key", self.schema, self.name)),
        }
    }
}

/// The members of a change this module reads.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Change<'a> {
    #[serde(borrow)]
    relation: Option<&'a RawValue>,
    #[serde(borrow)]
    relations: Option<Vec<Relation<'a>>>,
    #[serde(borrow)]
    new: Option<&'a RawValue>,
    #[serde(borrow)]
    key: Option<&'a RawValue>,
    #[serde(borrow)]
    spec: Option<&'a RawValue>,
    #[serde(borrow)]
    table: Option<Name<'a>>,
    #[serde(borrow)]
    id: Option<Name<'a>>,
    #[serde(borrow)]
    old: Option<&'a RawValue>,
    #[serde(borrow)]
    column: Option<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct IndexSpec<'a> {
    #[serde(borrow)]
    schema: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    name: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    table_name: std::borrow::Cow<'a, str>,
}

#[derive(Deserialize)]
struct NamedColumn<'a> {
    #[serde(borrow)]
    name: std::borrow::Cow<'a, str>,
}

/// The key of a row: the raw JSON values of its key columns, in the row
/// key's order, as a JSON array (`[1,"a"]`). The encoder writes a value the
/// same way wherever it appears, so a row's key from its insert and from a
/// later delete's old key are the same text.
fn row_key(object: &str, columns: &[String], what: &str) -> Result<String, String> {
    let mut values: Vec<Option<&str>> = vec![None; columns.len()];
    for member in json_scan::Members::of(object).ok_or_else(|| format!("{what} is not a JSON object"))? {
        let (name, value) = member.map_err(|_| format!("{what} is not valid JSON"))?;
        let name = json_scan::key_text(name).ok_or_else(|| format!("{what} has a malformed member name"))?;
        if let Some(i) = columns.iter().position(|c| *c == name) {
            values[i] = Some(value);
        }
    }
    let mut key = String::from("[");
    for (i, (value, column)) in values.iter().zip(columns).enumerate() {
        let value = value.ok_or_else(|| format!("{what} lacks key column {column:?}"))?;
        if i > 0 {
            key.push(',');
        }
        key.push_str(value.trim());
    }
    key.push(']');
    Ok(key)
}

fn relation_of(raw: &str) -> Result<Relation<'_>, String> {
    serde_json::from_str(raw).map_err(|e| format!("a stored change's relation: {e}"))
}

/// What the change `change` (the inner JSON object of a stored row, tagged
/// `tag`) does to the state. Transaction boundaries do nothing.
pub fn ops<'a>(tag: &str, change: &'a str) -> Result<Vec<StateOp<'a>>, String> {
    let parse = || -> Result<Change<'a>, String> {
        serde_json::from_str(change).map_err(|e| format!("a stored {tag} change is not what Sluice wrote: {e}"))
    };
    let missing = |member: &str| format!("a stored {tag} change has no {member}");
    Ok(match tag {
        "begin" | "commit" | "rollback" => Vec::new(),
        "insert" | "update" => {
            let c = parse()?;
            let raw_relation = c.relation.ok_or_else(|| missing("relation"))?.get();
            let relation = relation_of(raw_relation)?;
            let columns = relation.key_columns()?;
            let row = c.new.ok_or_else(|| missing("new row"))?.get();
            let key = row_key(row, columns, &format!("the new row of a {tag}"))?;
            let table = relation.table();
            let mut ops = Vec::with_capacity(2);
            if let Some(old) = c.key.map(RawValue::get).filter(|k| k.trim() != "null") {
                let old = row_key(old, columns, "the old key of an update")?;
                if old != key {
                    ops.push(StateOp::Rekey { table: table.clone(), old, new: key.clone() });
                }
            }
            ops.push(StateOp::Upsert { table, key, row, relation: raw_relation, whole: tag == "insert" });
            ops
        }
        "delete" => {
            let c = parse()?;
            let relation = relation_of(c.relation.ok_or_else(|| missing("relation"))?.get())?;
            let key = row_key(c.key.ok_or_else(|| missing("key"))?.get(), relation.key_columns()?, "a delete's key")?;
            vec![StateOp::Delete { table: relation.table(), key }]
        }
        "truncate" => {
            let c = parse()?;
            let tables = c.relations.ok_or_else(|| missing("relations"))?.iter().map(Relation::table).collect();
            vec![StateOp::Truncate { tables }]
        }
        "create-table" => {
            let c = parse()?;
            let spec: Name<'_> = serde_json::from_str(c.spec.ok_or_else(|| missing("spec"))?.get())
                .map_err(|e| format!("a stored create-table spec: {e}"))?;
            vec![StateOp::Schema { table: spec.key(), index: None, change }]
        }
        "create-index" => {
            let c = parse()?;
            let spec: IndexSpec<'_> = serde_json::from_str(c.spec.ok_or_else(|| missing("spec"))?.get())
                .map_err(|e| format!("a stored create-index spec: {e}"))?;
            vec![StateOp::Schema {
                table: object_key(&spec.schema, &spec.table_name),
                index: Some(object_key(&spec.schema, &spec.name)),
                change,
            }]
        }
        "drop-table" => vec![StateOp::DropTable { table: parse()?.id.ok_or_else(|| missing("id"))?.key() }],
        "drop-index" => vec![StateOp::DropIndex { index: parse()?.id.ok_or_else(|| missing("id"))?.key() }],
        "rename-table" => {
            let c = parse()?;
            let name = |raw: Option<&RawValue>, what: &str| -> Result<String, String> {
                let n: Name<'_> = serde_json::from_str(raw.ok_or_else(|| missing(what))?.get())
                    .map_err(|e| format!("a stored rename-table {what}: {e}"))?;
                Ok(n.key())
            };
            vec![StateOp::RenameTable { old: name(c.old, "old")?, new: name(c.new, "new")?, change }]
        }
        "drop-column" => {
            let c = parse()?;
            let table = c.table.ok_or_else(|| missing("table"))?.key();
            let column: String =
                serde_json::from_str(c.column.ok_or_else(|| missing("column"))?.get()).map_err(|e| e.to_string())?;
            vec![StateOp::DropColumn { table, column, change }]
        }
        "update-column" => {
            let c = parse()?;
            let table = c.table.ok_or_else(|| missing("table"))?.key();
            let name = |raw: Option<&RawValue>, what: &str| -> Result<String, String> {
                let n: NamedColumn<'_> = serde_json::from_str(raw.ok_or_else(|| missing(what))?.get())
                    .map_err(|e| format!("a stored update-column {what}: {e}"))?;
                Ok(n.name.into_owned())
            };
            let (old, new) = (name(c.old, "old")?, name(c.new, "new")?);
            if old == new {
                vec![StateOp::Schema { table, index: None, change }]
            } else {
                vec![StateOp::RenameColumn { table, old, new, change }]
            }
        }
        "add-column" | "update-table-metadata" => {
            vec![StateOp::Schema { table: parse()?.table.ok_or_else(|| missing("table"))?.key(), index: None, change }]
        }
        // Backfill messages never reach the log (sources cannot send them).
        other => return Err(format!("the compacted state does not know the change {other:?}")),
    })
}

/// The statements a change log runs to keep the state, inside its open
/// storage transaction.
pub trait StateStore {
    /// Inserts the row, or merges it into the stored one ([`merge_rows`])
    /// unless it is `whole`; `relation` describes the table's rows (kept
    /// once per table).
    fn upsert(&mut self, table: &str, key: &str, row: &str, relation: &str, whole: bool) -> anyhow::Result<()>;
    /// Moves a row to another key (replacing any row stored there).
    fn rekey(&mut self, table: &str, old: &str, new: &str) -> anyhow::Result<()>;
    fn delete(&mut self, table: &str, key: &str) -> anyhow::Result<()>;
    /// Deletes every row of `table`.
    fn clear(&mut self, table: &str) -> anyhow::Result<()>;
    /// Appends a schema change at its place in the log.
    fn add_schema(&mut self, at: (&str, i64), table: &str, index: Option<&str>, change: &str) -> anyhow::Result<()>;
    /// Deletes the table's rows and schema history (its indexes included).
    fn drop_table(&mut self, table: &str) -> anyhow::Result<()>;
    fn drop_index(&mut self, index: &str) -> anyhow::Result<()>;
    /// Moves the table's rows and history to another name.
    fn rename_table(&mut self, old: &str, new: &str) -> anyhow::Result<()>;
    /// Drops `column` from every row of `table` ([`edit_column`]), or
    /// renames it to `rename_to`.
    fn edit_column(&mut self, table: &str, column: &str, rename_to: Option<&str>) -> anyhow::Result<()>;
}

/// Applies one stored change (at `(watermark, pos)`) to the state.
pub fn apply(store: &mut dyn StateStore, at: (&str, i64), tag: &str, change: &str) -> anyhow::Result<()> {
    let ops = ops(tag, change).map_err(|e| anyhow::anyhow!("keeping the table state at {}: {e}", at.0))?;
    for op in ops {
        match op {
            StateOp::Upsert { table, key, row, relation, whole } => store.upsert(&table, &key, row, relation, whole)?,
            StateOp::Rekey { table, old, new } => store.rekey(&table, &old, &new)?,
            StateOp::Delete { table, key } => store.delete(&table, &key)?,
            StateOp::Truncate { tables } => {
                for table in tables {
                    store.clear(&table)?;
                }
            }
            StateOp::Schema { table, index, change } => store.add_schema(at, &table, index.as_deref(), change)?,
            StateOp::DropTable { table } => store.drop_table(&table)?,
            StateOp::DropIndex { index } => store.drop_index(&index)?,
            StateOp::RenameTable { old, new, change } => {
                store.rename_table(&old, &new)?;
                store.add_schema(at, &new, None, change)?;
            }
            StateOp::DropColumn { table, column, change } => {
                store.edit_column(&table, &column, None)?;
                store.add_schema(at, &table, None, change)?;
            }
            StateOp::RenameColumn { table, old, new, change } => {
                store.edit_column(&table, &old, Some(&new))?;
                store.add_schema(at, &table, None, change)?;
            }
        }
    }
    Ok(())
}

/// `stored` with the members of `patch` put in (replacing those of the same
/// name, the others kept in their order): an update's new values over the
/// row they update. Both are JSON objects as the encoder writes them.
pub fn merge_rows(stored: &str, patch: &str) -> Result<String, String> {
    let patch_members = json_scan::members(patch).ok_or("an update's new row is not a JSON object")?;
    let stored_members = json_scan::members(stored).ok_or("a stored row is not a JSON object")?;
    let mut out = String::with_capacity(stored.len() + patch.len());
    out.push('{');
    let mut first = true;
    let mut push = |out: &mut String, name: &str, value: &str| {
        if !first {
            out.push(',');
        }
        first = false;
        out.push('"');
        out.push_str(name);
        out.push_str("\":");
        out.push_str(value);
    };
    for (name, value) in &stored_members {
        let value = patch_members.iter().find(|(n, _)| n == name).map_or(*value, |(_, v)| *v);
        push(&mut out, name, value);
    }
    for (name, value) in &patch_members {
        if !stored_members.iter().any(|(n, _)| n == name) {
            push(&mut out, name, value);
        }
    }
    out.push('}');
    Ok(out)
}

/// `row` without the member `column`, or with it renamed to `to`.
pub fn edit_column(row: &str, column: &str, to: Option<&str>) -> Result<String, String> {
    let members = json_scan::members(row).ok_or("a stored row is not a JSON object")?;
    let mut out = String::with_capacity(row.len());
    out.push('{');
    let mut first = true;
    for (raw_name, value) in members {
        let name = json_scan::key_text(raw_name).ok_or("a stored row has a malformed member name")?;
        let name = if name == column {
            match to {
                None => continue,
                Some(to) => serde_json::to_string(to).map_err(|e| e.to_string())?,
            }
        } else {
            format!("\"{raw_name}\"")
        };
        if !first {
            out.push(',');
        }
        first = false;
        out.push_str(&name);
        out.push(':');
        out.push_str(value);
    }
    out.push('}');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const REL: &str = r#"{"schema":"public","name":"items","rowKey":{"columns":["a","b"],"type":"default"}}"#;

    fn t() -> String {
        object_key("public", "items")
    }

    #[test]
    fn row_changes_become_upserts_and_deletes_by_key() {
        let insert = format!(r#"{{"tag":"insert","relation":{REL},"new":{{"b":"x","a":1,"c":null}}}}"#);
        assert_eq!(
            ops("insert", &insert).unwrap(),
            [StateOp::Upsert {
                table: t(),
                key: r#"[1,"x"]"#.into(),
                row: r#"{"b":"x","a":1,"c":null}"#,
                relation: REL,
                whole: true,
            }]
        );
        let update = format!(r#"{{"tag":"update","relation":{REL},"key":null,"new":{{"a":1,"b":"x","c":2}}}}"#);
        assert!(matches!(&ops("update", &update).unwrap()[..], [StateOp::Upsert { whole: false, .. }]));
        let moved = format!(r#"{{"tag":"update","relation":{REL},"key":{{"a":0,"b":"x"}},"new":{{"a":1,"b":"x"}}}}"#);
        assert_eq!(
            ops("update", &moved).unwrap()[0],
            StateOp::Rekey { table: t(), old: r#"[0,"x"]"#.into(), new: r#"[1,"x"]"#.into() }
        );
        let delete = format!(r#"{{"tag":"delete","relation":{REL},"key":{{"a":1,"b":"x"}}}}"#);
        assert_eq!(ops("delete", &delete).unwrap(), [StateOp::Delete { table: t(), key: r#"[1,"x"]"#.into() }]);
        let truncate = format!(r#"{{"tag":"truncate","relations":[{REL}]}}"#);
        assert_eq!(ops("truncate", &truncate).unwrap(), [StateOp::Truncate { tables: vec![t()] }]);
        assert!(ops("begin", r#"{"tag":"begin"}"#).unwrap().is_empty());
    }

    #[test]
    fn a_key_is_the_same_text_however_the_row_orders_its_members() {
        let columns = ["a".to_string(), "b".to_string()];
        let one = row_key(r#"{"a":12345678901234567890,"b":"q\"uote"}"#, &columns, "x").unwrap();
        let two = row_key(r#"{"b":"q\"uote", "a":12345678901234567890}"#, &columns, "x").unwrap();
        assert_eq!(one, two);
        assert_eq!(one, r#"[12345678901234567890,"q\"uote"]"#);
        assert!(row_key(r#"{"a":1}"#, &columns, "the row").unwrap_err().contains("lacks key column \"b\""));
    }

    #[test]
    fn schema_changes_name_their_table_and_index() {
        let create = r#"{"tag":"create-table","spec":{"schema":"public","name":"items","columns":{}}}"#;
        assert_eq!(ops("create-table", create).unwrap(), [StateOp::Schema { table: t(), index: None, change: create }]);
        let index = r#"{"tag":"create-index","spec":{"schema":"public","name":"items_pk","tableName":"items","columns":{"a":"ASC"},"unique":true}}"#;
        assert_eq!(
            ops("create-index", index).unwrap(),
            [StateOp::Schema { table: t(), index: Some(object_key("public", "items_pk")), change: index }]
        );
        let rename = r#"{"tag":"rename-table","old":{"schema":"public","name":"items"},"new":{"schema":"public","name":"goods"}}"#;
        assert_eq!(
            ops("rename-table", rename).unwrap(),
            [StateOp::RenameTable { old: t(), new: object_key("public", "goods"), change: rename }]
        );
        let renamed = r#"{"tag":"update-column","table":{"schema":"public","name":"items"},"old":{"name":"c","spec":{}},"new":{"name":"d","spec":{}}}"#;
        assert_eq!(
            ops("update-column", renamed).unwrap(),
            [StateOp::RenameColumn { table: t(), old: "c".into(), new: "d".into(), change: renamed }]
        );
        let dropped = r#"{"tag":"drop-column","table":{"schema":"public","name":"items"},"column":"c"}"#;
        assert_eq!(
            ops("drop-column", dropped).unwrap(),
            [StateOp::DropColumn { table: t(), column: "c".into(), change: dropped }]
        );
        assert!(ops("backfill", "{}").unwrap_err().contains("backfill"));
    }

    #[test]
    fn rows_merge_and_lose_or_rename_columns() {
        let stored = r#"{"a":1,"big":"toast","c":null}"#;
        assert_eq!(merge_rows(stored, r#"{"a":1,"c":5,"d":true}"#).unwrap(), r#"{"a":1,"big":"toast","c":5,"d":true}"#);
        assert_eq!(edit_column(stored, "big", None).unwrap(), r#"{"a":1,"c":null}"#);
        assert_eq!(edit_column(stored, "c", Some("e\"")).unwrap(), r#"{"a":1,"big":"toast","e\"":null}"#);
    }
}

//! The published schema: what the upstream's catalog says about the tables
//! Sluice replicates, the event trigger that reports schema changes into the
//! WAL, and the diff that turns two schemas into schema-change messages.

use std::collections::HashMap;

use serde::Deserialize;

use crate::source::model::{
    AddColumn, ColumnSpec, CreateTable, DropColumn, IndexSpec, KeyType, Relation, RenameTable, SchemaChange, SortOrder,
    TableName, TableSpec, UpdateColumn,
};

/// The prefix of the logical messages the event trigger emits.
pub const DDL_PREFIX: &str = "sluice/ddl";

/// One JSON document describing every published table and its indexes.
/// Used by the event trigger and, at snapshot time, by the source itself.
/// An array column's type is named as Zero's own Postgres source names it,
/// the element's type with one `[]` per dimension (`text[]`): zero-cache
/// refuses a column spec with an element type class and no `[]` (`_text`).
pub const SPECS_SQL: &str = r#"
SELECT jsonb_build_object(
  'tables', COALESCE((
    SELECT jsonb_agg(jsonb_build_object(
      'oid', c.oid::int8, 'schema', n.nspname, 'name', c.relname, 'pubs', t.pubs,
      'identity', c.relreplident,
      'columns', (
        SELECT COALESCE(jsonb_agg(jsonb_build_object(
          'attnum', a.attnum, 'name', a.attname, 'type_oid', a.atttypid::int8,
          'data_type', CASE WHEN el.oid IS NULL THEN ty.typname
                            ELSE el.typname || repeat('[]', greatest(a.attndims, 1)) END,
          'not_null', a.attnotnull, 'default', pg_get_expr(d.adbin, d.adrelid),
          'max_len', CASE WHEN ty.typname IN ('varchar', 'bpchar') AND a.atttypmod > 4 THEN a.atttypmod - 4 END,
          'type_class', ty.typtype, 'elem_class', el.typtype) ORDER BY a.attnum), '[]'::jsonb)
        FROM pg_attribute a
        JOIN pg_type ty ON ty.oid = a.atttypid
        LEFT JOIN pg_type el ON el.oid = ty.typelem AND ty.typlen = -1 AND ty.typelem <> 0
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''),
      'pk', (
        SELECT jsonb_agg(a.attname ORDER BY k.ord)
        FROM pg_index i
        CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
        WHERE i.indrelid = c.oid AND i.indisprimary),
      'identity_index', (
        SELECT jsonb_agg(a.attname ORDER BY k.ord)
        FROM pg_index i
        CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
        WHERE i.indrelid = c.oid AND i.indisreplident)
    ) ORDER BY c.oid)
    FROM (SELECT schemaname, tablename, jsonb_agg(pubname::text ORDER BY pubname) AS pubs
          FROM pg_publication_tables GROUP BY 1, 2) t
    JOIN pg_namespace n ON n.nspname = t.schemaname
    JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = t.tablename), '[]'::jsonb),
  'indexes', COALESCE((
    SELECT jsonb_agg(jsonb_build_object(
      'oid', ic.oid::int8, 'schema', n.nspname, 'name', ic.relname, 'table_oid', i.indrelid::int8,
      'table_name', tc.relname, 'unique', i.indisunique,
      'columns', (
        SELECT jsonb_agg(jsonb_build_array(a.attname, (i.indoption[k.ord - 1] & 1) = 1) ORDER BY k.ord)
        FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
        WHERE k.ord <= i.indnkeyatts)
    ) ORDER BY ic.oid)
    FROM pg_index i
    JOIN pg_class ic ON ic.oid = i.indexrelid
    JOIN pg_class tc ON tc.oid = i.indrelid
    JOIN pg_namespace n ON n.oid = ic.relnamespace
    WHERE i.indrelid IN (SELECT c.oid FROM pg_publication_tables pt
                         JOIN pg_namespace pn ON pn.nspname = pt.schemaname
                         JOIN pg_class c ON c.relnamespace = pn.oid AND c.relname = pt.tablename)
      AND i.indexprs IS NULL AND i.indpred IS NULL AND NOT (0 = ANY (i.indkey::int2[]))), '[]'::jsonb)
)::text"#;

/// Bookkeeping Sluice keeps in the upstream: its slots and the last
/// published schema the event trigger saw.
pub fn metadata_sql() -> String {
    format!(
        r#"
CREATE SCHEMA IF NOT EXISTS _sluice;
CREATE TABLE IF NOT EXISTS _sluice.slots (
  slot TEXT PRIMARY KEY,
  replica_version TEXT NOT NULL,
  publications TEXT[] NOT NULL,
  created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS _sluice.published_schema (
  lock BOOL PRIMARY KEY DEFAULT true CHECK (lock),
  current JSONB
);
CREATE OR REPLACE FUNCTION _sluice.schema_specs() RETURNS JSONB LANGUAGE sql STABLE AS $specs$
  SELECT ({SPECS_SQL})::jsonb
$specs$;
CREATE OR REPLACE FUNCTION _sluice.on_ddl() RETURNS event_trigger LANGUAGE plpgsql AS $fn$
DECLARE
  prev JSONB;
  cur JSONB;
BEGIN
  -- One schema change at a time, so each message's 'previous' is exact.
  PERFORM pg_advisory_xact_lock(7310522611240211011);
  SELECT current INTO prev FROM _sluice.published_schema;
  cur := _sluice.schema_specs();
  IF prev IS DISTINCT FROM cur THEN
    INSERT INTO _sluice.published_schema (lock, current) VALUES (true, cur)
      ON CONFLICT (lock) DO UPDATE SET current = EXCLUDED.current;
    PERFORM pg_logical_emit_message(true, '{DDL_PREFIX}',
      jsonb_build_object('tag', tg_tag, 'previous', prev, 'schema', cur)::text);
  END IF;
END
$fn$;
"#
    )
}

/// Installs the event trigger (needs superuser). Run in a savepoint.
pub const TRIGGER_SQL: &str = r#"
DO $do$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_event_trigger WHERE evtname = '_sluice_ddl') THEN
    CREATE EVENT TRIGGER _sluice_ddl ON ddl_command_end EXECUTE FUNCTION _sluice.on_ddl();
  END IF;
END $do$"#;

#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
pub struct Schema {
    pub tables: Vec<TableInfo>,
    pub indexes: Vec<IndexInfo>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct TableInfo {
    pub oid: u32,
    pub schema: String,
    pub name: String,
    pub pubs: Vec<String>,
    pub identity: String,
    pub columns: Vec<ColumnInfo>,
    pub pk: Option<Vec<String>>,
    pub identity_index: Option<Vec<String>>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ColumnInfo {
    pub attnum: i32,
    pub name: String,
    pub type_oid: u32,
    pub data_type: String,
    pub not_null: bool,
    pub default: Option<String>,
    pub max_len: Option<i32>,
    pub type_class: String,
    pub elem_class: Option<String>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct IndexInfo {
    pub oid: u32,
    pub schema: String,
    pub name: String,
    pub table_oid: u32,
    pub table_name: String,
    pub unique: bool,
    pub columns: Option<Vec<(String, bool)>>,
}

impl Schema {
    pub fn parse(text: &str) -> Result<Schema, String> {
        serde_json::from_str(text).map_err(|e| format!("the published schema does not parse: {e}"))
    }

    /// Only the tables in one of `pubs`, and their indexes.
    pub fn published_in(&self, pubs: &[String]) -> Schema {
        let tables: Vec<TableInfo> =
            self.tables.iter().filter(|t| t.pubs.iter().any(|p| pubs.contains(p))).cloned().collect();
        let indexes = self.indexes.iter().filter(|i| tables.iter().any(|t| t.oid == i.table_oid)).cloned().collect();
        Schema { tables, indexes }
    }
}

impl TableInfo {
    pub fn table_name(&self) -> TableName {
        TableName { schema: self.schema.clone(), name: self.name.clone() }
    }

    /// The relation declaration pgoutput would send for this table.
    pub fn relation(&self) -> Relation {
        let all: Vec<String> = self.columns.iter().map(|c| c.name.clone()).collect();
        let (key_columns, key_type) = match self.identity.as_str() {
            "f" => (all.clone(), KeyType::Full),
            "i" => (self.identity_index.clone().unwrap_or_default(), KeyType::Index),
            "n" => (Vec::new(), KeyType::Nothing),
            _ => (self.pk.clone().unwrap_or_default(), KeyType::Default),
        };
        Relation {
            id: self.oid,
            schema: self.schema.clone(),
            name: self.name.clone(),
            columns: all,
            key_columns,
            key_type,
        }
    }

    pub fn spec(&self) -> TableSpec {
        TableSpec {
            schema: self.schema.clone(),
            name: self.name.clone(),
            columns: self.columns.iter().map(ColumnInfo::spec).collect(),
            primary_key: self.pk.clone(),
        }
    }
}

impl ColumnInfo {
    pub fn spec(&self) -> ColumnSpec {
        ColumnSpec {
            name: self.name.clone(),
            pos: self.attnum,
            data_type: self.data_type.clone(),
            not_null: Some(self.not_null),
            default: self.default.clone(),
            character_max_length: self.max_len,
            pg_type_class: Some(self.type_class.clone()),
            elem_pg_type_class: self.elem_class.clone(),
        }
    }
}

impl IndexInfo {
    pub fn spec(&self) -> IndexSpec {
        IndexSpec {
            schema: self.schema.clone(),
            name: self.name.clone(),
            table_name: self.table_name.clone(),
            unique: self.unique,
            columns: self
                .columns
                .iter()
                .flatten()
                .map(|(c, desc)| (c.clone(), if *desc { SortOrder::Desc } else { SortOrder::Asc }))
                .collect(),
        }
    }
}

/// A default a replica can apply to existing rows by itself: none, or a
/// constant. Anything that calls a function (now(), nextval(...)) cannot be.
fn replicable_default(default: &Option<String>) -> bool {
    match default {
        None => true,
        Some(d) => !d.contains('('),
    }
}

/// The schema changes that take `prev` to `cur` (both already restricted to
/// the publications), in Zero's order: dropped indexes, dropped tables,
/// per-table renames and column changes, new tables, new indexes. `Err`
/// names a change that cannot be expressed, which needs a new snapshot.
pub fn diff(prev: &Schema, cur: &Schema, tag: &str) -> Result<Vec<SchemaChange>, String> {
    let prev_tables: HashMap<u32, &TableInfo> = prev.tables.iter().map(|t| (t.oid, t)).collect();
    let cur_tables: HashMap<u32, &TableInfo> = cur.tables.iter().map(|t| (t.oid, t)).collect();
    let prev_indexes: HashMap<u32, &IndexInfo> = prev.indexes.iter().map(|i| (i.oid, i)).collect();
    let cur_indexes: HashMap<u32, &IndexInfo> = cur.indexes.iter().map(|i| (i.oid, i)).collect();
    let mut out = Vec::new();

    // An index whose definition or name changed is dropped and re-created.
    // Renaming its table is not a change: the replica renames the table
    // with its indexes.
    let same_index = |a: &IndexInfo, b: &IndexInfo| {
        IndexInfo { table_name: String::new(), ..a.clone() } == IndexInfo { table_name: String::new(), ..b.clone() }
    };
    let changed_index = |i: &IndexInfo| cur_indexes.get(&i.oid).is_none_or(|c| !same_index(c, i));
    for i in prev.indexes.iter().filter(|i| changed_index(i)) {
        // Dropping a table drops its indexes; say so only for kept tables.
        if cur_tables.contains_key(&i.table_oid) {
            out.push(SchemaChange::DropIndex(TableName { schema: i.schema.clone(), name: i.name.clone() }));
        }
    }
    for t in prev.tables.iter().filter(|t| !cur_tables.contains_key(&t.oid)) {
        out.push(SchemaChange::DropTable(t.table_name()));
    }
    for t in cur.tables.iter() {
        if let Some(old) = prev_tables.get(&t.oid) {
            out.extend(diff_table(old, t, tag)?);
        }
    }
    for t in cur.tables.iter().filter(|t| !prev_tables.contains_key(&t.oid)) {
        if !tag.starts_with("CREATE") {
            return Err(format!(
                "table {}.{} joined the publication ({tag}) with rows the stream never carried; a new snapshot is needed",
                t.schema, t.name
            ));
        }
        out.push(SchemaChange::CreateTable(CreateTable { spec: t.spec(), metadata: None }));
    }
    for i in cur.indexes.iter() {
        if prev_indexes.get(&i.oid).is_none_or(|p| !same_index(p, i)) {
            out.push(SchemaChange::CreateIndex(i.spec()));
        }
    }
    Ok(out)
}

/// Changes to one kept table, matching columns by attnum.
pub fn diff_table(old: &TableInfo, new: &TableInfo, tag: &str) -> Result<Vec<SchemaChange>, String> {
    let mut out = Vec::new();
    if old.schema != new.schema || old.name != new.name {
        out.push(SchemaChange::RenameTable(RenameTable { old: old.table_name(), new: new.table_name() }));
    }
    let table = new.table_name();
    for c in old.columns.iter().filter(|c| !new.columns.iter().any(|n| n.attnum == c.attnum)) {
        out.push(SchemaChange::DropColumn(DropColumn { table: table.clone(), column: c.name.clone() }));
    }
    for c in new.columns.iter() {
        match old.columns.iter().find(|o| o.attnum == c.attnum) {
            Some(o) if o.name != c.name || o.type_oid != c.type_oid || o.not_null != c.not_null => {
                out.push(SchemaChange::UpdateColumn(UpdateColumn {
                    table: table.clone(),
                    old: o.spec(),
                    new: c.spec(),
                }));
            }
            Some(_) => {}
            None => {
                if !replicable_default(&c.default) {
                    return Err(format!(
                        "column {}.{}.{} was added ({tag}) with the default {}, which a replica cannot compute; a new snapshot is needed",
                        new.schema,
                        new.name,
                        c.name,
                        c.default.as_deref().unwrap_or("NULL")
                    ));
                }
                out.push(SchemaChange::AddColumn(AddColumn {
                    table: table.clone(),
                    column: c.spec(),
                    table_metadata: None,
                }));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn col(attnum: i32, name: &str, type_oid: u32) -> ColumnInfo {
        ColumnInfo {
            attnum,
            name: name.into(),
            type_oid,
            data_type: "int8".into(),
            not_null: false,
            default: None,
            max_len: None,
            type_class: "b".into(),
            elem_class: None,
        }
    }

    fn table(oid: u32, name: &str, columns: Vec<ColumnInfo>) -> TableInfo {
        TableInfo {
            oid,
            schema: "public".into(),
            name: name.into(),
            pubs: vec!["p".into()],
            identity: "d".into(),
            columns,
            pk: Some(vec!["id".into()]),
            identity_index: None,
        }
    }

    fn tags(changes: &[SchemaChange]) -> Vec<&'static str> {
        changes.iter().map(crate::change::schema_tag).collect()
    }

    #[test]
    fn renames_and_columns() {
        let prev = Schema { tables: vec![table(1, "a", vec![col(1, "id", 20), col(2, "x", 20)])], indexes: vec![] };
        let cur = Schema {
            tables: vec![table(1, "b", vec![col(1, "id", 20), col(3, "y", 25)]), table(2, "c", vec![col(1, "id", 20)])],
            indexes: vec![],
        };
        assert!(diff(&prev, &cur, "ALTER TABLE").is_err(), "a table joining by ALTER needs a snapshot");
        let cur_one = Schema { tables: vec![cur.tables[0].clone()], indexes: vec![] };
        assert_eq!(tags(&diff(&prev, &cur_one, "ALTER TABLE").unwrap()), ["rename-table", "drop-column", "add-column"]);
        assert_eq!(
            tags(&diff(&prev, &cur, "CREATE TABLE").unwrap()),
            ["rename-table", "drop-column", "add-column", "create-table"]
        );
        assert_eq!(
            tags(&diff(&cur, &prev, "DROP TABLE").unwrap()),
            ["drop-table", "rename-table", "drop-column", "add-column"]
        );
    }

    #[test]
    fn volatile_defaults_need_a_snapshot() {
        let prev = Schema { tables: vec![table(1, "a", vec![col(1, "id", 20)])], indexes: vec![] };
        let mut added = col(2, "at", 1184);
        added.default = Some("now()".into());
        let cur = Schema { tables: vec![table(1, "a", vec![col(1, "id", 20), added])], indexes: vec![] };
        let err = diff(&prev, &cur, "ALTER TABLE").unwrap_err();
        assert!(err.contains("public.a.at") && err.contains("now()"), "{err}");
    }
}

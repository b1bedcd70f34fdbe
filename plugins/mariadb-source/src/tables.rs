//! The captured tables as the stream has described them: relation ids and
//! declarations (sent again whenever a TABLE_MAP shows other columns), and
//! each table's column specs, for the schema changes DDL turns into.

use std::collections::HashMap;

use crate::ddl::{ColumnDef, TableRef};
use sluice_plugin_sdk::types::{
    ColumnSpec, CreateTable, IndexSpec, KeyType, Message, Relation, SchemaChange, SortOrder, TableName, TableSpec,
};

#[derive(Default)]
pub struct Tables {
    next_id: u32,
    known: HashMap<TableRef, Known>,
}

struct Known {
    id: u32,
    /// Column specs from the snapshot, a CREATE TABLE or a TABLE_MAP.
    columns: Vec<ColumnDef>,
    primary_key: Vec<String>,
    /// What the last relation declaration said (names and key).
    declared: Option<(Vec<String>, Vec<String>)>,
}

impl Tables {
    fn entry(&mut self, t: &TableRef) -> &mut Known {
        let next_id = &mut self.next_id;
        self.known.entry(t.clone()).or_insert_with(|| {
            *next_id += 1;
            Known { id: *next_id, columns: Vec::new(), primary_key: Vec::new(), declared: None }
        })
    }

    /// Records a table's columns (snapshot, CREATE TABLE).
    pub fn set(&mut self, t: &TableRef, columns: Vec<ColumnDef>, primary_key: Vec<String>) {
        let k = self.entry(t);
        k.columns = columns;
        k.primary_key = primary_key;
    }

    /// Declares the relation rows of `t` are sent under, if the last
    /// declaration differs; returns its id.
    pub fn declare(&mut self, t: &TableRef, names: Vec<String>, key: Vec<String>, out: &mut Vec<Message>) -> u32 {
        let k = self.entry(t);
        let decl = (names, key);
        if k.declared.as_ref() != Some(&decl) {
            let (columns, key_columns) = decl.clone();
            let key_type = if key_columns.is_empty() { KeyType::Full } else { KeyType::Default };
            let key_columns = if key_columns.is_empty() { columns.clone() } else { key_columns };
            out.push(Message::Relation(Relation {
                id: k.id,
                schema: t.db.clone(),
                name: t.table.clone(),
                columns,
                key_columns,
                key_type,
            }));
            k.declared = Some(decl);
        }
        k.id
    }

    /// Declares `t` from its recorded columns (for a TRUNCATE before any row).
    pub fn declare_known(&mut self, t: &TableRef, out: &mut Vec<Message>) -> u32 {
        let k = self.entry(t);
        if let Some((names, key)) = k.declared.clone() {
            return self.declare(t, names, key, out);
        }
        let names = k.columns.iter().map(|c| c.name.clone()).collect();
        let key = k.primary_key.clone();
        self.declare(t, names, key, out)
    }

    /// After a TABLE_MAP: keep the column specs in step with what the binlog
    /// says the table holds (names and types), keeping what DDL told us
    /// about nullability and defaults.
    pub fn observe(&mut self, t: &TableRef, columns: &[crate::binlog::Column], primary_key: Vec<String>) {
        let k = self.entry(t);
        let old = std::mem::take(&mut k.columns);
        k.columns = columns
            .iter()
            .map(|c| {
                let prior = old.iter().find(|o| o.name == c.name);
                ColumnDef {
                    name: c.name.clone(),
                    ty: c.ty.clone(),
                    not_null: prior.map_or(!c.nullable, |p| p.not_null),
                    default: prior.and_then(|p| p.default.clone()),
                }
            })
            .collect();
        k.primary_key = primary_key;
    }

    pub fn column(&self, t: &TableRef, name: &str) -> Option<(usize, ColumnDef)> {
        let k = self.known.get(t)?;
        k.columns.iter().position(|c| c.name == name).map(|i| (i, k.columns[i].clone()))
    }

    pub fn columns(&self, t: &TableRef) -> usize {
        self.known.get(t).map_or(0, |k| k.columns.len())
    }

    pub fn add_column(&mut self, t: &TableRef, c: ColumnDef) {
        self.entry(t).columns.push(c);
    }

    pub fn drop_column(&mut self, t: &TableRef, name: &str) {
        let k = self.entry(t);
        k.columns.retain(|c| c.name != name);
        k.primary_key.retain(|c| c != name);
    }

    pub fn change_column(&mut self, t: &TableRef, old: &str, new: ColumnDef) {
        let k = self.entry(t);
        if let Some(c) = k.columns.iter_mut().find(|c| c.name == old) {
            *c = new.clone();
        }
        for p in &mut k.primary_key {
            if p == old {
                *p = new.name.clone();
            }
        }
    }

    pub fn drop(&mut self, t: &TableRef) {
        self.known.remove(t);
    }

    pub fn rename(&mut self, from: &TableRef, to: &TableRef) {
        if let Some(mut k) = self.known.remove(from) {
            // The relation is declared again under its new name.
            k.declared = None;
            self.known.insert(to.clone(), k);
        }
    }

    pub fn spec(&self, t: &TableRef) -> TableSpec {
        let (columns, pk) = self.known.get(t).map(|k| (k.columns.clone(), k.primary_key.clone())).unwrap_or_default();
        TableSpec {
            schema: t.db.clone(),
            name: t.table.clone(),
            columns: columns.iter().enumerate().map(|(i, c)| column_spec(c, i + 1)).collect(),
            primary_key: (!pk.is_empty()).then_some(pk),
        }
    }
}

pub fn column_spec(c: &ColumnDef, pos: usize) -> ColumnSpec {
    ColumnSpec {
        name: c.name.clone(),
        pos: pos as i32,
        data_type: c.ty.pg_name().to_string(),
        not_null: Some(c.not_null),
        default: c.default.clone(),
        character_max_length: c.ty.char_max_len(),
        pg_type_class: None,
        elem_pg_type_class: None,
    }
}

pub fn table_name(t: &TableRef) -> TableName {
    TableName { schema: t.db.clone(), name: t.table.clone() }
}

/// A table's declaration, and the unique index over its primary key (which
/// replicas such as zero-cache need to sync a table to clients).
pub fn declaration(spec: TableSpec, out: &mut Vec<Message>) {
    let index = spec.primary_key.as_ref().filter(|k| !k.is_empty()).map(|key| IndexSpec {
        schema: spec.schema.clone(),
        name: format!("{}_pkey", spec.name),
        table_name: spec.name.clone(),
        unique: true,
        columns: key.iter().map(|c| (c.clone(), SortOrder::Asc)).collect(),
    });
    out.push(Message::Schema(SchemaChange::CreateTable(CreateTable { spec, metadata: None })));
    if let Some(index) = index {
        out.push(Message::Schema(SchemaChange::CreateIndex(index)));
    }
}

//! The table state ([`super::state`]) in the Postgres change DB.
//!
//! Each statement costs a round trip, so the state operations of one append
//! are first collected into a [`Plan`]: row operations are coalesced by key
//! (the last one wins, an update merges into what is pending), and run as a
//! few set-based statements per batch; schema operations, which are rare,
//! run one by one in their place.

use std::collections::HashMap;

use tokio_postgres::types::ToSql;
use tokio_postgres::Client;

use super::state::{self, StateStore};

type Key = (String, String);

enum Pending {
    /// The row to store; `whole` replaces the stored one, otherwise it is
    /// merged into it.
    Put {
        row: String,
        whole: bool,
    },
    Deleted,
}

enum Step {
    Rows { deletes: Vec<Key>, puts: Vec<(Key, String)>, merges: Vec<(Key, String)> },
    Sql { sql: String, params: Vec<Option<String>> },
    EditColumn { table: String, column: String, rename_to: Option<String> },
}

/// The statements one append runs for the table state.
pub(super) struct Plan<'a> {
    schema: &'a str,
    /// The relation object last written per table (see the SQLite log).
    relations: &'a mut HashMap<String, String>,
    steps: Vec<Step>,
    order: Vec<Key>,
    rows: HashMap<Key, Pending>,
}

impl<'a> Plan<'a> {
    pub(super) fn new(schema: &'a str, relations: &'a mut HashMap<String, String>) -> Self {
        Plan { schema, relations, steps: Vec::new(), order: Vec::new(), rows: HashMap::new() }
    }

    /// Closes the run of row operations collected so far.
    fn flush(&mut self) {
        if self.order.is_empty() {
            return;
        }
        let (mut deletes, mut puts, mut merges) = (Vec::new(), Vec::new(), Vec::new());
        for key in self.order.drain(..) {
            match self.rows.remove(&key) {
                Some(Pending::Deleted) => deletes.push(key),
                Some(Pending::Put { row, whole: true }) => puts.push((key, row)),
                Some(Pending::Put { row, whole: false }) => merges.push((key, row)),
                None => {}
            }
        }
        self.steps.push(Step::Rows { deletes, puts, merges });
    }

    fn sql(&mut self, sql: String, params: Vec<Option<String>>) {
        self.flush();
        self.steps.push(Step::Sql { sql, params });
    }

    fn key(&mut self, table: &str, key: &str) -> Key {
        let k = (table.to_string(), key.to_string());
        if !self.rows.contains_key(&k) {
            self.order.push(k.clone());
        }
        k
    }

    /// Runs the plan on `c`, inside the open storage transaction.
    pub(super) async fn run(mut self, c: &Client) -> anyhow::Result<()> {
        self.flush();
        let s = self.schema;
        for step in self.steps {
            match step {
                Step::Rows { deletes, mut puts, merges } => {
                    if !deletes.is_empty() {
                        let (tables, keys): (Vec<String>, Vec<String>) = deletes.into_iter().unzip();
                        c.execute(
                            &format!(
                                r#"DELETE FROM {s}."stateRows" WHERE ("tableKey", "rowKey") IN
                                   (SELECT * FROM unnest($1::text[], $2::text[]))"#
                            ),
                            &[&tables, &keys],
                        )
                        .await?;
                    }
                    if !merges.is_empty() {
                        // Updates merge into the stored rows, read here (one
                        // query for the batch) and merged as the SQLite log
                        // merges them, without re-encoding values.
                        let (tables, keys): (Vec<&str>, Vec<&str>) =
                            merges.iter().map(|((t, k), _)| (t.as_str(), k.as_str())).unzip();
                        let stored: HashMap<Key, String> = c
                            .query(
                                &format!(
                                    r#"SELECT "tableKey", "rowKey", "row" FROM {s}."stateRows"
                                       WHERE ("tableKey", "rowKey") IN (SELECT * FROM unnest($1::text[], $2::text[]))"#
                                ),
                                &[&tables, &keys],
                            )
                            .await?
                            .into_iter()
                            .map(|r| ((r.get(0), r.get(1)), r.get(2)))
                            .collect();
                        for (key, patch) in merges {
                            let row = match stored.get(&key) {
                                Some(old) => state::merge_rows(old, &patch).map_err(anyhow::Error::msg)?,
                                None => patch,
                            };
                            puts.push((key, row));
                        }
                    }
                    if !puts.is_empty() {
                        let mut tables = Vec::with_capacity(puts.len());
                        let mut keys = Vec::with_capacity(puts.len());
                        let mut rows = Vec::with_capacity(puts.len());
                        for ((t, k), row) in puts {
                            tables.push(t);
                            keys.push(k);
                            rows.push(row);
                        }
                        c.execute(
                            &format!(
                                r#"INSERT INTO {s}."stateRows" ("tableKey", "rowKey", "row")
                                   SELECT * FROM unnest($1::text[], $2::text[], $3::text[])
                                   ON CONFLICT ("tableKey", "rowKey") DO UPDATE SET "row" = EXCLUDED."row""#
                            ),
                            &[&tables, &keys, &rows],
                        )
                        .await?;
                    }
                }
                Step::Sql { sql, params } => {
                    let params: Vec<&(dyn ToSql + Sync)> = params.iter().map(|p| p as &(dyn ToSql + Sync)).collect();
                    c.execute(&sql, &params).await?;
                }
                Step::EditColumn { table, column, rename_to } => {
                    let rows = c
                        .query(
                            &format!(r#"SELECT "rowKey", "row" FROM {s}."stateRows" WHERE "tableKey" = $1"#),
                            &[&table],
                        )
                        .await?;
                    let mut keys = Vec::with_capacity(rows.len());
                    let mut edited = Vec::with_capacity(rows.len());
                    for r in rows {
                        keys.push(r.get::<_, String>(0));
                        let row: String = r.get(1);
                        edited
                            .push(state::edit_column(&row, &column, rename_to.as_deref()).map_err(anyhow::Error::msg)?);
                    }
                    c.execute(
                        &format!(
                            r#"UPDATE {s}."stateRows" r SET "row" = u."row"
                               FROM unnest($2::text[], $3::text[]) AS u("rowKey", "row")
                               WHERE r."tableKey" = $1 AND r."rowKey" = u."rowKey""#
                        ),
                        &[&table, &keys, &edited],
                    )
                    .await?;
                }
            }
        }
        Ok(())
    }
}

impl StateStore for Plan<'_> {
    fn upsert(&mut self, table: &str, key: &str, row: &str, relation: &str, whole: bool) -> anyhow::Result<()> {
        if self.relations.get(table).map(String::as_str) != Some(relation) {
            let s = self.schema;
            // Not a barrier for the rows: another table.
            self.steps.push(Step::Sql {
                sql: format!(
                    r#"INSERT INTO {s}."stateTables" ("tableKey", "relation") VALUES ($1, $2)
                       ON CONFLICT ("tableKey") DO UPDATE SET "relation" = EXCLUDED."relation""#
                ),
                params: vec![Some(table.to_string()), Some(relation.to_string())],
            });
            self.relations.insert(table.to_string(), relation.to_string());
        }
        let k = self.key(table, key);
        let next = match self.rows.remove(&k) {
            None => Pending::Put { row: row.to_string(), whole },
            Some(Pending::Deleted) => Pending::Put { row: row.to_string(), whole: true },
            Some(Pending::Put { row: pending, whole: was_whole }) => {
                if whole {
                    Pending::Put { row: row.to_string(), whole: true }
                } else {
                    Pending::Put {
                        row: state::merge_rows(&pending, row).map_err(anyhow::Error::msg)?,
                        whole: was_whole,
                    }
                }
            }
        };
        self.rows.insert(k, next);
        Ok(())
    }

    fn rekey(&mut self, table: &str, old: &str, new: &str) -> anyhow::Result<()> {
        let s = self.schema;
        let p = |v: &str| Some(v.to_string());
        self.sql(
            format!(r#"DELETE FROM {s}."stateRows" WHERE "tableKey" = $1 AND "rowKey" = $2"#),
            vec![p(table), p(new)],
        );
        self.sql(
            format!(r#"UPDATE {s}."stateRows" SET "rowKey" = $1 WHERE "tableKey" = $2 AND "rowKey" = $3"#),
            vec![p(new), p(table), p(old)],
        );
        Ok(())
    }

    fn delete(&mut self, table: &str, key: &str) -> anyhow::Result<()> {
        let k = self.key(table, key);
        self.rows.insert(k, Pending::Deleted);
        Ok(())
    }

    fn clear(&mut self, table: &str) -> anyhow::Result<()> {
        let s = self.schema;
        self.sql(format!(r#"DELETE FROM {s}."stateRows" WHERE "tableKey" = $1"#), vec![Some(table.to_string())]);
        Ok(())
    }

    fn add_schema(&mut self, at: (&str, i64), table: &str, index: Option<&str>, change: &str) -> anyhow::Result<()> {
        let s = self.schema;
        self.sql(
            format!(
                r#"INSERT INTO {s}."stateSchema" (watermark, pos, "tableKey", "indexKey", change)
                   VALUES ($1, $2::text::int8, $3, $4, $5)"#
            ),
            vec![
                Some(at.0.to_string()),
                Some(at.1.to_string()),
                Some(table.to_string()),
                index.map(str::to_string),
                Some(change.to_string()),
            ],
        );
        Ok(())
    }

    fn drop_table(&mut self, table: &str) -> anyhow::Result<()> {
        let s = self.schema;
        self.relations.remove(table);
        for t in ["stateRows", "stateSchema", "stateTables"] {
            self.sql(format!(r#"DELETE FROM {s}."{t}" WHERE "tableKey" = $1"#), vec![Some(table.to_string())]);
        }
        Ok(())
    }

    fn drop_index(&mut self, index: &str) -> anyhow::Result<()> {
        let s = self.schema;
        self.sql(format!(r#"DELETE FROM {s}."stateSchema" WHERE "indexKey" = $1"#), vec![Some(index.to_string())]);
        Ok(())
    }

    fn rename_table(&mut self, old: &str, new: &str) -> anyhow::Result<()> {
        let s = self.schema;
        self.relations.remove(old);
        self.relations.remove(new);
        let p = |v: &str| Some(v.to_string());
        self.sql(format!(r#"DELETE FROM {s}."stateTables" WHERE "tableKey" = $1"#), vec![p(new)]);
        for t in ["stateRows", "stateSchema", "stateTables"] {
            self.sql(format!(r#"UPDATE {s}."{t}" SET "tableKey" = $1 WHERE "tableKey" = $2"#), vec![p(new), p(old)]);
        }
        Ok(())
    }

    fn edit_column(&mut self, table: &str, column: &str, rename_to: Option<&str>) -> anyhow::Result<()> {
        self.flush();
        self.steps.push(Step::EditColumn {
            table: table.to_string(),
            column: column.to_string(),
            rename_to: rename_to.map(str::to_string),
        });
        Ok(())
    }
}

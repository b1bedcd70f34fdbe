//! The initial snapshot: one transaction holding a create-table and every
//! row of each captured table, read inside `START TRANSACTION WITH
//! CONSISTENT SNAPSHOT`. The snapshot's binlog position (which InnoDB fixes
//! with the read view, with no global read lock) becomes the GTID position
//! the binlog stream starts from, so nothing is missed or seen twice.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::client::{ident, quote, text, Client, Row};
use crate::ddl::{ColumnDef, TableRef};
use crate::lag::ReadPosition;
use crate::replication::Replication;
use crate::tables::Tables;
use crate::types::{decode_text, ColType};
use crate::{check_server, to_lexi, watermark, Config, GtidPos};
use sluice_plugin_sdk::types::{Begin, Commit, Insert, Message, PluginError};

/// How long one `next-batch` reads rows before handing them over.
const BATCH_TIME: Duration = Duration::from_millis(250);

pub struct Snapshot {
    pub replica_version: String,
    /// The snapshot's binlog position: what the binlog stream reads from.
    pub binlog: ReadPosition,
    /// About how many rows the captured tables hold (InnoDB's estimate);
    /// `None` when a table has no estimate.
    pub rows_estimate: Option<u64>,
    client: Option<Client>,
    pos: GtidPos,
    counter: u64,
    pending: VecDeque<(TableRef, Vec<ColumnDef>, Vec<String>)>,
    current: Option<Current>,
    tables: Tables,
    begun: bool,
    finished: bool,
}

struct Current {
    table: TableRef,
    relation: u32,
    types: Vec<ColType>,
}

fn transient(endpoint: &str, what: &str) -> impl Fn(crate::client::ClientError) -> PluginError {
    let (endpoint, what) = (endpoint.to_string(), what.to_string());
    move |e| PluginError::Transient(format!("MariaDB at {endpoint}: {what}: {e}"))
}

impl Snapshot {
    pub fn start(config: &Config) -> Result<Box<Snapshot>, PluginError> {
        let endpoint = config.endpoint();
        let mut c = config.connect()?;
        check_server(&mut c, &endpoint)?;
        for sql in [
            "SET NAMES utf8mb4",
            "SET time_zone = '+00:00'",
            "SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ",
            "START TRANSACTION WITH CONSISTENT SNAPSHOT",
        ] {
            c.execute(sql).map_err(transient(&endpoint, sql))?;
        }
        let status =
            c.query("SHOW STATUS LIKE 'binlog_snapshot_%'").map_err(transient(&endpoint, "snapshot position"))?;
        let mut file = None;
        let mut offset = None;
        for row in status {
            let mut it = row.into_iter().map(|v| v.map(text).unwrap_or_default());
            match (it.next().as_deref(), it.next()) {
                (Some("Binlog_snapshot_file"), Some(v)) => file = Some(v),
                (Some("Binlog_snapshot_position"), Some(v)) => offset = Some(v),
                _ => {}
            }
        }
        let (Some(file), Some(offset)) = (file, offset) else {
            return Err(PluginError::Fatal(format!("MariaDB at {endpoint} reports no binlog snapshot position")));
        };
        let offset: u64 = offset
            .parse()
            .map_err(|_| PluginError::Fatal(format!("MariaDB at {endpoint}: snapshot position {offset:?}")))?;
        let gtid = c
            .query_value(&format!("SELECT BINLOG_GTID_POS({}, {offset})", quote(&file)))
            .map_err(transient(&endpoint, "BINLOG_GTID_POS"))?
            .ok_or_else(|| {
                PluginError::Transient(format!("MariaDB at {endpoint}: no GTID position for {file}:{offset}"))
            })?;
        let pos = GtidPos::parse(&gtid).map_err(|e| PluginError::Fatal(format!("MariaDB at {endpoint}: {e}")))?;

        let mut pending = VecDeque::new();
        let captured = captured_tables(&mut c, config).map_err(transient(&endpoint, "listing tables"))?;
        let rows_estimate = captured.iter().map(|(_, rows)| *rows).sum::<Option<u64>>();
        for (t, _) in captured {
            let (columns, pk) = describe(&mut c, &t).map_err(|e| match e {
                Described::Client(e) => {
                    PluginError::Transient(format!("MariaDB at {endpoint}: describing {}.{}: {e}", t.db, t.table))
                }
                Described::Unsupported(why) => PluginError::Fatal(format!("{}.{}: {why}", t.db, t.table)),
            })?;
            pending.push_back((t, columns, pk));
        }
        // The replica version is the snapshot's GTID counter; the snapshot is
        // stored just after it (`LEXI.GTIDS` sorts after `LEXI`) and before
        // the first transaction after the snapshot (a higher counter).
        let counter = pos.seq_sum();
        Ok(Box::new(Snapshot {
            replica_version: to_lexi(counter),
            binlog: ReadPosition { file, offset },
            rows_estimate,
            client: Some(c),
            pos,
            counter,
            pending,
            current: None,
            tables: Tables::default(),
            begun: false,
            finished: false,
        }))
    }

    /// Hands out the snapshot; returns the binlog stream once it is complete.
    pub fn next_batch(
        &mut self,
        config: &Config,
        max: usize,
        out: &mut Vec<Message>,
    ) -> Result<Option<Box<Replication>>, PluginError> {
        if self.finished {
            return Err(PluginError::Transient("the snapshot ended; the stream must be reopened".into()));
        }
        let wm = watermark(self.counter, &self.pos);
        if !self.begun {
            out.push(Message::Begin(Begin { commit_watermark: wm.clone(), extra: None }));
            self.begun = true;
        }
        let endpoint = config.endpoint();
        let started = Instant::now();
        let limit = max.min(config.snapshot_batch_rows.max(1) as usize);
        let Some(client) = self.client.as_mut() else {
            return Err(PluginError::Transient("the snapshot connection is gone".into()));
        };
        while out.len() < limit && started.elapsed() < BATCH_TIME {
            let Some(cur) = &self.current else {
                let Some((t, columns, pk)) = self.pending.pop_front() else {
                    out.push(Message::Commit(Commit { watermark: wm, extra: None }));
                    self.finished = true;
                    let _ = client.execute("COMMIT");
                    if let Some(c) = self.client.take() {
                        c.quit();
                    }
                    let tables = std::mem::take(&mut self.tables);
                    let replica_version = self.replica_version.clone();
                    return Replication::start(config, replica_version, self.counter, self.pos.clone(), tables)
                        .map(Some);
                };
                let names: Vec<String> = columns.iter().map(|c| c.name.clone()).collect();
                let types = columns.iter().map(|c| c.ty.clone()).collect();
                self.tables.set(&t, columns, pk.clone());
                let relation = self.tables.declare(&t, names.clone(), pk, out);
                crate::tables::declaration(self.tables.spec(&t), out);
                let list: Vec<String> = names.iter().map(|n| ident(n)).collect();
                let sql = format!("SELECT {} FROM {}.{}", list.join(", "), ident(&t.db), ident(&t.table));
                let n = client.start_query(&sql).map_err(transient(&endpoint, &sql))?;
                if n != names.len() {
                    return Err(PluginError::Transient(format!("{sql}: {n} columns came back")));
                }
                self.current = Some(Current { table: t, relation, types });
                continue;
            };
            let row: Option<Row> =
                client.next_row(cur.types.len()).map_err(transient(&endpoint, "reading snapshot rows"))?;
            match row {
                None => self.current = None,
                Some(row) => {
                    let mut new = Vec::with_capacity(row.len());
                    for (v, ty) in row.iter().zip(&cur.types) {
                        new.push(decode_text(v.as_deref(), ty).map_err(|e| {
                            PluginError::Fatal(format!("{}.{}: snapshot value: {e}", cur.table.db, cur.table.table))
                        })?);
                    }
                    out.push(Message::Insert(Insert { relation: cur.relation, new }));
                }
            }
        }
        Ok(None)
    }
}

/// The captured tables, with the engine's estimate of their row counts.
fn captured_tables(
    c: &mut Client,
    config: &Config,
) -> Result<Vec<(TableRef, Option<u64>)>, crate::client::ClientError> {
    let mut dbs: Vec<String> = config.databases.clone();
    dbs.extend(config.tables.iter().filter_map(|t| t.split_once('.').map(|(d, _)| d.to_string())));
    dbs.sort();
    dbs.dedup();
    let list: Vec<String> = dbs.iter().map(|d| quote(d)).collect();
    let rows = c.query(&format!(
        "SELECT TABLE_SCHEMA, TABLE_NAME, TABLE_ROWS FROM information_schema.TABLES \
         WHERE TABLE_TYPE = 'BASE TABLE' AND TABLE_SCHEMA IN ({}) ORDER BY 1, 2",
        list.join(", ")
    ))?;
    Ok(rows
        .into_iter()
        .filter_map(|r| {
            let mut it = r.into_iter().map(|v| v.map(text).unwrap_or_default());
            let table = TableRef { db: it.next()?, table: it.next()? };
            Some((table, it.next().and_then(|rows| rows.parse().ok())))
        })
        .filter(|(t, _)| config.captures(&t.db, &t.table))
        .collect())
}

enum Described {
    Client(crate::client::ClientError),
    Unsupported(String),
}

/// A table's columns and primary key from information_schema.
fn describe(c: &mut Client, t: &TableRef) -> Result<(Vec<ColumnDef>, Vec<String>), Described> {
    let rows = c
        .query(&format!(
            "SELECT COLUMN_NAME, DATA_TYPE, COLUMN_TYPE, IS_NULLABLE, COLUMN_DEFAULT, NUMERIC_PRECISION, \
             NUMERIC_SCALE, DATETIME_PRECISION, CHARACTER_MAXIMUM_LENGTH, CHARACTER_SET_NAME \
             FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = {} AND TABLE_NAME = {} ORDER BY ORDINAL_POSITION",
            quote(&t.db),
            quote(&t.table)
        ))
        .map_err(Described::Client)?;
    let mut columns = Vec::new();
    for r in rows {
        let f: Vec<Option<String>> = r.into_iter().map(|v| v.map(text)).collect();
        let s = |i: usize| f.get(i).cloned().flatten();
        let n = |i: usize| s(i).and_then(|v| v.parse::<u64>().ok());
        let name = s(0).unwrap_or_default();
        let ty = ColType::from_information_schema(
            &s(1).unwrap_or_default(),
            &s(2).unwrap_or_default(),
            n(5),
            n(6),
            n(7),
            n(8),
            s(9).as_deref(),
        )
        .map_err(|e| Described::Unsupported(format!("column {name}: {e}")))?;
        let default = s(4).filter(|d| d != "NULL");
        columns.push(ColumnDef { name, ty, not_null: s(3).as_deref() == Some("NO"), default });
    }
    let pk = c
        .query(&format!(
            "SELECT COLUMN_NAME FROM information_schema.KEY_COLUMN_USAGE WHERE CONSTRAINT_NAME = 'PRIMARY' \
             AND TABLE_SCHEMA = {} AND TABLE_NAME = {} ORDER BY ORDINAL_POSITION",
            quote(&t.db),
            quote(&t.table)
        ))
        .map_err(Described::Client)?
        .into_iter()
        .filter_map(|r| r.into_iter().next().flatten().map(text))
        .collect();
    Ok((columns, pk))
}

//! The binlog stream: a replica connection that dumps the binlog from a GTID
//! position and turns its events into Sluice messages.
//!
//! Transactions that touch no captured table produce nothing (their GTIDs
//! still advance the position the next watermark carries). A transaction's
//! `begin` goes out with its first captured change, its `commit` at the XID
//! (or QUERY COMMIT, or the end of a standalone DDL statement).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::binlog::{self, kind, RowsKind, TableMap};
use crate::client::{quote, Client, ClientError};
use crate::ddl::{self, AlterOp, Ddl, TableRef};
use crate::lag::ReadPosition;
use crate::tables::{column_spec, table_name, Tables};
use crate::wire::Poll;
use crate::{check_server, watermark, Config, GtidPos};
use sluice_plugin_sdk::types::{
    AddColumn, Begin, Commit, Control, Delete, DropColumn, Insert, Message, PluginError, RenameTable, SchemaChange,
    Truncate, Update, UpdateColumn, Value,
};

/// How long an idle `next-batch` waits for an event.
const WAIT: Duration = Duration::from_millis(100);
/// How long one `next-batch` converts events before handing them over.
const BATCH_TIME: Duration = Duration::from_millis(300);

const COM_BINLOG_DUMP: u8 = 0x12;
const COM_REGISTER_SLAVE: u8 = 0x15;
/// ER_MASTER_FATAL_ERROR_READING_BINLOG: the requested position is gone.
const FATAL_READING_BINLOG: u16 = 1236;

pub struct Replication {
    pub replica_version: String,
    client: Client,
    endpoint: String,
    /// The counter of the last transaction handed out.
    counter: u64,
    /// The GTID position after the last transaction read.
    pos: GtidPos,
    /// Events carry CRC32s (known from the format description).
    checksums: bool,
    /// TABLE_MAPs of captured tables, by table id, with the relation their
    /// rows are sent under.
    maps: HashMap<u64, (TableMap, u32)>,
    tables: Tables,
    tx: Option<Tx>,
    /// A reset-required went out: this stream is over.
    pub ended: bool,
    /// Where in the binlog the dump has read to (for the position gap).
    pub read: ReadPosition,
    last_heard: Instant,
    silence_limit: Duration,
}

struct Tx {
    domain: u32,
    server: u32,
    seq: u64,
    standalone: bool,
    begun: bool,
    /// The watermark's counter: see the crate docs.
    counter: u64,
    watermark: String,
}

impl Replication {
    pub fn start(
        config: &Config,
        replica_version: String,
        counter: u64,
        pos: GtidPos,
        tables: Tables,
    ) -> Result<Box<Replication>, PluginError> {
        let endpoint = config.endpoint();
        let mut c = config.connect()?;
        check_server(&mut c, &endpoint)?;
        let fail = |what: &str, e: ClientError| PluginError::Transient(format!("MariaDB at {endpoint}: {what}: {e}"));
        let heartbeat_ns = config.heartbeat_ms.max(10) * 1_000_000;
        for sql in [
            "SET @master_binlog_checksum = @@global.binlog_checksum".to_string(),
            // Capability 4 (MARIA_SLAVE_CAPABILITY_GTID): GTID events and no
            // BEGIN; without it, GTIDs arrive as QUERY BEGIN.
            "SET @mariadb_slave_capability = 4".to_string(),
            format!("SET @slave_connect_state = {}", quote(&pos.to_string())),
            "SET @slave_gtid_strict_mode = 0".to_string(),
            "SET @slave_gtid_ignore_duplicates = 0".to_string(),
            format!("SET @master_heartbeat_period = {heartbeat_ns}"),
        ] {
            c.execute(&sql).map_err(|e| fail(&sql, e))?;
        }
        let mut reg = vec![COM_REGISTER_SLAVE];
        reg.extend_from_slice(&config.server_id.to_le_bytes());
        reg.extend_from_slice(&[0, 0, 0]); // hostname, user, password: empty
        reg.extend_from_slice(&0u16.to_le_bytes());
        reg.extend_from_slice(&0u32.to_le_bytes());
        reg.extend_from_slice(&0u32.to_le_bytes());
        c.conn.reset_seq();
        c.conn.write_packet(&reg).map_err(|e| fail("registering as a replica", e.into()))?;
        let ok = c.conn.read_packet().map_err(|e| fail("registering as a replica", e.into()))?;
        if ok.first() == Some(&0xff) {
            return Err(fail("registering as a replica", crate::client::server_error(&ok)));
        }
        let mut dump = vec![COM_BINLOG_DUMP];
        dump.extend_from_slice(&4u32.to_le_bytes());
        dump.extend_from_slice(&0u16.to_le_bytes()); // blocking: wait for new events
        dump.extend_from_slice(&config.server_id.to_le_bytes());
        c.conn.reset_seq();
        c.conn.write_packet(&dump).map_err(|e| fail("starting the binlog dump", e.into()))?;
        Ok(Box::new(Replication {
            replica_version,
            client: c,
            endpoint,
            counter,
            pos,
            checksums: false,
            maps: HashMap::new(),
            tables,
            tx: None,
            ended: false,
            read: ReadPosition::default(),
            last_heard: Instant::now(),
            silence_limit: Duration::from_millis(config.heartbeat_ms.max(10) * 3 + 2000),
        }))
    }

    pub fn next_batch(&mut self, config: &Config, max: usize, out: &mut Vec<Message>) -> Result<(), PluginError> {
        let started = Instant::now();
        while out.len() < max && started.elapsed() < BATCH_TIME && !self.ended {
            let wait = out.is_empty().then_some(WAIT);
            let packet = match self.client.conn.poll_packet(wait) {
                Ok(Poll::Packet(p)) => p,
                Ok(Poll::Pending) => {
                    if self.last_heard.elapsed() > self.silence_limit {
                        return Err(PluginError::Transient(format!(
                            "MariaDB at {}: no binlog event or heartbeat for {} ms",
                            self.endpoint,
                            self.last_heard.elapsed().as_millis()
                        )));
                    }
                    if wait.is_none() {
                        break;
                    }
                    continue;
                }
                Err(e) => return Err(PluginError::Transient(format!("MariaDB at {}: {e}", self.endpoint))),
            };
            self.last_heard = Instant::now();
            let before = out.len();
            if let Err(e) = self.packet(config, &packet, out) {
                out.truncate(before);
                return Err(e);
            }
            if self.ended {
                break;
            }
        }
        Ok(())
    }

    fn packet(&mut self, config: &Config, p: &[u8], out: &mut Vec<Message>) -> Result<(), PluginError> {
        match p.first() {
            Some(0x00) => {}
            Some(0xff) => {
                return match crate::client::server_error(p) {
                    ClientError::Server { code: FATAL_READING_BINLOG, message } => {
                        // The position is not in the server's binlogs (purged,
                        // or another server's history): this lineage is over.
                        self.reset(
                            out,
                            format!("MariaDB at {} cannot continue from GTID {}: {message}", self.endpoint, self.pos),
                        );
                        Ok(())
                    }
                    e => Err(PluginError::Transient(format!("MariaDB at {}: binlog dump: {e}", self.endpoint))),
                };
            }
            Some(0xfe) => {
                return Err(PluginError::Transient(format!("MariaDB at {} ended the binlog stream", self.endpoint)))
            }
            _ => return Err(PluginError::Transient(format!("MariaDB at {}: unexpected binlog packet", self.endpoint))),
        }
        let event = &p[1..];
        let bad = |e: String| PluginError::Transient(format!("MariaDB at {}: {e}", self.endpoint));
        let (h, body) = binlog::split(event, self.checksums).map_err(bad)?;
        self.read.advance(h.log_pos);
        match h.kind {
            kind::FORMAT_DESCRIPTION => self.checksums = binlog::fde_checksums(event),
            kind::ROTATE => {
                let (offset, file) = binlog::rotate(body).map_err(bad)?;
                self.read.rotate(offset, file);
            }
            // The server's own word on where the dump stands: its file (the
            // offset is the header's).
            kind::HEARTBEAT => {
                if let Ok(file) = std::str::from_utf8(body) {
                    let file = file.trim_end_matches('\0');
                    if !file.is_empty() {
                        self.read.file = file.to_string();
                    }
                }
            }
            kind::GTID => {
                let g = binlog::gtid(&h, body).map_err(bad)?;
                if let Some(tx) = &self.tx {
                    return Err(bad(format!(
                        "GTID {}-{}-{} began while {}-{}-{} was still open",
                        g.domain, g.server, g.seq, tx.domain, tx.server, tx.seq
                    )));
                }
                let mut next = self.pos.clone();
                next.set(g.domain, g.server, g.seq);
                self.tx = Some(Tx {
                    domain: g.domain,
                    server: g.server,
                    seq: g.seq,
                    standalone: g.standalone,
                    begun: false,
                    counter: (self.counter + 1).max(next.seq_sum()),
                    watermark: String::new(),
                });
                if let Some(tx) = self.tx.as_mut() {
                    tx.watermark = watermark(tx.counter, &next);
                }
            }
            kind::TABLE_MAP => {
                let map = binlog::table_map(body).map_err(bad)?;
                if config.captures(&map.db, &map.table) {
                    if !map.has_names {
                        return Err(PluginError::Fatal(format!(
                            "MariaDB at {}: the table map of {}.{} carries no column names \
                             (SET GLOBAL binlog_row_metadata=FULL)",
                            self.endpoint, map.db, map.table
                        )));
                    }
                    // Declared here, once per TABLE_MAP (again only when the
                    // columns or key differ), not per rows event.
                    let t = TableRef { db: map.db.clone(), table: map.table.clone() };
                    let names: Vec<String> = map.columns.iter().map(|c| c.name.clone()).collect();
                    let pk: Vec<String> = map.primary_key.iter().map(|&i| names[i].clone()).collect();
                    self.tables.observe(&t, &map.columns, pk.clone());
                    let relation = self.tables.declare(&t, names, pk, out);
                    self.maps.insert(map.table_id, (map, relation));
                } else {
                    self.maps.remove(&map.table_id);
                }
            }
            kind::WRITE_ROWS_V1
            | kind::UPDATE_ROWS_V1
            | kind::DELETE_ROWS_V1
            | kind::WRITE_ROWS_V2
            | kind::UPDATE_ROWS_V2
            | kind::DELETE_ROWS_V2 => {
                let id = binlog::rows_table_id(body).map_err(bad)?;
                let Some((map, relation)) = self.maps.get(&id) else { return Ok(()) };
                let rows = binlog::rows(h.kind, body, map).map_err(bad)?;
                let relation = *relation;
                self.begin(out)?;
                if let Some((map, _)) = self.maps.get(&id) {
                    convert_rows(relation, rows, &map.primary_key, out);
                }
            }
            kind::XID => self.commit(out, h.timestamp),
            kind::QUERY => {
                let q = binlog::query(body).map_err(bad)?;
                let sql = q.sql.trim();
                if sql.eq_ignore_ascii_case("BEGIN") {
                } else if sql.eq_ignore_ascii_case("COMMIT") {
                    self.commit(out, h.timestamp);
                } else if sql.eq_ignore_ascii_case("ROLLBACK") {
                    self.rollback(out);
                } else {
                    self.ddl(config, &q.db, sql, out)?;
                    if self.tx.as_ref().is_some_and(|t| t.standalone) {
                        self.commit(out, h.timestamp);
                    }
                }
            }
            kind::WRITE_ROWS_COMPRESSED_V1..=kind::DELETE_ROWS_COMPRESSED_V1 | kind::QUERY_COMPRESSED => {
                return Err(PluginError::Fatal(format!(
                    "MariaDB at {} writes compressed binlog events (log_bin_compress=ON), which are not supported",
                    self.endpoint
                )));
            }
            // GTID_LIST, ANNOTATE_ROWS, BINLOG_CHECKPOINT, STOP, ...:
            // nothing a replica needs.
            _ => {}
        }
        Ok(())
    }

    /// Opens the current transaction towards the host, once.
    fn begin(&mut self, out: &mut Vec<Message>) -> Result<(), PluginError> {
        if self.tx.is_none() {
            // A statement outside any GTID group (should not happen with
            // GTIDs on): give it its own transaction at the current position.
            self.tx = Some(Tx {
                domain: u32::MAX,
                server: 0,
                seq: 0,
                standalone: true,
                begun: false,
                counter: self.counter + 1,
                watermark: watermark(self.counter + 1, &self.pos),
            });
        }
        let Some(tx) = self.tx.as_mut() else { return Ok(()) };
        if !tx.begun {
            tx.begun = true;
            let extra =
                (tx.domain != u32::MAX).then(|| format!("{{\"gtid\":\"{}-{}-{}\"}}", tx.domain, tx.server, tx.seq));
            out.push(Message::Begin(Begin { commit_watermark: tx.watermark.clone(), extra }));
        }
        Ok(())
    }

    /// Ends the current transaction; `timestamp` is the committing event's
    /// (seconds), passed on as `commitTimeMs` so the host can measure the
    /// source's lag.
    fn commit(&mut self, out: &mut Vec<Message>, timestamp: u32) {
        let Some(tx) = self.tx.take() else { return };
        if tx.domain != u32::MAX {
            self.pos.set(tx.domain, tx.server, tx.seq);
        }
        if tx.begun {
            let extra = Some(format!("{{\"commitTimeMs\":{}}}", u64::from(timestamp) * 1000));
            out.push(Message::Commit(Commit { watermark: tx.watermark, extra }));
            self.counter = tx.counter;
        }
    }

    fn rollback(&mut self, out: &mut Vec<Message>) {
        let Some(tx) = self.tx.take() else { return };
        if tx.domain != u32::MAX {
            self.pos.set(tx.domain, tx.server, tx.seq);
        }
        if tx.begun {
            out.push(Message::Rollback);
        }
    }

    fn reset(&mut self, out: &mut Vec<Message>, why: String) {
        if self.tx.take().is_some_and(|t| t.begun) {
            out.push(Message::Rollback);
        }
        out.push(Message::Control(Control::ResetRequired(Some(why))));
        self.ended = true;
    }

    fn ddl(&mut self, config: &Config, db: &str, sql: &str, out: &mut Vec<Message>) -> Result<(), PluginError> {
        let cap = |t: &TableRef| config.captures(&t.db, &t.table);
        let parsed = ddl::parse(sql, db);
        let excerpt: String = sql.chars().take(300).collect();
        match parsed {
            Ddl::NotTables => {}
            Ddl::CreateTable { table, columns, primary_key } => {
                if cap(&table) {
                    self.begin(out)?;
                    self.tables.set(&table, columns, primary_key);
                    crate::tables::declaration(self.tables.spec(&table), out);
                }
            }
            Ddl::DropTables(tables) => {
                for t in tables.iter().filter(|t| cap(t)) {
                    self.begin(out)?;
                    out.push(Message::Schema(SchemaChange::DropTable(table_name(t))));
                    self.tables.drop(t);
                }
            }
            Ddl::RenameTables(pairs) => {
                for (a, b) in pairs {
                    match (cap(&a), cap(&b)) {
                        (true, true) => {
                            self.begin(out)?;
                            out.push(Message::Schema(SchemaChange::RenameTable(RenameTable {
                                old: table_name(&a),
                                new: table_name(&b),
                            })));
                            self.tables.rename(&a, &b);
                        }
                        (true, false) => {
                            self.begin(out)?;
                            out.push(Message::Schema(SchemaChange::DropTable(table_name(&a))));
                            self.tables.drop(&a);
                        }
                        (false, true) => {
                            self.reset(
                                out,
                                format!("table {}.{} was renamed into the capture: {excerpt}", a.db, a.table),
                            );
                            return Ok(());
                        }
                        (false, false) => {}
                    }
                }
            }
            Ddl::Truncate(t) => {
                if cap(&t) {
                    self.begin(out)?;
                    let id = self.tables.declare_known(&t, out);
                    out.push(Message::Truncate(Truncate { relations: vec![id] }));
                }
            }
            Ddl::Alter { table, ops } => {
                if !cap(&table) {
                    return Ok(());
                }
                for op in ops {
                    self.begin(out)?;
                    match op {
                        AlterOp::Add(def) => {
                            let pos = self.tables.columns(&table) + 1;
                            out.push(Message::Schema(SchemaChange::AddColumn(AddColumn {
                                table: table_name(&table),
                                column: column_spec(&def, pos),
                                table_metadata: None,
                            })));
                            self.tables.add_column(&table, def);
                        }
                        AlterOp::Drop(name) => {
                            out.push(Message::Schema(SchemaChange::DropColumn(DropColumn {
                                table: table_name(&table),
                                column: name.clone(),
                            })));
                            self.tables.drop_column(&table, &name);
                        }
                        AlterOp::Change { old, new, new_name } => {
                            let (pos, old_def) = match self.tables.column(&table, &old) {
                                Some((i, d)) => (i + 1, d),
                                None => match &new {
                                    Some(n) => (
                                        self.tables.columns(&table) + 1,
                                        ddl::ColumnDef { name: old.clone(), ..n.clone() },
                                    ),
                                    None => {
                                        self.reset(
                                            out,
                                            format!("cannot follow a rename of unknown column {old}: {excerpt}"),
                                        );
                                        return Ok(());
                                    }
                                },
                            };
                            let mut new_def = new.unwrap_or_else(|| old_def.clone());
                            new_def.name = new_name;
                            out.push(Message::Schema(SchemaChange::UpdateColumn(UpdateColumn {
                                table: table_name(&table),
                                old: column_spec(&old_def, pos),
                                new: column_spec(&new_def, pos),
                            })));
                            self.tables.change_column(&table, &old, new_def);
                        }
                        AlterOp::RenameTable(to) => {
                            if cap(&to) {
                                out.push(Message::Schema(SchemaChange::RenameTable(RenameTable {
                                    old: table_name(&table),
                                    new: table_name(&to),
                                })));
                                self.tables.rename(&table, &to);
                            } else {
                                out.push(Message::Schema(SchemaChange::DropTable(table_name(&table))));
                                self.tables.drop(&table);
                            }
                        }
                    }
                }
            }
            Ddl::Unsupported { tables, why } => {
                let touches = if tables.is_empty() { config.captures_db(db) } else { tables.iter().any(cap) };
                if touches {
                    self.reset(out, format!("mariadb-source cannot follow this DDL ({why}): {excerpt}"));
                }
            }
        }
        Ok(())
    }
}

/// Row images to inserts, updates and deletes. Old images carry the key
/// (every column for a table without a primary key).
fn convert_rows(relation: u32, rows: binlog::Rows, key: &[usize], out: &mut Vec<Message>) {
    let full =
        |img: Vec<Option<Value>>| -> Vec<Value> { img.into_iter().map(|v| v.unwrap_or(Value::Absent)).collect() };
    let key_only = |img: &[Option<Value>]| -> Vec<Value> {
        img.iter()
            .enumerate()
            .map(|(i, v)| if key.contains(&i) { v.clone().unwrap_or(Value::Absent) } else { Value::Absent })
            .collect()
    };
    let mut images = rows.images.into_iter();
    match rows.kind {
        RowsKind::Insert => {
            for img in images {
                out.push(Message::Insert(Insert { relation, new: full(img) }));
            }
        }
        RowsKind::Delete => {
            for img in images {
                let old = if key.is_empty() { full(img) } else { key_only(&img) };
                out.push(Message::Delete(Delete { relation, old }));
            }
        }
        RowsKind::Update => {
            while let (Some(before), Some(after)) = (images.next(), images.next()) {
                let old = if key.is_empty() {
                    Some(full(before))
                } else if key.iter().any(|&i| before.get(i) != after.get(i)) {
                    Some(key_only(&before))
                } else {
                    None
                };
                out.push(Message::Update(Update { relation, old, new: full(after) }));
            }
        }
    }
}

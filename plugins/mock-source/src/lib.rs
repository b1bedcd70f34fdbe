//! mock-source: a deterministic change source for tests, demos and benchmarks.
//!
//! Transaction `i` (counting from 1) has commit watermark `lexi(i)` and always
//! the same content for the same configuration, so a consumer can check exactly
//! what it received, and a stream resumed after watermark `W` continues with
//! identical transactions. Fault knobs make the plugin misbehave once per open
//! so the host's recovery paths can be exercised.

use std::time::{Duration, Instant};

use serde::Deserialize;

use sluice_plugin_sdk::types::{
    Begin, ColumnSpec, Commit, CreateTable, IndexSpec, Insert, KeyType, Message, PluginError, Relation, SchemaChange,
    SortOrder, TableSpec, Value,
};
use sluice_plugin_sdk::watermark::{from_lexi, to_lexi};
use sluice_plugin_sdk::{Progress, Resume, Source};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {
    /// Number of transactions to produce; `None` runs forever.
    transactions: Option<u64>,
    rows_per_tx: u32,
    tables: u32,
    row_bytes: usize,
    seed: u64,
    /// Transactions per second; 0 = as fast as the host pulls.
    rate: f64,
    replica_version: String,
    fail_after: Option<u64>,
    trap_after: Option<u64>,
    hang_after: Option<u64>,
    oom_after: Option<u64>,
    rollback_every: Option<u64>,
    interrupt_every: Option<u64>,
    /// Put the wall-clock time the commit was produced into the commit
    /// (`{"sentAtUs": ...}`), for latency measurements.
    timestamps: bool,
    /// Declare the tables in transaction 1 (`create-table` and a unique
    /// `create-index` per table, before its rows), as a real source's
    /// snapshot does, so consumers that build tables (zero-cache) can.
    /// Column `big` then holds 2^52 + id instead of 2^60 + id: Zero's
    /// clients refuse numbers beyond 2^53.
    schema: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            transactions: None,
            rows_per_tx: 10,
            tables: 1,
            row_bytes: 100,
            seed: 0,
            rate: 0.0,
            replica_version: "00".into(),
            fail_after: None,
            trap_after: None,
            hang_after: None,
            oom_after: None,
            rollback_every: None,
            interrupt_every: None,
            timestamps: false,
            schema: false,
        }
    }
}

/// Zero's LexiVersion of a transaction number.
fn lexi(n: u64) -> String {
    to_lexi(n.into())
}

fn unlexi(s: &str) -> Option<u64> {
    from_lexi(s).and_then(|n| u64::try_from(n).ok())
}

/// splitmix64: a tiny, well-distributed generator for deterministic payloads.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

struct State {
    config: Config,
    /// The transaction being emitted (or the next one).
    next_tx: u64,
    /// How many messages of `next_tx` were already sent (`None`: not started).
    emitted_in_tx: Option<u32>,
    declared: bool,
    messages_sent: u64,
    txs_since_open: u64,
    interrupted: bool,
    opened_at: Instant,
    first_tx: u64,
}

impl State {
    fn finished(&self) -> bool {
        matches!(self.config.transactions, Some(n) if self.next_tx > n)
    }

    /// Transactions that are due by now under the configured rate.
    fn due(&self) -> bool {
        if self.config.rate <= 0.0 {
            return true;
        }
        let elapsed = self.opened_at.elapsed().as_secs_f64();
        ((self.next_tx - self.first_tx) as f64) < elapsed * self.config.rate + 1.0
    }

    fn wait_for_due(&self) {
        if self.config.rate <= 0.0 {
            return;
        }
        let due_at = (self.next_tx - self.first_tx) as f64 / self.config.rate;
        let wait = due_at - self.opened_at.elapsed().as_secs_f64();
        if wait > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(wait.min(0.05)));
        }
    }

    fn table_name(&self, t: u32) -> String {
        format!("table{t}")
    }

    fn row(&self, tx: u64, j: u32) -> (u32, Vec<Value>) {
        let cfg = &self.config;
        let id = (tx - 1) * cfg.rows_per_tx as u64 + j as u64;
        let table = (id % cfg.tables as u64) as u32;
        let mut payload = String::with_capacity(cfg.row_bytes);
        let mut r = mix(cfg.seed ^ id);
        'fill: loop {
            r = mix(r);
            for k in 0..8 {
                if payload.len() >= cfg.row_bytes {
                    break 'fill;
                }
                payload.push((b'a' + ((r >> (k * 8)) as u8 % 26)) as char);
            }
        }
        (
            table,
            vec![
                Value::Int(id as i64),
                // Beyond 2^53 so consumers check big integers stay exact;
                // below it with `schema`, for consumers that serve Zero's
                // clients, which refuse numbers a double cannot hold.
                Value::Int((1i64 << if cfg.schema { 52 } else { 60 }) + id as i64),
                Value::Text(payload),
                Value::Text(lexi(tx)),
            ],
        )
    }

    /// Schema messages at the start of transaction `tx`.
    fn schema_messages(&self, tx: u64) -> u32 {
        if self.config.schema && tx == 1 {
            2 * self.config.tables
        } else {
            0
        }
    }

    /// Messages in transaction `tx`, begin and commit included.
    fn messages_in(&self, tx: u64) -> u32 {
        self.schema_messages(tx) + self.config.rows_per_tx + 2
    }

    /// The table declaration (`k` even) or its unique key index (`k` odd)
    /// of table `k / 2`.
    fn schema_message(&self, k: u32) -> Message {
        let table = self.table_name(k / 2);
        let change = if k.is_multiple_of(2) {
            let column = |pos: i32, name: &str, data_type: &str| ColumnSpec {
                name: name.into(),
                pos,
                data_type: data_type.into(),
                not_null: Some(name == "id"),
                default: None,
                character_max_length: None,
                pg_type_class: Some("b".into()),
                elem_pg_type_class: None,
            };
            SchemaChange::CreateTable(CreateTable {
                spec: TableSpec {
                    schema: "public".into(),
                    name: table,
                    columns: vec![
                        column(1, "id", "int8"),
                        column(2, "big", "int8"),
                        column(3, "payload", "text"),
                        column(4, "tx", "text"),
                    ],
                    primary_key: Some(vec!["id".into()]),
                },
                metadata: None,
            })
        } else {
            SchemaChange::CreateIndex(IndexSpec {
                schema: "public".into(),
                name: format!("{table}_pkey"),
                table_name: table,
                unique: true,
                columns: vec![("id".into(), SortOrder::Asc)],
            })
        };
        Message::Schema(change)
    }

    fn message_at(&self, tx: u64, k: u32) -> Message {
        let rows = self.config.rows_per_tx;
        if k == 0 {
            return Message::Begin(Begin { commit_watermark: lexi(tx), extra: None });
        }
        let ddl = self.schema_messages(tx);
        if k <= ddl {
            return self.schema_message(k - 1);
        }
        let k = k - ddl;
        if k <= rows {
            let (table, values) = self.row(tx, k - 1);
            return Message::Insert(Insert { relation: table, new: values });
        }
        if matches!(self.config.rollback_every, Some(n) if n > 0 && tx.is_multiple_of(n)) {
            Message::Rollback
        } else {
            let extra = self.config.timestamps.then(|| {
                let us = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_micros())
                    .unwrap_or(0);
                format!("{{\"sentAtUs\":{us}}}")
            });
            Message::Commit(Commit { watermark: lexi(tx), extra })
        }
    }

    fn interrupt_due(&self) -> bool {
        !self.interrupted
            && self.config.interrupt_every.is_some_and(|n| n > 0 && (self.txs_since_open + 1).is_multiple_of(n))
    }

    fn fault_due(&self) -> bool {
        let sent = self.messages_sent;
        let c = &self.config;
        [c.fail_after, c.trap_after, c.hang_after, c.oom_after].iter().any(|n| n.is_some_and(|n| sent >= n))
    }

    fn check_faults(&mut self) -> Result<(), PluginError> {
        let sent = self.messages_sent;
        let cfg = &mut self.config;
        if cfg.fail_after.is_some_and(|n| sent >= n) {
            cfg.fail_after = None;
            return Err(PluginError::Transient(format!("mock-source: injected failure after {sent} messages")));
        }
        if cfg.trap_after.is_some_and(|n| sent >= n) {
            panic!("mock-source: injected trap after {sent} messages");
        }
        if cfg.hang_after.is_some_and(|n| sent >= n) {
            eprintln!("mock-source: hanging after {sent} messages");
            #[allow(clippy::empty_loop)]
            loop {}
        }
        if cfg.oom_after.is_some_and(|n| sent >= n) {
            eprintln!("mock-source: allocating without bound after {sent} messages");
            let mut hoard: Vec<Vec<u8>> = Vec::new();
            loop {
                hoard.push(vec![1u8; 1 << 20]);
            }
        }
        Ok(())
    }
}

impl Source for State {
    fn open(config: &str, resume: Option<Resume>) -> Result<State, PluginError> {
        let config: Config = if config.trim().is_empty() {
            Config::default()
        } else {
            serde_json::from_str(config).map_err(|e| PluginError::InvalidConfig(format!("mock-source config: {e}")))?
        };
        if config.tables == 0 {
            return Err(PluginError::InvalidConfig("mock-source config: tables must be at least 1".into()));
        }
        let next_tx = match resume {
            None => 1,
            Some(Resume { watermark: w, .. }) => {
                unlexi(&w).ok_or_else(|| {
                    PluginError::Fatal(format!("mock-source cannot resume after watermark {w:?}: not a LexiVersion"))
                })? + 1
            }
        };
        Ok(State {
            config,
            next_tx,
            emitted_in_tx: None,
            declared: false,
            messages_sent: 0,
            txs_since_open: 0,
            interrupted: false,
            opened_at: Instant::now(),
            first_tx: next_tx,
        })
    }

    fn replica_version(&self) -> String {
        self.config.replica_version.clone()
    }

    fn next_batch(&mut self, max: u32) -> Result<Vec<Message>, PluginError> {
        let st = self;
        let mut out = Vec::new();
        if !st.declared {
            for t in 0..st.config.tables {
                out.push(Message::Relation(Relation {
                    id: t,
                    schema: "public".into(),
                    name: st.table_name(t),
                    columns: vec!["id".into(), "big".into(), "payload".into(), "tx".into()],
                    key_columns: vec!["id".into()],
                    key_type: KeyType::Default,
                }));
            }
            st.declared = true;
        }
        while (out.len() as u32) < max && !st.finished() {
            // Faults fire at the start of a call, so everything sent before them
            // reached the host (an interrupted transaction really is open there).
            if st.fault_due() && !out.is_empty() {
                break;
            }
            st.check_faults()?;
            if st.emitted_in_tx.is_none() && !st.due() {
                if out.is_empty() {
                    st.wait_for_due();
                    if !st.due() {
                        break;
                    }
                } else {
                    break;
                }
            }
            let tx = st.next_tx;
            let k = st.emitted_in_tx.unwrap_or(0);
            if k == 1 && st.interrupt_due() {
                if !out.is_empty() {
                    break;
                }
                st.interrupted = true;
                return Err(PluginError::Transient(format!(
                    "mock-source: injected interruption inside transaction {}",
                    lexi(tx)
                )));
            }
            out.push(st.message_at(tx, k));
            st.messages_sent += 1;
            if k + 1 == st.messages_in(tx) {
                st.next_tx += 1;
                st.emitted_in_tx = None;
                st.txs_since_open += 1;
            } else {
                st.emitted_in_tx = Some(k + 1);
            }
        }
        if out.is_empty() && st.finished() {
            // Nothing more will come: wait a little so an idle host does not spin.
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(out)
    }

    fn ack(&mut self, _watermark: &str) -> Result<(), PluginError> {
        Ok(())
    }

    /// Transaction 1 is a new lineage's snapshot, and its row count is known.
    fn progress(&mut self) -> Progress {
        let snapshotting = self.next_tx == 1;
        Progress {
            behind_bytes: None,
            snapshot_rows_estimate: snapshotting.then_some(u64::from(self.config.rows_per_tx)),
        }
    }
}

sluice_plugin_sdk::export_source!(State);

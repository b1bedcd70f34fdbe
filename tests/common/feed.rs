//! A change source fed by the test, for the storage and subscriber suites.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sluice::source::model::{Begin, Commit, Delete, Insert, KeyType, Message, Relation, Value};
use sluice::source::{ChangeSource, ChangeStream, Resume, SourceError};

/// A source fed by the test: messages are delivered in the order pushed;
/// `fail` ends the current stream, later messages go to the next open.
#[derive(Clone, Default)]
pub struct Feed {
    pub items: Arc<Mutex<VecDeque<Option<Message>>>>,
    pub opens: Arc<Mutex<Vec<Option<String>>>>,
    /// Every watermark the host acked, in order.
    pub acks: Arc<Mutex<Vec<String>>>,
    /// See [`Feed::with_snapshot`].
    pub snapshot: bool,
}

/// The replica version of a [`Feed::with_snapshot`] source, and its snapshot.
pub const SNAPSHOT_RV: &str = "00";
pub const SNAPSHOT: &str = "01";

impl Feed {
    /// A source like a real one: replica version `00`, and a fresh open
    /// (no snapshot stored yet) streams an empty snapshot transaction at `01`
    /// first, which establishes the lineage (subscribers are served from then
    /// on). The plain feed (replica version `01`) sends only what is pushed.
    pub fn with_snapshot() -> Feed {
        Feed { snapshot: true, ..Feed::default() }
    }

    pub fn push(&self, m: Message) {
        self.items.lock().unwrap().push_back(Some(m));
    }
    pub fn fail(&self) {
        self.items.lock().unwrap().push_back(None);
    }
    pub fn tx(&self, w: &str, ids: &[i64]) {
        self.push(begin(w));
        for id in ids {
            self.push(insert(*id));
        }
        self.push(commit(w));
    }
}

struct FeedStream(Feed);

impl FeedStream {
    fn rv(&self) -> &'static str {
        if self.0.snapshot {
            SNAPSHOT_RV
        } else {
            "01"
        }
    }
}

#[async_trait]
impl ChangeSource for Feed {
    fn name(&self) -> &str {
        "feed"
    }
    async fn open(&mut self, resume: Option<Resume<'_>>) -> Result<Box<dyn ChangeStream>, SourceError> {
        let fresh = resume.is_none_or(|r| r.watermark == r.replica_version);
        self.opens.lock().unwrap().push(resume.map(|r| r.watermark.to_string()));
        let mut items = self.items.lock().unwrap();
        if self.snapshot && fresh {
            items.push_front(Some(commit(SNAPSHOT)));
            items.push_front(Some(begin(SNAPSHOT)));
        }
        items.push_front(Some(relation()));
        Ok(Box::new(FeedStream(self.clone())))
    }
}

#[async_trait]
impl ChangeStream for FeedStream {
    fn replica_version(&self) -> &str {
        self.rv()
    }
    async fn next_batch(&mut self, _max: u32) -> Result<Vec<Message>, SourceError> {
        let next = self.0.items.lock().unwrap().pop_front();
        match next {
            Some(Some(m)) => Ok(vec![m]),
            Some(None) => Err(SourceError::Transient("feed: injected failure".into())),
            None => {
                tokio::time::sleep(Duration::from_millis(2)).await;
                Ok(vec![])
            }
        }
    }
    async fn ack(&mut self, watermark: &str) -> Result<(), SourceError> {
        self.0.acks.lock().unwrap().push(watermark.to_string());
        Ok(())
    }
}

pub fn relation() -> Message {
    Message::Relation(Relation {
        id: 0,
        schema: "public".into(),
        name: "foo".into(),
        columns: vec!["id".into(), "big".into()],
        key_columns: vec!["id".into()],
        key_type: KeyType::Default,
    })
}
pub fn begin(w: &str) -> Message {
    Message::Begin(Begin { commit_watermark: w.into(), extra: None })
}
pub fn insert(id: i64) -> Message {
    Message::Insert(Insert { relation: 0, new: vec![Value::Int(id), Value::Int(987654321987654321 + id)] })
}
pub fn delete(id: i64) -> Message {
    Message::Delete(Delete { relation: 0, old: vec![Value::Int(id), Value::Absent] })
}
pub fn commit(w: &str) -> Message {
    Message::Commit(Commit { watermark: w.into(), extra: None })
}

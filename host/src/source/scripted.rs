//! A source that plays scripts: for the loop's rules tested beside it
//! (`streamer/rules.rs`) and for the integration tests, as the in-memory
//! log (`storage::memory`) is for storage. Not for production use.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use super::model::{Begin, Commit, Insert, KeyType, Message, Relation, Status, Value};
use super::{ChangeSource, ChangeStream, Resume, SourceError};

/// The replica version and the messages (or failures) of one open.
pub type Script = (String, Vec<Result<Message, String>>);

/// Plays one script per open (the last one again for later opens), and
/// records where each open resumed and what was acked.
#[derive(Clone, Default)]
pub struct Scripted {
    scripts: Arc<Vec<Script>>,
    opens: Arc<Mutex<Vec<Option<String>>>>,
    acks: Arc<Mutex<Vec<String>>>,
}

impl Scripted {
    pub fn new(scripts: Vec<(&str, Vec<Result<Message, String>>)>) -> Scripted {
        Scripted {
            scripts: Arc::new(scripts.into_iter().map(|(rv, s)| (rv.to_string(), s)).collect()),
            ..Default::default()
        }
    }

    /// Where each open resumed (`None`: from the start of a lineage).
    pub fn opens(&self) -> Vec<Option<String>> {
        self.opens.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The watermarks acked, in order.
    pub fn acks(&self) -> Vec<String> {
        self.acks.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

struct ScriptedStream {
    replica_version: String,
    items: std::vec::IntoIter<Result<Message, String>>,
    acks: Arc<Mutex<Vec<String>>>,
}

#[async_trait]
impl ChangeSource for Scripted {
    fn name(&self) -> &str {
        "scripted"
    }

    async fn open(&mut self, resume: Option<Resume<'_>>) -> Result<Box<dyn ChangeStream>, SourceError> {
        let mut opens = self.opens.lock().unwrap_or_else(|e| e.into_inner());
        opens.push(resume.map(|r| r.watermark.to_string()));
        let Some((rv, script)) = self.scripts.get((opens.len() - 1).min(self.scripts.len().saturating_sub(1))) else {
            return Err(SourceError::Fatal("no script to play".into()));
        };
        Ok(Box::new(ScriptedStream {
            replica_version: rv.clone(),
            items: script.clone().into_iter(),
            acks: self.acks.clone(),
        }))
    }
}

#[async_trait]
impl ChangeStream for ScriptedStream {
    fn replica_version(&self) -> &str {
        &self.replica_version
    }

    async fn next_batch(&mut self, _max: u32) -> Result<Vec<Message>, SourceError> {
        match self.items.next() {
            Some(Ok(m)) => Ok(vec![m]),
            Some(Err(e)) => Err(SourceError::Transient(e)),
            None => {
                tokio::time::sleep(Duration::from_millis(5)).await;
                Ok(vec![])
            }
        }
    }

    async fn ack(&mut self, watermark: &str) -> Result<(), SourceError> {
        self.acks.lock().unwrap_or_else(|e| e.into_inner()).push(watermark.to_string());
        Ok(())
    }
}

/// Table `public.foo (id)`, relation 0.
pub fn relation() -> Result<Message, String> {
    Ok(Message::Relation(Relation {
        id: 0,
        schema: "public".into(),
        name: "foo".into(),
        columns: vec!["id".into()],
        key_columns: vec!["id".into()],
        key_type: KeyType::Default,
    }))
}

pub fn begin(w: &str) -> Result<Message, String> {
    Ok(Message::Begin(Begin { commit_watermark: w.into(), extra: None }))
}

/// A row of `public.foo`.
pub fn insert(id: i64) -> Result<Message, String> {
    Ok(Message::Insert(Insert { relation: 0, new: vec![Value::Int(id)] }))
}

/// A commit carrying `{"extra":"fields"}`.
pub fn commit(w: &str) -> Result<Message, String> {
    Ok(Message::Commit(Commit { watermark: w.into(), extra: Some(r#"{"extra":"fields"}"#.into()) }))
}

pub fn status(w: &str, ack: bool) -> Result<Message, String> {
    Ok(Message::Status(Status { watermark: w.into(), ack }))
}

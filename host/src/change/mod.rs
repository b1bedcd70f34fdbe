//! Changes as they travel through Sluice: serialized once, shared everywhere.
//!
//! A source message is encoded exactly once into the canonical JSON tuple that
//! subscribers receive (`["data",{...}]`, `["begin",{...},{"commitWatermark":"w"}]`,
//! ...). The change log stores only the inner object (the second element), and
//! replaying from the log rebuilds the tuple byte for byte, so live and
//! caught-up subscribers see identical frames (Zero's change-log codec).

mod encode;
pub mod json;

pub use encode::{schema_tag, EncodeError, Encoder, Event};

use std::ops::Range;
use std::sync::Arc;

/// What kind of message a change is; decides how it is stored and replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Begin,
    Commit,
    Rollback,
    /// A data or schema change (`["data", {...}]`).
    Data,
}

/// One encoded message of a transaction.
#[derive(Debug, Clone)]
pub struct Change {
    pub kind: Kind,
    /// The `tag` of the inner object (`"insert"`, `"create-table"`, `"begin"`...).
    pub tag: &'static str,
    /// The full JSON tuple sent to subscribers.
    pub json: Arc<str>,
    /// Where the inner object (what the change log stores) sits in `json`.
    inner: Range<usize>,
}

impl Change {
    /// The inner object, as stored in the change log's `change` column.
    pub fn stored(&self) -> &str {
        &self.json[self.inner.clone()]
    }

    /// Rebuilds a change from a change-log row, byte-identical to the one that
    /// was forwarded live. `watermark` is the row's watermark.
    pub fn from_stored(tag: &str, stored: &str, watermark: &str) -> Change {
        let kind = kind_of(tag);
        let mut json = String::with_capacity(stored.len() + watermark.len() + 40);
        let head = match kind {
            Kind::Begin => "[\"begin\",",
            Kind::Commit => "[\"commit\",",
            Kind::Rollback => "[\"rollback\",",
            Kind::Data => "[\"data\",",
        };
        json.push_str(head);
        let start = json.len();
        json.push_str(stored);
        let end = json.len();
        finish_tuple(&mut json, kind, watermark);
        Change { kind, tag: static_tag(tag), json: json.into(), inner: start..end }
    }

    /// The synthetic rollback forwarded when a stream ends inside a transaction.
    pub fn rollback() -> Change {
        let json = "[\"rollback\",{\"tag\":\"rollback\"}]";
        Change { kind: Kind::Rollback, tag: "rollback", json: json.into(), inner: 12..json.len() - 1 }
    }
}

/// Appends the tuple's tail: the watermark element for begin and commit.
pub(crate) fn finish_tuple(json: &mut String, kind: Kind, watermark: &str) {
    match kind {
        Kind::Begin => {
            json.push_str(",{\"commitWatermark\":");
            json::push_str(json, watermark);
            json.push_str("}]");
        }
        Kind::Commit => {
            json.push_str(",{\"watermark\":");
            json::push_str(json, watermark);
            json.push_str("}]");
        }
        Kind::Rollback | Kind::Data => json.push(']'),
    }
}

fn kind_of(tag: &str) -> Kind {
    match tag {
        "begin" => Kind::Begin,
        "commit" => Kind::Commit,
        "rollback" => Kind::Rollback,
        _ => Kind::Data,
    }
}

/// Every tag Sluice produces; stored tags map back onto these.
const TAGS: &[&str] = &[
    "begin",
    "commit",
    "rollback",
    "insert",
    "update",
    "delete",
    "truncate",
    "create-table",
    "rename-table",
    "add-column",
    "update-column",
    "drop-column",
    "drop-table",
    "create-index",
    "drop-index",
    "update-table-metadata",
    "backfill",
    "backfill-completed",
];

fn static_tag(tag: &str) -> &'static str {
    TAGS.iter().copied().find(|t| *t == tag).unwrap_or("data")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rollback_extracts_inner_object() {
        let r = Change::rollback();
        assert_eq!(r.stored(), "{\"tag\":\"rollback\"}");
        let again = Change::from_stored("rollback", r.stored(), "05");
        assert_eq!(again.json, r.json);
    }

    #[test]
    fn begin_and_commit_round_trip_through_the_log() {
        for (tag, json) in [
            ("begin", "[\"begin\",{\"tag\":\"begin\",\"xid\":7},{\"commitWatermark\":\"0b\"}]"),
            ("commit", "[\"commit\",{\"tag\":\"commit\"},{\"watermark\":\"0b\"}]"),
            ("insert", "[\"data\",{\"tag\":\"insert\",\"new\":{\"a\":1,\"b\":\"x,y\"}}]"),
        ] {
            let first = json.find(',').unwrap() + 1;
            let last = if tag == "insert" { json.len() - 1 } else { json.rfind(',').unwrap() };
            let stored = &json[first..last];
            let c = Change::from_stored(tag, stored, "0b");
            assert_eq!(&*c.json, json);
            assert_eq!(c.stored(), stored);
        }
    }
}

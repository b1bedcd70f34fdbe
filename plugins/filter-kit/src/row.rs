//! row-filter: a predicate on column values, with row movement.
//!
//! Config:
//! ```json
//! {"table": "public.items", "where": {"and": [
//!     {"column": "status", "op": "=", "value": "open"},
//!     {"column": "n", "op": ">=", "value": 10},
//!     {"not": {"column": "owner", "op": "is null"}},
//!     {"column": "kind", "op": "in", "values": ["a", "b"]}]}}
//! ```
//! `table` is a `schema.table` glob; other tables pass unchanged. Operators:
//! `= != < <= > >=`, `in`, `is null`, `is not null`, combined with `and`,
//! `or`, `not`. Comparisons follow SQL: with a NULL operand they are unknown,
//! and a row is in the view only when the predicate is true.
//!
//! Row movement: an insert passes if its row matches. An update whose new row
//! matches passes, or becomes an insert when the old row is known not to have
//! matched; an update whose new row does not match is dropped when the old
//! row is known not to have matched, and otherwise becomes a delete of the
//! key (the row leaves the view). What "known" means depends on the replica
//! identity: with `FULL` the old row is complete; with the default (primary
//! key) identity only the old key is known, so only a predicate on key
//! columns can be judged on it. A delete is dropped only when its old row is
//! known not to have matched. A predicate on a column the change leaves out
//! (an unchanged TOASTed value) cannot be judged: the change passes as is.

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::{glob_match, scan, Filter, Policy, Verdict};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    table: String,
    #[serde(rename = "where")]
    predicate: Expr,
}

#[derive(Deserialize)]
#[serde(untagged, deny_unknown_fields)]
enum Expr {
    And {
        and: Vec<Expr>,
    },
    Or {
        or: Vec<Expr>,
    },
    Not {
        not: Box<Expr>,
    },
    In {
        column: String,
        #[serde(rename = "op")]
        _op: InOp,
        values: Vec<Value>,
    },
    Compare {
        column: String,
        op: Op,
        #[serde(default)]
        value: Value,
    },
}

#[derive(Deserialize)]
enum InOp {
    #[serde(rename = "in")]
    In,
}

#[derive(Deserialize, Clone, Copy)]
enum Op {
    #[serde(rename = "=")]
    Eq,
    #[serde(rename = "!=")]
    Ne,
    #[serde(rename = "<")]
    Lt,
    #[serde(rename = "<=")]
    Le,
    #[serde(rename = ">")]
    Gt,
    #[serde(rename = ">=")]
    Ge,
    #[serde(rename = "is null")]
    IsNull,
    #[serde(rename = "is not null")]
    IsNotNull,
}

/// SQL's three values, plus "the row does not carry that column".
#[derive(Clone, Copy, PartialEq, Debug)]
enum Truth {
    True,
    False,
    Null,
    Missing,
}

fn order(a: &Value, b: &Value) -> Option<std::cmp::Ordering> {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_i64(), y.as_i64()) {
            (Some(x), Some(y)) => Some(x.cmp(&y)),
            _ => match (x.as_u64(), y.as_u64()) {
                (Some(x), Some(y)) => Some(x.cmp(&y)),
                _ => x.as_f64()?.partial_cmp(&y.as_f64()?),
            },
        },
        (Value::String(x), Value::String(y)) => Some(x.cmp(y)),
        (Value::Bool(x), Value::Bool(y)) => Some(x.cmp(y)),
        _ => None,
    }
}

impl Expr {
    fn eval(&self, row: &Map<String, Value>) -> Truth {
        use Truth::*;
        match self {
            Expr::And { and } => and.iter().fold(True, |acc, e| match (acc, e.eval(row)) {
                (Missing, _) | (_, Missing) => Missing,
                (False, _) | (_, False) => False,
                (Null, _) | (_, Null) => Null,
                _ => True,
            }),
            Expr::Or { or } => or.iter().fold(False, |acc, e| match (acc, e.eval(row)) {
                (Missing, _) | (_, Missing) => Missing,
                (True, _) | (_, True) => True,
                (Null, _) | (_, Null) => Null,
                _ => False,
            }),
            Expr::Not { not } => match not.eval(row) {
                True => False,
                False => True,
                other => other,
            },
            Expr::In { column, values, .. } => match row.get(column) {
                None => Missing,
                Some(Value::Null) => Null,
                Some(v) => {
                    if values.iter().any(|x| order(v, x) == Some(std::cmp::Ordering::Equal)) {
                        True
                    } else {
                        False
                    }
                }
            },
            Expr::Compare { column, op, value } => {
                let Some(v) = row.get(column) else { return Missing };
                match op {
                    Op::IsNull => return if v.is_null() { True } else { False },
                    Op::IsNotNull => return if v.is_null() { False } else { True },
                    _ => {}
                }
                if v.is_null() || value.is_null() {
                    return Null;
                }
                let Some(o) = order(v, value) else { return False };
                use std::cmp::Ordering::*;
                let yes = match op {
                    Op::Eq => o == Equal,
                    Op::Ne => o != Equal,
                    Op::Lt => o == Less,
                    Op::Le => o != Greater,
                    Op::Gt => o == Greater,
                    Op::Ge => o != Less,
                    Op::IsNull | Op::IsNotNull => false,
                };
                if yes {
                    True
                } else {
                    False
                }
            }
        }
    }
}

pub struct RowFilter {
    table: String,
    predicate: Expr,
    /// The columns the predicate reads: only these are parsed from a row.
    columns: Vec<String>,
}

impl Expr {
    fn columns(&self, out: &mut Vec<String>) {
        match self {
            Expr::And { and: list } | Expr::Or { or: list } => list.iter().for_each(|e| e.columns(out)),
            Expr::Not { not } => not.columns(out),
            Expr::In { column, .. } | Expr::Compare { column, .. } => {
                if !out.contains(column) {
                    out.push(column.clone());
                }
            }
        }
    }
}

/// Only `columns` of a row object, parsed; `None` for anything else (null,
/// absent). The rest of the row is skipped by the scanner, never parsed.
fn pick(raw: Option<&str>, columns: &[String]) -> Option<Map<String, Value>> {
    let mut out = Map::new();
    for (k, v) in scan::members(raw?)? {
        let key = scan::key_text(k)?;
        if columns.iter().any(|c| **c == *key) {
            out.insert(key.into_owned(), serde_json::from_str(v).ok()?);
        }
    }
    Some(out)
}

impl RowFilter {
    fn test(&self, row: Option<&str>) -> Truth {
        match pick(row, &self.columns) {
            Some(r) => self.predicate.eval(&r),
            None => Truth::Missing,
        }
    }

    /// The key of the row an update leaves the view with: the old key when
    /// it changed, else the key columns of the new row.
    fn key_of(&self, change: &scan::RowParts<'_>) -> String {
        let columns = crate::key_columns(change.relation);
        let from = if change.key.is_some() { change.key } else { change.new };
        Value::Object(pick(from, &columns).unwrap_or_default()).to_string()
    }

    /// The host sends only row changes of tables whose policy is `inspect`
    /// (this filter's table), plus truncates and schema changes, which pass.
    fn verdict(&self, tag: &str, json: &str) -> Verdict {
        if !matches!(tag, "insert" | "update" | "delete") {
            return Verdict::Keep;
        }
        let Some(c) = scan::row_parts(json) else { return Verdict::Keep };
        match tag {
            "insert" => match self.test(c.new) {
                Truth::Missing | Truth::True => Verdict::Keep,
                _ => Verdict::Drop,
            },
            "delete" => match self.test(c.key) {
                Truth::False | Truth::Null => Verdict::Drop,
                _ => Verdict::Keep,
            },
            _ => {
                let new = self.test(c.new);
                if new == Truth::Missing {
                    return Verdict::Keep;
                }
                // `key` is the old key (or the whole old row under FULL);
                // null when the key did not change.
                let old = self.test(c.key);
                match (new == Truth::True, old) {
                    (true, Truth::False | Truth::Null) => Verdict::Replace(format!(
                        "{{\"tag\":\"insert\",\"relation\":{},\"new\":{}}}",
                        c.relation,
                        c.new.unwrap_or("{}")
                    )),
                    (true, _) => Verdict::Keep,
                    (false, Truth::False | Truth::Null) => Verdict::Drop,
                    (false, _) => Verdict::Replace(format!(
                        "{{\"tag\":\"delete\",\"relation\":{},\"key\":{}}}",
                        c.relation,
                        self.key_of(&c)
                    )),
                }
            }
        }
    }
}

impl Filter for RowFilter {
    fn from_config(config: &str) -> Result<Self, String> {
        let c: Config = serde_json::from_str(config).map_err(|e| {
            format!("{e} (expected {{\"table\": \"schema.table\", \"where\": {{\"column\": .., \"op\": .., \"value\": ..}}}})")
        })?;
        if !c.table.contains('.') {
            return Err(format!("table {:?} must have the form schema.table", c.table));
        }
        let mut columns = Vec::new();
        c.predicate.columns(&mut columns);
        Ok(RowFilter { table: c.table, predicate: c.predicate, columns })
    }

    fn policy(&self, schema: &str, table: &str) -> Policy {
        if glob_match(&self.table, &format!("{schema}.{table}")) {
            Policy::Inspect
        } else {
            Policy::KeepAll
        }
    }

    fn decide(&self, tag: &str, json: &str) -> Verdict {
        self.verdict(tag, json)
    }
}

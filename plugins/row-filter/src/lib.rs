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

use filter_kit::{glob_match, row_key, table_of};
use serde::Deserialize;
use serde_json::{json, Map, Value};

wit_bindgen::generate!({ path: "../../wit", world: "filter-plugin" });

use exports::sluice::plugin::filter::{Change, ChangeFilter, Decision, Guest, GuestChangeFilter, TablePolicy};
use sluice::plugin::types::PluginError;

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

struct RowFilter {
    table: String,
    predicate: Expr,
}

impl RowFilter {
    fn test(&self, row: &Value) -> Truth {
        match row.as_object() {
            Some(r) => self.predicate.eval(r),
            None => Truth::Missing,
        }
    }

    fn decide(&self, change: &Change) -> Decision {
        let Ok(v) = serde_json::from_str::<Value>(&change.json) else { return Decision::Keep };
        let ours = table_of(&v).is_some_and(|(s, n)| glob_match(&self.table, &format!("{s}.{n}")));
        if !ours {
            return Decision::Keep;
        }
        let in_view = |t: Truth| t == Truth::True;
        match change.tag.as_str() {
            "insert" => match self.test(&v["new"]) {
                Truth::Missing | Truth::True => Decision::Keep,
                _ => Decision::Drop,
            },
            "delete" => match self.test(&v["key"]) {
                Truth::False | Truth::Null => Decision::Drop,
                _ => Decision::Keep,
            },
            "update" => {
                let new = self.test(&v["new"]);
                if new == Truth::Missing {
                    return Decision::Keep;
                }
                // `key` is the old key (or the whole old row under FULL);
                // null when the key did not change.
                let old = if v["key"].is_object() { self.test(&v["key"]) } else { Truth::Missing };
                match (in_view(new), old) {
                    (true, Truth::False | Truth::Null) => Decision::Replace(
                        json!({"tag": "insert", "relation": v["relation"], "new": v["new"]}).to_string(),
                    ),
                    (true, _) => Decision::Keep,
                    (false, Truth::False | Truth::Null) => Decision::Drop,
                    (false, _) => {
                        let key = if v["key"].is_object() {
                            let (columns, _) = row_key(&v);
                            let old = &v["key"];
                            Value::Object(columns.iter().map(|c| (c.to_string(), old[*c].clone())).collect())
                        } else {
                            let (columns, _) = row_key(&v);
                            Value::Object(columns.iter().map(|c| (c.to_string(), v["new"][*c].clone())).collect())
                        };
                        Decision::Replace(json!({"tag": "delete", "relation": v["relation"], "key": key}).to_string())
                    }
                }
            }
            _ => Decision::Keep,
        }
    }
}

struct Component;

impl Guest for Component {
    type ChangeFilter = RowFilter;

    fn create(config: String) -> Result<ChangeFilter, PluginError> {
        let c: Config = serde_json::from_str(&config).map_err(|e| {
            PluginError::InvalidConfig(format!(
                "{e} (expected {{\"table\": \"schema.table\", \"where\": {{\"column\": .., \"op\": .., \"value\": ..}}}})"
            ))
        })?;
        if !c.table.contains('.') {
            return Err(PluginError::InvalidConfig(format!("table {:?} must have the form schema.table", c.table)));
        }
        Ok(ChangeFilter::new(RowFilter { table: c.table, predicate: c.predicate }))
    }
}

impl GuestChangeFilter for RowFilter {
    fn table_policy(&self, schema: String, name: String) -> TablePolicy {
        if glob_match(&self.table, &format!("{schema}.{name}")) {
            TablePolicy::Inspect
        } else {
            TablePolicy::KeepAll
        }
    }

    fn apply(&self, batch: Vec<Change>) -> Vec<Decision> {
        batch.iter().map(|c| self.decide(c)).collect()
    }
}

export!(Component);

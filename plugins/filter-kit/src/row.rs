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

use std::cmp::Ordering;

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

#[derive(Deserialize, Clone, Copy, Debug)]
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

impl Truth {
    fn of(yes: bool) -> Truth {
        if yes {
            Truth::True
        } else {
            Truth::False
        }
    }
}

/// A JSON number: integers (anything that fits i128, so every i64 and u64)
/// compare exactly, anything else as f64.
#[derive(Clone, Copy, Debug)]
enum Num {
    Int(i128),
    Float(f64),
}

impl Num {
    /// Integers of up to 18 digits (most values), read directly: a plain
    /// loop in 64 bits (iterator chains and 128-bit numbers cost several
    /// times more in a plugin).
    #[inline(always)]
    fn small_int(b: &[u8]) -> Option<i64> {
        let negative = b.first() == Some(&b'-');
        let digits = &b[negative as usize..];
        if digits.is_empty() || digits.len() > 18 {
            return None;
        }
        let mut n = 0i64;
        for d in digits {
            if !d.is_ascii_digit() {
                return None;
            }
            n = n * 10 + (d - b'0') as i64;
        }
        Some(if negative { -n } else { n })
    }

    fn parse(raw: &str) -> Option<Num> {
        let b = raw.as_bytes();
        if let Some(n) = Num::small_int(b) {
            return Some(Num::Int(n as i128));
        }
        if !b.iter().any(|b| matches!(b, b'.' | b'e' | b'E')) {
            if let Ok(i) = raw.parse::<i128>() {
                return Some(Num::Int(i));
            }
        }
        raw.parse::<f64>().ok().map(Num::Float)
    }

    fn float(&self) -> f64 {
        match *self {
            Num::Int(i) => i as f64,
            Num::Float(f) => f,
        }
    }

    fn cmp(&self, other: &Num) -> Option<Ordering> {
        match (self, other) {
            (Num::Int(a), Num::Int(b)) => Some(a.cmp(b)),
            _ => self.float().partial_cmp(&other.float()),
        }
    }
}

/// A constant of the predicate, parsed once when the filter is created.
#[derive(Debug)]
enum Const {
    Null,
    Bool(bool),
    Num(Num),
    Str(String),
    /// Arrays and objects: equal to nothing, ordered against nothing.
    Other,
}

impl Const {
    fn from_json(v: &Value) -> Const {
        match v {
            Value::Null => Const::Null,
            Value::Bool(b) => Const::Bool(*b),
            Value::Number(n) => Num::parse(&n.to_string()).map_or(Const::Other, Const::Num),
            Value::String(s) => Const::Str(s.clone()),
            Value::Array(_) | Value::Object(_) => Const::Other,
        }
    }
}

/// How a raw JSON value of a row orders against a constant; `None` when the
/// two are not comparable (different types, arrays, objects).
fn order(raw: &str, c: &Const) -> Option<Ordering> {
    match (raw.as_bytes().first()?, c) {
        (b'"', Const::Str(s)) => {
            let body = raw.get(1..raw.len() - 1)?;
            if scan::has_escape(body) {
                let text: String = serde_json::from_str(raw).ok()?;
                Some(text.as_str().cmp(s.as_str()))
            } else {
                Some(body.cmp(s.as_str()))
            }
        }
        (b'-' | b'0'..=b'9', Const::Num(n)) => match (Num::small_int(raw.as_bytes()), n) {
            (Some(v), Num::Int(c)) => Some((v as i128).cmp(c)),
            _ => Num::parse(raw)?.cmp(n),
        },
        (b't', Const::Bool(b)) => Some(true.cmp(b)),
        (b'f', Const::Bool(b)) => Some(false.cmp(b)),
        _ => None,
    }
}

/// The predicate, with columns as indexes into the filter's column list.
enum Node {
    And(Vec<Node>),
    Or(Vec<Node>),
    Not(Box<Node>),
    In { column: usize, values: Vec<Const> },
    Compare { column: usize, op: Op, value: Const },
}

impl Node {
    fn compile(e: &Expr, columns: &mut Vec<String>) -> Node {
        let mut index = |c: &String| match columns.iter().position(|x| x == c) {
            Some(i) => i,
            None => {
                columns.push(c.clone());
                columns.len() - 1
            }
        };
        match e {
            Expr::And { and } => Node::And(and.iter().map(|e| Node::compile(e, columns)).collect()),
            Expr::Or { or } => Node::Or(or.iter().map(|e| Node::compile(e, columns)).collect()),
            Expr::Not { not } => Node::Not(Box::new(Node::compile(not, columns))),
            Expr::In { column, values, .. } => {
                Node::In { column: index(column), values: values.iter().map(Const::from_json).collect() }
            }
            Expr::Compare { column, op, value } => {
                Node::Compare { column: index(column), op: *op, value: Const::from_json(value) }
            }
        }
    }

    /// `row` has a span pair per column of the filter's list (see
    /// [`scan::spanned`]); a column without one is missing from the row.
    fn eval(&self, json: &str, row: &[u32]) -> Truth {
        use Truth::*;
        match self {
            Node::And(list) => list.iter().fold(True, |acc, e| match (acc, e.eval(json, row)) {
                (Missing, _) | (_, Missing) => Missing,
                (False, _) | (_, False) => False,
                (Null, _) | (_, Null) => Null,
                _ => True,
            }),
            Node::Or(list) => list.iter().fold(False, |acc, e| match (acc, e.eval(json, row)) {
                (Missing, _) | (_, Missing) => Missing,
                (True, _) | (_, True) => True,
                (Null, _) | (_, Null) => Null,
                _ => False,
            }),
            Node::Not(e) => match e.eval(json, row) {
                True => False,
                False => True,
                other => other,
            },
            Node::In { column, values } => match scan::spanned(json, row, *column) {
                None => Missing,
                Some("null") => Null,
                Some(v) => Truth::of(values.iter().any(|x| order(v, x) == Some(Ordering::Equal))),
            },
            Node::Compare { column, op, value } => {
                let Some(v) = scan::spanned(json, row, *column) else { return Missing };
                let null = v == "null";
                match op {
                    Op::IsNull => return Truth::of(null),
                    Op::IsNotNull => return Truth::of(!null),
                    _ => {}
                }
                if null || matches!(value, Const::Null) {
                    return Null;
                }
                let Some(o) = order(v, value) else { return False };
                Truth::of(match op {
                    Op::Eq => o == Ordering::Equal,
                    Op::Ne => o != Ordering::Equal,
                    Op::Lt => o == Ordering::Less,
                    Op::Le => o != Ordering::Greater,
                    Op::Gt => o == Ordering::Greater,
                    Op::Ge => o != Ordering::Less,
                    Op::IsNull | Op::IsNotNull => false,
                })
            }
        }
    }
}

pub struct RowFilter {
    table: String,
    predicate: Node,
    /// The columns the predicate reads (the filter's `row-columns`): the
    /// host finds their values, natively.
    locator: scan::ColumnLocator,
}

/// Only `columns` of a row object, parsed (for the key of a delete the
/// filter writes); `None` for anything else (null, absent).
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
    /// The key of the row an update leaves the view with: the old key when
    /// it changed, else the key columns of the new row.
    fn key_of(&self, change: &scan::RowParts<'_>) -> String {
        let columns = crate::key_columns(change.relation);
        let from = if change.key.is_some() { change.key } else { change.new };
        Value::Object(pick(from, &columns).unwrap_or_default()).to_string()
    }

    /// The host sends only row changes of tables whose policy is `inspect`
    /// (this filter's table), plus truncates and schema changes, which pass.
    /// `spans`: where the predicate's columns are in the change (four
    /// numbers per column, [`scan::ColumnLocator`]'s layout).
    fn verdict(&self, tag: &str, json: &str, spans: &[u32]) -> Verdict {
        if !matches!(tag, "insert" | "update" | "delete") {
            return Verdict::Keep;
        }
        // A row the change lacks (or that is not an object) has no spans:
        // every column is missing and it cannot be judged.
        let k = self.locator.columns().len();
        let new = || self.predicate.eval(json, spans.get(..2 * k).unwrap_or(&[]));
        let old = || self.predicate.eval(json, spans.get(2 * k..4 * k).unwrap_or(&[]));
        match tag {
            "insert" => match new() {
                Truth::Missing | Truth::True => Verdict::Keep,
                _ => Verdict::Drop,
            },
            "delete" => match old() {
                Truth::False | Truth::Null => Verdict::Drop,
                _ => Verdict::Keep,
            },
            _ => {
                let (new, old) = (new(), old());
                if new == Truth::Missing {
                    return Verdict::Keep;
                }
                // `key` is the old key (or the whole old row under FULL);
                // null when the key did not change.
                // The replacements are rare: the change is read again for them.
                let Some(c) = scan::row_parts(json) else { return Verdict::Keep };
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
        let predicate = Node::compile(&c.predicate, &mut columns);
        Ok(RowFilter { table: c.table, predicate, locator: scan::ColumnLocator::new(columns) })
    }

    fn policy(&self, schema: &str, table: &str) -> Policy {
        if glob_match(&self.table, &format!("{schema}.{table}")) {
            Policy::Inspect
        } else {
            Policy::KeepAll
        }
    }

    /// Natively, the host's part and the plugin's part in one.
    fn decide(&self, tag: &str, json: &str) -> Verdict {
        let mut spans = Vec::new();
        self.locator.locate(json, &mut spans);
        self.verdict(tag, json, &spans)
    }

    fn row_columns(&self) -> Option<Vec<String>> {
        Some(self.locator.columns().to_vec())
    }

    fn decide_located(&self, tag: &str, json: &str, spans: &[u32]) -> Verdict {
        self.verdict(tag, json, spans)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter(predicate: Value) -> RowFilter {
        let config = serde_json::json!({"table": "public.*", "where": predicate});
        RowFilter::from_config(&config.to_string()).unwrap()
    }

    const REL: &str = r#"{"schema":"public","name":"t","rowKey":{"columns":["id"],"type":"default"}}"#;

    fn insert(row: &str) -> String {
        format!(r#"{{"tag":"insert","relation":{REL},"new":{row}}}"#)
    }

    fn keeps(f: &RowFilter, row: &str) -> bool {
        f.decide("insert", &insert(row)) == Verdict::Keep
    }

    #[test]
    fn numbers_compare_exactly_as_integers_and_otherwise_as_floats() {
        let f = filter(serde_json::json!({"column": "n", "op": "<", "value": 9007199254740993u64}));
        assert!(keeps(&f, r#"{"id":1,"n":9007199254740992}"#), "2^53 < 2^53+1, exactly");
        assert!(!keeps(&f, r#"{"id":1,"n":9007199254740993}"#));
        let f = filter(serde_json::json!({"column": "n", "op": ">=", "value": 1.5}));
        assert!(keeps(&f, r#"{"id":1,"n":2}"#));
        assert!(keeps(&f, r#"{"id":1,"n":15e-1}"#));
        assert!(!keeps(&f, r#"{"id":1,"n":-1.25E0}"#));
        let f = filter(serde_json::json!({"column": "n", "op": "=", "value": -3}));
        assert!(keeps(&f, r#"{"id":1,"n":-3.0}"#), "integer and float of the same value are equal");
        assert!(!keeps(&f, r#"{"id":1,"n":"-3"}"#), "a string is not a number");
        let f = filter(serde_json::json!({"column": "n", "op": ">", "value": 0}));
        assert!(keeps(&f, r#"{"id":1,"n":18446744073709551615}"#), "u64::MAX > 0");
        assert!(!keeps(&f, r#"{"id":1,"n":-9223372036854775808}"#));
    }

    #[test]
    fn strings_and_keys_are_compared_unescaped() {
        let f = filter(serde_json::json!({"column": "s\"q", "op": "=", "value": "a\"b\u{e9}"}));
        assert!(keeps(&f, r#"{"id":1,"s\"q":"a\"b\u00e9"}"#));
        assert!(keeps(&f, "{\"id\":1,\"s\\\"q\":\"a\\\"b\u{e9}\"}"));
        assert!(!keeps(&f, r#"{"id":1,"s\"q":"a\"b"}"#));
        let f = filter(serde_json::json!({"column": "s", "op": "<", "value": "b"}));
        assert!(keeps(&f, r#"{"id":1,"s":"abc"}"#));
        assert!(!keeps(&f, r#"{"id":1,"s":"b"}"#));
    }

    #[test]
    fn three_valued_logic_and_missing_columns() {
        let f = filter(serde_json::json!({"not": {"column": "n", "op": "=", "value": 1}}));
        assert!(!keeps(&f, r#"{"id":1,"n":null}"#), "NOT (NULL = 1) is unknown: not in the view");
        assert!(keeps(&f, r#"{"id":1,"payload":"x"}"#), "a column the change leaves out cannot be judged");
        let f = filter(
            serde_json::json!({"or": [{"column": "n", "op": "is null"}, {"column": "k", "op": "in", "values": ["a", 2, true]}]}),
        );
        assert!(keeps(&f, r#"{"id":1,"n":null,"k":"z"}"#));
        assert!(keeps(&f, r#"{"id":1,"n":1,"k":true}"#));
        assert!(keeps(&f, r#"{"k":2,"id":1,"n":1}"#), "columns in any order");
        assert!(!keeps(&f, r#"{"id":1,"n":1,"k":"b"}"#));
        assert!(!keeps(&f, r#"{"id":1,"n":1,"k":null}"#), "NULL IN (...) is unknown");
        let f = filter(
            serde_json::json!({"and": [{"column": "n", "op": ">", "value": 0}, {"column": "n", "op": "!=", "value": 5}]}),
        );
        assert!(keeps(&f, r#"{"id":1,"n":4,"o":{"n":5}}"#));
        assert!(!keeps(&f, r#"{"id":1,"n":5}"#));
        assert!(!keeps(&f, r#"{"id":1,"n":[1]}"#), "arrays order against nothing");
    }

    #[test]
    fn many_columns_and_movement() {
        let clauses: Vec<Value> =
            (0..10).map(|i| serde_json::json!({"column": format!("c{i}"), "op": "is not null"})).collect();
        let f = filter(serde_json::json!({ "and": clauses }));
        let row = |last: &str| {
            let cols: Vec<String> = (0..9).map(|i| format!("\"c{i}\":{i}")).collect();
            format!("{{\"id\":1,{},\"c9\":{last}}}", cols.join(","))
        };
        assert!(keeps(&f, &row("9")));
        assert!(!keeps(&f, &row("null")));
        // An update whose old key left the view and whose new row is in it.
        let f = filter(serde_json::json!({"column": "id", "op": "<", "value": 10}));
        let update = format!(r#"{{"tag":"update","relation":{REL},"key":{{"id":20}},"new":{{"id":5,"x":1}}}}"#);
        assert_eq!(
            f.decide("update", &update),
            Verdict::Replace(format!(r#"{{"tag":"insert","relation":{REL},"new":{{"id":5,"x":1}}}}"#))
        );
        let update = format!(r#"{{"tag":"update","relation":{REL},"key":null,"new":{{"id":50,"x":1}}}}"#);
        assert_eq!(
            f.decide("update", &update),
            Verdict::Replace(format!(r#"{{"tag":"delete","relation":{REL},"key":{{"id":50}}}}"#))
        );
    }
}

//! DDL statements from the binlog's QUERY events, turned into schema
//! changes.
//!
//! The binlog carries DDL as statement text. The common shapes are parsed
//! here: CREATE TABLE (column list and primary key), DROP TABLE, RENAME
//! TABLE, TRUNCATE, and ALTER TABLE with ADD / DROP / RENAME / CHANGE /
//! MODIFY COLUMN and RENAME TO. Index and option changes do not change what
//! a replica stores and are passed over. Anything else that touches a
//! captured table cannot be expressed and becomes `Unsupported`, which the
//! stream turns into reset-required with the statement in the reason.

use crate::types::ColType;

#[derive(Debug, Clone, PartialEq)]
pub struct ColumnDef {
    pub name: String,
    pub ty: ColType,
    pub not_null: bool,
    pub default: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum AlterOp {
    Add(ColumnDef),
    Drop(String),
    /// Old name, new definition (`CHANGE`, `MODIFY`, `RENAME COLUMN`).
    Change {
        old: String,
        new: Option<ColumnDef>,
        new_name: String,
    },
    RenameTable(TableRef),
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TableRef {
    pub db: String,
    pub table: String,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Ddl {
    CreateTable {
        table: TableRef,
        columns: Vec<ColumnDef>,
        primary_key: Vec<String>,
    },
    DropTables(Vec<TableRef>),
    RenameTables(Vec<(TableRef, TableRef)>),
    Truncate(TableRef),
    Alter {
        table: TableRef,
        ops: Vec<AlterOp>,
    },
    /// Does not touch tables (CREATE DATABASE, GRANT, CREATE USER, ...).
    NotTables,
    /// Touches `tables` in a way we cannot express.
    Unsupported {
        tables: Vec<TableRef>,
        why: String,
    },
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Word(String),
    /// A backquoted identifier.
    Quoted(String),
    Str(String),
    Num(String),
    Punct(char),
}

fn tokenize(sql: &str) -> Vec<Tok> {
    let b: Vec<char> = sql.chars().collect();
    let mut i = 0;
    let mut out = Vec::new();
    while i < b.len() {
        let c = b[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '/' && b.get(i + 1) == Some(&'*') {
            // Comments, including MariaDB's executable /*!50100 ... */: we
            // take the text inside versioned comments as statement text.
            if b.get(i + 2) == Some(&'!') {
                i += 3;
                while i < b.len() && b[i].is_ascii_digit() {
                    i += 1;
                }
                continue;
            }
            i += 2;
            while i + 1 < b.len() && !(b[i] == '*' && b[i + 1] == '/') {
                i += 1;
            }
            i += 2;
        } else if c == '*' && b.get(i + 1) == Some(&'/') {
            i += 2; // the end of a versioned comment
        } else if c == '#' || (c == '-' && b.get(i + 1) == Some(&'-')) {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '`' {
            out.push(Tok::Quoted(quoted(&b, &mut i, false)));
        } else if c == '\'' || c == '"' {
            out.push(Tok::Str(quoted(&b, &mut i, true)));
        } else if c.is_ascii_digit() {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == '.') {
                i += 1;
            }
            out.push(Tok::Num(b[start..i].iter().collect()));
        } else if c.is_alphanumeric() || c == '_' || c == '$' {
            let start = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_' || b[i] == '$') {
                i += 1;
            }
            out.push(Tok::Word(b[start..i].iter().collect()));
        } else {
            out.push(Tok::Punct(c));
            i += 1;
        }
    }
    out
}

/// The text between the quote at `b[*i]` and its closing twin (a doubled
/// quote stands for itself; in strings, a backslash escapes the next
/// character). Leaves `*i` after the closing quote.
fn quoted(b: &[char], i: &mut usize, backslash: bool) -> String {
    let q = b[*i];
    let mut s = String::new();
    *i += 1;
    while *i < b.len() {
        let c = b[*i];
        if backslash && c == '\\' && *i + 1 < b.len() {
            s.push(b[*i + 1]);
            *i += 2;
            continue;
        }
        if c == q {
            if b.get(*i + 1) == Some(&q) {
                s.push(q);
                *i += 2;
                continue;
            }
            break;
        }
        s.push(c);
        *i += 1;
    }
    *i += 1;
    s
}

struct P<'a> {
    toks: &'a [Tok],
    at: usize,
    db: &'a str,
}

impl<'a> P<'a> {
    fn peek(&self) -> Option<&'a Tok> {
        self.toks.get(self.at)
    }
    fn next(&mut self) -> Option<&'a Tok> {
        let t = self.toks.get(self.at);
        self.at += 1;
        t
    }
    /// The next token is the keyword `kw` (case-insensitive): consume it.
    fn kw(&mut self, kw: &str) -> bool {
        if let Some(Tok::Word(w)) = self.peek() {
            if w.eq_ignore_ascii_case(kw) {
                self.at += 1;
                return true;
            }
        }
        false
    }
    /// The next token is one of `kws`: consume it.
    fn any_kw(&mut self, kws: &[&str]) -> bool {
        kws.iter().any(|k| self.kw(k))
    }
    fn punct(&mut self, p: char) -> bool {
        if self.peek() == Some(&Tok::Punct(p)) {
            self.at += 1;
            return true;
        }
        false
    }
    fn ident(&mut self) -> Option<String> {
        match self.next()? {
            Tok::Word(w) | Tok::Quoted(w) => Some(w.clone()),
            _ => None,
        }
    }
    /// `name` or `db.name`.
    fn table(&mut self) -> Option<TableRef> {
        let first = self.ident()?;
        if self.punct('.') {
            let t = self.ident()?;
            Some(TableRef { db: first, table: t })
        } else {
            Some(TableRef { db: self.db.to_string(), table: first })
        }
    }
    /// Skips a balanced parenthesised group starting at `(`.
    fn skip_group(&mut self) {
        if !self.punct('(') {
            return;
        }
        let mut depth = 1;
        while let Some(t) = self.next() {
            match t {
                Tok::Punct('(') => depth += 1,
                Tok::Punct(')') => {
                    depth -= 1;
                    if depth == 0 {
                        return;
                    }
                }
                _ => {}
            }
        }
    }
    /// Skips to the next `,` or `)` at depth 0 (not consumed).
    fn skip_item(&mut self) {
        let mut depth = 0;
        while let Some(t) = self.peek() {
            match t {
                Tok::Punct('(') => depth += 1,
                Tok::Punct(')') if depth == 0 => return,
                Tok::Punct(')') => depth -= 1,
                Tok::Punct(',') if depth == 0 => return,
                _ => {}
            }
            self.at += 1;
        }
    }
}

/// Classifies one statement. `db` is the QUERY event's default database.
pub fn parse(sql: &str, db: &str) -> Ddl {
    let toks = tokenize(sql);
    let mut p = P { toks: &toks, at: 0, db };
    let unsupported = |why: &str| Ddl::Unsupported { tables: Vec::new(), why: why.to_string() };
    if p.kw("CREATE") {
        let _ = p.kw("OR") && p.kw("REPLACE");
        p.kw("TEMPORARY");
        if !p.kw("TABLE") {
            // CREATE INDEX / VIEW / DATABASE / USER ...: nothing a replica stores.
            return Ddl::NotTables;
        }
        let _ = p.kw("IF") && p.kw("NOT") && p.kw("EXISTS");
        let Some(table) = p.table() else { return unsupported("CREATE TABLE without a name") };
        if p.kw("LIKE") || !p.punct('(') {
            return Ddl::Unsupported { tables: vec![table], why: "CREATE TABLE without a column list".into() };
        }
        let mut columns = Vec::new();
        let mut primary_key = Vec::new();
        loop {
            if p.kw("PRIMARY") {
                p.kw("KEY");
                let _ = p.kw("USING") && p.ident().is_some();
                primary_key = key_columns(&mut p);
            } else if p.any_kw(&[
                "KEY",
                "INDEX",
                "UNIQUE",
                "CONSTRAINT",
                "FOREIGN",
                "FULLTEXT",
                "SPATIAL",
                "CHECK",
                "PERIOD",
            ]) {
                p.skip_item();
            } else {
                match column_def(&mut p) {
                    Ok((c, pk)) => {
                        if pk {
                            primary_key = vec![c.name.clone()];
                        }
                        columns.push(c);
                    }
                    Err(why) => return Ddl::Unsupported { tables: vec![table], why },
                }
            }
            if p.punct(',') {
                continue;
            }
            if p.punct(')') {
                break;
            }
            return Ddl::Unsupported { tables: vec![table], why: "could not read the column list".into() };
        }
        // Table options follow; `AS SELECT` / `SELECT` would copy rows in.
        while let Some(t) = p.next() {
            if matches!(t, Tok::Word(w) if w.eq_ignore_ascii_case("SELECT")) {
                return Ddl::Unsupported { tables: vec![table], why: "CREATE TABLE ... SELECT".into() };
            }
        }
        return Ddl::CreateTable { table, columns, primary_key };
    }
    if p.kw("DROP") {
        p.kw("TEMPORARY");
        if !p.kw("TABLE") {
            return Ddl::NotTables;
        }
        let _ = p.kw("IF") && p.kw("EXISTS");
        let mut tables = Vec::new();
        while let Some(t) = p.table() {
            tables.push(t);
            if !p.punct(',') {
                break;
            }
        }
        return Ddl::DropTables(tables);
    }
    if p.kw("RENAME") {
        if !p.kw("TABLE") {
            return Ddl::NotTables;
        }
        let mut pairs = Vec::new();
        loop {
            let (Some(a), true, Some(b)) = (p.table(), p.kw("TO"), p.table()) else {
                return unsupported("could not read RENAME TABLE");
            };
            pairs.push((a, b));
            if !p.punct(',') {
                break;
            }
        }
        return Ddl::RenameTables(pairs);
    }
    if p.kw("TRUNCATE") {
        p.kw("TABLE");
        return match p.table() {
            Some(t) => Ddl::Truncate(t),
            None => unsupported("could not read TRUNCATE"),
        };
    }
    if p.kw("ALTER") {
        p.kw("ONLINE");
        p.kw("IGNORE");
        if !p.kw("TABLE") {
            return Ddl::NotTables;
        }
        let _ = p.kw("IF") && p.kw("EXISTS");
        let Some(table) = p.table() else { return unsupported("ALTER TABLE without a name") };
        let mut ops = Vec::new();
        loop {
            match alter_op(&mut p) {
                Ok(Some(op)) => ops.push(op),
                Ok(None) => {}
                Err(why) => return Ddl::Unsupported { tables: vec![table], why },
            }
            p.skip_item();
            if !p.punct(',') {
                break;
            }
        }
        return Ddl::Alter { table, ops };
    }
    Ddl::NotTables
}

/// `(a, b(10) DESC, ...)` -> ["a", "b"].
fn key_columns(p: &mut P) -> Vec<String> {
    let mut out = Vec::new();
    if !p.punct('(') {
        return out;
    }
    loop {
        if let Some(n) = p.ident() {
            out.push(n);
        }
        p.skip_item();
        if !p.punct(',') {
            p.punct(')');
            break;
        }
    }
    p.skip_item();
    out
}

/// One column definition; the flag says it was declared PRIMARY KEY inline.
fn column_def(p: &mut P) -> Result<(ColumnDef, bool), String> {
    let name = p.ident().ok_or("a column without a name")?;
    let ty_word = match p.next() {
        Some(Tok::Word(w)) => w.to_ascii_lowercase(),
        _ => return Err(format!("column {name}: no type")),
    };
    // Type arguments: (10,2), (255), ('a','b').
    let start = p.at;
    p.skip_group();
    let args: Vec<&Tok> = p.toks[start..p.at].iter().collect();
    let nums: Vec<u64> = args.iter().filter_map(|t| if let Tok::Num(n) = t { n.parse().ok() } else { None }).collect();
    let labels: Vec<String> =
        args.iter().filter_map(|t| if let Tok::Str(s) = t { Some(s.clone()) } else { None }).collect();
    let mut unsigned = false;
    let mut not_null = false;
    let mut pk = false;
    let mut default = None;
    let mut binary_cs = false;
    let mut latin1 = false;
    // Attributes up to the next `,` or `)` at depth 0.
    loop {
        match p.peek() {
            None | Some(Tok::Punct(',')) | Some(Tok::Punct(')')) => break,
            _ => {}
        }
        if p.kw("UNSIGNED") {
            unsigned = true;
        } else if p.kw("NOT") {
            not_null |= p.kw("NULL");
        } else if p.kw("PRIMARY") {
            p.kw("KEY");
            pk = true;
            not_null = true;
        } else if p.kw("DEFAULT") {
            default = match p.next() {
                Some(Tok::Str(s)) => Some(format!("'{}'", s.replace('\'', "''"))),
                Some(Tok::Num(n)) => Some(n.clone()),
                Some(Tok::Word(w)) => Some(w.clone()),
                Some(Tok::Punct('-')) => match p.next() {
                    Some(Tok::Num(n)) => Some(format!("-{n}")),
                    _ => None,
                },
                _ => None,
            };
        } else if p.kw("CHARACTER") || p.kw("CHARSET") {
            p.kw("SET");
            if let Some(cs) = p.ident() {
                binary_cs = cs.eq_ignore_ascii_case("binary");
                latin1 = cs.eq_ignore_ascii_case("latin1");
            }
        } else if p.kw("BINARY") {
            // `VARCHAR(10) BINARY` is a binary collation, still text.
        } else if matches!(p.peek(), Some(Tok::Punct('('))) {
            p.skip_group();
        } else {
            p.at += 1;
        }
    }
    let n0 = nums.first().copied();
    let n1 = nums.get(1).copied();
    let column_type = if unsigned { format!("{ty_word} unsigned") } else { ty_word.clone() };
    let (data_type, precision, scale, fsp, len) = match ty_word.as_str() {
        "decimal" | "numeric" | "dec" | "fixed" => ("decimal", n0.or(Some(10)), n1.or(Some(0)), None, None),
        "datetime" | "timestamp" | "time" => (ty_word.as_str(), None, None, n0, None),
        "bit" => ("bit", n0.or(Some(1)), None, None, None),
        "character" | "nchar" => ("char", None, None, None, n0.or(Some(1))),
        "char" | "binary" => (ty_word.as_str(), None, None, None, n0.or(Some(1))),
        "varchar" | "varbinary" | "nvarchar" => {
            (if ty_word == "varbinary" { "varbinary" } else { "varchar" }, None, None, None, n0)
        }
        "int1" => ("tinyint", None, None, None, None),
        "int2" => ("smallint", None, None, None, None),
        "int3" | "middleint" => ("mediumint", None, None, None, None),
        "int4" => ("int", None, None, None, None),
        "int8" => ("bigint", None, None, None, None),
        "float" if n0.is_some_and(|p| p > 24) => ("double", None, None, None, None),
        "serial" => ("bigint", None, None, None, None),
        other => (other, None, None, None, None),
    };
    let column_type = if data_type == "enum" || data_type == "set" {
        let quoted: Vec<String> = labels.iter().map(|l| format!("'{}'", l.replace('\'', "''"))).collect();
        format!("{data_type}({})", quoted.join(","))
    } else {
        column_type
    };
    let unsigned_type =
        if data_type == "serial" || ty_word == "serial" { "bigint unsigned".to_string() } else { column_type };
    let data_type = match (data_type, binary_cs) {
        ("varchar", true) => "varbinary",
        ("char", true) => "binary",
        ("text" | "tinytext" | "mediumtext" | "longtext", true) => "blob",
        (d, _) => d,
    };
    let ty = ColType::from_information_schema(
        data_type,
        &unsigned_type,
        precision,
        scale,
        fsp,
        len,
        latin1.then_some("latin1"),
    )
    .map_err(|e| format!("column {name}: {e}"))?;
    Ok((ColumnDef { name, ty, not_null, default }, pk))
}

/// One ALTER TABLE clause. `None`: it does not change what replicas store.
fn alter_op(p: &mut P) -> Result<Option<AlterOp>, String> {
    if p.kw("ADD") {
        const NOT_COLUMNS: [&str; 10] =
            ["PRIMARY", "KEY", "INDEX", "UNIQUE", "CONSTRAINT", "FOREIGN", "FULLTEXT", "SPATIAL", "CHECK", "PARTITION"];
        if p.any_kw(&NOT_COLUMNS) {
            return Ok(None);
        }
        p.kw("COLUMN");
        let _ = p.kw("IF") && p.kw("NOT") && p.kw("EXISTS");
        if matches!(p.peek(), Some(Tok::Punct('('))) {
            return Err("ADD COLUMN with a parenthesised list".into());
        }
        let (def, _) = column_def(p)?;
        return Ok(Some(AlterOp::Add(def)));
    }
    if p.kw("DROP") {
        if p.any_kw(&["PRIMARY", "KEY", "INDEX", "FOREIGN", "CONSTRAINT", "CHECK", "PARTITION"]) {
            return Ok(None);
        }
        p.kw("COLUMN");
        let _ = p.kw("IF") && p.kw("EXISTS");
        let name = p.ident().ok_or("DROP COLUMN without a name")?;
        return Ok(Some(AlterOp::Drop(name)));
    }
    if p.kw("CHANGE") {
        p.kw("COLUMN");
        let _ = p.kw("IF") && p.kw("EXISTS");
        let old = p.ident().ok_or("CHANGE COLUMN without a name")?;
        let (def, _) = column_def(p)?;
        return Ok(Some(AlterOp::Change { old, new_name: def.name.clone(), new: Some(def) }));
    }
    if p.kw("MODIFY") {
        p.kw("COLUMN");
        let _ = p.kw("IF") && p.kw("EXISTS");
        let (def, _) = column_def(p)?;
        return Ok(Some(AlterOp::Change { old: def.name.clone(), new_name: def.name.clone(), new: Some(def) }));
    }
    if p.kw("RENAME") {
        if p.kw("COLUMN") {
            let _ = p.kw("IF") && p.kw("EXISTS");
            let old = p.ident().ok_or("RENAME COLUMN without a name")?;
            p.kw("TO");
            let new_name = p.ident().ok_or("RENAME COLUMN without a new name")?;
            return Ok(Some(AlterOp::Change { old, new: None, new_name }));
        }
        if p.kw("INDEX") || p.kw("KEY") {
            return Ok(None);
        }
        let _ = p.kw("TO") || p.kw("AS");
        let t = p.table().ok_or("RENAME without a new name")?;
        return Ok(Some(AlterOp::RenameTable(t)));
    }
    // ALTER COLUMN SET/DROP DEFAULT, ENGINE=, COMMENT=, FORCE, ALGORITHM=,
    // LOCK=, ORDER BY, CONVERT TO CHARACTER SET (re-encodes text but keeps
    // values), ...
    if p.kw("ALTER") {
        p.kw("COLUMN");
        p.ident();
        return Ok(None);
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(db: &str, table: &str) -> TableRef {
        TableRef { db: db.into(), table: table.into() }
    }

    #[test]
    fn create_table() {
        let d = parse(
            "CREATE TABLE IF NOT EXISTS `shop`.orders (id bigint unsigned NOT NULL AUTO_INCREMENT, \
             note varchar(20) DEFAULT 'x', amount decimal(10,2), state enum('a','b'), \
             PRIMARY KEY (`id`), KEY k (note)) ENGINE=InnoDB",
            "other",
        );
        let Ddl::CreateTable { table, columns, primary_key } = d else { panic!("{d:?}") };
        assert_eq!(table, t("shop", "orders"));
        assert_eq!(primary_key, vec!["id"]);
        let names: Vec<_> = columns.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["id", "note", "amount", "state"]);
        assert_eq!(columns[0].ty, ColType::Int { bytes: 8, unsigned: true });
        assert!(columns[0].not_null);
        assert_eq!(columns[1].default.as_deref(), Some("'x'"));
        assert_eq!(columns[2].ty, ColType::Decimal { precision: 10, scale: 2 });
        assert!(matches!(&columns[3].ty, ColType::Enum { labels, .. } if labels == &["a", "b"]));
    }

    #[test]
    fn alter_table() {
        let d = parse(
            "ALTER TABLE t ADD COLUMN phone varchar(20) AFTER email, DROP COLUMN fax, \
             CHANGE old_name new_name int, RENAME COLUMN a TO b, ADD INDEX (x), ENGINE=InnoDB",
            "db",
        );
        let Ddl::Alter { table, ops } = d else { panic!("{d:?}") };
        assert_eq!(table, t("db", "t"));
        assert_eq!(ops.len(), 4, "{ops:?}");
        assert!(matches!(&ops[0], AlterOp::Add(c) if c.name == "phone"));
        assert_eq!(ops[1], AlterOp::Drop("fax".into()));
        assert!(
            matches!(&ops[2], AlterOp::Change { old, new_name, new: Some(_) } if old == "old_name" && new_name == "new_name")
        );
        assert!(matches!(&ops[3], AlterOp::Change { old, new_name, new: None } if old == "a" && new_name == "b"));
    }

    #[test]
    fn drops_renames_and_others() {
        assert_eq!(
            parse("DROP TABLE IF EXISTS `a`, db2.b /* generated by server */", "db"),
            Ddl::DropTables(vec![t("db", "a"), t("db2", "b")])
        );
        assert_eq!(parse("RENAME TABLE a TO b", "db"), Ddl::RenameTables(vec![(t("db", "a"), t("db", "b"))]));
        assert_eq!(parse("truncate table x", "db"), Ddl::Truncate(t("db", "x")));
        assert_eq!(parse("CREATE DATABASE d", "db"), Ddl::NotTables);
        assert!(matches!(parse("CREATE TABLE a LIKE b", "db"), Ddl::Unsupported { .. }));
        assert!(matches!(parse("CREATE TABLE a (id int) SELECT 1", "db"), Ddl::Unsupported { .. }));
    }
}

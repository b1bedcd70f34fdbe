// Prints one table of a zero-cache replica file as JSON: {"rows": [...]},
// ordered by KEY, without zero-cache's own bookkeeping columns (`_0_...`).
// The replica uses SQLite's wal2 mode, which only Zero's own SQLite build
// (@rocicorp/zero-sqlite3) reads.
//
// usage: node replica-rows.mjs REPLICA_FILE TABLE KEY
import Database from '@rocicorp/zero-sqlite3';

const [file, table, key] = process.argv.slice(2);
const db = new Database(file, { fileMustExist: true });
db.defaultSafeIntegers(true);
const rows = db
  .prepare(`SELECT * FROM "${table.replaceAll('"', '""')}" ORDER BY "${key.replaceAll('"', '""')}"`)
  .all()
  .map((row) => Object.fromEntries(Object.entries(row).filter(([c]) => !c.startsWith('_0_'))));
db.close();
process.stdout.write(JSON.stringify({ rows }, (_, v) => (typeof v === 'bigint' ? v.toString() : v)) + '\n');

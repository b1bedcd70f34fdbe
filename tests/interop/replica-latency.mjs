// Watches a zero-cache replica file for rows with id > FROM and reports,
// for each, how long after its `t` (epoch ms, written by the upstream
// client just before its commit) it became readable in the replica.
// Polls every millisecond; exits when COUNT rows were seen or after
// TIMEOUT_MS.
//
// usage: node replica-latency.mjs REPLICA_FILE TABLE FROM COUNT TIMEOUT_MS
// prints: {"seen": N, "latenciesMs": [...]}
import Database from '@rocicorp/zero-sqlite3';

const [file, table, from, count, timeoutMs] = process.argv.slice(2);
const db = new Database(file, { fileMustExist: true, readonly: true });
const query = db.prepare(`SELECT id, t FROM "${table.replaceAll('"', '""')}" WHERE id > ? ORDER BY id`);
const sleep = new Int32Array(new SharedArrayBuffer(4));
const deadline = Date.now() + Number(timeoutMs);
const latencies = [];
let last = Number(from);
while (latencies.length < Number(count) && Date.now() < deadline) {
  const now = Date.now();
  for (const row of query.all(last)) {
    latencies.push(now - row.t);
    last = Math.max(last, Number(row.id));
  }
  Atomics.wait(sleep, 0, 0, 1);
}
db.close();
process.stdout.write(JSON.stringify({ seen: latencies.length, latenciesMs: latencies }) + '\n');

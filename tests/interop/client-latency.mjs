// A Zero client (Zero's `Zero` class, in-memory store) that watches rows
// with id > FROM of TABLE (columns id, name, t) through a zero-cache and
// reports, for each new row, how long after its `t` (epoch ms, stamped by
// the upstream writer just before its commit) the client showed it.
//
// usage: node client-latency.mjs SERVER TABLE FROM COUNT TIMEOUT_MS
// prints {"ready": true} once the query is complete (the server answered),
// then {"seen": N, "latenciesMs": [...]} after COUNT rows or TIMEOUT_MS.
import { WebSocket } from 'ws';
import { Zero, createSchema, table, string, number } from '@rocicorp/zero';

globalThis.WebSocket ??= WebSocket;

const [server, tableName, from, count, timeoutMs] = process.argv.slice(2);
const schema = createSchema({
  tables: [table(tableName).columns({ id: number(), name: string(), t: number() }).primaryKey('id')],
  enableLegacyQueries: true,
});
const z = new Zero({ server, userID: 'sluice-bench', schema, kvStore: 'mem', logLevel: 'error' });
const view = z.materialize(z.query[tableName].where('id', '>', Number(from)));
const seen = new Set();
const latencies = [];
let ready = false;
let finished = false;
const finish = () => {
  if (finished) return;
  finished = true;
  // Exit once the report is written: a pipe takes it in pieces.
  process.stdout.write(JSON.stringify({ seen: latencies.length, latenciesMs: latencies }) + '\n', () => process.exit(0));
};
view.addListener((rows, resultType) => {
  const now = Date.now();
  if (!ready && resultType === 'complete') {
    ready = true;
    process.stdout.write('{"ready": true}\n');
  }
  for (const row of rows) {
    if (!seen.has(row.id)) {
      seen.add(row.id);
      latencies.push(now - row.t);
    }
  }
  if (latencies.length >= Number(count)) finish();
});
setTimeout(finish, Number(timeoutMs));

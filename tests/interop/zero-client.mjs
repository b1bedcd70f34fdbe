// A Zero client (Zero's own `Zero` class from @rocicorp/zero 1.9.0, with an
// in-memory store) that queries one table through a zero-cache and prints
// the table's rows as one JSON line whenever they change.
//
// usage: node zero-client.mjs SERVER TABLE KEY COLUMNS_JSON [INSERT_JSON]
//   SERVER        zero-cache's address, e.g. http://127.0.0.1:4870
//   TABLE         the table to query (the replica's name, e.g. `items`, or
//                 `shop.items` for a table outside Postgres' `public` schema)
//   KEY           its primary key column
//   COLUMNS_JSON  {"column": "string" | "number" | "boolean" | "json", ...}
//   INSERT_JSON   a row to insert with Zero's CRUD mutator once the first
//                 rows are shown (zero-cache writes it to its upstream)
// Prints {"rows": [...]} lines (rows ordered by the key); exits on SIGTERM.
import { WebSocket } from 'ws';
import { Zero, createSchema, table, string, number, boolean, json } from '@rocicorp/zero';

// Node 20 has no WebSocket global; Zero's client needs one.
globalThis.WebSocket ??= WebSocket;

const [server, tableName, key, columnsJson, insertJson] = process.argv.slice(2);
const columns = JSON.parse(columnsJson);
const types = { string, number, boolean, json };
const spec = Object.fromEntries(Object.entries(columns).map(([c, t]) => [c, types[t]()]));
// Zero's client names cannot hold a dot: `shop.items` is queried as
// `shop_items`, mapped to the server's name.
const clientName = tableName.replaceAll('.', '_');
const schema = createSchema({
  tables: [table(clientName).from(tableName).columns(spec).primaryKey(key)],
  enableLegacyQueries: true,
  enableLegacyMutators: true,
});

const z = new Zero({ server, userID: 'sluice-test', schema, kvStore: 'mem', logLevel: 'error' });
const view = z.materialize(z.query[clientName].orderBy(key, 'asc'));
let inserted = false;
view.addListener((rows) => {
  process.stdout.write(JSON.stringify({ rows }, (_, v) => (typeof v === 'bigint' ? v.toString() : v)) + '\n');
  if (insertJson && !inserted) {
    inserted = true;
    Promise.resolve(z.mutate[clientName].insert(JSON.parse(insertJson))).catch((e) => {
      process.stderr.write(`zero-client: the insert failed: ${e}\n`);
    });
  }
});
process.on('SIGTERM', () => { view.destroy(); z.close().finally(() => process.exit(0)); });

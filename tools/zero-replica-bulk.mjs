// The bulk route of tools/zero-replica.mjs: the same replica as zero-cache's
// custom-source initial sync writes, about three times faster at 1M rows.
//
// zero-cache's own initial sync spends its time per row on work that does
// not change the result: a JSON parser written in JavaScript (for integers
// beyond 2^53), a schema check of every message, and an INSERT whose SQL is
// rebuilt and looked up in a statement cache for every row. Here:
//   - a message is parsed with JSON.parse unless its text holds a run of 16
//     digits (a number that may not fit a double) or a "__proto__" key;
//     those go to zero-cache's BigIntJSON parser, so every value is the one
//     zero-cache would have read;
//   - every message is still checked against zero-cache's change-stream
//     schema;
//   - begin, DDL, commit and anything else go through zero-cache's
//     ChangeProcessor, as in its initial sync; so does a row of a table with
//     columns being backfilled (its change log bookkeeping);
//   - a row is converted with zero-cache's liteRow and written with one
//     prepared INSERT OR REPLACE per table and column list, with the
//     transaction's version in _0_version, exactly the statement the
//     ChangeProcessor builds;
//   - each message is handled inside the WebSocket's message event, so TCP
//     flow control holds Sluice back while SQLite works and nothing queues.
// The whole initial sync is one SQLite transaction (zero-cache's migration),
// as in zero-cache's route.

import { pathToFileURL } from 'node:url';

const LONG_DIGITS = /\d{16}/;

// How long the change source may say nothing (no handshake, no message)
// before the sync is given up: Sluice sends the table state without pause,
// so a silence this long is a dead link or a stuck peer.
export const SILENCE_MS = 30_000;

const sameColumns = (a, b) => a !== null && a.length === b.length && a.every((column, i) => column === b[i]);

export async function writeReplicaInBulk({ load, zeroRequire, lc, upstream, shard, file, context }) {
  const [
    { initReplica },
    { createReplicationStateTables, initReplicationState },
    { StatementRunner },
    { ChangeProcessor },
    { ReplicationStatusPublisher },
    { AutoResetSignal },
    { changeStreamMessageSchema },
    { insertSchema, rowSchema },
    { parse: validate },
    { BigIntJSON },
    { computeZqlSpecs, listTables },
    { liteRow },
    { liteTableName },
    { id },
    { ZERO_VERSION_COLUMN_NAME },
  ] = await Promise.all([
    load('out/zero-cache/src/services/change-source/common/replica-schema.js'),
    load('out/zero-cache/src/services/replicator/schema/replication-state.js'),
    load('out/zero-cache/src/db/statements.js'),
    load('out/zero-cache/src/services/replicator/change-processor.js'),
    load('out/zero-cache/src/services/replicator/replication-status.js'),
    load('out/zero-cache/src/services/change-streamer/schema/tables.js'),
    load('out/zero-cache/src/services/change-source/protocol/current/downstream.js'),
    load('out/zero-cache/src/services/change-source/protocol/current/data.js'),
    load('out/shared/src/valita.js'),
    load('out/shared/src/bigint-json.js'),
    load('out/zero-cache/src/db/lite-tables.js'),
    load('out/zero-cache/src/types/lite.js'),
    load('out/zero-cache/src/types/names.js'),
    load('out/zero-cache/src/types/sql.js'),
    load('out/zero-cache/src/services/replicator/schema/constants.js'),
  ]);
  const ws = await import(pathToFileURL(zeroRequire.resolve('ws')).href);
  const WebSocket = ws.WebSocket ?? ws.default;

  const parseJSON = (text) =>
    LONG_DIGITS.test(text) || text.includes('"__proto__"') ? BigIntJSON.parse(text) : JSON.parse(text);
  const tryParseJSON = (text) => {
    try {
      return parseJSON(text);
    } catch {
      return undefined;
    }
  };

  const initialSync = (log, tx) =>
    new Promise((resolve, reject) => {
      const t0 = Date.now();
      createReplicationStateTables(tx);
      const processor = new ChangeProcessor(new StatementRunner(tx), 'initial-sync', (_, err) => {
        throw err;
      });
      const status = ReplicationStatusPublisher.forRunningTransaction(tx);
      // The open transaction's version and JSON format; null outside one.
      let version = null;
      let jsonFormat = 'p';
      // Table specs as the ChangeProcessor reads them, reloaded after DDL.
      let specs = null;
      const statements = new Map();
      let rows = 0;
      let done = false;

      // The last row's table: rows come table by table.
      let last = { schema: null, name: null, relation: null, table: null, spec: null, columns: null, statement: null };
      const insert = (change) => {
        const { relation } = change;
        if (relation.schema !== last.schema || relation.name !== last.name || !specs) {
          specs ??= new Map(listTables(tx).map((spec) => [spec.name, spec]));
          const table = liteTableName(relation);
          const spec = specs.get(table);
          if (!spec) throw new Error(`a row for table ${table}, which the initial sync did not create`);
          last = { schema: relation.schema, name: relation.name, relation, table, spec, columns: null, statement: null };
        }
        const { table, spec } = last;
        // Its change log entry is the ChangeProcessor's to write.
        if (spec.backfilling?.length) {
          processor.processMessage(log, ['data', change]);
          return;
        }
        const { row } = liteRow(change.new, spec, jsonFormat);
        const columns = Object.keys(row);
        // One statement per table and column list, as zero-cache's own.
        if (!sameColumns(last.columns, columns)) {
          const key = `${table}\0${columns.join('\0')}`;
          let statement = statements.get(key);
          if (!statement) {
            const names = [...columns, ZERO_VERSION_COLUMN_NAME].map((c) => id(c));
            const sql = `INSERT OR REPLACE INTO ${id(table)} (${names.join(',')}) VALUES (${names.map(() => '?').join(',')})`;
            statement = tx.prepare(sql);
            statements.set(key, statement);
          }
          last.columns = columns;
          last.statement = statement;
        }
        const values = Object.values(row);
        values.push(version);
        last.statement.run(values);
        rows++;
      };

      // The rows of one table share their text up to the row's values:
      // `["data",{"tag":"insert","relation":{...},"new":` and, after the
      // values, `}]`. Once a row has been parsed and checked whole and that
      // split holds for it, the next rows that start with the same prefix
      // have only their values parsed. JSON's grammar makes this exact: the
      // prefix leaves the parser expecting the value of message[1].new, so
      // a text that is the prefix, one JSON value and `}]` is that row.
      // The prefix is always that of the last row's table (`last`): it is
      // set after such a row and cleared before any other message.
      let rowPrefix = null;
      const sameTableRow = (text) => {
        if (rowPrefix === null || !text.startsWith(rowPrefix) || !text.endsWith('}]')) return false;
        const values = tryParseJSON(text.slice(rowPrefix.length, -2));
        if (values === undefined) return false;
        insert({ relation: last.relation, new: validate(values, rowSchema, 'passthrough') });
        return true;
      };

      // Returns true at the initial sync's commit.
      const handle = (text) => {
        if (sameTableRow(text)) return false;
        rowPrefix = null;
        const message = parseJSON(text);
        // A row. Checking it against the union of every message (and
        // normalizing its relation, the same object in every row of a
        // table) was most of zero-cache's checking time: the first row of a
        // table is checked whole with zero-cache's insert schema, the next
        // ones by the relation's schema and name and zero-cache's row schema.
        if (version !== null && Array.isArray(message) && message.length === 2 && message[0] === 'data' && message[1]?.tag === 'insert') {
          const row = message[1];
          const relation = row.relation;
          const sameTable =
            specs && last.spec && !last.spec.backfilling?.length && relation?.schema === last.schema && relation?.name === last.name;
          if (sameTable) {
            insert({ relation, new: validate(row.new, rowSchema, 'passthrough') });
          } else {
            insert(validate(row, insertSchema, 'passthrough'));
          }
          const at = text.indexOf(',"new":') + ',"new":'.length;
          if (!last.spec.backfilling?.length && at > ',"new":'.length && text.endsWith('}]')) {
            if (tryParseJSON(text.slice(at, -2)) !== undefined) rowPrefix = text.slice(0, at);
          }
          return false;
        }
        const change = validate(message, changeStreamMessageSchema, 'passthrough');
        const [type, body] = change;
        switch (type) {
          case 'begin': {
            const { commitWatermark } = change[2];
            log.info?.(`initial sync of shard ${shard.appID} at replicaVersion ${commitWatermark}`);
            status.publish(log, 'Initializing', `Copying upstream tables at version ${commitWatermark}`, 5e3);
            initReplicationState(tx, shard.publications.toSorted(), commitWatermark, context, false);
            processor.processMessage(log, change);
            version = commitWatermark;
            jsonFormat = body.json ?? 'p';
            return false;
          }
          case 'data':
            // DDL, or a row outside a transaction (which zero-cache refuses).
            specs = null;
            processor.processMessage(log, change);
            return false;
          case 'commit':
            processor.processMessage(log, change);
            checkRequiredTables(log, tx);
            log.info?.(`finished initial-sync of ${rows} rows in ${Date.now() - t0} ms`);
            return true;
          case 'status':
            return false;
          case 'control':
            if (body.tag === 'reset-required') {
              throw new AutoResetSignal(body.message ?? 'auto-reset signaled by change source');
            }
            throw new Error(`unexpected message during the initial sync: ${text.slice(0, 200)}`);
          default:
            throw new Error(`unexpected message during the initial sync: ${text.slice(0, 200)}`);
        }
      };

      const url = new URL(upstream);
      url.searchParams.set('appID', shard.appID);
      url.searchParams.set('shardNum', String(shard.shardNum));
      for (const publication of shard.publications) url.searchParams.append('publications', publication);
      const socket = new WebSocket(url, { handshakeTimeout: SILENCE_MS });
      let heard = Date.now();
      const watchdog = setInterval(() => {
        if (Date.now() - heard > SILENCE_MS) {
          finish(new Error(`change source ${url.origin} sent nothing for ${SILENCE_MS / 1000} s before the initial sync's commit`));
        }
      }, 1000);
      const finish = (err) => {
        if (done) return;
        done = true;
        clearInterval(watchdog);
        status.stop();
        if (err) {
          socket.terminate();
          reject(err);
        } else {
          socket.close();
          resolve();
        }
      };
      socket.on('message', (data, isBinary) => {
        if (done) return;
        heard = Date.now();
        try {
          if (isBinary) throw new Error('a binary message from the change source; it sends JSON text');
          if (handle(data.toString())) finish();
        } catch (e) {
          finish(e);
        }
      });
      socket.on('error', (e) => finish(e));
      socket.on('close', (code, reason) =>
        finish(new Error(`change source ${url.origin} closed (${[code, reason].filter(String).join(' ')}) before the initial sync's commit`)),
      );
    });

  // zero-cache needs its shard's tables in every replica; its initial sync
  // checks the same.
  const checkRequiredTables = (log, tx) => {
    const { appID, shardNum } = shard;
    const required = {
      [`${appID}_${shardNum}.clients`]: { clientGroupID: 'string', clientID: 'string', lastMutationID: 'number', userID: 'string' },
      [`${appID}_${shardNum}.mutations`]: { clientGroupID: 'string', clientID: 'string', mutationID: 'number', mutation: 'json' },
      [`${appID}.permissions`]: { permissions: 'json', hash: 'string' },
    };
    const tables = computeZqlSpecs(log, tx, { includeBackfillingColumns: true });
    for (const [name, columns] of Object.entries(required)) {
      const table = tables.get(name)?.zqlSpec;
      if (!table) throw new Error(`the upstream has no "${name}" table with a unique index over non-null columns`);
      for (const [column, type] of Object.entries(columns)) {
        if (!table[column]) throw new Error(`the upstream's "${name}" table has no "${column}" column`);
        if (table[column].type !== type) {
          throw new Error(`the upstream's "${name}.${column}" column is a ${table[column].type}, not a ${type}`);
        }
      }
    }
  };

  await initReplica(lc, `replica-${shard.appID}-${shard.shardNum}`, file, initialSync);
}

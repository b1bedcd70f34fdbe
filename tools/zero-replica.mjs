// Writes a synced zero-cache replica file from Sluice, for a zero-cache
// view-syncer that starts on an empty disk (one that takes Sluice as its
// change-streamer, ZERO_CHANGE_STREAMER_URI, and has no litestream backup).
//
// It reads the initial sync Sluice serves on /changes/v0/stream (from its
// table state, at any time, also after its log was purged) into a replica
// made by zero-cache's own code: its migrations, replication state, table
// and index DDL, column metadata, value conversion and validation. Then it
// records Sluice's replica version in the file, so that the view-syncer
// subscribes to /replication/v6/changes with Sluice's replica version from
// the watermark the file holds.
//
// Two routes write the same file (tests/zero_cache.rs compares them row by
// row, bookkeeping included):
//   --via bulk (the default): every message but the rows goes through
//     zero-cache's ChangeProcessor; the rows are converted with zero-cache's
//     liteRow and inserted with one prepared statement per table, all in the
//     initial sync's one transaction. About 3x faster at 1M rows (docs/benchmarks.md).
//   --via initial-sync: zero-cache's custom-source initial sync itself,
//     which validates, converts and inserts one message at a time.
//
// A third route copies a file instead of writing one (tools/zero-replica-keep.mjs):
//   --keep: writes the file (or takes up one it kept before) and keeps it
//     current with Sluice, with zero-cache's own replicator, until SIGTERM;
//   --from KEPT: writes the new file as a consistent copy of the kept one,
//     after Sluice reserves its position. Under a second at 1M rows.
//
// Run it from a directory where @rocicorp/zero (1.9.0) is installed, for
// example the app's own:
//
//   node /path/to/sluice/tools/zero-replica.mjs --sluice HOST:PORT --file replica.db \
//        [--app zero] [--shard 0] [--token-file PATH] [--via bulk|initial-sync]
//   node /path/to/sluice/tools/zero-replica.mjs --sluice HOST:PORT --file kept.db --keep
//   node /path/to/sluice/tools/zero-replica.mjs --sluice HOST:PORT --file replica.db --from kept.db
//
// A Sluice started with --token needs it here too: from the file named by
// --token-file, or the SLUICE_TOKEN environment variable (never on the
// command line, where other users of the machine can read it). It is sent
// as an Authorization header to /status and in the stream URL's user info.
//
// It prints {"replicaVersion": ..., "watermark": ...} and exits 0 (with
// --keep: once the file is synced, and goes on keeping it), or names the
// cause and exits 1. An existing file is refused (remove it first), except
// the one --keep kept; a sync or copy that fails removes the file it began.
import { createRequire } from 'node:module';
import { existsSync, readFileSync, renameSync, rmSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { pathToFileURL } from 'node:url';

function fail(message) {
  process.stderr.write(`zero-replica: ${message}\n`);
  process.exit(1);
}

const FLAGS = new Set(['keep']);
const args = new Map();
for (let i = 2; i < process.argv.length; i += 2) {
  const [flag, value] = [process.argv[i], process.argv[i + 1]];
  if (FLAGS.has(flag?.slice(2))) {
    args.set(flag.slice(2), true);
    i -= 1;
    continue;
  }
  if (!flag?.startsWith('--') || value === undefined) fail(`expected --flag value pairs, got ${flag}`);
  args.set(flag.slice(2), value);
}
const sluice = (args.get('sluice') ?? fail('--sluice HOST:PORT is required')).replace(/^\w+:\/\//, '').replace(/\/.*$/, '');
const file = args.get('file') ?? fail('--file PATH is required');
const appID = args.get('app') ?? 'zero';
const shardNum = Number(args.get('shard') ?? '0');
const via = args.get('via') ?? 'bulk';
const keep = args.has('keep');
const kept = args.get('from');
if (via !== 'bulk' && via !== 'initial-sync') fail(`--via takes bulk or initial-sync, not ${via}`);
if (keep && kept !== undefined) fail('--keep and --from go to different files: keep one file, copy it to others');
// A kept file is taken up again after a restart; any other is written new.
const resuming = keep && existsSync(file);
if (existsSync(file) && !keep) fail(`${file} exists; a replica is written only into a new file`);
if (args.has('token')) fail('--token is not taken on the command line: use --token-file PATH or SLUICE_TOKEN');
let token = process.env.SLUICE_TOKEN ?? '';
if (args.has('token-file')) {
  try {
    token = readFileSync(args.get('token-file'), 'utf8').trim();
  } catch (e) {
    fail(`reading the token file ${args.get('token-file')}: ${e.message}`);
  }
}

// zero-cache's modules, from the @rocicorp/zero installed where this runs.
const here = createRequire(join(process.cwd(), 'index.js'));
let main;
try {
  main = here.resolve('@rocicorp/zero');
} catch {
  fail(`@rocicorp/zero is not installed in ${process.cwd()} (npm install @rocicorp/zero@1.9.0)`);
}
const root = main.slice(0, main.lastIndexOf(`${join('', 'out', 'zero')}`));
const zeroRequire = createRequire(join(root, 'package.json'));
const load = (path) => import(pathToFileURL(join(root, path)).href);
const { initializeCustomChangeSource } = await load('out/zero-cache/src/services/change-source/custom/change-source.js');
const { LogContext } = await import(pathToFileURL(zeroRequire.resolve('@rocicorp/logger')).href);
const Database = (await import(pathToFileURL(zeroRequire.resolve('@rocicorp/zero-sqlite3')).href)).default;
const { writeReplicaInBulk, SILENCE_MS } = await import('./zero-replica-bulk.mjs');
const { keepReplica, copyKeptReplica, replicaPosition } = await import('./zero-replica-keep.mjs');

const headers = token ? { authorization: `Bearer ${token}` } : {};
// A Sluice that accepts the connection and then says nothing must not hold
// the tool: the same bound as the bulk route's silence on the stream.
async function statusOf() {
  const response = await fetch(`http://${sluice}/status`, { headers, signal: AbortSignal.timeout(SILENCE_MS) }).catch((e) =>
    fail(`reading http://${sluice}/status: ${e.name === 'TimeoutError' ? `no answer in ${SILENCE_MS / 1000} s` : e.message}`),
  );
  if (response.status === 401) {
    fail(
      token
        ? `Sluice at ${sluice} refused the token (401): check --token-file or SLUICE_TOKEN against Sluice's --token`
        : `Sluice at ${sluice} requires a token (401): pass --token-file PATH or set SLUICE_TOKEN`,
    );
  }
  if (!response.ok) fail(`reading http://${sluice}/status: HTTP ${response.status}`);
  return response.json().catch((e) => fail(`reading http://${sluice}/status: ${e.message}`));
}
const status = await statusOf();
const replicaVersion = status.replicaVersion ?? fail(`Sluice at ${sluice} serves no lineage yet`);

// zero-cache's log lines go to stderr; stdout carries only the result.
const stderrSink = {
  log(level, context, ...args) {
    const where = Object.entries(context ?? {}).map(([k, v]) => `${k}=${v}`).join(' ');
    const line = `${level} ${where} ${args.map((a) => (typeof a === 'string' ? a : JSON.stringify(a))).join(' ')}`;
    // zero-cache names the stream's URL in its lines, the token with it.
    process.stderr.write(`${token ? line.replaceAll(encodeURIComponent(token), '***').replaceAll(token, '***') : line}\n`);
  },
};
const lc = new LogContext('info', { component: 'zero-replica' }, stderrSink);
// A replica file with its SQLite companions.
const removeFiles = (path) => {
  for (const suffix of ['', '-journal', '-wal', '-shm', '-wal2']) rmSync(`${path}${suffix}`, { force: true });
};
const shard = { appID, shardNum, publications: [] };
const auth = token ? `sluice:${encodeURIComponent(token)}@` : '';
const print = (result) => new Promise((resolve) => process.stdout.write(JSON.stringify(result) + '\n', resolve));

if (kept !== undefined) {
  let copied;
  try {
    copied = await copyKeptReplica({ zeroRequire, Database, sluice, token, shard, kept, file, statusOf });
  } catch (e) {
    removeFiles(file);
    fail(`copying ${kept} failed: ${e?.message ?? e}`);
  }
  await print({ ...copied, copiedFrom: kept });
  process.exit(0);
}

// Writes a synced replica into the new file `target`, at the replica
// version Sluice serves now. A sync that fails takes the file away, so that
// no half-written replica is left for a view-syncer and a second run can
// start at once.
async function writeReplica(target) {
  const serving = (await statusOf()).replicaVersion ?? fail(`Sluice at ${sluice} serves no lineage yet`);
  const context = { appID, taskID: 'sluice-zero-replica', timestamp: new Date().toISOString() };
  try {
    const upstream = `ws://${auth}${sluice}/changes/v0/stream`;
    if (via === 'bulk') await writeReplicaInBulk({ load, zeroRequire, lc, upstream, shard, file: target, context });
    else await initializeCustomChangeSource(lc, upstream, shard, target, context);
  } catch (e) {
    removeFiles(target);
    fail(`the initial sync from ${sluice} failed: ${e?.message ?? e} (${target} removed; run the tool again)`);
  }
  const { watermark } = replicaPosition(Database, target);
  if (watermark < serving) {
    removeFiles(target);
    fail(`the initial sync's watermark ${watermark} predates Sluice's replica version ${serving} (${target} removed)`);
  }
  const db = new Database(target);
  db.prepare('UPDATE "_zero.replicationConfig" SET replicaVersion = ?').run(serving);
  db.close();
}

const at = () => {
  try {
    return replicaPosition(Database, file).watermark;
  } catch {
    return 'an unreadable position';
  }
};
// A kept file Sluice can no longer serve (its position purged while the
// keeper was away, or a new lineage) is derived state: it is written again
// beside the old one and swapped in.
async function rebuild(why) {
  lc.warn?.(`${file}: ${why}; rebuilding it from Sluice's table state`);
  const next = `${file}.rebuilding`;
  removeFiles(next);
  await writeReplica(next);
  removeFiles(file);
  renameSync(next, file);
  lc.info?.(`rebuilt ${file} at ${at()}`);
}

if (!resuming) await writeReplica(file);
let position;
try {
  position = replicaPosition(Database, file);
} catch (e) {
  fail(`${file} is not a synced zero-cache replica (${e.message}); give --keep a new file or one it kept`);
}
if (position.replicaVersion !== replicaVersion) {
  // Only a file --keep kept can be here: any other is new.
  await rebuild(`its replica version ${position.replicaVersion} is not Sluice's ${replicaVersion} (a new lineage)`);
  position = replicaPosition(Database, file);
}
await print(position);
if (!keep) process.exit(0);

// Keep the file current until told to stop.
const stopper = new AbortController();
for (const signal of ['SIGTERM', 'SIGINT']) process.once(signal, () => stopper.abort());
while (!stopper.signal.aborted) {
  try {
    await keepReplica({ load, zeroRequire, lc, changesURI: `ws://${auth}${sluice}/`, file, signal: stopper.signal });
  } catch (e) {
    if (!e?.rebuild) fail(`keeping ${file} stopped at ${at()}: ${e?.message ?? e}`);
    await rebuild(e.message);
  }
}
lc.info?.(`stopped keeping ${file} at ${at()}`);
process.exit(0);

// The kept-replica route of tools/zero-replica.mjs: a replica kept current
// beside Sluice, and copies of it for new view-syncers.
//
// Writing a replica from the table state costs per-row work (about 8 s at
// 1M rows here); copying a file costs about as much as reading it. So, as
// zero-cache's own replication-manager keeps a "backup" replica and hands
// view-syncers a copy of it (its litestream backups, or VACUUM INTO for its
// "serving-copy"), the tool can:
//
//   --keep: follow Sluice's /replication/v6/changes and apply every
//     transaction to the file with zero-cache's own replicator
//     (IncrementalSyncer, its write worker and ChangeProcessor in "backup"
//     mode, which keeps no change log: a view-syncer starts with an empty
//     one, as after a restore). It runs until SIGTERM or SIGINT. A file
//     Sluice can no longer serve (its position purged while the keeper was
//     away, or a new lineage) is written again and swapped in.
//
//   --from KEPT: write the new file as a consistent copy of the kept one
//     (SQLite's VACUUM INTO, zero-cache's own way of copying a replica),
//     after Sluice has been made to hold the log from the kept file's
//     watermark, so the view-syncer can subscribe from the copy's.
//
// Why the hold is enough: the copy's watermark Wc is at least the kept
// file's watermark W0 read first. Sluice deletes only log entries below its
// purge floor, the least of its subscribers' acks and its reservations. The
// copy reserves W0 before it reads, so every purge decided afterwards keeps
// everything from W0 on; a purge decided before had a floor no higher than
// the keeper's ack then, which the keeper had already committed, so no
// higher than Wc. Either way Wc's own entry survives. A reservation outlives
// its connection by --consumer-retention-secs (600 s by default): start the
// view-syncer within that time.

import { existsSync } from 'node:fs';
import { pathToFileURL } from 'node:url';
import { SILENCE_MS } from './zero-replica-bulk.mjs';

// The watermark and replica version a synced replica file holds.
export function replicaPosition(Database, file) {
  const db = new Database(file, { readonly: true, fileMustExist: true });
  try {
    const { watermark } = db.prepare('SELECT stateVersion AS watermark FROM "_zero.replicationState"').get();
    const { replicaVersion } = db.prepare('SELECT replicaVersion FROM "_zero.replicationConfig"').get();
    return { watermark, replicaVersion };
  } finally {
    db.close();
  }
}

// Keeps `file` current with Sluice until `signal` aborts; resolves then.
// Rejects when zero-cache's replicator stops on its own; with `rebuild` set
// on the error when the cause is one a new file cures (Sluice no longer has
// the file's position, or serves another replica version).
export async function keepReplica({ load, zeroRequire, lc, changesURI, file, signal }) {
  const [
    { setupReplica },
    { ThreadWriteWorkerClient },
    { IncrementalSyncer },
    { streamIn },
    { downstreamSchema },
  ] = await Promise.all([
    load('out/zero-cache/src/workers/replicator.js'),
    load('out/zero-cache/src/services/replicator/write-worker-client.js'),
    load('out/zero-cache/src/services/replicator/incremental-sync.js'),
    load('out/zero-cache/src/types/streams.js'),
    load('out/zero-cache/src/services/change-streamer/change-streamer.js'),
  ]);
  const ws = await import(pathToFileURL(zeroRequire.resolve('ws')).href);
  const WebSocket = ws.WebSocket ?? ws.default;
  // zero-cache's own preparation of a backup replica: its migrations, then
  // WAL mode (a copy reads while the keeper writes).
  await setupReplica(lc, 'backup', { file });
  const worker = new ThreadWriteWorkerClient();
  // As zero-cache's backup replica, except that SQLite checkpoints the WAL
  // itself (zero-cache leaves that to litestream).
  await worker.init(file, 'backup', { busyTimeout: 30_000, analysisLimit: 1_000 }, { level: 'warn', format: 'text' });
  // zero-cache's change-streamer client, but for the handshake: zero-cache's
  // waits without bound on a peer that accepts and never answers; this one
  // gives up after SILENCE_MS and the replicator retries. Once connected,
  // zero-cache's streamIn ends a stream that brings neither a message nor a
  // ping (Sluice pings every 10 s) for 33 s.
  const streamer = {
    subscribe(ctx) {
      const { protocolVersion, ...params } = ctx;
      const query = new URLSearchParams({ ...params, taskID: ctx.taskID ?? '', initial: ctx.initial ? 'true' : 'false' });
      const socket = new WebSocket(`${changesURI}replication/v${protocolVersion}/changes?${query}`, {
        handshakeTimeout: SILENCE_MS,
      });
      return streamIn(lc, socket, downstreamSchema);
    },
  };
  const taskID = 'sluice-replica-keeper';
  // A serving subscriber: one that falls behind is dealt with as any other,
  // rather than holding Sluice's flow control for everyone as Zero's
  // backup replicator does.
  const syncer = new IncrementalSyncer(lc, taskID, `${taskID}/${process.pid}`, streamer, worker, 'serving', null);
  // Why the replicator stopped, when it stops itself (an error from Sluice,
  // such as a replica version it no longer serves).
  let reason = null;
  const stopSyncer = syncer.stop.bind(syncer);
  syncer.stop = (log, err) => {
    reason ??= err ?? null;
    stopSyncer(log, err);
  };
  const stop = () => syncer.stop(lc);
  signal.addEventListener('abort', stop, { once: true });
  try {
    await syncer.run();
  } finally {
    signal.removeEventListener('abort', stop);
    await worker.stop().catch(() => {});
  }
  if (signal.aborted) return;
  const why = String(reason?.message ?? reason ?? 'no reason given');
  const error = new Error(`zero-cache's replicator stopped: ${why}`);
  error.rebuild = /^(WatermarkTooOld|WrongReplicaVersion):/.test(why);
  throw error;
}

// Writes `file` as a copy of the kept replica `kept`, once Sluice holds its
// log from the kept file's watermark (see the top of this file). Returns the
// copy's position.
export async function copyKeptReplica({ zeroRequire, Database, sluice, token, shard, kept, file, statusOf }) {
  if (!existsSync(kept)) throw new Error(`the kept replica ${kept} does not exist (start one with --keep)`);
  const from = replicaPosition(Database, kept);
  const status = await statusOf();
  if (status.replicaVersion !== from.replicaVersion) {
    throw new Error(
      `${kept} is of replica version ${from.replicaVersion} but Sluice serves ${status.replicaVersion}: ` +
        'Sluice started a new lineage; remove the kept file and start the keeper again',
    );
  }
  const ws = await import(pathToFileURL(zeroRequire.resolve('ws')).href);
  const WebSocket = ws.WebSocket ?? ws.default;
  const auth = token ? `sluice:${encodeURIComponent(token)}@` : '';
  const query = new URLSearchParams({
    appID: shard.appID,
    shardNum: String(shard.shardNum),
    lastWatermark: from.watermark,
    replicaVersion: from.replicaVersion,
  });
  // Resuming zero-cache's custom upstream from W0 reserves W0 (and it stays
  // reserved for the retention period after the socket closes, whatever
  // Sluice answers on it). The reservation is seen in /status.
  const socket = new WebSocket(`ws://${auth}${sluice}/changes/v0/stream?${query}`, { handshakeTimeout: SILENCE_MS });
  let closed = null;
  socket.on('error', (e) => (closed ??= e.message));
  socket.on('close', (code, reason) => (closed ??= `closed (${[code, reason].filter(String).join(' ')})`));
  socket.on('message', () => {});
  try {
    const holder = `zero-cache ${shard.appID}_${shard.shardNum} @ ${from.replicaVersion}`;
    const deadline = Date.now() + SILENCE_MS;
    for (;;) {
      // Read before /status: Sluice reserves before it can close a resumed
      // stream, so a stream already closed and no reservation means none.
      const wasClosed = closed;
      const { reservations = [] } = await statusOf();
      if (reservations.some((r) => r.holder === holder && r.watermark === from.watermark)) break;
      if (wasClosed !== null) throw new Error(`Sluice at ${sluice} did not reserve ${from.watermark}: its stream ${wasClosed}`);
      if (Date.now() > deadline) throw new Error(`Sluice at ${sluice} did not reserve ${from.watermark} in ${SILENCE_MS / 1000} s`);
      await new Promise((resolve) => setTimeout(resolve, 20));
    }
    const source = new Database(kept, { fileMustExist: true });
    try {
      source.prepare('VACUUM INTO ?').run(file);
    } catch (e) {
      // The caller removes what the copy began.
      throw new Error(`copying ${kept}: ${e.message}`);
    } finally {
      source.close();
    }
  } finally {
    socket.terminate();
  }
  const copied = replicaPosition(Database, file);
  // The argument above holds while the keeper follows; a kept file whose
  // keeper was away may be behind what Sluice still holds.
  const { minWatermark } = await statusOf();
  if (minWatermark && minWatermark > copied.watermark) {
    throw new Error(
      `${kept} is at ${copied.watermark}, which Sluice's log no longer holds (it starts at ${minWatermark}): ` +
        'is its keeper running? (a keeper that comes back rebuilds the file)',
    );
  }
  return copied;
}

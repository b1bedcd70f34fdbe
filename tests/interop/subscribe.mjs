// Subscribes to a change streamer with Zero's own client (ChangeStreamerHttpClient
// from @rocicorp/zero 1.9.0) and checks what arrives against the mock source's
// known stream: every transaction once, in order, every message passing Zero's
// downstream schema, big integers intact. Reconnects from the last processed
// commit when the connection drops.
//
// usage: node subscribe.mjs TARGET REPLICA_VERSION TRANSACTIONS [APP_ID [ORACLE EVENTS]]
// Prints progress lines ("commit W") and a final JSON summary line.
//
// ORACLE is `mock` (the default: the mock source's commits lexi(1)..lexi(N))
// or `events` (a Postgres upstream whose transactions insert rows into table
// `events` with ids 0..EVENTS-1 and big = 2^60 + id: commits must grow and
// every id must arrive exactly once in a committed transaction).

const zeroSrc = new URL('./node_modules/@rocicorp/zero/out/zero-cache/src/', import.meta.url);
const { ChangeStreamerHttpClient } = await import(new URL('services/change-streamer/change-streamer-http.js', zeroSrc));
const { downstreamSchema } = await import(new URL('services/change-streamer/change-streamer.js', zeroSrc));
const { parse } = await import(new URL('../../shared/src/valita.js', zeroSrc));
const { LogContext } = await import('@rocicorp/logger');

// TARGET is the change streamer's ws:// URL, or a postgres:// change DB URL
// (with APP_ID) to discover the streamer the way a view-syncer does: from
// replicationState.ownerAddress.
const [target, replicaVersion, total, appID = 'zero', oracle = 'mock', events = '0'] = process.argv.slice(2);
const eventIds = new Map();
const discover = target.startsWith('postgres');
const want = Number(total);

function lexi(n) {
  const s = BigInt(n).toString(36);
  return (s.length - 1).toString(36) + s;
}

const lc = new LogContext('error', {});
// The change DB is only used for discovery, which a fixed URI skips.
const client = discover
  ? new ChangeStreamerHttpClient(lc, { appID, shardNum: 0 }, target, undefined)
  : new ChangeStreamerHttpClient(lc, { appID, shardNum: 0 }, 'postgres://127.0.0.1:1/unused', target);

const commits = [];
const problems = [];
let watermark = replicaVersion;
let reconnects = 0;
let messages = 0;

function fail(msg) {
  problems.push(msg);
}

while (commits.length < want && reconnects < 200) {
  let sub;
  try {
    sub = await client.subscribe({
      protocolVersion: 6, id: 'zero-interop', taskID: 'interop', mode: 'serving',
      replicaVersion, watermark, initial: false,
    });
  } catch (e) {
    reconnects++;
    await new Promise(r => setTimeout(r, 200));
    continue;
  }
  let first = true;
  let open = null;
  // Events of the open transaction: they count once it commits (a
  // transaction cut by a disconnect is redelivered whole).
  let pending = [];
  try {
    for await (const msg of sub) {
      messages++;
      try {
        parse(msg, downstreamSchema, 'passthrough');
      } catch (e) {
        fail(`message fails Zero's schema: ${String(e)}`);
      }
      const [kind, body, extra] = msg;
      if (first && kind !== 'status') fail(`first message is ${kind}, not status`);
      first = false;
      if (kind === 'error') {
        fail(`error from server: ${JSON.stringify(body)}`);
        break;
      } else if (kind === 'begin') {
        if (open) fail(`begin ${extra.commitWatermark} inside ${open}`);
        open = extra.commitWatermark;
      } else if (kind === 'data') {
        if (!open) fail('data outside a transaction');
        if (body.tag === 'insert' && oracle === 'events' && body.relation.name === 'events') {
          pending.push(Number(body.new.id));
        }
        if (body.tag === 'insert' && (oracle === 'mock' || body.relation.name === 'events')) {
          const { id, big } = body.new;
          if (typeof big !== 'bigint' || big !== (1n << 60n) + BigInt(id)) fail(`big integer not intact: ${big} for id ${id}`);
        }
      } else if (kind === 'rollback') {
        open = null;
        pending = [];
      } else if (kind === 'commit') {
        const w = extra.watermark;
        if (w !== open) fail(`commit ${w} does not match begin ${open}`);
        open = null;
        for (const id of pending) eventIds.set(id, (eventIds.get(id) ?? 0) + 1);
        pending = [];
        commits.push(w);
        watermark = w;
        console.log(`commit ${w}`);
        if (commits.length >= want) break;
      }
    }
  } catch (e) {
    // The connection dropped: reconnect from the last processed commit.
  }
  sub.cancel?.();
  if (commits.length < want) {
    reconnects++;
    await new Promise(r => setTimeout(r, 200));
  }
}

if (oracle === 'mock') {
  const expected = Array.from({ length: want }, (_, i) => lexi(i + 1));
  const inOrder = commits.length === want && commits.every((w, i) => w === expected[i]);
  if (!inOrder) fail(`commits differ from 1..${want}: got ${commits.length}, first mismatch at ${commits.findIndex((w, i) => w !== expected[i])}`);
} else {
  if (commits.length !== want) fail(`${commits.length} commits, expected ${want}`);
  const bad = commits.findIndex((w, i) => i > 0 && !(commits[i - 1] < w));
  if (bad >= 0) fail(`commit ${commits[bad]} does not follow ${commits[bad - 1]}`);
  for (let id = 0; id < Number(events); id++) {
    const n = eventIds.get(id) ?? 0;
    if (n !== 1) fail(`event ${id} arrived ${n} times`);
  }
  if (eventIds.size !== Number(events)) fail(`${eventIds.size} distinct events, expected ${events}`);
}
console.log(JSON.stringify({ commits: commits.length, reconnects, messages, problems }));
process.exit(problems.length ? 1 : 0);

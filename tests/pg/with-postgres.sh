#!/usr/bin/env bash
# Runs a command with a private PostgreSQL server for the tests.
#
#   tests/pg/with-postgres.sh cargo test
#
# Starts a throw-away server (wal_level=logical, a free port on 127.0.0.1, a
# temporary data directory) as an unprivileged user, exports
# SLUICE_TEST_PG_URL for the tests, and removes everything afterwards.
# To use a server of your own instead, set SLUICE_TEST_PG_URL yourself
# (a superuser URL, e.g. postgres://postgres@127.0.0.1:5432/postgres).
set -euo pipefail

find_bindir() {
  local d
  d=$(pg_config --bindir 2>/dev/null || true)
  if [ -n "$d" ] && [ -x "$d/initdb" ]; then echo "$d"; return; fi
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -n "$d" ] && [ -x "$d/initdb" ]; then echo "$d"; return; fi
}

BINDIR=$(find_bindir)
if [ -n "${SLUICE_TEST_PG_URL:-}" ]; then
  # Tests that need a private server of their own start it from these binaries.
  export SLUICE_TEST_PG_BINDIR="${SLUICE_TEST_PG_BINDIR:-$BINDIR}"
  exec "$@"
fi
if [ -z "$BINDIR" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "with-postgres: installing the PostgreSQL server (apt-get install postgresql)" >&2
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  BINDIR=$(find_bindir)
fi
if [ -z "$BINDIR" ]; then
  echo "with-postgres: no PostgreSQL server binaries found (install postgresql, or set SLUICE_TEST_PG_URL)" >&2
  exit 1
fi

# The server refuses to run as root.
RUN=()
if [ "$(id -u)" = 0 ]; then
  id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
  RUN=(runuser -u postgres --)
fi

DIR=$(mktemp -d /tmp/sluice-pg.XXXXXX)
chmod 755 "$DIR"
[ "$(id -u)" = 0 ] && chown postgres "$DIR"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')

stop() {
  "${RUN[@]}" "$BINDIR/pg_ctl" -D "$DIR/data" -m immediate -w stop >/dev/null 2>&1 || true
  rm -rf "$DIR"
}
trap stop EXIT

"${RUN[@]}" "$BINDIR/initdb" -D "$DIR/data" -U postgres -A trust -E UTF8 --no-sync >"$DIR/initdb.log" 2>&1 ||
  { cat "$DIR/initdb.log" >&2; exit 1; }
# A password (SCRAM) user for the tests of authentication; everyone else is trusted.
{
  echo "host all sluice_scram 127.0.0.1/32 scram-sha-256"
  echo "host replication sluice_scram 127.0.0.1/32 scram-sha-256"
  cat "$DIR/data/pg_hba.conf"
} >"$DIR/pg_hba.conf" && cat "$DIR/pg_hba.conf" >"$DIR/data/pg_hba.conf" && rm "$DIR/pg_hba.conf"
# SLUICE_TEST_PG_SSL=1 (make bench): the server also offers TLS, with a
# self-signed certificate, so the bench can compare sslmode=require with a
# plain connection on the same server. The tests keep a plain server and
# start TLS-only servers of their own (tests/pg_tls.rs).
SSL_OPTS=""
if [ "${SLUICE_TEST_PG_SSL:-}" = 1 ] && command -v openssl >/dev/null; then
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=127.0.0.1" \
    -keyout "$DIR/data/server.key" -out "$DIR/data/server.crt" >/dev/null 2>&1
  chmod 600 "$DIR/data/server.key"
  [ "$(id -u)" = 0 ] && chown postgres "$DIR/data/server.key" "$DIR/data/server.crt"
  SSL_OPTS="-c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key"
fi
"${RUN[@]}" "$BINDIR/pg_ctl" -D "$DIR/data" -l "$DIR/server.log" -w -t 60 \
  -o "-p $PORT -k $DIR $SSL_OPTS -c listen_addresses=127.0.0.1 -c wal_level=logical -c max_connections=300 -c max_wal_senders=20 -c max_replication_slots=20 -c logical_decoding_work_mem=64kB" \
  start >/dev/null || { cat "$DIR/server.log" >&2; exit 1; }

export SLUICE_TEST_PG_URL="postgres://postgres@127.0.0.1:$PORT/postgres"
export SLUICE_TEST_PG_BINDIR="$BINDIR"
echo "with-postgres: PostgreSQL $("$BINDIR/postgres" --version | awk '{print $3}') at $SLUICE_TEST_PG_URL" >&2
"$@"

#!/usr/bin/env bash
# Runs a command with a private MariaDB server for the mariadb-source tests.
#
#   tests/mariadb/with-mariadb.sh cargo test --test mariadb_source
#
# Installs Debian's mariadb-server when it is missing (as root, with apt-get),
# starts a throw-away server as an unprivileged user on a free port of
# 127.0.0.1 with a temporary data directory and the settings a binlog reader
# needs (log_bin, binlog_format=ROW, binlog_row_image=FULL,
# binlog_row_metadata=FULL), exports SLUICE_TEST_MARIADB (host:port, root
# over the socket SLUICE_TEST_MARIADB_SOCKET), and removes everything
# afterwards. Set SLUICE_TEST_MARIADB yourself to use your own server.
set -euo pipefail

if [ -n "${SLUICE_TEST_MARIADB:-}" ]; then
  exec "$@"
fi
if ! command -v mariadbd >/dev/null && ! [ -x /usr/sbin/mariadbd ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "with-mariadb: installing the MariaDB server (apt-get install mariadb-server)" >&2
    apt-get update -qq >/dev/null &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mariadb-server >/dev/null
  else
    echo "with-mariadb: no MariaDB server found (install mariadb-server, or set SLUICE_TEST_MARIADB)" >&2
    exit 1
  fi
fi
MARIADBD=$(command -v mariadbd || echo /usr/sbin/mariadbd)

# The server must not run as root.
RUN=()
USER_NAME=$(id -un)
if [ "$(id -u)" = 0 ]; then
  id mysql >/dev/null 2>&1 || useradd --system --no-create-home mysql
  RUN=(runuser -u mysql --)
  USER_NAME=mysql
fi

DIR=$(mktemp -d /tmp/sluice-mariadb.XXXXXX)
chmod 755 "$DIR"
[ "$(id -u)" = 0 ] && chown mysql "$DIR"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
SOCK="$DIR/mysqld.sock"

stop() {
  if [ -f "$DIR/mysqld.pid" ]; then
    kill "$(cat "$DIR/mysqld.pid")" 2>/dev/null || true
    for _ in $(seq 1 100); do [ -f "$DIR/mysqld.pid" ] || break; sleep 0.1; done
  fi
  rm -rf "$DIR"
}
trap stop EXIT

"${RUN[@]}" mariadb-install-db --no-defaults --datadir="$DIR/data" --user="$USER_NAME" \
  --auth-root-authentication-method=socket --skip-test-db >"$DIR/install.log" 2>&1 ||
  { cat "$DIR/install.log" >&2; exit 1; }

"${RUN[@]}" "$MARIADBD" --no-defaults --datadir="$DIR/data" --socket="$SOCK" --pid-file="$DIR/mysqld.pid" \
  --port="$PORT" --bind-address=127.0.0.1 --skip-name-resolve --log-error="$DIR/server.log" \
  --server-id=1 --log-bin="$DIR/data/binlog" --binlog-format=ROW --binlog-row-image=FULL \
  --binlog-row-metadata=FULL --innodb-buffer-pool-size=64M --innodb-log-file-size=32M \
  --innodb-flush-log-at-trx-commit=2 --sync-binlog=0 --max-connections=200 \
  --character-set-server=utf8mb4 --collation-server=utf8mb4_general_ci 2>>"$DIR/server.log" &

for _ in $(seq 1 300); do
  mariadb --no-defaults -S "$SOCK" -u root -e 'select 1' >/dev/null 2>&1 && break
  sleep 0.1
done
mariadb --no-defaults -S "$SOCK" -u root -e 'select 1' >/dev/null 2>&1 ||
  { echo "with-mariadb: the server did not start" >&2; cat "$DIR/server.log" >&2; exit 1; }

export SLUICE_TEST_MARIADB="127.0.0.1:$PORT"
export SLUICE_TEST_MARIADB_SOCKET="$SOCK"
echo "with-mariadb: $("$MARIADBD" --version | awk '{print $3}') at $SLUICE_TEST_MARIADB" >&2
"$@"

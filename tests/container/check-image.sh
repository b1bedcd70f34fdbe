#!/usr/bin/env bash
# Runs Sluice's image as an operator would, with podman, against the
# PostgreSQL server of tests/pg/with-postgres.sh (SLUICE_TEST_PG_URL), and
# checks, failing on the first that does not hold:
#   1. the HEALTHCHECK passes on the address the server is configured with;
#   2. the server runs as the image's non-root user (uid 10001);
#   3. transactions written upstream are stored;
#   4. SIGTERM is a graceful stop: a subscriber is closed with 1001, the
#      process logs "stopped" and exits 0, well within the grace period;
#   5. the change log lives on the volume: a new container on the same
#      volume continues the same lineage from the same watermark;
#   6. with TLS configured (SLUICE_TLS_CERT/KEY), the HEALTHCHECK follows:
#      it passes over https on the server's own certificate.
#   tests/pg/with-postgres.sh tests/container/check-image.sh sluice:VERSION
set -euo pipefail
IMAGE=${1:?usage: check-image.sh IMAGE}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
: "${SLUICE_TEST_PG_URL:?run under tests/pg/with-postgres.sh}"
# shellcheck source=tests/container/tools.sh
. "$ROOT/tests/container/tools.sh"
PSQL="${SLUICE_TEST_PG_BINDIR:+$SLUICE_TEST_PG_BINDIR/}psql"
SLUICE=${SLUICE_BIN:-$ROOT/target/dist/sluice}

NAME=sluice-check-$$
VOLUME=sluice-check-$$
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
TMP=$(mktemp -d)
cleanup() {
  podman rm -f -t 0 "$NAME" >/dev/null 2>&1 || true
  podman volume rm -f "$VOLUME" >/dev/null 2>&1 || true
  rm -rf "$TMP"
}
trap cleanup EXIT
fail() {
  echo "check-image: FAIL: $*" >&2
  podman logs "$NAME" 2>&1 | tail -20 >&2 || true
  exit 1
}
ok() { echo "check-image: ok: $*"; }
# Polls `$@` once every 0.2 s for up to $1 seconds.
wait_for() {
  local seconds=$1; shift
  local deadline=$((SECONDS + seconds))
  until "$@"; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.2
  done
}
status() { curl -fsS "http://127.0.0.1:$PORT/status"; }
field() { status | python3 -c "import json,sys; v=json.load(sys.stdin).get('$1'); print('' if v is None else v)"; }

# A root podman sets RLIMIT_NPROC and RLIMIT_NOFILE to 1048576, which a
# sandbox without CAP_SYS_RESOURCE refuses; runc (not crun) also copes
# with a hybrid cgroup layout. Neither matters to the image itself.
RUN_FLAGS=(--runtime runc --network host --ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=32768:32768)
start() {
  podman run -d --name "$NAME" "${RUN_FLAGS[@]}" "$@" -v "$VOLUME:/var/lib/sluice" \
    -e "SLUICE_LISTEN=127.0.0.1:$PORT" -e SLUICE_SOURCE=postgres \
    -e "SLUICE_SOURCE_CONFIG={\"url\":\"$SLUICE_TEST_PG_URL\"}" "$IMAGE" run >/dev/null
}

"$PSQL" -q "$SLUICE_TEST_PG_URL" -c "DROP TABLE IF EXISTS image_check; CREATE TABLE image_check (id int PRIMARY KEY, note text)"
start

# 1. The HEALTHCHECK, as the engine runs it (`podman healthcheck run`
#    executes the image's own command inside the container).
healthy() { podman healthcheck run "$NAME" >/dev/null 2>&1; }
wait_for 60 healthy || fail "the HEALTHCHECK did not pass within 60 s"
[ "$(podman inspect --format '{{.State.Health.Status}}' "$NAME")" = healthy ] || fail "not reported healthy"
ok "HEALTHCHECK passes (sluice health on 127.0.0.1:$PORT from SLUICE_LISTEN)"

# 2. The server's own uid, not only the image's USER line.
uid=$(podman exec "$NAME" awk '/^Uid:/ {print $2}' /proc/1/status)
[ "$uid" = 10001 ] || fail "the server runs as uid $uid"
ok "the server runs as uid 10001 (sluice)"

# 3. Data flows from the upstream into the volume's change log.
stored_at_least() { [ "$(field transactions)" -ge "$1" ] 2>/dev/null; }
for i in 1 2 3; do "$PSQL" -q "$SLUICE_TEST_PG_URL" -c "INSERT INTO image_check VALUES ($i, 'row $i')"; done
wait_for 60 stored_at_least 3 || fail "3 upstream transactions were not stored: $(status)"
lineage=$(field replicaVersion)
head=$(field lastWatermark)
[ -n "$lineage" ] && [ -n "$head" ] || fail "no lineage or head in /status"
ok "3 transactions stored (lineage $lineage, head $head)"

# 4. SIGTERM with a subscriber attached: it is told the server is going away.
"$SLUICE" tail "ws://127.0.0.1:$PORT" --from-head >"$TMP/tail.out" 2>"$TMP/tail.err" &
tail_pid=$!
subscribed() { [ "$(field subscribers)" -ge 1 ] 2>/dev/null; }
wait_for 30 subscribed || fail "the subscriber did not join"
started=$SECONDS
podman stop -t 40 "$NAME" >/dev/null
took=$((SECONDS - started))
code=$(podman inspect --format '{{.State.ExitCode}}' "$NAME")
[ "$code" = 0 ] || fail "exit code $code after SIGTERM"
[ "$took" -lt 35 ] || fail "the stop took $took s"
podman logs "$NAME" 2>&1 | grep -q '"stopped"' || fail "no \"stopped\" line in the log"
wait "$tail_pid" && tail_rc=0 || tail_rc=$?
grep -q "1001" "$TMP/tail.err" || fail "the subscriber was not closed with 1001 (tail exit $tail_rc: $(cat "$TMP/tail.err"))"
ok "SIGTERM: exit 0 in ${took} s, \"stopped\" logged, the subscriber closed with 1001"

# 5. A new container on the same volume continues the same log.
podman rm "$NAME" >/dev/null
start
wait_for 60 healthy || fail "the second container did not become healthy"
[ "$(field replicaVersion)" = "$lineage" ] || fail "lineage $(field replicaVersion) after the restart, was $lineage"
[ "$(field lastWatermark)" \> "$head" ] || [ "$(field lastWatermark)" = "$head" ] || fail "head went back to $(field lastWatermark) from $head"
"$PSQL" -q "$SLUICE_TEST_PG_URL" -c "INSERT INTO image_check VALUES (4, 'row 4')"
moved_on() { [ "$(field lastWatermark)" \> "$head" ]; }
wait_for 60 moved_on || fail "the restarted container did not store the next transaction"
ok "the volume kept the change log: lineage $lineage continues past $head"

# 6. TLS from the settings: the same HEALTHCHECK now speaks https.
mkdir "$TMP/tls"
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=sluice.example -keyout "$TMP/tls/server.key" \
  -out "$TMP/tls/server.crt" 2>/dev/null
chmod 644 "$TMP/tls/server.key" # read by uid 10001 in the container (a test key)
podman stop -t 40 "$NAME" >/dev/null && podman rm "$NAME" >/dev/null
start -v "$TMP/tls:/etc/sluice/tls:ro" -e SLUICE_TLS_CERT=/etc/sluice/tls/server.crt \
  -e SLUICE_TLS_KEY=/etc/sluice/tls/server.key
wait_for 60 healthy || fail "the HEALTHCHECK did not pass with TLS configured"
curl -fsS --cacert "$TMP/tls/server.crt" --resolve "sluice.example:$PORT:127.0.0.1" \
  "https://sluice.example:$PORT/healthz" >/dev/null || fail "the endpoint does not serve https"
! curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 || fail "the endpoint still serves plain http"
ok "with SLUICE_TLS_CERT the HEALTHCHECK passes over https"
echo "check-image: $IMAGE passed"

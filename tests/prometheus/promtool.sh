#!/usr/bin/env bash
# Runs Prometheus's own `promtool` (or, as `prometheus.sh`, the server) from
# Debian's `prometheus` package, unpacked once into target/tools without
# installing it (no service is started, no root needed once downloaded).
#   tests/prometheus/promtool.sh check rules packaging/prometheus/sluice-alerts.yml
# With PROMETHEUS_BIN=prometheus it runs the server binary instead.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
tools="$here/target/tools/prometheus"
bin="${PROMETHEUS_BIN:-promtool}"
if ! [ -x "$tools/usr/bin/$bin" ]; then
  if command -v "$bin" >/dev/null 2>&1 && [ -z "${PROMETHEUS_BIN:-}" ]; then
    exec "$bin" "$@"
  fi
  mkdir -p "$tools"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && apt-get download prometheus >/dev/null 2>&1) || {
    [ "$(id -u)" = 0 ] && apt-get update -qq >/dev/null && (cd "$work" && apt-get download prometheus >/dev/null)
  } || { echo "promtool.sh: cannot download Debian's prometheus package (apt-get download prometheus)" >&2; exit 1; }
  dpkg-deb -x "$work"/prometheus_*.deb "$tools"
fi
exec "$tools/usr/bin/$bin" "$@"

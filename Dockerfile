# Sluice: the host and the bundled plugins in a small image that runs as a
# non-root user. Build: `docker build -t sluice .`
# Run:   docker run -p 4849:4849 -v sluice-data:/var/lib/sluice sluice \
#          run --source postgres --source-config @/etc/sluice/source.json

# ---- build ----------------------------------------------------------------
FROM rust:1.95-bookworm AS build
RUN rustup target add wasm32-wasip2
WORKDIR /src
COPY . .
# The host (release) and every bundled plugin into target/plugins.
RUN cargo build --release --locked --bin sluice \
 && make plugins CARGO="cargo" \
 && strip target/release/sluice

# ---- run ------------------------------------------------------------------
FROM debian:bookworm-slim
# CA roots for sslrootcert=system and wss:// upstreams.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --home-dir /var/lib/sluice --shell /usr/sbin/nologin sluice \
 && mkdir -p /var/lib/sluice \
 && chown sluice:sluice /var/lib/sluice
# `sluice` finds its plugins in ../lib/sluice/plugins beside the binary.
COPY --from=build /src/target/release/sluice /usr/local/bin/sluice
COPY --from=build /src/target/plugins/ /usr/local/lib/sluice/plugins/
USER sluice
WORKDIR /var/lib/sluice
ENV SLUICE_LISTEN=0.0.0.0:4849 \
    SLUICE_CHANGE_DB=sqlite:/var/lib/sluice/changelog.db \
    SLUICE_LOG_FORMAT=json
VOLUME ["/var/lib/sluice"]
EXPOSE 4849
# Liveness: the process serves. (Kubernetes: probe /healthz and /readyz
# over HTTP instead; see README "Health".)
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s \
  CMD ["sluice", "health", "--url", "http://127.0.0.1:4849"]
# SIGTERM starts the graceful shutdown (1001 to every subscriber, storer
# drained); give it --shutdown-timeout-secs (30) plus a margin:
# `docker stop -t 40`.
STOPSIGNAL SIGTERM
ENTRYPOINT ["sluice"]
CMD ["run", "--source", "mock-source", "--source-config", "{\"rate\": 50}"]

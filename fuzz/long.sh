#!/usr/bin/env bash
# Long fuzzing: run each named target until its process has used CPU_SECONDS of CPU time (not
# wall time: a shared machine's wall clock says little), LANES targets at a time, at low
# priority. Each target's log goes to fuzz/target/long/TARGET.log and one line per target to
# fuzz/target/long/summary.tsv: target, CPU seconds, runs, corpus size, crash files.
# Usage: fuzz/long.sh [TARGET...]   (CPU_SECONDS=1800 LANES=2 by default)
set -uo pipefail
cd "$(dirname "$0")"
CPU_SECONDS=${CPU_SECONDS:-1800}
LANES=${LANES:-2}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=($(ls fuzz_targets | sed 's/\.rs$//'))
out=target/long
mkdir -p "$out"
./build.sh >/dev/null 2>&1 || exit 1
bin=target/x86_64-unknown-linux-gnu/release

cpu_of() { # user+system seconds of a pid
  awk '{print int(($14+$15)/100)}' "/proc/$1/stat" 2>/dev/null || echo 0
}

one() {
  local t=$1 log="$out/$1.log" corpus="target/corpus/$1"
  mkdir -p "$corpus" "$out/artifacts/$t"
  nice -n 10 "$bin/$t" "$corpus" "corpus/$t" -dict=json.dict -print_final_stats=1 \
    -artifact_prefix="$out/artifacts/$t/" -max_total_time=100000 >"$log" 2>&1 &
  local pid=$! used=0
  while kill -0 "$pid" 2>/dev/null; do
    sleep 10
    used=$(cpu_of "$pid")
    [ "$used" -ge "$CPU_SECONDS" ] && kill -INT "$pid" && break
  done
  wait "$pid"
  local runs crashes
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  crashes=$(ls "$out/artifacts/$t" | wc -l)
  printf '%s\t%s\t%s\t%s\t%s\n' "$t" "$used" "${runs:-?}" "$(ls "$corpus" | wc -l)" "$crashes" >>"$out/summary.tsv"
}

running=0
for t in "${targets[@]}"; do
  one "$t" &
  running=$((running + 1))
  if [ "$running" -ge "$LANES" ]; then wait -n; running=$((running - 1)); fi
done
wait
cat "$out/summary.tsv"

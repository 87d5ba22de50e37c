#!/usr/bin/env python3
"""Runs test binaries of the envoy-tests package side by side: `make integration` and
`make compat` hand it one job per (build or Envoy, test binary), and it keeps the machine's
cores busy without letting the jobs starve each other.

A job is one string: `VAR=value ...` settings for its environment, then the arguments of
`cargo test -p envoy-tests --features envoy` (`--test NAME`); the test binary runs with
`--test-threads 2`. A job marked `heavy:` (its first word) measures rates or fairness under
load: no other heavy job runs beside it, and only jobs that mostly wait (at most
--beside-heavy cores on average) run beside it.

Scheduling by CPU: each job's cores are its CPU time over its wall time, as measured at the
last run here (target/suite/times.json) or, for a job never run here, in a clean-clone CI run
(ESTIMATES). A job starts when the cores of the jobs running plus its own stay within --cores
(default: 85 % of the machine's: an Envoy loading the wasm build takes 2.4 s of CPU at once), at
most --jobs at once; the heavy jobs first, then the longest. Most of the suite waits on Envoy's
clocks and windows, so several of those run at once on two cores. Six at once, up to all the
cores, left a test's service call waiting over 2 s (a global rule's first call, global.rs).

Each job's output goes to target/suite/<label>.log and is printed whole if it fails. At the
end: a table of every job (wall time, CPU time of the job and all it started, result), longest
first, and the wall time of the whole run; the exit status is 1 if any job failed. No job is
retried."""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
OUT = ROOT / "target" / "suite"
TIMES = OUT / "times.json"
# Wall and CPU seconds of each job in a clean-clone CI run (when no run here measured it).
ESTIMATES = {
    "wasm-global": (115, 134), "wasm-share_fleet": (67, 104), "wasm-soak": (65, 122),
    "wasm-share_fair": (45, 70), "native-share_fair": (43, 55),
    "wasm-share_fair_six": (45, 70), "native-share_fair_six": (43, 55),
    "wasm-share_fair_many": (45, 75), "native-share_fair_many": (43, 60),
    "wasm-share_fair_learn": (45, 60), "native-share_fair_learn": (43, 45),
    "wasm-share_fair_faults": (75, 70), "native-share_fair_faults": (68, 55),
    "wasm-share_fair_waits": (45, 70), "native-share_fair_waits": (42, 55),
    "native-soak": (63, 121), "native-share_fleet": (61, 69), "wasm-flood": (61, 115),
    "wasm-envoy": (61, 46), "wasm-share": (61, 57), "native-share": (60, 51),
    "wasm@1.37.0-envoy": (59, 48), "wasm-sdk": (58, 41), "wasm@1.39.3-envoy": (55, 49),
    "wasm-docs": (53, 54), "wasm-explain": (53, 36), "wasm@1.36.4-envoy": (52, 43),
    "native-global": (47, 36), "wasm-algorithms": (44, 33), "wasm-elastic": (38, 10),
    "wasm-share_wait": (36, 20), "native-flood": (35, 65), "native-elastic": (35, 7),
    "wasm-share_learn": (34, 37), "wasm-share_tokens": (33, 16), "native-share_wait": (33, 18),
    "native-sdk": (33, 14), "native-share_learn": (31, 28), "native-share_tokens": (30, 10),
    "wasm-tokens": (30, 28), "native-envoy": (29, 13), "wasm-reload": (27, 32),
    "native@.venv-abi-1.39.3-envoy": (26, 12), "native@1.39.3-abi-1.39.3-envoy": (23, 11),
    "wasm-held": (22, 21), "native-reload": (21, 22), "native-algorithms": (21, 3),
    "wasm-quota": (19, 22), "wasm-prometheus": (18, 5), "native-prometheus": (17, 3),
    "native-tokens": (16, 4), "native-held": (15, 12), "wasm-failure": (14, 9),
    "wasm-operator_route": (11, 9), "native-quota": (11, 2), "native-docs": (11, 5),
    "wasm-replay": (9, 5), "wasm-tutorials": (9, 14), "wasm-plans": (8, 10),
    "native-explain": (7, 3), "wasm-hostile": (7, 6), "native-tutorials": (6, 6),
    "wasm-deploy": (5, 10), "native-failure": (5, 1), "wasm-envoy_gateway": (4, 3),
    "native-replay": (4, 1), "native-plans": (4, 1), "native-hostile": (3, 1),
    "wasm-services": (3, 5), "wasm-upgrade": (2, 4), "wasm-llm_upstream": (2, 2),
    "wasm-calendar": (2, 4), "wasm-versions": (2, 2), "native-operator": (2, 1),
    "native-services": (1, 1), "native-operator_route": (1, 1), "native-calendar": (1, 1),
    "native-examples": (1, 1), "wasm-examples": (1, 1), "wasm-operator": (1, 1),
}
# A job nothing is known of: as long as most, using one core.
UNKNOWN = (30, 30)


class Job:
    def __init__(self, spec):
        words = shlex.split(spec)
        self.heavy = bool(words) and words[0] == "heavy:"
        if self.heavy:
            words = words[1:]
        self.env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_][A-Z0-9_]*=", w))
        self.args = [w for w in words if not re.match(r"^[A-Z_][A-Z0-9_]*=", w)]
        tests = [a for i, a in enumerate(self.args) if i and self.args[i - 1] == "--test"]
        self.test = "+".join(tests) or "all"
        where = self.env.get("FILTER", "")
        if "ENVOY" in self.env:
            where += "@" + Path(self.env["ENVOY"]).parent.parent.name
        if "NATIVE_DIR" in self.env:
            where += "-" + Path(self.env["NATIVE_DIR"]).parent.name
        self.label = f"{where}-{self.test}".strip("-")
        self.wall = self.cpu = 0.0
        self.status = None

    def expect(self, known):
        """The wall seconds and cores this job is expected to take."""
        seen = known.get(self.label)
        if isinstance(seen, dict):
            wall, cpu = seen.get("wall", 0), seen.get("cpu", 0)
        else:
            wall, cpu = ESTIMATES.get(self.label, UNKNOWN)
        wall = max(wall, 1)
        return wall, min(cpu / wall, 2.0)

    def run(self):
        log = OUT / f"{self.label}.log"
        cmd = ["cargo", "test", "-p", "envoy-tests", "--features", "envoy", *self.args, "--",
               "--test-threads", "2"]
        started = time.monotonic()
        with open(log, "w") as out:
            out.write(f"$ {' '.join(f'{k}={v}' for k, v in self.env.items())} {shlex.join(cmd)}\n")
            out.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **self.env}, stdout=out,
                                    stderr=subprocess.STDOUT)
            # The job's own resource use: its process and every descendant it waited for.
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
        self.wall = time.monotonic() - started
        self.cpu = usage.ru_utime + usage.ru_stime
        self.status = proc.returncode
        return log


def table(known):
    """times.json as a markdown table: a row per test file, wall and CPU seconds of each build
    (the compat jobs' Envoys in the last column), the longest first."""
    rows = {}
    for label, t in known.items():
        if not isinstance(t, dict):
            continue
        where, test = label.rsplit("-", 1)
        build = "wasm" if where == "wasm" else "native" if where == "native" else "compat"
        row = rows.setdefault(test, {})
        wall, cpu = row.get(build, (0, 0))
        row[build] = (wall + t["wall"], cpu + t["cpu"])
    print("| test file | wasm: wall s | CPU s | native: wall s | CPU s | other Envoys: wall s | CPU s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    cell = lambda row, b: " | ".join(f"{v:.0f}" for v in row[b]) if b in row else "| "
    for test, row in sorted(rows.items(), key=lambda kv: -sum(w for w, _ in kv[1].values())):
        print(f"| `{test}.rs` | {cell(row, 'wasm')} | {cell(row, 'native')} | {cell(row, 'compat')} |")
    total = [sum(r[b][i] for r in rows.values() if b in r) for b in ("wasm", "native", "compat")
             for i in (0, 1)]
    print("| all | " + " | ".join(f"{v:.0f}" for v in total) + " |")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("SUITE_JOBS", "4")),
                    help="test binaries run at once, at most (SUITE_JOBS, default 4)")
    ap.add_argument("--cores", type=float,
                    default=float(os.environ.get("SUITE_CORES", 0.85 * (os.cpu_count() or 2))),
                    help="cores the running jobs may use together on average (SUITE_CORES, "
                         "default: 85 %% of the machine's, room for the bursts of Envoys "
                         "starting)")
    ap.add_argument("--beside-heavy", type=float, default=0.2,
                    help="the most cores a job may use on average to run beside a heavy one "
                         "(default 0.2)")
    ap.add_argument("--markdown", action="store_true",
                    help="print the table as markdown (for docs/src/contributing/testing.md)")
    ap.add_argument("--table", action="store_true",
                    help="print the last run's times (times.json) by test file and build, as "
                         "markdown, and run nothing")
    ap.add_argument("job", nargs="*")
    args = ap.parse_args()
    if args.table:
        return table(json.loads(TIMES.read_text()) if TIMES.exists() else {})
    if not args.job:
        ap.error("no job")
    OUT.mkdir(parents=True, exist_ok=True)
    jobs = [Job(s) for s in args.job]
    known = json.loads(TIMES.read_text()) if TIMES.exists() else {}
    expected = {j.label: j.expect(known) for j in jobs}
    # The heavy jobs first (each needs the machine nearly to itself), then the longest.
    pending = sorted(jobs, key=lambda j: (not j.heavy, -expected[j.label][0]))
    running = []
    done = threading.Condition()
    started = time.monotonic()

    def one(job):
        log = job.run()
        with done:
            mark = "ok" if job.status == 0 else f"FAILED ({job.status})"
            print(f"{mark:12} {job.wall:6.1f} s wall {job.cpu:6.1f} s CPU  {job.label}",
                  flush=True)
            if job.status != 0:
                sys.stdout.write(log.read_text(errors="replace"))
                sys.stdout.flush()
            running.remove(job)
            done.notify()

    def fits(job):
        cores = expected[job.label][1]
        busy = sum(expected[r.label][1] for r in running)
        if not running:
            return True
        if len(running) >= args.jobs or busy + cores > args.cores:
            return False
        if job.heavy:
            # Beside jobs that mostly wait only, and never beside another heavy one.
            return all(not r.heavy and expected[r.label][1] <= args.beside_heavy
                       for r in running)
        # While a heavy job runs or waits for its turn, only jobs that mostly wait start.
        if any(r.heavy for r in running) or any(p.heavy for p in pending):
            return cores <= args.beside_heavy
        return True

    threads = []
    with done:
        while pending:
            ready = next((j for j in pending if fits(j)), None)
            if ready is None:
                done.wait()
                continue
            pending.remove(ready)
            running.append(ready)
            t = threading.Thread(target=one, args=(ready,))
            t.start()
            threads.append(t)
    for t in threads:
        t.join()
    total = time.monotonic() - started
    known.update({j.label: {"wall": round(j.wall, 1), "cpu": round(j.cpu, 1)}
                  for j in jobs if j.status == 0})
    TIMES.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
    jobs.sort(key=lambda j: -j.wall)
    if args.markdown:
        print("\n| job | wall s | CPU s | result |\n|---|---:|---:|---|")
        for j in jobs:
            print(f"| {j.label} | {j.wall:.0f} | {j.cpu:.0f} | {'ok' if j.status == 0 else 'failed'} |")
    cpu = sum(j.cpu for j in jobs)
    print(f"\n{len(jobs)} jobs, at most {args.jobs} at once on {args.cores:g} cores: {total:.0f} s wall, "
          f"{sum(j.wall for j in jobs):.0f} s of jobs, {cpu:.0f} s CPU "
          f"({cpu / total:.2f} cores busy on average)")
    failed = [j.label for j in jobs if j.status != 0]
    if failed:
        print("failed: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

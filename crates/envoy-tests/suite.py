#!/usr/bin/env python3
"""Runs test binaries of the envoy-tests package side by side: `make integration` and
`make compat` hand it one job per (build or Envoy, test binary), and it runs the heavy ones
first, one at a time, then keeps up to --jobs of the others running, the longest first, so
that both cores stay busy while most tests wait on Envoy's clocks and windows.

A job is one string: `VAR=value ...` settings for its environment, then the arguments of
`cargo test -p envoy-tests --features envoy` (`--test NAME`); the test binary runs with
`--test-threads 2`. A job marked `heavy:` (its first word) measures rates or fairness under
load and needs most of the machine (up to one and a half cores of Envoys and load): it takes
every slot, so it runs alone.

Each job's output goes to target/suite/<label>.log and is printed whole if it fails. At the
end: a table of every job (wall time, CPU time of the job and all it started, result), longest
first, and the wall time of the whole run; the exit status is 1 if any job failed. No job is
retried. The wall times are kept in target/suite/times.json and order the next run."""

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
# Wall seconds of each job in a clean-clone CI run (its order when no run here measured it).
ESTIMATES = {"sdk": 80, "explain": 78, "global": 60, "share_fleet": 63, "soak": 63, "share": 60,
             "envoy": 36, "elastic": 34, "share_wait": 34, "share_learn": 33, "share_tokens": 31,
             "algorithms": 27, "docs": 22, "reload": 23, "flood": 30, "tokens": 20,
             "operator_route": 20, "held": 18, "prometheus": 14, "quota": 14, "operator": 10}


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

    def slots(self, jobs):
        return jobs if self.heavy else 1

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


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("SUITE_JOBS", "2")),
                    help="slots: test binaries run at once (SUITE_JOBS, default 2)")
    ap.add_argument("--markdown", action="store_true",
                    help="print the table as markdown (for docs/src/contributing/testing.md)")
    ap.add_argument("job", nargs="+")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    jobs = [Job(s) for s in args.job]
    known = json.loads(TIMES.read_text()) if TIMES.exists() else {}
    # The heavy jobs first, one after the other, then the others side by side: no slot idles
    # while a heavy job waits for the machine.
    jobs.sort(key=lambda j: (not j.heavy, -known.get(j.label, ESTIMATES.get(j.test, 15))))
    free = threading.Semaphore(args.jobs)
    lock = threading.Lock()
    started = time.monotonic()

    def one(job):
        log = job.run()
        with lock:
            mark = "ok" if job.status == 0 else f"FAILED ({job.status})"
            print(f"{mark:12} {job.wall:6.1f} s wall {job.cpu:6.1f} s CPU  {job.label}",
                  flush=True)
            if job.status != 0:
                sys.stdout.write(log.read_text(errors="replace"))
                sys.stdout.flush()

    threads = []
    for job in jobs:
        held = job.slots(args.jobs)
        for _ in range(held):
            free.acquire()

        def body(job=job, held=held):
            try:
                one(job)
            finally:
                for _ in range(held):
                    free.release()

        t = threading.Thread(target=body)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    total = time.monotonic() - started
    known.update({j.label: round(j.wall, 1) for j in jobs if j.status == 0})
    TIMES.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
    jobs.sort(key=lambda j: -j.wall)
    if args.markdown:
        print("\n| job | wall s | CPU s | result |\n|---|---:|---:|---|")
        for j in jobs:
            print(f"| {j.label} | {j.wall:.0f} | {j.cpu:.0f} | {'ok' if j.status == 0 else 'failed'} |")
    cpu = sum(j.cpu for j in jobs)
    print(f"\n{len(jobs)} jobs, {args.jobs} slots: {total:.0f} s wall, {sum(j.wall for j in jobs):.0f} s "
          f"of jobs, {cpu:.0f} s CPU ({cpu / total:.2f} cores busy on average)")
    failed = [j.label for j in jobs if j.status != 0]
    if failed:
        print("failed: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

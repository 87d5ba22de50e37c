#!/usr/bin/env python3
"""Runs Envoy test binaries again and again, optionally beside CPU hogs, and tells how often
each failed: the check that a test fails only for a reason (a test that fails once in twenty
runs is a bug in the product or in the test).

    python3 crates/envoy-tests/repeat.py --runs 20 --hogs 2 held share_wait
    python3 crates/envoy-tests/repeat.py --runs 5 --builds native soak

Each run is the test binary `cargo test -p envoy-tests --features envoy --test NAME` builds
(built once before the series, then run directly with `--test-threads N --nocapture`: a run
never waits on cargo's build lock, which a compile beside the series would hold), for each
build (FILTER=wasm, FILTER=native), one run at a time, in the environment `make integration`
gives the suite (the Makefile's TEST_ENV: the builds must be there, `make prepare`; a variable
already set, such as WASM=... or NATIVE_DIR=... naming a copy of a build, is kept). A hog is a
process that spins on one core for the whole series (two hogs on this two-core machine: every
Envoy and client gets what a starved machine leaves). Every run's output goes to
target/repeat/NAME-BUILD-RUN.log (an earlier series' logs of the same test and build are moved
to target/repeat/before-TIME/ first); the lines a test prints that start with `figure:` or hold
`used` / `admitted` are kept in the table's last column, so that the figures of passing runs
are seen beside those of failing ones. The exit status is 1 if any run failed."""

import argparse
import json
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
OUT = ROOT / "target" / "repeat"


def spin():
    while True:
        pass


def test_env():
    """The environment `make integration` runs the suite in."""
    line = subprocess.run(["make", "-s", "-n", "integration"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip().splitlines()[-1]
    env = dict(os.environ)
    for word in shlex.split(line.split(" python3 ")[0]):
        if "=" in word:
            k, v = word.split("=", 1)
            # A build the caller names (a copy kept apart while the tree is rebuilt) wins.
            env.setdefault(k, v)
    # The suite's jobs name the Envoy; the pinned one unless ENVOY says otherwise.
    env.setdefault("ENVOY", str(ROOT / ".venv" / "bin" / "envoy"))
    return env


def test_binary(test, env):
    """Builds the test binary of tests/TEST.rs (the suite's features) and returns the path of a
    copy of it under target/repeat/bin/ (a build of the tree during the series, which rewrites
    cargo's own, leaves the series' binary alone)."""
    out = subprocess.run(["cargo", "test", "-q", "-p", "envoy-tests", "--features", "envoy",
                          "--test", test, "--no-run", "--message-format=json"], cwd=ROOT,
                         env=env, capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        msg = json.loads(line)
        if msg.get("executable") and msg.get("target", {}).get("name") == test:
            copy = OUT / "bin" / f"{test}-{int(time.time())}"
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(msg["executable"], copy)
            return str(copy)
    sys.exit(f"no test binary for {test}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--hogs", type=int, default=0, help="processes spinning on a core each")
    ap.add_argument("--builds", default="wasm,native")
    ap.add_argument("--threads", type=int, default=2, help="--test-threads of each run")
    ap.add_argument("--timeout", type=int, default=900, help="seconds a run may take")
    ap.add_argument("tests", nargs="+", help="test binaries (tests/NAME.rs)")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    env = test_env()
    # Stopped by a signal, it still stops its hogs (the `finally` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    hogs = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.hogs)]
    for h in hogs:
        h.start()
    rows, failed = [], 0
    earlier = OUT / f"before-{int(time.time())}"
    try:
        for test in args.tests:
            exe = test_binary(test, env)
            for build in args.builds.split(","):
                for old in OUT.glob(f"{test}-{build}-*.log"):
                    earlier.mkdir(exist_ok=True)
                    old.rename(earlier / old.name)
                fails, walls, notes = 0, [], []
                for run in range(1, args.runs + 1):
                    log = OUT / f"{test}-{build}-{run}.log"
                    cmd = [exe, "--test-threads", str(args.threads), "--nocapture"]
                    started = time.time()
                    with open(log, "w") as out:
                        try:
                            rc = subprocess.run(cmd, cwd=ROOT / "crates" / "envoy-tests",
                                                env=env | {"FILTER": build},
                                                stdout=out, stderr=subprocess.STDOUT,
                                                timeout=args.timeout).returncode
                        except subprocess.TimeoutExpired:
                            rc = -1
                    walls.append(time.time() - started)
                    text = log.read_text(errors="replace")
                    keep = [l.strip() for l in text.splitlines()
                            if l.startswith("figure:") or re.search(r"\bused\b|admitted", l)]
                    if rc != 0:
                        fails += 1
                        notes.append(f"run {run} FAILED ({log.relative_to(ROOT)})")
                    notes.extend(f"run {run}: {k}" for k in keep[:3])
                    print(f"{test} {build} run {run}/{args.runs}: "
                          f"{'ok' if rc == 0 else 'FAILED'} in {walls[-1]:.0f} s", flush=True)
                failed += fails
                rows.append((test, build, args.runs, fails, sum(walls) / len(walls), notes))
    finally:
        for h in hogs:
            h.terminate()
    print(f"\n| test file | build | runs | failed | mean wall s | hogs |\n|---|---|---:|---:|---:|---:|")
    for test, build, runs, fails, wall, _ in rows:
        print(f"| `{test}.rs` | {build} | {runs} | {fails} | {wall:.0f} | {args.hogs} |")
    for test, build, _, _, _, notes in rows:
        for n in notes:
            print(f"{test} {build}: {n}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

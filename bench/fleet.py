#!/usr/bin/env python3
"""Global rules across a fleet: three Envoys of two workers each at full speed, one
rule keyed on `x-user`, each `global.mode` against the same rule local-only, in both builds.

Each run starts three fresh Envoys sharing the test RLS server (limitador over Redis, the
counters wiped before the run), warms them up with requests the rule does not match, then
drives each with its own wrk (1 thread, CONNECTIONS connections) at full speed for SECONDS:
all on one key (`hot`) or cycling over 1,000 keys (`keys`). Runs are interleaved (every
build, pattern and mode once per round, modes in a rotating order) and a mode's throughput is
a ratio to local-only in the same round and pattern, medians over the rounds. Service calls
are Envoy's count of requests to the `ratelimit` cluster (`upstream_rq_total`, every call of
every mode); lease claims are the filter's `lease_claims`. Admitted requests are compared with
what the limit allows: the hot key's limit, or for 1,000 keys each key's limit or what it was
offered, whichever is less.

`make bench` runs it after bench.py; alone, `python3 bench/fleet.py` (or
`make bench-fleet`) measures, stores the figures in bench/results.json's `global.fleet`, and
rewrites BENCHMARKS.md from bench/results.json.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the shared helpers: Envoy bootstraps, filters, wrk's script)

RLS_BIN = bench.ROOT / "crates/envoy-tests/rls-server/target/release/rls-server"
PROXIES, WORKERS = 3, 2
HOT_LIMIT = 1_000  # a minute, the hot key's
OPEN_LIMIT = 60_000_000  # a minute, the hot key's where the limit is not reached in a run
KEY_LIMIT = 20  # a minute, each of the 1,000 keys'
KEYS = bench.FLEET_KEYS
FLUSH_MS = bench.FLEET_FLUSH_MS
PATTERNS = {"hot": 1, "open": 1, "keys": KEYS}
# mode name: (rule's `global` fields or None, RLS server answering one call at a time)
MODES = {
    "local": (None, False),
    "sync": ({"mode": "sync", "timeout_ms": 1000}, True),
    "sync-concurrent": ({"mode": "sync", "timeout_ms": 1000}, False),
    "async": ({"mode": "async", "flush_ms": FLUSH_MS}, False),
    "lease": ({"mode": "lease", "flush_ms": FLUSH_MS, "timeout_ms": 1000}, True),
    "lease-concurrent": ({"mode": "lease", "flush_ms": FLUSH_MS, "timeout_ms": 1000}, False),
}


class Proxy(bench.Envoy):
    """One Envoy of the fleet: WORKERS workers, not pinned (the fleet, its clients and the
    service share the machine). Started without waiting: see `ready`."""

    def __init__(self, envoy_bin, name, filters, work, extra):
        super().__init__(envoy_bin, name, filters, work, extra, workers=WORKERS, wait=False)

    def stats(self):
        """Counters: `upstream_rq_total` of the ratelimit cluster, the filter's `lease_claims`
        and `global_errors` (summed over its rules), and the CPU time of Envoy's threads."""
        out = {"calls": 0, "lease_claims": 0, "global_errors": 0, "cpu_ns": self.cpu_ns()}
        for line in self.admin_get("/stats?usedonly").splitlines():
            name, _, value = line.rpartition(": ")
            if not value.isdigit():
                continue
            if name == "cluster.ratelimit.upstream_rq_total":
                out["calls"] += int(value)
            for c in ("lease_claims", "global_errors"):
                if c in name:
                    out[c] += int(value)
        return out


def wrk(proxy, seconds, connections, keys, lua):
    """Full speed on one proxy; requests and non-2xx answers."""
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s"] + (["-s", str(lua)] if lua else [])
    out = subprocess.run(cmd + [f"http://127.0.0.1:{proxy.port}/"], capture_output=True,
                         text=True, env={**os.environ, "KEYS": str(keys)}, check=True)
    if not lua:
        return None
    line = next((x for x in out.stdout.splitlines() if x.startswith("JSON ")), None)
    if not line:
        raise SystemExit(f"wrk output not understood:\n{out.stdout}{out.stderr}")
    return json.loads(line[5:])


def all_at_once(fn, items):
    outs = [None] * len(items)

    def one(i, x):
        outs[i] = fn(x)
    threads = [threading.Thread(target=one, args=(i, x)) for i, x in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


def limit_of(pattern):
    return {"hot": HOT_LIMIT, "open": OPEN_LIMIT}.get(pattern, KEY_LIMIT)


def filters(build, mode, pattern):
    """One rule named for the pattern (the service's limit of that name), keyed on x-user."""
    g, _ = MODES[mode]
    r = bench.rule(pattern, ["header:x-user"], n=limit_of(pattern))
    if g:
        r["global"] = {"cluster": "ratelimit", "domain": "edge"} | g
    return bench.ours([r], build=build)


def run_once(envoy_bin, work, build, pattern, mode, rls_ports, redis_port, args, lua):
    keys, limit = PATTERNS[pattern], limit_of(pattern)
    subprocess.run(["redis-cli", "-p", str(redis_port), "flushall"], check=True,
                   capture_output=True)
    extra = bench.RLS_CLUSTER.format(port=rls_ports[MODES[mode][1]])
    proxies = [Proxy(envoy_bin, f"fleet-{build}-{mode}-{i}", filters(build, mode, pattern), work,
                     extra) for i in range(PROXIES)]
    try:
        for p in proxies:
            p.ready()
        # Warm-up without x-user: the rule does not match, nothing is counted.
        all_at_once(lambda p: wrk(p, 1, args.connections, 1, None), proxies)
        before = [p.stats() for p in proxies]
        t0 = time.time()
        outs = all_at_once(lambda p: wrk(p, args.seconds, args.connections, keys, lua), proxies)
        elapsed = time.time() - t0
        time.sleep(1.5)  # a metrics publication period and a margin
        after = [p.stats() for p in proxies]
    finally:
        for p in proxies:
            p.stop()
    requests = sum(o["requests"] for o in outs)
    admitted = sum(o["requests"] - o["non2xx"] for o in outs)
    # What the fleet may admit: each key's limit, or what it was offered if less (wrk cycles
    # the keys, so each key gets an equal share, within a request per client).
    allowed = min(keys * limit, requests)
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before)) for k in before[0]}
    return {"rps": requests / args.seconds, "requests": requests, "admitted": admitted,
            "cpu_us_per_req": delta.pop("cpu_ns") / 1000 / max(requests, 1),
            "limit": limit, "allowed": allowed, "elapsed": elapsed,
            "p50_us": statistics.median(o["p50"] for o in outs),
            "p99_us": max(o["p99"] for o in outs),
            "per_proxy_admitted": [o["requests"] - o["non2xx"] for o in outs]} | delta


def measure(envoy_bin, work, rounds, seconds=4, connections=8, builds=("native", "wasm"),
            modes=tuple(MODES), patterns=tuple(PATTERNS), lua=None):
    """Every (build, pattern, mode) run `rounds` times, interleaved; raw runs and summary."""
    if not RLS_BIN.exists():
        print("  fleet: skipped (no rls-server build)")
        return None
    args = argparse.Namespace(seconds=seconds, connections=connections)
    if lua is None:
        lua = work / "keys.lua"
        lua.write_text(bench.WRK_LUA)
    if not (work / "modules").exists():
        (work / "modules").mkdir()
        (work / "modules" / "libwasm_ratelimit.so").symlink_to(
            bench.NATIVE_DIR / "libwasm_ratelimit.so")
    procs = []

    def start(cmd, port):
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.time() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                return
            except OSError:
                if time.time() > deadline:
                    raise SystemExit(f"nothing listens on {port}: {cmd[0]}")
                time.sleep(0.05)

    limits = json.dumps([
        {"namespace": "edge", "name": pattern, "max_value": limit_of(pattern), "seconds": 60,
         "conditions": [f"descriptors[0].rule == '{pattern}'"],
         "variables": ["descriptors[0]['header:x-user']"]} for pattern in PATTERNS])
    runs = {}
    try:
        redis_port = bench.free_port()
        start(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no"], redis_port)
        rls_ports = {}
        for serial in (False, True):
            rls_ports[serial] = bench.free_port()
            start([str(RLS_BIN), f"127.0.0.1:{rls_ports[serial]}",
                   f"redis://127.0.0.1:{redis_port}", limits, "0"] + (["serial"] if serial else []),
                  rls_ports[serial])
        for rnd in range(rounds):
            for build in builds:
                for pattern in patterns:
                    k = rnd % len(modes)
                    for mode in modes[k:] + modes[:k]:
                        r = run_once(envoy_bin, work, build, pattern, mode, rls_ports,
                                     redis_port, args, lua)
                        runs.setdefault(f"{build}/{pattern}/{mode}", []).append(r)
                        print(f"  fleet round {rnd + 1}/{rounds} {build} {pattern:4} {mode:16} "
                              f"{r['rps']:7.0f} rps, admitted {r['admitted']:6} of "
                              f"{r['allowed']:6}, {r['calls']:6} calls, p50 {r['p50_us']} µs, p99 {r['p99_us']} µs",
                              flush=True)
    finally:
        bench.stop(procs)
    return {"proxies": PROXIES, "workers": WORKERS, "seconds": seconds,
            "connections": connections, "flush_ms": FLUSH_MS, "hot_limit": HOT_LIMIT,
            "open_limit": OPEN_LIMIT,
            "key_limit": KEY_LIMIT, "keys": KEYS, "rounds": rounds, "runs": runs,
            "summary": summarize(runs)}


def summarize(runs):
    """Per (build, pattern, mode): medians of throughput × local-only (same round and
    pattern), requests/s, service calls and lease claims per 100 requests; admitted against
    what the limit allows in every run (the least and the most)."""
    out = {}
    for name, rs in runs.items():
        build, pattern, _ = name.split("/")
        local = runs.get(f"{build}/{pattern}/local", [])
        ratios = [r["rps"] / b["rps"] for r, b in zip(rs, local) if b["rps"]]
        cpu = [b["cpu_us_per_req"] / r["cpu_us_per_req"] for r, b in zip(rs, local)
               if r["cpu_us_per_req"]]
        per100 = lambda f: statistics.median(100 * r[f] / max(r["requests"], 1) for r in rs)
        out[name] = {
            "rps": statistics.median(r["rps"] for r in rs),
            "x_local": statistics.median(ratios) if ratios else None,
            "x_local_range": [min(ratios), max(ratios)] if ratios else None,
            "calls_per_100": per100("calls"),
            "x_local_cpu": statistics.median(cpu) if cpu else None,
            "claims_per_100": per100("lease_claims"),
            "claims_per_100_admitted": statistics.median(
                100 * r["lease_claims"] / max(r["admitted"], 1) for r in rs),
            "admitted": [r["admitted"] for r in rs],
            "allowed": [r["allowed"] for r in rs],
            "over_max": max(r["admitted"] - r["allowed"] for r in rs),
            "under_max": max(r["allowed"] - r["admitted"] for r in rs),
            "errors": sum(r["global_errors"] for r in rs),
        }
    return out


def instructions(envoy_bin, builds=("native", "wasm"), requests=2000):
    """Envoy's instructions per request (callgrind, bench.instructions: one Envoy, one worker,
    one client on one key) for a rule local-only, async and lease: admitted (a limit never
    reached) and refused (limit 10: local-only refuses by its own count, async once the
    service has blocked the key, lease once the service has refused a claim)."""
    work = Path(tempfile.mkdtemp(prefix="wasm-ratelimit-fleet-cg-"))
    (work / "modules").mkdir()
    (work / "modules" / "libwasm_ratelimit.so").symlink_to(
        bench.NATIVE_DIR / "libwasm_ratelimit.so")
    redis_port, rls_port = bench.free_port(), bench.free_port()
    limits = json.dumps([
        {"namespace": "edge", "name": name, "max_value": n, "seconds": 60,
         "conditions": [f"descriptors[0].rule == '{name}'"],
         "variables": ["descriptors[0].remote_address"]}
        for name, n in (("open", bench.NEVER), ("ten", 10), ("blocked", 10))])
    procs = [subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)]
    time.sleep(0.5)
    procs.append(subprocess.Popen([str(RLS_BIN), f"127.0.0.1:{rls_port}",
                                   f"redis://127.0.0.1:{redis_port}", limits],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1)
    extra = bench.RLS_CLUSTER.format(port=rls_port)

    def spec(build, name, rule, n, mode):
        r = bench.rule(rule, ["remote_address"], n=n)
        if mode:
            r["global"] = {"cluster": "ratelimit", "domain": "edge", "mode": mode,
                           "flush_ms": FLUSH_MS, "timeout_ms": 1000}
        return (f"{build}-{name}", bench.ours([r], build=build), None, extra)
    specs = [s for b in builds for s in (
        spec(b, "local", "open", bench.NEVER, None), spec(b, "async", "open", bench.NEVER, "async"),
        spec(b, "lease", "open", bench.NEVER, "lease"), spec(b, "local-429", "ten", 10, None),
        # The local limit is not reached: the service's block refuses.
        spec(b, "async-blocked", "blocked", 1000, "async"),
        spec(b, "lease-refused", "ten", 10, "lease"))]
    try:
        return bench.instructions(envoy_bin, specs, work, requests=requests)
    finally:
        bench.stop(procs)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envoy", default=os.environ.get("ENVOY", "envoy"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=4)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--builds", default="native,wasm")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    ap.add_argument("--out", help="write the raw figures here instead of into "
                    "bench/results.json and BENCHMARKS.md")
    ap.add_argument("--more", action="store_true",
                    help="add these runs to those in bench/results.json (more rounds of some "
                    "modes: each run is paired with local-only's of the same round)")
    ap.add_argument("--report-only", action="store_true",
                    help="print the section from bench/results.json's global.fleet")
    ap.add_argument("--instructions", action="store_true",
                    help="count each mode's instructions per request under callgrind (one "
                    "Envoy, one worker, one key), print them, write nothing")
    args = ap.parse_args()
    results = bench.BENCH / "results.json"
    if args.instructions:
        counts = instructions(args.envoy, tuple(args.builds.split(",")))
        for name, n in counts.items():
            build, mode = name.split("-", 1)
            base = counts[f"{build}-local-429" if "-" in mode else f"{build}-local"]
            print(f"{name:22} {n:10,.0f} instructions/request  {n / base - 1:+.1%}")
        return
    if args.report_only:
        print("\n".join(bench.fleet_report_lines(json.loads(results.read_text())["global"]["fleet"])))
        return
    work = Path(tempfile.mkdtemp(prefix="wasm-ratelimit-fleet-"))
    f = measure(args.envoy, work, args.rounds, args.seconds, args.connections,
                tuple(args.builds.split(",")), tuple(args.modes.split(",")),
                tuple(args.patterns.split(",")))
    if f:
        f["run"] = bench.run_info(" ".join(["bench/fleet.py"] + sys.argv[1:]))
    print("\n".join(bench.fleet_report_lines(f)))
    if args.out:
        Path(args.out).write_text(json.dumps(f, indent=2) + "\n")
        return
    r = json.loads(results.read_text())
    old = r["global"].get("fleet")
    if args.more and old and f:
        for name, runs in f["runs"].items():
            old["runs"][name] = old["runs"].get(name, []) + runs
        old["more"] = old.get("more", []) + [
            f"--rounds {args.rounds} --seconds {args.seconds} --builds {args.builds} "
            f"--patterns {args.patterns} --modes {args.modes} "
            f"({f['run']['date']}, {f['run']['commit']})"]
        old["summary"] = summarize(old["runs"])
        f = old
    r["global"]["fleet"] = f
    results.write_text(json.dumps(r, indent=2) + "\n")
    bench.write_benchmarks(bench.report(r))


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What every request pays for the filter, side by side with the alternatives, in one run.

Run by `make bench` (which builds the filters and the load generator and installs Envoy and wrk).
Every variant is the same Envoy binary, listener and `direct_response` route; only the HTTP
filters differ. Each Envoy runs with `--concurrency 1` pinned to CPU 0; the load generator is
pinned to CPU 1. Variants are measured interleaved (A B C ... then again, rotating the order),
and each figure is the median over the rounds. Results: BENCHMARKS.md and bench/results.json.
"""

import argparse
import fcntl
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
# WASM, NATIVE_DIR in the environment: other builds of the filter (one with symbols, a baseline).
WASM = Path(os.environ.get("WASM") or ROOT / "target/wasm32-wasip1/release/wasm_ratelimit.wasm").resolve()
NATIVE_DIR = Path(os.environ.get("NATIVE_DIR") or ROOT / "target/native").resolve()
NOOP_WASM = BENCH / "noop/target/wasm32-wasip1/release/noop_filter.wasm"
FLOOR_WASM = BENCH / "floor-wasm/target/wasm32-wasip1/release/floor_filter.wasm"
FLOOR_NATIVE_DIR = BENCH / "floor-native/target/release"
LOADGEN = BENCH / "loadgen/target/release/loadgen"
ENVOY_CPU, LOAD_CPU = "0", "1"
NEVER = 1_000_000_000  # a limit no benchmark reaches

ROUTER = """          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"""


def run_info(command):
    """When, and of which code, a run was made: stored with its figures, so that a page made
    from them (bench/summary.py) can say which run it shows."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += " with uncommitted changes"
    return {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit,
            "command": command}


_HELD_PORTS = []  # the lock files of the ports this process took, held until it exits


def _listened(port):
    """Whether anybody listens on `port` (any address), from /proc/net/tcp{,6}."""
    want = f":{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 3 and f[1].endswith(want) and f[3] == "0A":
                return True
    return False


def free_port():
    """A loopback port for a process this script starts, as the Envoy tests take theirs
    (crates/envoy-tests/tests/common/ports.rs, which says why): below the kernel's ephemeral
    range, nobody listening there, held by a lock file named after it (the same files as the
    tests') until this process exits; above the range, or in it, where it leaves too little
    below (ports.rs's ports_beside)."""
    try:
        low, high = (int(x) for x in
                     Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2])
    except (OSError, ValueError):
        low, high = 32768, 60999
    if low >= 2024:
        first, end = max(1024, low - 10_000), low
    elif high <= 65535 - 1000:
        first, end = high + 1, min(65535, high + 1 + 10_000)
    else:
        first, end = max(1024, low), high
    span = end - first
    folder = Path(tempfile.gettempdir()) / f"wasm-ratelimit-ports-{os.environ.get('USER', 'user')}"
    folder.mkdir(parents=True, exist_ok=True)
    start = (os.getpid() * 2654435761) % span
    for i in range(span):
        port = first + (start + i) % span
        lock = open(folder / str(port), "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        if _listened(port):
            lock.close()
            continue
        _HELD_PORTS.append(lock)
        return port
    raise RuntimeError(f"no free port in {first}..{end}")


def wasm_filter(path, config_json, name="bench"):
    """The http_filters entry of a wasm filter (the plugin config goes in as a JSON string)."""
    return f"""          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: {name}
                root_id: {name}
                vm_config:
                  vm_id: {name}
                  runtime: envoy.wasm.runtime.v8
                  code: {{local: {{filename: "{path}"}}}}
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: {json.dumps(json.dumps(config_json))}
"""


def dynamic_module(module, config, name="bench"):
    """The http_filters entry of a dynamic module (`lib<module>.so` in a search-path folder)."""
    return f"""          - name: envoy.filters.http.dynamic_modules
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
              dynamic_module_config: {{name: {module}}}
              filter_name: {name}
              filter_config:
                "@type": type.googleapis.com/google.protobuf.StringValue
                value: {json.dumps(config if isinstance(config, str) else json.dumps(config))}
"""


def native_local_ratelimit():
    """Envoy's own local_ratelimit: a never-reached per-client limit, x-ratelimit headers on."""
    return f"""          - name: envoy.filters.http.local_ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
              stat_prefix: bench
              token_bucket: {{max_tokens: {NEVER}, tokens_per_fill: {NEVER}, fill_interval: 60s}}
              filter_enabled: {{default_value: {{numerator: 100, denominator: HUNDRED}}}}
              filter_enforced: {{default_value: {{numerator: 100, denominator: HUNDRED}}}}
              enable_x_ratelimit_headers: DRAFT_VERSION_03
              max_dynamic_descriptors: 1000000
              rate_limits:
              - actions: [{{remote_address: {{}}}}]
              descriptors:
              - entries: [{{key: remote_address}}]
                token_bucket: {{max_tokens: {NEVER}, tokens_per_fill: {NEVER}, fill_interval: 60s}}
"""


def rule(name, key, n=NEVER, unit="minute"):
    return {"name": name, "key": key, "rate_limit": {"requests_per_unit": n, "unit": unit}}


BENCH_KEY_SEED = "62656e63682d6b65792d736565642d31"


def ours(rules, capacity=None, build="wasm", response=None, settings=None):
    """This filter with `rules`, in the wasm build or the native one (the dynamic module);
    `settings`: more top-level fields of its configuration."""
    # A fixed key seed: the keys' buckets, and so the order the native build locks them in (a
    # sort whose cost depends on it), are the same in every run; a random seed moved a
    # ten-rule request's count by up to 1 %.
    cfg = {"rules": rules, "key_seed": BENCH_KEY_SEED, **(settings or {})}
    if capacity:
        cfg["capacity"] = capacity
    if response:
        cfg["response"] = response
    if build == "native":
        return dynamic_module("wasm_ratelimit", cfg)
    return wasm_filter(WASM, cfg)


RLS_CLUSTER = """  clusters:
  - name: ratelimit
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {{}}
    load_assignment:
      cluster_name: ratelimit
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{address: 127.0.0.1, port_value: {port}}}
"""


# The route every variant uses unless it names another: an answer from Envoy itself.
DIRECT_ROUTE = """                direct_response: {status: 200, body: {inline_string: "ok\\n"}}
                # What an upstream charging by usage would report (read by the quota variants).
                response_headers_to_add: [{header: {key: x-usage-tokens, value: "1"}}]
"""


def bootstrap(port, admin, filters, extra="", route=None):
    return f"""admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
  - name: bench
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: bench
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
{route or DIRECT_ROUTE}          http_filters:
{filters}{ROUTER}""" + extra


class Envoy:
    """One Envoy process on free ports (`port`, `admin`), its log in `workdir/NAME.log`. Its
    bootstrap is `bootstrap` of `filters` (or what `config(port, admin)` returns); it runs one
    worker pinned to ENVOY_CPU (or under `wrapper`, such as valgrind, unpinned), or `workers`
    workers unpinned. Started, it is waited for until ready unless `wait` is false (then see
    `ready`)."""

    def __init__(self, envoy_bin, name, filters, workdir, extra="", wrapper=None, route=None,
                 workers=None, config=None, module_dir=None, cwd=None, wait=True):
        self.name = name
        self.port, self.admin = free_port(), free_port()
        cfg = workdir / f"{name}.yaml"
        cfg.write_text(config(self.port, self.admin) if config
                       else bootstrap(self.port, self.admin, filters, extra, route))
        self.log_path = workdir / f"{name}.log"
        self.logf = open(self.log_path, "w")
        # One folder holds both dynamic modules: this filter's and the floor probe's.
        env = {**os.environ,
               "ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(module_dir or workdir / "modules")}
        if workers:
            prefix, args = [], ["--concurrency", str(workers), "--base-id", str(self.admin)]
        else:
            prefix, args = wrapper or ["taskset", "-c", ENVOY_CPU], ["--concurrency", "1"]
        self.proc = subprocess.Popen(
            prefix + [envoy_bin, "-c", str(cfg)] + args + ["--disable-hot-restart", "-l", "warning"],
            stdout=self.logf, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        self.timeout = 300 if wrapper else 60
        if wait:
            self.ready()

    def ready(self):
        """Waits until the admin endpoint says LIVE; exits if Envoy ends or takes too long."""
        deadline = time.time() + self.timeout
        while True:
            try:
                if self.admin_get("/ready").strip() == "LIVE":
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"envoy {self.name} did not start; see {self.log_path}")
            time.sleep(0.1)

    def admin_get(self, path):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}{path}", timeout=5) as r:
            return r.read().decode()

    def cpu_ns(self):
        """CPU time of every Envoy thread, in ns."""
        total = 0
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass
        return total

    def memory(self):
        return int(json.loads(self.admin_get("/memory"))["allocated"])

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.logf.close()


WRK_LUA = r"""
-- Distinct client keys: x-user cycles through KEYS values (1 = a single key).
local keys = tonumber(os.getenv("KEYS") or "1")
local n = math.random(0, keys - 1)
request = function()
  n = (n + 1) % keys
  return wrk.format("GET", "/", {["x-user"] = "u" .. n})
end
done = function(summary, latency, requests)
  io.write(string.format("JSON {\"requests\": %d, \"p50\": %d, \"p99\": %d, \"p999\": %d, \"non2xx\": %d}\n",
    summary.requests, latency:percentile(50), latency:percentile(99), latency:percentile(99.9),
    summary.errors.status))
end
"""


def wrk(envoy, seconds, connections, keys, lua):
    """Closed-loop load; returns requests/s, latency percentiles and Envoy CPU per request."""
    cpu0 = envoy.cpu_ns()
    t0 = time.time()
    out = subprocess.run(
        ["taskset", "-c", LOAD_CPU, "wrk", "-t1", f"-c{connections}", f"-d{seconds}s",
         "-s", str(lua), f"http://127.0.0.1:{envoy.port}/"],
        capture_output=True, text=True, env={**os.environ, "KEYS": str(keys)}, check=True)
    elapsed = time.time() - t0
    cpu = envoy.cpu_ns() - cpu0
    m = re.search(r"^JSON (.*)$", out.stdout, re.M)
    if not m:
        raise SystemExit(f"wrk output not understood:\n{out.stdout}{out.stderr}")
    r = json.loads(m.group(1))
    return {
        "rps": r["requests"] / seconds,
        "p50_us": r["p50"], "p99_us": r["p99"], "p999_us": r["p999"],
        "cpu_us_per_req": cpu / 1000 / max(r["requests"], 1),
        "non2xx": r["non2xx"], "requests": r["requests"], "elapsed": elapsed,
    }


def loadgen(envoy, rate, seconds, connections=16):
    out = subprocess.run(
        ["taskset", "-c", LOAD_CPU, str(LOADGEN), f"127.0.0.1:{envoy.port}", str(rate),
         str(seconds), str(connections)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def median_of(runs, field):
    return statistics.median(r[field] for r in runs)


def summarize(runs):
    return {f: median_of(runs, f) for f in
            ("rps", "p50_us", "p99_us", "p999_us", "cpu_us_per_req")} | {
        "rounds": len(runs), "non2xx_share": sum(r["non2xx"] for r in runs) /
        max(sum(r["requests"] for r in runs), 1)}


def interleaved(envoy_bin, specs, rounds, measure, workdir, label="", extra="", cycles=1,
                warmup=None):
    """Runs `measure(envoy)` for every (name, filters) spec, interleaved: each round starts a
    fresh Envoy per variant (instances of one build differ by up to ~10%: V8 tiering, memory
    layout, so a variant's figures must span several processes), warms each up, then measures
    every variant `cycles` times in a rotating order. The machine is shared: short bursts close
    in time let a ratio compare variants under the same conditions (see `paired`)."""
    runs = {name: [] for name, _ in specs}
    for rnd in range(rounds):
        envoys = []
        try:
            envoys = [Envoy(envoy_bin, name, filters, workdir, extra) for name, filters in specs]
            if warmup:
                for e in envoys:
                    warmup(e)
            for cycle in range(cycles):
                k = (rnd * cycles + cycle) % len(envoys)
                for e in envoys[k:] + envoys[:k]:
                    runs[e.name].append(measure(e))
        finally:
            for e in envoys:
                e.stop()
        print(f"  {label} round {rnd + 1}/{rounds}: " + ", ".join(
            f"{name} {r[-1].get('rps', 0):.0f} rps" for name, r in runs.items()), flush=True)
    return runs


def paired(runs, a, b):
    """Variant `a` against `b`, burst by burst (the same round and cycle, so the same
    conditions), medians: the throughput ratio, and the same ratio derived from Envoy CPU per
    request (b's CPU / a's), which CPU time stolen by other tenants of the machine disturbs
    less."""
    pairs = list(zip(runs[a], runs[b]))
    return {
        "throughput": statistics.median(x["rps"] / y["rps"] for x, y in pairs),
        "cpu": statistics.median(y["cpu_us_per_req"] / x["cpu_us_per_req"] for x, y in pairs),
        "bursts": len(pairs),
    }


def instructions(envoy_bin, specs, workdir, requests=2000, count_calls=None, post=None,
                 objects=None, read_stats=None, tenants=None):
    """Envoy's instructions per request for each (name, filters) spec, counted by callgrind:
    each Envoy runs under valgrind, is warmed up with as many requests, then counts the
    instructions of all its threads while one client sends `requests` requests one after the
    other on a keep-alive connection. Unlike time, the count does not depend on what else the
    machine is doing (three runs agree within 0.2 %), so ratios of it compare variants exactly;
    it weighs every instruction alike, where time also pays for cache misses. Two Envoys run
    at once (valgrind runs one thread at a time). `count_calls`: names of functions whose calls
    per request are counted too (then returns the counts and, per variant, those calls and
    the filter's usage metrics per request sent). `post`: (headers, body) of a POST each
    request is, instead of a GET. `objects`: parts of the paths of shared objects (the native
    module's) whose own instructions per request are counted too (then returns them as
    `calls` are, under `object NAME`). `stats`: names of the filter's counters read at the end,
    per request sent (returned as `calls` are, under `stat NAME`). `read_stats`: those names.
    `tenants`: variants (by name) whose requests name a tenant in `x-tenant`, each the next of
    that many in turn."""
    import concurrent.futures
    import http.client

    def send(port, n, name=None):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        many = (tenants or {}).get(name)
        for i in range(n):
            if many:
                c.request("GET", "/", headers={"x-tenant": f"t{i % many}"})
            elif post is None:
                c.request("GET", "/")
            else:
                c.request("POST", "/v1/chat/completions", body=post[1], headers=post[0])
            c.getresponse().read()
        c.close()

    def one(spec):
        # (name, filters), or (name, filters, route, extra): a variant with its own upstream.
        name, filters, route, extra = (*spec, None, "")[:4]
        out = workdir / f"callgrind-{name}"
        wrapper = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--trace-children=yes",
                   "--smc-check=all-non-file", f"--callgrind-out-file={out}.%p",
                   # e.g. --dump-instr=yes, to annotate the module's machine code
                   *os.environ.get("CALLGRIND_ARGS", "").split()]
        e = Envoy(envoy_bin, f"cg-{name}", filters, workdir, extra, wrapper=wrapper, route=route)
        try:
            send(e.port, requests, name)
            control = lambda *a: subprocess.run(["callgrind_control", *a, str(e.proc.pid)],
                                                capture_output=True, check=True)
            control("-i", "on")
            send(e.port, requests, name)
            control("-i", "off")
            control("-d")
            dump = Path(f"{out}.{e.proc.pid}.1")
            deadline = time.time() + 60
            while not (dump.exists() and "totals:" in dump.read_text(errors="replace")):
                if time.time() > deadline:
                    raise SystemExit(f"no callgrind dump for {name}")
                time.sleep(0.2)
            text = dump.read_text(errors="replace")
            total = next(int(line.split()[1]) for line in text.splitlines()
                         if line.startswith("totals:"))
            for o in objects or ():
                calls[name][f"object {o}"] = object_total(text, o) / requests
            for st in read_stats or ():
                # Published about once a second: read until two reads agree.
                last, now, deadline = None, None, time.time() + 15
                while time.time() < deadline and (now is None or now != last):
                    time.sleep(1.5)
                    last, now = now, e.admin_get(f"/stats?filter={st}")
                total_stat = sum(int(line.rpartition(": ")[2]) for line in now.splitlines()
                                 if line.strip())
                calls[name][f"stat {st}"] = total_stat / (2 * requests)
            if count_calls is not None:
                for fn in count_calls:
                    calls[name][fn] = callgrind_calls(text, fn) / requests
                    calls[name][f"{fn} inclusive"] = callgrind_inclusive(dump, fn) / requests
                # What the filter charged (its metrics), for every request sent: published
                # about once a second, so read until two reads agree.
                stats, deadline = None, time.time() + 15
                while time.time() < deadline:
                    time.sleep(1.5)
                    last, stats = stats, e.admin_get("/stats?filter=usage_")
                    if stats == last:
                        break
                for line in stats.splitlines():
                    stat, _, value = line.rpartition(": ")
                    kind = stat.split("usage_")[-1].split(".")[0].split(";")[0]
                    calls[name][f"usage_{kind}"] = (calls[name].get(f"usage_{kind}", 0)
                                                    + int(value) / (2 * requests))
        finally:
            e.stop()
        print(f"  instructions: {name} {total / requests:,.0f} per request", flush=True)
        return name, total / requests

    calls = {name: {} for name, *_ in specs}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        counts = dict(pool.map(one, specs))
    return (counts, calls) if count_calls or objects or read_stats else counts


def object_total(text, part):
    """The instructions of the code in the shared objects whose path contains `part` (their
    functions' own counts, not what they called), in a callgrind dump: Envoy's binary is
    stripped, so this is how its share and a module's are told apart. Object names are
    compressed (`ob=(id) name` the first time, in `ob=` or `cob=`; `ob=(id)` after); the cost
    line after `calls=` is the call's inclusive cost, not the caller's own."""
    names, current, total, call_cost = {}, None, 0, False
    for line in text.splitlines():
        if line.startswith(("ob=", "cob=")):
            m = re.match(r"c?ob=(?:\((\d+)\))?\s*(.*)", line)
            if m.group(2):
                names[m.group(1)] = m.group(2)
            if line.startswith("ob="):
                current = names.get(m.group(1), m.group(2))
        elif line.startswith("calls="):
            call_cost = True
        elif line[:1].isdigit() or line[:1] in ("+", "-", "*"):
            if call_cost:
                call_cost = False
            elif current and part in current:
                fields = line.split()
                total += int(fields[1]) if len(fields) > 1 else 0
    return total


def callgrind_inclusive(dump, fn):
    """The instructions of the function named `fn` and all it called, in a callgrind dump (0
    if it never ran). Exported functions have their name without debug symbols too."""
    # (Run from `/`: callgrind_annotate shortens the paths under its working folder, and
    # then loses most of their counts.)
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100",
                          "--auto=no", str(dump)],
                         capture_output=True, text=True, check=True, cwd="/").stdout
    found = [int(m.group(1).replace(",", "")) for m in
             re.finditer(rf"^\s*([\d,]+) .*:{re.escape(fn)} \[", out, re.M)]
    return max(found, default=0)


def callgrind_calls(text, fn):
    """How many times the functions named `fn` were called, in a callgrind dump (its names
    compressed: `cfn=(id) name` the first time, `cfn=(id)` after)."""
    names, total, target = {}, 0, False
    for line in text.splitlines():
        if line.startswith(("fn=", "cfn=")):
            m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line)
            if m:
                if m.group(2):
                    names[m.group(1)] = m.group(2)
                target = line.startswith("cfn=") and names.get(m.group(1)) == fn
        elif line.startswith("calls=") and target:
            total += int(line[6:].split()[0])
            target = False
    return total


def paired_delta(runs, a, b):
    """Envoy CPU µs per request that `a` adds over `b`, burst by burst, median."""
    return statistics.median(x["cpu_us_per_req"] - y["cpu_us_per_req"]
                             for x, y in zip(runs[a], runs[b]))


def closed_loop(envoy_bin, specs, rounds, args, lua, workdir, keys=None, label="", extra="",
                raw=False):
    key_count = lambda e: (keys or {}).get(e.name, 1)
    measure = lambda e: wrk(e, args.seconds, args.connections, key_count(e), lua)
    warm = lambda e: wrk(e, 1, args.connections, key_count(e), lua)
    runs = interleaved(envoy_bin, specs, rounds, measure, workdir, label, extra, args.cycles,
                       warm)
    summary = {name: summarize(r) for name, r in runs.items()}
    return (summary, runs) if raw else summary


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--envoy", default=os.environ.get("ENVOY", "envoy"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=int, default=2)
    ap.add_argument("--cycles", type=int, default=3, help="measurements of every variant per round")
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="1 round of 2 s: a smoke test")
    ap.add_argument("--only", help="comma-separated main variants: measure just those, print "
                    "the table, write nothing (for development)")
    ap.add_argument("--report-only", action="store_true",
                    help="write BENCHMARKS.md again from bench/results.json")
    ap.add_argument("--redo-curves", action="store_true",
                    help="measure the cost curves again (all rounds) into bench/results.json "
                    "and BENCHMARKS.md, keeping the rest (a run the machine disturbed)")
    ap.add_argument("--instructions-only", action="store_true",
                    help="count the main variants' instructions per request, print, write nothing")
    ap.add_argument("--requests", type=int, default=2000,
                    help="requests counted per variant with --instructions-only, --tokens or --bodies")
    ap.add_argument("--bodies", action="store_true",
                    help="count the instructions per request of a rule keyed on the request "
                    "body's model against the same rule keyed on a header, for a 2 KB chat "
                    "request, both builds (and the body rule with log_body_fields false), the "
                    "native module's own instructions apart, --rounds rounds interleaved; "
                    "print, write bench/results-bodies.json")
    ap.add_argument("--tokens", action="store_true",
                    help="count the instructions per request of rules charged from response "
                    "bodies (JSON, event stream) against the header and no rule, both builds; "
                    "print, write bench/results-tokens.json (with --only: those variants)")
    ap.add_argument("--share", action="store_true",
                    help="count the instructions per request of a shared rule (one capacity "
                    "shared among the clients) against the same rule keyed alike but not "
                    "shared, both builds, the native module's own instructions apart, --rounds "
                    "rounds interleaved; print, write bench/results-share.json")
    ap.add_argument("--guard", action="store_true",
                    help="count what a plain rule costs the native build (the instructions of "
                    "the module's request hooks and of all they call, per request, for one rule "
                    "and for ten) and fail if either rose more than 0.5 %% over the figures "
                    "recorded in bench/guard.json (with --record: record them)")
    ap.add_argument("--record", action="store_true", help="with --guard: record the figures")
    args = ap.parse_args()
    if args.guard:
        work = Path(tempfile.mkdtemp(prefix="bench-guard-"))
        (work / "modules").mkdir()
        (work / "modules" / "libwasm_ratelimit.so").symlink_to(NATIVE_DIR / "libwasm_ratelimit.so")
        return guard(args, work)
    if args.share:
        work = Path(tempfile.mkdtemp(prefix="bench-share-"))
        (work / "modules").mkdir()
        (work / "modules" / "libwasm_ratelimit.so").symlink_to(NATIVE_DIR / "libwasm_ratelimit.so")
        return share(args, work)
    if args.bodies:
        work = Path(tempfile.mkdtemp(prefix="bench-bodies-"))
        (work / "modules").mkdir()
        (work / "modules" / "libwasm_ratelimit.so").symlink_to(NATIVE_DIR / "libwasm_ratelimit.so")
        return bodies(args, work)
    if args.tokens and args.report_only:
        for out in ("results-tokens.json", "results-tokens-paced.json"):
            if (BENCH / out).exists():
                print(f"{out}:\n{tokens_report(json.loads((BENCH / out).read_text()))}\n")
        return
    if args.report_only and not args.tokens:
        results = json.loads((BENCH / "results.json").read_text())
        write_benchmarks(report(results))
        return
    if args.quick:
        args.rounds, args.seconds, args.cycles = 1, 1, 1
    for tool in ("wrk", "taskset"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is required (make bench installs it)")
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="wasm-ratelimit-bench-"))
    lua = work / "keys.lua"
    lua.write_text(WRK_LUA)
    (work / "modules").mkdir()
    for so in (NATIVE_DIR / "libwasm_ratelimit.so", FLOOR_NATIVE_DIR / "libfloor_native.so"):
        (work / "modules" / so.name).symlink_to(so)
    envoy_version = subprocess.run([args.envoy, "--version"], capture_output=True,
                                   text=True).stdout.strip().split("version: ")[-1]

    per_client = [rule("per-client", ["remote_address"])]
    three = [rule("per-client", ["remote_address"]), rule("per-user", ["header:x-user"]),
             rule("global", [])]
    tiny = [rule("tiny", ["remote_address"], n=10)]
    variants = [
        ("no-filter", "", "no filter"),
        ("local-rl", native_local_ratelimit(),
         "Envoy local_ratelimit, per client, x-ratelimit headers"),
        ("floor-native", dynamic_module("floor_native", "1000000000", "floor"),
         "dynamic-module floor probe"),
        ("native-1", ours(per_client, build="native"), "native build, 1 rule per client"),
        ("native-3", ours(three, build="native"), "native build, 3 rules"),
        ("native-429", ours(tiny, build="native"), "native build, limit exceeded (429s)"),
        ("noop-wasm", wasm_filter(NOOP_WASM, {}, "noop"), "no-op Rust wasm filter"),
        ("floor-wasm", wasm_filter(FLOOR_WASM, {}, "floor"), "proxy-wasm floor probe"),
        ("wasm-1", ours(per_client), "wasm build, 1 rule per client"),
        ("wasm-3", ours(three), "wasm build, 3 rules"),
        ("wasm-429", ours(tiny), "wasm build, limit exceeded (429s)"),
    ]
    print(f"Envoy {envoy_version}; {args.rounds} rounds of {args.seconds} s, "
          f"{args.connections} connections; scratch {work}", flush=True)
    specs = [(name, filters) for name, filters, _ in variants]
    if args.redo_curves:
        results = json.loads((BENCH / "results.json").read_text())
        _, results["rules_curve"], results["per_rule_us"], results["keys_curve"] = curves(
            args, lua, work, args.rounds)
        results["curves_redone"] = True
        (BENCH / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        write_benchmarks(report(results))
        return
    if args.tokens:
        tokens(args, work)
        return
    if args.instructions_only:
        every = specs + header_styles() + rules_specs()
        keep = args.only.split(",") if args.only else [name for name, _ in every]
        counts = instructions(args.envoy, [s for s in every if s[0] in keep], work,
                              requests=args.requests)
        base = counts.get("no-filter")
        for name, n in counts.items():
            print(f"{name:18} {n:10,.0f} instructions/request"
                  + (f"  × no filter {n / base:.2f}" if base else ""))
        for line in instruction_targets(counts):
            print(line)
        return
    if args.only:
        keep = args.only.split(",")
        runs = closed_loop(args.envoy, [s for s in specs if s[0] in keep], args.rounds, args, lua,
                           work, label="variants")
        first = runs[keep[0]]
        for name, s in runs.items():
            print(f"{name:14} {s['rps']:8.0f} rps  {s['cpu_us_per_req']:6.1f} µs/req  "
                  f"× {keep[0]} {s['rps'] / first['rps']:.3f}")
        return
    main_runs, main_raw = closed_loop(args.envoy, specs, args.rounds, args, lua, work,
                                      label="variants", raw=True)
    pairs = {f"{a}/{b}": paired(main_raw, a, b) for a, b in (
        ("native-1", "floor-native"), ("wasm-1", "floor-wasm"), ("floor-native", "local-rl"),
        ("native-1", "local-rl"), ("wasm-1", "native-1"), ("floor-wasm", "noop-wasm"))}

    curve_rounds = max(1, (args.rounds + 1) // 2)
    rule_specs, rules_runs, per_rule, keys_runs = curves(args, lua, work, curve_rounds)

    # What each quota unit, and an elastic limit, adds to one rule per client, both builds.
    per_client_rule = rule("q", ["remote_address"])
    quota_rules = {
        "plain": [per_client_rule],
        "tokens": [per_client_rule | {"cost": {"response": "header:x-usage-tokens"}}],
        "bytes": [per_client_rule | {"cost": {"response": "body_bytes"}}],
        "in-flight": [{"name": "q", "key": ["remote_address"], "in_flight": {"max": NEVER}}],
        "prefix": [rule("q", [{"remote_address": {"ipv4_prefix": 24}}])],
        "elastic": [per_client_rule | {"elastic": {"ceiling": 2.0}}],
    }
    quota_specs = [(f"{b}-{name}", ours(rules, build=b))
                   for b in ("native", "wasm") for name, rules in quota_rules.items()]
    _, quota_raw = closed_loop(args.envoy, quota_specs, curve_rounds, args, lua, work,
                               label="quota", raw=True)
    quota = {f"{b}-{name}": {"cpu_us_per_req": summarize(quota_raw[f"{b}-{name}"])["cpu_us_per_req"],
                             "added_us": paired_delta(quota_raw, f"{b}-{name}", f"{b}-plain")}
             for b in ("native", "wasm") for name in quota_rules}

    memory = {b: memory_per_key(args, lua, work, b) for b in ("wasm", "native")}

    # Instructions per request: every variant above, counted exactly; and one rule per client
    # without header fields, to tell the fields' cost from the decision's.
    counted = instructions(args.envoy, specs + rule_specs + quota_specs + header_styles(), work,
                           requests=500 if args.quick else 2000)

    # Latency added at half the no-filter saturation rate (open loop).
    half = int(main_runs["no-filter"]["rps"] / 2)
    lat_specs = [(name, filters) for name, filters in specs
                 if name in ("no-filter", "local-rl", "floor-native", "native-1", "noop-wasm",
                             "floor-wasm", "wasm-1")]
    lat_runs = interleaved(args.envoy, lat_specs, curve_rounds,
                           lambda e: loadgen(e, half, args.seconds), work, label="latency")
    latency = {name: {f: statistics.median(r[f] for r in runs)
                      for f in ("rps", "p50_us", "p99_us", "p999_us")}
               for name, runs in lat_runs.items()}

    global_results = global_section(args, lua, work, curve_rounds)

    results = {
        "run": run_info(" ".join(["make bench (bench/bench.py"] + sys.argv[1:]) + ")"),
        "global": global_results,
        "envoy": envoy_version, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "rounds": args.rounds, "seconds": args.seconds, "connections": args.connections,
        "wasm_bytes": WASM.stat().st_size, "variants": main_runs, "paired": pairs,
        "cycles": args.cycles, "quota": quota, "instructions": counted,
        "labels": {name: label for name, _, label in variants},
        "rules_curve": rules_runs, "per_rule_us": per_rule, "keys_curve": keys_runs,
        "memory": memory,
        "latency_half_rate": {"rate": half, "by_variant": latency},
        "duration_s": round(time.time() - started),
    }
    (BENCH / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_benchmarks(report(results))
    print((ROOT / "BENCHMARKS.md").read_text())


# The native module's hooks a request goes through (the periodic one, whose work depends on
# time, not on requests, is left out): their inclusive instructions are the filter's whole cost
# to Envoy per request, Envoy's callbacks included, and do not move with the machine's load
# (two runs agree within 0.2 %), unlike the whole process's count.
REQUEST_HOOKS = [f"envoy_dynamic_module_on_http_filter_{h}" for h in (
    "new", "request_headers", "request_body", "response_headers", "response_body",
    "stream_complete", "destroy", "local_reply")]
GUARD = BENCH / "guard.json"
GUARD_SLACK = 0.005


def guard(args, work):
    """`make bench`'s first line: one rule per client (both field sets) and ten, native build,
    counted by callgrind; the figures against bench/guard.json's."""
    specs = [("native-1", ours([rule("per-client", ["remote_address"])], build="native")),
             ("native-rules-10", ours([rule(f"r{i}", ["remote_address"]) for i in range(10)],
                                      build="native"))]
    dumps = {}

    def keep(name):
        dumps[name] = sorted(work.glob(f"callgrind-{name}.*.1"))[-1]

    instructions(args.envoy, specs, work, requests=args.requests)
    for name, _ in specs:
        keep(name)
    now = {name: round(sum(callgrind_inclusive(dumps[name], h) for h in REQUEST_HOOKS)
                       / args.requests) for name, _ in specs}
    now["per further rule"] = round((now["native-rules-10"] - now["native-1"]) / 9)
    if args.record:
        GUARD.write_text(json.dumps({"run": run_info("bench/bench.py --guard --record"),
                                     "instructions": now}, indent=2) + "\n")
        print(f"recorded in {GUARD.relative_to(ROOT)}: {now}")
        return 0
    recorded = json.loads(GUARD.read_text())["instructions"]
    failed = False
    for name, n in now.items():
        was = recorded.get(name)
        change = (n - was) / was if was else 0.0
        # The per-rule figure is a difference: a cheaper single rule (its short path) raises
        # it; each of the two counts it is made of is held on its own.
        over = change > GUARD_SLACK and name != "per further rule"
        failed |= over
        print(f"{name:18} {n:7,} instructions/request in the module's hooks (recorded {was:,}; "
              f"{change:+.2%}){'  ROSE' if over else ''}")
    if failed:
        print(f"a plain rule costs more than {GUARD_SLACK:.1%} over bench/guard.json: find why, "
              "or record the new figures with --guard --record and say why in the commit")
        return 1
    return 0


def instruction_targets(ins):
    """The ratios the native hot path is held to, from instruction counts (as far as counted):
    a/b is the throughput ratio a/b that the counts imply (b's count / a's)."""
    lines = []
    for a, b, target in (("native-1-x", "local-rl", ">= 1.00"),
                         ("native-1", "floor-native", ">= 0.95"),
                         ("native-1", "local-rl", ""),
                         ("wasm-1", "floor-wasm", ""),
                         ("wasm-1-x", "floor-wasm", ""),
                         ("wasm-1", "native-1", "")):
        if a in ins and b in ins:
            lines.append(f"{a} / {b}: {ins[b] / ins[a]:.3f}" + (f" (target {target})" if target else ""))
    for b, target in (("native", " (target <= 2,500)"), ("wasm", "")):
        one, ten = ins.get(f"{b}-rules-1"), ins.get(f"{b}-rules-10")
        if one and ten:
            lines.append(f"{b}: each further rule {(ten - one) / 9:,.0f} instructions{target}")
    return lines


# Token usage read from response bodies (`cost.response: "openai"`): the answers an LLM API
# sends, served by a real upstream, so that Envoy receives them from the network as it would.
LLM_FIXTURES = ROOT / "crates/ratelimit-core/tests/fixtures/llm"
# The usage the answers report (the recorded stream's total_tokens), also sent as a header.
LLM_USAGE = 41

LLM_CLUSTER = """  clusters:
  - name: llm
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: llm
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{address: 127.0.0.1, port_value: {port}}}
"""

# The native module's body hook: Envoy calls it once per piece of body it delivers.
BODY_HOOK = "envoy_dynamic_module_on_http_filter_response_body"


def llm_answers():
    """What the token variants are served, built as crates/ratelimit-core/tests/usage_scan.rs
    builds the bodies it counts natively: name -> (content type, pieces). `json`: a 4 KB
    OpenAI chat completion (pretty-printed, a long answer with escapes), one piece; `sse`: a
    200-event OpenAI chat stream (usage in the last event, then [DONE]), one event a piece;
    `ok`: 3 bytes."""
    sample = (LLM_FIXTURES / "openai_chat.json").read_bytes()
    line = rb"Token buckets refill at a fixed rate; a request spends tokens.\n"
    long = line * ((4096 - len(sample)) // len(line) + 1)
    json_body = sample.replace(b'"content": "', b'"content": "' + long, 1)
    parts = (LLM_FIXTURES / "openai_chat_stream.sse").read_bytes().split(b"\n\n")
    events = [part + b"\n\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    first, content, tail = events[0], events[1:-3], events[-3:]
    stream = [first] + [content[i % len(content)] for i in range(200 - 1 - len(tail))] + tail
    return {"ok": ("text/plain", [b"ok\n"]), "json": ("application/json", [json_body]),
            "sse": ("text/event-stream", stream)}


class LlmUpstream:
    """An HTTP/1.1 upstream (keep-alive, in this process, outside valgrind) serving
    `llm_answers()` at /ok, /json and /sse, every answer with `x-usage-tokens`: `ok` and `json`
    with a content-length, in one write; `sse` chunked, each event its own chunk and its own
    write (TCP_NODELAY), as an LLM API flushes them. SSE_GAP_US in the environment: a pause
    after each event (what Envoy receives in one read, it delivers as one piece)."""

    def __init__(self):
        import socketserver
        answers = llm_answers()
        gap = float(os.environ.get("SSE_GAP_US") or 0) / 1e6

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                sock = self.request
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                buf = b""
                while True:
                    while b"\r\n\r\n" not in buf:
                        data = sock.recv(65536)
                        if not data:
                            return
                        buf += data
                    head, buf = buf.split(b"\r\n\r\n", 1)
                    path = head.split(b" ", 2)[1].decode().strip("/")
                    ctype, pieces = answers.get(path, answers["ok"])
                    fields = (f"HTTP/1.1 200 OK\r\ncontent-type: {ctype}\r\n"
                              f"x-usage-tokens: {LLM_USAGE}\r\n")
                    if path != "sse":
                        body = b"".join(pieces)
                        sock.sendall(f"{fields}content-length: {len(body)}\r\n\r\n".encode()
                                     + body)
                        continue
                    sock.sendall(f"{fields}transfer-encoding: chunked\r\n\r\n".encode())
                    for event in pieces:
                        sock.sendall(b"%x\r\n%s\r\n" % (len(event), event))
                        if gap:
                            time.sleep(gap)
                    sock.sendall(b"0\r\n\r\n")

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.bytes = {name: sum(map(len, pieces)) for name, (_, pieces) in answers.items()}
        self.pieces = {name: len(pieces) for name, (_, pieces) in answers.items()}
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def token_specs(port):
    """The token variants, both builds, for each answer: no filter; this filter with one rule
    per client that reads nothing of the answer (`pass`: its bytes just go by), charged from
    the response header (`header`), and charged from the body by the `openai` preset (`body`).
    (name, filters, route, extra)."""
    per_client = rule("per-client", ["remote_address"])
    charged = {"pass": per_client,
               "header": per_client | {"cost": {"response": "header:x-usage-tokens"}},
               "body": per_client | {"cost": {"response": "openai"}}}
    extra = LLM_CLUSTER.format(port=port)
    specs = []
    for answer in ("ok", "json", "sse"):
        route = f'                route: {{cluster: llm, prefix_rewrite: "/{answer}"}}\n'
        specs.append((f"no-filter-{answer}", "", route, extra))
        specs += [(f"{b}-{answer}-{kind}", ours([r], build=b), route, extra)
                  for b in ("native", "wasm") for kind, r in charged.items()
                  if answer != "ok" or kind != "body"]
    return specs


# The request of the body variants: a chat request of 2,048 bytes, its model near the end (after
# the messages, as the SDKs may send it).
def chat_request():
    pad = "How does a token bucket work? " * 80
    body = json.dumps({"messages": [{"role": "user", "content": pad}], "max_tokens": 300,
                       "model": "gpt-4o-mini"})
    body = body.replace(pad, pad[: len(pad) - (len(body) - 2048)])
    assert len(body) == 2048, len(body)
    return ({"content-type": "application/json", "x-api-key": "k1", "x-model": "gpt-4o-mini"},
            body.encode())


# Envoy's buffer filter after this one, so that the direct_response answers once the request's
# body is in (in the wasm build the headers go on while this filter reads the body).
BUFFER = """          - name: envoy.filters.http.buffer
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer
              max_request_bytes: 65536
"""


def bodies(args, work):
    """Instructions per request of a rule keyed on `body:model` against the same rule keyed on
    a header carrying the same value, for a 2 KB POST; both builds, and no filter; the body
    rule also with `log_body_fields: false`. `--rounds` rounds, the variants interleaved in
    each; the native module's own instructions counted apart. Prints the table and the
    instructions per request-body byte; writes bench/results-bodies.json."""
    header_rule = rule("per-key-model", ["header:x-api-key", "header:x-model"])
    body_rule = rule("per-key-model", ["header:x-api-key", "body:model"])
    unlogged = {"log_body_fields": False}
    specs = [("no-filter-post", BUFFER)]
    for b in ("native", "wasm"):
        specs += [(f"{b}-post-header", ours([header_rule], build=b) + BUFFER),
                  (f"{b}-post-body", ours([body_rule], build=b) + BUFFER),
                  (f"{b}-post-body-unlogged",
                   ours([body_rule], build=b, settings=unlogged) + BUFFER)]
    if args.only:
        keep = args.only.split(",")
        specs = [sp for sp in specs if sp[0] in keep]
    headers, body = chat_request()
    rounds = []
    for i in range(args.rounds):
        print(f"round {i + 1} of {args.rounds}", flush=True)
        rw = work / f"round-{i}"
        rw.mkdir()
        (rw / "modules").symlink_to(work / "modules")
        counts, seen = instructions(args.envoy, specs, rw, requests=args.requests,
                                    post=(headers, body), objects=[MODULE])
        rounds.append({"instructions": counts,
                       "module": {n: c[f"object {MODULE}"] for n, c in seen.items()}})
    median = lambda key, n: statistics.median(r[key][n] for r in rounds)
    names = [sp[0] for sp in specs]
    r = {"run": run_info(" ".join(["bench/bench.py"] + sys.argv[1:])),
         "instructions": {n: median("instructions", n) for n in names},
         "module": {n: median("module", n) for n in names if n.startswith("native")},
         "rounds": rounds, "body_bytes": len(body), "requests": args.requests}
    (BENCH / "results-bodies.json").write_text(json.dumps(r, indent=2) + "\n")
    print(bodies_report(r))


# The native module's shared object, as callgrind names it.
MODULE = "libwasm_ratelimit"


def share(args, work):
    """Instructions per request of one rule keyed by client address whose limit is a capacity
    shared among the clients (`share`; `-banded`: in two priority bands, each request in the
    lower), against the same rule not shared; both builds, and no filter. Every request is
    admitted (the capacity is never reached, so the level is never needed): this is what
    sharing costs each request. `--rounds` rounds, interleaved; the
    native module's own instructions apart. Prints the table; writes bench/results-share.json."""
    plain = rule("per-client", ["remote_address"], n=NEVER, unit="second")
    shared = dict(plain, share={})
    # Two bands, every request in the lower one (no x-band header): its budget decided too.
    banded = dict(plain, share={"bands": [{"name": "interactive", "min_share": 0.2},
                                          {"name": "batch"}],
                                "band": {"from": "header:x-band", "default": "batch"}})
    specs = [("no-filter", "")]
    for b in ("native", "wasm"):
        specs += [(f"{b}-plain", ours([plain], build=b)), (f"{b}-shared", ours([shared], build=b)),
                  (f"{b}-banded", ours([banded], build=b))]
    if args.only:
        keep = args.only.split(",")
        specs = [sp for sp in specs if sp[0] in keep]
    rounds = []
    for i in range(args.rounds):
        print(f"round {i + 1} of {args.rounds}", flush=True)
        rw = work / f"round-{i}"
        rw.mkdir()
        (rw / "modules").symlink_to(work / "modules")
        counts, seen = instructions(args.envoy, specs, rw, requests=args.requests,
                                    objects=[MODULE])
        # A request that waits and is released: one client alone over a capacity of
        # WAIT_RATE a second, one request after the other, each refused, waiting its turn
        # (max_wait_ms) and released; fewer requests (they come at WAIT_RATE a second).
        waited, waits = instructions(args.envoy, wait_specs(args), rw, requests=WAIT_REQUESTS,
                                     objects=[MODULE], read_stats=["share_queued", "share_waited_ms"])
        counts.update(waited)
        seen.update(waits)
        # Leased from the test rate limit service (over Redis), shared locally or fair across
        # the fleet: what each request pays, and the service's calls per request.
        leased, calls = lease_instructions(args, rw)
        counts.update(leased)
        seen.update(calls)
        rounds.append({"instructions": counts,
                       "module": {n: c[f"object {MODULE}"] for n, c in seen.items()},
                       "waits": {n: {k: v for k, v in c.items() if k.startswith("stat ")}
                                 for n, c in waits.items()},
                       "calls": {n: {k: v for k, v in c.items() if k.startswith("stat ")}
                                 for n, c in calls.items()}})
    median = lambda key, n: statistics.median(r[key][n] for r in rounds)
    names = [sp[0] for sp in specs] + [sp[0] for sp in wait_specs(args)] + [
        n for n in rounds[0]["instructions"] if n.endswith(("-leased", "-fair", "-fair-many"))]
    r = {"run": run_info(" ".join(["bench/bench.py"] + sys.argv[1:])),
         "instructions": {n: median("instructions", n) for n in names},
         "module": {n: median("module", n) for n in names if n.startswith("native")},
         "waits": {n: {k: statistics.median(rd["waits"][n][k] for rd in rounds)
                       for k in rounds[0]["waits"][n]} for n in rounds[0]["waits"]},
         "calls": {n: {k: statistics.median(rd["calls"][n][k] for rd in rounds)
                       for k in rounds[0]["calls"][n]} for n in rounds[0]["calls"]},
         "rounds": rounds, "requests": args.requests, "wait_requests": WAIT_REQUESTS,
         "wait_rate": WAIT_RATE}
    (BENCH / "results-share.json").write_text(json.dumps(r, indent=2) + "\n")
    print(share_report(r))


def lease_instructions(args, work):
    """The leased variants, both builds: the shared rule of `share` (never reached) whose
    capacity is leased from the test rate limit service over Redis (`-leased`: shared locally;
    `-fair`: fair across the fleet, `share.fleet: "fair"`, the service counting each descriptor
    by itself). Their instructions per request and, per request sent, the lease's claims and the
    calls to the service (`cluster.ratelimit.upstream_rq_total`: claims and the fair rule's
    reports). Skipped (nothing returned) without the rls-server build or redis-server."""
    rls_bin = ROOT / "crates/envoy-tests/rls-server/target/release/rls-server"
    if not rls_bin.exists() or not shutil.which("redis-server"):
        print("  leased: skipped (no rls-server build or no redis-server)")
        return {}, {}
    name = "per-client"
    limits = [{"namespace": "bench", "name": name, "max_value": NEVER, "seconds": 1,
               "conditions": [f"descriptors[0].rule == '{name}'"], "variables": []}]
    limits += [{"namespace": "bench", "name": f"{name}-{kind}", "max_value": 4294967295,
                "seconds": 3600, "conditions": [f"descriptors[0].fair == '{name}'"],
                "variables": [f"descriptors[0].{kind}", "descriptors[0].epoch"]}
               for kind in ("asked", "band")]
    procs = []
    try:
        redis_port, rls_port = free_port(), free_port()
        procs.append(subprocess.Popen(
            ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_listening(redis_port)
        procs.append(subprocess.Popen(
            [str(rls_bin), f"127.0.0.1:{rls_port}", f"redis://127.0.0.1:{redis_port}",
             json.dumps(limits), "0", "serial"], env={**os.environ, "RLS_DESCRIPTORS": "each"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_listening(rls_port)
        extra = RLS_CLUSTER.format(port=rls_port)
        lease = {"cluster": "ratelimit", "domain": "bench", "mode": "lease", "timeout_ms": 1000}
        base = dict(rule(name, ["remote_address"], n=NEVER, unit="second"), **{"global": lease})
        specs = []
        for b in ("native", "wasm"):
            specs.append((f"{b}-leased", ours([dict(base, share={})], build=b), None, extra))
            specs.append((f"{b}-fair", ours([dict(base, share={"fleet": "fair"})], build=b),
                          None, extra))
            # The same rule, its requests from FAIR_TENANTS tenants in turn: every one kept in
            # the rule's fair record (what a request reads and writes there grows with them).
            many = dict(base, key=["header:x-tenant"], share={"fleet": "fair"})
            specs.append((f"{b}-fair-many", ours([many], build=b), None, extra))
        if args.only:
            specs = [sp for sp in specs if sp[0] in args.only.split(",")]
        if not specs:
            return {}, {}
        return instructions(args.envoy, specs, work, requests=args.requests, objects=[MODULE],
                            read_stats=["lease_claims", "ratelimit.upstream_rq_total"],
                            tenants={f"{b}-fair-many": FAIR_TENANTS for b in ("native", "wasm")})
    finally:
        stop(procs)


def wait_listening(port):
    """Waits (at most 10 s) until something listens on `port`."""
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on {port}")


# The capacity a request waits for in the waiting variants, a second, and their requests.
WAIT_RATE = 50
WAIT_REQUESTS = 500


def wait_specs(args):
    """The waiting variants, both builds: one rule keyed by client address whose capacity,
    WAIT_RATE a second, is shared with waits of up to 2 s."""
    waits = dict(rule("per-client", ["remote_address"], n=WAIT_RATE, unit="second"),
                 share={"max_wait_ms": 2000})
    specs = [(f"{b}-waits", ours([waits], build=b)) for b in ("native", "wasm")]
    if args.only:
        specs = [sp for sp in specs if sp[0] in args.only.split(",")]
    return specs


def share_report(r):
    """The shared rule's cost, as markdown: Envoy's instructions per request (medians of the
    rounds) and, for the native build, the module's own."""
    ins, mod = r["instructions"], r["module"]
    lines = ["| build | no filter | rule not shared | shared | two bands | shared − not shared | module: not shared | module: shared | module: two bands |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    num = lambda d, k: f"{d[k]:,.0f}" if k in d else "–"
    for b in ("native", "wasm"):
        if f"{b}-plain" not in ins or f"{b}-shared" not in ins or "no-filter" not in ins:
            continue
        p, s = ins[f"{b}-plain"], ins[f"{b}-shared"]
        m = (" | ".join(num(mod, f"{b}-{v}") for v in ("plain", "shared", "banded"))
             if b == "native" else "– | – | –")
        lines.append(f"| {b} | {ins['no-filter']:,.0f} | {p:,.0f} | {s:,.0f} | "
                     f"{num(ins, f'{b}-banded')} | {s - p:+,.0f} | {m} |")
    waits = r.get("waits", {})
    if waits:
        lines += ["", "| build | shared, never reached | waits and is released | waits − never reached | waited per request | waiting ms per request | module: waits |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for b in ("native", "wasm"):
            w, s = ins.get(f"{b}-waits"), ins.get(f"{b}-shared")
            if w is None or s is None:
                continue
            st = waits.get(f"{b}-waits", {})
            m = f"{mod[f'{b}-waits']:,.0f}" if b == "native" and f"{b}-waits" in mod else "–"
            lines.append(f"| {b} | {s:,.0f} | {w:,.0f} | {w - s:+,.0f} | "
                         f"{st.get('stat share_queued', 0):.2f} | "
                         f"{st.get('stat share_waited_ms', 0):.1f} | {m} |")
    calls = r.get("calls", {})
    if calls:
        lines += ["", "| build | shared, never reached | leased | leased − shared | fair across the fleet | fair − leased | claims per 100 requests (leased, fair) | service calls per 100 requests (leased, fair) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for b in ("native", "wasm"):
            s_, l_, f_ = (ins.get(f"{b}-{v}") for v in ("shared", "leased", "fair"))
            if None in (s_, l_, f_):
                continue
            per100 = lambda v, st: 100 * calls.get(f"{b}-{v}", {}).get(f"stat {st}", 0)
            lines.append(f"| {b} | {s_:,.0f} | {l_:,.0f} | {l_ - s_:+,.0f} | {f_:,.0f} | "
                         f"{f_ - l_:+,.0f} | {per100('leased', 'lease_claims'):.2f}, "
                         f"{per100('fair', 'lease_claims'):.2f} | "
                         f"{per100('leased', 'ratelimit.upstream_rq_total'):.2f}, "
                         f"{per100('fair', 'ratelimit.upstream_rq_total'):.2f} |")
        many = [(b, ins[f"{b}-fair"], ins[f"{b}-fair-many"]) for b in ("native", "wasm")
                if f"{b}-fair" in ins and f"{b}-fair-many" in ins]
        if many:
            lines += ["", f"| build | fair across the fleet, one tenant | {FAIR_TENANTS} tenants in turn | more | module: one tenant | module: {FAIR_TENANTS} tenants |",
                      "|---|---:|---:|---:|---:|---:|"]
            for b, one, all_ in many:
                m = lambda v: (f"{mod[f'{b}-{v}']:,.0f}" if f"{b}-{v}" in mod else "–")
                lines.append(f"| {b} | {one:,.0f} | {all_:,.0f} | {all_ - one:+,.0f} | "
                             f"{m('fair')} | {m('fair-many')} |")
    if all(f"native-{v}" in mod for v in ("plain", "leased", "fair")):
        over = lambda d, v: d[f"native-{v}"] - d["native-plain"]
        lines += ["", f"Native, over a plain local rule: a leased shared rule "
                  f"{over(mod, 'leased'):+,.0f} instructions a request in the module (target "
                  f"<= +{LEASED_TARGET:,}), {over(ins, 'leased'):+,.0f} in all of Envoy; fair "
                  f"across the fleet {over(mod, 'fair'):+,.0f} and {over(ins, 'fair'):+,.0f}."]
    return "\n".join(lines)


# What a leased shared rule may cost the native module over a plain local rule, instructions a
# request (`share_report` says where it stands).
LEASED_TARGET = 2000
# Tenants the `-fair-many` variants send from, each in turn: as many as an Envoy keeps of a rule
# (`share::fair_record::MAX_TENANTS`).
FAIR_TENANTS = 256


def bodies_report(r):
    """The body variants' tables, as markdown: Envoy's instructions per request (medians of the
    rounds), and the native module's own."""
    ins, size = r["instructions"], r["body_bytes"]
    lines = ["| build | no filter | keyed on a header | keyed on `body:model` | body − header | per body byte | `log_body_fields: false` | body − header | per body byte |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for b in ("native", "wasm"):
        h, bd = ins.get(f"{b}-post-header"), ins.get(f"{b}-post-body")
        un = ins.get(f"{b}-post-body-unlogged")
        if h is None or bd is None:
            continue
        row = (f"| {b} | {ins.get('no-filter-post', 0):,.0f} | {h:,.0f} | {bd:,.0f} | "
               f"{bd - h:+,.0f} | {(bd - h) / size:.2f} |")
        row += (f" {un:,.0f} | {un - h:+,.0f} | {(un - h) / size:.2f} |" if un is not None
                else " | | |")
        lines.append(row)
    mod = r.get("module", {})
    h, bd, un = (mod.get(f"native-post-{v}") for v in ("header", "body", "body-unlogged"))
    if h is not None and bd is not None:
        lines += ["", "| the native module's own instructions | keyed on a header | keyed on `body:model` | body − header | per body byte | `log_body_fields: false` | body − header | per body byte |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|",
                  f"| per request | {h:,.0f} | {bd:,.0f} | {bd - h:+,.0f} | {(bd - h) / size:.2f} | "
                  + (f"{un:,.0f} | {un - h:+,.0f} | {(un - h) / size:.2f} |" if un is not None
                     else " | | |")]
    spread = []
    for n in r["instructions"]:
        xs = [x["instructions"][n] for x in r.get("rounds", [])]
        if len(xs) > 1:
            spread.append(f"{n} {min(xs):,.0f}–{max(xs):,.0f}")
    if spread:
        lines += ["", "Range over the rounds: " + "; ".join(spread) + "."]
    return "\n".join(lines)


def tokens(args, work):
    """Counts the token variants' instructions per request (callgrind, as
    --instructions-only), prints them with the instructions per body byte the body rule adds,
    and writes them to bench/results-tokens.json (bench/results-tokens-paced.json with
    SSE_GAP_US)."""
    upstream = LlmUpstream()
    try:
        specs = token_specs(upstream.port)
        if args.only:
            keep = args.only.split(",")
            specs = [s for s in specs if s[0] in keep]
        counts, seen = instructions(args.envoy, specs, work, requests=args.requests,
                                    count_calls=[BODY_HOOK])
    finally:
        upstream.stop()
    r = {"run": run_info(" ".join(["bench/bench.py"] + sys.argv[1:])),
         "instructions": counts, "seen": seen, "bytes": upstream.bytes,
         "pieces": upstream.pieces, "requests": args.requests,
         "sse_gap_us": float(os.environ.get("SSE_GAP_US") or 0)}
    out = "results-tokens-paced.json" if r["sse_gap_us"] else "results-tokens.json"
    (BENCH / out).write_text(json.dumps(r, indent=2) + "\n")
    print(tokens_report(r))


def tokens_report(r):
    """The table of the token variants and the figures per byte, as markdown."""
    ins, seen, size = r["instructions"], r["seen"], r["bytes"]
    cell = lambda name: f"{ins[name]:,.0f}" if name in ins else "–"
    hook = lambda name: seen.get(name, {}).get(f"{BODY_HOOK} inclusive")
    lines = [
        "| answer (body bytes) | build | no filter | rule reads nothing (`pass`) | charged from the header | charged from the body (`openai`) | body pieces per request (native hook calls) | native body hook, body rule (inclusive) | charged per request (header / body) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for answer, label in (("ok", "`ok`"), ("json", "4 KB JSON"), ("sse", "200-event stream")):
        for b in ("native", "wasm"):
            name = lambda kind: f"{b}-{answer}-{kind}"
            if not any(name(k) in ins for k in ("pass", "header", "body")):
                continue
            pieces = seen.get(name("body"), seen.get(name("header"), {})).get(BODY_HOOK)
            charged = " / ".join(
                f"{seen[name(k)].get('usage_charged', 0):g}"
                + (f" ({seen[name(k)]['usage_unreported']:g} unreported)"
                   if seen[name(k)].get("usage_unreported") else "")
                for k in ("header", "body") if name(k) in seen)
            h = hook(name("body"))
            lines.append(
                f"| {label} ({size[answer]:,}) | {b} | {cell(f'no-filter-{answer}')} | "
                f"{cell(name('pass'))} | {cell(name('header'))} | {cell(name('body'))} | "
                f"{f'{pieces:.1f}' if b == 'native' and pieces else '–'} | "
                f"{f'{h:,.0f}' if b == 'native' and h else '–'} | {charged} |")
    lines += ["", "| answer | build | body − header | per body byte | body − pass, per byte | native body hook, per body byte |",
              "|---|---|---:|---:|---:|---:|"]
    per_byte = {}
    for answer in ("json", "sse"):
        for b in ("native", "wasm"):
            n = lambda kind: ins.get(f"{b}-{answer}-{kind}")
            if n("body") is None or n("header") is None:
                continue
            added = n("body") - n("header")
            per_byte[f"{b}-{answer}"] = added / size[answer]
            over_pass = (f"{(n('body') - n('pass')) / size[answer]:.2f}"
                         if n("pass") is not None else "–")
            h = hook(f"{b}-{answer}-body")
            lines.append(f"| {answer} | {b} | {added:+,.0f} | {added / size[answer]:.2f} | "
                         f"{over_pass} | {f'{h / size[answer]:.2f}' if h else '–'} |")
    passing = [f"{answer} {(ins[f'no-filter-{answer}'] - ins['no-filter-ok']) / (size[answer] - size['ok']):.2f}"
               for answer in ("json", "sse")
               if f"no-filter-{answer}" in ins and "no-filter-ok" in ins]
    if passing:
        lines += ["", "Envoy passing the body without a filter, per byte ((no filter − no filter "
                  "`ok`) / bytes): " + ", ".join(passing) + "."]
    r["per_byte"] = per_byte
    return "\n".join(lines)


def header_styles():
    """One rule per client with no header fields, with the IETF style's two only, and with the
    X-RateLimit style's three only (the fields Envoy's local_ratelimit adds: the like-for-like
    comparison with it): to tell the fields' cost from the decision's (instructions only)."""
    bare = [rule("per-client", ["remote_address"])]
    return [(f"{b}-1-{style}", ours(bare, build=b, response={"headers": headers}))
            for b in ("native", "wasm") for style, headers in (("no-fields", "none"),
                                                               ("ietf", "ietf"),
                                                               ("x", "x-ratelimit"))]


def rules_specs():
    """1, 3 and 10 matching rules, each keyed by client address, both builds."""
    return [(f"{b}-rules-{n}", ours([rule(f"r{i}", ["remote_address"]) for i in range(n)],
                                    build=b))
            for b in ("native", "wasm") for n in (1, 3, 10)]


def curves(args, lua, work, rounds):
    """The cost curves, both builds: number of matching rules (each keyed by client address)
    and number of distinct client keys."""
    rules = rules_specs()
    rules_runs, rules_raw = closed_loop(args.envoy, rules, rounds, args, lua, work,
                                        label="rules", raw=True)
    per_rule = {b: paired_delta(rules_raw, f"{b}-rules-10", f"{b}-rules-1") / 9
                for b in ("native", "wasm")}
    key_counts = {"1": 1, "10k": 10_000, "1M": 1_000_000}
    keys_specs = [(f"{b}-keys-{k}", ours([rule("per-user", ["header:x-user"])],
                                         capacity=1_048_576, build=b))
                  for b in ("native", "wasm") for k in key_counts]
    keys_runs = closed_loop(args.envoy, keys_specs, rounds, args, lua, work,
                            keys={name: key_counts[name.rsplit("-", 1)[1]]
                                  for name, _ in keys_specs}, label="keys")
    return rules, rules_runs, per_rule, keys_runs


def memory_per_key(args, lua, work, build):
    """Envoy memory per tracked key at capacity 65,536: the wasm build's table grows as keys
    arrive (shared data), so it is filled with more keys than it holds; the native build's is
    allocated with the configuration, so two capacities are compared."""
    capacity = 65_536
    cfg = lambda cap: ours([rule("per-user", ["header:x-user"])], capacity=cap, build=build)
    if build == "native":
        small = Envoy(args.envoy, "memory-small", cfg(4), work)
        try:
            base = small.memory()
        finally:
            small.stop()
    env = Envoy(args.envoy, f"memory-{build}", cfg(capacity), work)
    try:
        if build == "wasm":
            base = env.memory()
        fill_seconds = 2 if args.quick else 10
        wrk(env, fill_seconds, args.connections, 50_000_000, lua)
        full = env.memory()
        wrk(env, max(1, fill_seconds // 2), args.connections, 50_000_000, lua)
        later = env.memory()
    finally:
        env.stop()
    return {"capacity": capacity, "before": base, "after_fill": full, "after_more": later,
            "bytes_per_key": (full - base) / capacity, "growth_after_full": later - full}


def stop(procs):
    """Stops the processes a section started (killed if one does not end within 5 s)."""
    for p in procs:
        p.terminate()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()


# The fleet's section (bench/fleet.py measures it): here, so that the page is written by one
# module and fleet.py imports this one, not the other way round.
# What BENCHMARKS.md says of the measurements (report.py), re-exported for fleet.py.
from report import FLEET_FLUSH_MS, FLEET_KEYS, fleet_report_lines, report, write_benchmarks  # noqa: E402,F401


def global_section(args, lua, work, rounds):
    """Global rules against a local-only rule, and async over-admission, with the test RLS
    server (limitador over Redis) that `make bench` builds. Skipped if it is not there."""
    rls_bin = ROOT / "crates/envoy-tests/rls-server/target/release/rls-server"
    if not rls_bin.exists() or not shutil.which("redis-server"):
        print("  global: skipped (no rls-server build or no redis-server)")
        return None
    procs = []

    def start(cmd):
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(p)
        return p

    def limits(rule, max_value):
        return json.dumps([{"namespace": "edge", "name": rule, "max_value": max_value, "seconds": 60,
                            "conditions": [f"descriptors[0].rule == '{rule}'"],
                            "variables": ["descriptors[0].remote_address"]}])

    try:
        redis_port, rls_port = free_port(), free_port()
        start(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no"])
        wait_listening(redis_port)
        start([str(rls_bin), f"127.0.0.1:{rls_port}", f"redis://127.0.0.1:{redis_port}",
               limits("g", NEVER)])
        wait_listening(rls_port)
        extra = RLS_CLUSTER.format(port=rls_port)
        g = lambda mode, more, b: ours([rule("g", ["remote_address"]) | {
            "global": {"cluster": "ratelimit", "domain": "edge", "mode": mode} | more}], build=b)
        specs = [(f"{b}-{name}", spec)
                 for b in ("native", "wasm")
                 for name, spec in (("local", ours([rule("g", ["remote_address"])], build=b)),
                                    ("sync", g("sync", {"timeout_ms": 1000}, b)),
                                    ("async", g("async", {"flush_ms": 100}, b)))]
        throughput = closed_loop(args.envoy, specs, rounds, args, lua, work, label="global",
                                 extra=extra)
        rate = 2_000
        lat_runs = interleaved(args.envoy, specs, rounds,
                               lambda e: loadgen(e, rate, args.seconds), work, "global latency",
                               extra)
        latency = {name: {f: statistics.median(x[f] for x in runs)
                          for f in ("p50_us", "p99_us", "p999_us")}
                   for name, runs in lat_runs.items()}

        # The fleet (three proxies, every mode) is measured by bench/fleet.py, which `make
        # bench` runs next: its last figures are kept.
        old = {}
        if (BENCH / "results.json").exists():
            old = json.loads((BENCH / "results.json").read_text()).get("global") or {}
        return {"throughput": throughput, "latency": latency, "latency_rate": rate,
                "fleet": old.get("fleet")}
    finally:
        stop(procs)


if __name__ == "__main__":
    sys.exit(main())

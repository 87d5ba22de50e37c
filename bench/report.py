"""The pages `make bench` writes: BENCHMARKS.md from bench/results.json (`report`, kept
sections carried over by `write_benchmarks`), the fleet's section (`fleet_report_lines`), and
the book's performance summary after it (bench/summary.py). bench.py measures; this module
only writes what it measured."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
# The fleet section's key count and flush period (bench.py measures with the same).
FLEET_KEYS = 1_000
FLEET_FLUSH_MS = 100

FLEET_LABELS = {
    "local": "local only",
    "sync": "sync (service one call at a time)",
    "sync-concurrent": "sync (service concurrent)",
    "async": f"async (flush {FLEET_FLUSH_MS} ms)",
    "lease": "lease (service one call at a time)",
    "lease-concurrent": "lease (service concurrent)",
}


def fleet_report_lines(f):
    """The BENCHMARKS.md section for `measure`'s results."""
    if not f:
        return []
    s = f["summary"]
    lines = [
        "## A fleet: three proxies, each global mode",
        "",
        f"{f['proxies']} Envoys × {f['workers']} workers (not pinned) share the test RLS server "
        "(limitador 0.14 over Redis, on this machine); each Envoy is driven by its own wrk "
        f"(1 thread, {f['connections']} connections) at full speed for {f['seconds']} s. One "
        "rule keyed on `x-user`: **hot**, every request on one key, limit "
        f"{f['hot_limit']:,} a minute; **hot, open**: the same at {f['open_limit']:,} a minute, "
        "not reached in a run (lease blocks capped at a tenth of it); **"
        f"{f['keys']:,} keys**, wrk cycling `x-user` over "
        f"{f['keys']:,} values, limit {f['key_limit']} a minute each. Every build, pattern and "
        f"mode once per round, {f['rounds']} rounds"
        + (f" (more for some: `--more {'`, `--more '.join(f['more'])}`; the admitted column lists every run)"
           if f.get("more") else "") + ", fresh Envoys and wiped counters per run. "
        "× local: throughput against local-only in the same round (median, and the range); "
        "from CPU: the same ratio from the Envoys' CPU time per request (local's / the "
        "mode's), which other tenants of the machine disturb less. "
        "Calls: requests Envoy sent to the service (`cluster.ratelimit.upstream_rq_total`) per "
        "100 requests. Allowed: the limit, or for the keys each key's limit or what it was "
        "offered if less, summed; over/under: the most any round admitted above / below it. "
        "\"One call at a time\" is rls-server's `serial`: limitador's Redis storage checks, "
        "then counts, in two steps, so concurrent calls near the limit are all granted. "
        "Measured by `make bench` (after bench.py's sections), or alone by `make bench-fleet` "
        f"(`python3 bench/fleet.py --rounds {f['rounds']} --seconds {f['seconds']}`: into "
        "bench/results.json and this page); [`bench/fleet.py`](bench/fleet.py).",
        "",
        "| build | keys | mode | requests/s | × local (range) | × local from CPU | calls / 100 req | admitted (per round) | allowed | over | under |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for name, x in s.items():
        build, pattern, mode = name.split("/")
        ratio, cpu = "1.00", "1.00"
        if mode != "local" and x["x_local"]:
            lo, hi = x["x_local_range"]
            ratio, cpu = f"{x['x_local']:.2f} ({lo:.2f}–{hi:.2f})", f"{x['x_local_cpu']:.2f}"
        allowed = sorted({min(x["allowed"]), max(x["allowed"])})
        keys = {"hot": "hot", "open": "hot, open", "keys": f"{FLEET_KEYS:,}"}[pattern]
        lines.append(
            f"| {build} | {keys} | {FLEET_LABELS[mode]} | {x['rps']:,.0f} | {ratio} | {cpu} | "
            f"{x['calls_per_100']:.3f} | {', '.join(f'{a:,}' for a in x['admitted'])} | "
            f"{'–'.join(f'{a:,}' for a in allowed)} | {max(x['over_max'], 0):,} | "
            f"{max(x['under_max'], 0):,} |")
    lines += [""] + fleet_target_lines(s, f)
    return lines


def fleet_target_lines(s, f):
    """The targets for lease on the hot key, and async and sync beside them."""
    out = ["Against the targets (hot key, the service answering one call at a time):", ""]
    for build in ("native", "wasm"):
        lease, async_, sync = (s.get(f"{build}/hot/{m}") for m in ("lease", "async", "sync"))
        if not (lease and async_ and sync):
            continue
        most = max(lease["admitted"])
        out.append(
            f"- {build}: lease admitted at most {most:,} of {f['hot_limit']:,} "
            f"({'never over' if most <= f['hot_limit'] else 'OVER'} the limit, "
            f"{len(lease['admitted'])} runs), {lease['x_local']:.2f}× local-only "
            f"({lease['x_local_cpu']:.2f}× from CPU; target ≥ 0.95×), "
            f"{lease['calls_per_100']:.3f} service calls per 100 requests (target ≤ 2; "
            f"{lease['claims_per_100_admitted']:.1f} claims per 100 admitted). Async "
            f"{async_['x_local']:.2f}× ({async_['x_local_cpu']:.2f}× from CPU), admitted "
            f"{min(async_['admitted']):,}–{max(async_['admitted']):,}; sync "
            f"{sync['x_local']:.2f}× ({sync['x_local_cpu']:.2f}× from CPU), admitted "
            f"{min(sync['admitted']):,}–{max(sync['admitted']):,}.")
        o = s.get(f"{build}/open/lease")
        if o:
            out[-1] += (f" Below the limit (hot, open): lease {o['x_local']:.2f}× "
                        f"({o['x_local_cpu']:.2f}× from CPU), {o['calls_per_100']:.3f} calls "
                        "per 100 requests.")
    return out + [""]


def report(r):
    v = r["variants"]
    base, local = v["no-filter"], v["local-rl"]
    lines = [
        "# Benchmarks",
        "",
        "What every request pays for the filter, measured by `make bench` in one run: the same",
        f"Envoy ({r['envoy']}) binary, listener and `direct_response` route for every variant, Envoy",
        "with `--concurrency 1` pinned to CPU 0, the load generator (wrk, 1 thread,",
        f"{r['connections']} keep-alive connections) pinned to CPU 1, variants interleaved over",
        f"{r['rounds']} rounds (a fresh Envoy per variant and round, warmed up) of {r['cycles']} bursts",
        f"of {r['seconds']} s per variant in a rotating order, medians.",
        "Envoy CPU per request is the CPU time of all Envoy threads during a run divided by the",
        "requests served. Ratios compare variants within this run; absolute numbers depend on the",
        f"machine ({r['machine']}), which is shared and noisy.",
        "",
        "| variant | requests/s | × no filter | × local_ratelimit | Envoy CPU µs/req | added µs/req | p50 µs | p99 µs | p99.9 µs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in v.items():
        lines.append(
            f"| {r['labels'][name]} | {s['rps']:.0f} | {s['rps'] / base['rps']:.2f} | "
            f"{s['rps'] / local['rps']:.2f} | {s['cpu_us_per_req']:.1f} | "
            f"{s['cpu_us_per_req'] - base['cpu_us_per_req']:+.1f} | "
            f"{s['p50_us']:.0f} | {s['p99_us']:.0f} | {s['p999_us']:.0f} |")
    p = r["paired"]
    pr = lambda name: f"{p[name]['throughput']:.2f} | {p[name]['cpu']:.2f}"
    lines += [
        "",
        "Each build against the least work any per-client limiter of its kind must do (the floor",
        "probes: read `source.address`, one counter update in shared state, two response header",
        "fields; [`bench/floor-native`](bench/floor-native), [`bench/floor-wasm`](bench/floor-wasm)).",
        "Ratios are taken burst by burst (the two variants measured one after the other, in the same",
        f"round), medians over {p['wasm-1/floor-wasm']['bursts']} pairs; the second column derives",
        "the same ratio from Envoy CPU per request, which CPU time taken by other tenants of the",
        "machine disturbs less:",
        "",
        "| | throughput ratio | from CPU per request |",
        "|---|---:|---:|",
        f"| native build, 1 rule per client, both header styles / dynamic-module floor | {pr('native-1/floor-native')} |",
        f"| wasm build, 1 rule per client, both header styles / proxy-wasm floor | {pr('wasm-1/floor-wasm')} |",
        f"| dynamic-module floor / Envoy local_ratelimit per client | {pr('floor-native/local-rl')} |",
        f"| native build, 1 rule / Envoy local_ratelimit per client | {pr('native-1/local-rl')} |",
        f"| wasm build, 1 rule / native build, 1 rule | {pr('wasm-1/native-1')} |",
        f"| proxy-wasm floor / no-op wasm filter | {pr('floor-wasm/noop-wasm')} |",
        "",
    ]
    ins = r["instructions"]
    ir = lambda a, b: ins[b] / ins[a]  # the throughput ratio a/b implied by instructions
    extra_labels = {name: label for name, label in (
        ("native-1-no-fields", "native build, 1 rule per client, no header fields"),
        ("wasm-1-no-fields", "wasm build, 1 rule per client, no header fields"),
        ("native-1-ietf", "native build, 1 rule per client, IETF fields only"),
        ("wasm-1-ietf", "wasm build, 1 rule per client, IETF fields only"),
        ("native-1-x", "native build, 1 rule per client, X-RateLimit fields only"),
        ("wasm-1-x", "wasm build, 1 rule per client, X-RateLimit fields only")) if name in ins}
    lines += [
        "## Instructions per request",
        "",
        "Time on this shared machine is noisy; instructions are not. Each variant again, this time",
        "under valgrind's callgrind: Envoy warmed up with 2,000 requests, then every instruction of",
        "all its threads counted while one client sends 2,000 requests one after the other on a",
        "keep-alive connection (three runs of one variant agree within 0.2 %). An instruction is",
        "not a unit of time (a cache miss costs more than many), but the ratios below compare the",
        "work each variant asks of Envoy exactly.",
        "",
        "| variant | instructions/request | × no filter | added over no filter |",
        "|---|---:|---:|---:|",
    ]
    for name in list(v) + list(extra_labels):
        label = r["labels"].get(name) or extra_labels[name]
        lines.append(f"| {label} | {ins[name]:,.0f} | {ins[name] / ins['no-filter']:.2f} | "
                     f"{ins[name] - ins['no-filter']:+,.0f} |")
    lines += [
        "",
        "| | throughput ratio implied by instructions |",
        "|---|---:|",
        f"| native build, 1 rule per client, both header styles / dynamic-module floor | {ir('native-1', 'floor-native'):.3f} |",
        f"| wasm build, 1 rule per client, both header styles / proxy-wasm floor | {ir('wasm-1', 'floor-wasm'):.3f} |",
        f"| native build, 1 rule per client, no header fields / dynamic-module floor | {ir('native-1-no-fields', 'floor-native'):.3f} |",
        f"| wasm build, 1 rule per client, no header fields / proxy-wasm floor | {ir('wasm-1-no-fields', 'floor-wasm'):.3f} |",
    ]
    lines += [f"| {b} build, 1 rule per client, IETF fields only / {floor} | "
              f"{ir(f'{b}-1-ietf', f'floor-{b}'):.3f} |"
              for b, floor in (("native", "dynamic-module floor"), ("wasm", "proxy-wasm floor"))
              if f"{b}-1-ietf" in ins]
    lines += [
        f"| dynamic-module floor / Envoy local_ratelimit per client | {ir('floor-native', 'local-rl'):.3f} |",
        f"| native build, 1 rule / Envoy local_ratelimit per client | {ir('native-1', 'local-rl'):.3f} |",
        *([f"| native build, 1 rule, X-RateLimit fields only (the same fields) / Envoy local_ratelimit per client | {ir('native-1-x', 'local-rl'):.3f} |"]
          if "native-1-x" in ins else []),
        f"| wasm build, 1 rule / native build, 1 rule | {ir('wasm-1', 'native-1'):.3f} |",
        "",
        *([r["instructions_ietf_note"], ""] if r.get("instructions_ietf_note") else []),
        "The five header fields of both styles cost "
        f"{(ins['native-1'] - ins['native-1-no-fields']) / 5:,.0f} instructions each in the native build and "
        f"{(ins['wasm-1'] - ins['wasm-1-no-fields']) / 5:,.0f} in the wasm build (the floor probes add two).",
        "",
        f"In the 429 variants, {v['native-429']['non2xx_share']:.1%} (native) and "
        f"{v['wasm-429']['non2xx_share']:.1%} (wasm) of the requests were refused: they measure",
        "the reject path (one state read, no write, a local reply with headers and body).",
        "",
        "## Cost curve",
        "",
    ]
    if r.get("curves_redone"):
        lines += [f"Measured again with `python3 bench/bench.py --redo-curves` ({r['rounds']} "
                  "rounds) after the main run, whose curve rounds other tenants of the machine "
                  "disturbed; the rest of this page is from the main run.", ""]
    lines += [
        "| matching rules (each keyed by client address) | build | requests/s | Envoy CPU µs/req | added per extra rule µs |",
        "|---|---|---:|---:|---:|",
    ]
    rc = r["rules_curve"]
    per_rule = r["per_rule_us"]
    for b in ("native", "wasm"):
        one = rc[f"{b}-rules-1"]["cpu_us_per_req"]
        for n in (1, 3, 10):
            s = rc[f"{b}-rules-{n}"]
            per = "" if n == 1 else f"{(s['cpu_us_per_req'] - one) / (n - 1):.2f}"
            lines.append(f"| {n} | {b} | {s['rps']:.0f} | {s['cpu_us_per_req']:.1f} | {per} |")
    lines += [
        "",
        f"Each further rule, burst by burst (10 rules against 1, / 9): native {per_rule['native']:.2f} µs,",
        f"wasm {per_rule['wasm']:.2f} µs; in instructions, native "
        f"{(ins['native-rules-10'] - ins['native-rules-1']) / 9:,.0f}, wasm "
        f"{(ins['wasm-rules-10'] - ins['wasm-rules-1']) / 9:,.0f} per further rule.",
        "",
        "| distinct client keys (header `x-user`, capacity 1,048,576) | build | requests/s | Envoy CPU µs/req | p99 µs |",
        "|---|---|---:|---:|---:|",
    ]
    for b in ("native", "wasm"):
        for k, label in (("1", "1"), ("10k", "10,000"), ("1M", "1,000,000")):
            s = r["keys_curve"][f"{b}-keys-{k}"]
            lines.append(f"| {label} | {b} | {s['rps']:.0f} | {s['cpu_us_per_req']:.1f} | "
                         f"{s['p99_us']:.0f} |")
    q = r["quota"]
    lines += [
        "",
        "## Quota units and elastic limits",
        "",
        "What each kind of rule adds to one rule keyed by client address (Envoy CPU µs per request,",
        "burst by burst against the plain rule): charged from a response header (`x-usage-tokens`,",
        "which the route adds to every response), charged by body bytes, requests in flight,",
        "keyed per IPv4 /24, and elastic (ceiling 2×: every response is observed).",
        "",
        "| rule | native µs/req | added | instructions added | wasm µs/req | added | instructions added |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, label in (("plain", "1 rule per client"), ("tokens", "charged from a response header"),
                        ("bytes", "charged by body bytes"), ("in-flight", "requests in flight"),
                        ("prefix", "keyed per /24"), ("elastic", "elastic")):
        n, w = q[f"native-{name}"], q[f"wasm-{name}"]
        added = lambda b: ins[f"{b}-{name}"] - ins[f"{b}-plain"]
        lines.append(f"| {label} | {n['cpu_us_per_req']:.1f} | {n['added_us']:+.2f} | "
                     f"{added('native'):+,.0f} | {w['cpu_us_per_req']:.1f} | "
                     f"{w['added_us']:+.2f} | {added('wasm'):+,.0f} |")
    m = r["memory"]
    mw, mn = m["wasm"], m["native"]
    lines += [
        "",
        "**Memory per tracked key** (Envoy's `/memory` allocated, capacity "
        f"{mw['capacity']:,}): wasm build {mw['bytes_per_key']:.0f} bytes (before and after filling the",
        f"table with more distinct keys than it holds: {mw['before']:,} → {mw['after_fill']:,} bytes; more new",
        f"keys afterwards: {mw['growth_after_full']:+,} bytes); native build {mn['bytes_per_key']:.0f} bytes",
        f"(the table is allocated with the configuration: capacity 4 against {mn['capacity']:,},",
        f"{mn['before']:,} → {mn['after_fill']:,} bytes once filled; more new keys: "
        f"{mn['growth_after_full']:+,} bytes). Either way the total is fixed by `capacity`.",
        "",
        "## Latency at half the no-filter saturation rate",
        "",
        f"Open-loop load at {r['latency_half_rate']['rate']:,} requests/s (bench/loadgen: 16 connections,",
        "latency from each request's scheduled send time). A variant whose own saturation rate is",
        "below this rate queues, and its latency shows it.",
        "",
        "| variant | p50 µs | p99 µs | p99.9 µs | p99 added vs no filter µs |",
        "|---|---:|---:|---:|---:|",
    ]
    lat = r["latency_half_rate"]["by_variant"]
    for name, s in lat.items():
        lines.append(f"| {r['labels'][name]} | {s['p50_us']:.0f} | {s['p99_us']:.0f} | "
                     f"{s['p999_us']:.0f} | {s['p99_us'] - lat['no-filter']['p99_us']:+.0f} |")
    lines += [
        "",
        "## Against the targets",
        "",
        "| target | measured |",
        "|---|---|",
        f"| native build, 1 rule per client ≥ 0.92× the dynamic-module floor | {p['native-1/floor-native']['throughput']:.2f}× (from CPU: {p['native-1/floor-native']['cpu']:.2f}×; from instructions: {ir('native-1', 'floor-native'):.3f}×) |",
        f"| native build, each further rule ≤ 1 µs | {per_rule['native']:.2f} µs |",
        f"| wasm build, 1 rule per client ≥ 0.92× the proxy-wasm floor | {p['wasm-1/floor-wasm']['throughput']:.2f}× (from CPU: {p['wasm-1/floor-wasm']['cpu']:.2f}×; from instructions: {ir('wasm-1', 'floor-wasm'):.3f}×) |",
        f"| memory per tracked key ≤ 64 B | wasm {mw['bytes_per_key']:.0f} B, native {mn['bytes_per_key']:.0f} B |",
        "",
    ]
    lines += global_report(r.get("global"))
    lines += [
        "## Reproduce",
        "",
        "```sh",
        "make bench   # builds everything, installs Envoy, wrk, valgrind and Redis if missing; about 20 minutes",
        "```",
        "",
        f"The run took {r['duration_s']} s. Raw figures: [`bench/results.json`](bench/results.json);",
        "the floor probes: [`bench/floor-native/`](bench/floor-native),",
        "[`bench/floor-wasm/`](bench/floor-wasm); the no-op filter: [`bench/noop/`](bench/noop); the",
        "open-loop load generator: [`bench/loadgen/`](bench/loadgen); the driver:",
        "[`bench/bench.py`](bench/bench.py).",
        "",
        "The sizes of the `.wasm` and of the native module as built now are on the performance",
        "pages ([what the builds weigh](docs/src/performance/cost.md#what-the-builds-weigh)), checked",
        "against the files built; a size in a section below is that of the build the section names.",
        "",
    ]
    return "\n".join(lines)


# A section of BENCHMARKS.md measured apart from `make bench` (by --instructions-only runs)
# says so on the line after its heading; rewriting the page keeps it, at the end.
KEPT = "<!-- kept by bench.py:"


def write_benchmarks(text):
    """Writes BENCHMARKS.md, carrying over the sections of the current one marked KEPT."""
    page = ROOT / "BENCHMARKS.md"
    old = page.read_text() if page.exists() else ""
    kept, section = [], None
    for line in old.splitlines():
        if line.startswith("## "):
            if section:
                kept.append(section)
            section = [line]
        elif section is not None:
            section.append(line)
    if section:
        kept.append(section)
    kept = ["\n".join(s).rstrip() + "\n" for s in kept if len(s) > 1 and s[1].startswith(KEPT)]
    page.write_text(text.rstrip() + "\n" + "".join("\n" + k for k in kept))
    # The book's performance summary is made from the same results: keep it in step.
    subprocess.run([sys.executable, str(BENCH / "summary.py")], check=True)


def global_report(g):
    if not g:
        return ["## Global rules", "", "Not measured in this run (no RLS server build).", ""]
    t, lat, o = g["throughput"], g["latency"], g.get("over_admission")
    lines = [
        "## Global rules",
        "",
        "One rule keyed by client address: local only, `global` sync and `global` async, against",
        "the test RLS server (limitador over Redis, on this machine, not pinned: it competes with",
        "Envoy and the load generator for the two CPUs).",
        "",
        f"| build, rule | requests/s | Envoy CPU µs/req | p50 µs | p99 µs at {g['latency_rate']:,} req/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in (f"{b}-{mode}" for b in ("native", "wasm") for mode in ("local", "sync", "async")):
        lines.append(f"| {name.replace('-', ', ')} | {t[name]['rps']:.0f} | "
                     f"{t[name]['cpu_us_per_req']:.1f} | "
                     f"{lat[name]['p50_us']:.0f} | {lat[name]['p99_us']:.0f} |")
    if "over_admission" in g:  # results of the run before the fleet's
        lines += [
        "",
        f"**Async over-admission** (wasm build): {o['replicas']} proxies at full speed ({o['offered_rps']:,.0f} "
        f"requests/s offered in all), flush every {o['flush_ms']} ms, global limit "
        f"{o['limit']:,} a minute: {o['admitted']:,} admitted, {o['over']:,} over the limit; the "
        f"documented bound, offered rate × (2 × flush + 10 ms), is {o['bound']:,.0f}.",
        ]
    return lines + [""] + fleet_report_lines(g.get("fleet"))

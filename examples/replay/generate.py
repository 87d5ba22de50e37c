#!/usr/bin/env python3
"""Writes access.log: ten minutes of an API's traffic as Envoy writes it with the JSON format of
this example's envoy.yaml (one object per line, keys sorted, numbers as numbers, a missing header
as null), in the order Envoy writes entries: when each request ends. Deterministic (seeded).

Who is in it: 60 ordinary clients with API keys, browsing at a few requests a minute; a batch
job that polls hard with one key; a scraper without a key; a client whose retries storm for
20 seconds; someone guessing passwords on /login; and three lines cut short, as a log rotation
can leave them.

    python3 examples/replay/generate.py > examples/replay/access.log
"""

import datetime
import json
import random
import sys

rng = random.Random(20261120)
T0 = datetime.datetime(2026, 11, 20, 10, 0, 0, tzinfo=datetime.timezone.utc)
SPAN_MS = 600_000
entries = []  # (start_ms, fields)


def request(start_ms, client, method, path, key=None, status=200, body=None, duration=None):
    if duration is None:
        # Mostly fast, with a long tail (a few requests take seconds).
        duration = int(rng.lognormvariate(3.2, 0.9))
        if rng.random() < 0.01:
            duration += rng.randint(2_000, 8_000)
    entries.append((start_ms, {
        "authority": "api.example.com",
        "bytes_sent": body if body is not None else rng.randint(200, 4_000),
        "downstream_remote_address": f"{client}:{rng.randint(20_000, 60_000)}",
        "duration": duration,
        "method": method,
        "path": path,
        "response_code": status,
        "start_time": None,  # filled below
        "x-api-key": key,
    }))


def poisson(rate_per_s, start_ms, end_ms):
    t = start_ms
    while True:
        t += rng.expovariate(rate_per_s) * 1000
        if t >= end_ms:
            return
        yield int(t)


PATHS = ["/api/orders", "/api/orders/{}", "/api/items", "/api/items/{}", "/api/search?q={}"]
for c in range(60):
    client = f"10.1.{c // 200}.{c % 200 + 10}"
    key = f"key-{c:03d}-{rng.getrandbits(32):08x}"
    for t in poisson(rng.uniform(0.02, 0.15), 0, SPAN_MS):
        path = rng.choice(PATHS).format(rng.randint(1, 5000))
        request(t, client, rng.choice(["GET"] * 5 + ["POST"]), path, key)
        if rng.random() < 0.05:
            request(t + rng.randint(50, 400), client, "GET", "/static/app.js", body=48_213)

# A batch job polling with one key: 3 requests a second, in bursts of 12 every 4 seconds.
for burst in range(0, SPAN_MS, 4_000):
    for i in range(12):
        request(burst + i * 15, "10.9.0.4", "GET", f"/api/orders?page={i}", "key-batch-7f3e")

# A scraper without a key, 4 requests a second for four minutes.
for t in poisson(4.0, 60_000, 300_000):
    request(t, "203.0.113.7", "GET", f"/api/items/{rng.randint(1, 90_000)}")

# A client retrying without backoff for 20 seconds, 25 requests a second.
for t in poisson(25.0, 380_000, 400_000):
    request(t, "198.51.100.23", "POST", "/api/orders", "key-041-retry", status=503)

# Password guessing: 60 attempts over three minutes.
for t in poisson(0.33, 200_000, 380_000):
    request(t, "192.0.2.55", "POST", "/login", status=401, body=37)

lines = []
for start, fields in entries:
    fields["start_time"] = (T0 + datetime.timedelta(milliseconds=start)).strftime(
        "%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    lines.append((start + fields["duration"], json.dumps(fields, sort_keys=True, separators=(",", ":"))))
lines.sort(key=lambda x: x[0])  # Envoy writes an entry when its request ends
out = [line for _, line in lines]
for at in (731, 2_048, 3_500):  # cut short
    out[at] = out[at][: len(out[at]) // 2]
sys.stdout.write("\n".join(out) + "\n")

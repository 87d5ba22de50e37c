# Traffic for examples/openai-tokens and examples/anthropic-tokens, as recorded in their
# access.log: `python3 examples/openai-tokens/traffic.py openai|anthropic SECONDS` sends, for
# SECONDS, the requests of four API keys of different appetites (JSON answers and streams) to
# the example's Envoy on localhost:10000.
import json, sys, threading, time, random, urllib.request, urllib.error
api, seconds = sys.argv[1], float(sys.argv[2])
path = "/v1/chat/completions" if api == "openai" else "/v1/messages"
model = "gpt-4o-mini" if api == "openai" else "claude-sonnet-4-20250514"
# key: (seconds between requests, share of streams, max_tokens)
keys = {"key-batch": (1.0, 0.0, 300), "key-chat": (4.0, 0.5, 500), "key-app": (7.0, 0.8, 800), "key-dev": (20.0, 0.5, 200)}
def ask(key, stream, max_tokens):
    body = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "How does a token bucket work?"}]}
    headers = {"x-api-key": key, "content-type": "application/json"}
    if api == "anthropic":
        headers["anthropic-version"] = "2023-06-01"
    if stream:
        body["stream"] = True
        if api == "openai":
            body["stream_options"] = {"include_usage": True}
        headers["x-demo-stream"] = "1"
    req = urllib.request.Request("http://127.0.0.1:10000" + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req) as r:
            r.read()
    except urllib.error.HTTPError as e:
        e.read()
def client(key, every, streams, max_tokens, seed):
    rng = random.Random(seed)
    end = time.time() + seconds
    time.sleep(rng.uniform(0, every))
    while time.time() < end:
        ask(key, rng.random() < streams, max_tokens)
        time.sleep(every * rng.uniform(0.5, 1.5))
threads = [threading.Thread(target=client, args=(k, *v, i)) for i, (k, v) in enumerate(keys.items())]
[t.start() for t in threads]
[t.join() for t in threads]

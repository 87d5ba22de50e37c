#!/usr/bin/env python3
"""What reading a compressed LLM answer would cost, measured with callgrind (BENCHMARKS.md,
"Compressed answers"): zlib inflate (what the filter would do to read a gzip answer) against
zlib deflate at Envoy's gzip settings (what Envoy's compressor does when the backend answers in
identity and Envoy compresses for the client).

  python3 bench/compression.py prep     # writes /tmp/stream.raw (8 MiB of chat-completion
                                        # chunks) and /tmp/stream.z (it, zlib level 6)
  PY=$(python3 -c 'import sys; print(sys.executable)')   # the interpreter itself, not a shim
  for a in base inflate "deflate 6 12 5" "deflate 1 12 5"; do
    valgrind --tool=callgrind --callgrind-out-file=/dev/null $PY bench/compression.py $a 2>&1 | grep Collected
  done

(instructions of a step - instructions of `base`) / 8,388,608 bytes = instructions per
uncompressed byte. `deflate LEVEL WINDOW_BITS MEM_LEVEL`: Envoy's gzip defaults are 6, 12, 5.
"""

import json
import random
import sys
import zlib

RAW, COMPRESSED = "/tmp/stream.raw", "/tmp/stream.z"
WORDS = "token bucket refill rate request window limit quota client burst answer stream model usage the a of to and in".split()


def prep():
    random.seed(7)
    out, n = [], 0
    while n < 8 * 1024 * 1024:
        chunk = {
            "id": "chatcmpl-x",
            "object": "chat.completion.chunk",
            "model": "gpt-4o-mini",
            "choices": [{"index": 0, "delta": {"content": " ".join(random.choice(WORDS) for _ in range(3))}, "finish_reason": None}],
            "usage": None,
        }
        event = "data: " + json.dumps(chunk) + "\n\n"
        out.append(event)
        n += len(event)
    data = "".join(out).encode()[: 8 * 1024 * 1024]
    open(RAW, "wb").write(data)
    open(COMPRESSED, "wb").write(zlib.compress(data, 6))


def main():
    step = sys.argv[1]
    if step == "prep":
        return prep()
    raw = open(RAW, "rb").read()
    compressed = open(COMPRESSED, "rb").read()
    if step == "inflate":
        d = zlib.decompressobj()
        print(sum(len(d.decompress(compressed[i : i + 4096])) for i in range(0, len(compressed), 4096)))
    elif step == "deflate":
        level, wbits, mem = (int(a) for a in sys.argv[2:5])
        c = zlib.compressobj(level, zlib.DEFLATED, 16 + wbits, mem)
        n = sum(len(c.compress(raw[i : i + 4096])) for i in range(0, len(raw), 4096))
        print(n + len(c.flush()))


if __name__ == "__main__":
    main()

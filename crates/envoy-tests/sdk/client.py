#!/usr/bin/env python3
"""Calls of an official LLM SDK (the `openai` or `anthropic` Python package) through Envoy,
for crates/envoy-tests/tests/sdk.rs: what the SDK saw, as JSON.

usage: client.py SDK BASE_URL API_KEY MODE STEP [--output-tokens N] [--max-retries N] ...
       client.py --serve

  SDK     openai | anthropic
  MODE    json | stream
  STEP    allowed: with_raw_response, no retries: the status, headers and text;
          refused: no retries, a plain call: the error the SDK raised (class, str, body,
                   status, headers), or none;
          retried: with_raw_response and max_retries (1 by default): every attempt the SDK
                   made (when it was sent, when its answer came, its status and headers) and
                   the final one.
  --output-tokens N  sent as x-test-output-tokens: the usage the test upstream reports.
  --answer-header NAME=VALUE  sent as x-test-answer-header: one more header the upstream
                     answers with.
  --prime            first make one plain call, without retries, that must pass (so that the
                     step's call comes right after it, whatever the process took to start and
                     import the SDK).
  --calls N          exhaust: at most N plain calls (50 by default).
  --header NAME=V    one more request header.
  --authorization V  send `Authorization: V` instead of the SDK's bearer token (a client whose
                     credentials are of another scheme).
  --model NAME       the model the call names (gpt-4o-mini or claude-sonnet-4-5 by default).
  --after FILE       once the SDK is imported and its client made, write FILE.ready and wait
                     (up to 60 s) for FILE before the first call: the test starts what must be
                     in flight then, whatever the process took to start and import the SDK.

  STEP exhaust: plain calls without retries, one after another, until the SDK raises an error:
  how many passed, and the error (as for refused).

One call prints one JSON document of what the SDK saw. With --serve, the process makes one call
per line of stdin, each line a JSON array of one call's arguments (as above, e.g.
["openai", "http://127.0.0.1:10000", "sk-a", "json", "refused", "--prime"]), and answers each
with one line on stdout: {"out": DOCUMENT}, or {"exception": TEXT} (the traceback, then what the
call wrote) if the call raised, and serves the next one; it ends at the end of stdin. Each SDK
is imported once, by the first call that names it; every call makes its own SDK client (and its
own record of attempts) and closes it, as a process of its own would.
"""

import argparse
import contextlib
import io
import json
import os
import sys
import time
import traceback


def call(argv):
    """One call with the command line `argv` (without the program's name): what the SDK saw."""
    parser = argparse.ArgumentParser()
    for arg in ["sdk", "base_url", "api_key", "mode", "step"]:
        parser.add_argument(arg)
    parser.add_argument("--output-tokens")
    parser.add_argument("--max-retries", type=int, default=1)
    parser.add_argument("--prime", action="store_true")
    parser.add_argument("--answer-header")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--authorization")
    parser.add_argument("--header", action="append", default=[])
    parser.add_argument("--model")
    parser.add_argument("--after")
    args = parser.parse_args(argv)
    sdk, base_url, api_key, mode, step = (
        args.sdk,
        args.base_url,
        args.api_key,
        args.mode,
        args.step,
    )
    output_tokens = args.output_tokens
    stream = mode == "stream"
    attempts = []

    def on_request(request):
        attempts.append({"sent": time.monotonic()})

    def on_response(response):
        attempts[-1].update(
            {
                "answered": time.monotonic(),
                "status": response.status_code,
                "headers": dict(response.headers),
            }
        )

    retries = args.max_retries if step == "retried" else 0
    extra = {"x-test-output-tokens": output_tokens} if output_tokens else {}
    if args.answer_header:
        extra["x-test-answer-header"] = args.answer_header
    for h in args.header:
        name, value = h.split("=", 1)
        extra[name] = value
    defaults = {"Authorization": args.authorization} if args.authorization else None
    if sdk == "openai":
        import openai as lib

        make, lib_url = lib.OpenAI, base_url + "/v1"
    else:
        import anthropic as lib

        make, lib_url = lib.Anthropic, base_url
    with make(
        base_url=lib_url,
        api_key=api_key,
        default_headers=defaults,
        max_retries=retries,
        timeout=20,
        http_client=lib.DefaultHttpxClient(
            event_hooks={"request": [on_request], "response": [on_response]}
        ),
    ) as client:
        if sdk == "openai":
            kwargs = {
                "model": args.model or "gpt-4o-mini",
                "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 64,
                "extra_headers": extra,
            }
            if stream:
                kwargs.update(stream=True, stream_options={"include_usage": True})
            create = client.chat.completions.create
            raw_create = client.chat.completions.with_raw_response.create

            def text_of(parsed):
                if stream:
                    return "".join(
                        c.choices[0].delta.content or "" for c in parsed if c.choices
                    )
                return parsed.choices[0].message.content
        else:
            kwargs = {
                "model": args.model or "claude-sonnet-4-5",
                "max_tokens": 64,
                "messages": [{"role": "user", "content": "Say hello."}],
                "extra_headers": extra,
            }
            if stream:
                kwargs["stream"] = True
            create = client.messages.create
            raw_create = client.messages.with_raw_response.create

            def text_of(parsed):
                if stream:
                    return "".join(
                        e.delta.text
                        for e in parsed
                        if e.type == "content_block_delta" and e.delta.type == "text_delta"
                    )
                return "".join(b.text for b in parsed.content if b.type == "text")

        out = {"sdk": sdk, "version": lib.__version__}
        if args.after:
            open(args.after + ".ready", "w").close()
            waited = time.monotonic() + 60
            while not os.path.exists(args.after):
                if time.monotonic() > waited:
                    raise TimeoutError(f"{args.after} never came")
                time.sleep(0.01)
        if args.prime:
            result = client.with_options(max_retries=0)
            result = (
                result.chat.completions.create(**kwargs)
                if sdk == "openai"
                else result.messages.create(**kwargs)
            )
            text_of(result)
            del attempts[:]
        def error_of(e):
            return {
                "class": type(e).__name__,
                "rate_limit_error": isinstance(e, lib.RateLimitError),
                "authentication_error": isinstance(e, lib.AuthenticationError),
                "str": str(e),
                "message": e.message,
                "body": e.body,
                "status": e.status_code,
                "headers": dict(e.response.headers),
            }

        if step == "refused":
            try:
                result = create(**kwargs)
                if stream:
                    for _ in result:
                        pass
                out["error"] = None
            except lib.APIStatusError as e:
                out["error"] = error_of(e)
        elif step == "exhaust":
            out["passed"] = 0
            out["error"] = None
            for _ in range(args.calls):
                try:
                    result = create(**kwargs)
                    if stream:
                        for _ in result:
                            pass
                    out["passed"] += 1
                except lib.APIStatusError as e:
                    out["error"] = error_of(e)
                    break
        else:
            raw = raw_create(**kwargs)
            out["status"] = raw.status_code
            out["headers"] = dict(raw.headers)
            out["text"] = text_of(raw.parse())
        out["attempts"] = attempts
        return out


def serve():
    """One call per line of stdin, one answer per line of stdout, until the end of stdin."""
    for line in sys.stdin:
        written = io.StringIO()
        try:
            with contextlib.redirect_stdout(written), contextlib.redirect_stderr(written):
                answer = {"out": call(json.loads(line))}
        except (Exception, SystemExit):
            answer = {"exception": traceback.format_exc() + written.getvalue()}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        print(json.dumps(call(sys.argv[1:])))

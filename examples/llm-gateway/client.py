# The official OpenAI and Anthropic SDKs as clients of the gateway (examples/llm-gateway/envoy.yaml):
# bob asks gpt-4o-mini three times, then Claude once, with one API key.
# From the repository root: .venv/bin/python examples/llm-gateway/client.py
import os

import anthropic
import openai

gateway = os.environ.get("GATEWAY_URL", "http://localhost:10000")
question = [{"role": "user", "content": "How does a token bucket work?"}]
gpt = openai.OpenAI(base_url=gateway + "/v1", api_key="bob", max_retries=0)  # 0: show the refusal
for _ in range(3):
    try:
        raw = gpt.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", max_tokens=300, messages=question)
        print(f"gpt-4o-mini: {raw.parse().usage.total_tokens} tokens;",
              "requests left", raw.headers["x-ratelimit-remaining-requests"])
    except openai.RateLimitError as e:
        print("gpt-4o-mini refused:", e.status_code, e.body["message"])
claude = anthropic.Anthropic(base_url=gateway, api_key="bob", max_retries=0)
raw = claude.messages.with_raw_response.create(
    model="claude-sonnet-4-5", max_tokens=300, messages=question)
usage = raw.parse().usage
print(f"claude-sonnet-4-5: {usage.input_tokens + usage.output_tokens} tokens;",
      "requests left", raw.headers["anthropic-ratelimit-requests-remaining"])

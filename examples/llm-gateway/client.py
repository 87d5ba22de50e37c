# The official OpenAI SDK as a client of the gateway (examples/llm-gateway/envoy.yaml):
# bob asks three questions. From the repository root: .venv/bin/python examples/llm-gateway/client.py
import os

from openai import OpenAI, RateLimitError

gateway = os.environ.get("GATEWAY_URL", "http://localhost:10000")
client = OpenAI(base_url=gateway + "/v1", api_key="bob", max_retries=0)  # 0: show the refusal
question = [{"role": "user", "content": "How does a token bucket work?"}]
for _ in range(3):
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", max_tokens=300, messages=question)
        used = raw.parse().usage.total_tokens
        print(f"answered: {used} tokens;",
              "requests left", raw.headers["x-ratelimit-remaining-requests"] + ",",
              "tokens left", raw.headers["x-ratelimit-remaining-tokens"])
    except RateLimitError as e:
        print("refused:", e.status_code, e.body["message"])

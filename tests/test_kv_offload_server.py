"""KV offload through a real server restart: `serve --kv-offload-dir`, a ~2,000-token system
prompt, stop, start again, the same request: its prefix comes from the directory
(`usage.prompt_tokens_details.cached_tokens`) and the greedy answer is the cold run's."""

from __future__ import annotations

import pytest
from live_server import LiveServer

pytestmark = pytest.mark.milestone("m25")

SYSTEM_PROMPT = "You follow these rules. " + " ".join(
    f"Rule {i}: when asked about topic {i}, answer in one short sentence." for i in range(106)
)
MESSAGES = [
    {"role": "system", "content": SYSTEM_PROMPT},
    {"role": "user", "content": "What is topic 7 about?"},
]


def ask(server: LiveServer):
    with server.openai() as client:
        return client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=12, temperature=0
        )


@pytest.mark.timeout(600)
def test_a_long_system_prompt_is_loaded_after_a_restart(tmp_path):
    args = ("--kv-offload-dir", str(tmp_path), "--num-kv-blocks", "512")
    server = LiveServer.start(*args)
    try:
        cold = ask(server)
    finally:
        assert server.stop() == 0, server.log()
    assert cold.usage.prompt_tokens >= 2000
    assert not (cold.usage.prompt_tokens_details and cold.usage.prompt_tokens_details.cached_tokens)
    assert list(tmp_path.glob("*/*.kvb")), "nothing was written"

    server = LiveServer.start(*args)
    try:
        warm = ask(server)
    finally:
        server.stop()
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached >= 2000 - 16 * 2  # every full block of the system prompt and more
    assert warm.choices[0].message.content == cold.choices[0].message.content

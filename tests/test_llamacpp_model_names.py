"""Model names the llama.cpp way, through HTTP: a server started with
`--served-model-name NAME '*'` accepts any `model` (its answers report the name asked for,
the base model runs it, /v1/models still lists only its own names); without `'*'` an unknown
name stays vLLM's 404 (the shared live server)."""

from __future__ import annotations

import pytest
from live_server import LiveServer, shared_server

pytestmark = pytest.mark.milestone("m30")

MESSAGES = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def any_name_server():
    live = LiveServer.start("--served-model-name", "my-model", "*", "--num-kv-blocks", "64")
    yield live
    live.stop()


def test_any_name_is_accepted_with_the_star(any_name_server):
    with any_name_server.client() as client:
        models = client.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["my-model"]
        chat = {"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
        response = client.post("/v1/chat/completions", json=chat)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "gpt-4o"
        ours = client.post("/v1/chat/completions", json={**chat, "model": "my-model"}).json()
        answer = response.json()["choices"][0]["message"]["content"]
        assert answer == ours["choices"][0]["message"]["content"]  # the same base model
        completion = {"model": "test", "prompt": "Hello", "n_predict": 2}
        assert client.post("/completion", json=completion).json()["model"] == "test"
        messages = {"model": "claude-x", "max_tokens": 2, "messages": MESSAGES}
        assert client.post("/v1/messages", json=messages).json()["model"] == "claude-x"
        assert client.get("/v1/models/anything").status_code == 200


def test_unknown_names_are_404s_by_default():
    with shared_server().client() as client:
        chat = {"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 3}
        response = client.post("/v1/chat/completions", json=chat)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found"
        completion = client.post("/completion", json={"model": "test", "prompt": "Hi"})
        assert completion.status_code == 404

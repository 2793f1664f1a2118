"""Multi-LoRA through a live server and the official `openai` client: `--enable-lora
--lora-modules a=PATH`, `/v1/models` lists the adapter with its parent, `model="a"` gives
the greedy tokens of the base model merged with the adapter by PEFT (4 prompts x 32 tokens,
float32, one batched request), unknown adapters are 404s in the OpenAI shape, and adapters
load and unload at run time behind `--allow-runtime-lora-updating` (404 without it)."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
from live_server import LiveServer, shared_server
from lora_adapters import adapter_dir, peft_greedy
from transformers import AutoTokenizer

pytestmark = pytest.mark.milestone("m18")

BASE = "SmolLM2-135M-Instruct"
ADMIN_KEY = "lora-admin-key"
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Three reasons to learn Python:",
]


@pytest.fixture(scope="module")
def server():
    args = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    args += ["--lora-modules", f"a={adapter_dir(1)}", "--allow-runtime-lora-updating"]
    server = LiveServer.start(*args, "--num-kv-blocks", "256", admin_api_key=ADMIN_KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_models_lists_adapters_with_parent(client):
    models = {m.id: m.model_extra for m in client.models.list().data}
    assert set(models) == {BASE, "a"}
    assert models["a"]["parent"] == BASE and models["a"]["root"] == str(adapter_dir(1))
    assert models[BASE]["parent"] is None
    assert client.models.retrieve("a").model_extra["parent"] == BASE


@pytest.mark.slow
def test_adapter_through_server_matches_peft(client):
    from nanollmserve.model import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    result = client.completions.create(model="a", prompt=ids, max_tokens=32, temperature=0)
    texts = [c.text for c in sorted(result.choices, key=lambda c: c.index)]
    reference = peft_greedy(adapter_dir(1), ids, 32)
    assert texts == [tokenizer.decode(r, skip_special_tokens=True) for r in reference]
    base = client.completions.create(model=BASE, prompt=ids, max_tokens=32, temperature=0)
    assert [c.text for c in sorted(base.choices, key=lambda c: c.index)] != texts


def test_unknown_adapter_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_load_use_and_unload_at_run_time(server, client):
    with server.client() as http:  # admin routes (m27): the API key does not load adapters
        refused = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapter_dir(2))}
        )
        assert refused.status_code == 401, refused.text
    with server.admin_client() as http:
        loaded = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapter_dir(2))}
        )
        assert loaded.status_code == 200, loaded.text
        chat = client.chat.completions.create(
            model="b", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
        assert chat.model == "b" and chat.choices[0].message.content
        again = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapter_dir(2))}
        )
        assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
        too_big = http.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "big", "lora_path": str(adapter_dir(1, rank=16))},
        )
        assert too_big.status_code == 400
        assert too_big.json()["error"]["param"] == "lora_path"
        assert "--max-lora-rank 8" in too_big.json()["error"]["message"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b", prompt="Hi", max_tokens=2)
    assert {m.id for m in client.models.list().data} == {BASE, "a"}


def test_runtime_updating_is_off_by_default():
    server = shared_server()  # started without --allow-runtime-lora-updating
    with server.client() as http:
        response = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapter_dir(1))}
        )
    assert response.status_code == 404
    assert "--allow-runtime-lora-updating" in response.json()["error"]["message"]


def test_lora_flags_need_enable_lora():
    result = subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", "serve", "--lora-modules", "a=/x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "--lora-modules needs --enable-lora" in result.stderr

"""llama.cpp's `GET /props`, `GET /slots`, slot actions refused without --slot-save-path,
`POST /apply-template` and `POST /infill` through HTTP: on the shared live server (the
bundled SmolLM2, which has no fill-in-the-middle tokens: /infill is a 400 saying so) and on
a tiny random model whose tokenizer has them (/infill runs the FIM prompt)."""

from __future__ import annotations

import pytest
import torch
from live_server import LiveServer, shared_server
from transformers import AddedToken, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from nanollmserve.model import resolve_model

pytestmark = pytest.mark.milestone("m30")

FIM = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as client:
        yield client


def test_props_reports_the_defaults_slots_template_and_the_served_name(client):
    props = client.get("/props").json()
    settings = props["default_generation_settings"]
    assert settings["params"]["temperature"] == 0.8 and settings["params"]["top_k"] == 40
    assert settings["n_ctx"] == client.get("/v1/models").json()["data"][0]["max_model_len"]
    assert props["total_slots"] == len(client.get("/slots").json()) >= 1
    assert props["model_path"] == client.get("/v1/models").json()["data"][0]["id"]
    assert "/" not in props["model_path"]  # a name, never the model's directory
    assert "<|im_start|>" in props["chat_template"]
    assert props["modalities"]["vision"] is False and props["is_sleeping"] is False
    assert props["build_info"].startswith("nanollmserve-")


def test_props_and_slots_need_the_api_key(server):
    for path in ("/props", "/slots"):
        assert (
            server.client().get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        )


def test_slots_show_no_prompts_and_idle_when_idle(server, client):
    server.wait_idle()
    slots = client.get("/slots").json()
    assert [s["id"] for s in slots] == list(range(len(slots)))
    assert not any(s["is_processing"] for s in slots)
    assert all("prompt" not in s and "prompt" not in s["params"] for s in slots)
    assert client.get("/slots", params={"fail_on_no_slot": 1}).status_code == 200


@pytest.mark.parametrize("action", ["save", "restore", "erase"])
def test_slot_actions_without_slot_save_path_are_refused_naming_the_flag(client, action):
    """As llama.cpp's server: no --slot-save-path, no slot actions (tests/test_llamacpp_slots.py
    runs them with it)."""
    response = client.post("/slots/0", params={"action": action}, json={"filename": "a.bin"})
    assert response.status_code == 501
    error = response.json()["error"]
    assert f"slot {action} is off" in error["message"] and "--slot-save-path" in error["message"]


def test_bad_slot_requests_are_400s(client):
    assert client.post("/slots/0", params={"action": "dump"}).status_code == 400
    assert client.post("/slots/0").status_code == 400
    response = client.post("/slots/100000", params={"action": "save"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "id_slot"


def test_apply_template_renders_what_chat_runs(client):
    prompt = client.post("/apply-template", json={"messages": MESSAGES}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and "Name a colour." in prompt
    chat_ids = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    text_ids = client.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert text_ids == chat_ids
    assert client.post("/apply-template", json={"messages": []}).status_code == 400


def test_infill_without_fim_tokens_is_a_400_that_says_why(client):
    response = client.post("/infill", json={"input_prefix": "def f(", "input_suffix": "):"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "fill-in-the-middle" in error["message"] and "<fim_prefix>" in error["message"]


def make_fim_model(out_dir):
    """The bundled tokenizer plus StarCoder's three FIM tokens, random tiny Llama weights."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in FIM])
    tokenizer.save_pretrained(out_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory):
    live = LiveServer.start(str(make_fim_model(tmp_path_factory.mktemp("fim"))),
                            "--num-kv-blocks", "64")  # fmt: skip
    yield live
    live.stop()


def test_infill_runs_the_fim_prompt_on_a_model_with_fim_tokens(fim_server):
    with fim_server.client() as client:
        body = {
            "input_prefix": "def add(a, b):\n    return ",
            "input_suffix": "\n",
            "input_extra": [{"filename": "util.py", "text": "x = 1"}],
            "n_predict": 3,
            "temperature": 0,
            "return_tokens": True,
        }
        result = client.post("/infill", json=body)
        assert result.status_code == 200, result.text
        result = result.json()
        expected = (
            "util.py\nx = 1\n<fim_prefix>def add(a, b):\n    return <fim_suffix>\n<fim_middle>"
        )
        ids = client.post("/tokenize", json={"prompt": expected}).json()["tokens"]
        fim_ids = client.post("/tokenize", json={"prompt": "".join(FIM)}).json()["tokens"]
        assert len(fim_ids) == 3 and set(fim_ids) <= set(ids)  # each FIM token is one token
        assert result["tokens_evaluated"] == len(ids)
        assert result["prompt"] == expected
        assert result["tokens_predicted"] == len(result["tokens"]) == 3


def test_tokenize_and_detokenize_take_llamacpps_shapes_too(client):
    text = "What is the capital of France?"
    vllm = client.post("/tokenize", json={"prompt": text}).json()
    native = client.post("/tokenize", json={"content": text})
    assert native.status_code == 200 and native.json() == {"tokens": vllm["tokens"]}
    detok = client.post("/detokenize", json={"tokens": vllm["tokens"]}).json()
    assert detok["content"] == detok["prompt"] == text
    pieces = client.post("/tokenize", json={"content": text, "with_pieces": True}).json()
    assert [p["id"] for p in pieces["tokens"]] == vllm["tokens"]
    assert "".join(p["piece"] for p in pieces["tokens"]) == text
    both = client.post("/tokenize", json={"content": text, "prompt": text})
    assert both.status_code == 400
    assert client.post("/tokenize", json={"prompt": text, "with_pieces": True}).status_code == 400
    assert client.post("/tokenize", json={"content": text, "add_special": True}).status_code == 400

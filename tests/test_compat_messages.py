"""The Anthropic Messages API (and `--reasoning-parser`) with the other features, for the
compatibility matrix (scripts/compat_matrix.py), through the real `anthropic` SDK:

- the scripted Qwen3 checkpoint of `reasoning_model.py` with ngram speculative decoding and
  a LoRA adapter (small random deltas on o_proj and down_proj: the script survives, the
  logits move): a message runs with accepted drafts; naming the adapter gives the same
  thinking and answer while its prompt logprobs differ from the base model's; token-level
  fields are refused on `/v1/messages` (Anthropic's shape has no place for them);
- the bundled model on its GGUF blocks: a message is the chat completion of the same
  conversation, and a thinking block the prompt opens comes back as `reasoning_content`.
"""

from __future__ import annotations

import anthropic
import httpx
import pytest
import torch
from compat_stack import SPEC_NGRAM
from live_server import LiveServer
from lora_adapters import make_adapter
from reasoning_model import ANSWER, SCRIPT, THINKING, make_reasoning_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

pytestmark = [pytest.mark.milestone("m23"), pytest.mark.timeout(400)]

BLOCKS = [("thinking", THINKING), ("text", ANSWER)]
ADAPTER = "think-lora"


def _client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _blocks(message) -> list[tuple[str, str]]:
    return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def _small_adapter(model_dir, out_dir):
    """A random LoRA of the scripted model whose deltas are scaled down: they move the
    logits without overturning the script's margins."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    make_adapter(out_dir, seed=3, rank=4, targets=["o_proj", "down_proj"], base=base)
    weights = out_dir / "adapter_model.safetensors"
    tensors = load_file(weights)
    save_file({k: v * 0.05 if "lora_B" in k else v for k, v in tensors.items()}, weights)
    return out_dir


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_reasoning_model(tmp_path_factory.mktemp("qwen3-reasoning"))
    adapter = _small_adapter(model_dir, tmp_path_factory.mktemp("qwen3-lora"))
    live = LiveServer.start(
        str(model_dir), "--num-kv-blocks", "64", "--reasoning-parser", "qwen3",
        "--speculative-config", SPEC_NGRAM,
        "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{ADAPTER}={adapter}",
    )  # fmt: skip
    yield live
    live.stop()


def test_a_message_runs_with_accepted_drafts(server):
    # the script is in the prompt, so the ngram drafts follow it
    message = _client(server).messages.create(
        model="", max_tokens=40, messages=[{"role": "user", "content": SCRIPT}],
        extra_body={"temperature": 0},
    )  # fmt: skip
    assert _blocks(message) == BLOCKS
    assert server.stats()["spec_decode"]["num_accepted_tokens"] > 0


def test_naming_the_adapter_runs_it_under_the_messages_api_and_the_parser(server):
    kwargs = dict(max_tokens=40, messages=[{"role": "user", "content": "Is it ok?"}])
    message = _client(server).messages.create(
        model=ADAPTER, **kwargs, extra_body={"temperature": 0}
    )
    assert _blocks(message) == BLOCKS and message.model == ADAPTER
    chat = _post(server, "/v1/chat/completions", {"model": ADAPTER, "temperature": 0, **kwargs})
    chat_message = chat.json()["choices"][0]["message"]
    assert (chat_message["reasoning_content"], chat_message["content"]) == (THINKING, ANSWER)

    def prompt_logprobs(model: str) -> list[float]:
        body = {"model": model, "prompt": "Is it ok?\n", "max_tokens": 1, "prompt_logprobs": 0}
        reply = _post(server, "/v1/completions", body).json()
        positions = reply["choices"][0]["prompt_logprobs"]
        return [next(iter(p.values()))["logprob"] for p in positions[1:]]

    assert prompt_logprobs(ADAPTER) != pytest.approx(prompt_logprobs(""), rel=1e-4, abs=1e-4)


@pytest.mark.parametrize(
    ("field", "value"),
    [("return_token_ids", True), ("prompt_logprobs", 1), ("logprobs", True), ("echo", True)],
    ids=["return_token_ids", "prompt_logprobs", "logprobs", "echo"],
)
def test_token_level_fields_are_refused_on_messages(server, field, value):
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], field: value}
    reply = _post(server, "/v1/messages", body)
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert f"Unrecognized request argument supplied: {field}" in error["error"]["message"]
    assert server.process.poll() is None


@pytest.mark.parametrize(
    "priority",
    [1, 1.5, "1", True, 2**31, -(2**31) - 1, [1]],
    ids=["nonzero-on-fcfs", "float", "string", "bool", "past-int32", "below-int32", "list"],
)
def test_priority_on_messages_is_checked_as_on_chat(server, priority):
    """This server schedules fcfs: a non-zero priority is refused as chat refuses it, and a
    value that is not an int32 is a 400 naming `priority`."""
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    reply = _post(server, "/v1/messages", {**body, "priority": priority})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert "priority" in reply.json()["error"]["message"]
    assert _post(server, "/v1/messages", {**body, "priority": 0}).status_code == 200


# -- GGUF blocks -------------------------------------------------------------------------------
HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]
OPENED = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "<think>"}]


@pytest.fixture(scope="module")
def gguf_server():
    live = LiveServer.start(
        "--dtype", "auto", "--num-kv-blocks", "128", "--reasoning-parser", "qwen3"
    )
    yield live
    live.stop()


def test_gguf_blocks_answer_a_message_as_chat(gguf_server):
    assert "quantization=gguf" in gguf_server.log()
    message = _client(gguf_server).messages.create(
        model="", max_tokens=12, messages=HELLO, extra_body={"temperature": 0}
    )
    chat = _post(
        gguf_server,
        "/v1/chat/completions",
        {"messages": HELLO, "max_tokens": 12, "temperature": 0},
    ).json()
    assert _blocks(message) == [("text", chat["choices"][0]["message"]["content"])]
    assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_gguf_blocks_thinking_the_prompt_opens_is_reasoning_content(gguf_server):
    chat = _post(
        gguf_server,
        "/v1/chat/completions",
        {"messages": OPENED, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
         "continue_final_message": True, "add_generation_prompt": False},
    ).json()  # fmt: skip
    raw = _post(
        gguf_server,
        "/v1/completions",
        {"prompt": chat["prompt_token_ids"], "max_tokens": 8, "temperature": 0},
    ).json()["choices"][0]["text"]  # the same prompt, its text unparsed
    message = chat["choices"][0]["message"]
    thinking, _, answer = raw.partition("</think>")
    assert thinking and message["reasoning_content"] == thinking
    assert (message["content"] or "") == answer

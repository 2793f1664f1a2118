"""The Anthropic Messages API (and `--reasoning-parser`) with the other features, for the
compatibility matrix (scripts/compat_matrix.py), through the real `anthropic` SDK:

- the scripted Qwen3 checkpoint of `reasoning_model.py` with ngram speculative decoding and
  a LoRA adapter made to change the answer only (`_answer_cutting_adapter`: the thinking
  stays the script's, the answer loses its last token): a message runs with accepted drafts;
  naming the adapter gives the script's thinking block and the adapter's answer, which
  differs from the base model's and is PEFT's greedy output; token-level fields are refused
  on `/v1/messages` (Anthropic's shape has no place for them); llama.cpp's `/completion` on
  the same server runs with drafts and the adapter too, its text unsplit (a prompt, as on
  /v1/completions: the parser splits chats and messages);
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
from lora_adapters import _peft_greedy, make_adapter
from reasoning_model import ANSWER, SCRIPT, THINKING, make_reasoning_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

pytestmark = [pytest.mark.milestone("m23"), pytest.mark.timeout(400), pytest.mark.slow]

BLOCKS = [("thinking", THINKING), ("text", ANSWER)]
ADAPTER = "think-lora"
CUT_ANSWER = ANSWER[: -len("}")]
"""The adapter's answer: the script's without its last token."""


def _client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _blocks(message) -> list[tuple[str, str]]:
    return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def _answer_cutting_adapter(model_dir, out_dir):
    """A rank-1 LoRA of the scripted model on the last layer's down_proj that changes the
    answer and nothing else. The model is a bigram table (attention and MLP outputs zero), so
    down_proj's input at a position depends on that position's token alone: lora_A is
    orthogonal to that input for every token the script writes or ends its prompt with, but
    the answer's second-to-last one (` true`), where lora_B adds the embedding of the answer's
    last token (`}`), whose successor is `<|im_end|>`: the answer ends one token early."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    load = lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # noqa: E731
    make_adapter(out_dir, seed=3, rank=1, targets=["down_proj"], base=load())
    base = load()
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    answer = encode(ANSWER)
    kept = [*encode("\n"), *encode(SCRIPT), tokenizer.convert_tokens_to_ids("<|im_end|>")]
    kept = [t for t in kept if t != answer[-2]]
    layers = base.model.layers
    inputs = []
    hook = layers[-1].mlp.down_proj.register_forward_pre_hook(
        lambda module, args: inputs.append(args[0][0].detach())
    )
    with torch.no_grad():
        base(torch.tensor([[answer[-2], *kept]]))
    hook.remove()
    target, others = inputs[0][0], inputs[0][1:]
    basis = torch.linalg.qr(others.T).Q  # the span of the other tokens' down_proj inputs
    a = target - basis @ (basis.T @ target)
    a = a / (a @ target)  # a . x = 1 at ` true`, 0 at every other token of the script
    embed = base.model.embed_tokens.weight.detach()
    scaling = 2.0  # make_adapter's lora_alpha / r
    weights = out_dir / "adapter_model.safetensors"
    tensors = load_file(weights)
    last = f"layers.{len(layers) - 1}.mlp"
    for key in tensors:
        if "lora_A" in key:
            tensors[key] = a[None, :].clone() if last in key else torch.zeros_like(tensors[key])
        elif "lora_B" in key:
            delta = 3.0 * embed[answer[-1]][:, None] / scaling
            tensors[key] = delta.clone() if last in key else torch.zeros_like(tensors[key])
    save_file(tensors, weights)
    return out_dir


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_reasoning_model(tmp_path_factory.mktemp("qwen3-reasoning"))
    adapter = _answer_cutting_adapter(model_dir, tmp_path_factory.mktemp("qwen3-lora"))
    live = LiveServer.start(
        str(model_dir), "--num-kv-blocks", "64", "--reasoning-parser", "qwen3",
        "--speculative-config", SPEC_NGRAM,
        "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{ADAPTER}={adapter}",
    )  # fmt: skip
    live.model_dir, live.adapter = model_dir, adapter
    yield live
    live.stop()


def test_a_message_runs_with_accepted_drafts(server, compat):
    # the script is in the prompt, so the ngram drafts follow it
    drafts = server.stats()["spec_decode"]["num_drafts"]
    message = _client(server).messages.create(
        model="", max_tokens=40, messages=[{"role": "user", "content": SCRIPT}],
        extra_body={"temperature": 0},
    )  # fmt: skip
    assert _blocks(message) == BLOCKS
    assert server.stats()["spec_decode"]["num_accepted_tokens"] > 0
    compat.exercised("spec", num_drafts=server.stats()["spec_decode"]["num_drafts"] - drafts)
    compat.exercised("messages", message=message)
    compat.exercised("reasoning", reasoning_content=message.content[0].thinking)
    # llama.cpp's /completion on the same server: the message's prompt, the same drafts.
    chat = [{"role": "user", "content": SCRIPT}]
    prompt = _post(server, "/apply-template", {"messages": chat}).json()["prompt"]
    drafts = server.stats()["spec_decode"]["num_drafts"]
    native = _post(server, "/completion", {"prompt": prompt, "n_predict": 40, "temperature": 0})
    assert native.status_code == 200, native.text
    assert native.json()["content"] == SCRIPT  # a prompt's text: not split by the parser
    assert native.json()["tokens_evaluated"] == message.usage.input_tokens
    compat.exercised("spec", num_drafts=server.stats()["spec_decode"]["num_drafts"] - drafts)
    compat.exercised("llamacpp", completion=native.json())


def test_naming_the_adapter_runs_it_under_the_messages_api_and_the_parser(server, compat):
    kwargs = dict(max_tokens=40, messages=[{"role": "user", "content": "Is it ok?"}])
    client = _client(server)
    message = client.messages.create(model=ADAPTER, **kwargs, extra_body={"temperature": 0})
    base = client.messages.create(model="", **kwargs, extra_body={"temperature": 0})
    assert _blocks(base) == BLOCKS
    # The adapter's answer, its thinking split off by the parser; not the base model's.
    assert _blocks(message) == [("thinking", THINKING), ("text", CUT_ANSWER)]
    compat.exercised("lora", output=_blocks(message), base=_blocks(base))
    compat.exercised("messages", message=message)
    compat.exercised("reasoning", reasoning_content=message.content[0].thinking)
    # The same conversation as a chat completion: the same split, and PEFT's greedy tokens.
    body = {"model": ADAPTER, "temperature": 0, "return_token_ids": True, **kwargs}
    chat = _post(server, "/v1/chat/completions", body).json()
    chat_message = chat["choices"][0]["message"]
    assert (chat_message["reasoning_content"], chat_message["content"]) == (THINKING, CUT_ANSWER)
    peft_base = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32)
    [reference] = _peft_greedy(server.adapter, [chat["prompt_token_ids"]], 40, base=peft_base)
    assert chat["choices"][0]["token_ids"] == reference[: len(chat["choices"][0]["token_ids"])]
    assert len(reference) - len(chat["choices"][0]["token_ids"]) <= 1  # the stop token
    # llama.cpp's /completion names the adapter with `model` too: the chat's prompt ids give
    # the chat's tokens (unsplit text); without `model`, the base model's.
    native = {"prompt": chat["prompt_token_ids"], "n_predict": 40, "temperature": 0}
    native["return_tokens"] = True
    adapted = _post(server, "/completion", {**native, "model": ADAPTER}).json()
    plain = _post(server, "/completion", native).json()
    assert adapted["tokens"] == chat["choices"][0]["token_ids"]
    assert adapted["content"] == f"<think>{THINKING}</think>{CUT_ANSWER}"
    assert plain["content"] == f"<think>{THINKING}</think>{ANSWER}"
    compat.exercised("lora", output=adapted["content"], base=plain["content"])
    compat.exercised("llamacpp", completion=adapted)


@pytest.mark.parametrize(
    ("field", "value"),
    [("return_token_ids", True), ("prompt_logprobs", 1), ("logprobs", True), ("echo", True)],
    ids=["return_token_ids", "prompt_logprobs", "logprobs", "echo"],
)
def test_token_level_fields_are_refused_on_messages(server, field, value, compat):
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], field: value}
    reply = _post(server, "/v1/messages", body)
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert f"Unrecognized request argument supplied: {field}" in error["error"]["message"]
    assert server.process.poll() is None
    compat.refused("messages", "tokenio", error["error"]["message"])


@pytest.mark.parametrize(
    "priority",
    [1, 1.5, "1", True, 2**31, -(2**31) - 1, [1]],
    ids=["nonzero-on-fcfs", "float", "string", "bool", "past-int32", "below-int32", "list"],
)
def test_priority_on_messages_is_checked_as_on_chat(server, priority, compat):
    """This server schedules fcfs: a non-zero priority is refused as chat refuses it, and a
    value that is not an int32 is a 400 naming `priority`."""
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    reply = _post(server, "/v1/messages", {**body, "priority": priority})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert "priority" in reply.json()["error"]["message"]
    compat.exercised("messages", message=reply.json())
    compat.exercised("priority", refused=reply.json()["error"]["message"])
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


def test_gguf_blocks_answer_a_message_as_chat(gguf_server, compat):
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
    compat.exercised("gguf", quantization=compat.quantization_in_log(gguf_server.log()))
    compat.exercised("messages", message=message)


def test_gguf_blocks_thinking_the_prompt_opens_is_reasoning_content(gguf_server, compat):
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
    compat.exercised("gguf", quantization=compat.quantization_in_log(gguf_server.log()))
    compat.exercised("reasoning", reasoning_content=message["reasoning_content"])

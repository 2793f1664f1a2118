"""Anthropic's Messages API (m23) through a live server with the real `anthropic` SDK: the
bundled SmolLM2 served with the tool chat template and `--enable-auto-tool-choice
--tool-call-parser hermes`, as the tool-calling tests serve it.

A message is the chat completion of the same conversation (same text, same prompt tokens,
which count_tokens and /tokenize agree on); streaming sends Anthropic's event sequence and
adds up to the non-streamed message; stop reasons map (end_turn, max_tokens,
stop_sequence with the string, tool_use); a forced tool (`tool_choice` tool / any) gives a
`tool_use` block whose input follows the schema, streamed as input_json_delta; an `auto`
call is the one chat parses; `tool_result` turns render as chat's `tool` messages. Errors
come in Anthropic's shape with the right status and name the field; `x-api-key` is
accepted; the router forwards both routes; `bench serve --endpoint messages` measures them;
with `--reasoning-parser` the thinking is a `thinking` block (the scripted Qwen3 model), and
an assistant's earlier `thinking` blocks are its chat message's `reasoning_content`, which the
Qwen3 template renders (`redacted_thinking` is left out).
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from bench_cli import run_bench
from cluster_process import ClusterProcess
from live_server import API_KEY, LiveServer, free_port

pytestmark = [pytest.mark.milestone("m23"), pytest.mark.timeout(300)]

TEMPLATE = "examples/tool_chat_template_smollm2.jinja"
MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0}  # the SDK has no temperature argument any more: extra_body
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": WEATHER_SCHEMA,
}
TIME = {
    "name": "get_time",
    "description": "Get the current time in a timezone",
    "input_schema": {
        "type": "object",
        "properties": {"timezone": {"type": "string", "maxLength": 20}},
        "required": ["timezone"],
    },
}
HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def server():
    from pathlib import Path

    template = Path(__file__).resolve().parent.parent / TEMPLATE
    server = LiveServer.start(
        "--num-kv-blocks", "256", "--chat-template", str(template),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        api_key=API_KEY,
    )  # fmt: skip
    yield server
    server.stop()


def _client(url: str, key: str = API_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server):
    return _client(server.url)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _post(server, body, path="/v1/messages", headers=None) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    headers = headers or {"x-api-key": API_KEY, "content-type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=120)


def test_a_message_is_the_chat_completion_of_the_same_conversation(server, client):
    system = "You are a poet."
    message = client.messages.create(
        model=MODEL, max_tokens=24, system=system, messages=HELLO, extra_body=GREEDY
    )
    chat = server.openai().chat.completions.create(
        model=MODEL,
        max_tokens=24,
        temperature=0,
        messages=[{"role": "system", "content": system}, *HELLO],
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == MODEL
    assert [b.type for b in message.content] == ["text"]
    assert _text(message) == chat.choices[0].message.content
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    expected = {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert message.stop_reason == expected and message.stop_sequence is None
    # System as text blocks renders the same prompt.
    blocks = [{"type": "text", "text": "You are "}, {"type": "text", "text": "a poet."}]
    again = client.messages.create(
        model=MODEL, max_tokens=24, system=blocks, messages=HELLO, extra_body=GREEDY
    )
    assert _text(again) == _text(message)
    assert again.usage.input_tokens == message.usage.input_tokens


def test_count_tokens_is_the_chat_templates_prompt_count(server, client):
    system = "Be brief."
    count = client.messages.count_tokens(model=MODEL, system=system, messages=HELLO)
    tokenized = server.client().post(
        "/tokenize", json={"messages": [{"role": "system", "content": system}, *HELLO]}
    )
    assert count.input_tokens == tokenized.json()["count"] > 0
    message = client.messages.create(
        model=MODEL, max_tokens=2, system=system, messages=HELLO, extra_body=GREEDY
    )
    assert message.usage.input_tokens == count.input_tokens
    # With tools, the rendered tools count too, as /v1/messages runs them.
    with_tools = client.messages.count_tokens(
        model=MODEL, system=system, messages=HELLO, tools=[WEATHER]
    )
    forced = client.messages.create(
        model=MODEL, max_tokens=40, system=system, messages=HELLO, tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY,
    )  # fmt: skip
    assert with_tools.input_tokens == forced.usage.input_tokens > count.input_tokens


def test_streaming_sends_anthropics_event_sequence(server, client):
    kwargs = dict(model=MODEL, max_tokens=20, messages=HELLO, extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = [event.type for event in stream if not event.type.startswith("text")]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[1] == "content_block_start"
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}
    assert _text(final) == _text(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    # On the wire: each `event:` line names the type its `data:` carries.
    body = {**kwargs.pop("extra_body"), **kwargs, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY}
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    payloads = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert all(line.startswith("event: ") for line in lines[0::2])
    assert names == [p["type"] for p in payloads]
    start = payloads[0]["message"]
    assert start["usage"]["input_tokens"] == whole.usage.input_tokens
    assert start["content"] == [] and start["stop_reason"] is None


def test_max_tokens_and_stop_sequence_stop_reasons(client):
    cut = client.messages.create(
        model=MODEL, max_tokens=3, messages=HELLO, extra_body={**GREEDY, "ignore_eos": True}
    )
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    text = _text(
        client.messages.create(model=MODEL, max_tokens=24, messages=HELLO, extra_body=GREEDY)
    )
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    for streamed in (False, True):
        kwargs = dict(
            model=MODEL, max_tokens=24, messages=HELLO, stop_sequences=["@@never@@", stop],
            extra_body=GREEDY,
        )  # fmt: skip
        if streamed:
            with client.messages.stream(**kwargs) as stream:
                message = stream.get_final_message()
        else:
            message = client.messages.create(**kwargs)
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
        assert _text(message) == text[: text.index(stop)]


def _validated_input(block) -> dict:
    assert block.type == "tool_use" and block.name == "get_weather" and block.id
    jsonschema.validate(block.input, WEATHER_SCHEMA)
    return block.input


def test_a_forced_tool_gives_a_tool_use_block(client, compat):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any"}):
        kwargs = dict(
            model=MODEL, max_tokens=60, messages=question, tools=[WEATHER],
            tool_choice={**choice, "disable_parallel_tool_use": True}, extra_body=GREEDY,
        )  # fmt: skip
        message = client.messages.create(**kwargs)
        [block] = message.content
        arguments = _validated_input(block)
        assert message.stop_reason == "tool_use"
        compat.exercised("messages", message=message)
        compat.exercised("structured", output=block.input, schema=WEATHER_SCHEMA)
        with client.messages.stream(**kwargs) as stream:
            partial = [
                e.delta.partial_json
                for e in stream
                if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
            ]
            final = stream.get_final_message()
        [streamed] = final.content
        assert json.loads("".join(partial)) == _validated_input(streamed) == arguments
        assert final.stop_reason == "tool_use"


def test_tool_choice_none_renders_no_tools_and_answers_text(client):
    message = client.messages.create(
        model=MODEL, max_tokens=12, messages=HELLO, tools=[WEATHER],
        tool_choice={"type": "none"}, extra_body=GREEDY,
    )  # fmt: skip
    plain = client.messages.create(model=MODEL, max_tokens=12, messages=HELLO, extra_body=GREEDY)
    assert [b.type for b in message.content] == ["text"]
    assert _text(message) == _text(plain)
    assert message.usage.input_tokens == plain.usage.input_tokens


# One earlier turn shows the model the call format (as the chat tool tests do).
CHAT_ONE_SHOT = [
    {"role": "user", "content": "What is the weather in London?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": json.dumps({"city": "London", "unit": "celsius"}),
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees, rain"},
    {"role": "user", "content": "What is the weather in Paris?"},
]
ONE_SHOT = [
    {"role": "user", "content": "What is the weather in London?"},
    {
        "role": "assistant",
        "content": [
            {
                "type": "tool_use",
                "id": "call_1",
                "name": "get_weather",
                "input": {"city": "London", "unit": "celsius"},
            }
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "call_1", "content": "12 degrees, rain"},
            {"type": "text", "text": "What is the weather in Paris?"},
        ],
    },
]


def test_tool_use_and_tool_result_turns_run_as_chats_tool_calls(server, client):
    chat = server.openai().chat.completions.create(
        model=MODEL, messages=CHAT_ONE_SHOT, max_tokens=40, temperature=0,
        tools=[{"type": "function", "function": {
            "name": w["name"], "description": w["description"], "parameters": w["input_schema"]
        }} for w in (WEATHER, TIME)],
    )  # fmt: skip
    message = client.messages.create(
        model=MODEL, max_tokens=40, messages=ONE_SHOT, tools=[WEATHER, TIME], extra_body=GREEDY
    )
    [choice] = chat.choices
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    calls = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    expected = [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []
    ]
    assert calls == expected
    assert _text(message) == (choice.message.content or "")
    mapped = {"tool_calls": "tool_use", "stop": "end_turn", "length": "max_tokens"}
    assert message.stop_reason == mapped[choice.finish_reason]


def test_a_wrong_key_is_an_authentication_error_and_x_api_key_works_everywhere(server):
    with pytest.raises(anthropic.AuthenticationError) as caught:
        _client(server.url, "wrong-key").messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "authentication_error"
    # The OpenAI routes take the x-api-key header too, and keep their own error shape.
    models = httpx.get(f"{server.url}/v1/models", headers={"x-api-key": API_KEY}, timeout=30)
    assert models.status_code == 200
    refused = httpx.get(f"{server.url}/v1/models", headers={"x-api-key": "nope"}, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def _assistant(*blocks) -> dict:
    return {"role": "assistant", "content": list(blocks)}


def _hostile_bodies() -> list:
    ok = {"model": MODEL, "max_tokens": 4, "messages": HELLO}
    many_blocks = [{"type": "text", "text": "x"}] * 1100
    thinking = {"type": "thinking", "signature": "s"}
    return [
        (
            "temperature",
            '{"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], '
            '"temperature": NaN}',
        ),
        (
            "temperature",
            '{"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], '
            '"temperature": Infinity}',
        ),
        ("temperature", {**ok, "temperature": -1}),
        ("temperature", {**ok, "temperature": "hot"}),
        ("top_p", {**ok, "top_p": -0.5}),
        ("top_k", {**ok, "top_k": -5}),
        ("max_tokens", {k: v for k, v in ok.items() if k != "max_tokens"}),
        ("max_tokens", {**ok, "max_tokens": 0}),
        ("max_tokens", {**ok, "max_tokens": -1}),
        ("max_tokens", {**ok, "max_tokens": 10**30}),
        ("max_tokens", {**ok, "max_tokens": 1_000_000}),  # more than the context leaves
        ("max_tokens", {**ok, "max_tokens": "4"}),
        ("max_tokens", {**ok, "max_tokens": 2.5}),
        ("messages", {**ok, "messages": "hi"}),
        ("messages", {**ok, "messages": []}),
        ("messages", {**ok, "messages": [{"role": "user", "content": many_blocks}]}),
        ("messages", {**ok, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
        ("system", {**ok, "system": 5}),
        ("messages", {**ok, "messages": [*HELLO, _assistant({**thinking, "thinking": 5})]}),
        ("messages", {**ok, "messages": [*HELLO, _assistant({**thinking, "thinking": ["a"]})]}),
        ("messages", {**ok, "system": "x " * 5000}),  # the rendered prompt outgrows the context
        ("stop_sequences", {**ok, "stop_sequences": [1]}),
        ("stop_sequences", {**ok, "stop_sequences": ["a"] * 17}),
        ("stop_sequences", {**ok, "stop_sequences": ["a" * 257]}),
        ("tools", {**ok, "tools": [{**WEATHER, "name": f"t{i}"} for i in range(129)]}),
        ("tools", {**ok, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
        ("tool_choice", {**ok, "tool_choice": {"type": "tool", "name": "get_weather"}}),
        ("tool_choice", {**ok, "tool_choice": {"type": "sometimes"}}),
        ("metadata.user_id", {**ok, "metadata": {"user_id": "u" * 300}}),
        ("min_tokens", {**ok, "min_tokens": -3}),
        ("frequency_penalty", {**ok, "frequency_penalty": 1.0}),  # a chat field, not Anthropic's
    ]


@pytest.mark.parametrize(("param", "body"), _hostile_bodies())
def test_hostile_values_are_400s_in_anthropics_shape(server, param, body):
    response = _post(server, body)
    assert response.status_code == 400, response.text
    answer = response.json()
    assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}
    assert answer["error"]["type"] == "invalid_request_error"
    assert param.split(".")[0] in answer["error"]["message"], answer
    assert server.process.poll() is None
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_other_errors_keep_their_status_in_anthropics_shape(server, client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", max_tokens=2, messages=HELLO)
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=MODEL, messages=[])
    broken = _post(server, "{not json")
    assert broken.status_code == 400 and broken.json()["type"] == "error"
    # Without the /v1 prefix too, as every route.
    ok = _post(server, {"max_tokens": 2, "messages": HELLO, **GREEDY}, path="/messages")
    assert ok.status_code == 200 and ok.json()["type"] == "message"


@pytest.fixture(scope="module")
def router(server):
    port = free_port()
    router = ClusterProcess.start(
        "router", port, "--port", str(port), "--worker", server.url, "--health-interval", "0.5",
        api_key=API_KEY, num_workers=1,
    )  # fmt: skip
    yield router
    router.stop()


def test_the_router_forwards_both_routes(router, client, compat):
    through = _client(router.url)
    kwargs = dict(model=MODEL, max_tokens=12, messages=HELLO, extra_body=GREEDY)
    direct = client.messages.create(**kwargs)
    routed = through.messages.create(**kwargs)
    assert _text(routed) == _text(direct)
    compat.exercised("messages", message=routed)
    compat.exercised("router", routed=router.stats()["workers"][0]["num_routed"])
    with through.messages.stream(**kwargs) as stream:
        assert _text(stream.get_final_message()) == _text(direct)
    counted = through.messages.count_tokens(model=MODEL, messages=HELLO)
    assert counted.input_tokens == direct.usage.input_tokens
    with pytest.raises(anthropic.AuthenticationError) as caught:
        _client(router.url, "wrong-key").messages.create(**kwargs)
    assert caught.value.body["error"]["type"] == "authentication_error"


def test_bench_serve_measures_the_messages_endpoint(server):
    result = run_bench(
        "serve", "--base-url", server.url, "--endpoint", "messages", "--api-key", API_KEY,
        "--num-prompts", "4", "--max-concurrency", "2", "--input-len", "8-16",
        "--output-len", "6", "--ignore-eos",
    )  # fmt: skip
    assert result["endpoint"] == "messages"
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["token_count_source"] == "usage"
    assert result["total_output_tokens"] == 24
    assert result["ttft_ms"]["p50"] > 0 and result["output_throughput"] > 0


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory):
    """The scripted Qwen3 checkpoint of `reasoning_model.py` with `--reasoning-parser`."""
    from reasoning_model import make_reasoning_model

    model_dir = make_reasoning_model(tmp_path_factory.mktemp("qwen3-reasoning"))
    server = LiveServer.start(
        str(model_dir), "--num-kv-blocks", "64", "--reasoning-parser", "qwen3", api_key=API_KEY
    )
    yield server
    server.stop()


def test_reasoning_comes_back_as_a_thinking_block(reasoning_server, compat):
    from reasoning_model import ANSWER, THINKING

    client = _client(reasoning_server.url)
    kwargs = dict(model="", max_tokens=40, messages=[{"role": "user", "content": "Is it ok?"}])
    message = client.messages.create(**kwargs, extra_body=GREEDY)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == THINKING and message.content[1].text == ANSWER
    assert message.stop_reason == "end_turn"
    compat.exercised("messages", message=message)
    compat.exercised("reasoning", reasoning_content=message.content[0].thinking)
    with client.messages.stream(**kwargs, extra_body=GREEDY) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"
    assert final.content[0].thinking == THINKING and final.content[1].text == ANSWER


def _tool_turn(*thinking) -> list[dict]:
    """A user query, an assistant's call after `thinking` blocks, the tool's answer: Qwen3's
    template renders the thinking of the assistant turns after the last user query."""
    call = {"type": "tool_use", "id": "c1", "name": "ls", "input": {"p": "."}}
    result = {"type": "tool_result", "tool_use_id": "c1", "content": "main.py"}
    return [
        {"role": "user", "content": "Fix the bug"},
        _assistant(*thinking, call),
        {"role": "user", "content": [result]},
    ]


FIRST = {"type": "thinking", "thinking": "List the files, ", "signature": "s1"}
SECOND = {"type": "thinking", "thinking": "then read main.py.", "signature": "s2"}


@pytest.mark.milestone("m30")
@pytest.mark.timeout(60)
def test_earlier_thinking_blocks_are_the_chat_messages_reasoning_content(reasoning_server):
    from nanollmserve.api.protocol_messages import CountTokensRequest

    chat = CountTokensRequest(messages=_tool_turn(FIRST, SECOND)).to_chat_request()
    assistant = chat.message_dicts()[1]
    assert assistant["reasoning_content"] == "List the files, then read main.py."
    client = _client(reasoning_server.url)

    def count(messages) -> int:
        return client.messages.count_tokens(model="", messages=messages).input_tokens

    redacted = {"type": "redacted_thinking", "data": "opaque"}
    bare, thought = count(_tool_turn()), count(_tool_turn(FIRST, SECOND))
    assert count(_tool_turn(redacted)) == bare < count(_tool_turn(FIRST)) < thought
    # One conversion: count_tokens, /v1/messages and the same chat on /tokenize agree.
    message = client.messages.create(model="", max_tokens=1, messages=_tool_turn(FIRST, SECOND))
    assert message.usage.input_tokens == thought
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    with reasoning_server.client() as http:
        tokenized = http.post("/tokenize", json={"messages": messages})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["count"] == thought


@pytest.mark.milestone("m30")
@pytest.mark.timeout(60)
def test_earlier_thinking_counts_toward_the_context_and_the_body_cap(reasoning_server):
    huge = {**FIRST, "thinking": "x " * 5000}  # rendered: past the 1024-token context
    response = _post(reasoning_server, {"max_tokens": 2, "messages": _tool_turn(huge)})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "messages" in error["message"]
    over = {**FIRST, "thinking": "x" * (5 << 20)}  # past the 4 MiB body cap
    response = _post(reasoning_server, {"max_tokens": 2, "messages": _tool_turn(over)})
    assert response.status_code == 413, response.text
    assert response.json()["error"]["type"] == "request_too_large"
    assert httpx.get(f"{reasoning_server.url}/health", timeout=10).status_code == 200

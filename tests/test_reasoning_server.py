"""`--reasoning-parser` and the chat template extras through a live server and the real
`openai` client, on the tiny scripted Qwen3 checkpoint of `reasoning_model.py` (real Qwen3
chat template; greedy output `<think>THINKING</think>ANSWER`, or ANSWER alone when the
template closes the thinking): `reasoning_content` in messages and stream deltas, the
`reasoning` item of /v1/responses and its events, structured output and forced tool calls
applied after `</think>`, `chat_template_kwargs` / `--default-chat-template-kwargs` (HTTP and
gRPC), `add_generation_prompt` / `continue_final_message`, an assistant's earlier thinking sent back
(`reasoning_content`, vLLM's `reasoning`) rendered by the template, and hostile values."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from live_server import LiveServer, free_port
from reasoning_model import ANSWER, THINKING, VERDICT_SCHEMA, VERDICTS, make_reasoning_model

from nanollmserve.api.grpc_client import connect

pytestmark = [pytest.mark.milestone("m23"), pytest.mark.timeout(300)]

MESSAGES = [{"role": "user", "content": "Is it ok?"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
VERDICT = VERDICT_SCHEMA


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_reasoning_model(tmp_path_factory.mktemp("qwen3-reasoning"))


@pytest.fixture(scope="module")
def server(model_dir):
    grpc_port = free_port()
    live = LiveServer.start(
        str(model_dir), "--num-kv-blocks", "64", "--reasoning-parser", "qwen3",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--grpc-port", str(grpc_port),
    )  # fmt: skip
    live.grpc_target = f"127.0.0.1:{grpc_port}"
    yield live
    live.stop()


@pytest.fixture(scope="module")
def no_think_server(model_dir):
    """Thinking off by default (`--default-chat-template-kwargs`), gRPC on too."""
    grpc_port = free_port()
    live = LiveServer.start(
        str(model_dir), "--num-kv-blocks", "64", "--reasoning-parser", "deepseek_r1",
        "--default-chat-template-kwargs", '{"enable_thinking": false}',
        "--grpc-port", str(grpc_port),
    )  # fmt: skip
    live.grpc_target = f"127.0.0.1:{grpc_port}"
    yield live
    live.stop()


def chat(server, **fields):
    return server.openai().chat.completions.create(
        model="", messages=fields.pop("messages", MESSAGES), temperature=0, **fields
    )


def test_reasoning_content_and_answer(server) -> None:
    message = chat(server).choices[0].message
    assert message.reasoning_content == THINKING
    assert message.content == ANSWER


def test_streamed_deltas_add_up_to_the_same_split(server) -> None:
    reasoning, content = [], []
    for chunk in chat(server, stream=True):
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
            assert "<think>" not in reasoning[-1] + content[-1]
            assert "</think>" not in reasoning[-1] + content[-1]
    assert "".join(reasoning) == THINKING
    assert "".join(content) == ANSWER


def test_enable_thinking_false_per_request(server) -> None:
    message = chat(server, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert message.choices[0].message.reasoning_content is None
    assert message.choices[0].message.content == ANSWER


def test_json_schema_applies_after_the_thinking(server, compat) -> None:
    """The model's own answer breaks the schema: the grammar must shape it, after thinking
    that the grammar would have refused."""
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": VERDICT}}
    message = chat(server, response_format=response_format).choices[0].message
    assert message.reasoning_content == THINKING
    assert message.content != ANSWER
    assert json.loads(message.content) in VERDICTS, message.content
    compat.exercised("reasoning", reasoning_content=message.reasoning_content)
    compat.exercised("structured", output=message.content, schema=VERDICT)


def test_choice_grammar_constrains_the_answer_not_the_thinking(server) -> None:
    """The model's own answer is not a choice: the grammar must shape it, after thinking
    that the grammar would have refused."""
    body = {"structured_outputs": {"choice": ["yes", "no"]}}
    message = chat(server, extra_body=body).choices[0].message
    assert message.reasoning_content == THINKING
    assert message.content in ("yes", "no")


def test_forced_tool_call_after_the_thinking(server) -> None:
    tools = [{"type": "function", "function": {"name": "check", "parameters": SCHEMA}}]
    choice = {"type": "function", "function": {"name": "check"}}
    message = chat(server, tools=tools, tool_choice=choice).choices[0].message
    assert message.reasoning_content == THINKING
    [call] = message.tool_calls
    assert call.function.name == "check"
    assert json.loads(call.function.arguments) == {"ok": True}


def test_responses_reasoning_item(server) -> None:
    response = server.openai().responses.create(model="", input="Is it ok?", temperature=0)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THINKING
    assert message.type == "message" and response.output_text == ANSWER


def test_responses_stream_events(server) -> None:
    client = server.openai()
    deltas, kinds = [], []
    with client.responses.stream(model="", input="Is it ok?", temperature=0) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.reasoning_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == THINKING
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert final.output[0].type == "reasoning" and final.output_text == ANSWER


def test_continue_final_message(server) -> None:
    """The assistant's last message stays open: the model continues after its text."""
    messages = MESSAGES + [{"role": "assistant", "content": "Consider"}]
    body = {"continue_final_message": True, "add_generation_prompt": False}
    message = chat(server, messages=messages, extra_body=body).choices[0].message
    assert message.content.startswith(" quickly</think>")


def test_add_generation_prompt_false_renders_less(server) -> None:
    usage = chat(server, max_tokens=1).usage
    fewer = chat(server, max_tokens=1, extra_body={"add_generation_prompt": False}).usage
    assert fewer.prompt_tokens < usage.prompt_tokens


HOSTILE = [
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"_private": 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"a b": 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"k" * 65: 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {f"k{i}": i for i in range(33)}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"deep": [[[[[1]]]]]}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"big": "x" * 5000}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tiny": 5e-324, "huge": 1e308}}, None),  # finite: fine
    ({"add_generation_prompt": [True]}, "add_generation_prompt"),
    ({"continue_final_message": {"x": 1}}, "continue_final_message"),
    ({"continue_final_message": True}, "continue_final_message"),  # with the default prompt
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
]


@pytest.mark.parametrize(("fields", "param"), HOSTILE)
def test_hostile_chat_template_fields(server, fields, param) -> None:
    body = {"messages": MESSAGES, "max_tokens": 2, **fields}
    with server.client() as http:
        response = http.post("/v1/chat/completions", json=body)
        if param is None:
            assert response.status_code == 200, response.text
            return
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param, error
        assert http.get("/health").status_code == 200


THOUGHT = "I should list the files first."
CALL = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"p": "."}'}}


def tool_turn(**reasoning) -> list[dict]:
    """A user query, an assistant's call (with `reasoning`), the tool's answer: Qwen3's
    template renders the thinking of the assistant turns after the last user query."""
    return [
        {"role": "user", "content": "Fix the bug"},
        {"role": "assistant", "content": "", "tool_calls": [CALL], **reasoning},
        {"role": "tool", "tool_call_id": "c1", "content": "main.py"},
    ]


@pytest.mark.milestone("m30")
@pytest.mark.timeout(60)
def test_earlier_reasoning_content_reaches_the_template(server) -> None:
    with server.client() as http:

        def prompt(messages) -> str:
            response = http.post("/apply-template", json={"messages": messages})
            assert response.status_code == 200, response.text
            return response.json()["prompt"]

        bare = prompt(tool_turn())
        rendered = prompt(tool_turn(reasoning_content=THOUGHT))
        assert THOUGHT not in bare and f"<think>\n{THOUGHT}\n</think>" in rendered
        assert prompt(tool_turn(reasoning=THOUGHT)) == rendered  # vLLM's name
        both = prompt(tool_turn(reasoning=THOUGHT, reasoning_content=THOUGHT))
        assert both == rendered
        user = [{**tool_turn()[0], "reasoning_content": THOUGHT}, *tool_turn()[1:]]
        assert prompt(user) == bare  # only an assistant's thinking is kept, as in vLLM
    thought = chat(server, messages=tool_turn(reasoning_content=THOUGHT), max_tokens=1)
    without = chat(server, messages=tool_turn(), max_tokens=1)
    assert thought.usage.prompt_tokens > without.usage.prompt_tokens


REASONING_HOSTILE = [
    {"reasoning_content": 5},
    {"reasoning_content": ["a"]},
    {"reasoning": {"text": "a"}},
    {"reasoning_content": "a", "reasoning": "b"},  # disagree
    {"reasoning_content": "x " * 5000},  # rendered: the prompt outgrows the 1024-token context
]


@pytest.mark.milestone("m30")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("fields", REASONING_HOSTILE, ids=["int", "list", "dict", "both", "huge"])
def test_hostile_reasoning_content(server, fields) -> None:
    body = {"messages": [*MESSAGES, {"role": "assistant", "content": "ok", **fields}]}
    with server.client() as http:
        response = http.post("/v1/chat/completions", json={**body, "max_tokens": 2})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"].startswith("messages"), error
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_in_kwargs(server, literal) -> None:
    raw = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
    raw += f'"chat_template_kwargs": {{"temperature_hint": {literal}}}}}'
    with server.client() as http:
        response = http.post(
            "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "chat_template_kwargs"


def test_default_kwargs_and_request_override(no_think_server) -> None:
    """The default closes the thinking in the prompt: even deepseek_r1 (which otherwise reads
    everything up to `</think>` as thinking) answers in `content`; a request turns it on."""
    message = chat(no_think_server).choices[0].message
    assert message.reasoning_content is None and message.content == ANSWER
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    message = chat(no_think_server, extra_body=on).choices[0].message
    assert message.reasoning_content == THINKING and message.content == ANSWER


def test_default_kwargs_reach_grpc_chats(server, no_think_server, compat) -> None:
    """A gRPC chat thinks where the server's default does (the parser splits the thinking
    off) and answers at once where the default turns thinking off."""

    async def main(live):
        async with await connect(live.grpc_target) as client:
            return await client.generate(messages=MESSAGES, max_tokens=40, temperature=0)

    thinking = asyncio.run(main(server))
    assert (thinking.reasoning_content, thinking.text) == (THINKING, ANSWER)
    compat.exercised("grpc", reply=thinking)
    compat.exercised("reasoning", reasoning_content=thinking.reasoning_content)
    off = asyncio.run(main(no_think_server))
    assert (off.reasoning_content, off.text) == ("", ANSWER)


def test_bad_default_kwargs_flag_fails_at_start(model_dir) -> None:
    with pytest.raises(RuntimeError, match="default-chat-template-kwargs"):
        LiveServer.start(str(model_dir), "--default-chat-template-kwargs", "[1]")


def test_grammar_refused_where_think_is_not_one_token(tmp_path) -> None:
    live = LiveServer.start("--num-kv-blocks", "64", "--reasoning-parser", "qwen3")
    try:
        body = {"messages": MESSAGES, "max_tokens": 2, "response_format": {"type": "json_object"}}
        response = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "response_format"
        assert "one token" in response.json()["error"]["message"]
    finally:
        live.stop()

"""Tool calling through a live server with the real `openai` SDK (strict validation): the
bundled SmolLM2 served with the tool chat template and `--enable-auto-tool-choice
--tool-call-parser hermes`. `tool_choice` auto (a call parsed out of the text, and text
that is not a call staying content), required and named (the grammar forces a call whose
arguments validate against the function's schema), streamed `delta.tool_calls`, and full
two-turn tool loops through chat completions and through `/v1/responses`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jsonschema
import openai
import pytest
from live_server import API_KEY, LiveServer

pytestmark = pytest.mark.milestone("m19")

TEMPLATE = Path(__file__).resolve().parent.parent / "examples" / "tool_chat_template_smollm2.jinja"
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
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": WEATHER_SCHEMA,
    },
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a timezone",
        "parameters": TIME_SCHEMA,
    },
}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}

needs_grammar = pytest.mark.skipif(
    importlib.util.find_spec("nanollmserve.engine.structured_output") is None,
    reason="forced calls need m15's grammar engine (nanollmserve.engine.structured_output)",
)


def _call(city: str, call_id: str) -> dict:
    arguments = json.dumps({"city": city, "unit": "celsius"})
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }


# One earlier turn shows the model the call format; then it is asked for another city.
ONE_SHOT = [
    {"role": "user", "content": "What is the weather in London?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("London", "call_1")]},
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture(scope="module")
def server():
    server = LiveServer.start(
        "--num-kv-blocks",
        "256",
        "--chat-template",
        str(TEMPLATE),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        api_key=API_KEY,
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def _valid(call) -> dict:
    """The call's arguments, parsed and checked against its function's schema."""
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.name])
    return arguments


def test_auto_parses_a_call_the_prompt_asks_for(client):
    reply = client.chat.completions.create(
        model="", messages=ONE_SHOT, tools=[WEATHER], temperature=0, max_tokens=40
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] == "Paris"
    assert not choice.message.content


def test_auto_text_that_is_no_call_stays_content(client):
    messages = [{"role": "user", "content": "Say hello."}]
    with_tools = client.chat.completions.create(
        model="", messages=messages, tools=[WEATHER], temperature=0, max_tokens=12
    )
    choice = with_tools.choices[0]
    assert choice.message.tool_calls == [] and choice.message.content
    assert "<tool_call>" not in choice.message.content
    assert choice.finish_reason in ("stop", "length")


@needs_grammar
def test_required_forces_a_valid_call(client):
    for seed in range(2):
        reply = client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
            tools=[WEATHER, TIME],
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=80,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.function.name in SCHEMAS
            _valid(call.function)


@needs_grammar
def test_named_function_forces_its_arguments(client):
    reply = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Weather in Rome, please."}],
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        seed=1,
        max_tokens=60,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _valid(call.function)


def test_streamed_tool_calls_add_up_to_the_call(client):
    kwargs = dict(model="", messages=ONE_SHOT, tools=[WEATHER], temperature=0, max_tokens=40)
    full = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or []) if c.choices]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 for d in deltas) and all(d.id is None for d in deltas[1:])
    fragments = [d.function.arguments for d in deltas if d.function.arguments]
    assert len(fragments) > 1  # the arguments arrive in pieces
    assert "".join(fragments) == full.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_chat_tool_loop_two_turns(client):
    messages = list(ONE_SHOT)
    first = client.chat.completions.create(
        model="", messages=messages, tools=[WEATHER], temperature=0, max_tokens=40
    )
    [call] = first.choices[0].message.tool_calls
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"})
    second = client.chat.completions.create(
        model="", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=30
    )
    answer = second.choices[0]
    assert answer.message.content and answer.message.tool_calls == []
    assert answer.finish_reason in ("stop", "length")


@needs_grammar
def test_responses_tool_loop_two_turns(client):
    tool = {"type": "function", **WEATHER["function"]}
    conversation = [
        {"role": "user", "content": "What is the weather in London?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": json.dumps({"city": "London", "unit": "celsius"}),
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "12 degrees"},
        {"role": "assistant", "content": "It is 12 degrees in London."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    first = client.responses.create(
        model="",
        input=conversation,
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=40,
    )
    assert first.status == "completed"
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    _valid(call)
    second = client.responses.create(
        model="",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}],
        tools=[tool],
        tool_choice="none",
        max_output_tokens=30,
    )
    assert second.status in ("completed", "incomplete")
    assert second.output_text
    assert all(item.type == "message" for item in second.output)


def test_responses_stream_of_a_call(client):
    """`client.responses.stream` reads function-call events; they add up to the call."""
    tool = {"type": "function", **WEATHER["function"]}
    one_shot = [
        {"role": "user", "content": "What is the weather in London?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": json.dumps({"city": "London", "unit": "celsius"}),
        },
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    kwargs = dict(model="", input=one_shot, tools=[tool], temperature=0, max_output_tokens=40)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    [call] = [item for item in final.output if item.type == "function_call"]
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(fragments) == done.arguments == call.arguments
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] == "Paris"
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["function_call"] and added[0].id == call.id


def test_bad_tool_requests_are_400s(client, server):
    cases = [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools.0.function.name",
        ),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="", messages=ONE_SHOT, max_tokens=2, **extra)
        assert err.value.body["param"] == param, extra

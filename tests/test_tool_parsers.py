"""Tool-call parsing and planning without a server: the `hermes` parser (one object, a
SmolLM2 list, `[]`, text around the calls), streaming piece by piece gives the same calls
and argument text as a whole parse, the forced-call parsers, `plan_tools` (grammars and
400s), and the SmolLM2 tool chat template (identical to the model's own without tools)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from nanollmserve.api.errors import APIError
from nanollmserve.api.protocol_tools import FunctionDefinition
from nanollmserve.api.tool_choice import plan_tools
from nanollmserve.api.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    NamedCallParser,
    RequiredCallsParser,
    ToolCallError,
)

pytestmark = pytest.mark.milestone("m19")

TEMPLATE = Path(__file__).resolve().parent.parent / "examples" / "tool_chat_template_smollm2.jinja"
WEATHER = FunctionDefinition(
    name="get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
)
TIME = FunctionDefinition(name="get_time")


def _stream(parser, text: str, size: int):
    """Feed `text` in pieces of `size` characters: (content, {index: arguments}, headers)."""
    content, arguments, headers = "", {}, []
    pieces = [text[i : i + size] for i in range(0, len(text), size)] + [None]
    for piece in pieces:
        delta = parser.feed(piece) if piece is not None else parser.finish()
        content += delta.content
        for call in delta.tool_calls:
            if call.name is not None:
                headers.append((call.index, call.id, call.name))
            arguments[call.index] = arguments.get(call.index, "") + call.arguments
    return content, arguments, headers


def test_hermes_reads_objects_lists_and_content():
    call = '{"name": "get_weather", "arguments": {"city": "Pa\\"ris"}}'
    text = f"Sure.\n<tool_call>\n{call}\n</tool_call>"
    content, [call] = HermesToolParser().parse(text)
    assert content == "Sure." and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": 'Pa"ris'} and call.id.startswith("call_")
    calls = '[{"name": "a", "arguments": {"x": [1, {"y": "}"}]}}, {"arguments": {}, "name": "b"}]'
    smollm2 = f"<tool_call>{calls}</tool_call>"
    content, calls = HermesToolParser().parse(smollm2)
    assert content is None and [c.name for c in calls] == ["a", "b"]
    assert [json.loads(c.arguments) for c in calls] == [{"x": [1, {"y": "}"}]}, {}]
    assert HermesToolParser().parse("Nothing to call. <tool_call>[]</tool_call>") == (
        "Nothing to call.",
        [],
    )
    assert HermesToolParser().parse("a < b, <tool") == ("a < b, <tool", [])


def test_hermes_rejects_broken_calls():
    for text in (
        '<tool_call>{"name": "f", "arguments": {</tool_call>',
        '<tool_call>{"arguments": {}}',
    ):
        with pytest.raises(ToolCallError):
            HermesToolParser().parse(text)
    with pytest.raises(ToolCallError):
        HermesToolParser().parse('<tool_call>{"name": "f", "arguments": {"a": 1')


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_streaming_pieces_add_up_to_the_whole_parse(size):
    calls = '[{"name": "a", "arguments": {"q": "x}y", "n": [1]}}, {"name": "b", "arguments": {}}]'
    text = f"Hi <tool_call>{calls}</tool_call>"
    whole_content, whole_calls = HermesToolParser().parse(text)
    parser = HermesToolParser()
    content, arguments, headers = _stream(parser, text, size)
    assert content.strip() == whole_content
    assert [(i, name) for i, _, name in headers] == [(0, "a"), (1, "b")]
    assert [c.id for c in parser.calls] == [call_id for _, call_id, _ in headers]
    assert [arguments[i] for i in range(2)] == [c.arguments for c in whole_calls]


def test_forced_call_parsers():
    content, [call] = RequiredCallsParser().parse('[{"name": "get_time", "arguments": {}}]')
    assert content is None and call.name == "get_time" and call.arguments == "{}"
    with pytest.raises(ToolCallError):
        RequiredCallsParser().parse("[]")
    parser = NamedCallParser("get_weather")
    _, arguments, headers = _stream(parser, '{"city": "Rome"}', 3)
    assert headers[0][2] == "get_weather" and arguments[0] == '{"city": "Rome"}'
    assert parser.calls[0].arguments == '{"city": "Rome"}'


def test_plan_tools():
    assert plan_tools([WEATHER], "none", tool_call_parser="hermes").template_tools is None
    auto = plan_tools([WEATHER], "auto", tool_call_parser="hermes")
    assert (
        auto.structured_outputs is None
        and auto.template_tools[0]["function"]["name"] == "get_weather"
    )
    named = plan_tools([WEATHER, TIME], "get_weather", tool_call_parser=None)
    assert named.structured_outputs.json == WEATHER.parameters
    required = plan_tools([WEATHER, TIME], "required", tool_call_parser=None)
    schema = required.structured_outputs.json
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}}], schema)
    for bad in (
        [],
        [{"name": "get_weather", "arguments": {}}],
        [{"name": "nope", "arguments": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = plan_tools([TIME], "required", tool_call_parser=None, parallel_tool_calls=False)
    assert single.structured_outputs.json["maxItems"] == 1
    for functions, choice, parser in [
        ([WEATHER], "auto", None),  # auto without --enable-auto-tool-choice
        ([], "required", "hermes"),
        ([WEATHER], "get_time", "hermes"),
        ([WEATHER, WEATHER], "auto", "hermes"),
    ]:
        with pytest.raises(APIError) as err:
            plan_tools(functions, choice, tool_call_parser=parser)
        assert err.value.status_code == 400 and err.value.param in ("tool_choice", "tools")


def test_cli_parser_choices_are_the_registered_parsers():
    from nanollmserve.cli.main import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    [action] = [a for a in serve._actions if a.dest == "tool_call_parser"]
    assert sorted(action.choices) == sorted(TOOL_PARSERS)


def test_smollm2_tool_template():
    from transformers import AutoTokenizer

    from nanollmserve.model import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None).path))
    template = TEMPLATE.read_text()
    conversations = [
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"},
        ],
    ]
    for messages in conversations:
        for prompt in (True, False):
            own = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt
            )
            ours = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt, chat_template=template
            )
            assert ours == own
    turn = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5 C"},
    ]
    tools = [WEATHER.template_dict()]
    text = tokenizer.apply_chat_template(
        turn, tools=tools, tokenize=False, add_generation_prompt=True, chat_template=template
    )
    assert '"name": "get_weather"' in text.split("</tools>")[0]
    assert '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>' in text
    assert "<tool_response>\n5 C\n</tool_response>" in text

"""The bundled model does tool calls out of the box (m29, issue 42): `nanollmserve serve` with
no flags serves it with its tool chat template (the package's
`frontend/smollm2_tool_chat_template.jinja`, also `examples/tool_chat_template_smollm2.jinja`)
and auto tool choice with the hermes parser, so the openai SDK gets parsed tool calls. A
template without tool support is still refused with a 400 that says so."""

from __future__ import annotations

import json

import openai
import pytest
from live_server import LiveServer

pytestmark = [pytest.mark.milestone("m29"), pytest.mark.timeout(300)]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
# One earlier turn shows the 135M model the call format; then it is asked for another city.
ONE_SHOT = [
    {"role": "user", "content": "What is the weather in London?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "London"})},
            }
        ],
    },
    {"role": "user", "content": "What is the weather in Paris?"},
]
# SmolLM2's own chat template (the one its GGUF carries): ChatML, no tools.
NO_TOOLS_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_serve_with_no_flags_answers_a_tools_request_with_a_parsed_call() -> None:
    server = LiveServer.start()  # no flag but the port: what `make serve` runs
    try:
        client = server.openai()
        reply = client.chat.completions.create(
            model="", messages=ONE_SHOT, tools=[WEATHER], temperature=0, max_tokens=40
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert not choice.message.content
        # A chat without tools is answered as text, as before.
        plain = client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": "Name three colors."}],
            temperature=0,
            max_tokens=16,
        )
        assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    finally:
        server.stop()


def test_a_template_without_tool_support_is_refused(tmp_path) -> None:
    template = tmp_path / "no_tools.jinja"
    template.write_text(NO_TOOLS_TEMPLATE)
    server = LiveServer.start("--chat-template", str(template))
    try:
        client = server.openai()
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(
                model="",
                messages=ONE_SHOT,
                tools=[WEATHER],
                tool_choice="required",
                max_tokens=40,
            )
        assert error.value.status_code == 400
        assert "chat template does not render tools" in str(error.value)
        # ... and with --chat-template given, auto tool choice is not turned on by itself
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(
                model="", messages=ONE_SHOT, tools=[WEATHER], max_tokens=40
            )
        assert "--enable-auto-tool-choice" in str(error.value)
    finally:
        server.stop()

"""A grammar cannot stall the server, through its HTTP API: a schema, regex or choice list
over a structured-output limit gets a 400 naming its field before anything compiles; a slow
compile runs on the grammar workers while other requests (and /tokenize) are answered; a
compile past `--structured-outputs-timeout` gets a 400 naming the flag and the server goes
on; and a full server answers 503 with Retry-After before doing any work for a request."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer

pytestmark = pytest.mark.milestone("m21")

SLOW_SCHEMA_PROPERTIES = 600
"""Properties of `slow_schema()`: within the default limits (about 40 KB), and some seconds
to compile (measured: 6 s for 500 on a 2-core machine)."""


def slow_schema(num_properties: int = SLOW_SCHEMA_PROPERTIES, salt: str = "") -> dict:
    """An object of string properties with patterns: XGrammar's compile time grows with them."""
    properties = {
        f"p{i}{salt}": {"type": "string", "pattern": f"^[a-z]{{1,{i % 20 + 1}}}[0-9]+$"}
        for i in range(num_properties)
    }
    return {"type": "object", "properties": properties, "required": list(properties)}


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def _assert_error(response: httpx.Response, status: int, param: str | None, text: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert text in error["message"]
    return error


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server():
    # A long deadline: the slow compile below must finish, however loaded the machine is.
    template = str(Path(__file__).parents[1] / "examples" / "tool_chat_template_smollm2.jinja")
    server = LiveServer.start("--structured-outputs-timeout", "600", "--chat-template", template)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def strict_server():
    """A 1 s compile deadline and room for one sequence only."""
    server = LiveServer.start(
        "--structured-outputs-timeout", "1", "--max-num-seqs", "1", "--max-queue-len", "0"
    )
    yield server
    server.stop()


OVER_LIMITS = {
    "properties": ({"json": {"type": "object", "properties": {f"p{i}": {} for i in range(1001)}}}),
    "depth": {"json": nested_schema(40)},
    "enum": {"json": {"enum": list(range(1001))}},
    "schema-bytes": {"json": {"type": "string", "description": "x" * 70_000}},
    "choice": {"choice": [f"c{i}" for i in range(1001)]},
    "regex": {"regex": "a" * 70_000},
    "grammar": {"grammar": 'root ::= "' + "a" * 70_000 + '"'},
}
FLAGS = {
    "properties": "--max-schema-properties",
    "depth": "--max-schema-depth",
    "enum": "--max-enum-entries",
    "schema-bytes": "--max-schema-bytes",
    "choice": "--max-enum-entries",
    "regex": "--max-grammar-bytes",
    "grammar": "--max-grammar-bytes",
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("limit", sorted(OVER_LIMITS))
def test_a_grammar_over_a_limit_is_a_400_naming_its_field(server, limit):
    with server.client() as client:
        body = {"prompt": "Hi", "max_tokens": 4, "structured_outputs": OVER_LIMITS[limit]}
        response = client.post("/v1/completions", json=body)
        _assert_error(response, 400, "structured_outputs", FLAGS[limit])
        if "json" in OVER_LIMITS[limit]:
            chat = {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
                "response_format": _json_format(OVER_LIMITS[limit]["json"]),
            }
            response = client.post("/v1/chat/completions", json=chat)
            _assert_error(response, 400, "response_format", FLAGS[limit])
        assert server.stats()["num_grammar_compiles_running"] == 0  # refused before compiling


@pytest.mark.timeout(240)
def test_a_forced_tool_call_or_text_format_over_a_limit_names_its_field(server):
    too_many = OVER_LIMITS["properties"]["json"]
    tool = {"type": "function", "function": {"name": "f", "parameters": too_many}}
    with server.client() as client:
        chat = {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "tools": [tool],
            "tool_choice": "required",
        }
        response = client.post("/v1/chat/completions", json=chat)
        _assert_error(response, 400, "tools", "--max-schema-properties")
        text_format = {"type": "json_schema", "name": "out", "schema": too_many}
        responses = {"input": "Hi", "max_output_tokens": 16, "text": {"format": text_format}}
        response = client.post("/v1/responses", json=responses)
        _assert_error(response, 400, "text.format", "--max-schema-properties")


@pytest.mark.timeout(300)
def test_a_slow_compile_does_not_delay_other_requests(server):
    events: list[str] = []
    slow_result: dict = {}

    def send_slow() -> None:
        with server.client(timeout=600) as client:
            body = {"prompt": "{", "max_tokens": 4, "structured_outputs": {"json": slow_schema()}}
            slow_result["response"] = client.post("/v1/completions", json=body)
        events.append("slow answered")

    slow = threading.Thread(target=send_slow)
    slow.start()
    try:
        _wait_for(
            lambda: server.stats()["num_grammar_compiles_running"] == 1 or not slow.is_alive(),
            timeout=120,
            what="the slow grammar to start compiling",
        )
        assert slow.is_alive(), "the slow request ended before its grammar compiled"
        with server.client() as client:
            small = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8})
            tokenized = client.post("/tokenize", json={"prompt": "Hello world"})
            compiles_running = server.stats()["num_grammar_compiles_running"]
        events.append("small answered")
        assert small.status_code == 200, small.text
        assert tokenized.status_code == 200, tokenized.text
    finally:
        slow.join(timeout=600)
    # The small request and /tokenize were answered while the grammar still compiled.
    assert events == ["small answered", "slow answered"]
    assert compiles_running == 1
    assert slow_result["response"].status_code == 200, slow_result["response"].text


@pytest.mark.timeout(300)
def test_a_compile_past_the_deadline_is_a_400_naming_the_flag(strict_server):
    with strict_server.client(timeout=300) as client:
        chat = {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "response_format": _json_format(slow_schema(salt="t")),
        }
        response = client.post("/v1/chat/completions", json=chat)
        _assert_error(response, 400, "response_format", "--structured-outputs-timeout")
        # The same grammar again fails at once: it is remembered as too slow.
        response = client.post("/v1/chat/completions", json=chat)
        _assert_error(response, 400, "response_format", "--structured-outputs-timeout")
        # The server goes on, grammars included.
        small = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8})
        assert small.status_code == 200, small.text
        choice = {
            "prompt": "Yes or no?",
            "max_tokens": 4,
            "structured_outputs": {"choice": ["yes"]},
        }
        answered = client.post("/v1/completions", json=choice)
        assert answered.status_code == 200, answered.text
        assert answered.json()["choices"][0]["text"] == "yes"
    assert strict_server.process.poll() is None


@pytest.mark.timeout(300)
def test_a_full_server_answers_503_before_doing_any_work(strict_server):
    strict_server.wait_idle()
    rejected_before = strict_server.stats()["num_requests_rejected"]
    # as many tokens as the context allows: it must still hold the one sequence after the
    # three requests below, however slowly they are sent (closing the stream aborts it)
    long_body = {"prompt": "Once", "max_tokens": 8000, "ignore_eos": True, "stream": True}
    with (
        strict_server.client() as client,
        client.stream("POST", "/v1/completions", json=long_body) as running,
    ):
        assert running.status_code == 200
        # its first token: it holds the one sequence. The iterator is kept: a dropped one is
        # collected at once, which closes the connection, and the server aborts the request.
        lines = running.iter_lines()
        next(lines)
        # Either would be a 400 once tokenized or compiled; a full server refuses first.
        bad_grammar = {"prompt": "Hi", "max_tokens": 4, "structured_outputs": {"regex": "("}}
        too_long = {"prompt": "word " * 100_000, "max_tokens": 4}
        bad_chat = {
            "messages": [{"role": "user", "content": "word " * 100_000}],
            "max_tokens": 4,
        }
        for path, body in [
            ("/v1/completions", bad_grammar),
            ("/v1/completions", too_long),
            ("/v1/chat/completions", bad_chat),
        ]:
            response = client.post(path, json=body)
            error = _assert_error(response, 503, None, "overloaded")
            assert error["type"] == "server_error"
            assert response.headers["Retry-After"].isdigit()
    assert strict_server.stats()["num_requests_rejected"] == rejected_before + 3
    strict_server.wait_idle()
    with strict_server.client() as client:
        response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
        assert response.status_code == 200, response.text

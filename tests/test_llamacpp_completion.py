"""llama.cpp's native `POST /completion` through HTTP on the shared live server: its
response fields (`content`, `tokens`, `stop_type`, `timings`, `completion_probabilities`),
its stream, the same greedy text as the OpenAI route (one engine path), and a 400 naming
the field for every value it cannot honour (NaN, infinities, out of range, unsupported).
The `compat` calls are the compatibility matrix's evidence (scripts/compat_matrix.py): the
shared server runs the bundled model's GGUF blocks."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from live_server import shared_server

pytestmark = pytest.mark.milestone("m30")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client():
    with shared_server().client() as client:
        yield client


def complete(client: httpx.Client, **fields) -> dict:
    response = client.post("/completion", json={"prompt": PROMPT, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_greedy_text_matches_the_openai_route_and_the_fields_add_up(client, compat):
    native = complete(client, n_predict=6, return_tokens=True)
    openai = client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    ).json()
    assert native["content"] == openai["choices"][0]["text"]
    assert native["stop"] is True
    assert native["tokens_predicted"] == len(native["tokens"]) == 6
    assert native["stop_type"] == "limit" and native["stopping_word"] == ""
    assert native["tokens_evaluated"] == openai["usage"]["prompt_tokens"]
    assert native["prompt"] == PROMPT
    assert native["generation_settings"]["n_predict"] == 6
    detok = client.post("/detokenize", json={"tokens": native["tokens"]}).json()
    assert detok["prompt"] == native["content"]
    timings = native["timings"]
    assert timings["predicted_n"] == 6
    assert timings["prompt_n"] + timings["cache_n"] == native["tokens_evaluated"]
    assert timings["predicted_ms"] > 0 and timings["prompt_ms"] > 0
    assert math.isclose(
        timings["predicted_per_second"], 1000 * 6 / timings["predicted_ms"], rel_tol=1e-6
    )
    assert math.isclose(timings["predicted_per_token_ms"], timings["predicted_ms"] / 6)
    assert "quantization=gguf" in shared_server().log()
    compat.exercised("gguf", quantization=compat.quantization_in_log(shared_server().log()))
    compat.exercised("llamacpp", completion=native)


def test_tokens_are_left_out_unless_asked(client):
    assert complete(client, n_predict=2)["tokens"] == []


def test_prompt_as_token_ids(client, compat):
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_ids = complete(client, prompt=ids, n_predict=4, return_tokens=True)
    assert by_ids["tokens_evaluated"] == len(ids)
    by_text = complete(client, n_predict=4, return_tokens=True)
    assert by_ids["content"] == by_text["content"]
    assert by_ids["tokens"] == by_text["tokens"]
    detok = client.post("/detokenize", json={"tokens": by_ids["tokens"]}).json()
    assert detok["prompt"] == by_ids["content"]
    compat.exercised("tokenio", token_ids=by_ids["tokens"])
    compat.exercised("llamacpp", completion=by_ids)


def test_stop_word_and_eos(client):
    text = complete(client, n_predict=8)["content"]
    word = text.strip().split()[0][:3]
    stopped = complete(client, n_predict=8, stop=[word])
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert word not in stopped["content"]
    chat = client.post(
        "/apply-template", json={"messages": [{"role": "user", "content": "Say hi."}]}
    ).json()["prompt"]
    ended = complete(client, prompt=chat, n_predict=200)
    assert ended["stop_type"] == "eos", ended


def test_n_probs_gives_the_top_tokens_of_each_step(client):
    result = complete(client, n_predict=4, n_probs=3)
    probs = result["completion_probabilities"]
    assert len(probs) == result["tokens_predicted"] == 4
    for step in probs:
        top = step["top_logprobs"]
        assert len(top) == 3
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["id"] == step["id"]  # greedy: the sampled token is the most likely
        assert bytes(step["bytes"]).decode() == step["token"]
    assert "".join(step["token"] for step in probs) == result["content"]


def test_stream_events_add_up_to_the_answer(client):
    whole = complete(client, n_predict=6)
    events = []
    with client.stream(
        "POST",
        "/completion",
        json={"prompt": PROMPT, "n_predict": 6, "temperature": 0, "stream": True, "n_probs": 1},
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    *partial, last = events
    assert all(e["stop"] is False and len(e["completion_probabilities"]) == 1 for e in partial)
    assert "".join(e["content"] for e in partial) == whole["content"]
    assert sum(len(e["tokens"]) for e in partial) == 6
    assert last["stop"] is True and last["content"] == ""
    assert last["stop_type"] == "limit" and last["tokens_predicted"] == 6
    assert last["timings"]["predicted_n"] == 6


def test_json_schema_and_grammar_constrain_the_output(client, compat):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 8}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    result = complete(client, json_schema=schema, n_predict=40)
    assert set(json.loads(result["content"])) == {"answer"}
    compat.exercised("structured", output=result["content"], schema=schema)
    compat.exercised("llamacpp", completion=result)
    result = complete(client, grammar='root ::= "yes" | "no"', n_predict=5)
    assert result["content"] in ("yes", "no")
    compat.exercised("structured", output=result["content"], choice=["yes", "no"])
    compat.exercised("llamacpp", completion=result)


@pytest.mark.parametrize("priority", [0, 1, -1], ids=["zero", "one", "negative"])
def test_priority_is_not_a_completion_field(client, priority, compat):
    """llama.cpp's /completion has no `priority` (nanollmserve's extension of the OpenAI and
    Anthropic routes): like any field it does not declare, a 400 naming it, whatever the
    value and the server's scheduling policy; the same request without it is answered."""
    response = client.post(
        "/completion", json={"prompt": PROMPT, "n_predict": 2, "priority": priority}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "Unrecognized request argument supplied: priority" in error["message"], error
    compat.refused("llamacpp", "priority", error["message"])
    assert complete(client, n_predict=2)["stop"] is True


def test_cache_prompt_false_shares_no_prefix_blocks(client):
    prompt = "A long shared prefix for the cache test. " * 8
    complete(client, prompt=prompt, n_predict=1)
    assert complete(client, prompt=prompt, n_predict=1)["tokens_cached"] > 0
    uncached = complete(client, prompt=prompt, n_predict=1, cache_prompt=False)
    assert uncached["tokens_cached"] == 0
    assert uncached["timings"]["cache_n"] == 0


def test_fields_at_their_defaults_and_their_supported_values_are_accepted(client):
    complete(client, n_predict=2, typical_p=1.0, repeat_last_n=64, seed=-1, top_k=0)
    complete(client, n_predict=2, repeat_penalty=1.1, repeat_last_n=-1)
    complete(client, n_predict=2, repeat_penalty=1.1, repeat_last_n=0)
    complete(client, n_predict=2, temperature=0.7, top_p=1e-300, seed=5, min_p=1e-300)
    complete(client, n_predict=2, ignore_eos=True, presence_penalty=0.5, repeat_last_n=-1)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"prompt": "x", "temperature": NaN}', "temperature"),
        ('{"prompt": "x", "top_p": Infinity}', "top_p"),
        ('{"prompt": "x", "min_p": -Infinity}', "min_p"),
        ('{"prompt": "x", "typical_p": NaN}', "typical_p"),
        ('{"prompt": "x", "repeat_penalty": 1e308}', "repeat_penalty"),
        ('{"prompt": "x", "repeat_penalty": 1e-300}', "repeat_penalty"),
        ('{"prompt": "x", "presence_penalty": 3}', "presence_penalty"),
        ('{"prompt": "x", "frequency_penalty": -1e300}', "frequency_penalty"),
        ('{"prompt": "x", "temperature": 1e300}', "temperature"),
        ('{"prompt": "x", "top_p": 0}', "top_p"),
        ('{"prompt": "x", "n_predict": 0}', "n_predict"),
        ('{"prompt": "x", "n_predict": -2}', "n_predict"),
        ('{"prompt": "x", "n_predict": 1099511627776}', "n_predict"),
        ('{"prompt": "x", "n_probs": 21}', "n_probs"),
        ('{"prompt": "x", "n_probs": -1}', "n_probs"),
        ('{"prompt": "x", "top_k": -5}', "top_k"),
        ('{"prompt": "x", "seed": 18446744073709551616}', "seed"),
        ('{"prompt": "x", "repeat_last_n": -7}', "repeat_last_n"),
        ('{"prompt": "x", "typical_p": 0.5}', "typical_p"),
        ('{"prompt": "x", "repeat_penalty": 1.2, "repeat_last_n": 32}', "repeat_last_n"),
        ('{"prompt": "x", "grammar": "root ::= \\"a\\"", "json_schema": {}}', "grammar"),
        ('{"prompt": "x", "grammar": "root ::= nonsense ((("}', "grammar"),
        ('{"prompt": "x", "mirostat": 2}', "mirostat"),
        ('{"prompt": "x", "stop": [""]}', "stop"),
        ('{"prompt": ""}', "prompt"),
        ('{"prompt": [-1]}', "prompt"),
        ('{"prompt": "x", "model": "no-such-model"}', "model"),
    ],
)
def test_values_it_cannot_honour_are_400s_naming_the_field(client, body, param):
    response = client.post(
        "/completion", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert param in (error["param"] or "") or param in error["message"], error


def test_the_openai_routes_keep_their_shapes(client):
    for path in ("/completions", "/v1/completions"):
        body = client.post(path, json={"prompt": PROMPT, "max_tokens": 2}).json()
        assert body["object"] == "text_completion" and "content" not in body

"""Token-level input and output over HTTP with the openai client (vLLM's extras through
`extra_body`): `return_token_ids` and `prompt_logprobs` on completions and chat, streaming
too; `echo` with `logprobs`; prompts as token ids; `logprobs` with `n` > 1;
`use_beam_search` refused; hostile values of the new fields answered with a 400 naming them
while the server keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from live_server import shared_server

pytestmark = [pytest.mark.milestone("m23"), pytest.mark.timeout(300)]

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def server():
    return shared_server()


def _tokenize(server, **body) -> list[int]:
    with server.client() as client:
        return client.post("/tokenize", json=body).json()["tokens"]


def test_completion_return_token_ids_and_prompt_logprobs(server):
    client = server.openai(strict=True)
    prompt_ids = _tokenize(server, prompt=PROMPT)
    extra = {"return_token_ids": True, "prompt_logprobs": 2}
    response = client.completions.create(model=None, prompt=PROMPT, extra_body=extra, **GREEDY)
    choice = response.choices[0].model_dump()
    assert choice["prompt_token_ids"] == prompt_ids
    assert len(choice["token_ids"]) == response.usage.completion_tokens
    prompt_logprobs = choice["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt_ids)
    for token_id, entry in zip(prompt_ids[1:], prompt_logprobs[1:], strict=True):
        assert next(iter(entry)) == str(token_id)  # the prompt token first, then the top 2
        assert set(entry[str(token_id)]) == {"logprob", "rank", "decoded_token"}
        assert 1 <= len(entry) <= 3
    # the same request from token ids, streamed: the same ids, the prompt's in the first chunk
    stream = server.openai(strict=False).completions.create(  # chunks have null reasons
        model=None, prompt=prompt_ids, stream=True, extra_body=extra, **GREEDY
    )
    chunks = [c.choices[0].model_dump() for c in stream if c.choices]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert chunks[0]["prompt_logprobs"] == prompt_logprobs
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    # not asked for: not in the JSON at all
    plain = client.completions.create(model=None, prompt=PROMPT, **GREEDY).choices[0]
    assert not {"prompt_token_ids", "token_ids", "prompt_logprobs"} & set(plain.model_dump())


def test_chat_return_token_ids_and_prompt_logprobs(server):
    client = server.openai(strict=True)
    messages = [{"role": "user", "content": "Name a color."}]
    prompt_ids = _tokenize(server, messages=messages)
    extra = {"return_token_ids": True, "prompt_logprobs": 1}
    response = client.chat.completions.create(
        model="", messages=messages, extra_body=extra, **GREEDY
    ).model_dump()
    assert response["prompt_token_ids"] == prompt_ids
    assert len(response["prompt_logprobs"]) == len(prompt_ids)
    token_ids = response["choices"][0]["token_ids"]
    assert len(token_ids) == response["usage"]["completion_tokens"]
    stream = client.chat.completions.create(
        model="", messages=messages, stream=True, extra_body=extra, **GREEDY
    )
    chunks = [c.model_dump() for c in stream]
    firsts = [c for c in chunks if c.get("prompt_token_ids")]
    assert len(firsts) == 1 and firsts[0]["prompt_token_ids"] == prompt_ids
    assert firsts[0]["prompt_logprobs"] == response["prompt_logprobs"]
    streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert streamed == token_ids


def test_echo_with_logprobs_scores_the_prompt(server):
    client = server.openai(strict=True)
    prompt_ids = _tokenize(server, prompt=PROMPT)
    scored = client.completions.create(
        model=None, prompt=PROMPT, extra_body={"prompt_logprobs": 2}, **GREEDY
    ).choices[0]
    for stream in (False, True):
        # the SDK's types say float, but the echoed first token's logprob is null (as at
        # OpenAI and vLLM): its default, lenient parsing takes it
        response = server.openai(strict=False).completions.create(
            model=None, prompt=PROMPT, echo=True, logprobs=2, stream=stream, **GREEDY
        )
        choices = [c.choices[0] for c in response] if stream else [response.choices[0]]
        text = "".join(c.text for c in choices)
        tokens = [t for c in choices for t in c.logprobs.tokens]
        token_logprobs = [lp for c in choices for lp in c.logprobs.token_logprobs]
        top = [t for c in choices for t in c.logprobs.top_logprobs]
        assert text.startswith(PROMPT)
        assert len(tokens) == len(prompt_ids) + 6
        assert token_logprobs[0] is None and top[0] is None
        expected = [next(iter(e.values()))["logprob"] for e in scored.prompt_logprobs[1:]]
        assert token_logprobs[1 : len(prompt_ids)] == pytest.approx(expected, rel=1e-5)
        assert all(isinstance(lp, float) for lp in token_logprobs[1:])
        offsets = [o for c in choices for o in c.logprobs.text_offset]
        assert offsets == sorted(offsets)


def test_logprobs_with_n_above_one(server):
    client = server.openai(strict=True)
    response = client.completions.create(
        model=None, prompt=PROMPT, n=3, logprobs=1, temperature=1.0, seed=3, max_tokens=4
    )
    assert len(response.choices) == 3
    for choice in response.choices:
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) > 0
    chat = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Hi"}],
        n=2,
        logprobs=True,
        top_logprobs=2,
        max_tokens=4,
        seed=5,
    )
    assert [len(c.logprobs.content) > 0 for c in chat.choices] == [True, True]


def test_token_id_prompts_on_completions(server):
    client = server.openai(strict=True)
    prompt_ids = _tokenize(server, prompt=PROMPT)
    by_text = client.completions.create(model=None, prompt=PROMPT, **GREEDY)
    by_ids = client.completions.create(model=None, prompt=[prompt_ids, prompt_ids], **GREEDY)
    assert [c.text for c in by_ids.choices] == [by_text.choices[0].text] * 2


def test_use_beam_search_is_refused(server):
    client = server.openai(strict=True)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(
            model=None, prompt=PROMPT, extra_body={"use_beam_search": True}, **GREEDY
        )
    body = error.value.body
    assert body["param"] == "use_beam_search" and "beam search" in body["message"]
    # false is the default: accepted
    client.completions.create(
        model=None, prompt=PROMPT, extra_body={"use_beam_search": False}, **GREEDY
    )


HOSTILE = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "1.5",
    '"3"',
    "true",
    "[]",
    "{}",
    "-1",
    "21",
    "2147483648",
    "1e-300",
]


@pytest.mark.parametrize(
    ("route", "field"),
    [
        ("/v1/completions", "prompt_logprobs"),
        ("/v1/completions", "return_token_ids"),
        ("/v1/completions", "use_beam_search"),
        ("/v1/chat/completions", "prompt_logprobs"),
        ("/v1/chat/completions", "return_token_ids"),
    ],
)
def test_hostile_token_io_values_are_400s_naming_the_field(server, route, field):
    base = {"model": "", "max_tokens": 2}
    base.update(
        {"prompt": "Hi"}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    values = HOSTILE if field == "prompt_logprobs" else ["NaN", '"yes"', "[]", "{}", "2"]
    with server.client() as client:
        for value in values:
            body = json.dumps(base)[:-1] + f', "{field}": {value}}}'
            headers = {"content-type": "application/json"}
            response = client.post(route, content=body, headers=headers)
            assert response.status_code == 400, (value, response.text)
            error = response.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"}
            assert error["param"] == field, (value, error)
        assert client.get("/health").status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200

"""What one request may cost (issue 41, "One request can still cost minutes and hundreds of
MB"), through live servers, their gRPC port and the router:

- `prompt_logprobs` with `n`: computed once per request. The prefix-cache counters of
  /metrics count the prompt tokens the engine computed (looked up minus found): the prompt
  once plus at most a partial block per other choice, not `n` prompts; every choice still
  carries the same prompt logprobs (completions: on each choice, as vLLM does).
- `--max-prompt-logprobs-entries`: the entries the response would hold (prompt tokens x
  (k + 1) x the copies it holds: each choice on completions, once on chat and gRPC) are
  refused with a 400 naming the flag, before any work; at the limit they are served.
- `--max-request-prompt-tokens`: the total prompt tokens over a request's prompts or
  embedding inputs (default 8 x the context length), a 400 naming it on completions, chat,
  responses, Anthropic messages and embeddings, INVALID_ARGUMENT on gRPC, and the router
  passes the worker's 400 on.
- Hostile values of the flags (NaN, inf, 0, negative, a float) fail in one line with status
  2 before the model loads; hostile `n` / `prompt_logprobs` values are 400s (HTTP) and
  INVALID_ARGUMENT (gRPC), and the servers keep serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import grpc
import httpx
import pytest
from cluster_process import ClusterProcess
from live_server import LiveServer, free_port

from nanollmserve.api.grpc_client import connect
from nanollmserve.cli.main import build_parser
from nanollmserve.request_limits import limits_from_args

pytestmark = [pytest.mark.milestone("m27"), pytest.mark.timeout(300)]

API_KEY = "cost-key-123"
CONTEXT = 512  # --max-model-len of the servers: the default total is 8 x this
TIGHT_TOTAL = 300  # --max-request-prompt-tokens of the tight server
TIGHT_ENTRIES = 2000  # --max-prompt-logprobs-entries of the tight server
BLOCK_SIZE = 16


WORDS = ("apple", "river", "stone", "green", "house", "light", "cloud", "music", "table", "water")


def _words(n: int) -> str:
    """A text of `n` tokens for the bundled tokenizer (one token per word)."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(n))


def _ids(n: int, start: int = 100) -> list[int]:
    """A prompt of exactly `n` token ids."""
    return [start + (i % 500) for i in range(n)]


@pytest.fixture(scope="module")
def default_server():
    """The default request-cost flags (only a small context, so that 8 contexts are cheap)."""
    grpc_port = free_port()
    server = LiveServer.start(
        "--max-model-len", str(CONTEXT), "--grpc-port", str(grpc_port), api_key=API_KEY
    )
    server.grpc_target = f"127.0.0.1:{grpc_port}"
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tight_server():
    grpc_port = free_port()
    server = LiveServer.start(
        "--max-model-len", str(CONTEXT), "--grpc-port", str(grpc_port),
        "--max-request-prompt-tokens", str(TIGHT_TOTAL),
        "--max-prompt-logprobs-entries", str(TIGHT_ENTRIES),
        api_key=API_KEY,
    )  # fmt: skip
    server.grpc_target = f"127.0.0.1:{grpc_port}"
    yield server
    server.stop()


def _error(response: httpx.Response, flag: str, param: str | None = None) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert flag in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    return error


def _metric(client: httpx.Client, name: str) -> float:
    text = client.get("/metrics").text
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _computed_prompt_tokens(client: httpx.Client) -> float:
    """Prompt tokens the engine computed so far: looked up in the prefix cache minus found."""
    queries = _metric(client, "nanollmserve:prefix_cache_queries_total")
    return queries - _metric(client, "nanollmserve:prefix_cache_hits_total")


# -- prompt logprobs once per request -----------------------------------------------------------
def test_prompt_logprobs_with_n_are_computed_once_and_given_to_every_choice(default_server):
    n, k, length = 4, 2, 200
    prompt = _ids(length, start=1000)
    with default_server.client() as client:
        before = _computed_prompt_tokens(client)
        response = client.post(
            "/v1/completions",
            json={
                "prompt": prompt, "n": n, "max_tokens": 2, "temperature": 1.0, "seed": 7,
                "prompt_logprobs": k,
            },
        )  # fmt: skip
        assert response.status_code == 200, response.text
        computed = _computed_prompt_tokens(client) - before
        choices = response.json()["choices"]
        # The prompt once; each other choice at most its partial last block (old: n x 200).
        assert length <= computed <= length + (n - 1) * BLOCK_SIZE, computed
        assert len(choices) == n
        first = choices[0]["prompt_logprobs"]
        assert len(first) == length and first[0] is None
        assert all(1 <= len(entry) <= k + 1 for entry in first[1:])
        assert all(c["prompt_logprobs"] == first for c in choices)

        # Streamed, each choice's first chunk carries the same prompt logprobs.
        seen = {}
        with client.stream(
            "POST",
            "/v1/completions",
            json={
                "prompt": prompt, "n": n, "max_tokens": 3, "temperature": 1.0,
                "prompt_logprobs": k, "stream": True,
            },
        ) as stream:  # fmt: skip
            for line in stream.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    seen.setdefault(choice["index"], choice.get("prompt_logprobs"))
        assert sorted(seen) == list(range(n))
        assert all(value == first for value in seen.values())

        # Chat: once on the response, computed once too.
        before = _computed_prompt_tokens(client)
        response = client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": _words(200)}], "n": n,
                "max_tokens": 2, "prompt_logprobs": k,
            },
        )  # fmt: skip
        assert response.status_code == 200, response.text
        body = response.json()
        chat_length = body["usage"]["prompt_tokens"]
        computed = _computed_prompt_tokens(client) - before
        assert chat_length <= computed <= chat_length + (n - 1) * BLOCK_SIZE, computed
        assert len(body["prompt_logprobs"]) == chat_length


# -- the default limits -------------------------------------------------------------------------
@pytest.mark.timeout(900)
def test_default_total_is_eight_contexts_over_http_and_grpc(default_server):
    """9 prompts of 500 tokens (4,500 > 8 x 512) are refused before any runs; 8 are served
    (4,000 prompt tokens: minutes on one loaded core, hence the long read timeout)."""
    limit = 8 * CONTEXT
    with default_server.client(timeout=600) as client:
        before = _computed_prompt_tokens(client)
        response = client.post(
            "/v1/completions",
            json={"prompt": [_ids(500, start=s) for s in range(9)], "max_tokens": 1},
        )
        error = _error(response, f"--max-request-prompt-tokens {limit}", "prompt")
        assert "4500" in error["message"]
        assert _computed_prompt_tokens(client) == before  # nothing ran
        ok = client.post(
            "/v1/completions",
            json={"prompt": [_ids(500, start=s) for s in range(8)], "max_tokens": 1},
        )
        assert ok.status_code == 200, ok.text

    async def batch():
        async with await connect(default_server.grpc_target, api_key=API_KEY) as grpc_client:
            prompts = [_words(500)] * 9
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await grpc_client.batch_generate(prompts, max_tokens=1, timeout=120)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "--max-request-prompt-tokens" in raised.value.details()

    asyncio.run(batch())


def test_default_prompt_logprobs_entries_limit(default_server):
    """500 tokens x 21 x 25 choices = 262,500 entries > 262,144: a 400 before any work."""
    with default_server.client() as client:
        before = _computed_prompt_tokens(client)
        response = client.post(
            "/v1/completions",
            json={"prompt": _ids(500), "n": 25, "max_tokens": 1, "prompt_logprobs": 20},
        )
        error = _error(response, "--max-prompt-logprobs-entries 262144", "prompt_logprobs")
        assert "262500" in error["message"]
        assert _computed_prompt_tokens(client) == before


# -- the tight server: every surface ------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [_ids(200), _ids(101)], "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": _words(400), "max_tokens": 1}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": _words(400)}], "max_tokens": 1},
            "messages",
        ),
        ("/v1/responses", {"input": _words(400), "max_output_tokens": 16}, None),
    ],
)
def test_total_prompt_tokens_over_http(tight_server, path, body, param):
    with tight_server.client() as client:
        _error(client.post(path, json=body), f"--max-request-prompt-tokens {TIGHT_TOTAL}", param)


def test_total_prompt_tokens_on_anthropic_messages(tight_server):
    with tight_server.client() as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        response = client.post(
            "/v1/messages",
            headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"},
            json={
                "model": model, "max_tokens": 8,
                "messages": [{"role": "user", "content": _words(400)}],
            },
        )  # fmt: skip
        assert response.status_code == 400, response.text
        assert f"--max-request-prompt-tokens {TIGHT_TOTAL}" in response.text
        # At the limit: served.
        ok = client.post(
            "/v1/completions", json={"prompt": [_ids(150), _ids(150)], "max_tokens": 1}
        )
        assert ok.status_code == 200, ok.text


def test_prompt_logprobs_entries_count_the_copies_a_response_holds(tight_server):
    """Completions repeat them in each choice (n copies), chat holds them once."""
    with tight_server.client() as client:
        # 100 tokens x 3 x 7 choices = 2,100 > 2,000.
        response = client.post(
            "/v1/completions",
            json={"prompt": _ids(100), "n": 7, "max_tokens": 1, "prompt_logprobs": 2},
        )
        error = _error(response, f"--max-prompt-logprobs-entries {TIGHT_ENTRIES}")
        assert "2100" in error["message"]
        # echo with logprobs puts them in front of each choice's logprobs too: 2 copies each.
        response = client.post(
            "/v1/completions",
            json={
                "prompt": _ids(100), "n": 4, "max_tokens": 1, "prompt_logprobs": 2,
                "echo": True, "logprobs": 1,
            },
        )  # fmt: skip
        _error(response, f"--max-prompt-logprobs-entries {TIGHT_ENTRIES}")
        # 100 x 3 x 6 = 1,800: served.
        ok = client.post(
            "/v1/completions",
            json={"prompt": _ids(100), "n": 6, "max_tokens": 1, "prompt_logprobs": 2},
        )
        assert ok.status_code == 200, ok.text
        # Chat: n does not multiply them (~230 tokens x 3 x 1 < 2,000).
        ok = client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": _words(200)}], "n": 8,
                "max_tokens": 1, "prompt_logprobs": 2,
            },
        )  # fmt: skip
        assert ok.status_code == 200, ok.text
        # But k does (~230 x 21 > 2,000).
        response = client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": _words(200)}], "max_tokens": 1,
                "prompt_logprobs": 20,
            },
        )  # fmt: skip
        _error(response, f"--max-prompt-logprobs-entries {TIGHT_ENTRIES}", "prompt_logprobs")


@pytest.mark.parametrize(
    "fields",
    [
        {"n": 0},
        {"n": -3},
        {"n": 10**12},
        {"n": float("inf")},
        {"n": 2.5},
        {"prompt_logprobs": -1},
        {"prompt_logprobs": 10**9},
        {"prompt_logprobs": 1.5},
        {"prompt_logprobs": "nan"},
        {"n": 64, "prompt_logprobs": 20},  # each allowed alone: 134,400 entries together
        {"n": 2, "prompt_logprobs": 10},  # 2,200 entries
        {"n": 10**6, "prompt_logprobs": 10**6},
    ],
)
def test_hostile_n_and_k_over_http(tight_server, fields):
    with tight_server.client() as client:
        body = {"prompt": _ids(100), "max_tokens": 1, **fields}
        content = json.dumps(body).replace("Infinity", "1e999")
        response = client.post(
            "/v1/completions", content=content, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] in fields, error
        n, k = fields.get("n"), fields.get("prompt_logprobs")
        if isinstance(n, int) and 1 <= n <= 64 and isinstance(k, int) and 0 <= k <= 20:
            assert "--max-prompt-logprobs-entries" in error["message"], error
        assert client.get("/health").status_code == 200


def test_grpc_refuses_what_http_refuses(tight_server):
    async def calls():
        async with await connect(tight_server.grpc_target, api_key=API_KEY) as client:
            cases = [
                (client.generate, (_words(400),), {}, "--max-request-prompt-tokens"),
                (client.batch_generate, ([_words(120)] * 3,), {}, "--max-request-prompt-tokens"),
                # 100 tokens x 21 > 2,000
                (client.generate, (_words(100),), {"prompt_logprobs": 20}, "entries"),
                (client.generate, (_words(20),), {"prompt_logprobs": 10**6}, "prompt_logprobs"),
            ]
            for method, args, sampling, words in cases:
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await method(*args, max_tokens=1, timeout=120, **sampling)
                assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, sampling
                assert words in raised.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                stream = client.stream(_words(400), max_tokens=1, timeout=120)
                async for _ in stream:
                    pass
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            reply = await client.generate(_words(40), max_tokens=1, prompt_logprobs=2, timeout=120)
            assert len(reply.prompt_logprobs) == reply.prompt_tokens

    asyncio.run(calls())


def test_router_passes_the_workers_400_on(tight_server):
    port = free_port()
    router = ClusterProcess.start(
        "router", port, "--port", str(port), "--worker", tight_server.url,
        "--health-interval", "0.5", api_key=API_KEY, num_workers=1,
    )  # fmt: skip
    try:
        with httpx.Client(base_url=router.url, headers=router.headers, timeout=120) as client:
            response = client.post(
                "/v1/completions", json={"prompt": [_ids(200), _ids(200)], "max_tokens": 1}
            )
            _error(response, f"--max-request-prompt-tokens {TIGHT_TOTAL}", "prompt")
            response = client.post(
                "/v1/completions",
                json={"prompt": _ids(100), "n": 7, "max_tokens": 1, "prompt_logprobs": 2},
            )
            _error(response, f"--max-prompt-logprobs-entries {TIGHT_ENTRIES}")
            ok = client.post("/v1/completions", json={"prompt": _ids(50), "max_tokens": 1})
            assert ok.status_code == 200, ok.text
    finally:
        router.stop()


def test_embeddings_total_over_the_inputs():
    server = LiveServer.start(
        "--runner", "pooling", "--max-model-len", str(CONTEXT),
        "--max-request-prompt-tokens", str(TIGHT_TOTAL), api_key=API_KEY,
    )  # fmt: skip
    try:
        with server.client() as client:
            response = client.post("/v1/embeddings", json={"input": [_ids(200), _ids(101)]})
            _error(response, f"--max-request-prompt-tokens {TIGHT_TOTAL}", "input")
            ok = client.post("/v1/embeddings", json={"input": [_ids(200), _ids(100)]})
            assert ok.status_code == 200, ok.text
            assert ok.json()["usage"]["prompt_tokens"] == 300
    finally:
        server.stop()


# -- hostile flag values ------------------------------------------------------------------------
HOSTILE_FLAG_VALUES = ["nan", "inf", "-inf", "-5", "1.5", "1e9", ""]


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--max-request-prompt-tokens", v) for v in [*HOSTILE_FLAG_VALUES, "0"]]
    + [("--max-prompt-logprobs-entries", v) for v in HOSTILE_FLAG_VALUES],
)
def test_hostile_flag_values_fail_with_status_2_before_the_model_loads(flag, value):
    """(0 entries is allowed: no prompt logprobs at all.)"""
    result = subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", "serve", "--port", "0", flag, value],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]  # argparse prints the usage before it
    # The value is refused by name (argparse's type check or the limit's own), not the flag.
    assert f"argument {flag}:" in last or f"{flag} must be" in last, result.stderr
    assert "Traceback" not in result.stderr and "loaded" not in result.stderr


def test_flag_values_parse_and_a_huge_one_means_no_tighter_limit():
    parser = build_parser()
    args = parser.parse_args(["serve", "--max-request-prompt-tokens", str(10**40)])
    limits = limits_from_args(args)
    assert limits.prompt_tokens_limit(CONTEXT) == 10**40
    default = limits_from_args(parser.parse_args(["serve"]))
    assert default.prompt_tokens_limit(CONTEXT) == 8 * CONTEXT
    assert default.max_prompt_logprobs_entries == 1 << 18


# -- the memory a step of prompt logprobs takes -------------------------------------------------
PEAK_SCRIPT = """
import resource
from nanollmserve import LLM, SamplingParams
llm = LLM()
llm.generate(["warm up"], SamplingParams(max_tokens=1), use_tqdm=False)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
prompt = [100 + (i % 500) for i in range(500)]
[out] = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=20), use_tqdm=False)
assert len(out.prompt_logprobs) == 500
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)
"""


def test_scoring_a_prompt_step_keeps_its_vocabulary_rows_a_slice_at_a_time():
    """A 500-token prompt scored in one step: its logits rows (500 x 49,152 floats, ~94 MiB)
    were copied to float, log-softmaxed and compared whole (+328 MiB of peak RSS on the old
    code); a slice of rows at a time, the peak stays near the logits themselves (+98 MiB)."""
    result = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    growth_mib = int(result.stdout.strip().splitlines()[-1])
    assert growth_mib < 200, growth_mib

"""Speculative decoding (m16) as users see it: a live `serve --speculative-config` (ngram) on
the bundled model driven by the openai client (streaming deltas carrying several tokens,
logprobs, stop strings, max_tokens, the `spec_decode_*` metrics and /stats; structured
output requests, concurrent with an unconstrained one, answering exactly as the shared
server without speculation does, streamed, with n > 1 and a stop string, and validating
when sampled), and the CLI (`generate --show-stats`, a bad config)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from live_server import LiveServer, shared_server
from spec_decode_prompts import ASK_JSON, REGEX, SCHEMA

pytestmark = pytest.mark.milestone("m16")

MODEL = "SmolLM2-135M-Instruct"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
# Code that repeats: the continuation copies it, so prompt lookup finds long runs.
PROMPT = "def add(a, b):\n    return a + b\n\n" * 3 + "def add("


@pytest.fixture(scope="module")
def server():
    server = LiveServer.start("--num-kv-blocks", "128", "--speculative-config", json.dumps(SPEC))
    yield server
    server.stop()


def test_streaming_logprobs_stop_strings_and_metrics(server):
    client = server.openai()
    model = client.models.list().data[0].id
    assert model == MODEL
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=40, temperature=0, logprobs=1)
    full = client.completions.create(**kwargs)
    choice = full.choices[0]
    assert full.usage.completion_tokens == 40 and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == 40  # one logprob entry per token
    assert "return a + b" in choice.text

    # Streamed completions carry finish_reason null until the last chunk: read unstrictly.
    chunks = list(server.openai(strict=False).completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == choice.text
    tokens_per_chunk = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices]
    assert sum(tokens_per_chunk) == 40
    assert max(tokens_per_chunk) > 1  # accepted drafts arrive together in one delta

    # A stop string inside an accepted run cuts the text (and the tokens) right there.
    stop = "a + b"
    cut = client.completions.create(**{**kwargs, "stop": [stop]}).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == choice.text[: choice.text.index(stop)]
    assert len(cut.logprobs.tokens) < 40

    stats = server.stats()["spec_decode"]
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] > 0
    assert stats["mean_acceptance_length"] > 1.5
    assert sum(stats["num_accepted_tokens_per_pos"]) == stats["num_accepted_tokens"]
    metrics = scrape(server.url)
    labels = f'model_name="{MODEL}"'
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert metrics[f"nanollmserve:spec_decode_{name}_total{{{labels}}}"] == stats[name]
    per_pos = "nanollmserve:spec_decode_num_accepted_tokens_per_pos_total"
    assert metrics[f'{per_pos}{{{labels},position="0"}}'] == stats["num_accepted_tokens_per_pos"][0]


JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
JSON = {"response_format": JSON_FORMAT}
CONSTRAINED = {
    "json_schema": JSON,
    "regex": {"extra_body": {"structured_outputs": {"regex": REGEX}}},
    "choice": {"extra_body": {"structured_outputs": {"choice": ["Ada Lovelace", "Alan Turing"]}}},
    "unconstrained": {},
}


def test_structured_output_with_drafts_answers_as_without(server, compat):
    reference_server = shared_server()  # no speculation
    model = MODEL

    def ask(srv, extra, **kwargs):
        args = {"max_tokens": 80, "temperature": 0, **extra, **kwargs}
        return srv.openai().chat.completions.create(model=model, messages=ASK_JSON, **args)

    def answers(srv, **kwargs):  # all four at once: they share steps
        with ThreadPoolExecutor(len(CONSTRAINED)) as pool:
            futures = {k: pool.submit(ask, srv, e, **kwargs) for k, e in CONSTRAINED.items()}
            return {k: [c.message.content for c in f.result().choices] for k, f in futures.items()}

    before = server.stats()["spec_decode"]["num_accepted_tokens"]
    expected = answers(reference_server)
    assert answers(server) == expected
    assert server.stats()["spec_decode"]["num_accepted_tokens"] > before
    text = expected["json_schema"][0]
    jsonschema.validate(json.loads(text), SCHEMA)
    assert re.fullmatch(REGEX, expected["regex"][0])
    assert expected["unconstrained"][0] != text

    # Alone: the constrained request gets drafts and keeps some.
    before = server.stats()["spec_decode"]
    assert ask(server, JSON).choices[0].message.content == text
    assert server.stats()["spec_decode"]["num_accepted_tokens"] - before["num_accepted_tokens"] >= 8
    drafts = server.stats()["spec_decode"]["num_drafts"] - before["num_drafts"]
    compat.exercised("spec", num_drafts=drafts)
    compat.exercised("structured", output=text, schema=SCHEMA)

    # n > 1 and a stop string inside a drafted run: as without speculation.
    assert answers(server, n=2) == answers(reference_server, n=2)
    stopped = ask(server, JSON, stop=['"city"']).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.message.content == text[: text.index('"city"')]

    # Streamed with logprobs: deltas carry several tokens and join to the same text.
    stream = server.openai(strict=False).chat.completions.create(
        model=model, messages=ASK_JSON, max_tokens=80, temperature=0, stream=True,
        logprobs=True, response_format=JSON_FORMAT,
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert max(len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs) > 1

    # Sampled at temperature 1.0: every answer still follows the schema.
    sampled = ask(server, JSON, temperature=1.0, seed=5, n=3, max_tokens=120)
    for choice in sampled.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def scrape(url: str) -> dict[str, float]:
    """`name{labels}` -> value of every sample of /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_show_stats_and_a_bad_config():
    proc = run_cli(
        "generate", "--dtype", "float32", "--prompt", PROMPT, "--max-tokens", "24",
        "--ignore-eos", "--speculative-config", json.dumps(SPEC), "--show-stats",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    stats = dict(line.split(": ", 1) for line in proc.stderr.splitlines() if ": " in line)
    assert int(stats["generated_tokens"]) == 24
    assert int(stats["spec_decode_num_accepted_tokens"]) > 0
    assert float(stats["spec_decode_mean_acceptance_length"]) > 1
    bad = run_cli("serve", "--speculative-config", '{"method": "ngram"}')
    assert bad.returncode == 2
    assert "num_speculative_tokens" in bad.stderr and "Traceback" not in bad.stderr

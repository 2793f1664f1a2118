"""Speculative decoding (m16) as users see it: a live `serve --speculative-config` (ngram) on
the bundled model driven by the openai client (streaming deltas carrying several tokens,
logprobs, stop strings, max_tokens, the `spec_decode_*` metrics and /stats), and the CLI
(`generate --show-stats`, a bad config)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from live_server import LiveServer

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

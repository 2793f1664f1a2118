"""`nanollmserve bench serve` end to end: it starts our server, measures it and reports exact
counts; the shared-prefix workload hits the prefix cache; Poisson arrivals, goodput, plots.
Plus the pure parts (workloads, metrics, SSE client) against a stub server."""

from __future__ import annotations

import asyncio
import json

import pytest
from bench_cli import run_bench

from nanollmserve.bench.serve_client import OpenAIBackend, RequestResult, server_root
from nanollmserve.bench.serve_metrics import parse_goodput, summarize
from nanollmserve.bench.serve_workloads import (
    WordTokens,
    random_workload,
    shared_prefix_workload,
    sharegpt_workload,
)

pytestmark = [pytest.mark.milestone("m12"), pytest.mark.slow]


@pytest.fixture(scope="module")
def tokenizer():
    from nanollmserve.frontend.tokenizer import load_tokenizer
    from nanollmserve.model.source import resolve_model

    return load_tokenizer(resolve_model(None).path)


def test_serve_against_our_own_server_reports_exact_counts(tmp_path):
    plot, out = tmp_path / "serve.png", tmp_path / "serve.json"
    result = run_bench(
        "serve", "--num-prompts", "8", "--max-concurrency", "4",
        "--input-len", "16-32", "--output-len", "8", "--ignore-eos",
        "--server-args", "--dtype float32 --num-kv-blocks 256",
        "--goodput", "ttft:60000", "tpot:60000",
        "--plot", str(plot), "--output", str(out), "--save-detailed",
    )  # fmt: skip
    assert json.loads(out.read_text()) == result
    assert result["model"] == "SmolLM2-135M-Instruct"  # read from /v1/models
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["token_count_source"] == "usage"
    per_request = result["requests"]
    assert result["total_output_tokens"] == sum(r["output_tokens"] for r in per_request) == 64
    assert result["total_input_tokens"] == sum(r["prompt_tokens"] for r in per_request)
    assert 8 * 16 <= result["total_input_tokens"] <= 8 * 32  # word prompts: 1 token a word
    assert 1 <= result["max_concurrent_requests"] <= 4
    assert result["server"]["peak_running_requests_since_start"] >= 2
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(result[key]) == {"mean", "p50", "p95", "p99", "max"}
        assert result[key]["p50"] > 0
    assert result["ttft_ms"]["p99"] <= result["e2el_ms"]["max"]
    assert result["goodput"]["good_requests"] == 8  # generous SLOs: every request meets them
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_shared_prefix_hits_the_cache_with_poisson_arrivals():
    result = run_bench(
        "serve", "--workload", "shared-prefix", "--num-groups", "2", "--prefix-len", "64",
        "--num-prompts", "6", "--input-len", "8", "--output-len", "4", "--ignore-eos",
        "--request-rate", "20", "--endpoint", "chat",
        "--server-args", "--dtype float32 --num-kv-blocks 256", "--disable-tqdm",
    )  # fmt: skip
    assert result["request_rate"] == 20 and result["endpoint"] == "chat"
    assert result["completed"] == 6 and result["total_output_tokens"] == 24
    # Later requests find their group's 64-token system prompt (4 blocks of 16) cached.
    assert result["server"]["prefix_cache_hit_rate"] > 0
    assert result["server"]["prefix_cache_hit_tokens"] >= 64


def test_serve_grpc_backend_with_a_concurrency_sweep(tmp_path):
    plot = tmp_path / "sweep.png"
    result = run_bench(
        "serve", "--backend", "grpc", "--sweep-concurrency", "1,3", "--num-prompts", "3",
        "--input-len", "8", "--output-len", "4", "--ignore-eos", "--disable-tqdm",
        "--server-args", "--dtype float32 --num-kv-blocks 128", "--plot", str(plot),
    )  # fmt: skip
    assert result["backend"] == "grpc" and result["model"] == "SmolLM2-135M-Instruct"
    assert [run["max_concurrency"] for run in result["sweep"]] == [1, 3]
    for run in result["sweep"]:
        assert run["completed"] == 3 and run["total_output_tokens"] == 12
        assert run["token_count_source"] == "usage"
    assert result["sweep"][0]["max_concurrent_requests"] == 1
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_word_prompts_have_exactly_the_drawn_token_counts(tokenizer):
    words = WordTokens(tokenizer)
    requests = random_workload(words, 5, "10-40", "3-5", seed=1)
    assert requests == random_workload(words, 5, "10-40", "3-5", seed=1)  # seeded
    for r in requests:
        assert tokenizer.encode(r.completion_prompt(), add_special_tokens=False) == (
            r.prompt_token_ids
        )
        assert 10 <= r.prompt_len <= 40 and 3 <= r.max_tokens <= 5
    shared = shared_prefix_workload(words, 12, 3, 32, "5", "2", seed=0)
    by_group = {g: [r for r in shared if r.group == g] for g in range(3)}
    assert [len(rs) for rs in by_group.values()] == [4, 4, 4]
    for rs in by_group.values():  # a group's requests share its system prompt and its ids
        assert len({r.system for r in rs}) == 1
        assert len({tuple(r.prompt_token_ids[:32]) for r in rs}) == 1
    assert len({rs[0].system for rs in by_group.values()}) == 3
    # Shuffled, not in turn (round robin over 3 workers would otherwise split the groups).
    assert [r.group for r in shared] != [i % 3 for i in range(12)]
    assert tokenizer.encode(shared[1].completion_prompt(), add_special_tokens=False) == (
        shared[1].prompt_token_ids
    )
    assert [m["role"] for m in shared[0].messages()] == ["system", "user"]


def test_sharegpt_file_is_read_and_filtered(tokenizer, tmp_path):
    long = "word " * 40
    records = [
        {"conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": long}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long}]},
        {"prompt": long, "max_tokens": 7},
    ]
    path = tmp_path / "sharegpt.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    requests = sharegpt_workload(tokenizer, path, 10, None, 2048, seed=0)
    assert len(requests) == 2  # "hi" is under 4 tokens
    reply_len = len(tokenizer.encode(long, add_special_tokens=False))
    assert sorted(r.max_tokens for r in requests) == sorted([7, reply_len])


def test_metrics_goodput_and_percentiles():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    for bad in (["ttft"], ["speed:5"], ["ttft:x"], ["e2el:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    fast = RequestResult(True, 10, 5, ttft=0.1, itl=[0.01] * 4, e2e=0.14)
    slow = RequestResult(True, 10, 5, ttft=0.9, itl=[0.05] * 4, e2e=1.1)
    failed = RequestResult(error="HTTP 503")
    summary = summarize([fast, slow, failed], 2.0, 2, {"ttft": 500})
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["total_output_tokens"] == 10 and summary["output_throughput"] == 5.0
    assert summary["goodput"]["good_requests"] == 1
    assert summary["goodput"]["request_goodput"] == 0.5
    assert summary["ttft_ms"]["p50"] == 500.0 and summary["ttft_ms"]["max"] == 900.0
    assert summary["tpot_ms"]["mean"] == pytest.approx((10 + 50) / 2)
    assert summary["errors"] == ["HTTP 503"]


def test_sse_client_times_chunks_and_falls_back_when_there_is_no_usage():
    """A server without usage in its stream (like llama-cpp-python) and without /tokenize:
    output tokens are the content chunks; TTFT and ITL come from the chunk times."""
    import httpx

    from nanollmserve.bench.serve_workloads import ServeRequest

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "stub"}]})
        if request.url.path == "/v1/completions":
            body = json.loads(request.content)
            assert body["model"] == "stub" and body["stream"] and body["ignore_eos"]
            chunks = [{"choices": [{"text": t}]} for t in ("", "a", "b", "c")]
            if body["max_tokens"] == 5:  # ends by length: exactly max_tokens tokens
                chunks[-1]["choices"][0]["finish_reason"] = "length"
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, text=text)
        return httpx.Response(404, json={"detail": "not found"})

    async def main():
        backend = OpenAIBackend("http://stub/v1/", extra_body={"ignore_eos": True})
        backend.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        backend.model = await backend.fetch_model()
        requests = [ServeRequest(" a b", [10, 11], 3), ServeRequest(" c", [12], 5)]
        results = [await backend.send(request) for request in requests]
        await backend.fill_missing_counts(requests, results)
        await backend.close()
        return results

    result, by_length = asyncio.run(main())
    assert by_length.output_tokens == 5 and by_length.count_source == "length"
    assert result.success and result.text == "abc" and len(result.itl) == 2
    assert result.output_tokens == 3 and result.count_source == "chunks"
    assert result.prompt_tokens == 2  # the intended count, as no server count exists
    assert 0 < result.ttft <= result.e2e
    assert server_root("http://h:1/v1/") == "http://h:1"


@pytest.mark.milestone("m11")
def test_serve_compares_http_and_grpc_in_one_json():
    result = run_bench(
        "serve", "--backend", "both", "--num-prompts", "3", "--max-concurrency", "3",
        "--input-len", "16", "--output-len", "4", "--ignore-eos", "--disable-tqdm",
        "--server-args", "--dtype float32",
    )  # fmt: skip
    assert result["backend"] == "both"
    for name in ("openai", "grpc"):
        run = result[name]
        assert run["backend"] == name
        assert run["completed"] == 3 and run["failed"] == 0
        assert run["total_output_tokens"] == 12
    assert result["ratios"]["grpc_vs_openai_output_throughput"] > 0

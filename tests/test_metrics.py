"""Prometheus metrics: exact counters and histograms of ServerMetrics fed by hand, the stats
log line, then a live server's /metrics after known requests (token counts, request counts,
histogram counts and per-step tokens all exact), KV usage back to 0 after an abort, and who
may read /metrics (open with --api-key, closed with --metrics-require-auth)."""

from __future__ import annotations

import time

import httpx
import pytest
from live_server import LiveServer, shared_server
from prometheus_client.parser import text_string_to_metric_families

from nanollmserve.engine.kv_cache import KVCacheStats
from nanollmserve.engine.stats import EngineStats, StepStats
from nanollmserve.metrics import ServerMetrics, format_stats_line
from nanollmserve.metrics.prometheus import SIMPLE_LATENCY_BUCKETS_S, build_1_2_5_buckets
from nanollmserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

pytestmark = pytest.mark.milestone("m10")

MODEL = "SmolLM2-135M-Instruct"
LABELS = {"model_name": "m"}


# -- ServerMetrics fed by hand ----------------------------------------------------------------
def engine_stats(
    *,
    running=0,
    waiting=0,
    used=0,
    prompt=0,
    generated=0,
    preempted=0,
    queries=0,
    hits=0,
    step=None,
) -> EngineStats:
    kv = KVCacheStats(
        num_blocks=10,
        block_size=16,
        num_used_blocks=used,
        num_free_blocks=10 - used,
        num_cached_blocks=0,
        allocated_tokens=0,
        reserved_tokens=0,
        peak_used_blocks=used,
    )
    return EngineStats(running, waiting, kv, queries, hits, preempted, 0, prompt, generated, step)


def finished(reason: str, num_prompt=3, num_generated=2, arrival=100.0) -> RequestOutput:
    metrics = RequestMetrics(
        arrival_time=arrival,
        first_scheduled_time=arrival + 0.5,
        first_token_time=arrival + 1.0,
        last_token_time=arrival + 2.0,
        finished_time=arrival + 2.0,
        num_prompt_tokens=num_prompt,
        num_generation_tokens=num_generated,
    )
    choice = CompletionOutput(0, "x", list(range(num_generated)), finish_reason=reason)
    return RequestOutput("r", "p", list(range(num_prompt)), [choice], True, metrics=metrics)


def value(metrics: ServerMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, {**LABELS, **labels})


def test_counters_follow_the_engine_totals_exactly():
    current = {"stats": engine_stats()}
    metrics = ServerMetrics("m", lambda: current["stats"])
    steps = [
        engine_stats(prompt=5, generated=1, queries=5, step=StepStats(5, [])),
        engine_stats(prompt=5, generated=2, queries=5, step=StepStats(1, [0.02])),
        engine_stats(
            prompt=12, generated=4, queries=12, hits=0, preempted=1, step=StepStats(8, [0.03])
        ),
        engine_stats(
            prompt=12, generated=5, queries=28, hits=16, preempted=1, step=StepStats(1, [0.5])
        ),
    ]
    for stats in steps:
        metrics.on_step(stats)
    assert value(metrics, "nanollmserve:prompt_tokens_total") == 12
    assert value(metrics, "nanollmserve:generation_tokens_total") == 5
    assert value(metrics, "inference_tokens_generated_total") == 5
    assert value(metrics, "nanollmserve:num_preemptions_total") == 1
    assert value(metrics, "nanollmserve:prefix_cache_queries_total") == 28
    assert value(metrics, "nanollmserve:prefix_cache_hits_total") == 16
    assert value(metrics, "nanollmserve:iteration_tokens_total_count") == 4
    assert value(metrics, "nanollmserve:iteration_tokens_total_sum") == 15
    assert value(metrics, "nanollmserve:iteration_tokens_total_bucket", le="1.0") == 2
    assert value(metrics, "nanollmserve:inter_token_latency_seconds_count") == 3
    assert value(metrics, "nanollmserve:inter_token_latency_seconds_sum") == pytest.approx(0.55)
    assert value(metrics, "nanollmserve:inter_token_latency_seconds_bucket", le="0.025") == 1


def test_request_histograms_and_finish_reasons():
    metrics = ServerMetrics("m", engine_stats)
    for output in [finished("stop"), finished("length", 4, 6), finished("abort")]:
        metrics.on_request_finished(output)
    success = "nanollmserve:request_success_total"
    assert value(metrics, success, finished_reason="stop") == 1
    assert value(metrics, success, finished_reason="length") == 1
    assert value(metrics, "nanollmserve:num_aborted_requests_total") == 1
    assert value(metrics, "inference_requests_total") == 3
    # Request-level histograms: successful requests only.
    assert value(metrics, "nanollmserve:e2e_request_latency_seconds_count") == 2
    assert value(metrics, "nanollmserve:e2e_request_latency_seconds_sum") == pytest.approx(4.0)
    assert value(metrics, "nanollmserve:request_queue_time_seconds_sum") == pytest.approx(1.0)
    assert value(metrics, "nanollmserve:request_prompt_tokens_sum") == 7
    assert value(metrics, "nanollmserve:request_generation_tokens_sum") == 8
    assert value(metrics, "nanollmserve:request_generation_tokens_bucket", le="5.0") == 1
    # Token-time and simple-API histograms: every request that got there, aborted or not.
    assert value(metrics, "nanollmserve:time_to_first_token_seconds_count") == 3
    assert value(metrics, "inference_request_latency_seconds_count") == 3
    assert value(metrics, "inference_request_latency_seconds_bucket", le="2.5") == 3
    assert value(metrics, "inference_request_latency_seconds_bucket", le="1.0") == 0


def test_gauges_read_the_latest_stats_at_scrape_time():
    current = {"stats": engine_stats(running=2, waiting=1, used=4)}
    metrics = ServerMetrics("m", lambda: current["stats"])
    assert value(metrics, "nanollmserve:num_requests_running") == 2
    assert value(metrics, "nanollmserve:num_requests_waiting") == 1
    assert value(metrics, "nanollmserve:kv_cache_usage_perc") == pytest.approx(0.4)
    assert value(metrics, "nanollmserve:num_kv_blocks_free") == 6
    current["stats"] = engine_stats()  # e.g. an abort while idle: no step, still current
    assert value(metrics, "nanollmserve:kv_cache_usage_perc") == 0
    assert value(metrics, "nanollmserve:num_kv_blocks_free") == 10


def test_buckets():
    assert build_1_2_5_buckets(8192)[:4] == (1, 2, 5, 10)
    assert build_1_2_5_buckets(8192)[-1] == 5000
    assert SIMPLE_LATENCY_BUCKETS_S[0] == 0.1 and SIMPLE_LATENCY_BUCKETS_S[-1] == 50


def test_two_instances_do_not_clash():
    ServerMetrics("a", engine_stats)
    ServerMetrics("a", engine_stats)  # own registries: no "duplicated timeseries" error


def test_stats_log_line():
    before = engine_stats(prompt=100, generated=10)
    after = engine_stats(
        running=3, waiting=2, used=5, prompt=300, generated=50, queries=40, hits=10
    )
    line = format_stats_line(before, after, elapsed=2.0)
    assert line == (
        "engine stats: running=3 waiting=2 kv_usage=50.0% prompt=100.0 tok/s "
        "generation=20.0 tok/s prefix_cache_hit_rate=25.0%"
    )


# -- a live server ----------------------------------------------------------------------------
def scrape(url: str, headers=None) -> dict[tuple[str, frozenset], float]:
    response = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples


def get(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset({"model_name": MODEL, **labels}.items())), 0.0)


@pytest.fixture(scope="module")
def server():
    return shared_server()


def test_metrics_are_exact_after_known_requests(server):
    server.wait_idle()
    before = scrape(server.url)
    client = server.openai()
    usages, reasons = [], []
    for i, max_tokens in enumerate([3, 5, 8]):
        reply = client.completions.create(
            model=MODEL,
            prompt=f"Metrics test {i}: count to ten.",
            max_tokens=max_tokens,
            temperature=0,
        )
        usages.append(reply.usage)
        reasons.append(reply.choices[0].finish_reason)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    usages.append(chat.usage)
    reasons.append(chat.choices[0].finish_reason)
    server.wait_idle()
    after = scrape(server.url)

    def delta(name, **labels):
        return get(after, name, **labels) - get(before, name, **labels)

    n = len(usages)
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert delta("nanollmserve:generation_tokens_total") == completion
    assert delta("inference_tokens_generated_total") == completion
    assert delta("nanollmserve:prompt_tokens_total") == prompt
    assert delta("nanollmserve:prefix_cache_queries_total") == prompt
    assert delta("nanollmserve:prefix_cache_hits_total") == cached
    for reason in ("stop", "length"):
        expected = reasons.count(reason)
        assert delta("nanollmserve:request_success_total", finished_reason=reason) == expected
    assert delta("inference_requests_total") == n
    assert delta("nanollmserve:num_aborted_requests_total") == 0
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prompt_tokens",
    ):
        assert delta(f"nanollmserve:{histogram}_count") == n, histogram
    assert delta("inference_request_latency_seconds_count") == n
    assert delta("nanollmserve:request_prompt_tokens_sum") == prompt
    assert delta("nanollmserve:request_generation_tokens_sum") == completion
    assert delta("nanollmserve:inter_token_latency_seconds_count") == completion - n
    # Every step ran the uncached prompt tokens (prefill) or one token per decode.
    assert delta("nanollmserve:iteration_tokens_total_sum") == (prompt - cached) + (completion - n)
    assert get(after, "nanollmserve:num_requests_running") == 0
    assert get(after, "nanollmserve:kv_cache_usage_perc") == 0


def test_metrics_open_with_api_key_but_other_routes_closed(server):
    assert server.api_key
    assert httpx.get(f"{server.url}/stats", timeout=10).status_code == 401
    samples = scrape(server.url)  # no Authorization header
    assert ("nanollmserve:num_kv_blocks_free", frozenset({"model_name": MODEL}.items())) in samples


def test_kv_usage_returns_to_zero_after_an_aborted_stream(server):
    server.wait_idle()
    before = scrape(server.url)
    # ignore_eos: the request cannot end by itself before the disconnect aborts it (a sampled
    # answer that stopped after a few tokens made this test fail on a loaded machine).
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 500, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with server.client() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one token arrived; leaving closes the connection -> abort
    stats = server.wait_idle()
    after = scrape(server.url)
    delta = get(after, "nanollmserve:num_aborted_requests_total") - get(
        before, "nanollmserve:num_aborted_requests_total"
    )
    assert delta == 1
    assert get(after, "nanollmserve:kv_cache_usage_perc") == 0
    assert get(after, "nanollmserve:num_kv_blocks_free") == stats["num_total_blocks"]
    assert get(after, "nanollmserve:num_requests_running") == 0


def test_metrics_require_auth_and_stats_log_line():
    private = LiveServer.start(
        "--num-kv-blocks",
        "64",
        "--metrics-require-auth",
        "--log-stats-interval",
        "0.5",
        api_key="metrics-key",
    )
    try:
        assert httpx.get(f"{private.url}/metrics", timeout=10).status_code == 401
        samples = scrape(private.url, headers=private.headers)
        assert get(samples, "nanollmserve:num_kv_blocks_free") == 64
        deadline = time.monotonic() + 10
        while "engine stats: running=0 waiting=0 kv_usage=0.0%" not in private.log():
            assert time.monotonic() < deadline, private.log()
            time.sleep(0.2)
    finally:
        private.stop()

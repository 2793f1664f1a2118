"""ServerMetrics: the Prometheus metrics of one server, fed by the engine.

It is an AsyncEngine observer. On the engine thread, `on_step(stats)` adds what the step
changed to the counters (the engine keeps exact running totals; the counters follow their
differences) and observes the step's token count and inter-token latencies;
`on_request_finished(output)` observes the per-request histograms. The gauges read the
latest stats snapshot when Prometheus scrapes, so they are right even when no step runs
(an abort while idle frees blocks without a step).

Names follow vLLM (`nanollmserve:` prefix, label `model_name`), plus the three
`inference_*` names of the simple API. An engine that speculates also exports vLLM's
`spec_decode_*` counters (drafts, draft tokens, accepted tokens, accepted tokens by position).
Every metric lives in the instance's own registry, so
several servers (or tests) in one process never clash.

    metrics = ServerMetrics("my-model", lambda: engine.stats().engine)
    engine.add_observer(metrics)
    body = metrics.render()  # the text /metrics returns
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from nanollmserve.engine.spec_decode.stats import SpecDecodeStats
from nanollmserve.engine.stats import EngineStats
from nanollmserve.outputs import RequestOutput

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics", "build_1_2_5_buckets"]

# fmt: off
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                     50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on
SIMPLE_LATENCY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# Engine totals exported as counters: EngineStats field -> counter name.
ENGINE_COUNTERS = {
    "num_prompt_tokens": "nanollmserve:prompt_tokens_total",
    "num_generation_tokens": "nanollmserve:generation_tokens_total",
    "num_preemptions": "nanollmserve:num_preemptions_total",
    "prefix_cache_queries": "nanollmserve:prefix_cache_queries_total",
    "prefix_cache_hits": "nanollmserve:prefix_cache_hits_total",
    "remote_prefill_loaded_tokens": "nanollmserve:kv_remote_prefill_loaded_tokens_total",
    "remote_prefill_recomputed_tokens": "nanollmserve:kv_remote_prefill_recomputed_tokens_total",
}
SUCCESS_REASONS = ("stop", "length")
# Speculative decoding totals exported as counters: SpecDecodeStats field -> name and help.
SPEC_DECODE_COUNTERS = {
    "num_drafts": (
        "nanollmserve:spec_decode_num_drafts",
        "Draft steps: one per request whose proposals the target checked in a step.",
    ),
    "num_draft_tokens": ("nanollmserve:spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "num_accepted_tokens": (
        "nanollmserve:spec_decode_num_accepted_tokens",
        "Draft tokens the target accepted.",
    ),
}


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (inclusive)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        stats_fn: Callable[[], EngineStats],
        max_model_len: int = 8192,
    ) -> None:
        disable_created_metrics()  # no `*_created` series beside each counter/histogram
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels
        self._last_totals = dict.fromkeys(ENGINE_COUNTERS, 0)
        self._spec_counters: dict[str, Counter] | None = None  # made at the first draft step
        self._spec_totals: dict = {}

        def gauge(name: str, doc: str, read: Callable[[EngineStats], float]) -> None:
            child = Gauge(name, doc, ["model_name"], registry=self.registry).labels(**labels)
            child.set_function(lambda: read(stats_fn()))

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, ["model_name", *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            metric = Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)
            return metric.labels(**labels)

        gauge(
            "nanollmserve:num_requests_running",
            "Requests running in the engine now.",
            lambda s: s.num_requests_running,
        )
        gauge(
            "nanollmserve:num_requests_waiting",
            "Requests waiting to be scheduled.",
            lambda s: s.num_requests_waiting,
        )
        gauge(
            "nanollmserve:kv_cache_usage_perc",
            "KV cache usage: 1 means 100 percent.",
            lambda s: s.kv_cache.usage,
        )
        gauge(
            "nanollmserve:num_kv_blocks_free",
            "KV cache blocks free now.",
            lambda s: s.kv_cache.num_free_blocks,
        )

        docs = {
            "num_prompt_tokens": "Prompt tokens of requests that produced their first token.",
            "num_generation_tokens": "Tokens generated (sampled) by the engine.",
            "num_preemptions": "Requests preempted (blocks freed, recomputed later).",
            "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
            "prefix_cache_hits": "Prompt tokens found in the prefix cache (a request resumed "
            "after preemption is not counted).",
            "remote_prefill_loaded_tokens": "Prompt tokens a prefill worker computed "
            "(kv_transfer_params remote_tokens) whose KV this worker found in its pool or read "
            "from the --kv-offload-dir store.",
            "remote_prefill_recomputed_tokens": "Prompt tokens a prefill worker computed that "
            "this worker computed again (a block missing, corrupt, or the last one).",
        }
        self._engine_counters = {
            field: counter(name, docs[field]).labels(**labels)
            for field, name in ENGINE_COUNTERS.items()
        }
        success = counter(
            "nanollmserve:request_success_total",
            "Requests that finished (stop or length), by finish reason.",
            ("finished_reason",),
        )
        self._success = {r: success.labels(finished_reason=r, **labels) for r in SUCCESS_REASONS}
        self._aborted = counter(
            "nanollmserve:num_aborted_requests_total",
            "Requests aborted (client gone, cancelled, shutdown).",
        ).labels(**labels)
        self._failed = counter(
            "nanollmserve:num_failed_requests_total",
            'Requests that ended with an error of their own (finish reason "error": their '
            "sampling raised), not counted as successes.",
        ).labels(**labels)

        self._ttft = histogram(
            "nanollmserve:time_to_first_token_seconds",
            "Time from arrival to the first token.",
            TTFT_BUCKETS_S,
        )
        self._itl = histogram(
            "nanollmserve:inter_token_latency_seconds",
            "Time between two tokens of a request.",
            ITL_BUCKETS_S,
        )
        self._e2e = histogram(
            "nanollmserve:e2e_request_latency_seconds",
            "Time from arrival to finish.",
            REQUEST_BUCKETS_S,
        )
        self._queue = histogram(
            "nanollmserve:request_queue_time_seconds",
            "Time from arrival to first scheduling.",
            REQUEST_BUCKETS_S,
        )
        token_buckets = build_1_2_5_buckets(max_model_len)
        self._prompt_tokens = histogram(
            "nanollmserve:request_prompt_tokens", "Prompt tokens per request.", token_buckets
        )
        self._generation_tokens = histogram(
            "nanollmserve:request_generation_tokens", "Generated tokens per request.", token_buckets
        )
        self._step_tokens = histogram(
            "nanollmserve:iteration_tokens_total", "Tokens run per engine step.", STEP_TOKEN_BUCKETS
        )

        self._simple_requests = counter(
            "inference_requests_total", "Requests finished (any reason)."
        ).labels(**labels)
        self._simple_tokens = counter(
            "inference_tokens_generated_total", "Tokens generated."
        ).labels(**labels)
        self._simple_latency = histogram(
            "inference_request_latency_seconds",
            "Request latency, arrival to finish (any reason).",
            SIMPLE_LATENCY_BUCKETS_S,
        )

    # -- observer (engine thread) -----------------------------------------------------------
    def on_step(self, stats: EngineStats) -> None:
        for field, child in self._engine_counters.items():
            total = getattr(stats, field)
            delta = total - self._last_totals[field]
            if delta > 0:
                child.inc(delta)
                if field == "num_generation_tokens":
                    self._simple_tokens.inc(delta)
            self._last_totals[field] = total
        if stats.spec_decode is not None:
            self._count_spec_decode(stats.spec_decode)
        step = stats.last_step
        if step is not None:
            self._step_tokens.observe(step.num_scheduled_tokens)
            for latency in step.inter_token_latencies:
                self._itl.observe(latency)

    def _count_spec_decode(self, spec: SpecDecodeStats) -> None:
        if self._spec_counters is None:
            self._spec_counters = {
                field: Counter(name, doc, ["model_name"], registry=self.registry).labels(
                    **self._labels
                )
                for field, (name, doc) in SPEC_DECODE_COUNTERS.items()
            }
            self._spec_per_pos = Counter(
                "nanollmserve:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by position in the draft (0 = first).",
                ["model_name", "position"],
                registry=self.registry,
            )
        totals = {field: getattr(spec, field) for field in SPEC_DECODE_COUNTERS}
        totals.update(
            {("pos", i): count for i, count in enumerate(spec.num_accepted_tokens_per_pos)}
        )
        for key, total in totals.items():
            delta = total - self._spec_totals.get(key, 0)
            if delta > 0:
                if isinstance(key, tuple):
                    self._spec_per_pos.labels(position=str(key[1]), **self._labels).inc(delta)
                else:
                    self._spec_counters[key].inc(delta)
            self._spec_totals[key] = total

    def on_request_finished(self, output: RequestOutput) -> None:
        metrics = output.metrics
        reasons = [c.finish_reason for c in output.outputs]
        self._simple_requests.inc()
        if metrics is not None and metrics.e2e_latency is not None:
            self._simple_latency.observe(metrics.e2e_latency)
        if metrics is not None and metrics.ttft is not None:
            self._ttft.observe(metrics.ttft)
        if "abort" in reasons or not reasons:
            self._aborted.inc()
            return
        if "error" in reasons:
            self._failed.inc()
            return
        self._success[reasons[0] if reasons[0] in self._success else "stop"].inc()
        if metrics is None:
            return
        if metrics.e2e_latency is not None:
            self._e2e.observe(metrics.e2e_latency)
        if metrics.time_in_queue is not None:
            self._queue.observe(metrics.time_in_queue)
        self._prompt_tokens.observe(len(output.prompt_token_ids))
        self._generation_tokens.observe(sum(len(c.token_ids) for c in output.outputs))

    # -- exposition -------------------------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text format of every metric (the body of GET /metrics)."""
        return generate_latest(self.registry)

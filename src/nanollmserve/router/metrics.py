"""RouterMetrics: the router's own Prometheus metrics, served at the router's /metrics.

Per worker (label `worker`, its URL): requests routed, failed attempts, retries (failed
attempts that another worker then served), up (1 while in the rotation), requests in flight,
and the upstream latency histogram (from sending a request to the worker's response
headers). With `--policy pd`: phase-1 fallbacks (requests a decode worker prefilled itself,
label `reason`) and the phase-1 latency histogram (per prefill worker). The gauges are read
from the pool when Prometheus scrapes. Each instance has its own registry.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from nanollmserve.router.workers import WorkerPool

__all__ = ["CONTENT_TYPE_LATEST", "RouterMetrics"]

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                     60.0, 120.0, 300.0)  # fmt: skip


class RouterMetrics:
    def __init__(self, pool: WorkerPool) -> None:
        disable_created_metrics()
        self.pool = pool
        self.registry = CollectorRegistry()
        labels = ["worker"]
        r = self.registry
        self.requests = Counter(
            "nanollmserve_router:requests_total", "Attempts routed to a worker", labels, registry=r
        )
        self.failures = Counter(
            "nanollmserve_router:request_failures_total",
            "Attempts that failed on a worker (no connection, reset, 502/503, cut stream)",
            labels,
            registry=r,
        )
        self.retries = Counter(
            "nanollmserve_router:retries_total",
            "Failed attempts retried on another worker",
            labels,
            registry=r,
        )
        self.upstream_latency = Histogram(
            "nanollmserve_router:upstream_latency_seconds",
            "Seconds from sending a request to a worker to its response headers",
            labels,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.pd_fallbacks = Counter(
            "nanollmserve_router:pd_prefill_fallbacks_total",
            "--policy pd: requests sent to a decode worker without phase 1 (it prefills them "
            "itself); reason: no_prefill_worker, prefill_failed or no_transfer_params",
            ["reason"],
            registry=r,
        )
        self.pd_prefill_latency = Histogram(
            "nanollmserve_router:pd_prefill_latency_seconds",
            "--policy pd: seconds of a successful phase 1, from sending the request to a "
            "prefill worker to its whole answer (the prompt's blocks in the store)",
            labels,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.worker_up = Gauge(
            "nanollmserve_router:worker_up", "1 while the worker is in the rotation", labels,
            registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "nanollmserve_router:worker_requests_in_flight",
            "Requests sent to the worker that have not ended",
            labels,
            registry=r,
        )
        self._gauge_labels: set[str] = set()

    def render(self) -> bytes:
        urls = set()
        for worker in self.pool.all():
            urls.add(worker.url)
            self.worker_up.labels(worker.url).set(1 if worker.is_healthy else 0)
            self.in_flight.labels(worker.url).set(worker.num_in_flight)
        for gone in self._gauge_labels - urls:  # a worker the pool no longer has
            self.worker_up.remove(gone)
            self.in_flight.remove(gone)
        self._gauge_labels = urls
        return generate_latest(self.registry)

"""The numbers `nanollmserve bench serve` reports, defined as `vllm bench serve` defines them.

- TTFT: send -> first content chunk. ITL: the gaps between content chunks (all requests
  pooled). TPOT: per request, (E2E - TTFT) / (output tokens - 1). E2E: send -> last byte.
- Throughputs divide by the benchmark's duration (first send -> last response).
- Goodput: completed requests per second that met every SLO given as
  `--goodput ttft:MS tpot:MS e2el:MS`.
- `by_kind` (the mixed workload): the latencies of each kind of request on its own, so the
  short turns' TTFT and ITL show what the long prompts among them cost them.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from nanollmserve.bench.report import percentile

if TYPE_CHECKING:  # serve_client imports httpx: not at every CLI start
    from nanollmserve.bench.serve_client import RequestResult

SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad --goodput item {item!r}: expected KEY:MS with KEY in {SLO_KEYS}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"bad --goodput item {item!r}: {value!r} is not a number") from None
        if slos[key] <= 0:
            raise ValueError(f"bad --goodput item {item!r}: the SLO must be > 0 ms")
    return slos


def distribution_ms(values: list[float]) -> dict:
    """Seconds -> mean / p50 / p95 / p99 / max in milliseconds (zeros when empty)."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "p99": 0.0, "max": 0.0}
    ms = [v * 1000 for v in values]
    return {
        "mean": round(statistics.fmean(ms), 3),
        "p50": round(percentile(ms, 50), 3),
        "p95": round(percentile(ms, 95), 3),
        "p99": round(percentile(ms, 99), 3),
        "max": round(max(ms), 3),
    }


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    measured = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.e2e}
    return all(measured[key] * 1000 <= limit for key, limit in slos.items())


def summarize(
    results: list[RequestResult],
    duration: float,
    max_concurrent: int,
    slos: dict[str, float] | None = None,
) -> dict:
    """The metrics of one run (results in request order, failures included)."""
    done = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    duration = max(duration, 1e-9)
    summary = {
        "duration_s": round(duration, 3),
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_output_chunks": sum(r.num_chunks for r in done),
        "request_throughput": round(len(done) / duration, 3),
        "output_throughput": round(total_out / duration, 2),
        "total_token_throughput": round((total_in + total_out) / duration, 2),
        "max_concurrent_requests": max_concurrent,
        "ttft_ms": distribution_ms([r.ttft for r in done]),
        "tpot_ms": distribution_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl]),
        "e2el_ms": distribution_ms([r.e2e for r in done]),
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in done)
        summary["goodput"] = {
            "slos_ms": slos,
            "good_requests": good,
            "request_goodput": round(good / duration, 3),
        }
    sources = sorted({r.count_source for r in done})
    summary["token_count_source"] = ",".join(sources) if sources else "none"
    errors = [r.error for r in results if not r.success]
    if errors:
        summary["errors"] = errors[:5]
    return summary


def summarize_kinds(requests: list, results: list[RequestResult]) -> dict:
    """Per request kind (`ServeRequest.kind`): its count, failures and latency spreads."""
    kinds: dict[str, list[RequestResult]] = {}
    for request, result in zip(requests, results, strict=True):
        kinds.setdefault(request.kind, []).append(result)
    summaries = {}
    for kind, kind_results in sorted(kinds.items()):
        done = [r for r in kind_results if r.success]
        summaries[kind] = {
            "completed": len(done),
            "failed": len(kind_results) - len(done),
            "ttft_ms": distribution_ms([r.ttft for r in done]),
            "tpot_ms": distribution_ms([r.tpot for r in done if r.tpot is not None]),
            "itl_ms": distribution_ms([gap for r in done for gap in r.itl]),
            "e2el_ms": distribution_ms([r.e2e for r in done]),
        }
    return summaries

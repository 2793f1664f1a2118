"""GET /stats of the router: the workers' own /stats added up (the same keys a worker's
/stats has, so tools written for one server, such as `bench serve`, read the cluster's
totals), plus one entry per worker: its URL, health, KV role, requests in flight, routed /
failed / retried counts and its own /stats (null when it is down or did not answer).
"""

from __future__ import annotations

import asyncio

import httpx

from nanollmserve.router.workers import Worker, WorkerPool

MAXED = frozenset({"block_size", "peak_running_requests"})


async def cluster_stats(
    pool: WorkerPool, client: httpx.AsyncClient, headers: dict[str, str]
) -> dict:
    workers = pool.all()
    own = await asyncio.gather(*(_worker_stats(w, client, headers) for w in workers))
    entries = [
        {
            "url": worker.url,
            "is_healthy": worker.is_healthy,
            "is_sleeping": worker.is_sleeping,
            "is_draining": worker.is_draining,
            "kv_role": worker.kv_role,
            "num_in_flight": worker.num_in_flight,
            "num_routed": worker.num_routed,
            "num_failed": worker.num_failed,
            "num_retried": worker.num_retried,
            "stats": stats,
        }
        for worker, stats in zip(workers, own, strict=True)
    ]
    return {
        **aggregate([stats for stats in own if stats is not None]),
        "is_healthy": any(worker.is_healthy for worker in workers),
        "num_workers": len(workers),
        "num_healthy_workers": sum(worker.is_healthy for worker in workers),
        "workers": entries,
    }


def aggregate(all_stats: list[dict]) -> dict:
    """Counts summed (sizes and peaks: the largest), rates recomputed from the sums."""
    total: dict = {}
    for stats in all_stats:
        for name, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, int):
                continue
            if name in MAXED:
                total[name] = max(total.get(name, 0), value)
            else:
                total[name] = total.get(name, 0) + value
    if "prefix_cache_queries" in total:
        queries = total["prefix_cache_queries"]
        total["prefix_cache_hit_rate"] = total["prefix_cache_hits"] / queries if queries else 0.0
    if total.get("num_total_blocks"):
        used = total["num_total_blocks"] - total["num_free_blocks"]
        total["kv_cache_usage"] = used / total["num_total_blocks"]
    return total


async def _worker_stats(
    worker: Worker, client: httpx.AsyncClient, headers: dict[str, str]
) -> dict | None:
    if not worker.is_healthy:
        return None
    try:
        response = await client.get(f"{worker.url}/stats", headers=headers, timeout=5.0)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None

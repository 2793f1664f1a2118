"""`run_cluster(...)`: the workers (local processes or Ray actors) and the router in one
process, until SIGINT / SIGTERM; then the router stops taking requests and every worker
gets SIGTERM (its graceful shutdown), SIGKILL after the grace time. Nothing is left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket

from nanollmserve.router import RouterSettings, WorkerPool, create_router_app
from nanollmserve.router.server import serve_router

logger = logging.getLogger("nanollmserve.cluster")


async def run_cluster(
    workers, router_sock: socket.socket, settings: RouterSettings, log_level: str
) -> None:
    """`workers` is a started LocalWorkers or RayWorkers."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if hasattr(workers, "follow"):  # Ray: the router follows the actors' addresses
        pool = WorkerPool(await workers.addresses())
        supervise = asyncio.create_task(workers.follow(pool))
    else:  # local: fixed ports; this process restarts what exits
        pool = WorkerPool(workers.urls)
        supervise = asyncio.create_task(workers.watch())
    app = create_router_app(pool, settings)
    ready = asyncio.create_task(_log_when_ready(pool, router_sock))
    try:
        await serve_router(app, router_sock, log_level, stop=stop)
    finally:
        for task in (supervise, ready):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await workers.stop()
        logger.info("nanollmserve cluster stopped")


async def _log_when_ready(pool: WorkerPool, sock: socket.socket) -> None:
    host, port = sock.getsockname()[:2]
    while len(pool.healthy()) < len(pool.all()) or not pool.all():
        await asyncio.sleep(0.5)
    logger.info(
        "nanollmserve cluster ready: router http://%s:%d, %d workers: %s",
        host,
        port,
        len(pool.all()),
        " ".join(_described(worker) for worker in pool.all()),
    )


def _described(worker) -> str:
    return worker.url if worker.kv_role == "both" else f"{worker.url} ({worker.kv_role})"

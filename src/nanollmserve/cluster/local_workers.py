"""LocalWorkers: N `nanollmserve serve` processes on this machine, on consecutive ports.

`start()` launches them; `watch()` restarts a worker that exits (after 1, 2, 4 ... up to
30 seconds, the delay reset once a worker has run for a minute; at most `max_restarts`
times, -1: always), and the router's health checks take it out and back in; `stop()` ends
them all: SIGTERM, then SIGKILL after the grace time.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from dataclasses import dataclass

from nanollmserve.cluster.worker_process import (
    serve_command,
    start_worker_process,
    stop_process,
)

logger = logging.getLogger("nanollmserve.cluster")

MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0


@dataclass
class LocalWorker:
    index: int
    host: str
    port: int
    env: dict[str, str]
    args: list[str]
    """Its own serve flags, after the common ones (a disaggregated cluster's --kv-role)."""
    cpus: list[int] | None = None
    """The CPUs it is pinned to (None: not pinned)."""
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    num_restarts: int = 0
    num_quick_exits: int = 0
    restart_at: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class LocalWorkers:
    def __init__(
        self,
        host: str,
        ports: list[int],
        serve_args: list[str],
        envs: list[dict[str, str]],
        max_restarts: int = -1,
        stop_timeout: float = 30.0,
        worker_args: list[list[str]] | None = None,
        worker_cpus: list[list[int] | None] | None = None,
    ) -> None:
        self.serve_args = serve_args
        self.max_restarts = max_restarts
        self.stop_timeout = stop_timeout
        worker_args = worker_args or [[] for _ in ports]
        worker_cpus = worker_cpus or [None for _ in ports]
        self.workers = [
            LocalWorker(i, host, port, env, args, cpus)
            for i, (port, env, args, cpus) in enumerate(
                zip(ports, envs, worker_args, worker_cpus, strict=True)
            )
        ]

    @property
    def urls(self) -> list[str]:
        return [worker.url for worker in self.workers]

    def start(self) -> None:
        for worker in self.workers:
            self._launch(worker)

    def _launch(self, worker: LocalWorker) -> None:
        command = serve_command(worker.host, worker.port, self.serve_args + worker.args)
        worker.process = start_worker_process(command, worker.env, worker.cpus)
        worker.started_at = time.monotonic()
        worker.restart_at = None
        logger.info(
            "worker %d: started (pid %d) on %s%s",
            worker.index,
            worker.process.pid,
            worker.url,
            f", CPUs {','.join(map(str, worker.cpus))}" if worker.cpus else "",
        )

    def poll(self) -> None:
        """Restart the workers that exited, each when its backoff delay is over."""
        now = time.monotonic()
        for worker in self.workers:
            if worker.process is None:
                continue
            if worker.restart_at is not None:
                if now >= worker.restart_at:
                    worker.num_restarts += 1
                    self._launch(worker)
                continue
            status = worker.process.poll()
            if status is None:
                continue
            if 0 <= self.max_restarts <= worker.num_restarts:
                logger.error(
                    "worker %d exited with status %d; not restarted (--max-restarts %d)",
                    worker.index,
                    status,
                    self.max_restarts,
                )
                worker.process = None
                continue
            ran = now - worker.started_at
            worker.num_quick_exits = 0 if ran > STABLE_AFTER_S else worker.num_quick_exits + 1
            delay = min(MAX_BACKOFF_S, 2.0 ** max(0, worker.num_quick_exits - 1))
            worker.restart_at = now + delay
            logger.warning(
                "worker %d exited with status %d after %.1f s; restarting in %.0f s",
                worker.index,
                status,
                ran,
                delay,
            )

    async def watch(self, interval: float = 0.5) -> None:
        while True:
            self.poll()
            await asyncio.sleep(interval)

    async def stop(self) -> None:
        running = [w.process for w in self.workers if w.process is not None]
        for process in running:
            if process.poll() is None:
                process.terminate()
        await asyncio.gather(
            *(asyncio.to_thread(stop_process, p, self.stop_timeout) for p in running)
        )
        logger.info("workers stopped")

"""RayWorkers: the cluster's workers as Ray actors, placed by Ray's resources (one CPU or GPU
per worker by default) on any node of a Ray cluster, and restarted by Ray when they die.

Each actor (`ServeWorkerActor`) runs a `nanollmserve serve` process on its node and exits
when that process does, so a dead server, a dead actor process and a lost node all end the
same way: Ray starts the actor again (`max_restarts`) and it starts a fresh server. The
launcher asks every actor for its address each second (`addresses()`), so the router follows
the workers wherever Ray puts them. Ray is an optional extra: `pip install
'nanollmserve[cluster]'`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

from nanollmserve.cluster.worker_process import (
    serve_command,
    start_worker_process,
    stop_process,
    worker_env,
)
from nanollmserve.errors import UserError

logger = logging.getLogger("nanollmserve.cluster")

ADDRESS_TIMEOUT_S = 5.0


class ServeWorkerActor:
    """The body of one worker actor (made a Ray actor class by `RayWorkers`)."""

    def __init__(
        self,
        host: str | None,
        port: int,
        serve_args: list[str],
        api_key: str | None,
        admin_api_key: str | None = None,
    ) -> None:
        import ray

        self.host = host or ray.util.get_node_ip_address()
        self.port = port
        self.stopping = False
        command = serve_command(self.host, port, serve_args)
        self.process = start_worker_process(command, worker_env(api_key, None, None, admin_api_key))
        threading.Thread(target=self._exit_with_server, daemon=True).start()

    def _exit_with_server(self) -> None:
        status = self.process.wait()
        if not self.stopping:  # the server died: so does the actor, and Ray restarts it
            print(f"nanollmserve worker exited with status {status}; restarting", flush=True)
            os._exit(1)

    def address(self) -> tuple[str, int]:
        """(the worker's URL, this actor's process id)."""
        return f"http://{self.host}:{self.port}", os.getpid()

    def stop(self, timeout: float) -> int:
        self.stopping = True
        return stop_process(self.process, timeout)


class RayWorkers:
    def __init__(
        self,
        address: str,
        num_workers: int,
        base_port: int,
        serve_args: list[str],
        api_key: str | None,
        host: str | None,
        max_restarts: int,
        num_cpus: float,
        num_gpus: float | None,
        stop_timeout: float = 30.0,
        worker_args: list[list[str]] | None = None,
        admin_api_key: str | None = None,
    ) -> None:
        try:
            import ray
        except ImportError:
            raise UserError(
                "--ray-address needs Ray: pip install 'nanollmserve[cluster]'"
            ) from None
        self.ray = ray
        if address == "local":  # a private Ray on this machine, ended with the launcher
            ray.init(
                num_cpus=max(1, int(num_workers * num_cpus)),
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
            )
        else:
            ray.init(address=address)
        if num_gpus is None:  # one GPU per worker where the cluster has GPUs
            num_gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
        actor_class = ray.remote(ServeWorkerActor)
        worker_args = worker_args or [[] for _ in range(num_workers)]
        self.actors = [
            actor_class.options(
                max_restarts=max_restarts, num_cpus=num_cpus, num_gpus=num_gpus
            ).remote(host, base_port + i, serve_args + worker_args[i], api_key, admin_api_key)
            for i in range(num_workers)
        ]
        self.stop_timeout = stop_timeout
        self.urls: list[str] = [""] * num_workers
        self.pids: list[int | None] = [None] * num_workers

    async def addresses(self) -> list[str]:
        """Each worker's current URL (the last known one while its actor restarts)."""

        async def one(index: int) -> None:
            try:
                ref = self.actors[index].address.remote()
                url, pid = await asyncio.wait_for(ref, ADDRESS_TIMEOUT_S)
            except Exception:  # restarting, or dead for good: keep the last address
                return
            if url != self.urls[index] or pid != self.pids[index]:
                logger.info("worker %d: actor pid %d serves %s", index, pid, url)
            self.urls[index], self.pids[index] = url, pid

        await asyncio.gather(*(one(i) for i in range(len(self.actors))))
        return [url for url in self.urls if url]

    async def follow(self, pool, interval: float = 1.0) -> None:
        """Keep the router's pool on the actors' addresses."""
        while True:
            pool.set_urls(await self.addresses())
            await asyncio.sleep(interval)

    async def stop(self) -> None:
        refs = [actor.stop.remote(self.stop_timeout) for actor in self.actors]
        try:
            await asyncio.wait_for(asyncio.gather(*refs), self.stop_timeout + 10)
        except Exception as exc:  # a dead actor: its server died with it
            logger.warning("stopping a worker actor failed: %r", exc)
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        self.ray.shutdown()
        logger.info("workers stopped")

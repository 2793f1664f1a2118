"""RayWorkers: the cluster's workers as Ray actors, placed by Ray's resources (one CPU or GPU
per worker by default) on any node of a Ray cluster, and restarted by Ray when they die.

Each actor (`ServeWorkerActor`) runs a `nanollmserve serve` process on its node and exits
when that process does, so a dead server, a dead actor process and a lost node all end the
same way: Ray starts the actor again (`max_restarts`) and it starts a fresh server. The
launcher asks every actor for its address each second (`addresses()`), so the router follows
the workers wherever Ray puts them. Ray is an optional extra: `pip install
'nanollmserve[cluster]'`.

Placement: by Ray's resources, or with `workers_per_node` N (`cluster --workers-per-node`)
pinned by node affinity: the alive nodes with room for N workers (their CPUs and GPUs),
ordered by address and node id, worker i on node i // N (a disaggregated cluster's prefill
workers come first, so they land on the first nodes and the decode workers on the next).
A restarted actor comes back on its node.

With `kv_key` (prefill/decode disaggregation over `--kv-transfer ray`), each actor makes its
own private store under /dev/shm on its node (removed when it stops) holding that one MAC
key, gives its server `--kv-offload-dir` there, and `RAY_ADDRESS` so the server joins the
cluster to move blocks through Ray's object store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import tempfile
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
        kv_key: str | None = None,
    ) -> None:
        import ray

        self.host = host or ray.util.get_node_ip_address()
        self.port = port
        self.stopping = False
        self.store: str | None = None
        env = worker_env(api_key, None, None, admin_api_key)
        if kv_key is not None:  # --kv-transfer ray: a store of its own, the cluster's key
            self.store = _own_store(kv_key)
            serve_args = [*serve_args, "--kv-offload-dir", self.store]
            env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        command = serve_command(self.host, port, serve_args)
        self.process = start_worker_process(command, env)
        threading.Thread(target=self._exit_with_server, daemon=True).start()

    def _exit_with_server(self) -> None:
        status = self.process.wait()
        if not self.stopping:  # the server died: so does the actor, and Ray restarts it
            print(f"nanollmserve worker exited with status {status}; restarting", flush=True)
            self._remove_store()
            os._exit(1)

    def address(self) -> tuple[str, int]:
        """(the worker's URL, this actor's process id)."""
        return f"http://{self.host}:{self.port}", os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def stop(self, timeout: float) -> int:
        self.stopping = True
        status = stop_process(self.process, timeout)
        self._remove_store()
        return status

    def _remove_store(self) -> None:
        if self.store is not None:
            shutil.rmtree(self.store, ignore_errors=True)


def _own_store(key_hex: str) -> str:
    """A fresh private store on this node (/dev/shm: memory) holding the cluster's key."""
    from nanollmserve.kv_store_dir import KEY_FILE, open_store_dir, write_private

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = open_store_dir(tempfile.mkdtemp(prefix="nanollmserve-kv-ray-", dir=shm))
    write_private(path, KEY_FILE, key_hex.encode() + b"\n")
    return str(path)


def init_ray(address: str, num_workers: int, num_cpus: float):
    """Join (or, for `local`, start) the Ray cluster -> the ray module."""
    try:
        import ray
    except ImportError:
        raise UserError("--ray-address needs Ray: pip install 'nanollmserve[cluster]'") from None
    if ray.is_initialized():
        return ray
    if address == "local":  # a private Ray on this machine, ended with the launcher
        ray.init(
            num_cpus=max(1, int(num_workers * num_cpus)),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
        )
    else:
        try:
            ray.init(address=address)
        except ConnectionError as exc:
            raise UserError(f"--ray-address {address}: {exc}") from None
    return ray


def ray_hosts(ray) -> int:
    """How many distinct hosts (node addresses) the Ray cluster's alive nodes are on."""
    return len({node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]})


def node_placement(
    ray, num_workers: int, per_node: int, num_cpus: float, num_gpus: float
) -> list[str]:
    """The node id of each worker, `per_node` workers a node (UserError: too few nodes)."""
    if per_node < 1:
        raise UserError(f"--workers-per-node must be >= 1, got {per_node}")
    fits = [
        node
        for node in ray.nodes()
        if node["Alive"]
        and node["Resources"].get("CPU", 0) >= num_cpus * per_node
        and node["Resources"].get("GPU", 0) >= num_gpus * per_node
    ]
    fits.sort(key=lambda node: (node["NodeManagerAddress"], node["NodeID"]))
    needed = math.ceil(num_workers / per_node)
    if len(fits) < needed:
        raise UserError(
            f"--workers-per-node {per_node}: {num_workers} workers need {needed} nodes with "
            f"{num_cpus * per_node:g} CPUs and {num_gpus * per_node:g} GPUs free, the Ray "
            f"cluster has {len(fits)}"
        )
    return [fits[i // per_node]["NodeID"] for i in range(num_workers)]


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
        workers_per_node: int | None = None,
        kv_key: bytes | None = None,
    ) -> None:
        ray = self.ray = init_ray(address, num_workers, num_cpus)
        if num_gpus is None:  # one GPU per worker where the cluster has GPUs
            num_gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
        actor_class = ray.remote(ServeWorkerActor)
        worker_args = worker_args or [[] for _ in range(num_workers)]
        nodes: list[str | None] = [None] * num_workers
        if workers_per_node is not None:
            nodes = list(node_placement(ray, num_workers, workers_per_node, num_cpus, num_gpus))
        key_hex = None if kv_key is None else kv_key.hex()
        self.actors = []
        for i in range(num_workers):
            options = {"max_restarts": max_restarts, "num_cpus": num_cpus, "num_gpus": num_gpus}
            if nodes[i] is not None:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                    nodes[i], soft=False
                )
            self.actors.append(
                actor_class.options(**options).remote(
                    host,
                    base_port + i,
                    serve_args + worker_args[i],
                    api_key,
                    admin_api_key,
                    key_hex,
                )
            )
        for i, node in enumerate(nodes):
            if node is not None:
                logger.info("worker %d placed on node %s", i, node)
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
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
        self.ray.shutdown()
        logger.info("workers stopped")

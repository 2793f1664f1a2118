"""One `serve` worker with its gRPC port and a `router` in front of it, for the feature x
feature tests of the compatibility matrix (scripts/compat_matrix.py). Not a test module.

`CompatStack.start(*serve_args)` starts the worker (tests/live_server.py) with
`--grpc-port` and a router (tests/cluster_process.py) whose only worker it is, so one test
module can check a feature through HTTP, through gRPC and through the router.
"""

from __future__ import annotations

import asyncio
import re

import httpx
from cluster_process import ClusterProcess
from live_server import LiveServer, free_port

from nanollmserve.api.grpc_client import connect

SPEC_NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
REPEATING_PROMPT = "Repeat after me five times: red green blue. red green blue. red green blue."


ADMIN_KEY = "compat-stack-admin-key"
"""The worker's --admin-api-key: its admin routes (/debug/steps, ...) are read on its own
port with it; the router forwards none of them."""


class CompatStack:
    def __init__(self, worker: LiveServer, grpc_target: str, router: ClusterProcess) -> None:
        self.worker = worker
        self.grpc_target = grpc_target
        self.router = router

    @classmethod
    def start(cls, *serve_args: str) -> CompatStack:
        grpc_port = free_port()
        worker = LiveServer.start(
            *serve_args, "--grpc-port", str(grpc_port), admin_api_key=ADMIN_KEY
        )
        try:
            port = free_port()
            router = ClusterProcess.start(
                "router", port, "--port", str(port), "--worker", worker.url,
                "--health-interval", "0.5", num_workers=1,
            )  # fmt: skip
        except BaseException:
            worker.stop()
            raise
        return cls(worker, f"127.0.0.1:{grpc_port}", router)

    def stop(self) -> None:
        self.router.stop()
        self.worker.stop()

    def grpc(self, body):
        """`await body(client)` with a connected gRPC client, on a fresh event loop."""

        async def main():
            async with await connect(self.grpc_target) as client:
                return await body(client)

        return asyncio.run(main())

    def ready_line(self) -> str:
        return next(
            line for line in self.worker.log().splitlines() if "nanollmserve ready:" in line
        )

    def metric(self, name: str) -> float:
        """The sum of every sample of the Prometheus metric `name` on the worker."""
        text = httpx.get(f"{self.worker.url}/metrics", timeout=30).text
        pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
        return sum(float(value) for value in pattern.findall(text))

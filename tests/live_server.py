"""A real `nanollmserve serve` subprocess for the server tests (not a test module).

`shared_server()` starts the one server most test modules share (the bundled model on the
default flags, as users run it: GGUF blocks, the native step, float16 K/V; an API key, a
small KV pool and queue) the first time it is asked for and stops it when the test session
ends; `LiveServer.start(...)` starts a private one (fuzzing, shutdown tests). Neither adds a
flag beyond the port: a test that needs dense float32 weights (an exact comparison with an
offline float32 `LLM`, say) passes `--dtype float32` itself and says why. The server's log
goes to a temp file that a failing test can print.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

API_KEY = "test-key-123"
STARTUP_TIMEOUT_S = 180.0
SHARED_ARGS = ["--num-kv-blocks", "256", "--max-queue-len", "16"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def busy_port():
    """A port something else is listening on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


class LiveServer:
    def __init__(
        self,
        process: subprocess.Popen,
        port: int,
        log_path: Path,
        api_key: str | None,
        verify: str | None = None,
        admin_api_key: str | None = None,
    ):
        self.admin_api_key = admin_api_key
        """`--admin-api-key` (through its variable): what the admin routes need."""
        self.process = process
        self.port = port
        self.log_path = log_path
        self.api_key = api_key
        self.verify = verify or True
        """With `verify` (a CA file: the server was started with --ssl-*) it speaks HTTPS."""
        self.url = f"{'https' if verify else 'http'}://127.0.0.1:{port}"

    @classmethod
    def start(
        cls,
        *args: str,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        verify: str | None = None,
        admin_api_key: str | None = None,
    ) -> LiveServer:
        port = free_port()
        log_fd, log_path = tempfile.mkstemp(prefix="nanollmserve-test-", suffix=".log")
        env = {**os.environ, **(env or {})}
        env.pop("NANOLLMSERVE_API_KEY", None)
        env.pop("NANOLLMSERVE_ADMIN_API_KEY", None)
        if api_key:
            env["NANOLLMSERVE_API_KEY"] = api_key
        if admin_api_key:
            env["NANOLLMSERVE_ADMIN_API_KEY"] = admin_api_key
        command = [sys.executable, "-m", "nanollmserve.cli.main", "serve"]
        command += ["--port", str(port), *args]
        process = subprocess.Popen(command, stdout=log_fd, stderr=subprocess.STDOUT, env=env)
        os.close(log_fd)
        atexit.register(Path(log_path).unlink, missing_ok=True)
        server = cls(process, port, Path(log_path), api_key, verify, admin_api_key)
        server.wait_ready()
        return server

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                health = httpx.get(f"{self.url}/health", timeout=2, verify=self.verify)
                if health.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers=self.headers, timeout=timeout, verify=self.verify
        )

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_api_key}"} if self.admin_api_key else {}

    def admin_client(self, timeout: float = 120.0) -> httpx.Client:
        """A client of the admin routes (`/sleep`, `/debug/steps`, ...): the admin key."""
        return httpx.Client(
            base_url=self.url, headers=self.admin_headers, timeout=timeout, verify=self.verify
        )

    def openai(self, strict: bool = True, asynchronous: bool = False):
        import openai

        cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        return cls(
            base_url=f"{self.url}/v1",
            api_key=self.api_key or "unused",
            max_retries=0,
            timeout=120,
            _strict_response_validation=strict,
        )

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/stats", headers=self.headers, timeout=10).json()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Stats once nothing is in flight (aborts land within an engine step or two)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            idle = stats["num_sequences_in_flight"] == 0 and stats["num_requests_running"] == 0
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


_shared: LiveServer | None = None


def shared_server() -> LiveServer:
    global _shared
    if _shared is None:
        _shared = LiveServer.start(*SHARED_ARGS, api_key=API_KEY)
        atexit.register(_shared.stop)
    return _shared

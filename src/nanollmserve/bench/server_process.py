"""Our own server as a subprocess, for benchmarks run without `--base-url`.

`OwnServer(args)` starts `nanollmserve serve --port FREE ARGS...` (bundled model unless ARGS
name one), waits for `/health`, and is stopped with SIGTERM when the `with` block ends. Its
log goes to a temp file that is printed if it fails to start. A subclass overrides `command()`
to run another server the same way (`bench/llamacpp_server.py`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from nanollmserve.bench.report import log


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class OwnServer:
    def __init__(self, serve_args: list[str], grpc: bool = False, timeout: float = 300.0):
        self.serve_args = serve_args
        self.port = free_port()
        self.grpc_port = free_port() if grpc else None
        self.timeout = timeout
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def command(self) -> list[str]:
        """The server's command line (a subclass runs another server the same way)."""
        command = [sys.executable, "-m", "nanollmserve.cli.main", "serve"]
        command += ["--host", "127.0.0.1", "--port", str(self.port), *self.serve_args]
        if self.grpc_port is not None:
            command += ["--grpc-port", str(self.grpc_port)]
        return command

    def __enter__(self) -> OwnServer:
        command = self.command()
        fd, path = tempfile.mkstemp(prefix="nanollmserve-bench-", suffix=".log")
        self.log_path = Path(path)
        env = dict(os.environ)
        env.pop("NANOLLMSERVE_API_KEY", None)
        log(f"starting: {' '.join(command)}")
        self.process = subprocess.Popen(command, stdout=fd, stderr=subprocess.STDOUT, env=env)
        os.close(fd)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.process.returncode}:\n{self.log()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2, trust_env=False).status_code == 200:
                    log(f"server ready at {self.url}")
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the server was not ready after {self.timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path else ""

    def __exit__(self, *exc_info) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

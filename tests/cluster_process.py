"""A real `nanollmserve cluster` (or `router`) subprocess for the router tests (not a test
module), and the tiny model its workers serve.

`tiny_model_dir()` saves, once per test session, a random-weight 2-layer Llama with the
bundled model's tokenizer (so text prompts work) into a temp folder: a worker on it loads
fast and needs little memory. `ClusterProcess.start(...)` runs the command, waits until its
router sees every worker healthy, and finds the workers' process ids (`worker_pid`).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 240.0
WORKER_ARGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--served-model-name", "tiny"]
WORKER_ARGS += ["--disable-log-requests"]
"""serve flags of the test workers: the tiny model (tiny_model_dir()), a small KV pool."""


@cache
def tiny_model_dir() -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from nanollmserve.model.source import resolve_model

    out = Path(tempfile.mkdtemp(prefix="nanollmserve-tiny-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    tokenizer.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def free_consecutive_ports(n: int) -> int:
    """The first of `n` consecutive free ports of 127.0.0.1."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = sock.getsockname()[1]
        if base + n < 65535 and all(_is_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no free consecutive ports")


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def pid_listening_as_worker(port: int) -> int | None:
    """The process id of the `serve` process started with `--port PORT` (from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in args and b"--port" in args and str(port).encode() in args:
            index = args.index(b"--port")
            if args[index + 1] == str(port).encode():
                return int(entry.name)
    return None


def parent_pid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(f"no PPid for {pid}")


def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


class ClusterProcess:
    def __init__(self, process: subprocess.Popen, url: str, log_path: Path, api_key: str | None):
        self.process = process
        self.url = url
        self.log_path = log_path
        self.api_key = api_key
        self.admin_api_key: str | None = None
        """`--admin-api-key` (through its variable): the router's admin surface."""

    @classmethod
    def start(
        cls,
        subcommand: str,
        port: int,
        *args: str,
        api_key: str | None = None,
        num_workers: int = 2,
        admin_api_key: str | None = None,
    ) -> ClusterProcess:
        log_fd, log_path = tempfile.mkstemp(prefix="nanollmserve-cluster-", suffix=".log")
        env = dict(os.environ)
        env.pop("NANOLLMSERVE_API_KEY", None)
        env.pop("NANOLLMSERVE_ADMIN_API_KEY", None)
        if api_key:
            env["NANOLLMSERVE_API_KEY"] = api_key
        if admin_api_key:
            env["NANOLLMSERVE_ADMIN_API_KEY"] = admin_api_key
        command = [sys.executable, "-m", "nanollmserve.cli.main", subcommand, *args]
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=subprocess.STDOUT, env=env
        )
        os.close(log_fd)
        atexit.register(Path(log_path).unlink, missing_ok=True)
        cluster = cls(process, f"http://127.0.0.1:{port}", Path(log_path), api_key)
        cluster.admin_api_key = admin_api_key
        atexit.register(cluster.stop)
        try:
            cluster.wait_healthy(num_workers, STARTUP_TIMEOUT_S)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_api_key}"} if self.admin_api_key else {}

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/stats", headers=self.headers, timeout=30).json()

    def worker(self, url: str) -> dict:
        return next(w for w in self.stats()["workers"] if w["url"] == url)

    def wait_healthy(self, num_workers: int, timeout: float) -> None:
        def healthy() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"exited with {self.process.returncode}:\n{self.log()}")
            try:
                health = httpx.get(f"{self.url}/health", timeout=2)
            except httpx.HTTPError:
                return False
            if num_workers == 0:  # only the router itself (503: no healthy worker)
                return True
            return health.status_code == 200 and health.json()["num_healthy_workers"] == (
                num_workers
            )

        try:
            wait_until(healthy, timeout, f"{num_workers} healthy workers", interval=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log()}") from None

    def openai(self):
        import openai

        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0, timeout=120
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-20000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

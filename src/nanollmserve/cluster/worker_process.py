"""One worker: the `nanollmserve serve` command line the cluster runs, and the process that
runs it. The process dies with its parent (Linux `PR_SET_PDEATHSIG`), so a cluster or Ray
actor killed with SIGKILL leaves no orphan server holding a port and memory.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def serve_command(host: str, port: int, serve_args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "nanollmserve.cli.main",
        "serve",
        "--host",
        host,
        "--port",
        str(port),
        *serve_args,
    ]


def worker_env(
    api_key: str | None,
    devices: str | None,
    num_threads: int | None = None,
    admin_api_key: str | None = None,
) -> dict[str, str]:
    """The worker's environment: the key it requires, the admin key of its admin routes
    (the launcher's, shared with the router only; never the launcher's own variable), the
    devices it may use, the compute threads it starts (`OMP_NUM_THREADS`, which torch and
    the native kernels follow)."""
    env = dict(os.environ)
    env.pop("NANOLLMSERVE_API_KEY", None)
    env.pop("NANOLLMSERVE_ADMIN_API_KEY", None)
    if api_key:
        env["NANOLLMSERVE_API_KEY"] = api_key
    if admin_api_key:
        env["NANOLLMSERVE_ADMIN_API_KEY"] = admin_api_key
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    if num_threads is not None:
        env["OMP_NUM_THREADS"] = str(num_threads)
    return env


def start_worker_process(
    command: list[str], env: dict[str, str], cpus: list[int] | None = None
) -> subprocess.Popen:
    """Start a worker that is killed when the thread that started it dies, pinned to `cpus`
    when given."""

    def before_exec() -> None:
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return subprocess.Popen(command, env=env, preexec_fn=before_exec)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def stop_process(process: subprocess.Popen, timeout: float) -> int:
    """SIGTERM (the server's graceful shutdown), then SIGKILL after `timeout` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode

"""Which GPUs and CPUs the local workers get: with several GPUs, worker i gets its own
(`CUDA_VISIBLE_DEVICES`), `devices_per_worker` of them for tensor parallelism. The count
comes from `CUDA_VISIBLE_DEVICES` or `nvidia-smi -L`, so the launcher never imports torch.

Workers on the CPU get their own cores (`--worker-cpus split`, the default): the CPUs this
process may run on, cut into one contiguous share per worker, each worker pinned to its share
with as many compute threads. Without it every worker starts one thread per core of the
machine, and two workers' threads wait on each other's barriers: on 2 cores a batched step
took seconds instead of tens of milliseconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess


def visible_gpus() -> list[str]:
    """The GPU ids a process may use here ([] on a machine without NVIDIA GPUs)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [gpu.strip() for gpu in visible.split(",") if gpu.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU ")]


def devices_of_worker(index: int, gpus: list[str], devices_per_worker: int = 1) -> str | None:
    """The CUDA_VISIBLE_DEVICES of worker `index`, None to leave it unset (fewer GPUs than
    one worker needs: the workers share what there is, or run on the CPU)."""
    if len(gpus) < 2 * devices_per_worker:
        return None
    first = (index * devices_per_worker) % len(gpus)
    return ",".join(gpus[(first + k) % len(gpus)] for k in range(devices_per_worker))


def cpus_of_worker(index: int, num_workers: int, cpus: list[int]) -> list[int] | None:
    """The CPUs worker `index` of `num_workers` is pinned to: an equal contiguous share of
    `cpus` (the first shares one larger when they do not divide), None when there are fewer
    CPUs than workers (then the workers share them, one thread each)."""
    if num_workers < 1 or len(cpus) < num_workers:
        return None
    size, extra = divmod(len(cpus), num_workers)
    start = index * size + min(index, extra)
    return cpus[start : start + size + (1 if index < extra else 0)]

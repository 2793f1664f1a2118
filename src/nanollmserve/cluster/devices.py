"""Which GPUs the local workers get: with several GPUs, worker i gets its own
(`CUDA_VISIBLE_DEVICES`), `devices_per_worker` of them for tensor parallelism. The count
comes from `CUDA_VISIBLE_DEVICES` or `nvidia-smi -L`, so the launcher never imports torch.
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

"""Which CPU kernel runs the matmuls of a one-token step.

PyTorch sends bfloat16 and float16 matmuls on the CPU to oneDNN. A step of one token (a decode
step of a single sequence) is a chain of matrix-vector products, and its time is the time to
stream every weight through the cores once: oneDNN's kernel for a one-row input streams them
at ~12 GB/s on the 2-core CPU we measure on, while ATen's own matrix-vector kernel, which
PyTorch takes when oneDNN is switched off, streams them ~1.6x faster (bundled model, bfloat16:
23.5 -> 14.3 ms per token, same tokens). From two rows on, oneDNN's blocked GEMM wins (4x at
8 rows), so the switch covers one-token steps only.

The switch is PyTorch's process-wide "oneDNN enabled" flag, set for the duration of the step
and restored after; the engine runs steps on one thread, and nothing else in the process runs
matmuls meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_ONEDNN_DTYPES = (torch.bfloat16, torch.float16)


@contextmanager
def matmul_kernels_for(num_rows: int, device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Inside: the matmuls of a step whose inputs have `num_rows` rows use the faster kernel."""
    if num_rows != 1 or device.type != "cpu" or dtype not in _ONEDNN_DTYPES:
        yield
        return
    was_enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(was_enabled)

"""Decode as a memory-bandwidth figure: the bytes a one-token step of a GGUF model must read,
and the rate at which this machine's threads can read memory at all.

A single stream's decode step reads every weight once, so (bytes a token) / TPOT is the
memory traffic it sustains. That traffic is set against the machine's read bandwidth,
measured in the same run. scripts/bench-batched uses this to report both servers' c1 decode
in GB/s (issue 40: "report our decode GB/s against the machine's measured memory
bandwidth").

- The bytes are the file's: every tensor of the GGUF except `token_embd.weight`, of which a
  step reads one row. It is counted in full where the model ties its output head to it (no
  `output.weight`), because the head reads all of it. The 1-D norm tensors are included;
  they are tiny.
- The KV cache a step reads is left out. At the benchmark's 128-token prompts it is under
  1% of a 1B model's weights.
- One numerator serves both servers. Ours streams its tile-blocks, which can be a little
  larger than the file's blocks (a Q4_K weight: 4.69 bits against 4.5). So the figure is
  the file's bytes over the time, the same for each server.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

TOKEN_EMBEDDING = "token_embd.weight"
OUTPUT_HEAD = "output.weight"


def decode_bytes_per_token(path: str | Path) -> int:
    """Bytes of the GGUF file at `path` that a one-token decode step reads (see the module
    docstring)."""
    import gguf

    tensors = gguf.GGUFReader(str(path)).tensors
    names = {tensor.name for tensor in tensors}
    tied = OUTPUT_HEAD not in names
    return sum(int(t.n_bytes) for t in tensors if t.name != TOKEN_EMBEDDING or tied)


def read_bandwidth_gb_s(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """The best of `repeats` timed full reads (a sum) of an `nbytes` float32 buffer on
    PyTorch's threads, in GB/s (1e9 bytes). Use a buffer far larger than the last-level
    cache, so that the reads come from memory."""
    if nbytes < 4 or repeats < 1:
        raise ValueError(
            f"read_bandwidth_gb_s: nbytes {nbytes} and repeats {repeats} must be positive"
        )
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)  # written once: its pages are resident
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best / 1e9

"""Turn the `--device` and `--dtype` flags into a torch device and dtype, or a clear error.

`auto` picks CUDA with bfloat16 (float16 on GPUs without bfloat16) when a GPU is there, and
the CPU otherwise, in bfloat16 where the CPU has native bfloat16 math (AVX512-BF16 or AMX:
batched matmuls run several times faster than in float32 there) and float32 elsewhere.
"""

from __future__ import annotations

import re

import torch

from nanollmserve.errors import UserError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str = "auto") -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N` -> torch.device; a GPU asked for must exist."""
    name = (device or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", name)
    if not match:
        raise UserError(f"unknown device {device!r} (expected auto, cpu, cuda or cuda:N)")
    if not torch.cuda.is_available():
        raise UserError(
            f"device {device!r} asked for, but CUDA is not available on this machine "
            f"(torch {torch.__version__}); use --device cpu"
        )
    index = int(match.group(1) or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise UserError(f"device {device!r} does not exist: this machine has {count} CUDA GPU(s)")
    return torch.device("cuda", index)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` or a dtype name -> torch.dtype. auto: bfloat16 on CUDA (float16 on GPUs without
    bfloat16 support); on CPU bfloat16 where the CPU computes it natively, else float32."""
    name = (dtype or "auto").strip().lower()
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r} (expected auto, float32, bfloat16 or float16)")
    return DTYPES[name]


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX tiles: bfloat16 matmuls in hardware, not emulated in float32."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")

"""The native ops as typed Python functions: the one place that calls into the C library.

Each function checks the shapes, dtypes and devices of its tensors before any native code
runs (a wrong pointer in C is a crash or silent garbage, a wrong shape here is a ValueError),
passes the pointers, and turns the C status into an exception. Per-call scratch memory is a
workspace allocated once and grown when a larger step needs more, not allocated per call.
"""

from __future__ import annotations

import torch

from nanollmserve.model.gguf_blocks import BLOCK_SIZE, TILE_BLOCK_BYTES, TILE_OUTPUTS

NLS_NO_MEMORY = -1
NLS_BAD_SHAPE = -5


class _Workspace:
    """A byte buffer reused across calls, grown (never shrunk) to the largest request."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def get(self, nbytes: int) -> torch.Tensor:
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer


_matmul_workspace = _Workspace()


def _library():
    from nanollmserve.native.build import load_kernels

    library = load_kernels()
    if library is None:
        from nanollmserve.native.build import kernels_unavailable_reason

        raise RuntimeError(f"the native kernels are unavailable: {kernels_unavailable_reason()}")
    return library


def gguf_matmul(
    kind: int, tiles: torch.Tensor, out_features: int, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [rows, in] (any float dtype, CPU) @ W^T (+ bias) -> float32 [rows, out_features],
    W being `tiles` (uint8 [ceil(out / 16), in / 32, tile-block bytes of `kind`],
    `BlockRows.tiled()`)."""
    if x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(
            f"GGUF matmul: input {list(x.shape)} on {x.device} is not [rows, in] on the CPU"
        )
    rows, in_features = x.shape
    expected = (
        -(-out_features // TILE_OUTPUTS),
        in_features // BLOCK_SIZE,
        TILE_BLOCK_BYTES.get(kind),
    )
    if (
        tiles.dtype != torch.uint8
        or tuple(tiles.shape) != expected
        or not tiles.is_contiguous()
        or in_features % BLOCK_SIZE
        or in_features == 0
    ):
        raise ValueError(
            f"GGUF matmul: tiles {list(tiles.shape)} ({tiles.dtype}) do not fit an input "
            f"[{rows}, {in_features}] and {out_features} outputs of kind {kind}"
        )
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,)):
        raise ValueError(
            f"GGUF matmul: bias {list(bias.shape)} ({bias.dtype}) is not float32 [{out_features}]"
        )
    x = x.float().contiguous()
    out = torch.empty(rows, out_features)
    if rows == 0:
        return out
    library = _library()
    threads = torch.get_num_threads()
    nbytes = library.nls_gguf_matmul_workspace_bytes(in_features, rows, threads)
    workspace = _matmul_workspace.get(nbytes)
    status = library.nls_gguf_matmul(
        kind, tiles.data_ptr(), out_features, in_features, x.data_ptr(), rows,
        None if bias is None else bias.contiguous().data_ptr(), out.data_ptr(),
        workspace.data_ptr(), workspace.numel(), threads,
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(
            f"native GGUF matmul failed ({out_features}x{in_features}): status {status}"
        )
    return out

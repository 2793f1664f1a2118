"""The native library, loaded and bound, and its ops as typed Python functions: the one place
that calls into the C library.

One function per C entry point (vLLM's `_custom_ops.py` is the model): it checks the shapes,
dtypes, devices and contiguity of its tensors before any native code runs (a wrong pointer
in C is a crash or silent garbage, a wrong shape here is a ValueError), passes the pointers,
and turns the C status (NLS_* in native/native.h) into an exception: MemoryError for
NLS_NO_MEMORY, ValueError naming what was out of range for the others. Per-call scratch
memory is a `Workspace` allocated once per thread (the engine's) and grown when a larger
step needs more, never allocated per call, here or in C.

Each entry point's ctypes signature is declared beside the function that calls it (AMX's
`nls_amx_init` included), and `bind` sets them all on the library `load_kernels` opens (the
build of this CPU's ISA level, compiled by `native/build.py`). `bind` then checks the
library's ABI (`nls_abi_info`: its constants, statuses, struct sizes and field offsets)
against this side's (`native/abi.py`) and refuses a library that differs: the kernels are
then reported unavailable with the differences as the reason.

The library loads after PyTorch, so its OpenMP runtime is the one PyTorch already loaded
(same `libgomp.so.1` soname): one thread pool, not two. `load_kernels()` returns None, with
the reason logged once, where the kernels cannot run: not Linux x86-64, a CPU without
AVX2/FMA/F16C, no C compiler, a failed build, or a library whose constants or struct layouts
differ from `native/abi.py`'s. Callers then keep the dequantized weights.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import threading

import torch

from nanollmserve.native.abi import (
    BLOCK_SIZE,
    DECODE_PHASES,
    KIND_Q8,
    MAX_HEAD_DIM,
    NLS_BAD_BLOCK,
    NLS_BAD_POSITION,
    NLS_BAD_SHAPE,
    NLS_BAD_TOKEN,
    NLS_KV_F16,
    NLS_KV_F32,
    NLS_KV_INT8,
    NLS_NO_MEMORY,
    TILE_BLOCK_BYTES,
    TILE_OUTPUTS,
    NlsModel,
    abi_differences,
    expected_abi,
    head_limits,
    kquant_bits,
    library_abi,
)
from nanollmserve.native.build import NativeUnavailable, build_library, isa_level

logger = logging.getLogger(__name__)

KV_DTYPE_CODES = {torch.float32: NLS_KV_F32, torch.int8: NLS_KV_INT8, torch.float16: NLS_KV_F16}
"""The KV cache dtypes the attention reads -> their `nls_model.kv_dtype` codes."""

_i32, _i64, _int, _float, _ptr = (
    ctypes.c_int32, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p,
)  # fmt: skip
_SIGNATURES: dict[str, tuple[list, type]] = {}


def _signature(name: str, argtypes: list, restype: type) -> None:
    """Declares C function `name`'s signature; `bind` sets it on the loaded library."""
    _SIGNATURES[name] = (argtypes, restype)


class Workspace:
    """A byte buffer reused across calls, grown (never shrunk) to the largest request. One
    buffer per thread: two engines stepping in two threads of a process never share one."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, nbytes: int) -> torch.Tensor:
        """At least `nbytes` bytes (uint8), the same buffer as last time when it is large
        enough."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._local.buffer = torch.empty(nbytes, dtype=torch.uint8)
        return buffer


MATMUL_WORKSPACE = Workspace()
ATTENTION_WORKSPACE = Workspace()
DRAW_WORKSPACE = Workspace()


def available() -> bool:
    """Whether the native library is loaded (built for this CPU, ABI checked)."""
    return load_kernels() is not None


def _library() -> ctypes.CDLL:
    library = load_kernels()
    if library is None:
        raise RuntimeError(f"the native kernels are unavailable: {kernels_unavailable_reason()}")
    return library


def _check_tensor(
    op: str, name: str, tensor: object, dtype: torch.dtype | None, dims: int | None
) -> torch.Tensor:
    """`tensor`, or ValueError when it is not a CPU tensor of `dtype` (None: any
    floating-point dtype) with `dims` dimensions (None: any)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{op}: {name} is a {type(tensor).__name__}, not a tensor")
    if tensor.device.type != "cpu":
        raise ValueError(f"{op}: {name} is on {tensor.device}, not the CPU")
    if dtype is None and not tensor.dtype.is_floating_point:
        raise ValueError(f"{op}: {name} is {tensor.dtype}, not a floating-point tensor")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"{op}: {name} is {tensor.dtype}, not {dtype}")
    if dims is not None and tensor.dim() != dims:
        raise ValueError(f"{op}: {name} {list(tensor.shape)} is not {dims}-dimensional")
    return tensor


def _raise_for(status: int, op: str, reasons: dict[int, str]) -> None:
    """Nothing for status 0; else the exception the C status stands for."""
    if status == 0:
        return
    if status == NLS_NO_MEMORY:
        raise MemoryError(f"{op}: out of memory")
    if status in reasons:
        raise ValueError(f"{op} refused its inputs: {reasons[status]}")
    raise RuntimeError(f"{op}: unexpected native status {status}")


# ------------------------------------------------------------------ GGUF block matmul --

_signature("nls_gguf_matmul_workspace_bytes", [_i64, _i64, _int], _i64)
_signature(
    "nls_gguf_matmul",
    [_int, _ptr, _i64, _i64, _ptr, _i64, _ptr, _int, _ptr, _ptr, _i64, _int],
    _int,
)


def gguf_matmul(
    kind: int,
    tiles: torch.Tensor,
    out_features: int,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    int16: bool = False,
) -> torch.Tensor:
    """x [rows, in] (any float dtype, CPU) @ W^T (+ bias) -> float32 [rows, out_features],
    W being `tiles` (uint8 [ceil(out / 16), in / 32, tile-block bytes of `kind`],
    `BlockRows.tiled()`, or for a K-quant kind `KQuantRows.tiled()`). `int16`: keep int16
    activations where the kind would multiply int8 ones (`abi.int8_group`): the output
    projection's choice (decision 48)."""
    op = "GGUF matmul"
    if x.dim() != 2 or x.device.type != "cpu" or not x.dtype.is_floating_point:
        raise ValueError(
            f"{op}: input {list(x.shape)} ({x.dtype}) on {x.device} is not a float "
            "[rows, in] on the CPU"
        )
    rows, in_features = x.shape
    expected = (
        -(-out_features // TILE_OUTPUTS),
        in_features // BLOCK_SIZE,
        TILE_BLOCK_BYTES.get(kind),
    )
    if (
        tiles.dtype != torch.uint8
        or tiles.device.type != "cpu"
        or tuple(tiles.shape) != expected
        or not tiles.is_contiguous()
        or in_features % BLOCK_SIZE
        or in_features == 0
    ):
        raise ValueError(
            f"{op}: tiles {list(tiles.shape)} ({tiles.dtype}, {tiles.device}) do not fit an "
            f"input [{rows}, {in_features}] and {out_features} outputs of kind {kind}"
        )
    if bias is not None and (
        bias.dtype != torch.float32 or bias.shape != (out_features,) or bias.device.type != "cpu"
    ):
        raise ValueError(
            f"{op}: bias {list(bias.shape)} ({bias.dtype}, {bias.device}) is not float32 "
            f"[{out_features}] on the CPU"
        )
    if kquant_bits(kind) is not None:  # kquant_cpu.c's layout: its own entry point, the bias after
        out = kquant_matmul(kind, tiles, out_features, x, int16=int16)
        return out if bias is None else out.add_(bias)
    x = x.float().contiguous()
    out = torch.empty(rows, out_features)
    if rows == 0:
        return out
    library = _library()
    threads = torch.get_num_threads()
    nbytes = library.nls_gguf_matmul_workspace_bytes(in_features, rows, threads)
    workspace = MATMUL_WORKSPACE.get(nbytes)
    status = library.nls_gguf_matmul(
        kind, tiles.data_ptr(), out_features, in_features, x.data_ptr(), rows,
        None if bias is None else bias.contiguous().data_ptr(), int(int16), out.data_ptr(),
        workspace.data_ptr(), workspace.numel(), threads,
    )  # fmt: skip
    _raise_for(status, f"{op} ({out_features}x{in_features})", {NLS_BAD_SHAPE: "bad shape"})
    return out


_signature("nls_q8_matmul_ref", [_ptr, _i64, _i64, _ptr, _i64, _ptr], _int)


def q8_matmul_reference(tiles: torch.Tensor, out_features: int, x: torch.Tensor) -> torch.Tensor:
    """`gguf_matmul` of Q8 tiles (`KIND_Q8`) without a bias, by the plain-C twin of its int8
    kernel (`nls_q8_matmul_ref`, one thread): the numbers every ISA level's kernel gives."""
    rows, in_features = x.shape
    if tiles.dtype != torch.uint8 or tuple(tiles.shape) != (
        -(-out_features // TILE_OUTPUTS), in_features // BLOCK_SIZE, TILE_BLOCK_BYTES[KIND_Q8]
    ) or not tiles.is_contiguous():  # fmt: skip
        raise ValueError(
            f"Q8 reference matmul: tiles {list(tiles.shape)} do not fit {list(x.shape)}"
        )
    x = x.float().contiguous()
    out = torch.empty(rows, out_features)
    status = _library().nls_q8_matmul_ref(
        tiles.data_ptr(), out_features, in_features, x.data_ptr(), rows, out.data_ptr()
    )
    _raise_for(
        status, f"Q8 reference matmul ({out_features}x{in_features})", {NLS_BAD_SHAPE: "bad shape"}
    )
    return out


# ------------------------------------------------- K-quant and 5-bit block matmul --

_signature("nls_kq_tile_block_bytes", [_int], _i64)
_signature("nls_kq_matmul_workspace_bytes", [_i64, _i64, _int], _i64)
_signature(
    "nls_kq_matmul",
    [_int, _ptr, _i64, _i64, _ptr, _i64, _int, _ptr, _ptr, _i64, _int],
    _int,
)
_signature("nls_kq_matmul_ref", [_int, _ptr, _i64, _i64, _ptr, _i64, _int, _ptr], _int)


def kquant_matmul(
    kind: int,
    tiles: torch.Tensor,
    out_features: int,
    x: torch.Tensor,
    reference: bool = False,
    int16: bool = False,
) -> torch.Tensor:
    """x [rows, in] (any float dtype, CPU) @ W^T -> float32 [rows, out_features], W being
    `tiles` of K-quant `kind` (its codes' bits and layout: uint8 [ceil(out / 16), in / 32,
    tile-block bytes], `KQuantRows.tiled()` of model/gguf_kquants.py, the kind
    `KQuantRows.kind`). `reference`: the plain-C twin
    (`nls_kq_matmul_ref`, one thread) instead of this build's vector kernel. `int16`: keep
    int16 activations where the kind would multiply int8 ones (`gguf_matmul`'s)."""
    op = "K-quant matmul"
    if x.dim() != 2 or x.device.type != "cpu" or not x.dtype.is_floating_point:
        raise ValueError(
            f"{op}: input {list(x.shape)} ({x.dtype}) on {x.device} is not a float "
            "[rows, in] on the CPU"
        )
    library = _library()
    rows, in_features = x.shape
    block_bytes = library.nls_kq_tile_block_bytes(kind)
    expected = (-(-out_features // TILE_OUTPUTS), in_features // BLOCK_SIZE, block_bytes)
    if (
        block_bytes < 0
        or tiles.dtype != torch.uint8
        or tiles.device.type != "cpu"
        or tuple(tiles.shape) != expected
        or not tiles.is_contiguous()
        or in_features % BLOCK_SIZE
        or in_features == 0
    ):
        raise ValueError(
            f"{op}: tiles {list(tiles.shape)} ({tiles.dtype}, {tiles.device}) do not fit an "
            f"input [{rows}, {in_features}] and {out_features} outputs of kind {kind}"
        )
    x = x.float().contiguous()
    out = torch.empty(rows, out_features)
    if rows == 0:
        return out
    if reference:
        status = library.nls_kq_matmul_ref(
            kind, tiles.data_ptr(), out_features, in_features, x.data_ptr(), rows, int(int16),
            out.data_ptr(),
        )  # fmt: skip
    else:
        threads = torch.get_num_threads()
        nbytes = library.nls_kq_matmul_workspace_bytes(in_features, rows, threads)
        workspace = MATMUL_WORKSPACE.get(nbytes)
        status = library.nls_kq_matmul(
            kind, tiles.data_ptr(), out_features, in_features, x.data_ptr(), rows, int(int16),
            out.data_ptr(), workspace.data_ptr(), workspace.numel(), threads,
        )  # fmt: skip
    _raise_for(status, f"{op} ({out_features}x{in_features})", {NLS_BAD_SHAPE: "bad shape"})
    return out


# ------------------------------------------------------------- the embedding lookup --

_signature("nls_embed_rows", [_int, _ptr, _i64, _i64, _ptr, _i64, _ptr], _int)


def embed_rows(kind: int, table: torch.Tensor, vocab: int, ids: torch.Tensor) -> torch.Tensor:
    """The decode step's embedding lookup (`embed_row` of gguf_cpu.c): float32 rows
    [len(ids), hidden] of a table of `kind`: 0, float32 [vocab, hidden]; else the tiled blocks
    of a linear weight of that kind (uint8 [ceil(vocab / 16), hidden / 32, tile-block bytes],
    `GGUFEmbedding.tiles`), only the looked-up rows dequantized."""
    op = "embedding lookup"
    if kind == 0:
        _check_tensor(op, "table", table, torch.float32, 2)
        hidden = table.shape[1]
    else:
        _check_tensor(op, "table", table, torch.uint8, 3)
        hidden = table.shape[1] * BLOCK_SIZE
        expected = (-(-vocab // TILE_OUTPUTS), table.shape[1], TILE_BLOCK_BYTES.get(kind))
        if tuple(table.shape) != expected:
            raise ValueError(f"{op}: tiles {list(table.shape)} do not hold a kind {kind} table")
    if table.shape[0] < (vocab if kind == 0 else 1) or not table.is_contiguous():
        raise ValueError(f"{op}: table {list(table.shape)} does not hold {vocab} rows")
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), hidden)
    status = _library().nls_embed_rows(
        kind, table.data_ptr(), vocab, hidden, ids.data_ptr(), ids.numel(), out.data_ptr()
    )
    reasons = {
        NLS_BAD_SHAPE: "a kind or width it cannot read",
        NLS_BAD_TOKEN: "token id outside the vocabulary",
    }
    _raise_for(status, op, reasons)
    return out


# -------------------------------------------------------------- paged decode attention --

_signature("nls_paged_decode_attention_workspace_bytes", [_i32, _i32, _i64, _int], _i64)
_signature(
    "nls_paged_decode_attention",
    [_ptr, _ptr, _ptr, _ptr, _ptr, _i32, _i64, _i32, _i32, _i32, _i32, _i64, _float, _ptr, _i64,
     _ptr, _ptr, _ptr, _i64, _int],
    _int,
)  # fmt: skip
_ATTENTION_REFUSALS = {
    NLS_BAD_POSITION: "a decode context is longer than its block table",
    NLS_BAD_BLOCK: "a decode block table names a block outside the KV pool",
    NLS_BAD_SHAPE: "heads or head size it cannot run",
}


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [seqs, heads, head_dim] (float32) -> the same shape: each sequence attends to its
    first context_lens[s] keys (int64 [seqs]) through its row of `block_tables` (int64
    [seqs, width]), read in place from the paged caches (contiguous, [blocks, block_size,
    kv_heads, head_dim]: float32, float16, or int8 codes with `k_scale` / `v_scale`, their
    float32 scales [blocks, block_size, kv_heads], `layers/kv_quant.py`). The C checks every
    length and block id it reads through (no host sync here) and its refusals are
    ValueErrors."""
    op = "native paged decode attention"
    _check_tensor(op, "q", q, torch.float32, 3)
    if k_scale is not None:
        cache_dtype = torch.int8
    elif k_cache.dtype == torch.float16:
        cache_dtype = torch.float16
    else:
        cache_dtype = torch.float32
    _check_tensor(op, "k_cache", k_cache, cache_dtype, 4)
    _check_tensor(op, "v_cache", v_cache, cache_dtype, 4)
    if cache_dtype == torch.int8:
        for name, scales in (("k_scale", k_scale), ("v_scale", v_scale)):
            _check_tensor(op, name, scales, torch.float32, 3)
            if scales.shape != k_cache.shape[:3] or not scales.is_contiguous():
                raise ValueError(
                    f"{op}: {name} {list(scales.shape)} is not the contiguous scales of caches "
                    f"{list(k_cache.shape)}"
                )
    elif v_scale is not None:
        raise ValueError(f"{op}: v_scale without k_scale")
    _check_tensor(op, "block_tables", block_tables, torch.int64, 2)
    _check_tensor(op, "context_lens", context_lens, torch.int64, 1)
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(
            f"{op}: caches {list(k_cache.shape)} and {list(v_cache.shape)} are not one "
            "contiguous shape"
        )
    if cache_head_dim != head_dim or head_limits(head_dim, num_heads, num_kv_heads):
        raise ValueError(
            f"{op}: q {list(q.shape)} does not fit caches {list(k_cache.shape)} (heads a "
            f"multiple of the KV heads, head_dim a multiple of 8 up to {MAX_HEAD_DIM})"
        )
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError(
            f"{op}: block tables {list(block_tables.shape)} and context lengths "
            f"{list(context_lens.shape)} are not one row per query ({num_seqs})"
        )
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{op}: scale {scale} is not a positive finite number")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    q, tables, lens = q.contiguous(), block_tables.contiguous(), context_lens.contiguous()
    library = _library()
    threads = torch.get_num_threads()
    table_width = block_tables.shape[1]
    nbytes = library.nls_paged_decode_attention_workspace_bytes(
        num_heads, num_kv_heads, table_width * block_size, threads
    )
    workspace = ATTENTION_WORKSPACE.get(nbytes)
    shapes = (
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale,
        tables.data_ptr(), table_width, lens.data_ptr(), out.data_ptr(), workspace.data_ptr(),
        workspace.numel(), threads,
    )  # fmt: skip
    scales = (k_scale.data_ptr(), v_scale.data_ptr()) if k_scale is not None else (None, None)
    status = library.nls_paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *scales, KV_DTYPE_CODES[cache_dtype],
        *shapes,
    )  # fmt: skip
    _raise_for(status, op, _ATTENTION_REFUSALS)
    return out


# ---------------------------------------------------------------------- filtered draw --

_signature("nls_filtered_draw_workspace_bytes", [_i64, _int], _i64)
_signature(
    "nls_filtered_draw",
    [_ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _int],
    _int,
)
_MAX_VOCAB = 2**31 - 1
"""Token ids are kept in 32 bits in the draw's candidates."""


def filtered_draw(
    x: torch.Tensor,
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """Rows of temperature-scaled logits `x` and their softmax `probs` (float32
    [rows, vocab]), each row's filters (top_k int64, 0 = off; top_p float32, 1 = off; min_p
    float32, 0 = off) and uniform `u` (float64 in [0, 1)) -> int64 [rows] token ids
    (`native/sampling_cpu.c`), -1 for a row whose kept tokens have no mass."""
    op = "native filtered draw"
    _check_tensor(op, "x", x, torch.float32, 2)
    _check_tensor(op, "probs", probs, torch.float32, 2)
    rows, vocab = x.shape
    if probs.shape != x.shape or not 0 < vocab <= _MAX_VOCAB:
        raise ValueError(
            f"{op}: logits {list(x.shape)} and probabilities {list(probs.shape)} are not one "
            f"[rows, vocab] shape with vocab in [1, {_MAX_VOCAB}]"
        )
    for name, values, dtype in (
        ("top_k", top_k, torch.int64),
        ("top_p", top_p, torch.float32),
        ("min_p", min_p, torch.float32),
        ("u", u, torch.float64),
    ):
        _check_tensor(op, name, values, dtype, 1)
        if values.shape[0] != rows:
            raise ValueError(f"{op}: {name} {list(values.shape)} is not one value per row ({rows})")
    tokens = torch.empty(rows, dtype=torch.int64)
    if rows == 0:
        return tokens
    x, probs = x.contiguous(), probs.contiguous()
    top_k, top_p, min_p, u = (t.contiguous() for t in (top_k, top_p, min_p, u))
    library = _library()
    threads = torch.get_num_threads()
    workspace = DRAW_WORKSPACE.get(library.nls_filtered_draw_workspace_bytes(vocab, threads))
    status = library.nls_filtered_draw(
        x.data_ptr(), probs.data_ptr(), rows, vocab, top_k.data_ptr(), top_p.data_ptr(),
        min_p.data_ptr(), u.data_ptr(), tokens.data_ptr(), workspace.data_ptr(),
        workspace.numel(), threads,
    )  # fmt: skip
    _raise_for(status, op, {NLS_BAD_SHAPE: f"bad shape [{rows}, {vocab}]"})
    return tokens


# ------------------------------------------------------------------------ decode step --

_signature("nls_decode_scratch_bytes", [_ptr, _i64, _int], _i64)
_signature(
    "nls_decode_step",
    [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _int],
    _int,
)
_DECODE_REFUSALS = {
    NLS_BAD_POSITION: "position out of range",
    NLS_BAD_TOKEN: "token id outside the vocabulary",
    NLS_BAD_BLOCK: "block id outside the KV pool",
    NLS_BAD_SHAPE: "a token count, sequence index, logit row or scratch it cannot run",
}
DECODE_WORKSPACE = Workspace()


def _check_model(op: str, model: object) -> NlsModel:
    if not isinstance(model, NlsModel):
        raise ValueError(f"{op}: {type(model).__name__} is not the native model structure")
    return model


def _bounds(values: torch.Tensor) -> tuple[int, int]:
    """The smallest and the largest of `values` (not empty), as Python ints."""
    low, high = torch.aminmax(values)
    return int(low), int(high)


def decode_step_limits(
    head_dim: int, num_heads: int, num_kv_heads: int, kv_dtype: torch.dtype, has_scales: bool
) -> str | None:
    """Why `decode_step` cannot run a decoder of these heads over a KV cache of `kv_dtype`
    (int8 codes need their scales: `has_scales`), or None."""
    reason = head_limits(head_dim, num_heads, num_kv_heads)
    if reason is not None:
        return reason
    if kv_dtype not in KV_DTYPE_CODES:
        return f"the step reads a float32, float16 or int8 KV cache, not {kv_dtype}"
    if kv_dtype == torch.int8 and not has_scales:
        return "the int8 KV cache has no scales bound"
    return None


def decode_step(
    model: NlsModel,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    seq_of_token: torch.Tensor,
    block_tables: torch.Tensor,
    logit_rows: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The whole model (`nls_decode_step`, an `NlsModel` of `native/abi.py`) over one step's
    `tokens` (int64 [T]) of one or several sequences: token t at `positions[t]` of sequence
    `seq_of_token[t]` (int64 [T]), whose blocks are row seq_of_token[t] of `block_tables`
    (int64 [seqs, width], reaching each token's position; a shorter table padded at its end
    with -1, no block); writes their K/V there and, for each token in `logit_rows` (int64
    [R]), one row of logits (or, without a native lm_head, the final normed hidden state)
    into `out` (float32, contiguous). The step's scratch memory is `DECODE_WORKSPACE`'s.

    The one check of a step's inputs (the engine's `StepBatch` is built unchecked and the
    C's own checks are its guard against a caller that skipped these): ValueError, before
    any native code runs, for a token id outside the vocabulary, a position outside
    [0, max_context), a sequence's table that does not reach its token's position (its
    entry there -1 or past the width), a block id outside the KV pool, a sequence index or
    logit row outside the step, or tensors of the wrong dtype, device or shape. A -1 before
    a table's end (no block under an earlier position) is not a layout the batch makes: the
    C refuses it (NLS_BAD_BLOCK, a ValueError here too) before it reads anything."""
    op = "native decode step"
    _check_model(op, model)
    for name, tensor, dims in (
        ("tokens", tokens, 1),
        ("positions", positions, 1),
        ("seq_of_token", seq_of_token, 1),
        ("block_tables", block_tables, 2),
        ("logit_rows", logit_rows, 1),
    ):
        _check_tensor(op, name, tensor, torch.int64, dims)
    _check_tensor(op, "out", out, torch.float32, None)
    count, rows = tokens.shape[0], logit_rows.shape[0]
    if count == 0 or positions.shape[0] != count or seq_of_token.shape[0] != count:
        raise ValueError(f"{op}: {count} tokens need one position and sequence each")
    num_seqs, width = block_tables.shape
    if num_seqs == 0 or width == 0:
        raise ValueError(f"{op}: an empty block table {list(block_tables.shape)}")
    if rows:
        low, high = _bounds(logit_rows)
        if not 0 <= low <= high < count:
            raise ValueError(f"{op}: logit rows outside the {count} tokens")
    low, high = _bounds(tokens)
    if not 0 <= low <= high < model.vocab:
        bad = low if low < 0 else high
        raise ValueError(f"{op}: token id {bad} is outside the vocabulary [0, {model.vocab})")
    low, high = _bounds(seq_of_token)
    if not 0 <= low <= high < num_seqs:
        raise ValueError(f"{op}: a sequence index outside the {num_seqs} block tables")
    low, high = _bounds(positions)
    if not 0 <= low <= high < model.max_context:
        raise ValueError(f"{op}: positions {low}..{high} are outside [0, {model.max_context})")
    if high // model.block_size >= width:
        raise ValueError(f"{op}: a block table of {width} blocks does not reach position {high}")
    low, high = _bounds(block_tables)
    if not -1 <= low <= high < model.num_blocks:
        bad = low if low < -1 else high
        raise ValueError(
            f"{op}: a block table names a block outside [0, {model.num_blocks}): {bad}"
        )
    if _bounds(block_tables[seq_of_token, positions // model.block_size])[0] < 0:
        raise ValueError(
            f"{op}: a block table does not reach a token's position: its entry there is -1, "
            f"outside [0, {model.num_blocks})"
        )
    width_out = model.vocab if model.lm_head_kind else model.hidden
    if out.numel() != rows * width_out or not out.is_contiguous():
        raise ValueError(
            f"{op}: out {list(out.shape)} is not {rows} contiguous rows of {width_out}"
        )
    tokens, positions, seq_of_token, block_tables, logit_rows = (
        t.contiguous() for t in (tokens, positions, seq_of_token, block_tables, logit_rows)
    )
    library = _library()
    threads = torch.get_num_threads()
    scratch = DECODE_WORKSPACE.get(
        library.nls_decode_scratch_bytes(ctypes.byref(model), count, threads)
    )
    status = library.nls_decode_step(
        ctypes.byref(model), tokens.data_ptr(), positions.data_ptr(), seq_of_token.data_ptr(),
        count, block_tables.data_ptr(), num_seqs, width, logit_rows.data_ptr(), rows,
        scratch.data_ptr(), scratch.numel(), out.data_ptr(), threads,
    )  # fmt: skip
    _raise_for(status, op, _DECODE_REFUSALS)


_signature("nls_decode_profile", [_int, _ptr], None)


def decode_profile(enable: bool) -> dict[str, float]:
    """Seconds each part of the native steps took since the last call (`DECODE_PHASES`; the
    engine thread's wall time between the step's barriers, all zero while off), reset; the
    timing is on from now when `enable`. Off, a phase costs one branch."""
    seconds = (ctypes.c_double * len(DECODE_PHASES))()
    _library().nls_decode_profile(int(enable), ctypes.addressof(seconds))
    return dict(zip(DECODE_PHASES, seconds, strict=True))


# ------------------------------------------------------------------ binding and the ABI --

_signature("nls_abi_info", [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(_i64), _i64], _i64)
_signature("nls_amx_init", [], _int)
"""0 when this process may use AMX tiles (Linux grants the tile state per process); builds
without AMX answer 0, having nothing to ask for."""


def bind(library: ctypes.CDLL) -> None:
    """Sets every entry point's signature on `library`, then checks its ABI against this
    side's; NativeUnavailable, with the differences, when the library does not match."""
    for name, (argtypes, restype) in _SIGNATURES.items():
        try:
            function = getattr(library, name)
        except AttributeError:
            raise NativeUnavailable(f"the native library has no {name} (a stale build?)") from None
        function.argtypes, function.restype = argtypes, restype
    differences = abi_differences(library_abi(library), expected_abi())
    if differences:
        raise NativeUnavailable(
            "the native library does not match the Python side: " + "; ".join(differences)
        )


def load_kernels() -> ctypes.CDLL | None:
    """The loaded library, its signatures set and its ABI checked, or None (reason logged
    once)."""
    return _load()[0]


def kernels_unavailable_reason() -> str | None:
    """None when the kernels are loaded, else why they cannot run here."""
    return _load()[1]


def _open_library() -> ctypes.CDLL:
    """The library of this CPU's ISA level, bound; for `amx`, only once the kernel has granted
    this process the AMX tile state, else the `avx512` one."""
    level = isa_level()
    library = ctypes.CDLL(str(build_library(level)))
    bind(library)
    if level == "amx" and library.nls_amx_init() != 0:
        logger.warning("the kernel refused AMX tile state to this process: using the avx512 build")
        library = ctypes.CDLL(str(build_library("avx512")))
        bind(library)
    return library


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    try:
        library = _open_library()
    except (NativeUnavailable, OSError) as error:
        logger.warning("native GGUF kernels unavailable: %s", error)
        return None, str(error)
    return library, None

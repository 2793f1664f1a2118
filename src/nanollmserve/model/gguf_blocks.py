"""The GGUF file's own 4-bit blocks of each linear weight, under our module names.

A GGUF Q4_0 / Q4_1 tensor is a row-major matrix `[out, in]` cut into blocks of 32 inputs; a
Q4_1 block is `d` (float16), `m` (float16) and 16 bytes of 4-bit codes `q` (0..15), and
stands for the weights `d * q + m`; a Q4_0 block has no `m` and stands for `d * (q - 8)`.
Byte `j` of a block holds input `j` in its low nibble and input `j + 16` in its high one.

This module reads those blocks (never the dequantized floats) and returns, per linear weight
of our model (`model.layers.0.self_attn.qkv_proj.weight`, ...), the codes as int32 `[out, in]`
and the per-block constants `d` and `m` as float32 `[out, in / 32]`, ready for PyTorch's int4
kernel (`layers/gguf_linear.py`). q/k/v and gate/up are concatenated along the output rows as
the fused modules expect, and llama.cpp's reordering of the query and key rows of Llama-family
files (its converter interleaves the two rotary halves of each head) is undone on the rows, as
transformers undoes it on the floats, so row `i` here is row `i` of the dequantized checkpoint.

Tensors of other types (Q8_0, K-quants, floats) are not returned: they stay dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nanollmserve.model.model_config import ModelConfig

BLOCK_SIZE = 32
INT4_TYPES = ("Q4_0", "Q4_1")
"""GGUF block types kept quantized (4-bit codes, one or two float16 constants per block)."""

_LAYER_TENSORS = {
    "attn_q": ("self_attn.qkv_proj", 0),
    "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", None),
    "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", None),
}
"""GGUF tensor `blk.N.<key>.weight` -> (our module under `model.layers.N`, fused shard index)."""
_ROTARY_PERMUTED_ARCHITECTURES = ("llama", "mistral")


@dataclass
class Int4Blocks:
    """One linear weight in 4-bit blocks: `w[o, i] = scale[o, i // 32] * (codes[o, i] - 8) +
    zero[o, i // 32]` (the form of PyTorch's int4 kernel)."""

    codes: torch.Tensor
    """int32 [out, in], values 0..15."""
    scale: torch.Tensor
    """float32 [out, in / 32]: the block's `d`."""
    zero: torch.Tensor
    """float32 [out, in / 32]: `m + 8 d` (Q4_1) or 0 (Q4_0)."""

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: the weights these blocks stand for."""
        scale = self.scale.repeat_interleave(BLOCK_SIZE, dim=1)
        zero = self.zero.repeat_interleave(BLOCK_SIZE, dim=1)
        return (self.codes - 8).float() * scale + zero


def read_int4_blocks(gguf_path: Path, config: ModelConfig) -> dict[str, Int4Blocks]:
    """Our weight name -> its blocks, for every linear weight stored as Q4_0 / Q4_1 whose fused
    parts all are (a fused module with one part of another type stays dequantized)."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    architecture = _architecture(reader)
    parts: dict[str, dict[int | None, Int4Blocks]] = {}
    for tensor in reader.tensors:
        name = tensor.name
        if not name.startswith("blk.") or not name.endswith(".weight"):
            continue
        _, layer, key, _ = name.split(".")
        if key not in _LAYER_TENSORS or tensor.tensor_type.name not in INT4_TYPES:
            continue
        module, shard = _LAYER_TENSORS[key]
        blocks = _blocks(np.asarray(tensor.data), tensor.tensor_type.name)
        if architecture in _ROTARY_PERMUTED_ARCHITECTURES and key in ("attn_q", "attn_k"):
            heads = config.num_heads if key == "attn_q" else config.num_kv_heads
            blocks = _unpermute_rows(blocks, heads)
        parts.setdefault(f"model.layers.{layer}.{module}.weight", {})[shard] = blocks
    weights = {}
    for name, shards in parts.items():
        expected = 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1
        if len(shards) != expected:
            continue
        ordered = [shards[i] for i in sorted(shards, key=lambda s: -1 if s is None else s)]
        weights[name] = Int4Blocks(
            torch.cat([b.codes for b in ordered]),
            torch.cat([b.scale for b in ordered]),
            torch.cat([b.zero for b in ordered]),
        )
    return weights


def _architecture(reader) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        return ""
    return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")


def _blocks(raw: np.ndarray, block_type: str) -> Int4Blocks:
    """`raw`: uint8 [out, blocks * bytes per block] as stored in the file."""
    rows = raw.shape[0]
    block_bytes = 20 if block_type == "Q4_1" else 18
    blocks = raw.reshape(rows, -1, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if block_type == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8.0 * d
        packed = blocks[..., 4:]
    else:
        zero = np.zeros_like(d)
        packed = blocks[..., 2:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # inputs 0..15, then 16..31
    return Int4Blocks(
        torch.from_numpy(codes.reshape(rows, -1).astype(np.int32)),
        torch.from_numpy(d),
        torch.from_numpy(zero),
    )


def _unpermute_rows(blocks: Int4Blocks, num_heads: int) -> Int4Blocks:
    """Undo llama.cpp's per-head interleave of the rotary halves (rows only: blocks run along
    the inputs, so a row permutation keeps every block whole)."""
    rows = blocks.codes.shape[0]
    half = rows // num_heads // 2
    order = torch.arange(rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(rows)
    return Int4Blocks(blocks.codes[order], blocks.scale[order], blocks.zero[order])

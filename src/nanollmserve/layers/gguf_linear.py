"""`--quantization gguf`: linear layers that run the GGUF file's own 4-bit blocks.

The bundled model stores its linear weights as Q4_1 blocks (32 weights, 4-bit codes `q`, two
float16 constants: `w = d * q + m`). PyTorch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`,
groups of 32) computes `w = (q - 8) * scale + zero`, so `scale = d` and `zero = m + 8 d` is
the file's own arithmetic (Q4_0: `zero = 0`): nothing is re-quantized, the codes are the
file's (`model/gguf_blocks.py`), and the only rounding is that of the two block constants and
of the activations to the kernel's bfloat16.

A one-token step streams every weight once, so it runs at the speed the kernel reads weights:
4.5 bits a weight instead of 32 (float32) or 16 (bfloat16). Measured on the model's shapes
(the 120 linear layers of the bundled model, 2 threads, AVX2 CPU): 9.0 ms at 1 row against
34.6 ms for float32 weights; 12.2 vs 61 at 4 rows; 50 vs 62 at 16; even at 32; 183 vs 127 at
64. So a step of more than `MAX_INT4_ROWS` rows multiplies with a dense copy of the weights in
the model dtype instead (the weights dequantized from the same blocks, as without `gguf`):
large steps are bound by arithmetic, not by weight bytes, and the dense GEMM does that better.
The dense copy costs the memory of the unquantized model; dequantizing the blocks into one
reused buffer before each layer's GEMM would save it, but unpacking 4-bit codes with tensor
ops costs more than the GEMM it feeds (see the m17 decision log).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from nanollmserve.layers.quantization import Fp16Linear, WeightOnlyLinear
from nanollmserve.model.gguf_blocks import BLOCK_SIZE, Int4Blocks

MAX_INT4_ROWS = 16
"""Steps with at most this many rows use the int4 kernel; larger ones the dense copy."""


def kernel_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The activation dtype of the int4 kernel: its float32 path is not vectorized (13x slower
    than its bfloat16 path at one row on AVX2), so float32 models convert to bfloat16 for it."""
    return torch.float16 if model_dtype == torch.float16 else torch.bfloat16


def pack_int4_blocks(blocks: Int4Blocks, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The blocks in the int4 kernel's layout: `packed` (uint8) and `scale_zero` [in/32, out, 2]."""
    packed = torch._convert_weight_to_int4pack_for_cpu(blocks.codes.contiguous(), 1)
    scale_zero = torch.stack([blocks.scale.t(), blocks.zero.t()], dim=-1)
    return {"packed": packed, "scale_zero": scale_zero.to(dtype).contiguous()}


class GGUFInt4Linear(WeightOnlyLinear):
    """A linear layer holding its GGUF 4-bit blocks (packed for PyTorch's int4 kernel) and a
    dense copy of the same weights for large steps."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        packed: torch.Tensor,
        scale_zero: torch.Tensor,
    ) -> None:
        super().__init__(weight)
        if self.in_features % BLOCK_SIZE:
            raise ValueError(f"in_features {self.in_features} is not a multiple of {BLOCK_SIZE}")
        self.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zero", scale_zero)
        self.max_int4_rows = MAX_INT4_ROWS

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_int4_rows:
            return F.linear(x, self.weight, self.bias)
        out = torch._weight_int4pack_mm_for_cpu(
            x.to(self.scale_zero.dtype), self.packed, BLOCK_SIZE, self.scale_zero
        ).to(x.dtype)
        return out if self.bias is None else out + self.bias


def apply_gguf_blocks(model: nn.Module, packed: dict[str, dict[str, torch.Tensor]]) -> int:
    """Replace each linear layer whose weight has blocks in `packed` (weight name -> the
    `pack_int4_blocks` tensors) in place -> the number replaced.

    A tied output projection (the embedding table, stored as Q8_0 in the bundled file) gets a
    float16 copy run by fbgemm's float16 GEMM when the model computes in float32: 2.3 ms per
    token instead of 9.3 for the float32 table (49152 x 576, 2 threads); float16 keeps 11
    significant bits of Q8_0's `d * q`.
    """
    replaced = 0
    for module_name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or f"{module_name}.weight" not in packed:
            continue
        tensors = packed[f"{module_name}.weight"]
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(
            parent,
            attr,
            GGUFInt4Linear(module.weight, module.bias, tensors["packed"], tensors["scale_zero"]),
        )
        replaced += 1
    lm_head = getattr(model, "lm_head", "absent")
    embedding = model.model.embed_tokens.weight
    if lm_head is None and embedding.dtype == torch.float32:
        model.lm_head = Fp16Linear(embedding, None)
    return replaced


def int4_kernel_for_every_step(model: nn.Module) -> None:
    """Make every step, however many rows, run the int4 kernel (slow for large steps): what
    `bench quality` scores, so the perplexity of `gguf` is that of the kernel's arithmetic,
    the one decode steps use, not that of the dense copy."""
    for module in model.modules():
        if isinstance(module, GGUFInt4Linear):
            module.max_int4_rows = sys.maxsize

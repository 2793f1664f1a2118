"""`--quantization gguf`: linear layers that run the GGUF file's own quantized blocks.

The bundled model stores its linear weights as Q4_1 blocks (32 weights, 4-bit codes `q`, two
float16 constants: `w = d * q + m`) and its embedding table, which is also its output
projection, as Q8_0 (`w = d * q`, 8-bit codes). These layers keep those blocks
(`model/gguf_blocks.py`: nothing is re-quantized) and multiply with them through the native
kernels (`native/gguf_cpu.c`), which quantize each activation row to int16 per block of 32
(llama.cpp uses int8, which moved the bundled model's answers; decision 26 in
docs/ARCHITECTURE.md) and take a block's dot product in two `madd`s of 16-bit integers.

A one-token step streams every weight once, so it runs at the speed the kernel reads weights:
4.5 bits a weight (Q4_1) instead of 32 (float32). Measured on the bundled model (2 threads,
AVX2 EPYC, best of 3-5): its 120 linear layers take 3.8 ms at one row in the kernel alone
(6.3 ms through these modules, one call each; PyTorch's int4 kernel took 9.0, float32 weights
34.6). With more rows each group of 8 blocks is decoded once for all of them, but the integer
products grow with the rows: 17.6 ms at 4 rows against 53.2 for the dense float32 weights,
52.5 vs 67.6 at 16, 72.5 vs 81.9 at 24, 112.6 vs 100.9 at 32. So a step of more than
`MAX_NATIVE_ROWS` rows multiplies with a dense copy of the weights in the model dtype (the
weights dequantized from the same blocks, as without `gguf`), which does large steps better.
The Q8_0 output projection (49152 x 576) crosses over later, past `MAX_NATIVE_ROWS_OUTPUT`
rows (25.4 vs 33.9 ms at 32, 58.5 vs 45.1 at 64): its float32 table is 113 MB to stream. The
dense copy costs the memory of the unquantized model (m17 decision log).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from nanollmserve.layers.quantization import WeightOnlyLinear
from nanollmserve.model.gguf_blocks import BlockRows

MAX_NATIVE_ROWS = 24
"""Steps with at most this many rows use the native block kernel; larger ones the dense copy."""
MAX_NATIVE_ROWS_OUTPUT = 48
"""The same crossover for the output projection over the vocabulary."""


class GGUFLinear(WeightOnlyLinear):
    """A linear layer holding its GGUF blocks (`BlockRows`) and a dense copy of the same
    weights (`weight`, float32) for steps of more than `max_native_rows` rows."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        blocks: BlockRows,
        max_native_rows: int = MAX_NATIVE_ROWS,
    ) -> None:
        super().__init__(weight)
        if blocks.rows.shape[0] != self.out_features or blocks.in_features != self.in_features:
            raise ValueError(
                f"blocks for [{blocks.rows.shape[0]}, {blocks.in_features}] do not fit a "
                f"[{self.out_features}, {self.in_features}] weight"
            )
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("the native GGUF kernels run float32 models on the CPU")
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.kind = blocks.kind
        self.register_buffer("block_rows", blocks.rows.contiguous())
        self.max_native_rows = max_native_rows

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_native_rows:
            return F.linear(x, self.weight, self.bias)
        from nanollmserve.native.build import load_kernels

        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"GGUF matmul: input {list(x.shape)} is not [rows, {self.in_features}]"
            )
        x = x.float().contiguous()
        out = torch.empty(x.shape[0], self.out_features)
        status = load_kernels().nls_gguf_matmul(
            self.kind,
            self.block_rows.data_ptr(),
            self.out_features,
            self.in_features,
            x.data_ptr(),
            x.shape[0],
            None if self.bias is None else self.bias.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(
                f"native GGUF matmul failed ({self.out_features}x{self.in_features})"
            )
        return out


def apply_gguf_blocks(model: nn.Module, blocks: dict[str, BlockRows]) -> int:
    """Replace each linear layer whose weight has blocks (weight name -> `BlockRows`) in place,
    and the output projection when the file has its blocks -> the number of linear layers
    replaced (the output projection not counted).

    The bundled model ties its output projection to the embedding table, stored as Q8_0: the
    lm_head becomes a `GGUFLinear` over those blocks (30 MB a token instead of the float32
    table's 113 MB), with the float32 table the embedding lookup keeps as its dense copy.
    """
    replaced = 0
    for module_name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or f"{module_name}.weight" not in blocks:
            continue
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = GGUFLinear(module.weight, module.bias, blocks[f"{module_name}.weight"])
        setattr(parent, attr, layer)
        replaced += 1
    lm_head = getattr(model, "lm_head", "absent")
    if "lm_head.weight" in blocks and (lm_head is None or isinstance(lm_head, nn.Linear)):
        dense = model.model.embed_tokens.weight if lm_head is None else lm_head.weight
        model.lm_head = GGUFLinear(
            dense, None, blocks["lm_head.weight"], max_native_rows=MAX_NATIVE_ROWS_OUTPUT
        )
    return replaced


def native_kernel_for_every_step(model: nn.Module) -> None:
    """Make every step, however many rows, run the native block kernel (slow for large steps):
    what `bench quality` scores, so the perplexity of `gguf` is that of the kernel's
    arithmetic, the one decode steps use, not that of the dense copy."""
    for module in model.modules():
        if isinstance(module, GGUFLinear):
            module.max_native_rows = sys.maxsize

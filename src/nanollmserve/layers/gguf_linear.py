"""`--quantization gguf`: linear layers that run the GGUF file's own quantized blocks.

The bundled model stores its linear weights as Q4_1 blocks (32 weights, 4-bit codes `q`, two
float16 constants: `w = d * q + m`) and its embedding table, which is also its output
projection, as Q8_0 (`w = d * q`, 8-bit codes). These layers keep only those blocks
(`model/gguf_blocks.py`: nothing is re-quantized, and no dequantized copy is kept), tiled 16
outputs at a time, and multiply with them through the native kernels (`native/gguf_cpu.c`) at
every row count (weights in K-quant and 5-bit blocks through `native/kquant_cpu.c`'s kernel,
`model/gguf_kquants.py`): each activation row is quantized to int16 per block of 32 (llama.cpp uses
int8, which moved the bundled model's answers; decision 26 in docs/ARCHITECTURE.md), each
tile's weights are decoded once per block for all rows of the step, and a block's products
are 16-bit multiply-adds (AVX-512 VNNI `vpdpwssd` where the CPU has it, AVX2 `vpmaddwd`
otherwise: `native/build.py` builds one library per ISA level and loads the widest this CPU
runs).

A one-token step streams every weight once, at 4.5 bits a weight (Q4_1) instead of 32. A
batched step streams them once too, whatever its row count: the dense float32 copy that
larger steps used to multiply with (the memory of the unquantized model) is gone; the
crossover measurements that led to it are in the m17 decision log, the ones that retired it
in docs/benchmarks.md.
"""

from __future__ import annotations

import torch
from torch import nn

from nanollmserve.layers.gguf_embedding import GGUFEmbedding
from nanollmserve.layers.quantization import WeightOnlyLinear
from nanollmserve.model.gguf_blocks import BlockRows, BlockTiles, embedding_in_output_blocks
from nanollmserve.model.gguf_kquants import KQuantTiles


class GGUFLinear(WeightOnlyLinear):
    """A linear layer holding its GGUF blocks, tiled for the native kernels (`tiles`), and
    its float32 bias if any."""

    def __init__(
        self,
        blocks: BlockRows | BlockTiles | KQuantTiles,
        bias: torch.Tensor | None,
        out_features: int,
        in_features: int,
    ) -> None:
        super().__init__(out_features, in_features)
        if blocks.out_features != out_features or blocks.in_features != in_features:
            raise ValueError(
                f"blocks for [{blocks.out_features}, {blocks.in_features}] do not fit a "
                f"[{out_features}, {in_features}] weight"
            )
        if bias is not None and (bias.device.type != "cpu" or bias.is_meta):
            raise ValueError("the native GGUF kernels run float32 models on the CPU")
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        )
        self.kind = blocks.kind
        self.register_buffer("tiles", blocks.tiled())

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (what a LoRA delta beside this layer computes in)."""
        return torch.float32

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        from nanollmserve.native.ops import gguf_matmul

        return gguf_matmul(self.kind, self.tiles, self.out_features, x, self.bias)


def apply_gguf_blocks(
    model: nn.Module, blocks: dict[str, BlockRows | BlockTiles | KQuantTiles]
) -> int:
    """Replace each linear layer whose weight has blocks (weight name -> `BlockRows`) in place,
    and the output projection when the file has its blocks -> the number of linear layers
    replaced (the output projection not counted).

    The bundled model ties its output projection to the embedding table, stored as Q8_0: the
    lm_head becomes a `GGUFLinear` over those blocks (30 MB a token instead of the float32
    table's 113 MB), and the embedding lookup reads its rows from the same blocks
    (`GGUFEmbedding`): no float32 table is kept. A table in 4-bit blocks, or an untied one,
    keeps the float32 embedding.
    """
    replaced = 0
    for module_name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or f"{module_name}.weight" not in blocks:
            continue
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = GGUFLinear(
            blocks[f"{module_name}.weight"],
            module.bias,
            module.out_features,
            module.in_features,
        )
        setattr(parent, attr, layer)
        replaced += 1
    lm_head = getattr(model, "lm_head", "absent")
    if "lm_head.weight" in blocks and (lm_head is None or isinstance(lm_head, nn.Linear)):
        vocab, hidden = model.model.embed_tokens.weight.shape
        model.lm_head = GGUFLinear(blocks["lm_head.weight"], None, vocab, hidden)
        # tied: the table's own blocks
        if embedding_in_output_blocks(lm_head is None, model.lm_head.kind):
            model.model.embed_tokens = GGUFEmbedding(model.lm_head.tiles, vocab, hidden)
    return replaced

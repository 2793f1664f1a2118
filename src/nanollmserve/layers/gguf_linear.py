"""`--quantization gguf`: linear layers that run the GGUF file's own quantized blocks.

The bundled model stores its linear weights as Q4_1 blocks (32 weights, 4-bit codes `q`, two
float16 constants: `w = d * q + m`) and its embedding table, which is also its output
projection, as Q8_0 (`w = d * q`, 8-bit codes); the input embedding looks its rows up in the
same blocks (`gguf_embedding.py`). These layers keep only those blocks
(`model/gguf_blocks.py`: nothing is re-quantized, and no dequantized copy is kept), tiled 16
outputs at a time, and multiply with them through the native kernels (`native/gguf_cpu.c`) at
every row count (weights in K-quant and 5-bit blocks through `native/kquant_cpu.c`'s kernel,
`model/gguf_kquants.py`): each activation row is quantized to int16 per block of 32 (decision 26
in docs/ARCHITECTURE.md: llama.cpp's int8 moved the bundled model's answers), and the K-quant,
Q5 and Q8_0 kernels take those rows on to int8 as llama.cpp does (decisions 46-48; Q4_0 / Q4_1
and the output projection, `int16=True`, stay int16), each tile's weights are decoded once
per block for all rows of the step, and a block's products are integer multiply-adds
(AVX-512 VNNI `vpdpwssd` / `vpdpbusd` where the CPU has it, AVX2 `vpmaddwd` / `vpmaddubsw`
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
from nanollmserve.model.gguf_blocks import BlockRows, BlockTiles, embedding_blocks


class GGUFLinear(WeightOnlyLinear):
    """A linear layer holding its GGUF blocks, tiled for the native kernels (`tiles`), and
    its float32 bias if any. `int16`: its activations stay int16 whatever the blocks' type
    (the output projection: the logits are what tokens are chosen from, decision 48); else
    they go int8 where the type's kernel does (`abi.int8_group`)."""

    def __init__(
        self,
        blocks: BlockRows | BlockTiles,
        bias: torch.Tensor | None,
        out_features: int,
        in_features: int,
        int16: bool = False,
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
        self.int16 = int16
        self.register_buffer("tiles", blocks.tiled())

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (what a LoRA delta beside this layer computes in)."""
        return torch.float32

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        from nanollmserve.native.ops import gguf_matmul

        return gguf_matmul(self.kind, self.tiles, self.out_features, x, self.bias, self.int16)


def apply_gguf_blocks(model: nn.Module, blocks: dict[str, BlockRows | BlockTiles]) -> int:
    """Replace each linear layer whose weight has blocks (weight name -> `BlockRows`) in place,
    the output projection when the file has its blocks, and the input embedding when its table
    is in blocks -> the number of linear layers replaced (the output projection not counted).

    The input embedding looks its rows up in the table's own blocks (`GGUFEmbedding`): a tied
    table's are the output projection's (the bundled model's Q8_0 table: the lm_head runs 30
    MB a token instead of the float32 table's 113 MB, and nothing is stored twice), an untied
    one's are `blocks["model.embed_tokens.weight"]` (a Q4_K_M file's Q4_K table). No float32
    table is kept; a table in a type no kernel runs keeps the float32 embedding.
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
    vocab, hidden = model.model.embed_tokens.weight.shape
    if "lm_head.weight" in blocks and (lm_head is None or isinstance(lm_head, nn.Linear)):
        model.lm_head = GGUFLinear(blocks["lm_head.weight"], None, vocab, hidden, int16=True)
    tied = lm_head is None
    table = embedding_blocks(blocks, tied)
    if table is not None:
        # tied: the lm_head's own tiles (`tiled()` of a `BlockRows` would be a second copy)
        tiles = model.lm_head.tiles if tied else table.tiled()
        model.model.embed_tokens = GGUFEmbedding(table.kind, tiles, vocab, hidden)
    return replaced

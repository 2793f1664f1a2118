"""`--quantization gguf`: the input embedding read from the GGUF file's own Q8_0 blocks.

A model with tied embeddings (the bundled SmolLM2) stores one table, `token_embd.weight`, as
Q8_0 blocks (`w = d * q`: a float16 `d` and 32 signed 8-bit codes per block of 32). Its output
projection already runs those blocks (`GGUFLinear`, tiled for the native kernels). This
embedding looks its rows up in the same tiled blocks (the same tensor, no second copy) and
dequantizes only the rows a step asks for: the float32 table (vocab x hidden x 4 bytes, 113 MB
on the bundled model) is never built. `d * q` is one float32 multiply, so each row is the
float the dequantized table held: the answers do not move.

The native step (`engine/native_decode.py`) reads the same blocks in C (`embed_row` in
`native/gguf_cpu.c`); the model declares them with `embed_kind` KIND_Q8.
"""

from __future__ import annotations

import torch
from torch import nn

from nanollmserve.native.abi import BLOCK_SIZE, KIND_Q8, TILE_OUTPUTS

_CODE_BYTES = 512
"""A Q8 tile-block: 16 outputs x 32 int8 codes, then their 16 float16 `d`."""


class GGUFEmbedding(nn.Module):
    """Token ids [T] -> float32 rows [T, hidden] of a table held as tiled Q8 blocks
    (`BlockRows.tiled()`: uint8 [tiles, hidden / 32, 544], 16 vocabulary rows a tile)."""

    def __init__(self, tiles: torch.Tensor, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        num_tiles, num_blocks = -(-num_embeddings // TILE_OUTPUTS), embedding_dim // BLOCK_SIZE
        if tiles.dtype != torch.uint8 or tuple(tiles.shape[:2]) != (num_tiles, num_blocks):
            raise ValueError(
                f"tiles {tuple(tiles.shape)} do not hold a Q8 [{num_embeddings}, "
                f"{embedding_dim}] table"
            )
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.kind = KIND_Q8
        self.register_buffer("tiles", tiles)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        tile, output = flat // TILE_OUTPUTS, flat % TILE_OUTPUTS
        # byte 32 p + 2 o + i of a tile-block is output o's code for input 2 p + i
        codes = self.tiles[:, :, :_CODE_BYTES].unflatten(2, (BLOCK_SIZE // 2, TILE_OUTPUTS, 2))
        scales = self.tiles[:, :, _CODE_BYTES:].unflatten(2, (TILE_OUTPUTS, 2))
        row_codes = codes[tile, :, :, output, :].contiguous().view(torch.int8)  # [T, nb, 16, 2]
        row_scales = scales[tile, :, output, :].contiguous().view(torch.float16)  # [T, nb, 1]
        rows = row_codes.flatten(2).float() * row_scales.float()
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, Q8_0 blocks"

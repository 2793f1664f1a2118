"""`--quantization gguf`: the input embedding read from the GGUF file's own blocks.

A GGUF file stores its embedding table, `token_embd.weight`, in blocks like its linear
weights: Q8_0 on the bundled SmolLM2 (tied: the same table is its output projection), Q4_K on
a Q4_K_M file (untied, beside a Q6_K `output.weight`). Whenever the table's type is one the
native kernels run (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1), the table is kept as
those blocks in the kernels' tiled layout of its kind (`BlockRows.tiled()` for the legacy
kinds, `KQuantRows.tiled()` for the K-quant ones; a tied table is the output projection's
tiles, no second copy) and only the rows a step asks for are dequantized: the float32 table
(vocab x hidden x 4 bytes: 113 MB on the bundled model, 400 MB on a 1.2B Q4_K_M) is never
built, cached or read.

Every kind stands for its weights as products of a float16 and small integers plus at most
one such product (`w = d * q` for Q8, `d * q + m` for Q4, `d * (sc * (q - off)) + dm * mn`
for the K-quant kinds: `model/gguf_kquants.py`): each product is exact in float32, so each
row is the float the dequantized table held, rounded once as the `gguf` package rounds it
(tests/test_gguf_embedding.py checks it bit for bit): the answers do not move.

The native step (`engine/native_decode.py`) reads the same blocks in C (`embed_row` in
`native/gguf_cpu.c`, `nls_kq_dequant_row` in `native/kquant_cpu.c`); the model declares them
with `embed_kind` = this module's `kind`.
"""

from __future__ import annotations

import torch
from torch import nn

from nanollmserve.native.abi import (
    BLOCK_SIZE,
    KIND_Q4,
    KIND_Q8,
    TILE_BLOCK_BYTES,
    TILE_OUTPUTS,
    kquant_bits,
    kquant_offsets,
)


class GGUFEmbedding(nn.Module):
    """Token ids [T] -> float32 rows [T, hidden] of a table held as the tiled blocks of a
    linear weight of `kind` (KIND_Q4, KIND_Q8 or a K-quant kind): uint8
    [ceil(vocab / 16), hidden / 32, tile-block bytes], 16 vocabulary rows a tile."""

    def __init__(
        self, kind: int, tiles: torch.Tensor, num_embeddings: int, embedding_dim: int
    ) -> None:
        super().__init__()
        num_tiles, num_blocks = -(-num_embeddings // TILE_OUTPUTS), embedding_dim // BLOCK_SIZE
        shape = (num_tiles, num_blocks, TILE_BLOCK_BYTES.get(kind))
        if tiles.dtype != torch.uint8 or tuple(tiles.shape) != shape or embedding_dim % BLOCK_SIZE:
            raise ValueError(
                f"tiles {tuple(tiles.shape)} do not hold a kind {kind} [{num_embeddings}, "
                f"{embedding_dim}] table"
            )
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.kind = kind
        self.register_buffer("tiles", tiles)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        tile, output = flat // TILE_OUTPUTS, flat % TILE_OUTPUTS
        if self.kind == KIND_Q8:
            rows = self._q8_rows(tile, output)
        elif self.kind == KIND_Q4:
            rows = self._q4_rows(tile, output)
        else:
            rows = self._kquant_rows(tile, output)
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def _q8_rows(self, tile: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        # byte 32 p + 2 o + i of a tile-block is output o's code for input 2 p + i, then 16 `d`
        codes = self.tiles[:, :, :512].unflatten(2, (BLOCK_SIZE // 2, TILE_OUTPUTS, 2))
        scales = self.tiles[:, :, 512:].unflatten(2, (TILE_OUTPUTS, 2))
        row_codes = codes[tile, :, :, output, :].contiguous().view(torch.int8)  # [T, nb, 16, 2]
        row_scales = scales[tile, :, output, :].contiguous().view(torch.float16)  # [T, nb, 1]
        return row_codes.flatten(2).float() * row_scales.float()

    def _nibbles(self, tile: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """int32 [T, nb, 32]: the low 4 bits of each looked-up row's codes, in input order
        (byte 32 g + 2 o + i: input 2 g + i in its low nibble, 16 + 2 g + i in its high one)."""
        nib = self.tiles[:, :, :256].unflatten(2, (8, TILE_OUTPUTS, 2))
        row = nib[tile, :, :, output, :].flatten(2).int()  # [T, nb, 16]: byte 2 g + i
        return torch.cat([row & 15, row >> 4], dim=2)

    def _halves(self, start: int, tile: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """float32 [T, nb, 1]: the looked-up rows' float16 at byte `start` + 2 o."""
        halves = self.tiles[:, :, start : start + 32].unflatten(2, (TILE_OUTPUTS, 2))
        return halves[tile, :, output, :].contiguous().view(torch.float16).float()

    def _q4_rows(self, tile: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        # codes [256], d [16], m [16]: w = d * q + m
        q = self._nibbles(tile, output).float()
        return q * self._halves(256, tile, output) + self._halves(288, tile, output)

    def _kquant_rows(self, tile: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        # groups of a header (d, dm, off) and `group` tile-blocks (nib [256], hi [bits - 4][16]
        # uint32, sc [1 or 2][16], mn [16]; kquant_cpu.c's header comment):
        # w = d * (sc (q - off)) + dm * mn
        bits, at = kquant_bits(self.kind), kquant_offsets(self.kind)
        num_tiles, nb = self.tiles.shape[:2]
        group, header = at["group"], at["header"]
        groups = self.tiles.reshape(num_tiles, nb // group, -1)
        heads = groups[:, :, :header]  # [tiles, ng, header]
        blocks = groups[:, :, header:].unflatten(2, (group, at["block"]))  # [tiles, ng, g, block]

        def per_block(a: torch.Tensor) -> torch.Tensor:  # [T, ng, ...] -> [T, nb, ...]
            return a.repeat_interleave(group, dim=1)

        def block_bytes(start: int) -> torch.Tensor:  # [T, nb]: the rows' byte at start + o
            return blocks[..., start : start + TILE_OUTPUTS][tile, :, :, output].flatten(1, 2)

        def head_halves(start: int) -> torch.Tensor:  # [T, nb, 1]: the rows' float16
            halves = heads[..., start : start + 32].unflatten(2, (TILE_OUTPUTS, 2))
            return per_block(halves[tile, :, output, :].contiguous().view(torch.float16).float())

        nib = blocks[..., :256].unflatten(3, (8, TILE_OUTPUTS, 2))
        row = nib[tile, :, :, :, output, :].flatten(1, 2).flatten(2).int()  # [T, nb, 16]
        q = torch.cat([row & 15, row >> 4], dim=2)
        if bits > 4:
            # bit 2 o + i of word p is bit 4 + k of the code of input 2 p + i (p = 0..15)
            words = blocks[..., 256 : 256 + 64 * (bits - 4)].unflatten(3, (bits - 4, 16, 4))
            words = words[tile].contiguous().view(torch.int32)[..., 0].flatten(1, 2)
            lanes = (2 * output)[:, None, None, None, None] + torch.arange(2)  # [T, 1, 1, 1, 2]
            high = (words[..., None] >> lanes) & 1  # [T, nb, k, 16, 2]
            shifts = torch.arange(4, bits, dtype=torch.int32)[:, None, None]
            q = q | (high << shifts).sum(dim=2, dtype=torch.int32).flatten(2)
        sc = torch.stack([block_bytes(at["sc0"]), block_bytes(at["sc1"])], dim=2)
        sc = sc.contiguous().view(torch.int8).int()  # [T, nb, 2]
        off = per_block(heads[..., at["off"] : at["off"] + TILE_OUTPUTS][tile, :, output].int())
        per_input = q.unflatten(2, (2, 16)) - off[..., None, None]
        integers = (per_input * sc[..., None]).flatten(2).float()  # exact: |.| <= 4096
        d = head_halves(0)
        if at["dm"] < 0:  # no min: dm mn = +0, as the zeros once stored gave
            dm = mn = torch.zeros_like(d)
        else:
            dm, mn = head_halves(at["dm"]), block_bytes(at["mn"]).float()[..., None]
        return d * integers + dm * mn

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kind {self.kind} blocks"

"""The GGUF file's own quantized blocks of each linear weight, under our module names.

A GGUF Q4_0 / Q4_1 / Q8_0 tensor is a row-major matrix `[out, in]` cut into blocks of 32
inputs: a Q4_1 block is `d` (float16), `m` (float16) and 16 bytes of 4-bit codes `q` (0..15)
standing for the weights `d * q + m` (byte `j` holds input `j` in its low nibble and input
`j + 16` in its high one); a Q4_0 block has no `m` and stands for `d * (q - 8)`; a Q8_0 block
is `d` and 32 signed bytes standing for `d * q`.

This module reads those blocks (never the dequantized floats) and lays each weight out as the
native kernels read it (`native/gguf_cpu.c`; the block and tile constants are `native/abi.py`'s,
checked against the C library at load), one row of bytes per output: the row's codes,
then its `d` constants, then (4-bit kinds) its `m` constants, Q4_0 stored as Q4_1 with
`m = -8 d` (exact in float16). q/k/v and gate/up are concatenated along the output rows as the
fused modules expect, and llama.cpp's reordering of the query and key rows of Llama-family
files (its converter interleaves the two rotary halves of each head) is undone on the rows, as
transformers undoes it on the floats, so row `i` here is row `i` of the dequantized checkpoint.
The output projection (`lm_head.weight`) is the file's `output.weight`, or for tied embeddings
its `token_embd.weight`. An untied `token_embd.weight` in a type the kernels run is laid out
the same way as `model.embed_tokens.weight` (`EMBEDDING`): the input embedding looks its rows
up in those blocks (`layers/gguf_embedding.py`), as a tied one does in the output projection's.

A fused weight with a part in a K-quant or 5-bit type (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1) is read
by `gguf_kquants.py` instead, every part in its own type (legacy parts too), into the K-quant
kernel's layout (`BlockTiles`). Tensors of other types (IQ*, TQ*, Q2_K, Q3_K, floats) are not
returned: their modules stay dequantized, and `warn_without_kernel` names them.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nanollmserve.errors import UserError
from nanollmserve.model.gguf_file import GGUFFile, GGUFTensor, read_gguf_file
from nanollmserve.model.gguf_kquants import (
    KQUANT_TYPES,
    LEGACY_TYPES,
    TYPE_BITS_OFFSET,
    BlockTiles,
    fuse_rows,
    kquant_layout,
    read_kquant_rows,
)
from nanollmserve.model.model_config import ModelConfig
from nanollmserve.native.abi import BLOCK_SIZE, KIND_Q4, KIND_Q8, TILE_OUTPUTS, kquant_kind

logger = logging.getLogger(__name__)

BLOCK_KINDS = {"Q4_0": KIND_Q4, "Q4_1": KIND_Q4, "Q8_0": KIND_Q8}
"""GGUF block types kept quantized -> the kernel kind that runs them."""
ROW_BYTES_PER_BLOCK = {KIND_Q4: 20, KIND_Q8: 34}
"""Bytes of one block of 32 weights in a kernel row (`BlockRows.rows`): codes, `d`, (Q4) `m`."""
_STORED_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
"""Bytes of one block of 32 weights as the file stores it."""
_GGML_TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
"""ggml type id -> name, for the block types the kernels run (`GGMLQuantizationType`)."""

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
_KQUANT_READABLE = {ggml_type: name for name, ggml_type in {**LEGACY_TYPES, **KQUANT_TYPES}.items()}
"""ggml type id -> name, for every type the K-quant kernel's layout holds."""
_FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
"""ggml type ids of plain floats: dense weights by nature, not block types without a kernel."""


EMBEDDING = "model.embed_tokens.weight"
"""The input embedding's name in `read_gguf_blocks`' answer (an untied table's own blocks)."""


def embedding_in_blocks(gguf: GGUFFile, config: ModelConfig) -> bool:
    """Whether the input embedding is looked up in the file's blocks (`GGUFEmbedding`):
    `token_embd.weight` is in a type the kernels run (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q5_0,
    Q5_1), tied or not. Then no float32 table is kept, written to the cache or read: a tied
    table is the output projection's blocks, an untied one has its own
    (`read_gguf_blocks`' `EMBEDDING`)."""
    table = gguf.tensors.get("token_embd.weight")
    if table is None or table.ggml_type not in _KQUANT_READABLE or len(table.shape) != 2:
        return False
    return not config.tie_word_embeddings or _output_tensor(gguf, config) is table


def embedding_blocks(blocks: dict, tied: bool) -> BlockRows | BlockTiles | None:
    """The blocks `read_gguf_blocks` (or the cache) gives the input embedding, or None (a
    float32 table then): a tied table's are the output projection's."""
    return blocks.get("lm_head.weight") if tied else blocks.get(EMBEDDING)


@dataclass
class BlockRows:
    """One weight `[out, in]` as rows of quantized blocks, laid out for the native kernels."""

    kind: int
    """KIND_Q4 or KIND_Q8."""
    rows: torch.Tensor
    """uint8 [out, in / 32 * ROW_BYTES_PER_BLOCK[kind]]."""

    @property
    def out_features(self) -> int:
        return self.rows.shape[0]

    @property
    def in_features(self) -> int:
        return self.rows.shape[1] // ROW_BYTES_PER_BLOCK[self.kind] * BLOCK_SIZE

    def tiled(self) -> torch.Tensor:
        """uint8 [tiles, in / 32, TILE_BLOCK_BYTES[kind]]: the layout the native kernels
        multiply with (`native/gguf_cpu.c`, "tiled block kernel"). Outputs are taken 16 at a
        time (the last tile padded with zero weights); a tile-block holds the 16 outputs'
        codes for one block of 32 inputs, arranged so that one 32-byte load widens into the
        16 outputs' weights for an input pair, then their 16 `d` and (Q4) 16 `m`."""
        out, nb = self.rows.shape[0], self.in_features // BLOCK_SIZE
        tiles = -(-out // TILE_OUTPUTS)
        raw = np.zeros((tiles * TILE_OUTPUTS, self.rows.shape[1]), dtype=np.uint8)
        raw[:out] = self.rows.numpy()
        code_bytes = nb * (16 if self.kind == KIND_Q4 else BLOCK_SIZE)

        def per_tile(a: np.ndarray) -> np.ndarray:  # [tiles * 16, nb, X] -> [tiles, nb, 16 * X]
            a = a.reshape(tiles, TILE_OUTPUTS, nb, -1).transpose(0, 2, 1, 3)
            return a.reshape(tiles, nb, -1)

        d = per_tile(raw[:, code_bytes : code_bytes + 2 * nb].reshape(-1, nb, 2))
        if self.kind == KIND_Q8:
            codes = raw[:, :code_bytes].reshape(-1, TILE_OUTPUTS, nb, 16, 2)  # [.., o, b, p, i]
            codes = codes.reshape(tiles, TILE_OUTPUTS, nb, 16, 2).transpose(0, 2, 3, 1, 4)
            parts = [codes.reshape(tiles, nb, 512), d]
        else:
            packed = raw[:, :code_bytes].reshape(tiles, TILE_OUTPUTS, nb, 16)
            low, high = packed & 0x0F, packed >> 4  # inputs 0..15 and 16..31 of each block
            # group g, byte 2o+i: input 2g+i (low nibble) and 16+2g+i (high nibble) of output o
            lo = low.reshape(tiles, TILE_OUTPUTS, nb, 8, 2)
            hi = high.reshape(tiles, TILE_OUTPUTS, nb, 8, 2)
            codes = (lo | (hi << 4)).transpose(0, 2, 3, 1, 4).reshape(tiles, nb, 256)
            m = per_tile(raw[:, code_bytes + 2 * nb :].reshape(-1, nb, 2))
            parts = [codes, d, m]
        return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=2)))

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: the weights these blocks stand for."""
        out, nb = self.rows.shape[0], self.in_features // BLOCK_SIZE
        raw = self.rows.numpy()
        code_bytes = nb * (16 if self.kind == KIND_Q4 else BLOCK_SIZE)
        d = raw[:, code_bytes : code_bytes + 2 * nb].copy().view(np.float16).astype(np.float32)
        if self.kind == KIND_Q8:
            codes = raw[:, :code_bytes].view(np.int8).reshape(out, nb, BLOCK_SIZE)
            weights = codes.astype(np.float32) * d[..., None]
        else:
            m = raw[:, code_bytes + 2 * nb :].copy().view(np.float16).astype(np.float32)
            packed = raw[:, :code_bytes].reshape(out, nb, 16)
            codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
            weights = codes.astype(np.float32) * d[..., None] + m[..., None]
        return torch.from_numpy(weights.reshape(out, nb * BLOCK_SIZE))


def read_gguf_blocks(gguf_path: Path, config: ModelConfig) -> dict[str, BlockRows | BlockTiles]:
    """Our weight name -> its blocks laid out for a native kernel, for every linear weight
    whose fused parts all have one: `BlockRows` when they are all Q4_0 / Q4_1 or all Q8_0,
    else `BlockTiles` in the K-quant layout when each is a K-quant, 5-bit or legacy type
    (else the module stays dequantized); and an untied input embedding table in such a type
    under `EMBEDDING`, laid out as a linear weight of its type (`GGUFEmbedding` looks its
    rows up there).

    The file is memory-mapped (`gguf_file.py`) and each legacy weight written once, straight
    from the map into its fused output rows: no per-tensor Python objects beyond the table, no
    concatenation afterwards."""
    gguf = read_gguf_file(gguf_path)
    permuted = gguf.architecture in _ROTARY_PERMUTED_ARCHITECTURES
    parts: dict[str, dict[int | None, GGUFTensor]] = {}
    for tensor in gguf.tensors.values():
        pieces = tensor.name.split(".", 3)  # blk, layer, key, weight
        if tensor.ggml_type not in _KQUANT_READABLE or len(pieces) != 4 or pieces[0] != "blk":
            continue
        _, layer, key, suffix = pieces
        if suffix == "weight" and key in _LAYER_TENSORS:
            module, shard = _LAYER_TENSORS[key]
            parts.setdefault(f"model.layers.{layer}.{module}.weight", {})[shard] = tensor
    weights = {}
    for name, shards in parts.items():
        expected = 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1
        if len(shards) != expected:
            continue
        ordered = [shards[i] for i in sorted(shards, key=lambda s: -1 if s is None else s)]
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
        row_heads = [heads.get(t.name.split(".")[2]) if permuted else None for t in ordered]
        weights[name] = _fused_blocks(gguf, ordered, row_heads)
    output = _output_tensor(gguf, config)
    if output is not None:
        weights["lm_head.weight"] = _fused_blocks(gguf, [output], [None])
    if embedding_in_blocks(gguf, config) and not config.tie_word_embeddings:
        weights[EMBEDDING] = _fused_blocks(gguf, [gguf.tensors["token_embd.weight"]], [None])
    return weights


def warn_without_kernel(gguf_path: Path) -> None:
    """A warning naming the block types of the file's layer weights that no native kernel runs
    (IQ*, TQ*, Q2_K, Q3_K, ...): their layers (and the rest of a fused module) run dequantized
    float32 weights. Nothing for a file whose layer weights are all in types the kernels run
    (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1) or plain floats. Reads only the file's
    tensor table."""
    counts: Counter[int] = Counter()
    for tensor in read_gguf_file(gguf_path).tensors.values():
        pieces = tensor.name.split(".", 3)  # blk, layer, key, weight
        if len(pieces) != 4 or pieces[0] != "blk" or pieces[3] != "weight":
            continue
        native_or_float = tensor.ggml_type in _KQUANT_READABLE or tensor.ggml_type in _FLOAT_TYPES
        if pieces[2] in _LAYER_TENSORS and not native_or_float:
            counts[tensor.ggml_type] += 1
    if not counts:
        return
    from gguf import GGMLQuantizationType

    def name(ggml_type: int) -> str:
        try:
            return GGMLQuantizationType(ggml_type).name
        except ValueError:
            return f"ggml type {ggml_type}"

    listed = ", ".join(f"{n} {name(t)}" for t, n in counts.most_common())
    logger.warning(
        "%s: %d layer weights are in block types the native kernels do not run (%s): their "
        "layers run dequantized float32 weights (native: %s)",
        *(gguf_path.name, sum(counts.values()), listed, ", ".join(_KQUANT_READABLE.values())),
    )


def output_block_kind(gguf: GGUFFile, config: ModelConfig) -> int | None:
    """The block kind `read_gguf_blocks` gives the output projection, or None when it has no
    blocks."""
    output = _output_tensor(gguf, config)
    if output is None:
        return None
    legacy = _block_type(output)
    if legacy is not None:
        return BLOCK_KINDS[legacy]
    type_name = _KQUANT_READABLE[output.ggml_type]
    return kquant_kind(TYPE_BITS_OFFSET[type_name][0], kquant_layout([type_name]))


def _output_tensor(gguf: GGUFFile, config: ModelConfig) -> GGUFTensor | None:
    """The tensor the output projection runs as blocks, or None: the file's `output.weight`,
    or without one, for tied embeddings, the embedding table."""
    name = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
    output = gguf.tensors.get(name)
    tied_or_own = name == "output.weight" or config.tie_word_embeddings
    if output is None or not tied_or_own or output.ggml_type not in _KQUANT_READABLE:
        return None
    return output


def _block_type(tensor: GGUFTensor) -> str | None:
    """The tensor's GGUF block type name when it is one the kernels run, else None."""
    name = _GGML_TYPE_NAMES.get(tensor.ggml_type)
    return name if name in BLOCK_KINDS else None


def _fused_blocks(
    gguf: GGUFFile, tensors: list[GGUFTensor], row_heads: list[int | None]
) -> BlockRows | BlockTiles:
    """The tensors as one weight: `BlockRows` when they are all of one legacy kind, else each
    read in its own type into the K-quant kernel's layout."""
    kinds = {BLOCK_KINDS.get(_KQUANT_READABLE[t.ggml_type]) for t in tensors}
    if len(kinds) == 1 and None not in kinds:
        return _fused_block_rows(gguf, tensors, row_heads, kinds.pop())
    in_features = tensors[0].shape[-1]
    if any(t.shape[-1] != in_features or len(t.shape) != 2 for t in tensors):
        raise UserError(f"GGUF tensors {[t.name for t in tensors]} do not fuse into one weight")
    rows = []
    for tensor, heads in zip(tensors, row_heads, strict=True):
        raw = gguf.raw(tensor.name)
        if heads is not None:
            raw = raw[_unpermuted_order(raw.shape[0], heads)]
        rows.append(read_kquant_rows(_KQUANT_READABLE[tensor.ggml_type], raw, in_features))
    return fuse_rows(rows).to_tiles()


def _fused_block_rows(
    gguf: GGUFFile, tensors: list[GGUFTensor], row_heads: list[int | None], kind: int
) -> BlockRows:
    """The tensors' block rows stacked along the outputs, each laid out from the map straight
    into its slice of one array (`row_heads[i]`: undo llama.cpp's q/k interleave over that
    many heads, None: keep the order)."""
    in_features = tensors[0].shape[-1]
    if any(t.shape[-1] != in_features or len(t.shape) != 2 for t in tensors):
        raise UserError(f"GGUF tensors {[t.name for t in tensors]} do not fuse into one weight")
    row_bytes = in_features // BLOCK_SIZE * ROW_BYTES_PER_BLOCK[kind]
    out = np.empty((sum(t.shape[0] for t in tensors), row_bytes), dtype=np.uint8)
    first = 0
    for tensor, heads in zip(tensors, row_heads, strict=True):
        raw = gguf.raw(tensor.name)
        if heads is not None:
            raw = raw[_unpermuted_order(raw.shape[0], heads)]
        _lay_out(raw, _block_type(tensor), out[first : first + raw.shape[0]])
        first += raw.shape[0]
    return BlockRows(kind, torch.from_numpy(out))


def _block_rows(raw: np.ndarray, block_type: str) -> BlockRows:
    """`raw`: uint8 [out, blocks * bytes per block] as stored in the file -> kernel rows."""
    kind = BLOCK_KINDS[block_type]
    blocks = raw.shape[1] // _STORED_BLOCK_BYTES[block_type]
    out = np.empty((raw.shape[0], blocks * ROW_BYTES_PER_BLOCK[kind]), dtype=np.uint8)
    _lay_out(raw, block_type, out)
    return BlockRows(kind, torch.from_numpy(out))


def _lay_out(raw: np.ndarray, block_type: str, out: np.ndarray) -> None:
    """Write `raw` (uint8 [rows, blocks * bytes per block] as stored in the file) into `out`
    (uint8 [rows, kernel row bytes]): each row's codes, then its `d`, then (4-bit) its `m`."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, _STORED_BLOCK_BYTES[block_type])
    nb = blocks.shape[1]
    code_bytes = blocks.shape[2] - (4 if block_type == "Q4_1" else 2)
    codes = out[:, : nb * code_bytes].reshape(rows, nb, code_bytes)
    d = out[:, nb * code_bytes : nb * (code_bytes + 2)].reshape(rows, nb, 2)
    if block_type == "Q8_0":
        codes[...], d[...] = blocks[..., 2:], blocks[..., 0:2]
        return
    m = out[:, nb * (code_bytes + 2) :].reshape(rows, nb, 2)
    if block_type == "Q4_1":
        codes[...], d[...], m[...] = blocks[..., 4:], blocks[..., 0:2], blocks[..., 2:4]
        return
    # Q4_0: d * (q - 8) = d * q + m with m = -8 d (a power-of-two multiple: exact)
    codes[...], d[...] = blocks[..., 2:], blocks[..., 0:2]
    scale = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)
    m[...] = (scale.astype(np.float32) * -8.0).astype(np.float16).view(np.uint8)


def _unpermuted_order(rows: int, num_heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's per-head interleave of the rotary halves (rows
    only: blocks run along the inputs, so a row permutation keeps every block whole)."""
    half = rows // num_heads // 2
    return np.arange(rows).reshape(num_heads, half, 2).transpose(0, 2, 1).reshape(rows)

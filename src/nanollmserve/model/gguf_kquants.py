"""The GGUF file's K-quant and 5-bit blocks (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1), taken apart into
integers and laid out for the native kernel that runs them (`native/kquant_cpu.c`). The legacy
Q4_0, Q4_1 and Q8_0 blocks are read the same way where they share a fused weight with these
(a Q4_K_M file of a narrow model has Q8_0 attn_v beside Q5_0 attn_q and attn_k); alone they
run on gguf_cpu.c's own kernels (`gguf_blocks.py`).

Each of these types stands for its weights, per block of 32 inputs of one output row, as

    w = d * sc_h * (q - off) + dm * mn

(q: the 4-, 5- or 6-bit code; sc_h: the integer scale of the block's first or second 16
inputs; d, dm: float16; mn: a small unsigned integer): `KQuantRows` holds exactly those
numbers, read bit by bit from the file's bytes in ggml's layouts (`dequantize_row_q4_K` and
its neighbours in ggml-quants.c), so nothing is rounded or re-quantized. The `gguf` package's
`gguf.quants.dequantize` is the oracle these are tested against (tests/test_kquant_kernels.py).

`KQuantRows.tiled()` lays the numbers out as the kernel reads them: 16 outputs per tile and
per block of 32 inputs their low nibbles (gguf_cpu.c's Q4 arrangement), the higher code bits
as one 32-bit mask per widened input pair, the sub-scales and `mn`; `d`, `dm` and `off` in a
header per tile-block, or per 8 of them where every part is a K-quant (`d` and `dm` per 256
inputs). What a weight's types make constant is not stored: one sub-scale row where no part
is Q6_K, no `dm` and `mn` where no part has a min (`kquant_layout`, the layout flags of its
kind). The byte map is in kquant_cpu.c's header comment. `fuse_rows` stacks weights of
different types along the outputs (q/k/v, gate/up of a Q4_K_M file: Q4_K beside Q6_K) into
one: the offset is per output and the codes take the widest part's bits. A tile-block with its
share of the header is 300 bytes for Q4_K (4.69 bits a weight, the file 4.5), 364 for Q5_K
(5.69; 5.5), 424 for Q6_K (6.63; 6.56), 384 for Q5_0 (6.0; 5.5); a fused weight with a Q8_0
part takes 8-bit codes. `BlockTiles` holds a weight in that layout (or in a legacy kind's
tiled layout, `gguf_blocks.BlockRows.tiled()`) as the linear layers and the GGUF cache keep
it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanollmserve.native.abi import (
    KQ_MIN,
    KQ_SUPER,
    KQ_TWO_SC,
    TILE_BLOCK_BYTES,
    kquant_kind,
    kquant_offsets,
)

BLOCK = 32
"""Inputs per block of the kernel (sub-blocks of the 256-wide K-quant super-blocks)."""
TILE = 16
"""Outputs per tile (`TILE` of native.h)."""
KQUANT_TYPES = {"Q5_0": 6, "Q5_1": 7, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
"""The GGUF block types only this module's kernel runs -> their ggml type ids
(`GGMLQuantizationType`)."""
LEGACY_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
"""The legacy types it also reads, for weights fused with the types above."""
TYPE_BITS_OFFSET = {
    "Q4_0": (4, 8),
    "Q4_1": (4, 0),
    "Q8_0": (8, 128),
    "Q5_0": (5, 16),
    "Q5_1": (5, 0),
    "Q4_K": (4, 0),
    "Q5_K": (5, 0),
    "Q6_K": (6, 32),
}
"""Type -> (code bits, code offset `off`)."""
STORED = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
"""Type -> (weights per file block, bytes per file block)."""
SUPER_BLOCK_TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K"})
"""Types whose `d` and `dm` are per 256 inputs (8 blocks of 32)."""
TWO_SCALE_TYPES = frozenset({"Q6_K"})
"""Types with a sub-scale per 16 inputs (the others: one per 32, or none)."""
MIN_TYPES = frozenset({"Q4_K", "Q5_K", "Q5_1", "Q4_1"})
"""Types with a min (`dm mn` not zero)."""


def kquant_layout(type_names: list[str] | tuple[str, ...]) -> int:
    """The layout flags (`native.abi.KQ_SUPER` | `KQ_TWO_SC` | `KQ_MIN`) of a weight whose
    rows are of these types: a header per super-block where every part is a K-quant, two
    sub-scale rows where a part is Q6_K, `dm` and `mn` where a part has a min."""
    names = set(type_names)
    return (
        (KQ_SUPER if names <= SUPER_BLOCK_TYPES else 0)
        | (KQ_TWO_SC if names & TWO_SCALE_TYPES else 0)
        | (KQ_MIN if names & MIN_TYPES else 0)
    )


def tile_block_bytes(kind: int) -> int:
    """Bytes of one tile-block (16 outputs x 32 inputs) of a K-quant kind with its share of
    its header (`nls_kq_tile_block_bytes`)."""
    return TILE_BLOCK_BYTES[kind]


@dataclass
class KQuantRows:
    """One weight [out, in] of K-quant or 5-bit types, as integers and halves."""

    type_name: str
    """The file's block type, or the fused types joined by "+"."""
    bits: int
    """Bits of the widest code."""
    off: np.ndarray
    """uint8 [out]: each output's code offset."""
    codes: np.ndarray
    """uint8 [out, in]: q, all its bits."""
    sc: np.ndarray
    """int8 [out, in / 16]: the scale of each 16 inputs."""
    d: np.ndarray
    """float16 [out, in / 32]."""
    dm: np.ndarray
    """float16 [out, in / 32]."""
    mn: np.ndarray
    """uint8 [out, in / 32]."""

    @property
    def layout(self) -> int:
        """The layout flags its types give (`kquant_layout`)."""
        return kquant_layout(self.type_name.split("+"))

    @property
    def kind(self) -> int:
        """The native kind of these code bits and this layout (`native.abi.kquant_kind`)."""
        return kquant_kind(self.bits, self.layout)

    def to_tiles(self) -> BlockTiles:
        """The kernel's layout, as the linear layers keep it."""
        out, n = self.codes.shape
        return BlockTiles(self.kind, out, n, torch.from_numpy(self.tiled()))

    def dequantize(self) -> np.ndarray:
        """float32 [out, in]: the weights these numbers stand for."""
        out, n = self.codes.shape
        q = self.codes.astype(np.float32) - self.off.astype(np.float32)[:, None]
        q = q.reshape(out, n // 16, 16)
        w = q * self.sc.astype(np.float32)[..., None]
        w = w.reshape(out, n // BLOCK, BLOCK) * self.d.astype(np.float32)[..., None]
        w += (self.dm.astype(np.float32) * self.mn.astype(np.float32))[..., None]
        return w.reshape(out, n)

    def tiled(self) -> np.ndarray:
        """uint8 [tiles, in / 32, tile_block_bytes(kind)], the last tile padded with zero
        weights: each tile's groups of a header and `group` tile-blocks, in input order.
        ValueError where the numbers are not what the layout leaves out (a `d` or `dm` not
        constant over a super-block, two sub-scales of a 32-block that differ without
        KQ_TWO_SC, a `dm` not +0 without KQ_MIN): nothing is dropped that is not a copy."""
        out, n = self.codes.shape
        nb, tiles = n // BLOCK, -(-out // TILE)
        rows = tiles * TILE
        at = kquant_offsets(self.kind)
        group, two, has_min = at["group"], at["sc1"] != at["sc0"], at["mn"] >= 0
        if nb % group:
            raise ValueError(f"{self.type_name}: {n} inputs are not whole super-blocks")
        sc, d, dm = self.sc, self.d.view(np.uint16), self.dm.view(np.uint16)
        d_sb, dm_sb = d.reshape(out, -1, group), dm.reshape(out, -1, group)
        if (d_sb != d_sb[..., :1]).any() or (dm_sb != dm_sb[..., :1]).any():
            raise ValueError(f"{self.type_name}: d or dm varies within a super-block")
        if not two and (sc[:, 0::2] != sc[:, 1::2]).any():
            raise ValueError(f"{self.type_name}: two sub-scales in a block of 32")
        if not has_min and dm.any():
            raise ValueError(f"{self.type_name}: a min in a layout without one")

        def padded(a: np.ndarray) -> np.ndarray:
            full = np.zeros((rows, *a.shape[1:]), dtype=a.dtype)
            full[:out] = a
            return full

        def per_tile(a: np.ndarray) -> np.ndarray:  # [rows, k] -> [t, k, 16 * itemsize]
            a = padded(a).reshape(tiles, TILE, a.shape[1]).transpose(0, 2, 1)
            return np.ascontiguousarray(a).view(np.uint8).reshape(tiles, a.shape[1], -1)

        codes = padded(self.codes).reshape(tiles, TILE, nb, BLOCK)
        low, high = codes[..., :16] & 15, codes[..., 16:] & 15  # [t, o, b, 16]
        nib = (low | (high << 4)).reshape(tiles, TILE, nb, 8, 2).transpose(0, 2, 3, 1, 4)
        parts = [nib.reshape(tiles, nb, 256)]
        for k in range(self.bits - 4):
            bit = ((codes >> (4 + k)) & 1).reshape(tiles, TILE, nb, 16, 2)  # input 2p + i
            lanes = bit.transpose(0, 2, 3, 1, 4).reshape(tiles, nb, 16, 32)
            # lane j -> bit j of a little-endian 32-bit word
            words = np.packbits(lanes, axis=-1, bitorder="little")
            parts.append(words.reshape(tiles, nb, 64))
        for h in (0, 1) if two else (0,):
            parts.append(per_tile(sc[:, h::2]))
        if has_min:
            parts.append(per_tile(self.mn))
        blocks = np.concatenate(parts, axis=2)
        assert blocks.shape[2] == at["block"]
        first = slice(None, None, group)  # each header's block: d, dm of its first
        header = [per_tile(self.d[:, first])]
        if has_min:
            header.append(per_tile(self.dm[:, first]))
        header.append(per_tile(np.repeat(self.off[:, None], nb // group, axis=1)))
        used = sum(h.shape[2] for h in header)  # then zeros to the header's bytes
        header.append(np.zeros((tiles, nb // group, at["header"] - used), dtype=np.uint8))
        headers = np.concatenate(header, axis=2)  # [t, nb / group, header bytes]
        groups = np.concatenate(
            [headers, blocks.reshape(tiles, nb // group, group * at["block"])], axis=2
        )
        return np.ascontiguousarray(groups).reshape(tiles, nb, tile_block_bytes(self.kind))


@dataclass(frozen=True)
class BlockTiles:
    """One weight already in a native kernel's tiled layout, any kind (a K-quant kind:
    `KQuantRows.tiled()`; a legacy one: `gguf_blocks.BlockRows.tiled()`), as `GGUFLinear`
    and the GGUF cache hold it: a cached weight's `tiles` maps the cache file, so a load
    copies nothing and the weights are in memory once (the file's pages)."""

    kind: int
    out_features: int
    in_features: int
    tiles: torch.Tensor
    """uint8 [ceil(out / 16), in / 32, the kind's tile-block bytes]."""

    def tiled(self) -> torch.Tensor:
        return self.tiles


def read_kquant_rows(type_name: str, raw: np.ndarray, in_features: int) -> KQuantRows:
    """The file's bytes of a weight (uint8 [out, in / per-block * bytes-per-block]) taken
    apart; ValueError for a type this module does not read or a shape that does not fit."""
    if type_name not in _READERS:
        raise ValueError(f"{type_name} is not one of {', '.join(_READERS)}")
    per_block, block_bytes = STORED[type_name]
    if in_features % per_block or raw.shape[-1] != in_features // per_block * block_bytes:
        raise ValueError(
            f"{type_name} rows of {raw.shape[-1]} bytes do not hold {in_features} inputs"
        )
    out = raw.shape[0]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(out, -1, block_bytes)
    return _READERS[type_name](blocks, out, in_features)


def fuse_rows(parts: list[KQuantRows]) -> KQuantRows:
    """The weights stacked along the outputs, in order (one kernel call for a fused module)."""
    if len({p.codes.shape[1] for p in parts}) != 1:
        raise ValueError("fused K-quant weights must have the same inputs")
    return KQuantRows(
        "+".join(p.type_name for p in parts),
        max(p.bits for p in parts),
        np.concatenate([p.off for p in parts]),
        *(np.concatenate([getattr(p, f) for p in parts]) for f in ("codes", "sc", "d", "dm", "mn")),
    )


def _rows(name: str, codes, sc, d, dm, mn) -> KQuantRows:
    bits, off = TYPE_BITS_OFFSET[name]
    return KQuantRows(
        name, bits, np.full(codes.shape[0], off, dtype=np.uint8), codes, sc, d, dm, mn
    )


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """float16 [out, blocks] at byte `start` of each block."""
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]


def _bits_of(words: np.ndarray, count: int) -> np.ndarray:
    """uint8 [..., count]: bit j of each little-endian word."""
    return ((words[..., None] >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _q5_legacy(blocks: np.ndarray, out: int, n: int, with_m: bool) -> KQuantRows:
    start = 4 if with_m else 2
    qh = np.ascontiguousarray(blocks[..., start : start + 4]).view("<u4")[..., 0]
    qs = blocks[..., start + 4 : start + 20]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1) | (_bits_of(qh, 32) << 4)
    nb = n // BLOCK
    d = _half(blocks, 0)
    dm = _half(blocks, 2) if with_m else np.zeros((out, nb), dtype=np.float16)
    mn = np.full((out, nb), 1 if with_m else 0, dtype=np.uint8)
    sc = np.ones((out, n // 16), dtype=np.int8)
    name = "Q5_1" if with_m else "Q5_0"
    return _rows(name, codes.reshape(out, n), sc, d, dm, mn)


def _legacy(blocks: np.ndarray, out: int, n: int, name: str) -> KQuantRows:
    """Q4_0 (d (q - 8)), Q4_1 (d q + m), Q8_0 (d q, q signed: stored as q + 128, off 128)."""
    nb = n // BLOCK
    d = _half(blocks, 0)
    if name == "Q8_0":
        codes = blocks[..., 2:34] ^ np.uint8(0x80)
    else:
        qs = blocks[..., 4:20] if name == "Q4_1" else blocks[..., 2:18]
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1)
    with_m = name == "Q4_1"
    dm = _half(blocks, 2) if with_m else np.zeros((out, nb), dtype=np.float16)
    mn = np.full((out, nb), 1 if with_m else 0, dtype=np.uint8)
    sc = np.ones((out, n // 16), dtype=np.int8)
    return _rows(name, codes.reshape(out, n), sc, d, dm, mn)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 6-bit scales and mins of each super-block's 12 scale bytes
    (ggml's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    sc = np.concatenate(
        [s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1
    )
    mn = np.concatenate(
        [s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1
    )
    return sc, mn


def _k_sub_blocks(blocks: np.ndarray, out: int, n: int, codes: np.ndarray, name: str) -> KQuantRows:
    """Q4_K / Q5_K: per 32-block scale d * sc and min -dmin * mn."""
    sc, mn = _k_scales(blocks[..., 4:16])  # [out, sb, 8]
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    nb = n // BLOCK
    return _rows(
        name,
        codes.reshape(out, n),
        np.repeat(sc.reshape(out, nb), 2, axis=-1).astype(np.int8),
        np.repeat(d, 8, axis=-1),
        np.repeat(-dmin, 8, axis=-1),
        mn.reshape(out, nb),
    )


def _q4_k(blocks: np.ndarray, out: int, n: int) -> KQuantRows:
    qs = blocks[..., 16:144].reshape(out, -1, 4, 32)  # 4 chunks of 64 weights
    codes = np.stack([qs & 15, qs >> 4], axis=3)  # [out, sb, chunk, low/high, 32]
    return _k_sub_blocks(blocks, out, n, codes, "Q4_K")


def _q5_k(blocks: np.ndarray, out: int, n: int) -> KQuantRows:
    qh = blocks[..., 16:48]  # [out, sb, 32]: bit 2i / 2i + 1 is the 5th bit of chunk i's low / high
    qs = blocks[..., 48:176].reshape(out, -1, 4, 32)
    shifts = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
    fifth = ((qh[:, :, None, None, :] >> shifts) & 1) << 4  # [out, sb, 4, 2, 32]
    codes = np.stack([qs & 15, qs >> 4], axis=3) | fifth
    return _k_sub_blocks(blocks, out, n, codes, "Q5_K")


def _q6_k(blocks: np.ndarray, out: int, n: int) -> KQuantRows:
    ql = blocks[..., 0:128].reshape(out, -1, 2, 2, 32)  # [out, sb, half, l / l + 32, 32]
    qh = blocks[..., 128:192].reshape(out, -1, 2, 1, 32)
    low = np.stack(
        [ql[..., 0, :] & 15, ql[..., 1, :] & 15, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], axis=3
    )
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    high = (qh >> shifts) & 3  # [out, sb, half, 4, 32]
    codes = low | (high << 4)
    scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8)  # [out, sb, 16]
    nb = n // BLOCK
    return _rows(
        "Q6_K",
        codes.reshape(out, n),
        scales.reshape(out, n // 16),
        np.repeat(_half(blocks, 208), 8, axis=-1),
        np.zeros((out, nb), dtype=np.float16),
        np.zeros((out, nb), dtype=np.uint8),
    )


_READERS = {
    "Q4_0": lambda b, out, n: _legacy(b, out, n, "Q4_0"),
    "Q4_1": lambda b, out, n: _legacy(b, out, n, "Q4_1"),
    "Q8_0": lambda b, out, n: _legacy(b, out, n, "Q8_0"),
    "Q5_0": lambda b, out, n: _q5_legacy(b, out, n, with_m=False),
    "Q5_1": lambda b, out, n: _q5_legacy(b, out, n, with_m=True),
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}

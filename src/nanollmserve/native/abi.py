"""What the Python side and the C library agree on (`native/native.h`): the block layout
constants, the kernel limits, the status and KV dtype codes, the ctypes mirrors of the
`nls_layer` / `nls_model` structures, and the check of all of them against the library.

The C side asserts its structure layouts at compile time (`_Static_assert` in native.h, as
ggml does for its block sizes); at load, `ops.bind` asks the library for its numbers
(`nls_abi_info`) and refuses one that differs from `expected_abi()`, naming the differences.
No torch and no other project module here: this is the bottom of the house.
"""

from __future__ import annotations

import ctypes

BLOCK_SIZE = 32
"""Weights per GGUF block (`QK`)."""
KIND_Q4 = 4
"""4-bit codes with per-block `d` and `m` (from Q4_0 or Q4_1)."""
KIND_Q8 = 8
"""8-bit codes with a per-block `d` (from Q8_0)."""
KIND_KQ4 = 44
"""The first kind of kquant_cpu.c's layout: KIND_KQ4 + (bits - 4) + 8 * layout for 4- to 8-bit
codes (the K-quants, Q5_0/Q5_1, and legacy blocks fused with them: `model/gguf_kquants.py`),
the layout an or of KQ_SUPER, KQ_TWO_SC and KQ_MIN."""
KIND_KQ8 = 48
KQ_SUPER = 1
"""Layout flag: `d` and `dm` once per 8 tile-blocks (a 256-input super-block), else per
tile-block."""
KQ_TWO_SC = 2
"""Layout flag: a sub-scale per 16 inputs (Q6_K), else one per 32."""
KQ_MIN = 4
"""Layout flag: `dm` and `mn` stored (a type with a min), else neither (zeros)."""
KQ_LAYOUTS = 8
KQUANT_KINDS = frozenset(
    KIND_KQ4 + 8 * layout + bits - 4 for layout in range(KQ_LAYOUTS) for bits in range(4, 9)
)
TILE_OUTPUTS = 16
"""Outputs per tile of the kernels' weight layout (`TILE`; `BlockRows.tiled`)."""


def kquant_kind(bits: int, layout: int) -> int:
    """The kind of kquant_cpu.c's layout with `bits`-bit codes (4 to 8) and `layout` flags."""
    if not 4 <= bits <= 8:
        raise ValueError(f"K-quant codes are 4 to 8 bits, not {bits}")
    if not 0 <= layout < KQ_LAYOUTS:
        raise ValueError(f"K-quant layout flags are 0 to {KQ_LAYOUTS - 1}, not {layout}")
    return KIND_KQ4 + 8 * layout + bits - 4


def kquant_bits(kind: int) -> int | None:
    """The code width of a K-quant kind, or None for another kind."""
    return (kind - KIND_KQ4) % 8 + 4 if kind in KQUANT_KINDS else None


def kquant_layout(kind: int) -> int:
    """The layout flags of a K-quant kind."""
    return (kind - KIND_KQ4) // 8


def int8_group(kind: int) -> int | None:
    """Inputs per int8 activation scale where a kind's kernel multiplies int8 activations:
    256 for the super-block K-quant kinds (kquant_int8_cpu.c's `kq8_runs`, decision 46), 32
    for the per-block K-quant kinds (Q5_0, Q5_1 and their fusions, decision 47) and for Q8_0
    (`KIND_Q8`, decision 48); None for Q4_0/Q4_1 (`KIND_Q4`) and a K-quant kind with 7- or
    8-bit codes (a fused Q8_0 part), which keep int16 activations."""
    if kind == KIND_Q8:
        return 32
    bits = kquant_bits(kind)
    if bits is None or bits > 6:
        return None
    return 256 if kquant_layout(kind) & KQ_SUPER else 32


def kquant_offsets(kind: int) -> dict[str, int]:
    """Where a K-quant kind keeps its numbers (`kq_layout_of` of kquant_layout.h): `group`
    tile-blocks per header; `block` and `header` bytes; in a tile-block the sub-scale rows
    `sc0`, `sc1` and `mn` (-1: none); in a header `d` (0), `dm` (-1: none) and `off`."""
    bits, layout = kquant_bits(kind), kquant_layout(kind)
    two, has_min = bool(layout & KQ_TWO_SC), bool(layout & KQ_MIN)
    sc0 = 256 + 64 * (bits - 4)
    sc1 = sc0 + 16 * two
    return {
        "group": 8 if layout & KQ_SUPER else 1,
        "block": sc1 + 16 + 16 * has_min,
        "header": (80 + 32 * has_min) // 32 * 32 if layout & KQ_SUPER else 48 + 32 * has_min,
        "sc0": sc0,
        "sc1": sc1,
        "mn": sc1 + 16 if has_min else -1,
        "d": 0,
        "dm": 32 if has_min else -1,
        "off": 32 + 32 * has_min,
    }


def _kquant_tile_block_bytes(kind: int) -> int:
    offsets = kquant_offsets(kind)
    return offsets["block"] + offsets["header"] // offsets["group"]


TILE_BLOCK_BYTES = {
    KIND_Q4: 320,
    KIND_Q8: 544,
    **{kind: _kquant_tile_block_bytes(kind) for kind in sorted(KQUANT_KINDS)},
}
"""Bytes of one tile-block (16 outputs x 32 inputs) of each kind, a K-quant kind's with its
share of its header (`nls_kq_tile_block_bytes`)."""


MAX_HEAD_DIM = 256
"""The largest head size the attention kernels hold in their accumulators."""
DECODE_PHASES = ("other", "qkv", "rope_kv_write", "attention", "o", "gate_up", "down", "lm_head")
"""The parts of a native step `ops.decode_profile` times, in the C enum's order: "other" is
the norms, activation quantization, residual adds and SiLU between the products."""

NLS_NO_MEMORY = -1
NLS_BAD_POSITION = -2
NLS_BAD_TOKEN = -3
NLS_BAD_BLOCK = -4
NLS_BAD_SHAPE = -5
STATUS_NAMES = (
    "NLS_NO_MEMORY", "NLS_BAD_POSITION", "NLS_BAD_TOKEN", "NLS_BAD_BLOCK", "NLS_BAD_SHAPE",
)  # fmt: skip
NLS_KV_F32 = 0
NLS_KV_INT8 = 1
NLS_KV_F16 = 2
"""The KV cache element types the attention reads (`nls_model.kv_dtype`)."""
NLS_ACT_SILU = 0
NLS_ACT_GELU_TANH = 1
ACTIVATION_CODES = {"silu": NLS_ACT_SILU, "gelu_tanh": NLS_ACT_GELU_TANH}
"""`DecoderOptions.activation` -> the step's gated activation (`nls_model.activation`)."""


class NlsLayer(ctypes.Structure):
    """`nls_layer` of native.h: one decoder layer's weights and K/V cache."""

    _fields_ = [
        ("qkv_kind", ctypes.c_int32),
        ("o_kind", ctypes.c_int32),
        ("gate_up_kind", ctypes.c_int32),
        ("down_kind", ctypes.c_int32),
        *((name, ctypes.c_void_p) for name in ("qkv", "o", "gate_up", "down")),
        *((name, ctypes.c_void_p) for name in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias")),
        *((name, ctypes.c_void_p) for name in ("input_norm", "post_norm")),
        *((name, ctypes.c_void_p) for name in ("q_norm", "k_norm", "k_cache", "v_cache")),
        *((name, ctypes.c_void_p) for name in ("k_scale", "v_scale")),
        *((name, ctypes.c_void_p) for name in ("attn_out_norm", "mlp_out_norm", "rope")),
        ("window", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


class NlsModel(ctypes.Structure):
    """`nls_model` of native.h: the sizes of a decoder and pointers to its tensors."""

    _fields_ = [
        *(
            (name, ctypes.c_int32)
            for name in (
                "hidden",
                "intermediate",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "num_layers",
                "vocab",
                "block_size",
                "lm_head_kind",
                "max_context",
                "num_blocks",
                "kv_dtype",
                "embed_kind",
                "activation",
            )
        ),  # fmt: skip
        *((name, ctypes.c_float) for name in ("eps", "attn_scale", "embed_scale", "logit_softcap")),
        *((name, ctypes.c_void_p) for name in ("embed", "final_norm", "rope", "lm_head", "layers")),
    ]


def head_limits(head_dim: int, num_heads: int, num_kv_heads: int) -> str | None:
    """Why the attention kernels cannot run these heads, or None (the C checks the same)."""
    if head_dim % 8 or not 0 < head_dim <= MAX_HEAD_DIM:
        return f"head_dim {head_dim} is not a multiple of 8 up to {MAX_HEAD_DIM}"
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"{num_heads} query heads do not group over {num_kv_heads} KV heads"
    return None


def library_abi(library: ctypes.CDLL) -> dict[str, int]:
    """The constants, statuses and struct layouts the library was built with
    (`nls_abi_info`, its signature set by `ops.bind`): name -> value."""
    count = library.nls_abi_info(None, None, 0)
    names, values = (ctypes.c_char_p * count)(), (ctypes.c_int64 * count)()
    library.nls_abi_info(names, values, count)
    return {name.decode(): value for name, value in zip(names, values, strict=True)}


def expected_abi() -> dict[str, int]:
    """What this side assumes of the library, in `nls_abi_info`'s names (read from this
    module's globals at each call)."""
    expected = {
        "QK": BLOCK_SIZE,
        "TILE": TILE_OUTPUTS,
        "KIND_Q4": KIND_Q4,
        "KIND_Q8": KIND_Q8,
        "KIND_KQ4": KIND_KQ4,
        "KIND_KQ8": KIND_KQ8,
        "KQ_SUPER": KQ_SUPER,
        "KQ_TWO_SC": KQ_TWO_SC,
        "KQ_MIN": KQ_MIN,
        "TILE_BLOCK_BYTES_Q4": TILE_BLOCK_BYTES[KIND_Q4],
        "TILE_BLOCK_BYTES_Q8": TILE_BLOCK_BYTES[KIND_Q8],
        "MAX_HEAD_DIM": MAX_HEAD_DIM,
        "NLS_PHASES": len(DECODE_PHASES),
        "NLS_KV_F32": NLS_KV_F32,
        "NLS_KV_INT8": NLS_KV_INT8,
        "NLS_KV_F16": NLS_KV_F16,
        "NLS_ACT_SILU": NLS_ACT_SILU,
        "NLS_ACT_GELU_TANH": NLS_ACT_GELU_TANH,
        **{name: globals()[name] for name in STATUS_NAMES},
    }
    for c_name, structure in (("nls_layer", NlsLayer), ("nls_model", NlsModel)):
        expected[f"sizeof({c_name})"] = ctypes.sizeof(structure)
        for field, *_ in structure._fields_:
            expected[f"{c_name}.{field}"] = getattr(structure, field).offset
    return expected


def abi_differences(library_values: dict[str, int], expected: dict[str, int]) -> list[str]:
    """One line per difference. A struct field the library does not list is not one (its
    size still has to match); a constant or field it lists that this side lacks is."""
    differences = [
        f"{name}: library {value}, Python {expected.get(name, 'missing')}"
        for name, value in library_values.items()
        if expected.get(name) != value
    ]
    differences += [
        f"{name}: library missing, Python {value}"
        for name, value in expected.items()
        if name not in library_values and "." not in name
    ]
    return differences

"""The serialized form of one KV block: what the offload store keeps on disk, and what
prefill/decode disaggregation will ship between workers.

A block is `block_size` token positions of K and V for every layer. Its bytes are

    prefix   "<8sIIQ32s": magic b"NLSKVBLK", format version, header length, payload length,
             HMAC-SHA256 (with the store's key) of the prefix's first 24 bytes, the header
             and the payload
    header   UTF-8 JSON (`KVBlockHeader`): the model id, the KV layout (layer count, KV heads,
             head dim, dtype, block size), the token ids the block covers, its hash and its
             parent's hash in the prefix chain
    payload  the K/V tensor `[2, num_layers, block_size, num_kv_heads, head_dim]` (K then V),
             C order, in the header's dtype, little-endian

The reader trusts nothing: a wrong magic, an unknown version, a length that does not match
what is there (a truncated file) or a MAC that does not match raises `KVBlockFormatError`. The
MAC is keyed (`kv_block_store.store_key`): whoever does not hold the key cannot make a block
this reader accepts, even with the right header, name and layout; a checksum (version 1 had a
CRC-32) would only catch accidents. A block from another key reads as corrupt.
and a header that parses is still compared with the reader's own layout before any byte of
K/V is used (`KVBlockHeader.layout` / `KVLayout`). Pure functions: no files, no engine state.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import asdict, dataclass

import torch

from nanollmserve.kv_store_dir import KEY_BYTES

MAGIC = b"NLSKVBLK"
VERSION = 2
"""2: an HMAC-SHA256 with the store's key instead of version 1's CRC-32."""
_PREFIX = struct.Struct("<8sIIQ32s")
_MACED_PREFIX = struct.Struct("<8sIIQ")
"""The prefix's fields before the MAC: they are authenticated with the header and payload."""
MAX_HEADER_BYTES = 1 << 20
"""A header is a few hundred bytes plus the token ids: anything longer is not ours."""

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class KVBlockFormatError(ValueError):
    """The bytes are not a whole, intact KV block of this format."""


@dataclass(frozen=True)
class KVLayout:
    """What a block's K/V bytes mean: two blocks with different layouts never mix."""

    model_id: str
    """The weights the K/V was computed with (name, content fingerprint, weight format)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    """float32 | float16 | bfloat16."""
    block_size: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block's K/V: [2, num_layers, block_size, num_kv_heads, head_dim]."""
        return (2, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        count = 1
        for n in self.block_shape:
            count *= n
        return count * self.torch_dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """The format's name for a torch dtype (KVBlockFormatError for one it cannot store)."""
    for name, candidate in _DTYPES.items():
        if candidate == dtype:
            return name
    raise KVBlockFormatError(f"KV dtype {dtype} has no serialized form")


@dataclass(frozen=True)
class KVBlockHeader:
    layout: KVLayout
    token_ids: tuple[int, ...]
    """The tokens whose K/V the block holds (block_size of them)."""
    block_hash: str
    """Hex digest naming the block: chained over its parent's hash and its token ids."""
    parent_hash: str
    """Hex digest of the previous block in the prefix chain (for the first block: the
    chain's root, which names the model, the LoRA adapter and the cache salt)."""

    def to_json(self) -> bytes:
        fields = asdict(self.layout)
        fields.update(
            token_ids=list(self.token_ids),
            block_hash=self.block_hash,
            parent_hash=self.parent_hash,
        )
        return json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> KVBlockHeader:
        try:
            fields = json.loads(data)
            layout = KVLayout(
                model_id=str(fields["model_id"]),
                num_layers=int(fields["num_layers"]),
                num_kv_heads=int(fields["num_kv_heads"]),
                head_dim=int(fields["head_dim"]),
                dtype=str(fields["dtype"]),
                block_size=int(fields["block_size"]),
            )
            header = cls(
                layout,
                tuple(int(t) for t in fields["token_ids"]),
                str(fields["block_hash"]),
                str(fields["parent_hash"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise KVBlockFormatError(f"unreadable block header: {exc}") from None
        if layout.dtype not in _DTYPES:
            raise KVBlockFormatError(f"unknown KV dtype {layout.dtype!r}")
        if min(layout.block_shape) < 1 or len(header.token_ids) != layout.block_size:
            raise KVBlockFormatError("block header with an impossible shape")
        return header


def _mac(key: bytes, maced_prefix, header_bytes, payload) -> bytes:
    if len(key) < KEY_BYTES:
        raise KVBlockFormatError(f"a block key has at least {KEY_BYTES} bytes")
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in (maced_prefix, header_bytes, payload):
        mac.update(part)
    return mac.digest()


def serialize_block(
    header: KVBlockHeader, kv: torch.Tensor, key: bytes
) -> list[bytes | memoryview]:
    """The block's bytes as buffers to write one after the other (the payload is a view of
    `kv`'s memory, not a copy): `kv` is one block's K/V on the CPU, in the header's layout;
    `key` the store's MAC key."""
    layout = header.layout
    if tuple(kv.shape) != layout.block_shape or kv.dtype != layout.torch_dtype:
        raise KVBlockFormatError(
            f"K/V of shape {tuple(kv.shape)} {kv.dtype} does not match the header's "
            f"{layout.block_shape} {layout.dtype}"
        )
    payload = memoryview(kv.detach().cpu().contiguous().view(torch.uint8).numpy()).cast("B")
    header_bytes = header.to_json()
    maced = _MACED_PREFIX.pack(MAGIC, VERSION, len(header_bytes), len(payload))
    prefix = maced + _mac(key, maced, header_bytes, payload)
    return [prefix, header_bytes, payload]


def deserialize_block(
    data: bytes | bytearray | memoryview, key: bytes
) -> tuple[KVBlockHeader, torch.Tensor]:
    """-> (header, K/V tensor [2, layers, block_size, kv_heads, head_dim] on the CPU), or
    KVBlockFormatError when the bytes are not one intact block written with `key`."""
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size:
        raise KVBlockFormatError("truncated: shorter than the block prefix")
    magic, version, header_len, payload_len, mac = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise KVBlockFormatError("not a KV block (bad magic)")
    if version != VERSION:
        raise KVBlockFormatError(f"KV block format version {version}, this reader knows {VERSION}")
    if header_len > MAX_HEADER_BYTES or _PREFIX.size + header_len + payload_len != len(view):
        raise KVBlockFormatError(
            f"truncated or padded: {len(view)} bytes, the prefix says "
            f"{_PREFIX.size + header_len + payload_len}"
        )
    header_bytes = view[_PREFIX.size : _PREFIX.size + header_len]
    payload = view[_PREFIX.size + header_len :]
    expected = _mac(key, view[: _MACED_PREFIX.size], header_bytes, payload)
    if not hmac.compare_digest(expected, mac):
        raise KVBlockFormatError(
            "MAC mismatch: the block is corrupt or was not written with this store's key"
        )
    header = KVBlockHeader.from_json(bytes(header_bytes))
    layout = header.layout
    if payload_len != layout.block_bytes:
        raise KVBlockFormatError(
            f"payload of {payload_len} bytes, the header's layout needs {layout.block_bytes}"
        )
    # A bytearray is wrapped as it is; other buffers are read-only to torch: copied.
    buffer = data if isinstance(data, bytearray) else bytearray(payload)
    offset = _PREFIX.size + header_len if buffer is data else 0
    kv = torch.frombuffer(buffer, dtype=layout.torch_dtype, offset=offset)
    return header, kv.view(layout.block_shape)

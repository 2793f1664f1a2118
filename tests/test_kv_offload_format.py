"""The serialized KV block (`engine/kv_block_format.py`): what the offload store writes and
prefill/decode disaggregation will ship. A block survives the round trip bit for bit with
its header; any flipped byte, cut or padding, and any unknown version, is refused."""

from __future__ import annotations

import struct

import pytest
import torch

from nanollmserve.engine.kv_block_format import (
    KVBlockFormatError,
    KVBlockHeader,
    KVLayout,
    deserialize_block,
    serialize_block,
)

pytestmark = pytest.mark.milestone("m25")

KEY = bytes(range(32))


def block(dtype: str = "float32", seed: int = 0) -> tuple[KVBlockHeader, torch.Tensor]:
    layout = KVLayout("SmolLM2:0123abcd:gguf", num_layers=3, num_kv_heads=2, head_dim=8,
                      dtype=dtype, block_size=4)  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn(layout.block_shape, generator=generator).to(layout.torch_dtype)
    header = KVBlockHeader(layout, (11, 22, 33, 2**31 - 1), "ab" * 16, "cd" * 16)
    return header, kv


def to_bytes(header: KVBlockHeader, kv: torch.Tensor) -> bytes:
    return b"".join(bytes(buffer) for buffer in serialize_block(header, kv, KEY))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_round_trip_keeps_every_bit_and_the_header(dtype):
    header, kv = block(dtype)
    data = to_bytes(header, kv)
    assert len(data) == len(to_bytes(*block(dtype, seed=1)))  # fixed size per layout
    for buffer in (bytearray(data), data, memoryview(data)):
        read_header, read_kv = deserialize_block(buffer, KEY)
        assert read_header == header
        assert read_kv.dtype == kv.dtype and read_kv.shape == kv.shape
        assert torch.equal(read_kv.view(torch.uint8), kv.view(torch.uint8))


def test_the_payload_is_k_then_v_for_every_layer_in_c_order():
    header, kv = block()
    data = to_bytes(header, kv)
    payload = data[len(data) - header.layout.block_bytes :]
    assert payload == kv.contiguous().numpy().tobytes()


def test_every_flipped_byte_is_caught():
    header, kv = block()
    data = to_bytes(header, kv)
    step = max(1, len(data) // 97)  # positions across the prefix, the header and the payload
    for position in range(0, len(data), step):
        corrupt = bytearray(data)
        corrupt[position] ^= 0x01
        with pytest.raises(KVBlockFormatError):
            deserialize_block(corrupt, KEY)


@pytest.mark.parametrize("cut", [0, 1, 8, 27, 28, 100, -1, -1000])
def test_a_truncated_block_is_refused(cut):
    data = to_bytes(*block())
    with pytest.raises(KVBlockFormatError, match="truncated|prefix"):
        deserialize_block(bytearray(data[:cut]), KEY)


def test_padding_and_other_versions_are_refused():
    data = to_bytes(*block())
    with pytest.raises(KVBlockFormatError, match="padded"):
        deserialize_block(bytearray(data + b"\0"), KEY)
    newer = bytearray(data)
    struct.pack_into("<I", newer, 8, 3)
    with pytest.raises(KVBlockFormatError, match="version 3"):
        deserialize_block(newer, KEY)


def test_a_tensor_that_does_not_match_its_header_is_not_written():
    header, kv = block()
    with pytest.raises(KVBlockFormatError):
        serialize_block(header, kv[:, :2], KEY)
    with pytest.raises(KVBlockFormatError):
        serialize_block(header, kv.to(torch.float16), KEY)

"""A GGUF file's metadata and tensor table, read in milliseconds, and its tensors as numpy.

The gguf package's `GGUFReader` builds a numpy view for every string of the vocabulary and the
merge table (about 100 000 for the bundled model): 1.7 s of the first start on an idle
machine, before anything is converted. This reader walks the header with `struct` over a
memory map instead, keeps the string arrays it is asked for (else only their length), and
leaves the tensor data in the map until a tensor is asked for.

Layout (GGUF v2/v3, little-endian): magic `GGUF`, version u32, tensor count u64, metadata count
u64; each metadata entry is a key (u64 length + UTF-8), a value type u32 and the value; each
tensor entry is a name, a dimension count u32, the dimensions u64 (fastest-moving first), a
ggml type u32 and an offset u64 into the data section, which starts at the next multiple of
`general.alignment` (32 unless set) after the table.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Container
from dataclasses import dataclass
from functools import cached_property
from math import prod
from pathlib import Path

import numpy as np

from nanollmserve.errors import UserError

_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?"}
_SCALAR_FORMATS |= {10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]
    """In torch order (slowest-moving first): `[out, in]` for a linear weight."""
    ggml_type: int
    offset: int
    """From the start of the file."""
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict
    """Key -> value; string arrays not asked for are their length."""
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @cached_property
    def data(self) -> np.ndarray:
        """The whole file, memory-mapped once, as a plain read-only uint8 array (a `np.memmap`
        runs Python code on every view taken of it)."""
        return np.memmap(self.path, dtype=np.uint8, mode="r").view(np.ndarray)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes, uint8 `[rows, bytes a row]` (a view of the file)."""
        tensor = self.tensors[name]
        rows = prod(tensor.shape[:-1]) if len(tensor.shape) > 1 else 1
        return self.data[tensor.offset : tensor.offset + tensor.nbytes].reshape(rows, -1)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in its torch shape (blocks decoded by the gguf package; Q8_0,
        an embedding table's usual type, here in one pass with the package's arithmetic)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        if tensor.ggml_type == GGMLQuantizationType.Q8_0:
            blocks = self.raw(name).reshape(-1, 34)
            scales = blocks[:, :2].copy().view(np.float16).astype(np.float32)
            values = blocks[:, 2:].view(np.int8) * scales  # float32, as `gguf.quants.Q8_0`
        else:
            values = dequantize(self.raw(name), GGMLQuantizationType(tensor.ggml_type))
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(tensor.shape)
        return values if values.flags.writeable else values.copy()  # F32: a view of the map


def read_gguf_file(path: Path, keep_strings: Container[str] = ()) -> GGUFFile:
    """The metadata (string arrays whose key is in `keep_strings` read in full) and the tensor
    table of a GGUF file; a UserError when it is not one this reader can walk."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        try:
            if blob[:4] != b"GGUF":
                raise UserError(f"not a GGUF file: {path}")
            version, tensor_count, metadata_count = struct.unpack_from("<IQQ", blob, 4)
            if version not in _VERSIONS:
                raise UserError(f"unsupported GGUF version {version} in {path}")
            reader = _Reader(blob, 24)
            metadata = {}
            for _ in range(metadata_count):
                key = reader.string()
                metadata[key] = reader.value(reader.unpack("I"), key in keep_strings)
            entries = []
            for _ in range(tensor_count):
                name = reader.string()
                dims = [reader.unpack("Q") for _ in range(reader.unpack("I"))]
                ggml_type, offset = reader.unpack("I"), reader.unpack("Q")
                entries.append((name, tuple(reversed(dims)), ggml_type, offset))
        except (struct.error, UnicodeDecodeError, ValueError) as exc:
            raise UserError(f"cannot read the GGUF header of {path}: {exc}") from None
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-reader.pos // alignment) * alignment
    tensors = {}
    for name, shape, ggml_type, offset in entries:
        block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        nbytes = prod(shape) // block_values * block_bytes
        tensors[name] = GGUFTensor(name, shape, ggml_type, data_start + offset, nbytes)
    return GGUFFile(Path(path), metadata, tensors)


class _Reader:
    """Walks the header from `pos`."""

    def __init__(self, blob: mmap.mmap, pos: int) -> None:
        self.blob, self.pos = blob, pos

    def unpack(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.blob, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        length = self.unpack("Q")
        self.pos += length
        return self.blob[self.pos - length : self.pos].decode("utf-8")

    def value(self, value_type: int, keep_strings: bool):
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type != _ARRAY:
            raise ValueError(f"unknown metadata value type {value_type}")
        element_type, count = self.unpack("I"), self.unpack("Q")
        if element_type in _SCALAR_FORMATS:
            fmt = f"<{count}{_SCALAR_FORMATS[element_type]}"
            values = list(struct.unpack_from(fmt, self.blob, self.pos))
            self.pos += struct.calcsize(fmt)
            return values
        if element_type != _STRING:
            raise ValueError(f"metadata array of type {element_type}")
        if keep_strings:
            return [self.string() for _ in range(count)]
        pos, length_at = self.pos, _U64.unpack_from  # variable lengths: walk them (~100 000)
        for _ in range(count):
            pos += 8 + length_at(self.blob, pos)[0]
        self.pos = pos
        return count

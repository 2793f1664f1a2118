"""Saved slots (`--slot-save-path DIR`, llama.cpp's `POST /slots/{id}?action=save|restore|erase`).

This engine binds no request to a slot, so a "slot" is a sequence place (`SlotTable`): a
request takes the lowest free place when the engine loop admits it (or the first to free
up), and when it finishes its place remembers its tokens (prompt + the first choice's
output). Requests with a LoRA adapter or a `cache_salt` are never remembered: their blocks
are their own, never written to a file another key holder could restore.

A saved slot is that sequence's full blocks still in the prefix cache plus its token ids, in
one file of the directory, `SLOT_MAGIC` framed:

    prefix  "<8sIIQ32s": magic b"NLSKVSLT", version, header length, body length, HMAC-SHA256
            (the directory's store key, `kv_store_dir.store_key`) of the first 24 bytes, the
            header and the body
    header  UTF-8 JSON: the KV layout (model id included), the token ids, each block's size
    body    the blocks, each in the KV block format (`kv_block_format.py`, its own MAC)

Restore trusts nothing: the file is opened without following a link, must be a regular file
of this user no larger than `max_file_bytes` (one whole context's blocks and headers), the
outer and each block's MAC must hold, the layout must be this engine's (another model,
weight format, KV dtype or block size is refused) and each block's tokens and hashes must
be the ones its place in the token sequence names. Only then are its blocks copied into
free pool blocks and registered in the prefix cache (`KVCacheManager.insert_cached`), so the
next request with that prefix takes them as cache hits. Erase forgets the place's tokens and
drops their cached blocks that no running request holds, and their `--kv-offload-dir` block
files. Everything here runs on the engine thread, between steps.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
import struct
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nanollmserve.engine.kv_block_format import (
    KVBlockFormatError,
    KVLayout,
    deserialize_block,
    dtype_name,
    serialize_block,
)
from nanollmserve.errors import ParamError
from nanollmserve.private_cache import PRIVATE_FILE_MODE

if TYPE_CHECKING:
    from nanollmserve.engine.engine_core import EngineCore

SLOT_MAGIC = b"NLSKVSLT"
SLOT_VERSION = 1
_PREFIX = struct.Struct("<8sIIQ32s")
_MACED = struct.Struct("<8sIIQ")
FILENAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
"""A slot file's name: a plain name of at most 128 characters, no separator, not hidden."""
MAX_SLOT_FILES = 64
"""Regular files the directory may hold (a save that would add one more is refused)."""
ERASE_WRITE_WAIT_S = 5.0
"""How long erase waits for the offload writer to finish the sequence's queued blocks."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def check_filename(filename: object) -> str:
    """The name if it is a plain slot file name, else a ParamError (400) on `filename`."""
    if not isinstance(filename, str) or not FILENAME.fullmatch(filename):
        shown = repr(filename)[:80]
        raise ParamError(
            f"filename must be a plain file name (letters, digits, '.', '_', '-'; at most "
            f"128; not starting with '.'; no path), got {shown}",
            "filename",
        )
    return filename


class SlotTable:
    """Which request holds which sequence place, and the tokens each place last ran
    (engine thread only)."""

    def __init__(self, num_places: int) -> None:
        self.keep_tokens = False
        """Set with `--slot-save-path`: without it no place copies or keeps a request's
        tokens (up to max_num_seqs contexts of prompts held for nothing)."""
        self.tokens: list[list[int] | None] = [None] * num_places
        self._holder: list[str | None] = [None] * num_places
        self._place: dict[str, int] = {}
        self._waiting: dict[str, bool] = {}  # request id -> savable, oldest first
        self._savable: dict[str, bool] = {}

    def assign(self, request_id: str, savable: bool) -> None:
        """A request entered the engine: the lowest free place, or the next to free up."""
        self._savable[request_id] = savable
        if None in self._holder:
            self._take(self._holder.index(None), request_id)
        else:
            self._waiting[request_id] = savable

    def busy(self) -> list[bool]:
        """Which places a request holds now: a copy, so another thread may call it (GET
        /slots reads it between steps without stopping the engine)."""
        return [holder is not None for holder in list(self._holder)]

    def record(self, request_id: str, prompt_ids: list[int], output_ids: list[int]) -> None:
        """The request finished with these tokens: its place remembers them (if savable and
        slots are saved at all)."""
        place = self._place.get(request_id)
        if self.keep_tokens and place is not None and self._savable.get(request_id):
            self.tokens[place] = [*prompt_ids, *output_ids]

    def release(self, request_id: str) -> None:
        """The request left the engine (finished, aborted, failed): its place frees up."""
        self._savable.pop(request_id, None)
        self._waiting.pop(request_id, None)
        place = self._place.pop(request_id, None)
        if place is None:
            return
        self._holder[place] = None
        if self._waiting:
            waiting = next(iter(self._waiting))
            del self._waiting[waiting]
            self._take(place, waiting)

    def _take(self, place: int, request_id: str) -> None:
        self._holder[place] = request_id
        self._place[request_id] = place


@dataclass(frozen=True)
class SlotDir:
    """The opened --slot-save-path: its path and the MAC key its files are written with."""

    path: Path
    key: bytes


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Engine -> its KV layout (the model id digests the weight files: computed once)."""


def _layout(engine: EngineCore) -> KVLayout:
    if engine.kv_offload is not None:
        return engine.kv_offload.layout
    layout = _LAYOUTS.get(engine)
    if layout is None:
        layout = _LAYOUTS[engine] = _make_layout(engine)
    return layout


def _make_layout(engine: EngineCore) -> KVLayout:
    from nanollmserve.engine.kv_offload import model_id

    kv_cache = engine.model_runner.kv_cache
    _, num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return KVLayout(
        model_id=model_id(engine.loaded, engine.config.kv_cache_dtype),
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype_name(kv_cache.dtype),
        block_size=block_size,
    )


def _names(engine: EngineCore, layout: KVLayout, token_ids: list[int]) -> list[str]:
    """The stable names (KV offload's digest chain) of the tokens' full blocks; the first
    one's parent is the base model without a salt."""
    from nanollmserve.engine.kv_offload import KVOffload

    namer = engine.kv_offload or KVOffload(lambda: engine.model_runner.kv_cache, layout, None)
    return [namer.chain_root(), *namer.prompt_block_names(token_ids, None)]


def max_file_bytes(engine: EngineCore, layout: KVLayout) -> int:
    """The largest slot file this engine writes or reads: a whole context's blocks, with
    generous room for the JSON headers (20 bytes a token id, 4 KiB a block)."""
    max_len = engine.max_model_len
    num_blocks = -(-max_len // layout.block_size)
    return num_blocks * (layout.block_bytes + 4096 + 20 * layout.block_size) + 20 * max_len + 65536


def save(engine: EngineCore, slot_dir: SlotDir, filename: str, token_ids: list[int] | None):
    """Write the place's sequence -> (tokens whose K/V was saved, bytes written)."""
    from nanollmserve.engine.kv_block_format import KVBlockHeader

    check_filename(filename)
    layout = _layout(engine)
    token_ids = token_ids or []
    blocks = engine.kv_cache.cached_prefix(token_ids)
    names = _names(engine, layout, token_ids[: len(blocks) * layout.block_size])
    kv_cache = engine.model_runner.kv_cache
    body: list = []
    sizes = []
    for index, block in enumerate(blocks):
        start = index * layout.block_size
        header = KVBlockHeader(
            layout,
            tuple(token_ids[start : start + layout.block_size]),
            names[index + 1],
            names[index],
        )
        kv = kv_cache[:, :, block.block_id].to("cpu", copy=True).contiguous()
        parts = serialize_block(header, kv, slot_dir.key)
        sizes.append(sum(len(part) for part in parts))
        body += [bytes(part) for part in parts]
    header_bytes = json.dumps(
        {"layout": asdict(layout), "token_ids": token_ids, "block_sizes": sizes},
        separators=(",", ":"),
    ).encode()
    body_bytes = b"".join(body)
    maced = _MACED.pack(SLOT_MAGIC, SLOT_VERSION, len(header_bytes), len(body_bytes))
    data = maced + _mac(slot_dir.key, maced, header_bytes, body_bytes) + header_bytes + body_bytes
    if len(data) > max_file_bytes(engine, layout):
        raise ParamError("the slot is larger than a whole context (this is a bug)", "filename")
    _write(slot_dir.path, filename, data)
    return len(blocks) * layout.block_size, len(data)


def restore(engine: EngineCore, slot_dir: SlotDir, filename: str) -> tuple[list[int], int, int]:
    """Read, verify and cache a slot file -> (its token ids, tokens whose blocks are now in
    the prefix cache, bytes read)."""
    check_filename(filename)
    layout = _layout(engine)
    data = _read(slot_dir.path, filename, max_file_bytes(engine, layout))
    try:
        token_ids, kvs = _parse(engine, layout, slot_dir.key, data)
    except KVBlockFormatError as exc:
        raise ParamError(f"slot file {filename} is refused: {exc}", "filename") from None
    kv_cache = engine.model_runner.kv_cache

    def fill(index: int, block_id: int) -> None:
        kv_cache[:, :, block_id].copy_(kvs[index])

    num_cached = engine.kv_cache.insert_cached(token_ids, len(kvs), fill)
    return token_ids, num_cached * layout.block_size, len(data)


def erase(engine: EngineCore, token_ids: list[int] | None) -> int:
    """Drop the sequence's cached blocks no request holds -> how many were dropped; with
    `--kv-offload-dir` its block files go too, so no later request reloads what was erased
    (a slot's tokens are the base model's, unsalted: `SlotTable.assign`'s `savable`)."""
    token_ids = token_ids or []
    if engine.kv_offload is not None:
        store = engine.kv_offload.store
        names = engine.kv_offload.prompt_block_names(token_ids, None)
        with contextlib.suppress(TimeoutError):  # a write still queued would land after
            store.when_written(names).result(ERASE_WRITE_WAIT_S)
        for name in names:
            store.discard(name)
    return engine.kv_cache.uncache(token_ids)


def _parse(engine: EngineCore, layout: KVLayout, key: bytes, data: bytearray):
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise KVBlockFormatError("truncated: shorter than the slot prefix")
    magic, version, header_len, body_len, mac = _PREFIX.unpack_from(view)
    if magic != SLOT_MAGIC:
        raise KVBlockFormatError("not a slot file (bad magic)")
    if version != SLOT_VERSION:
        raise KVBlockFormatError(f"slot file version {version}, this reader knows {SLOT_VERSION}")
    if _PREFIX.size + header_len + body_len != len(view):
        raise KVBlockFormatError("truncated or padded")
    header_bytes = view[_PREFIX.size : _PREFIX.size + header_len]
    body = view[_PREFIX.size + header_len :]
    if not hmac.compare_digest(_mac(key, view[: _MACED.size], header_bytes, body), mac):
        raise KVBlockFormatError(
            "MAC mismatch: the file is corrupt, was changed, or was not written with this "
            "directory's key"
        )
    try:
        fields = json.loads(bytes(header_bytes))
        written = KVLayout(**fields["layout"])
        token_ids = [int(t) for t in fields["token_ids"]]
        sizes = [int(n) for n in fields["block_sizes"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise KVBlockFormatError(f"unreadable slot header: {exc}") from None
    if written != layout:
        raise KVBlockFormatError(
            f"written for another model or KV layout ({written.model_id}, {written.dtype}, "
            f"block size {written.block_size}); this server runs {layout.model_id}"
        )
    if len(token_ids) > engine.max_model_len:
        raise KVBlockFormatError("more tokens than this server's context")
    if sum(sizes) != len(body) or len(sizes) > len(token_ids) // layout.block_size:
        raise KVBlockFormatError("its block sizes do not add up")
    names = _names(engine, layout, token_ids[: len(sizes) * layout.block_size])
    kvs = []
    offset = 0
    for index, size in enumerate(sizes):
        header, kv = deserialize_block(bytearray(body[offset : offset + size]), key)
        offset += size
        start = index * layout.block_size
        if (
            header.layout != layout
            or list(header.token_ids) != token_ids[start : start + layout.block_size]
            or header.block_hash != names[index + 1]
            or header.parent_hash != names[index]
        ):
            raise KVBlockFormatError(f"block {index}: its tokens or hashes are not its place's")
        kvs.append(kv)
    return token_ids, kvs


def _mac(key: bytes, *parts) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


def _write(directory: Path, filename: str, data: bytes) -> None:
    """Write `filename` in the directory: under a hidden temporary name (exclusive, 0600, no
    link followed), then renamed over it (a link there is replaced, never followed)."""
    temp = f".{filename}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    dir_fd = os.open(directory, _DIR_FLAGS)
    try:
        with os.scandir(dir_fd) as entries:
            names = {e.name for e in entries if e.is_file(follow_symlinks=False)}
        names = {name for name in names if FILENAME.fullmatch(name)}
        if filename not in names and len(names) >= MAX_SLOT_FILES:
            raise ParamError(
                f"the --slot-save-path directory holds {len(names)} slot files, at most "
                f"{MAX_SLOT_FILES}: overwrite or delete one",
                "filename",
            )
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(temp, flags, PRIVATE_FILE_MODE, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), PRIVATE_FILE_MODE)
                f.write(data)
            os.replace(temp, filename, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)


def _read(directory: Path, filename: str, max_bytes: int) -> bytearray:
    dir_fd = os.open(directory, _DIR_FLAGS)
    try:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(filename, flags, dir_fd=dir_fd)
        except OSError as exc:
            reason = "no such file" if isinstance(exc, FileNotFoundError) else exc.strerror
            raise ParamError(f"cannot read slot file {filename}: {reason}", "filename") from None
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise ParamError(f"slot file {filename} is not a regular file of ours", "filename")
        if info.st_size > max_bytes:
            raise ParamError(
                f"slot file {filename} has {info.st_size} bytes, more than a whole context "
                f"({max_bytes}): refused",
                "filename",
            )
        data = bytearray(info.st_size)
        num_read = f.readinto(data)
    return data[:num_read]

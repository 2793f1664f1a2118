"""KV offload: the prefix cache's second tier, a directory of blocks that outlives the process.

`--kv-offload-dir PATH` (bounded by `--kv-offload-max-bytes`) turns it on. Write-through:
every full block the prefix cache registers is, once the step that computes it has run,
copied out of the pool (one small copy on the engine thread) and written to the store by its
writer thread (`kv_block_store.py`), so a restart, a crash included, finds every block
written before it, and evicting a block from the pool costs nothing. A request whose prefix
misses the pool looks its next blocks up in the store; those found are read and checked
(`kv_block_format.py`), copied into free pool blocks and registered there before the
scheduler allocates, so the request takes them exactly as it takes pool hits (they count as
`cached_tokens`).

Keys are stable across processes, unlike the pool's in-process hashes: a block is named by
a BLAKE2b digest chained over its parent's digest and its token ids, and the chain's root
digests the KV layout (model id, layer count, KV heads, head dim, dtype, block size), the
LoRA adapter's weights and the request's `cache_salt`. A block computed under another model,
weight format, dtype, layout, adapter or salt is therefore never even looked up, and a file
whose header does not match what the request expects (layout, token ids, hashes) is
deleted, never loaded. The model id digests the weight files' whole contents (the sha256 the
GGUF cache records once per file identity, `gguf_cache.file_sha256`), the model config (rope
settings included), the weight dtype and format and the KV cache dtype, not their paths or
times. The store (`kv_block_store.py`) is a private, marked directory and every block carries
an HMAC with the store's key: a block planted by whoever lacks the key is never loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nanollmserve.engine.kv_block_format import (
    KVBlockFormatError,
    KVBlockHeader,
    KVLayout,
    deserialize_block,
    dtype_name,
)
from nanollmserve.engine.kv_block_store import KVBlockStore
from nanollmserve.engine.request import Request
from nanollmserve.errors import UserError

if TYPE_CHECKING:
    from nanollmserve.config import EngineConfig
    from nanollmserve.engine.model_loading import LoadedModel

logger = logging.getLogger(__name__)

_DIGEST_BYTES = 16


class KVOffload:
    """Moves blocks between the pool tensor (`ModelRunner.kv_cache`, [2, layers, blocks,
    block_size, kv_heads, head_dim], returned by `kv_cache_of`: sleep mode replaces it) and
    a `KVBlockStore`, and names them."""

    def __init__(
        self,
        kv_cache_of: Callable[[], torch.Tensor],
        layout: KVLayout,
        store: KVBlockStore,
    ) -> None:
        self.kv_cache_of = kv_cache_of
        self.layout = layout
        self.store = store
        self._layout_digest = _digest(json.dumps(layout.__dict__, sort_keys=True).encode())
        self._adapter_digests: dict[int, bytes] = {}

    @classmethod
    def open(
        cls, config: EngineConfig, loaded: LoadedModel, kv_cache_of: Callable[[], torch.Tensor]
    ) -> KVOffload | None:
        """The offload tier `config` asks for over the pool (None: it asks none)."""
        if config.kv_offload_dir is None:
            return None
        kv_cache = kv_cache_of()
        _, num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        try:
            layout = KVLayout(
                model_id=model_id(loaded, config.kv_cache_dtype),
                num_layers=num_layers,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                dtype=dtype_name(kv_cache.dtype),
                block_size=block_size,
            )
            store = KVBlockStore(config.kv_offload_dir, config.kv_offload_max_bytes)
        except (KVBlockFormatError, OSError) as exc:
            raise UserError(f"--kv-offload-dir {config.kv_offload_dir}: {exc}") from None
        logger.info(
            "KV offload to %s: %d blocks (%.1f MiB of %.1f MiB) found; %s",
            *(config.kv_offload_dir, store.num_files, store.num_bytes / 2**20),
            *(config.kv_offload_max_bytes / 2**20, layout.model_id),
        )
        return cls(kv_cache_of, layout, store)

    def block_digests(self, request: Request, num_blocks: int) -> list[bytes]:
        """The digests naming the request's first `num_blocks` full blocks (grown lazily)."""
        digests = request.block_digests
        if len(digests) < num_blocks:
            root = self._root(request.lora, request.sampling_params.cache_salt)
            self._extend_chain(digests, root, request.all_token_ids, num_blocks)
        return digests

    def prompt_block_names(
        self, token_ids: list[int], cache_salt: str | None, adapter=None
    ) -> list[str]:
        """The store names of a prompt's full blocks, as a request with this prompt, salt
        and LoRA adapter (None: the base model) names them: what phase 1 of prefill/decode
        disaggregation waits for (any thread)."""
        digests: list[bytes] = []
        num_blocks = len(token_ids) // self.layout.block_size
        self._extend_chain(digests, self._root(adapter, cache_salt), token_ids, num_blocks)
        return [digest.hex() for digest in digests]

    def chain_root(self, adapter=None, cache_salt: str | None = None) -> str:
        """The hex digest a prompt's first block is chained to (the `parent_hash` of its
        header) under this adapter (None: the base model) and salt."""
        return self._root(adapter, cache_salt).hex()

    def _extend_chain(
        self, digests: list[bytes], root: bytes, token_ids: list[int], num_blocks: int
    ) -> None:
        size = self.layout.block_size
        while len(digests) < num_blocks:
            i = len(digests)
            parent = digests[i - 1] if i else root
            tokens = token_ids[i * size : (i + 1) * size]
            digests.append(_digest(parent, struct.pack(f"<{size}I", *tokens)))

    def num_stored(self, request: Request, start: int, stop: int) -> int:
        """How many of blocks start, start + 1, ... (before `stop`) the store holds."""
        digests = self.block_digests(request, stop)
        count = 0
        while start + count < stop and self.store.contains(digests[start + count].hex()):
            count += 1
        return count

    def load(self, request: Request, start: int, block_ids: list[int]) -> int:
        """Read the request's blocks start, start + 1, ... into pool blocks `block_ids` ->
        how many were loaded (it stops at the first file that is gone, corrupt or foreign;
        a corrupt or foreign file is deleted)."""
        digests = self.block_digests(request, start + len(block_ids))
        kv_cache = self.kv_cache_of()
        for offset, block_id in enumerate(block_ids):
            index = start + offset
            name = digests[index].hex()
            data = self.store.read(name)
            if data is None:
                return offset
            try:
                header, kv = deserialize_block(data, self.store.key)
                self._check(header, request, index, digests)
            except KVBlockFormatError as exc:
                logger.warning("KV offload: dropping block file %s: %s", name, exc)
                self.store.discard(name)
                return offset
            kv_cache[:, :, block_id].copy_(kv)
        return len(block_ids)

    def save(self, blocks: list[tuple[Request, int, int]]) -> None:
        """Write-through: queue (request, block index, pool block id) for the store, each
        block's K/V copied out of the pool now (the pool may reuse the block at once)."""
        kv_cache = self.kv_cache_of()
        for request, index, block_id in blocks:
            digests = self.block_digests(request, index + 1)
            name = digests[index].hex()
            if not self.store.reserve(name, self.layout.block_bytes):
                continue
            view = kv_cache[:, :, block_id]
            if view.device.type == "cpu":
                kv = view.clone(memory_format=torch.contiguous_format)
            else:
                kv = view.contiguous().cpu()
            self.store.put(name, self._header(request, index, digests), kv)

    def close(self) -> None:
        """Finish the queued writes (at shutdown)."""
        self.store.close()
        logger.info(
            "KV offload: %d blocks written, %d dropped (the writer was behind)",
            self.store.num_written,
            self.store.num_dropped,
        )

    def _header(self, request: Request, index: int, digests: list[bytes]) -> KVBlockHeader:
        size = self.layout.block_size
        parent = (
            digests[index - 1]
            if index
            else self._root(request.lora, request.sampling_params.cache_salt)
        )
        return KVBlockHeader(
            layout=self.layout,
            token_ids=tuple(request.all_token_ids[index * size : (index + 1) * size]),
            block_hash=digests[index].hex(),
            parent_hash=parent.hex(),
        )

    def _check(
        self, header: KVBlockHeader, request: Request, index: int, digests: list[bytes]
    ) -> None:
        expected = self._header(request, index, digests)
        if header.layout != self.layout:
            raise KVBlockFormatError(f"written for another layout: {header.layout}")
        if header != expected:
            raise KVBlockFormatError("its tokens or hashes are not the ones it is named for")

    def _root(self, lora, salt: str | None) -> bytes:
        """What the first block's digest is chained to: the layout, the LoRA adapter (None:
        the base model), the cache salt."""
        adapter = b""
        if lora is not None:
            adapter = self._adapter_digests.get(lora.uid)
            if adapter is None:
                adapter = self._adapter_digests[lora.uid] = adapter_digest(lora)
        salt_bytes = b"" if salt is None else b"\x01" + salt.encode()
        return _digest(self._layout_digest, adapter, salt_bytes)


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def adapter_digest(adapter) -> bytes:
    """A LoRA adapter named by its weights (not its name or path, which may be reused)."""
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for name in sorted(adapter.weights):
        h.update(name.encode())
        for tensor in adapter.weights[name]:
            h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def model_id(loaded: LoadedModel, kv_cache_dtype: str = "auto") -> str:
    """`name:fingerprint:weight format`: the fingerprint digests each weight file's name and
    whole-file sha256 (a byte changed anywhere, the middle included, is another model), the
    model config (rope theta and scaling, heads, layers...), the weight dtype and format and
    the KV cache dtype: everything that changes the K/V a prompt gets. A copy of the same
    files on another machine gets the same id."""
    from nanollmserve.model.gguf_cache import file_sha256

    source = loaded.source
    if source.gguf_path is not None:
        files = [Path(source.gguf_path)]
    else:
        files = sorted(Path(source.path).glob("*.safetensors"))
        files += [Path(source.path, "config.json")]
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for path in files:
        h.update(f"{path.name}:{file_sha256(path)}\n".encode())
    settings = {
        "model_config": dataclasses.asdict(loaded.model_config),
        "dtype": str(loaded.dtype),
        "quantization": loaded.quantization,
        "kv_cache_dtype": kv_cache_dtype,
    }
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return f"{source.name}:{h.hexdigest()}:{loaded.quantization or 'dense'}"

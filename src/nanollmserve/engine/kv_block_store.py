"""A directory of serialized KV blocks (`kv_block_format.py`), one file per block, bounded in
bytes and evicted least recently used first.

A block's file is `DIR/<first two hex digits>/<hex name>.kvb`, the name being the block's
hash. Writes run on one writer thread fed by a queue bounded in bytes (`put`): a file is
written under a temporary name unique to its writer and renamed into place, so no reader,
in this process or another, ever sees half a file, and when the queue is full the block is
dropped rather than the engine kept waiting. `when_written` gives a future done once given
blocks are no longer queued (prefill/decode disaggregation answers after it). Reads (`read`)
run on the caller's thread and mark the file recently used (its mtime too, so the order
survives a restart). At start the directory is scanned: the files it holds count against
`max_bytes`, oldest mtime first to go. Nothing here parses a block: the caller verifies what
it reads and `discard`s a file that fails (a corrupt or truncated file is deleted, never
loaded).

Several processes may share one directory (a prefill and a decode worker on /dev/shm): the
disk, not this index, says what is stored. `contains` finds a file another process wrote
(and adopts it into this index), a file another process evicted is a miss for `read`, and
a reader holding a file open keeps reading it whole even when it is deleted or replaced
meanwhile. Each process bounds by `max_bytes` the files it wrote or adopted, so two writers
keep at most the sum of their bounds on disk.

The directory is private and marked as ours (`kv_store_dir.open_store_dir`, the rules of the native
library cache, `nanollmserve/private_cache.py`): it is made 0700, its shard directories 0700 and its
files 0600; a directory or file owned by another user (root aside) or writable by group or
others is refused with a `UserError` that says why. A new or empty directory gets a marker
file (`MARKER`) when it is first opened, and a non-empty directory without one is refused,
never emptied. Nothing here follows a symbolic link inside the store (every open, stat,
rename and unlink is relative to a shard directory opened with O_NOFOLLOW), and the only
files ever deleted are block files (`<hex>.kvb`) and this module's own temporary files
(`<hex>.<pid>.<hex>.tmp`), in a marked directory: anything else found there is left alone.
Blocks carry an HMAC-SHA256 keyed by `store_key` (a 0600 key file in the store, created once,
exclusively), so a block this store's writers did not make is refused like a corrupt one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import TYPE_CHECKING

from nanollmserve.kv_store_dir import open_store_dir, store_key
from nanollmserve.private_cache import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE

if TYPE_CHECKING:  # the cluster launcher opens a store without importing torch
    import torch

    from nanollmserve.engine.kv_block_format import KVBlockHeader

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
MAX_PENDING_BYTES = 256 << 20
"""K/V copies waiting for the writer thread, at most: past that, new blocks are dropped."""
MAX_STAGED_BYTES = 1 << 30
"""Blocks fetched from another host (`stage`) waiting for the engine, at most."""
STAGED_TTL_S = 60.0
"""A staged block the engine has not read this long after it arrived is dropped."""
STALE_TEMP_SECONDS = 3600.0
"""A temporary file older than this was left by a process that died mid-write."""
_SHARD = re.compile(r"[0-9a-f]{2}")
_BLOCK = re.compile(r"[0-9a-f]{2,128}\.kvb")
_TEMP = re.compile(r"[0-9a-f]{2,128}\.[0-9]+\.[0-9a-f]{8}\.tmp")
_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


class KVBlockStore:
    def __init__(self, directory: str | Path, max_bytes: int) -> None:
        self.directory = open_store_dir(directory)
        self.key = store_key(self.directory)
        """The MAC key every block here is written and read with."""
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()
        """Name -> file size, least recently used first."""
        self._bytes = 0
        self._pending: set[str] = set()
        self._pending_bytes = 0
        self._queue: queue.Queue = queue.Queue()
        self._waiters: list[tuple[set[str], Future]] = []
        """`when_written`'s futures, each with the names it still waits for."""
        self._inbox: OrderedDict[str, tuple[float, bytes | bytearray]] = OrderedDict()
        """`stage`d blocks: name -> (when it expires, its bytes), oldest first."""
        self._inbox_bytes = 0
        self.num_written = 0
        self.num_dropped = 0
        """Blocks not written because the writer was MAX_PENDING_BYTES behind."""
        self._scan()
        self._writer = threading.Thread(
            target=self._write_loop, name="kv-offload-writer", daemon=True
        )
        self._writer.start()

    @property
    def num_files(self) -> int:
        return len(self._files)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def path(self, name: str) -> Path:
        return self.directory / name[:2] / f"{name}{SUFFIX}"

    @contextlib.contextmanager
    def _shard(self, name: str, create: bool = False):
        """The fd of block `name`'s shard directory, opened without following a link (a link
        or anything but a directory there raises OSError); `create`: made 0700 if missing."""
        shard = self.directory / name[:2]
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(shard, PRIVATE_DIR_MODE)
        fd = os.open(shard, _NOFOLLOW_DIR)
        try:
            if create:
                os.fchmod(fd, PRIVATE_DIR_MODE)  # mkdir's mode is masked by the umask
            yield fd
        finally:
            os.close(fd)

    def _stat(self, name: str) -> os.stat_result:
        """The block file's own stat (OSError: missing, or not a regular file: a link)."""
        with self._shard(name) as shard:
            info = os.stat(f"{name}{SUFFIX}", dir_fd=shard, follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode):
            raise FileNotFoundError(f"{name}{SUFFIX} is not a regular file")
        return info

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(OSError), self._shard(name) as shard:
            os.unlink(f"{name}{SUFFIX}", dir_fd=shard)  # removes a link, never its target

    def stage(self, name: str, data: bytes | bytearray) -> None:
        """Hold a block fetched from another host (`kv_ray_transfer`) in memory until the
        engine reads it (`read` takes it out): bounded by MAX_STAGED_BYTES (oldest dropped
        first) and STAGED_TTL_S. Unchecked here: the reader verifies it like a file."""
        with self._lock:
            old = self._inbox.pop(name, None)
            if old is not None:
                self._inbox_bytes -= len(old[1])
            self._inbox[name] = (time.monotonic() + STAGED_TTL_S, data)
            self._inbox_bytes += len(data)
            self._expire_inbox()

    def _expire_inbox(self) -> None:
        now = time.monotonic()
        while self._inbox:
            name, (expires, data) = next(iter(self._inbox.items()))
            if expires > now and self._inbox_bytes <= MAX_STAGED_BYTES:
                break
            del self._inbox[name]
            self._inbox_bytes -= len(data)

    def _take_staged(self, name: str) -> bytes | bytearray | None:
        with self._lock:
            self._expire_inbox()
            entry = self._inbox.pop(name, None)
            if entry is None:
                return None
            self._inbox_bytes -= len(entry[1])
            return entry[1]

    @property
    def num_staged_bytes(self) -> int:
        return self._inbox_bytes

    def contains(self, name: str) -> bool:
        """On disk now (a block still being written is not), whichever process wrote it, or
        staged: a file another process wrote is adopted into this index, one it deleted
        forgotten."""
        with self._lock:
            if name in self._inbox:
                return True
        try:
            size = self._stat(name).st_size
        except OSError:
            self._forget(name)
            return False
        with self._lock:
            if name not in self._files:
                self._files[name] = size
                self._bytes += size
                self._evict()
        return True

    def num_stored(self, names: Iterable[str]) -> int:
        """How many of `names`, from the first, are on disk now."""
        count = 0
        for name in names:
            if not self.contains(name):
                break
            count += 1
        return count

    def when_written(self, names: Iterable[str]) -> Future:
        """A future done (result None) once none of `names` is queued for writing any more:
        each was written, failed or was dropped. Already done when none is queued."""
        future: Future = Future()
        with self._lock:
            pending = {name for name in names if name in self._pending}
            if pending:
                self._waiters.append((pending, future))
        if not pending:
            future.set_result(None)
        return future

    def reserve(self, name: str, num_bytes: int) -> bool:
        """Claim the right to `put` a block: False when it is stored or pending already, is
        larger than the whole store, or the writer is too far behind (then it counts as
        dropped). Call before copying the block's K/V out of the pool."""
        stored = self.contains(name)  # on disk: another process may have evicted it
        with self._lock:
            if stored or name in self._pending or num_bytes > self.max_bytes:
                return False
            if self._pending_bytes + num_bytes > MAX_PENDING_BYTES:
                self.num_dropped += 1
                return False
            self._pending.add(name)
            self._pending_bytes += num_bytes
            return True

    def put(self, name: str, header: KVBlockHeader, kv: torch.Tensor) -> None:
        """Queue a reserved block for the writer thread (`kv`: a CPU copy it may keep)."""
        self._queue.put((name, header, kv))

    def read(self, name: str) -> bytearray | None:
        """The file's bytes (None if it is gone), marking it the most recently used; a staged
        block's bytes first (taken out of the inbox)."""
        staged = self._take_staged(name)
        if staged is not None:
            return staged if isinstance(staged, bytearray) else bytearray(staged)
        file = f"{name}{SUFFIX}"
        try:
            with self._shard(name) as shard:
                fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=shard)
                with os.fdopen(fd, "rb") as f:
                    info = os.fstat(f.fileno())
                    if not stat.S_ISREG(info.st_mode):
                        raise FileNotFoundError(f"{file} is not a regular file")
                    data = bytearray(info.st_size)
                    num_read = f.readinto(data)
                with contextlib.suppress(OSError):  # evicted since it was opened: read whole
                    os.utime(file, dir_fd=shard, follow_symlinks=False)
        except OSError:  # gone: evicted (here or by another process) or never written
            self._forget(name)
            return None
        with self._lock:
            if name in self._files:
                self._files.move_to_end(name)
        return data if num_read == len(data) else data[:num_read]

    def discard(self, name: str) -> None:
        """Delete a file the caller found corrupt or foreign: it is never read again."""
        self._take_staged(name)
        self._forget(name)
        self._unlink(name)

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued (up to `timeout` seconds), then stop the writer thread."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout)

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._files.pop(name, None)
            if size is not None:
                self._bytes -= size

    def _scan(self) -> None:
        """Index the block files of the shard directories. Only real directories and regular
        files count (links are skipped, never followed); only this module's temporary files
        an hour old are deleted; anything else is left alone."""
        found = []
        now = time.time()
        with os.scandir(self.directory) as top:
            shards = [e.name for e in top if _SHARD.fullmatch(e.name) and not e.is_symlink()]
        for shard_name in shards:
            try:
                with self._shard(shard_name) as shard, os.scandir(shard) as entries:
                    for entry in entries:
                        if not entry.is_file(follow_symlinks=False):
                            continue
                        info = entry.stat(follow_symlinks=False)
                        if _BLOCK.fullmatch(entry.name):
                            found.append((info.st_mtime, entry.name[: -len(SUFFIX)], info.st_size))
                        elif (
                            _TEMP.fullmatch(entry.name) and now - info.st_mtime > STALE_TEMP_SECONDS
                        ):
                            with contextlib.suppress(OSError):
                                os.unlink(entry.name, dir_fd=shard)
            except OSError:  # not a directory (a link is refused by O_NOFOLLOW)
                logger.warning("KV store %s: skipping %s", self.directory, shard_name)
        for _, name, size in sorted(found):
            self._files[name] = size
            self._bytes += size
        self._evict()

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            name, header, kv = item
            size = 0
            try:
                size = self._write(name, header, kv)
            except Exception:  # noqa: BLE001 (a full disk must not stop the engine)
                logger.warning("could not write KV block %s", name, exc_info=True)
            with self._lock:
                self._pending.discard(name)
                self._pending_bytes -= kv.numel() * kv.element_size()
                if size:
                    self._files[name] = size
                    self._bytes += size
                    self.num_written += 1
                    self._evict()
                done = [future for waiting, future in self._waiters if _settle(waiting, name)]
                self._waiters = [w for w in self._waiters if w[0]]
            for future in done:
                with contextlib.suppress(InvalidStateError):  # cancelled by its waiter
                    future.set_result(None)

    def _write(self, name: str, header: KVBlockHeader, kv: torch.Tensor) -> int:
        from nanollmserve.engine.kv_block_format import serialize_block

        temp = f"{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        size = 0
        with self._shard(name, create=True) as shard:
            fd = os.open(temp, flags, PRIVATE_FILE_MODE, dir_fd=shard)
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), PRIVATE_FILE_MODE)
                for buffer in serialize_block(header, kv, self.key):
                    size += f.write(buffer)
            os.replace(temp, f"{name}{SUFFIX}", src_dir_fd=shard, dst_dir_fd=shard)
        return size

    def _evict(self) -> None:
        """Delete least recently used files until the store fits `max_bytes` (lock held)."""
        while self._bytes > self.max_bytes and self._files:
            name, size = self._files.popitem(last=False)
            self._bytes -= size
            self._unlink(name)


def _settle(waiting: set[str], name: str) -> bool:
    """Strike `name` from a waiter's set: True when that was the last one it waited for."""
    if name not in waiting:
        return False
    waiting.discard(name)
    return not waiting

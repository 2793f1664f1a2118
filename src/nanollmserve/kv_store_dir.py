"""The KV block store's directory (`engine/kv_block_store.py`): made or checked private and
marked as a store (`open_store_dir`), and the MAC key its blocks are written under
(`store_key`). Torch-free and engine-free, so the cluster launcher (which must not import the
engine) makes a store and its key before any worker starts.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from nanollmserve.errors import UserError
from nanollmserve.private_cache import (
    PRIVATE_DIR_MODE,
    PRIVATE_FILE_MODE,
    UntrustedCacheError,
    check_trusted,
)

MARKER = ".nanollmserve-kv-store"
"""Written (exclusively, 0600) into a new or empty directory the first time it is opened: a
directory without it is not a store, and nothing in it is ever deleted."""
KEY_FILE = ".nanollmserve-kv-key"
KEY_BYTES = 32
"""The store's MAC key, hex (0600, owner-only: readable by another user, it is refused)."""
_REMEDY = (
    "Give {flag} a directory of your own that only you can write (a new one is made 0700), "
    "or fix its owner and mode (chmod 700)"
)


def open_store_dir(directory: str | Path, flag: str = "--kv-offload-dir") -> Path:
    """Make or check a store directory -> its path. A missing one is made 0700 and marked; an
    existing one must be owned by this user (or root) and not writable by group or others,
    and must be marked already or empty (then it is marked); one this user owns is made
    0700. A `UserError` says why a directory is refused, naming `flag` (the option that
    gave it: --kv-offload-dir, --slot-save-path)."""
    path = Path(directory)
    what = f"the {flag} directory"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, PRIVATE_DIR_MODE)
        check_trusted(path, what, _REMEDY.format(flag=flag))
        if not path.is_dir():
            raise UserError(f"{flag} {path} is not a directory")
        if path.stat().st_uid == os.getuid():
            os.chmod(path, PRIVATE_DIR_MODE)  # ours: only we read the prompts' token ids
        entries = os.listdir(path)
        if MARKER not in entries:
            if entries:
                raise UserError(
                    f"{flag} {path} holds {len(entries)} entries but is not a KV "
                    f"block store (no {MARKER} file): it is refused rather than emptied. Give "
                    f"a new or empty directory (for example a subdirectory of this one)"
                )
            with contextlib.suppress(FileExistsError):  # another worker marked it first
                write_private(path, MARKER, b"nanollmserve KV block store\n")
        marker = path / MARKER
        if not stat.S_ISREG(os.lstat(marker).st_mode):
            raise UserError(f"{flag} {path}: {MARKER} is not a regular file")
        check_trusted(marker, what, _REMEDY.format(flag=flag))
    except UntrustedCacheError as exc:
        raise UserError(f"{flag}: {exc}") from None
    except OSError as exc:
        raise UserError(f"{flag} {path}: {exc}") from None
    return path


def store_key(directory: str | Path, flag: str = "--kv-offload-dir") -> bytes:
    """The MAC key of the (opened) store `directory`, made on first use: 32 random bytes in
    `KEY_FILE`, written 0600 under a temporary name and linked into place, which fails if a
    key is there already (then that key is used: every process of a store shares one). The
    key file must be a regular file owned by this user (or root) that no other user can read
    or write, else `UserError`."""
    path = Path(directory)
    try:
        with contextlib.suppress(FileExistsError):
            temp = f"{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            write_private(path, temp, secrets.token_hex(KEY_BYTES).encode() + b"\n")
            try:
                os.link(path / temp, path / KEY_FILE, follow_symlinks=False)
            finally:
                os.unlink(path / temp)
        fd = os.open(path / KEY_FILE, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            text = f.read(4 * KEY_BYTES)
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot read its key {KEY_FILE}: {exc}") from None
    if (
        not stat.S_ISREG(info.st_mode)
        or info.st_uid not in (os.getuid(), 0)
        or info.st_mode & 0o077
    ):
        raise UserError(
            f"{flag} {path}: refusing its key {KEY_FILE}: it is not a regular file "
            f"that only this user can read and write (0600). Delete it (a new key is made; "
            f"the blocks already there are then recomputed)"
        )
    try:
        key = bytes.fromhex(text.decode().strip())
    except ValueError:
        key = b""
    if len(key) < KEY_BYTES:
        raise UserError(f"{flag} {path}: its key {KEY_FILE} is not {KEY_BYTES} hex bytes")
    return key


def write_private(directory: Path, name: str, data: bytes) -> None:
    """Create `directory/name` exclusively (FileExistsError if it exists), 0600, with `data`."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    fd = os.open(directory / name, flags, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), PRIVATE_FILE_MODE)
        f.write(data)

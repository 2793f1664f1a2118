"""The cache directory (`$NANOLLMSERVE_CACHE`), kept private to the user who runs the server.

The cache holds code that gets loaded (the native library) and weights that get run (GGUF
conversions). On a shared machine another user who can write there could plant a library
that the next start loads, or swap a model's weights. So:

- every directory created here, from the cache root down, is made 0700 (whatever the umask);
- every file written into it is made owner-only before it is renamed into place;
- before anything in the cache is used, the path from the cache root down to it, and each
  file used, must be owned by this user (or root) and not writable by group or others, else
  `UntrustedCacheError` names the path and how to fix it. Nothing untrusted is ever loaded.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from nanollmserve.errors import UserError

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


class UntrustedCacheError(UserError):
    """A cache path that another user could have written: refused, never loaded."""


def cache_root() -> Path:
    """`$NANOLLMSERVE_CACHE`, default `~/.cache/nanollmserve`."""
    return Path(os.environ.get("NANOLLMSERVE_CACHE") or "~/.cache/nanollmserve").expanduser()


def private_cache_dir(*parts: str) -> Path:
    """`cache_root()/parts...`, each missing level created 0700, the whole chain checked."""
    path = cache_root()
    path.parent.mkdir(parents=True, exist_ok=True)
    _private_dir(path)
    for part in parts:
        path = path / part
        _private_dir(path)
    return path


def _private_dir(path: Path) -> None:
    """Create `path` 0700 unless it exists; either way check that it can be trusted."""
    try:
        path.mkdir(mode=PRIVATE_DIR_MODE)
        os.chmod(path, PRIVATE_DIR_MODE)  # mkdir's mode is masked by the umask; be exact
    except FileExistsError:
        pass
    check_trusted(path)


CACHE_REMEDY = (
    "Remove it (it is rebuilt) or fix its owner and mode (chmod go-w), or point "
    "NANOLLMSERVE_CACHE at a private directory"
)


def check_trusted(path: Path, what: str = "the cache path", remedy: str = CACHE_REMEDY) -> None:
    """`UntrustedCacheError` unless `path` is owned by this user (or root) and not writable by
    group or others. Symlinks are judged by what they point to, and the link itself too.
    `what` names the path in the message and `remedy` says how to fix it (other private
    directories, such as the KV block store, reuse this check)."""
    for info in (os.lstat(path), os.stat(path)):
        owner_ok = info.st_uid in (os.getuid(), 0)
        writable_by_others = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if not owner_ok or (writable_by_others and not stat.S_ISLNK(info.st_mode)):
            who = "owned by another user" if not owner_ok else "writable by group or others"
            raise UntrustedCacheError(
                f"refusing to use {what} {path}: it is {who}, so another user could "
                f"have replaced what it holds. {remedy}"
            )


def make_private_tree(path: Path) -> None:
    """chmod `path` (a file or a directory tree) owner-only, before it is renamed into place."""
    if path.is_symlink():
        return  # a conversion writes none; never chmod what a link points to
    if path.is_dir():
        os.chmod(path, PRIVATE_DIR_MODE)
        for child in path.iterdir():
            make_private_tree(child)
    else:
        os.chmod(path, PRIVATE_FILE_MODE)

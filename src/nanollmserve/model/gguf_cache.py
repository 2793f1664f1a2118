"""Convert a GGUF file once into a normal Hugging Face directory in the cache.

transformers reads GGUF (`gguf_file=`) by dequantizing every tensor, which takes ~15 s for the
bundled 135 M model. Doing it on every start would dominate start-up, so the first load writes
the result (config, generation config, tokenizer, float32 safetensors) into
`$NANOLLMSERVE_CACHE/gguf/<file stem>-<key>/` and later loads read that in about a second.

The key hashes the whole file: a reinstall of the same bytes hits the cache, and a file edited
anywhere, even in the middle, is a new entry. Hashing ~100 MB on every start would cost a few
tenths of a second, so the full hash is computed once per file identity (path, device, inode,
size, mtime and ctime, which no user can set back) and recorded in `gguf-digests/`.
A conversion writes into a `.tmp-*` directory beside the entry and renames it into place
when complete, so a killed conversion never leaves a half-written entry; leftover `.tmp-*`
directories are skipped and removed by a later conversion once they are an hour old.

The cache is private (`private_cache.py`): its directories are 0700, its files owner-only, and
an entry another user could have written is refused, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path

from nanollmserve.errors import UserError
from nanollmserve.model.private_cache import (
    PRIVATE_FILE_MODE,
    cache_root,
    check_trusted,
    make_private_tree,
    private_cache_dir,
)

__all__ = ["cache_root", "cached_gguf_blocks", "cached_hf_dir", "gguf_cache_key"]

CONVERSION_VERSION = 1
"""Bump when the conversion output changes, so old cache entries are not reused."""
GGUF_BLOCKS_VERSION = 1
"""Bump when the block row layout changes (the file name carries it)."""
TMP_PREFIX = ".tmp-"
STALE_TMP_SECONDS = 3600
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
"""`general.architecture` values whose conversion gives a supported HF architecture."""
_CHUNK = 1 << 20

logger = logging.getLogger(__name__)


def gguf_cache_key(gguf_path: Path) -> str:
    """`<stem>-<16 hex digits>` from the conversion version and the whole file's sha256."""
    digest = hashlib.sha256(f"v{CONVERSION_VERSION}:{file_sha256(gguf_path)}".encode())
    return f"{gguf_path.stem}-{digest.hexdigest()[:16]}"


def file_sha256(path: Path) -> str:
    """The sha256 of the whole file, computed once per file identity and recorded."""
    info = path.stat()
    identity = (
        f"{path.resolve()}:{info.st_dev}:{info.st_ino}:{info.st_size}:"
        f"{info.st_mtime_ns}:{info.st_ctime_ns}"
    )
    record = private_cache_dir("gguf-digests") / hashlib.sha256(identity.encode()).hexdigest()
    if record.is_file():
        check_trusted(record)
        recorded = record.read_text().strip()
        if len(recorded) == 64:
            return recorded
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=record.parent)
    with os.fdopen(fd, "w") as f:
        f.write(digest.hexdigest() + "\n")
    os.replace(tmp, record)
    return digest.hexdigest()


def cached_hf_dir(gguf_path: Path) -> tuple[Path, bool]:
    """The cache entry for `gguf_path`, converting it first if needed -> (dir, converted)."""
    root = private_cache_dir("gguf")
    entry = root / gguf_cache_key(gguf_path)
    if (entry / "config.json").is_file():
        check_entry_trusted(entry)
        return entry, False
    architecture = gguf_architecture(gguf_path)
    if architecture is not None and architecture not in GGUF_ARCHITECTURES:
        raise UserError(
            f"unsupported GGUF architecture {architecture!r} in {gguf_path.name} "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    _remove_stale_tmp_dirs(root)
    if entry.exists():  # damaged by hand (renames only ever move complete entries in)
        shutil.rmtree(entry)
    logger.info("converting %s once into %s (takes about 20 s)", gguf_path.name, entry)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{entry.name}-", dir=root))
    try:
        convert_gguf(gguf_path, tmp)
        make_private_tree(tmp)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / "config.json").is_file():
                raise
            # Another process finished the same conversion first: use its entry.
            check_entry_trusted(entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return entry, True


def check_entry_trusted(entry: Path) -> None:
    """`UntrustedCacheError` unless the entry and every file in it are this user's alone."""
    check_trusted(entry)
    for path in entry.rglob("*"):
        check_trusted(path)


def gguf_architecture(gguf_path: Path) -> str | None:
    """`general.architecture` when it is the file's first metadata key (as llama.cpp writes
    it), read from the header alone; a UserError if the file is not GGUF."""
    with open(gguf_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"not a GGUF file: {gguf_path}")
        try:
            # version u32, tensor count u64, metadata count u64, then key (u64 length + bytes),
            # value type u32 (8 = string), value (u64 length + bytes).
            f.seek(4 + 4 + 8 + 8)
            (key_len,) = struct.unpack("<Q", f.read(8))
            key = f.read(key_len) if key_len < 256 else b""
            (value_type,) = struct.unpack("<I", f.read(4))
            if key != b"general.architecture" or value_type != 8:
                return None
            (value_len,) = struct.unpack("<Q", f.read(8))
            return f.read(min(value_len, 256)).decode("utf-8", "replace")
        except struct.error:
            raise UserError(f"truncated GGUF file: {gguf_path}") from None


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize `gguf_path` with transformers and save it as an HF directory in `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are dequantized already; drop the GGUF "quantizer" so they can be saved.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    info = {"gguf_file": name, "gguf_size": gguf_path.stat().st_size, "version": CONVERSION_VERSION}
    (out_dir / "nanollmserve_gguf.json").write_text(json.dumps(info, indent=2) + "\n")


def _remove_stale_tmp_dirs(root: Path) -> None:
    """Remove `.tmp-*` dirs left by killed conversions (old enough not to be in progress)."""
    now = time.time()
    for path in root.glob(f"{TMP_PREFIX}*"):
        try:
            if now - path.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def cached_gguf_blocks(entry: Path, gguf_path: Path, config) -> dict:
    """The GGUF's quantized linear weights in the native kernels' row layout
    (`--quantization gguf`): weight name -> `BlockRows`, read from `entry` or laid out once and
    saved there (the layout is the same on every CPU)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from nanollmserve.model.gguf_blocks import BlockRows, read_gguf_blocks

    path = entry / f"gguf-blocks-v{GGUF_BLOCKS_VERSION}.safetensors"
    if not path.is_file():
        logger.info("laying out the quantized blocks of %s once into %s", gguf_path.name, path.name)
        blocks = read_gguf_blocks(gguf_path, config)
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=".safetensors", dir=entry)
        os.close(fd)
        try:
            kinds = {name: b.kind for name, b in blocks.items()}
            tensors = {name: b.rows for name, b in blocks.items()}
            save_file(
                tensors, tmp, metadata={"gguf_file": gguf_path.name, "kinds": json.dumps(kinds)}
            )
            os.chmod(tmp, PRIVATE_FILE_MODE)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    check_trusted(path)
    with safe_open(path, framework="pt") as f:
        kinds = json.loads((f.metadata() or {})["kinds"])
        return {name: BlockRows(kinds[name], f.get_tensor(name)) for name in f.keys()}  # noqa: SIM118 (not a dict)

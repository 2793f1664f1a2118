"""Convert a GGUF file once into a Hugging Face directory in the cache, in parts.

The first load of a GGUF file writes, into `$NANOLLMSERVE_CACHE/gguf/<file stem>-<key>/`, the
model's files (config, generation config, tokenizer: `gguf_convert.write_model_files`, under a
second) and nothing else. The weights follow as what runs them needs, each part written once
beside them:

- the GGUF block layers (`--quantization gguf`, the default for a GGUF file on the CPU): the
  linear weights' blocks (`gguf-blocks-v*.safetensors`) and the other tensors in float32
  (`gguf-unblocked-v*.safetensors`: norms, biases, and the embedding table only when it is in
  a type no kernel runs: else it is looked up in its blocks, an untied table's stored with the
  linear weights'), a few seconds;
- anything that runs dense weights: `model.safetensors`, every tensor dequantized to float32
  by transformers (~20 s for the bundled 135 M model), converted the first time such a load
  asks (`cached_dense_weights`, called by the loader).

`nanollmserve_gguf.json` says which file an entry was converted from, so a later dense load
can complete the entry. The key hashes the whole file: a reinstall of the same bytes hits the
cache, and a file edited anywhere, even in the middle, is a new entry. Hashing ~100 MB on
every start would cost a few tenths of a second, so the full hash is computed once per file
identity (path, device, inode, size, mtime and ctime, which no user can set back) and
recorded in `gguf-digests/`. A conversion writes into a `.tmp-*` directory or file beside its
target and renames it into place when complete, so a killed conversion never leaves a
half-written entry or part; leftover `.tmp-*` directories are skipped and removed by a later
conversion once they are an hour old. A part written at a new version (an upgrade that
changed its layout) deletes that part's older files in the entry, each as large as the weights.

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
from nanollmserve.private_cache import (
    PRIVATE_FILE_MODE,
    cache_root,
    check_trusted,
    make_private_tree,
    private_cache_dir,
)

__all__ = [
    "cache_root",
    "cached_dense_weights",
    "cached_gguf_blocks",
    "cached_hf_dir",
    "cached_unblocked_tensors",
    "gguf_cache_key",
]

CONVERSION_VERSION = 2
"""Bump when the conversion output changes, so old cache entries are not reused.
(2: an entry starts with the model files only; the weights are written as loads need them.)"""
GGUF_BLOCKS_VERSION = 6
"""Bump when the block row layout changes (the file name carries it). 2: K-quant weights
(stored tiled) and their shapes; 3: their sub-scales stored once per output; 4: the legacy
kinds stored tiled too (a load maps them instead of tiling a copy: the weights once in RSS);
5: an untied embedding table in a type the kernels run, tiled (`gguf_blocks.EMBEDDING`);
6: compact K-quant tile-blocks (a header of d, dm, off per super-block or block, sub-scales
and mins only where the types have them: the kinds carry the layout)."""
UNBLOCKED_VERSION = 4
"""Bump when the tensors of `gguf_convert.unblocked_tensors` change (the file name carries it).
(2: no float32 embedding table when a tied Q8_0 table is looked up in its blocks; 4: nor when
the table, tied or not, is in any type the kernels run.)"""
INFO_FILE = "nanollmserve_gguf.json"
DENSE_WEIGHTS_FILE = "model.safetensors"
TMP_PREFIX = ".tmp-"
STALE_TMP_SECONDS = 3600
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
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
    """The cache entry for `gguf_path`, writing its model files first if needed ->
    (dir, converted). The weights are added by `cached_gguf_blocks`,
    `cached_unblocked_tensors` or `cached_dense_weights`, as the load needs them."""
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
    logger.info(
        "first start with %s: converting it into the cache once (config and tokenizer, then "
        "the weights the load runs)",
        gguf_path.name,
    )
    start = time.perf_counter()
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
    logger.info(
        "converted the config and tokenizer of %s into %s in %.1f s",
        *(gguf_path.name, entry, time.perf_counter() - start),
    )
    return entry, True


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """The model files of `gguf_path` (config, generation config, tokenizer) and the record
    of where they came from, in `out_dir`: a cache entry without weights."""
    from nanollmserve.model.gguf_convert import write_model_files

    write_model_files(gguf_path, out_dir)
    info = {
        "gguf_file": gguf_path.name,
        "gguf_path": str(gguf_path.resolve()),
        "gguf_size": gguf_path.stat().st_size,
        "version": CONVERSION_VERSION,
    }
    (out_dir / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


def is_gguf_entry(path: Path) -> bool:
    """Whether `path` is a GGUF cache entry (its weights may still have to be converted)."""
    return (path / INFO_FILE).is_file()


def cached_dense_weights(entry: Path) -> Path:
    """`model.safetensors` of a GGUF cache entry, every tensor dequantized to float32, converted
    from the file the entry was made from the first time a load needs it (~20 s for the
    bundled model)."""
    path = entry / DENSE_WEIGHTS_FILE
    if path.is_file():
        check_trusted(path)
        return path
    from nanollmserve.model.gguf_convert import write_dense_weights

    check_trusted(entry / INFO_FILE)
    gguf_path = Path(json.loads((entry / INFO_FILE).read_text())["gguf_path"])
    if not gguf_path.is_file() or gguf_cache_key(gguf_path) != entry.name:
        raise UserError(
            f"the GGUF file {entry.name} was converted from is gone or changed ({gguf_path}): "
            f"load the model by its file again, or remove {entry}"
        )
    logger.info(
        "converting the dequantized float32 weights of %s once into %s (takes about 20 s; "
        "only what runs dense weights needs them: --quantization none, --dtype, ...)",
        *(gguf_path.name, entry.name),
    )
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=entry.parent))
    try:
        write_dense_weights(gguf_path, tmp)
        os.chmod(tmp / DENSE_WEIGHTS_FILE, PRIVATE_FILE_MODE)
        os.replace(tmp / DENSE_WEIGHTS_FILE, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted the dense weights in %.1f s", time.perf_counter() - start)
    return path


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
    """The GGUF's quantized linear weights (and an untied embedding table in blocks) in the
    native kernels' tiled layout (`--quantization gguf`): weight name -> `BlockTiles`,
    mapped from `entry` or laid out once and saved there (the layout is the same on every CPU)."""
    from nanollmserve.model.gguf_blocks import read_gguf_blocks, warn_without_kernel
    from nanollmserve.model.gguf_kquants import BlockTiles

    warn_without_kernel(gguf_path)

    def build() -> tuple[dict, dict]:
        blocks = read_gguf_blocks(gguf_path, config)
        kinds = {name: b.kind for name, b in blocks.items()}
        shapes = {name: [b.out_features, b.in_features] for name, b in blocks.items()}
        tensors = {name: b.tiled() for name, b in blocks.items()}
        metadata = {"kinds": json.dumps(kinds), "shapes": json.dumps(shapes)}
        return tensors, {"gguf_file": gguf_path.name, **metadata}

    path = entry / f"gguf-blocks-v{GGUF_BLOCKS_VERSION}.safetensors"
    tensors, metadata = _cached_tensors(path, "laying out the quantized blocks", build)
    kinds, shapes = json.loads(metadata["kinds"]), json.loads(metadata["shapes"])

    # stored tiled: the layers run the mapped file's bytes
    return {name: BlockTiles(kinds[name], *shapes[name], t) for name, t in tensors.items()}


def cached_unblocked_tensors(entry: Path, gguf_path: Path, config) -> dict:
    """The GGUF's tensors that are not linear weights run as blocks (embedding table, norms,
    biases), float32 under our parameter names (`gguf_convert.unblocked_tensors`), read from
    `entry` or dequantized once and saved there."""
    from nanollmserve.model.gguf_convert import unblocked_tensors

    def build() -> tuple[dict, dict]:
        return unblocked_tensors(gguf_path, config), {"gguf_file": gguf_path.name}

    path = entry / f"gguf-unblocked-v{UNBLOCKED_VERSION}.safetensors"
    tensors, _ = _cached_tensors(path, "dequantizing the tensors besides the blocks", build)
    return tensors


def _cached_tensors(path: Path, what: str, build) -> tuple[dict, dict]:
    """The tensors and metadata of `path`, built (`build() -> (tensors, metadata)`) and saved
    there first when the file is missing; the tensors map the file (no copy)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if not path.is_file():
        start = time.perf_counter()
        tensors, metadata = build()
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=".safetensors", dir=path.parent)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=metadata)
            os.chmod(tmp, PRIVATE_FILE_MODE)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        del tensors  # read back from the map below: never the blocks in memory twice
        logger.info("%s into %s: %.1f s", what, path.name, time.perf_counter() - start)
        _remove_older_versions(path)
    check_trusted(path)
    with safe_open(path, framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {}  # noqa: SIM118 (not a dict)


def _remove_older_versions(path: Path) -> None:
    """Delete the entry's files of this part at an older version (`gguf-blocks-v5` beside a
    new `gguf-blocks-v6`): each is as large as the weights, and no release reads them again,
    so an upgrade would otherwise leave gigabytes behind per model. A process still mapping
    one keeps its pages until it exits (unlinking does not unmap)."""
    prefix, _, current = path.stem.rpartition("-v")
    for old in path.parent.glob(f"{prefix}-v*{path.suffix}"):
        version = old.stem.rpartition("-v")[2]
        if version.isdigit() and int(version) < int(current):
            old.unlink(missing_ok=True)
            logger.info("removed %s (replaced by %s)", old.name, path.name)

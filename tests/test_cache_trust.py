"""The cache (`$NANOLLMSERVE_CACHE`) on a machine shared with other users: directories made
0700 whatever the umask, a native library or GGUF conversion that another user could have
written is refused (never loaded), and the GGUF cache key covers the whole file."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_model_loading import write_tiny_gguf

from nanollmserve.model import ModelConfig, load_model, resolve_model
from nanollmserve.model.gguf_cache import gguf_cache_key
from nanollmserve.native.build import cpu_supports_kernels
from nanollmserve.private_cache import UntrustedCacheError

pytestmark = [pytest.mark.milestone("m21"), pytest.mark.timeout(300)]

needs_kernels = pytest.mark.skipif(
    cpu_supports_kernels() is not None, reason=f"no native kernels: {cpu_supports_kernels()}"
)
needs_root = pytest.mark.skipif(
    os.getuid() != 0, reason="chown to another user needs root (CI runs as root)"
)
OTHER_UID = 65534  # nobody

PLANTED_LIBRARY = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *marker = fopen(getenv("PLANTED_MARKER"), "w");
    if (marker) fclose(marker);
}
"""


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def run_python(code: str, cache: Path, umask: int = 0o022, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "NANOLLMSERVE_CACHE": str(cache), **env},
        preexec_fn=lambda: os.umask(umask),
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@needs_kernels
def test_a_fresh_cache_is_private_even_with_a_loose_umask(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    code = (
        "from nanollmserve.native.build import library_path, isa_level\n"
        "from nanollmserve.native.ops import load_kernels\n"
        "assert load_kernels() is not None\n"
        "print(library_path(isa_level()))\n"
    )
    library = Path(run_python(code, cache, umask=0o002).strip())
    assert library.is_file() and library.is_relative_to(cache)
    for directory in (cache, cache / "native", library.parent):
        assert mode(directory) == 0o700, directory
    assert mode(library) & 0o077 == 0


def plant_library(tmp_path: Path) -> tuple[Path, Callable[[str], None]]:
    """A library of our own, in the cache where the kernels would be built (whose loading
    leaves a marker file), and `refused(expected)`: a fresh process refuses it with
    `expected` in its reason, and never loads it."""
    cache, marker = tmp_path / "cache", tmp_path / "planted-library-ran"
    library = Path(
        run_python(
            "from nanollmserve.native.build import library_path, isa_level\n"
            "print(library_path(isa_level()))",
            cache,
        ).strip()
    )
    os.makedirs(library.parent, mode=0o700)
    for directory in (cache, cache / "native", library.parent):
        os.chmod(directory, 0o700)
    source = tmp_path / "planted.c"
    source.write_text(PLANTED_LIBRARY)
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    # The control: loading it does leave the marker, so its absence below means something.
    control = tmp_path / "control-marker"
    run_python(f"import ctypes; ctypes.CDLL({str(library)!r})", cache, PLANTED_MARKER=str(control))
    assert control.exists(), "the planted library leaves no marker when it is loaded"
    probe = (
        "from nanollmserve.native.ops import kernels_unavailable_reason, load_kernels\n"
        "assert load_kernels() is None\n"
        "print(kernels_unavailable_reason())\n"
    )

    def refused(expected: str) -> None:
        reason = run_python(probe, cache, PLANTED_MARKER=str(marker))
        assert "refusing to use the cache path" in reason and expected in reason, reason
        assert not marker.exists(), "the planted library was loaded"

    return library, refused


@needs_kernels
def test_a_library_another_user_could_write_is_never_loaded(tmp_path: Path) -> None:
    library, refused = plant_library(tmp_path)
    os.chmod(library.parent, 0o777)
    refused(f"{library.parent}: it is writable by group or others")
    os.chmod(library.parent, 0o700)
    os.chmod(library, 0o666)
    refused(f"{library}: it is writable by group or others")


@needs_kernels
@needs_root
def test_a_library_owned_by_another_user_is_never_loaded(tmp_path: Path) -> None:
    library, refused = plant_library(tmp_path)
    os.chown(library, OTHER_UID, OTHER_UID)
    refused(f"{library}: it is owned by another user")


def gguf_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Path]:
    """(cache, entry, weights): a tiny GGUF converted, and loaded once, under a loose umask."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("NANOLLMSERVE_CACHE", str(cache))
    old_umask = os.umask(0o002)
    try:
        entry = resolve_model(str(write_tiny_gguf(tmp_path / "tiny.gguf"))).path
    finally:
        os.umask(old_umask)
    # The dense weights are added to the entry by the first load that needs them.
    load_model(entry, ModelConfig.from_pretrained(entry), torch.float32, torch.device("cpu"))
    return cache, entry, entry / "model.safetensors"


def test_gguf_entries_are_private_and_untrusted_ones_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, entry, weights = gguf_entry(tmp_path, monkeypatch)
    assert mode(cache) == mode(cache / "gguf") == mode(entry) == 0o700
    assert all(mode(path) & 0o077 == 0 for path in entry.rglob("*"))
    assert mode(weights) & 0o077 == 0
    assert resolve_model(str(tmp_path / "tiny.gguf")).path == entry  # trusted: reused
    for path, loose in ((entry, 0o777), (weights, 0o666), (cache / "gguf", 0o770)):
        os.chmod(path, loose)
        with pytest.raises(UntrustedCacheError, match="writable by group or others"):
            resolve_model(str(tmp_path / "tiny.gguf"))
        os.chmod(path, 0o700 if path.is_dir() else 0o600)
    assert resolve_model(str(tmp_path / "tiny.gguf")).path == entry  # trusted again


@needs_root
def test_a_gguf_entry_owned_by_another_user_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, weights = gguf_entry(tmp_path, monkeypatch)
    os.chown(weights, OTHER_UID, OTHER_UID)
    with pytest.raises(UntrustedCacheError, match="owned by another user"):
        resolve_model(str(tmp_path / "tiny.gguf"))


def test_a_gguf_edited_in_the_middle_is_a_new_cache_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NANOLLMSERVE_CACHE", str(tmp_path / "cache"))

    def edit_middle_keeping_size_and_mtime(path: Path) -> None:
        before = path.stat()
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(data)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert path.stat().st_size == before.st_size

    # A file larger than the first and last MiB that a partial key would read.
    big = tmp_path / "big.gguf"
    big.write_bytes(os.urandom(3 << 20))
    key = gguf_cache_key(big)
    assert gguf_cache_key(big) == key
    edit_middle_keeping_size_and_mtime(big)
    assert gguf_cache_key(big) != key

    # End to end: the edited model is converted into its own entry.
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf")
    first = resolve_model(str(gguf_path))
    edit_middle_keeping_size_and_mtime(gguf_path)
    second = resolve_model(str(gguf_path))
    assert second.converted and second.path != first.path
    assert not resolve_model(str(gguf_path)).converted

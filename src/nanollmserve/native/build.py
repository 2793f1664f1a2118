"""Compile the native sources (`gguf_cpu.c`, `kquant_cpu.c`, `kquant_int8_cpu.c`, `amx_cpu.c`,
`attention_cpu.c`, `sampling_cpu.c`) once per machine into the library `native/ops.py` loads.

The library is plain C with OpenMP (no PyTorch headers, so it compiles in about a second),
built with the system C compiler (`$CC`, default `cc`) into
`$NANOLLMSERVE_CACHE/native/<hash>/`, where the hash covers the source, the flags and the
compiler's version: a changed source or compiler builds a new library, a finished one is
never rebuilt. A build compiles the sources (several compiler processes at once where the
machine has cores to spare), links them into a temporary file and renames it into place, so
concurrent starts (the workers of a cluster) never load a half-written library; in one
process a second caller waits for the build in flight. Only this CPU's ISA level is built
(-O3 throughout: -O2 saves 0.3 s of the largest file's 0.8 s, once per machine). A first
start runs the build in a background thread (`build_in_background`) while the weights are
converted.

The path is predictable, so the cache is private (`nanollmserve/private_cache.py`): its
directories are created 0700, the library is made owner-only before the rename, and a library
whose directory or file another user could have written (owned by someone else, or writable by
group or others) is refused with the reason, never loaded.

This module only compiles: `native/ops.py` opens the library, binds its entry points and
checks its ABI (`load_kernels`). A build that cannot run here raises `NativeUnavailable`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nanollmserve.private_cache import (
    UntrustedCacheError,
    cache_root,
    check_trusted,
    private_cache_dir,
)

logger = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "gguf_cpu.c",
        "kquant_cpu.c",
        "kquant_int8_cpu.c",
        "amx_cpu.c",
        "attention_cpu.c",
        "sampling_cpu.c",
    )
)
HEADERS = tuple(Path(__file__).with_name(name) for name in ("native.h", "kquant_layout.h"))
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c11")
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
ISA_LEVELS = {
    "avx2": ((), ()),
    "avx512": (
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mbmi2"),
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "bmi2"),
    ),
    "amx": (
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mbmi2",
         "-mamx-tile", "-mamx-int8"),
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "bmi2", "amx_tile",
         "amx_int8"),
    ),
}  # fmt: skip
"""ISA level -> (extra compiler flags, the /proc/cpuinfo flags a CPU needs to run that build).
The same sources are built once per level; the block matmul picks its inner loop with
`#ifdef __AVX512VNNI__`, and the `amx` build runs steps of 8 rows or more on AMX int8 tiles
(native/amx_cpu.c; the same numbers as the vector kernel). `avx2` is the fallback every
supported CPU runs."""
ISA_ENV = "NANOLLMSERVE_CPU_ISA"
"""Forces an ISA level (`avx2` on an AVX-512 CPU, to measure the AVX2 build there)."""
_BUILD_LOCK = threading.Lock()


class NativeUnavailable(RuntimeError):
    """Why the native kernels cannot run on this machine."""


def _cpu_flags() -> list[str]:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])


def cpu_supports_kernels() -> str | None:
    """None when this CPU runs the kernels, else why not."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the native kernels are x86-64 Linux only (this is {platform.machine()})"
    try:
        flags = _cpu_flags()
    except OSError as error:
        return f"cannot read /proc/cpuinfo: {error}"
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in flags]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


def runnable_levels() -> list[str]:
    """The ISA levels this CPU has every flag for, narrowest first (`avx512` needs AVX-512
    F/BW/VL/DQ, VNNI and BMI2; `amx` those and AMX int8)."""
    flags = set(_cpu_flags())
    return [level for level, (_, needs) in ISA_LEVELS.items() if set(needs) <= flags]


def isa_level() -> str:
    """The widest ISA level this CPU runs (`runnable_levels`), or the one
    `NANOLLMSERVE_CPU_ISA` names; NativeUnavailable when that one cannot run here."""
    flags = set(_cpu_flags())
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced:
        if forced not in ISA_LEVELS:
            raise NativeUnavailable(f"{ISA_ENV}={forced!r}: choose one of {', '.join(ISA_LEVELS)}")
        missing = [flag for flag in ISA_LEVELS[forced][1] if flag not in flags]
        if missing:
            raise NativeUnavailable(f"{ISA_ENV}={forced}: this CPU lacks {', '.join(missing)}")
        return forced
    return runnable_levels()[-1]


def _compiler() -> str:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise NativeUnavailable(f"no C compiler ({compiler!r} not found; set CC)")
    return compiler


def build_flags(level: str) -> tuple[str, ...]:
    return (*FLAGS, *ISA_LEVELS[level][0])


def library_path(level: str) -> Path:
    """Where the library for these sources, this ISA level's flags and this compiler lives
    (built or not): `native/<hash>/libnanollmserve_native-<level>.so`."""
    compiler = _compiler()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS)))
    digest.update(" ".join(build_flags(level)).encode())
    digest.update(version.encode())
    name = f"libnanollmserve_native-{level}.so"
    return cache_root() / "native" / digest.hexdigest()[:16] / name


def build_library(level: str | None = None) -> Path:
    """The compiled library for `level` (default: `isa_level()`), building it first when
    needed; NativeUnavailable on failure."""
    reason = cpu_supports_kernels()
    if reason:
        raise NativeUnavailable(reason)
    level = level or isa_level()
    path = library_path(level)
    try:
        private_cache_dir("native", path.parent.name)
        if path.is_file():
            check_trusted(path)
            return path
    except UntrustedCacheError as error:
        raise NativeUnavailable(str(error)) from None
    with _BUILD_LOCK:  # a second caller waits for the build in flight, then finds the file
        if not path.is_file():
            _compile(level, path)
    return path


def _compile(level: str, path: Path) -> None:
    """Compile the sources (in parallel where the machine has cores to spare), link them into a
    temporary file and rename it to `path`."""
    logger.info("building the native kernels (%s) for this CPU, once per machine", level)
    start = time.perf_counter()
    compiler, flags = _compiler(), build_flags(level)
    compile_flags = [flag for flag in flags if flag != "-shared"]
    with tempfile.TemporaryDirectory(prefix=".tmp-", dir=path.parent) as tmp_dir:
        objects = [Path(tmp_dir) / f"{source.stem}.o" for source in SOURCES]

        def compile_one(source: Path, obj: Path) -> subprocess.CompletedProcess:
            command = [compiler, *compile_flags, "-c", str(source), "-o", str(obj)]
            return subprocess.run(command, capture_output=True, text=True, check=False)

        with ThreadPoolExecutor(_parallel_compiles()) as pool:
            results = list(pool.map(compile_one, SOURCES, objects))
        failed = "".join(result.stderr for result in results if result.returncode != 0)
        if failed:
            raise NativeUnavailable(f"building the native kernels failed:\n{failed[-2000:]}")
        tmp = Path(tmp_dir) / path.name
        command = [compiler, *flags, "-o", str(tmp), *map(str, objects), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise NativeUnavailable(f"linking the native kernels failed:\n{result.stderr[-2000:]}")
        os.chmod(tmp, 0o700)  # the linker creates it with the umask's mode
        os.replace(tmp, path)
    logger.info(
        "built the native kernels (%s) in %.1f s into %s", level, time.perf_counter() - start, path
    )


def _parallel_compiles() -> int:
    """Compiler processes at once: one core is left to the start-up that runs beside the build
    (on two cores, one compiler at a time keeps the critical path on its own core)."""
    return max(1, min(len(SOURCES), len(os.sched_getaffinity(0)) - 1))


def build_in_background() -> None:
    """Start compiling this CPU's library in a thread, so the build overlaps what the caller
    does next (converting and laying out the weights on a first start); a failure is left for
    `ops.load_kernels` to report. Whoever needs the library meanwhile waits for that build."""

    def build() -> None:
        try:
            build_library()
        except Exception:  # noqa: BLE001 (reported by the load that follows)
            logger.debug("building the native kernels in the background failed", exc_info=True)

    threading.Thread(target=build, name="native-build").start()

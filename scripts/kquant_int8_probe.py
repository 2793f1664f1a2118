"""What int8 activations would buy the K-quant kernel: times today's int16 kernel
(`nls_kq_matmul`) against two int8 twins of it (scripts/kquant_int8_probe.c: vpdpbusd, 4 byte
products a lane where vpdpwssd has 2): int8 per 32 inputs with the int16 kernel's float steps,
and int8 per 256 (llama.cpp's Q8_K) with the sub-scales merged in integers, on the same tiles
of random valid blocks, in one library built here with the AVX-512 level's flags plus BMI2.
Reports each kernel's error against the dequantized weights in float64. One JSON object on
stdout: its provenance (bench/provenance.py: git rev, dirty or not, date, CPU, cores,
command), and per type, shape and row count the min and median seconds of each kernel and
the median over calls of the int16 / int8 time ratios, the kernels taking turns call by call
so that a burst of host load falls on all three.

    PYTHONPATH=src .venv/bin/python scripts/kquant_int8_probe.py [--rows 1 8 32] [--threads 2]

A measurement for decision 35 / 40 (milestones/m31-kquants.md), not a served kernel: the
server runs `nls_kq_matmul` only. Needs AVX-512 VNNI and BMI2.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from nanollmserve.bench.provenance import provenance
from nanollmserve.model.gguf_kquants import read_kquant_rows
from nanollmserve.native import build

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "src" / "nanollmserve" / "native"

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kquant_kernel_bench import random_blocks  # noqa: E402

KERNELS = {
    "int16": ("nls_kq_matmul", "nls_kq_matmul_workspace_bytes"),
    "int8": ("probe_q8_matmul", "probe_q8_workspace_bytes"),
    "int8_256": ("probe_q8k_matmul", "probe_q8k_workspace_bytes"),
}
"""Each kernel's matmul and workspace functions: today's int16; int8 per 32 with the int16
kernel's float steps; int8 per 256 with the sub-scales merged in integers (super-block kinds
only)."""


def build_probe(workdir: Path) -> ctypes.CDLL:
    library = workdir / "probe.so"
    command = [
        os.environ.get("CC", "cc"), *build.build_flags("avx512"), "-mbmi2",
        f"-I{NATIVE}", "-o", str(library), str(ROOT / "scripts" / "kquant_int8_probe.c"), "-lm",
    ]  # fmt: skip
    subprocess.run(command, check=True)
    lib = ctypes.CDLL(str(library))
    i64, ptr, int_ = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    for matmul, workspace in KERNELS.values():
        getattr(lib, matmul).argtypes = [int_, ptr, i64, i64, ptr, i64, ptr, ptr, i64, int_]
        getattr(lib, workspace).argtypes = [i64, i64, int_]
        getattr(lib, workspace).restype = i64
    return lib


def caller(lib: ctypes.CDLL, name: str, kind: int, out: int, x: torch.Tensor, threads: int):
    rows, n = x.shape
    matmul, workspace_bytes = KERNELS[name]
    nbytes = getattr(lib, workspace_bytes)(n, rows, threads)
    workspace = torch.empty(nbytes, dtype=torch.uint8)
    y = torch.empty(rows, out)
    fn = getattr(lib, matmul)

    def call(tiles: torch.Tensor) -> torch.Tensor:
        status = fn(
            kind, tiles.data_ptr(), out, n, x.data_ptr(), rows, y.data_ptr(),
            workspace.data_ptr(), nbytes, threads,
        )  # fmt: skip
        if status:
            raise RuntimeError(f"{name} kernel: status {status}")
        return y

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K"])
    parser.add_argument("--shape", nargs="+", default=["2048x8192", "8192x2048"], help="OUTxIN")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 32])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--cache-mb", type=int, default=96, help="weight copies to cover")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        lib = build_probe(Path(tmp))
        for type_name in args.types:
            for shape in args.shape:
                out, n = (int(v) for v in shape.split("x"))
                rows_read = read_kquant_rows(type_name, random_blocks(type_name, out, n, 1), n)
                tiles = torch.from_numpy(rows_read.tiled())
                weights = torch.from_numpy(rows_read.dequantize()).double()
                copies = [tiles] + [
                    tiles.clone() for _ in range(int(args.cache_mb * 1e6 / tiles.numel()))
                ]
                for count in args.rows:
                    x = torch.randn(count, n, generator=torch.Generator().manual_seed(count))
                    exact = x.double() @ weights.T
                    scale = exact.abs().mean().item()
                    calls = {
                        name: caller(lib, name, rows_read.kind, out, x, args.threads)
                        for name in KERNELS
                    }
                    row = {"type": type_name, "shape": shape, "rows": count}
                    for name, call in calls.items():
                        err = (call(tiles).double() - exact).abs()
                        row[f"{name}_err_mean_rel"] = err.mean().item() / scale
                        row[f"{name}_err_max_rel"] = err.max().item() / scale
                        for copy in copies:
                            call(copy)
                    times = {name: [] for name in calls}
                    for i in range(args.calls):
                        copy = copies[i % len(copies)]
                        for name, call in calls.items() if i % 2 else reversed(calls.items()):
                            start = time.perf_counter()
                            call(copy)
                            times[name].append(time.perf_counter() - start)
                    for name, ts in times.items():
                        row[f"{name}_min_s"] = min(ts)
                        row[f"{name}_median_s"] = statistics.median(ts)
                    for name in ("int8", "int8_256"):
                        row[f"int16_over_{name}"] = round(
                            statistics.median(
                                a / b for a, b in zip(times["int16"], times[name], strict=True)
                            ),
                            3,
                        )
                    results.append(row)
                    print(json.dumps(row), file=sys.stderr)
    record = provenance()
    record["command"] = shlex.join(sys.argv)  # this script, not the `nanollmserve` CLI
    print(json.dumps({"provenance": record, "threads": args.threads, "cache_mb": args.cache_mb,
                      "results": results}))  # fmt: skip  # fmt: skip


if __name__ == "__main__":
    main()

"""Times the K-quant kernel (`nls_kq_matmul` through `ops.kquant_matmul`) on random valid
weights, one JSON object on stdout: git rev, date, CPU, command, and per weight and row count
the min and median seconds of `--calls` calls and the weight's GB/s at the min (calls rotate
over copies of the weight that together exceed the last-level cache, `--cache-mb`; 0 times one
copy, from cache where it fits).

    PYTHONPATH=src .venv/bin/python scripts/kquant_kernel_bench.py [--rows 1 4 8 32]
    NANOLLMSERVE_CPU_ISA=avx2 PYTHONPATH=src .venv/bin/python scripts/kquant_kernel_bench.py

The library is chosen once per process: run each ISA level in its own process. To compare two
builds, run this from each worktree alternately and compare the ratios of the same run pair.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from nanollmserve.model.gguf_blocks import _block_rows
from nanollmserve.model.gguf_kquants import STORED, read_kquant_rows

HALF_FIELDS = {
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q4_0": (0,),
    "Q8_0": (0,),
}
LEGACY = {"Q4_0": (32, 18), "Q8_0": (32, 34)}
"""Legacy types, run on gguf_cpu.c's own kernel (`ops.gguf_matmul`) for comparison."""


def random_blocks(type_name: str, out: int, n: int, seed: int) -> np.ndarray:
    """uint8 [out, bytes]: random block bytes with finite small float16 fields."""
    rng = np.random.default_rng(seed)
    per_block, block_bytes = {**STORED, **LEGACY}[type_name]
    raw = rng.integers(0, 256, size=(out, n // per_block, block_bytes), dtype=np.uint8)
    for start in HALF_FIELDS[type_name]:
        halves = (rng.standard_normal((out, n // per_block)) * 0.01).astype(np.float16)
        raw[..., start : start + 2] = halves[..., None].view(np.uint8)
    return raw.reshape(out, -1)


def shell(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
    except OSError:
        return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--types", nargs="+", default=["Q4_K", "Q6_K"], help="also Q4_0, Q8_0 (legacy)"
    )
    parser.add_argument("--shape", nargs="+", default=["2048x8192", "8192x2048"], help="OUTxIN")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 32])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument(
        "--cache-mb", type=int, default=96, help="rotate weight copies to cover this many MB"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from nanollmserve.native import ops

    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in shell("lscpu").splitlines() if "Model name" in ln),
        "",
    )
    results = []
    for type_name in args.types:
        for shape in args.shape:
            out, n = (int(v) for v in shape.split("x"))
            raw = random_blocks(type_name, out, n, seed=1)
            if type_name in LEGACY:
                legacy = _block_rows(raw, type_name)
                tiles, bits, kind = legacy.tiled(), 4, legacy.kind

                def run(w, x, kind=kind, out=out):
                    return ops.gguf_matmul(kind, w, out, x, None)
            else:
                rows = read_kquant_rows(type_name, raw, n)
                tiles, bits, kind = torch.from_numpy(rows.tiled()), rows.bits, rows.kind

                def run(w, x, kind=kind, out=out):
                    return ops.kquant_matmul(kind, w, out, x)

            gbytes = tiles.numel() / 1e9
            copies = [tiles] + [tiles.clone() for _ in range(int(args.cache_mb / 1e3 / gbytes))]
            for count in args.rows:
                x = torch.randn(count, n, generator=torch.Generator().manual_seed(count))
                for copy in copies:
                    run(copy, x)
                times = []
                for call in range(args.calls):
                    copy = copies[call % len(copies)]
                    start = time.perf_counter()
                    run(copy, x)
                    times.append(time.perf_counter() - start)
                results.append({
                    "type": type_name, "shape": shape, "rows": count, "bits": bits, "kind": kind,
                    "bits_per_weight": round(tiles.numel() * 8 / (out * n), 4),
                    "min_s": min(times), "median_s": statistics.median(times),
                    "gb_per_s": round(gbytes / min(times), 2),
                })  # fmt: skip
    print(json.dumps({
        "git_rev": shell("git", "rev-parse", "--short", "HEAD").strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu, "isa": os.environ.get("NANOLLMSERVE_CPU_ISA", "auto"),
        "threads": torch.get_num_threads(), "cache_mb": args.cache_mb, "command": sys.argv,
        "results": results,
    }))  # fmt: skip


if __name__ == "__main__":
    main()

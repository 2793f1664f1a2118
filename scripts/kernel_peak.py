"""How close the block products run to the multiply-add instruction they are built on.

    .venv/bin/python scripts/kernel_peak.py [--rows 1,5,32,512] [--repeats 5]
        [--output FILE]

For each ISA level this CPU runs (`avx2`, `avx512`, `amx`; the library of each is forced
with NANOLLMSERVE_CPU_ISA in a process of its own), on one thread:

- the peak: a C loop of independent multiply-adds of the instruction the level's vector
  kernel uses (`avx2`: `vpmaddwd` + `vpaddd` on ymm, 16 int16 products each;
  `avx512`/`amx`: `vpdpwssd` on zmm, 32), built here from `scripts/kernel_peak.c` with the
  library's compiler and flags, in GMAC/s; for `amx` also `tdpbssd` (16 x 16 x 64 int8
  products);
- the kernel: `ops.gguf_matmul` of a Q4_1 gate/up projection of the bundled model's shape
  (3072 x 576) at each row count, in GMAC/s (median of the repeats), and its share of the
  vector peak. `gguf_matmul` runs the accumulator kernel (`tile_block_rows`) below
  AMX_MIN_ROWS and, in the `amx` library, AMX tiles from there; the decode step's few-row
  kernel (a verify step's rows) is not this one.

A kernel near 100% of its instruction's peak cannot get faster without fewer instructions
per product (int8 activations do twice the products an instruction; decision 35 keeps them
out). Prints one JSON object with provenance.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

PEAK_SOURCE = Path(__file__).with_suffix(".c")


def peak(level: str) -> dict:
    """The level's multiply-add peak on one thread (`scripts/kernel_peak.c`, built with the
    compiler and ISA flags of the level's library, as an executable)."""
    from nanollmserve.native import build

    flags = [flag for flag in build.build_flags(level) if flag != "-shared"]
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "peak"
        subprocess.run([build._compiler(), *flags, str(PEAK_SOURCE), "-o", str(binary)], check=True)
        run = subprocess.run([str(binary)], check=True, capture_output=True, text=True)
    return json.loads(run.stdout)


def kernel(rows: list[int], repeats: int) -> dict:
    """GMAC/s of this process's library (one thread) on a random Q4_1 3072 x 576 tiling."""
    import time

    import torch

    from nanollmserve.native import build, ops
    from nanollmserve.native.abi import BLOCK_SIZE, KIND_Q4, TILE_BLOCK_BYTES, TILE_OUTPUTS

    torch.set_num_threads(1)
    out_features, in_features = 3072, 576
    kind = KIND_Q4
    tile_bytes = TILE_BLOCK_BYTES[kind]
    shape = (out_features // TILE_OUTPUTS, in_features // BLOCK_SIZE, tile_bytes)
    tiles = torch.randint(0, 256, shape, dtype=torch.uint8)
    scales = torch.full((tiles.shape[0], tiles.shape[1], 32), 0.01, dtype=torch.float16)
    tiles[:, :, 256:] = scales.view(torch.uint8)  # d and m of each output: finite, not denormal
    found = {}
    for n in rows:
        x = torch.randn(n, in_features)
        ops.gguf_matmul(kind, tiles, out_features, x, None)  # warm-up: workspace, caches
        calls = max(1, 2000 // n)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                ops.gguf_matmul(kind, tiles, out_features, x, None)
            times.append((time.perf_counter() - start) / calls)
        times.sort()
        found[n] = round(n * out_features * in_features / times[len(times) // 2] / 1e9, 2)
    return {"isa": build.isa_level(), "kernel_gmac_s": found}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,5,32,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output")
    parser.add_argument("--kernel-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows = [int(n) for n in args.rows.split(",")]
    if args.kernel_only:
        print(json.dumps(kernel(rows, args.repeats)))
        return 0

    from nanollmserve.bench.provenance import provenance
    from nanollmserve.native import build

    flags = set(build._cpu_flags())
    levels = [level for level, (_, needs) in build.ISA_LEVELS.items() if set(needs) <= flags]
    report = {"levels": {}}
    for level in levels:
        env = {**os.environ, build.ISA_ENV: level, "OMP_NUM_THREADS": "1"}
        run = subprocess.run(
            [sys.executable, __file__, "--kernel-only", "--rows", args.rows,
             "--repeats", str(args.repeats)],
            check=True, capture_output=True, text=True, env=env,
        )  # fmt: skip
        measured = json.loads(run.stdout.strip().splitlines()[-1])
        top = peak(level)
        measured["peak"] = top
        measured["kernel_share_of_vector_peak"] = {
            n: round(v / top["gmac_s"], 3) for n, v in measured["kernel_gmac_s"].items()
        }
        report["levels"][level] = measured
    report["provenance"] = provenance() | {
        "command": shlex.join([".venv/bin/python", "scripts/kernel_peak.py", *sys.argv[1:]])
    }
    text = json.dumps(report, indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

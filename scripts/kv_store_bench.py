"""Measure the shared KV block store, the transport of prefill/decode disaggregation: how long
a 1,000-token prompt's blocks take to be written (serialized, written under a temporary
name, renamed into place, by the store's writer thread) and read back (read, checksummed,
parsed), and the bytes/s of each. One JSON object on stdout.

    .venv/bin/python scripts/kv_store_bench.py [--dir /dev/shm] [--repeats 5]

The layout defaults to the bundled model's (SmolLM2-135M: 30 layers, 3 KV heads of 64,
float32, blocks of 16 tokens); the K/V bytes are random (the store never looks at them).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nanollmserve.engine.kv_block_format import KVBlockHeader, KVLayout, deserialize_block
from nanollmserve.engine.kv_block_store import KVBlockStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir", default=None, help="where the (removed afterwards) store goes (default /dev/shm)"
    )
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="kvbench-", dir=args.dir or _default_parent()))
    layout = KVLayout(
        "bench", args.layers, args.kv_heads, args.head_dim, "float32", args.block_size
    )
    num_blocks = args.tokens // args.block_size
    writes, reads = [], []
    for repeat in range(args.repeats):
        directory = base / str(repeat)
        store = KVBlockStore(directory, 1 << 34)
        blocks = [_block(layout, repeat, i) for i in range(num_blocks)]
        started = time.perf_counter()
        for name, header, kv in blocks:
            store.reserve(name, layout.block_bytes)
            store.put(name, header, kv)
        store.when_written([name for name, _, _ in blocks]).result()
        writes.append(time.perf_counter() - started)
        reader = KVBlockStore(directory, 1 << 34)  # another process's view: a fresh index
        started = time.perf_counter()
        for name, _, _ in blocks:
            deserialize_block(reader.read(name), reader.key)
        reads.append(time.perf_counter() - started)
        store.close()
        reader.close()
    num_bytes = sum(p.stat().st_size for p in (base / "0").glob("*/*.kvb"))
    shutil.rmtree(base, ignore_errors=True)
    write_s, read_s = statistics.median(writes), statistics.median(reads)
    print(
        json.dumps(
            {
                "directory": str(base),
                "tokens": args.tokens,
                "blocks": num_blocks,
                "bytes": num_bytes,
                "write_latency_ms": round(write_s * 1e3, 2),
                "read_latency_ms": round(read_s * 1e3, 2),
                "write_MB_per_s": round(num_bytes / write_s / 1e6, 1),
                "read_MB_per_s": round(num_bytes / read_s / 1e6, 1),
                "repeats": args.repeats,
            },
            indent=2,
        )
    )


def _default_parent() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None


def _block(layout: KVLayout, repeat: int, index: int):
    name = f"{repeat:04x}{index:028x}"
    token_ids = tuple(range(index * layout.block_size, (index + 1) * layout.block_size))
    header = KVBlockHeader(layout, token_ids, name, "0" * 32)
    return name, header, torch.randn(layout.block_shape)


if __name__ == "__main__":
    main()

"""Measure both transports of prefill/decode disaggregation's KV blocks for 1k- and 4k-token
prompts: the shared store (`--kv-transfer store`, a directory on /dev/shm) and Ray's object
store (`--kv-transfer ray`) between two Ray nodes. One JSON object on stdout (with
`provenance`).

    .venv/bin/python scripts/kv_transfer_bench.py [--tokens 1000 4000] [--repeats 5]

What each transport adds to the time to first token, per prompt (median of the repeats):

- store: the prefill worker's write of the prompt's blocks (serialized, MAC'd, written and
  renamed by the store's writer thread; phase 1 answers after it) plus the decode worker's
  read and check of them (`deserialize_block`, as its prefix lookup does).
- ray: the same write to the prefill worker's own store, then `RayKVTransfer.send` (the
  files read back, one `ray.put` each, the list signed) in this process, then, in a Ray
  actor pinned to another node with its own store and the same key, `receive` (every object
  fetched across nodes and staged) and the same read and check.

MB/s is the prompt's block bytes over the transfer's own time (store: write + read; ray:
send + receive). By default the Ray nodes are simulated on this machine
(`ray.cluster_utils.Cluster`, a head without CPUs and two one-CPU nodes; this process is a
driver attached to the head node, the receiver an actor on another node), so "across
nodes" is two raylets' object stores talking over the loopback interface. The layout is the
bundled model's (30 layers, 3 KV heads of 64, float32, blocks of 16 tokens: 0.74 MB a
block); the K/V bytes are random.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from nanollmserve.bench.provenance import provenance
from nanollmserve.engine.kv_block_format import KVBlockHeader, KVLayout, deserialize_block
from nanollmserve.engine.kv_block_store import KVBlockStore
from nanollmserve.kv_store_dir import KEY_FILE, open_store_dir, write_private

LAYOUT = KVLayout("bench", 30, 3, 64, "float32", 16)


def _store(key: bytes) -> KVBlockStore:
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    path = open_store_dir(tempfile.mkdtemp(prefix="kvtbench-", dir=shm))
    write_private(path, KEY_FILE, key.hex().encode() + b"\n")
    return KVBlockStore(path, 1 << 34)


def _blocks(tag: int, count: int):
    blocks = []
    for index in range(count):
        name = f"{tag:04x}{index:028x}"
        tokens = tuple(range(index * LAYOUT.block_size, (index + 1) * LAYOUT.block_size))
        header = KVBlockHeader(LAYOUT, tokens, name, "0" * 32)
        blocks.append((name, header, torch.randn(LAYOUT.block_shape)))
    return blocks


def _write(store: KVBlockStore, blocks) -> float:
    started = time.perf_counter()
    for name, header, kv in blocks:
        store.reserve(name, LAYOUT.block_bytes)
        store.put(name, header, kv)
    store.when_written([name for name, _, _ in blocks]).result()
    return time.perf_counter() - started


def _read(store: KVBlockStore, names) -> float:
    started = time.perf_counter()
    for name in names:
        data = store.read(name)
        assert data is not None, name
        deserialize_block(data, store.key)
    return time.perf_counter() - started


class Receiver:
    """The decode side, a Ray actor on another node: its own store with the same key."""

    def __init__(self, key: bytes) -> None:
        from nanollmserve.engine.kv_ray_transfer import RayKVTransfer

        self.store = _store(key)
        self.transfer = RayKVTransfer(self.store, fetch_timeout=120.0)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def receive(self, handle: dict) -> tuple[int, float, float]:
        started = time.perf_counter()
        staged = self.transfer.receive(handle)
        fetched = time.perf_counter() - started
        names = [name for name, _, _ in handle["blocks"]]
        return staged, fetched, _read(self.store, names)

    def close(self) -> None:
        self.store.close()
        shutil.rmtree(self.store.directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--ray-address", default=None, help="an existing Ray cluster (default: simulate two nodes)"
    )
    args = parser.parse_args()
    import secrets

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from nanollmserve.engine.kv_ray_transfer import RayKVTransfer

    nodes = None
    if args.ray_address is None:
        from ray.cluster_utils import Cluster

        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        nodes.add_node(num_cpus=1, resources={"node_a": 1})
        remote = nodes.add_node(num_cpus=1, resources={"node_b": 1})
        nodes.wait_for_nodes()
        address, remote_id = nodes.address, remote.node_id
    else:
        address, remote_id = args.ray_address, None
    ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    here = ray.get_runtime_context().get_node_id()
    if remote_id is None:
        others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
        remote_id = others[0]
    key = secrets.token_bytes(32)
    receiver = (
        ray.remote(Receiver)
        .options(num_cpus=1, scheduling_strategy=NodeAffinitySchedulingStrategy(remote_id, False))
        .remote(key)
    )
    assert ray.get(receiver.node_id.remote()) != here
    results = []
    tag = 0
    try:
        for tokens in args.tokens:
            count = tokens // LAYOUT.block_size
            store_times, ray_times = [], []
            for _ in range(args.repeats):
                tag += 1
                # store: the prefill worker writes, the decode worker reads the same directory
                sender = _store(key)
                blocks = _blocks(tag, count)
                names = [name for name, _, _ in blocks]
                write = _write(sender, blocks)
                reader = KVBlockStore(sender.directory, 1 << 34)  # another process's view
                read = _read(reader, names)
                store_times.append((write, read))
                reader.close()
                # ray: the prefill worker's own store, then the objects to another node
                tag += 1
                blocks = _blocks(tag, count)
                names = [name for name, _, _ in blocks]
                write = _write(sender, blocks)
                transfer = RayKVTransfer(sender, hold_seconds=600.0)
                started = time.perf_counter()
                handle = transfer.send(names)
                send = time.perf_counter() - started
                staged, fetch, read = ray.get(receiver.receive.remote(handle))
                assert staged == count, (staged, count)
                ray_times.append((write, send, fetch, read))
                transfer._held.clear()  # free the objects before the next repeat
                num_bytes = sum(sender.path(name).stat().st_size for name in names)
                sender.close()
                shutil.rmtree(sender.directory, ignore_errors=True)
            write, read = (statistics.median(t[i] for t in store_times) for i in range(2))
            r_write, send, fetch, r_read = (
                statistics.median(t[i] for t in ray_times) for i in range(4)
            )
            results.append(
                {
                    "tokens": tokens,
                    "blocks": count,
                    "bytes": num_bytes,
                    "store": {
                        "write_ms": round(write * 1e3, 1),
                        "read_ms": round(read * 1e3, 1),
                        "ttft_added_ms": round((write + read) * 1e3, 1),
                        "MB_per_s": round(num_bytes / (write + read) / 1e6, 1),
                    },
                    "ray": {
                        "write_ms": round(r_write * 1e3, 1),
                        "send_ms": round(send * 1e3, 1),
                        "fetch_ms": round(fetch * 1e3, 1),
                        "read_ms": round(r_read * 1e3, 1),
                        "ttft_added_ms": round((r_write + send + fetch + r_read) * 1e3, 1),
                        "MB_per_s": round(num_bytes / (send + fetch) / 1e6, 1),
                    },
                }
            )
    finally:
        ray.get(receiver.close.remote())
        ray.shutdown()
        if nodes is not None:
            nodes.shutdown()
    record = {
        "benchmark": "kv_transfer",
        "simulated_nodes": args.ray_address is None,
        "repeats": args.repeats,
        "results": results,
        "provenance": provenance(),
    }
    command = [".venv/bin/python", "scripts/kv_transfer_bench.py", *sys.argv[1:]]
    record["provenance"]["command"] = shlex.join(command)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()

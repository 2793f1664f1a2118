"""The workers of a disaggregated cluster (`cluster --prefill-workers P --decode-workers D`):
P workers with `--kv-role prefill`, then D with `--kv-role decode`, all pointed at one
`--kv-offload-dir`, the store through which prefill workers hand KV blocks to decode workers.

Without a `--kv-offload-dir` among the serve flags, the store is a fresh directory under
/dev/shm (memory: the shared-memory transport on one host; the temp directory where there
is no /dev/shm), made before the workers start and removed when the cluster stops. A
directory the user gives is kept. Ray across machines needs one given: every node must see
the same directory (a shared file system), which this cannot make.

With `--kv-transfer ray` (or `auto` on a Ray cluster of several hosts and no
`--kv-offload-dir`) there is no shared directory: each worker actor makes its own private
store on its node, all with one MAC key the launcher makes (`ray_key`, given to the actors),
and the blocks travel through Ray's object store (`engine/kv_ray_transfer.py`).

Either way the launcher opens the store before any worker starts (`kv_block_store`: a
private directory, 0700, marked as a store; a directory another user owns or could write,
or a non-empty one that is not a store, stops the cluster with the reason) and creates its
one MAC key (`store_key`: a 0600 file in the store, made exclusively). The workers are given
the store's path and read that key from it, so every prefill and decode worker signs and
checks blocks with the same key, and a block no worker wrote is never loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nanollmserve.errors import UserError

SHM_DIR = Path("/dev/shm")
STORE_PREFIX = "nanollmserve-kv-"


@dataclass
class Roles:
    num_prefill: int
    num_decode: int
    given_store: str | None
    """The user's --kv-offload-dir (already among the serve flags), or None."""
    transfer: str = "store"
    """store | ray | auto (resolved by `resolve` once the launcher knows the hosts)."""
    ray_key: bytes | None = None
    """--kv-transfer ray: the MAC key every worker's own store gets."""

    def resolve(self, ray_hosts: int | None) -> None:
        """Settle `auto`: the shared store on one host (local workers, a Ray cluster on one
        host, or a directory the user gave), Ray's object store across hosts."""
        if self.transfer == "auto":
            several = ray_hosts is not None and ray_hosts > 1 and self.given_store is None
            self.transfer = "ray" if several else "store"
        if self.transfer == "ray":
            import secrets

            from nanollmserve.kv_store_dir import KEY_BYTES

            self.ray_key = secrets.token_bytes(KEY_BYTES)

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode

    @contextlib.contextmanager
    def shared_store(self) -> Iterator[list[list[str]]]:
        """The serve flags each worker adds to the common ones (prefill workers first), with
        the store they share made for the time of the block (unless the user gave one)."""
        from nanollmserve.kv_store_dir import open_store_dir, store_key

        roles = ["prefill"] * self.num_prefill + ["decode"] * self.num_decode
        if self.transfer == "ray":  # each actor makes its own store (RayWorkers)
            yield [["--kv-role", role, "--kv-transfer", "ray"] for role in roles]
            return
        made = None
        if self.given_store is None:
            made = tempfile.mkdtemp(prefix=STORE_PREFIX, dir=SHM_DIR if SHM_DIR.is_dir() else None)
        try:
            store_key(open_store_dir(made or self.given_store))  # the workers' shared key
        except BaseException:
            if made is not None:
                shutil.rmtree(made, ignore_errors=True)
            raise
        store = [] if made is None else ["--kv-offload-dir", made]
        try:
            yield [["--kv-role", role, *store] for role in roles]
        finally:
            if made is not None:
                shutil.rmtree(made, ignore_errors=True)


def disaggregated_roles(args: argparse.Namespace, serve_args: list[str]) -> Roles | None:
    """The roles `--prefill-workers` / `--decode-workers` ask for (None without them), after
    checking they go together, without --workers, with --policy pd (or none)."""
    prefill, decode = args.prefill_workers, args.decode_workers
    if prefill is None and decode is None:
        return None
    if prefill is None or decode is None:
        raise UserError("--prefill-workers and --decode-workers go together: give both")
    if args.workers is not None:
        raise UserError(
            "--workers and --prefill-workers/--decode-workers are exclusive: give one or the other"
        )
    if prefill < 1 or decode < 1:
        raise UserError(
            f"--prefill-workers and --decode-workers must be >= 1, got {prefill} and {decode}"
        )
    if args.policy not in (None, "pd"):
        raise UserError(
            f"--prefill-workers/--decode-workers run the router's --policy pd, not {args.policy}"
        )
    store_dir = serve_flag_value(serve_args, "--kv-offload-dir")
    transfer = args.kv_transfer
    if transfer == "ray" and args.ray_address is None:
        raise UserError("--kv-transfer ray needs --ray-address (the workers as Ray actors)")
    if transfer == "ray" and store_dir is not None:
        raise UserError(
            "--kv-transfer ray gives each worker its own store: leave --kv-offload-dir out"
        )
    if transfer == "store" and store_dir is None and args.ray_address not in (None, "local"):
        raise UserError(
            "--prefill-workers with --ray-address and --kv-transfer store needs "
            "--kv-offload-dir DIR, a directory every node sees (the workers hand KV blocks "
            "over through it); or --kv-transfer ray"
        )
    return Roles(prefill, decode, store_dir, transfer)


def serve_flag_value(serve_args: list[str], name: str) -> str | None:
    """The value of serve flag `name` (`--flag V` or `--flag=V`; the last one wins, as in
    argparse), or None when it is not given."""
    value = None
    for i, arg in enumerate(serve_args):
        if arg == name and i + 1 < len(serve_args):
            value = serve_args[i + 1]
        elif arg.startswith(f"{name}="):
            value = arg.split("=", 1)[1]
    return value

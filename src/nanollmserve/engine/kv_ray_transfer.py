"""KV blocks between prefill and decode workers through Ray's object store (`serve --kv-transfer
ray`), for workers on different hosts that share no directory.

Each worker keeps its own private `--kv-offload-dir` store (the prefill worker's engine writes
a prompt's blocks there as usual, the decode worker's engine reads them from there), and both
hold the same MAC key (the cluster gives it to every worker). Between the two:

- Phase 1 (`send`, the prefill worker): once the prompt's blocks are on its disk, each
  block's bytes (the serialized, MAC'd `kv_block_format`, unchanged) are `ray.put` as one
  object. The answer's `kv_transfer_params.ray_blocks` names them: `{"blocks": [[block name,
  object id hex, owner address base64], ...], "mac": hex}`, the list authenticated with the
  store key, so a decode worker fetches only objects a holder of the key listed (a client
  that reaches a worker directly cannot make it fetch anything else, or contact another
  address).
- Phase 2 (`receive`, the decode worker): the objects are fetched with one deadline
  (`fetch_timeout`) and staged, in order, in the store's in-memory inbox
  (`KVBlockStore.stage`) until the first that is missing, freed or late; the engine's prefix
  lookup then loads them like its own files, checking each block's MAC, layout fingerprint
  and tokens (a block that fails is refused, its tokens computed again). Nothing waits longer
  than the deadline: what did not arrive is recomputed.

Lifetime: the prefill worker owns the objects (Ray frees an object when its owner drops the
last reference; the decode worker borrows by id, unknown to Ray's reference counting, so it
cannot keep one alive). The prefill worker holds each request's references for
`hold_seconds` after its phase-1 answer, and at most `max_bytes` of them (oldest freed first):
Ray's object store holds at most that much for one prefill worker, whatever the decode side
does. A decode worker that fetches after that finds the object freed: a miss, recomputed.
The inbox is bounded the same way on the decode side (`KVBlockStore.MAX_STAGED_BYTES`,
entries older than `STAGED_TTL_S` dropped).

Trust: anyone who can run code on the Ray cluster can read and write its objects (Ray has no
per-object access control); the MAC keeps a block no key holder wrote from being loaded, but
not a block's K/V (and the prompt's token ids in its header) from being read by such a party.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import logging
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from nanollmserve.engine.kv_block_store import KVBlockStore
from nanollmserve.errors import UserError

logger = logging.getLogger(__name__)

DEFAULT_HOLD_S = 120.0
DEFAULT_FETCH_TIMEOUT_S = 10.0


def connect(address: str | None) -> None:
    """Join the Ray cluster at `address` (None: `RAY_ADDRESS`, else the one `ray start` made
    here) as a driver, keeping this process's SIGTERM handler (ray.init replaces it; the
    server's graceful drain needs its own)."""
    try:
        import ray
    except ImportError:
        raise UserError(
            "--kv-transfer ray needs Ray: pip install 'nanollmserve[cluster]'"
        ) from None
    if ray.is_initialized():
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(
            address=address or "auto",
            logging_level="WARNING",
            log_to_driver=False,
            include_dashboard=False,
        )
    except ConnectionError as exc:
        raise UserError(f"--kv-transfer ray: cannot join the Ray cluster: {exc}") from None
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


class RayKVTransfer:
    def __init__(
        self,
        store: KVBlockStore,
        hold_seconds: float = DEFAULT_HOLD_S,
        fetch_timeout: float = DEFAULT_FETCH_TIMEOUT_S,
        max_bytes: int | None = None,
    ) -> None:
        import ray

        self.ray = ray
        self.store = store
        self.key = store.key
        self.hold_seconds = hold_seconds
        self.fetch_timeout = fetch_timeout
        self.max_bytes = store.max_bytes if max_bytes is None else max_bytes
        self._lock = threading.Lock()
        self._held: OrderedDict[int, tuple[float, int, list]] = OrderedDict()
        """Send number -> (when it may be freed, bytes, its ObjectRefs), oldest first."""
        self._held_bytes = 0
        self._sends = 0
        self.num_sent = 0
        self.num_received = 0
        self.num_missed = 0
        """Blocks a phase 2 named that were freed, lost or late: recomputed."""

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    # -- phase 1: the prefill worker ---------------------------------------------------------
    def send(self, names: Sequence[str]) -> dict | None:
        """Put the store's blocks `names` (in order, up to the first the store lacks) into
        Ray's object store -> the authenticated handle phase 2 carries (None: no block)."""
        core = self.ray._private.worker.global_worker.core_worker
        import numpy as np

        refs, entries, size = [], [], 0
        for name in names:
            data = self.store.read(name)
            if data is None:
                break
            ref = self.ray.put(np.frombuffer(data, dtype=np.uint8))
            _, owner, _ = core.serialize_object_ref(ref)
            refs.append(ref)
            entries.append([name, ref.hex(), base64.b64encode(owner).decode()])
            size += len(data)
        self._release()
        if not refs:
            return None
        with self._lock:
            self._sends += 1
            self._held[self._sends] = (time.monotonic() + self.hold_seconds, size, refs)
            self._held_bytes += size
            self.num_sent += len(refs)
        self._release()
        return {"blocks": entries, "mac": _mac(self.key, entries)}

    def _release(self) -> None:
        """Drop the references past their hold time, and the oldest past `max_bytes` (Ray
        frees an object once its owner holds no reference)."""
        now = time.monotonic()
        with self._lock:
            while self._held:
                number, (until, size, _) = next(iter(self._held.items()))
                if until > now and self._held_bytes <= self.max_bytes:
                    break
                del self._held[number]
                self._held_bytes -= size

    # -- phase 2: the decode worker ----------------------------------------------------------
    def receive(self, handle: dict) -> int:
        """Fetch a phase-1 handle's blocks (at most `fetch_timeout` seconds in all) and stage
        them, in order, until the first that is missing or late -> how many were staged.
        A handle whose MAC fails stages nothing. Any thread."""
        entries = handle.get("blocks") if isinstance(handle, dict) else None
        mac = handle.get("mac") if isinstance(handle, dict) else None
        if not isinstance(entries, list) or not isinstance(mac, str):
            return 0
        if not hmac.compare_digest(_mac(self.key, entries), mac):
            logger.warning("KV over Ray: refusing a block list not signed with the store key")
            return 0
        try:
            refs = [self._ref(object_id, owner) for _, object_id, owner in entries]
        except (ValueError, TypeError) as exc:
            logger.warning("KV over Ray: unreadable block list: %s", exc)
            return 0
        deadline = time.monotonic() + self.fetch_timeout
        staged = 0
        for (name, _, _), ref in zip(entries, refs, strict=True):
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError("the fetch deadline passed")
                value = self.ray.get(ref, timeout=left)
            except Exception as exc:  # noqa: BLE001 (freed, lost, owner gone, late: recompute)
                logger.warning(
                    "KV over Ray: block %d of %d not fetched (%s): recomputed",
                    staged + 1,
                    len(entries),
                    type(exc).__name__,
                )
                break
            self.store.stage(name, bytearray(memoryview(value)))
            staged += 1
        with self._lock:
            self.num_received += staged
            self.num_missed += len(entries) - staged
        return staged

    def _ref(self, object_id: str, owner: str):
        core = self.ray._private.worker.global_worker.core_worker
        owner_address = base64.b64decode(owner, validate=True)
        ref = self.ray.ObjectRef(bytes.fromhex(object_id), owner_address, "")
        core.deserialize_and_register_object_ref(
            ref.binary(), self.ray.ObjectRef.nil(), owner_address, b""
        )
        return ref

    def close(self) -> None:
        with self._lock:
            self._held.clear()
            self._held_bytes = 0
        with contextlib.suppress(Exception):
            self.ray.shutdown()


def _mac(key: bytes, entries: list) -> str:
    text = json.dumps(entries, separators=(",", ":"), sort_keys=True).encode()
    return hmac.new(key, b"nanollmserve-kv-ray-blocks\0" + text, hashlib.sha256).hexdigest()

"""KV blocks over Ray (m32, issue 43), the parts that need no Ray cluster: the store's inbox
of fetched blocks (bounded, expiring, taken out by the read), the phase-2 field's
`ray_blocks` shape checks, the router carrying it, and the decode side's fetch (a stand-in
for Ray): a list not signed with the store key fetches nothing, a block that does not arrive
by the deadline stops the staging there (the rest is recomputed); `--workers-per-node`
placement and `--kv-transfer auto`'s choice. The multi-node run is
tests/test_cluster_ray_pd.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from nanollmserve.engine import kv_block_store
from nanollmserve.engine.kv_block_store import KVBlockStore
from nanollmserve.errors import ParamError, UserError
from nanollmserve.kv_transfer import KVTransferParams
from nanollmserve.router.pd import transfer_params

pytestmark = pytest.mark.milestone("m32")

pytest.importorskip("ray")
from nanollmserve.engine.kv_ray_transfer import RayKVTransfer, _mac  # noqa: E402


def _phase_two(**extra) -> dict:
    return {
        "do_remote_prefill": True,
        "remote_tokens": 32,
        "remote_blocks": 2,
        "first_token_id": 7,
        **extra,
    }


def test_a_staged_block_is_found_read_once_and_bounded(tmp_path, monkeypatch) -> None:
    store = KVBlockStore(tmp_path / "store", 1 << 20)
    try:
        store.stage("ab" * 8, bytearray(b"x" * 100))
        assert store.contains("ab" * 8) and store.num_stored(["ab" * 8, "cd" * 8]) == 1
        assert store.read("ab" * 8) == bytearray(b"x" * 100)
        assert not store.contains("ab" * 8) and store.num_staged_bytes == 0  # taken out
        monkeypatch.setattr(kv_block_store, "MAX_STAGED_BYTES", 250)
        for name in ("01" * 8, "02" * 8, "03" * 8):
            store.stage(name, b"y" * 100)
        assert not store.contains("01" * 8) and store.num_staged_bytes == 200  # oldest out
        store.discard("02" * 8)
        assert not store.contains("02" * 8) and store.read("03" * 8) == bytearray(b"y" * 100)
        monkeypatch.setattr(kv_block_store, "STAGED_TTL_S", 0.0)
        store.stage("04" * 8, b"z")
        time.sleep(0.01)
        assert store.read("04" * 8) is None  # expired
    finally:
        store.close()


def test_ray_blocks_in_phase_two_are_checked() -> None:
    handle = {"blocks": [["ab" * 8, "ff" * 28, "b3duZXI="]], "mac": "0" * 64}
    params = KVTransferParams.from_value(_phase_two(ray_blocks=handle))
    assert params.ray_blocks == handle
    assert KVTransferParams.from_value(_phase_two(ray_blocks=None)).ray_blocks is None
    bad = [
        {"blocks": []},
        {"blocks": [], "mac": "short"},
        {"blocks": [["a", "b"]], "mac": "0" * 64},
        {"blocks": [["a", "b", 3]], "mac": "0" * 64},
        {"blocks": [["a", "b", "c"]] * 3, "mac": "0" * 64},  # more than remote_blocks
        "a string",
    ]
    for value in bad:
        with pytest.raises(ParamError) as error:
            KVTransferParams.from_value(_phase_two(ray_blocks=value))
        assert error.value.param == "kv_transfer_params"


def test_the_router_carries_ray_blocks_to_phase_two() -> None:
    handle = {"blocks": [], "mac": "0" * 64}
    answer = {"kv_transfer_params": {**_phase_two(ray_blocks=handle)}}
    carried = transfer_params(answer)
    assert carried == {
        "remote_tokens": 32,
        "remote_blocks": 2,
        "first_token_id": 7,
        "ray_blocks": handle,
    }
    answer["kv_transfer_params"]["ray_blocks"] = None  # the shared store's answer
    assert "ray_blocks" not in transfer_params(answer)


class _StandInRay:
    """What `receive` uses of Ray: refs made from ids, and a `get` with a timeout."""

    class ObjectRef:
        def __init__(self, binary: bytes, owner: bytes, call_site: str) -> None:
            self._binary = binary

        def binary(self) -> bytes:
            return self._binary

        @staticmethod
        def nil():
            return None

    def __init__(self, objects: dict[bytes, bytes], late: set[bytes]) -> None:
        self.objects, self.late = objects, late
        core = SimpleNamespace(deserialize_and_register_object_ref=lambda *args: None)
        self._private = SimpleNamespace(
            worker=SimpleNamespace(global_worker=SimpleNamespace(core_worker=core))
        )

    def get(self, ref, timeout: float):
        if ref.binary() in self.late:
            time.sleep(timeout)
            raise TimeoutError("late")
        return self.objects[ref.binary()]


def test_receive_stages_in_order_until_a_block_is_late_or_the_list_is_unsigned(
    tmp_path,
) -> None:
    store = KVBlockStore(tmp_path / "store", 1 << 20)
    try:
        transfer = RayKVTransfer(store, fetch_timeout=0.2)
        ids = [bytes([i]) * 28 for i in range(3)]
        entries = [[f"{i:02x}" * 8, ids[i].hex(), "b3duZXI="] for i in range(3)]
        transfer.ray = _StandInRay({ids[0]: b"zero", ids[2]: b"two"}, late={ids[1]})
        start = time.monotonic()
        assert transfer.receive({"blocks": entries, "mac": _mac(store.key, entries)}) == 1
        assert time.monotonic() - start < 2  # the deadline, not a wait forever
        assert store.read("00" * 8) == bytearray(b"zero") and not store.contains("02" * 8)
        assert (transfer.num_received, transfer.num_missed) == (1, 2)
        forged = {"blocks": entries, "mac": _mac(b"k" * 32, entries)}
        assert transfer.receive(forged) == 0 and not store.contains("00" * 8)
    finally:
        store.close()


def _node(node_id: str, address: str, cpus: float, gpus: float = 0, alive: bool = True):
    resources = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return {
        "NodeID": node_id,
        "NodeManagerAddress": address,
        "Alive": alive,
        "Resources": resources,
    }


def test_workers_per_node_places_by_node_affinity_in_address_order() -> None:
    from nanollmserve.cluster.ray_workers import node_placement, ray_hosts

    nodes = [
        _node("c", "10.0.0.3", 4),
        _node("head", "10.0.0.1", 0),  # no CPUs: no room
        _node("b", "10.0.0.2", 2),
        _node("a", "10.0.0.2", 1),  # room for one worker, not two
        _node("dead", "10.0.0.0", 8, alive=False),
    ]
    ray = SimpleNamespace(nodes=lambda: nodes)
    assert node_placement(ray, 2, 1, 1.0, 0.0) == ["a", "b"]
    assert node_placement(ray, 4, 2, 1.0, 0.0) == ["b", "b", "c", "c"]
    assert node_placement(ray, 3, 2, 1.0, 0.0) == ["b", "b", "c"]
    with pytest.raises(UserError, match="need 3 nodes"):
        node_placement(ray, 5, 2, 1.0, 0.0)
    with pytest.raises(UserError, match="need 1 nodes"):
        node_placement(ray, 1, 1, 1.0, 1.0)  # no node has a GPU
    with pytest.raises(UserError, match=">= 1"):
        node_placement(ray, 1, 0, 1.0, 0.0)
    assert ray_hosts(ray) == 3  # alive nodes' distinct addresses


def test_kv_transfer_auto_picks_ray_only_across_hosts_without_a_shared_directory() -> None:
    from nanollmserve.cluster.pd_roles import Roles

    for transfer, hosts, given, expected in [
        ("auto", None, None, "store"),  # local workers or ray local
        ("auto", 1, None, "store"),  # a Ray cluster on one host
        ("auto", 3, None, "ray"),
        ("auto", 3, "/shared/kv", "store"),  # a directory every node sees
        ("ray", 1, None, "ray"),  # forced (the tests)
        ("store", 3, "/shared/kv", "store"),
    ]:
        roles = Roles(1, 1, given, transfer)
        roles.resolve(hosts)
        assert roles.transfer == expected, (transfer, hosts, given)
        assert (roles.ray_key is not None) == (expected == "ray")
    roles = Roles(1, 2, None, "ray")
    roles.resolve(2)
    with roles.shared_store() as worker_args:  # no shared directory is made
        assert worker_args == [
            ["--kv-role", role, "--kv-transfer", "ray"] for role in ("prefill", "decode", "decode")
        ]
    assert len(roles.ray_key) == 32


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag", ["--kv-transfer-timeout", "--kv-transfer-hold-seconds"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1e300", "3601"])
def test_hostile_transfer_seconds_are_refused_before_the_model_loads(flag, value):
    import subprocess
    import sys

    command = [sys.executable, "-m", "nanollmserve.cli.main", "serve", "--kv-transfer", "ray"]
    result = subprocess.run([*command, flag, value], capture_output=True, text=True, timeout=100)
    assert result.returncode == 2, result.stdout + result.stderr
    message = result.stderr.strip().splitlines()
    assert len(message) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"{flag} must be a number of seconds in [0, 3600]" in message[0]

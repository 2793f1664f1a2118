"""Prefill/decode disaggregation across Ray nodes with the blocks moved through Ray's object
store (m32, issue 43): a Ray cluster of two worker nodes simulated on this machine
(`ray.cluster_utils.Cluster`, a head without CPUs and nodes with their own resources
{"node_a": 1} and {"node_b": 1}), `cluster --ray-address ADDR --kv-transfer ray
--workers-per-node 1`: the prefill worker on one node, the decode worker on the other, each
with its own private store (no shared directory), so every block crosses through Ray.

- Greedy output equals a single server's token for token, the decode worker's cached tokens
  coming from the prefill worker's blocks, with no fallback.
- `kill -9` of the prefill worker's server under concurrent requests: every request is
  answered; Ray restarts the actor on its node and it serves phase 1 again.
- Blocks lost in transit (the prefill worker frees its objects at once,
  `--kv-transfer-hold-seconds 0`): the decode worker's fetch fails fast, it recomputes the
  prompt, and the answer is still the single server's.

Slow (a Ray start, two cluster launches); skipped where Ray is not installed.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import httpx
import pytest
from cluster_process import (
    ClusterProcess,
    free_consecutive_ports,
    pid_listening_as_worker,
    wait_until,
)
from live_server import LiveServer, free_port

pytest.importorskip("ray")
pytestmark = [pytest.mark.milestone("m32"), pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, in a small workshop "
    "in a German town, where a goldsmith found a way to cast letters in metal, and then",
    "A recipe for bread needs flour, water, salt and yeast, a warm kitchen, a large bowl, a "
    "clean towel and some patience while the dough rises. First, you",
    "The mountain trail climbs through pine forest and over two wooden bridges to a cold "
    "green lake under the peak, where hikers often stop to rest and",
]
LOST = [f"Once upon a time, {text}" for text in PROMPTS]
MODEL_ARGS = ["--num-kv-blocks", "256", "--disable-log-requests"]
"""The bundled model (greedy text worth comparing), a small KV pool."""
GREEDY = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
GREEDY["return_token_ids"] = True
FALLBACKS = "nanollmserve_router:pd_prefill_fallbacks_total"


def _complete(url: str, prompt: str) -> dict:
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, **GREEDY}, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.fixture(scope="module")
def references() -> dict[str, list[int]]:
    server = LiveServer.start(*MODEL_ARGS)
    try:
        return {p: _complete(server.url, p)["choices"][0]["token_ids"] for p in PROMPTS + LOST}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def ray_nodes():
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    worker_nodes = [
        nodes.add_node(num_cpus=1, resources={"node_a": 1}),
        nodes.add_node(num_cpus=1, resources={"node_b": 1}),
    ]
    nodes.wait_for_nodes()
    try:
        yield nodes.address, {node.node_id for node in worker_nodes}
    finally:
        nodes.shutdown()


def _start(address: str, *serve_flags: str) -> ClusterProcess:
    base_port, router_port = free_consecutive_ports(2), free_port()
    cluster = ClusterProcess.start(
        "cluster", router_port, "--ray-address", address, "--prefill-workers", "1",
        "--decode-workers", "1", "--kv-transfer", "ray", "--workers-per-node", "1",
        "--base-port", str(base_port), "--router-port", str(router_port),
        "--health-interval", "0.5", "--shutdown-timeout", "5", *MODEL_ARGS, *serve_flags,
    )  # fmt: skip
    cluster.ports = (base_port, base_port + 1)
    return cluster


def _fallbacks(cluster: ClusterProcess) -> float:
    text = httpx.get(f"{cluster.url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(FALLBACKS))


def _store_of(port: int) -> str:
    pid = pid_listening_as_worker(port)
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return args[args.index(b"--kv-offload-dir") + 1].decode()


@pytest.fixture(scope="module")
def pd_cluster(ray_nodes):
    cluster = _start(ray_nodes[0])
    try:
        yield cluster
    except BaseException:
        print(cluster.log())
        raise
    finally:
        assert cluster.stop() == 0


def test_greedy_parity_with_blocks_through_ray_across_two_nodes(
    references, ray_nodes, pd_cluster
) -> None:
    cluster, (_, worker_node_ids) = pd_cluster, ray_nodes
    assert [w["kv_role"] for w in cluster.stats()["workers"]] == ["prefill", "decode"]
    placed = dict(re.findall(r"worker (\d) placed on node ([0-9a-f]+)", cluster.log()))
    assert set(placed) == {"0", "1"} and placed["0"] != placed["1"]
    assert set(placed.values()) == worker_node_ids  # one worker on each node
    prefill_store, decode_store = (_store_of(port) for port in cluster.ports)
    assert prefill_store != decode_store  # no shared directory: the blocks went by Ray
    for prompt in PROMPTS:
        answer = _complete(cluster.url, prompt)
        assert answer["choices"][0]["token_ids"] == references[prompt]
        # every full block but the one holding the last prompt token, which is recomputed
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16, prompt
    assert _fallbacks(cluster) == 0
    assert "KV over Ray" not in cluster.log()  # no block missed or refused


def test_a_killed_prefill_worker_leaves_no_request_unanswered(pd_cluster) -> None:
    """Four users send 16 requests; the prefill worker's server gets `kill -9` after the
    second answer. Every request is answered (the decode worker prefills what no prefill
    worker could, or recomputes blocks whose owner died); Ray restarts the actor on its node
    and it takes phase 1 again."""
    cluster = pd_cluster
    victim = pid_listening_as_worker(cluster.ports[0])
    assert victim is not None
    queue = list(range(16))
    statuses: list[int] = []
    lock = threading.Lock()

    def user() -> None:
        with httpx.Client(timeout=240) as client:
            while queue:
                i = queue.pop()
                body = {"prompt": f"{PROMPTS[i % 3]} Visitor {i} asks why.", "max_tokens": 8}
                try:
                    status = client.post(f"{cluster.url}/v1/completions", json=body).status_code
                except httpx.HTTPError as exc:  # a timeout would be a hang
                    status = -1
                    print(f"request {i}: {exc!r}")
                with lock:
                    statuses.append(status)
                    if len(statuses) == 2:
                        os.kill(victim, signal.SIGKILL)

    users = [threading.Thread(target=user) for _ in range(4)]
    for thread in users:
        thread.start()
    for thread in users:
        thread.join(400)
    assert not any(thread.is_alive() for thread in users)
    assert statuses == [200] * 16, statuses
    wait_until(
        lambda: pid_listening_as_worker(cluster.ports[0]) not in (None, victim), 240, "restart"
    )
    wait_until(lambda: cluster.stats()["workers"][0]["is_healthy"], 240, "the prefill worker")
    fallbacks = _fallbacks(cluster)
    fresh = (
        "After the restart, the harbour master counted the ships in the river port at dawn, "
        "wrote each name in a long ledger with a steel pen, and then"
    )  # new to both workers: its cached tokens can only have come through Ray
    answer = _complete(cluster.url, fresh)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert _fallbacks(cluster) == fallbacks


def test_blocks_lost_in_transit_are_recomputed(references, ray_nodes, pd_cluster) -> None:
    address, _ = ray_nodes
    assert pd_cluster.stop() == 0  # each node has room for one worker: make room (it is last)
    cluster = _start(address, "--kv-transfer-hold-seconds", "0")
    try:
        for prompt in LOST:
            answer = _complete(cluster.url, prompt)
            assert answer["choices"][0]["token_ids"] == references[prompt]
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, prompt
        assert _fallbacks(cluster) == 0  # phase 1 ran; its blocks were gone when fetched
        wait_until(lambda: "KV over Ray: block 1 of" in cluster.log(), 30, "the miss logged")
    except BaseException:
        print(cluster.log())
        raise
    finally:
        assert cluster.stop() == 0

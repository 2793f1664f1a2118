"""Prefill/decode disaggregation end to end (m26): `nanollmserve cluster --prefill-workers 1
--decode-workers 1` on the bundled model (a prefill worker, a decode worker sharing a fresh
store under /dev/shm, the router's `--policy pd`), against one colocated `serve`.

- Greedy output through the cluster equals the colocated server's token for token, 8 prompts
  x 64 tokens (four share a system prompt, so the prefill worker's own prefix cache serves
  them), non-streamed and streamed; the decode worker reads each prompt's blocks from the
  store (`cached_tokens`); the router counts every phase 1, no fallback.
- `bench serve --workload mixed` runs through it, reporting short and long requests apart.
- `kill -9` of the prefill worker under concurrent requests: none hangs, every one is
  answered (the decode worker prefills what no prefill worker could), and the router's
  metrics count the fallbacks; the restarted prefill worker takes phase 1 again.
- The same with the workers as Ray actors (`--ray-address local`; skipped without Ray).
- The CLI's refusals are one line; SIGTERM stops everything and removes the store.

The module's tests run in file order on the one cluster; the last one stops it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from bench_cli import run_bench
from cluster_process import (
    WORKER_ARGS,
    ClusterProcess,
    free_consecutive_ports,
    is_running,
    pid_listening_as_worker,
    tiny_model_dir,
    wait_until,
)
from live_server import LiveServer, free_port
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.milestone("m26"), pytest.mark.timeout(600), pytest.mark.slow]

MODEL_ARGS = ["--num-kv-blocks", "256", "--disable-log-requests"]
SYSTEM = (
    "You are a careful assistant for a museum of ships. Answer visitors' questions about "
    "sailing ships, their crews, the rivers and harbours they used and the goods they "
    "carried, in plain and short sentences."
)
QUESTIONS = ["Who steered the ship?", "What did they eat?", "How fast was it?", "Why sails?"]
OTHERS = [  # each over two KV blocks of 16 tokens
    "The history of the printing press begins in the fifteenth century, in a small workshop "
    "in a German town, where a goldsmith found a way to cast letters in metal, and then",
    "A recipe for bread needs flour, water, salt and yeast, a warm kitchen, a large bowl, a "
    "clean towel and some patience while the dough rises. First, you",
    "The mountain trail climbs through pine forest and over two wooden bridges to a cold "
    "green lake under the peak, where hikers often stop to rest and",
    "In the quiet library the old clock struck nine, the last reader closed his book and "
    "walked out into the rain, and the librarian began to",
]
NON_STREAMED = [f"{SYSTEM}\n\nQuestion: {q}\nAnswer:" for q in QUESTIONS] + OTHERS
STREAMED = [f"{SYSTEM}\n\nQuestion (visitor {i}): {q}\nAnswer:" for i, q in enumerate(QUESTIONS)]
STREAMED += [text.replace("The ", "Once, the ", 1).replace("A ", "Once, a ", 1) for text in OTHERS]
STREAMED = STREAMED[::4]  # one with the shared system prompt, one without: the stream's path
GREEDY = {"max_tokens": 64, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
LATENCY_COUNT = "nanollmserve_router:pd_prefill_latency_seconds_count"
FALLBACKS = "nanollmserve_router:pd_prefill_fallbacks_total"


@pytest.fixture(scope="module")
def cluster():
    base_port = free_consecutive_ports(2)
    router_port = free_port()
    cluster = ClusterProcess.start(
        "cluster", router_port, "--prefill-workers", "1", "--decode-workers", "1",
        "--base-port", str(base_port), "--router-port", str(router_port),
        "--health-interval", "0.5", "--shutdown-timeout", "5", *MODEL_ARGS,
    )  # fmt: skip
    cluster.prefill_port, cluster.decode_port = base_port, base_port + 1
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def colocated():
    server = LiveServer.start(*MODEL_ARGS)
    yield server
    server.stop()


def _metric(cluster, name: str) -> float:
    text = httpx.get(f"{cluster.url}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def _complete(url: str, prompt: str) -> dict:
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, **GREEDY}, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _stream(url: str, prompt: str) -> tuple[list[int], str]:
    body = {"prompt": prompt, **GREEDY, "stream": True}
    tokens, text = [], ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                tokens += choice.get("token_ids") or []
                text += choice.get("text", "")
    return tokens, text


def test_greedy_output_through_pd_equals_a_colocated_server(cluster, colocated, compat) -> None:
    roles = [w["kv_role"] for w in cluster.stats()["workers"]]
    assert roles == ["prefill", "decode"]
    phase_ones = _metric(cluster, LATENCY_COUNT)
    # The colocated answers are asked for all at once (greedy tokens do not depend on the
    # batch: test_engine_generation.py::test_batch_invariance); the cluster's one at a time,
    # so the prefill worker's prefix cache serves the shared system prompt.
    with ThreadPoolExecutor(len(NON_STREAMED) + len(STREAMED)) as pool:
        colocated_answers = list(
            pool.map(lambda prompt: _complete(colocated.url, prompt), NON_STREAMED + STREAMED)
        )
    references = [answer["choices"][0] for answer in colocated_answers]
    for prompt, expected in zip(NON_STREAMED, references[: len(NON_STREAMED)], strict=True):
        answer = _complete(cluster.url, prompt)
        got = answer["choices"][0]
        assert got["token_ids"] == expected["token_ids"] and len(got["token_ids"]) == 64
        assert got["text"] == expected["text"]
        # New to the decode worker: its cached tokens came from the store.
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, prompt
        compat.exercised(
            "offload", loaded_tokens=answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        )
        compat.exercised("tokenio", token_ids=got["token_ids"])
    for prompt, expected in zip(STREAMED, references[len(NON_STREAMED) :], strict=True):
        tokens, text = _stream(cluster.url, prompt)
        assert tokens == expected["token_ids"] and text == expected["text"]
    assert _metric(cluster, LATENCY_COUNT) == phase_ones + len(NON_STREAMED) + len(STREAMED)
    assert _metric(cluster, FALLBACKS) == 0
    compat.exercised("pd", phase_1=_metric(cluster, LATENCY_COUNT) - phase_ones)
    compat.exercised("router", routed=sum(w["num_routed"] for w in cluster.stats()["workers"]))


def test_structured_output_through_pd(cluster, compat) -> None:
    body = {"messages": [{"role": "user", "content": "Is the sea salty?"}], "max_tokens": 8}
    body["structured_outputs"] = {"choice": ["yes", "no"]}
    phase_ones = _metric(cluster, LATENCY_COUNT)
    answer = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] in ("yes", "no")
    compat.exercised("pd", phase_1=_metric(cluster, LATENCY_COUNT) - phase_ones)
    content = answer.json()["choices"][0]["message"]["content"]
    compat.exercised("structured", output=content, choice=["yes", "no"])


def test_bench_serve_mixed_through_the_cluster(cluster) -> None:
    result = run_bench(
        "serve", "--base-url", cluster.url, "--endpoint", "chat", "--workload", "mixed",
        "--num-prompts", "10", "--input-len", "16-32", "--long-input-len", "200-240",
        "--output-len", "8", "--ignore-eos", "--request-rate", "5", "--disable-tqdm",
    )  # fmt: skip
    assert result["workload"] == "mixed" and result["long_fraction"] == 0.2
    assert result["completed"] == 10 and result["total_output_tokens"] == 80
    assert (result["by_kind"]["long"]["completed"], result["by_kind"]["short"]["completed"]) == (
        2, 8,
    )  # fmt: skip
    for numbers in (result, result["by_kind"]["short"]):
        assert numbers["ttft_ms"]["p50"] > 0 and numbers["itl_ms"]["p99"] > 0
        assert numbers["ttft_ms"]["p99"] >= numbers["ttft_ms"]["p50"]


def test_a_killed_prefill_worker_hangs_no_request(cluster) -> None:
    """Six users send 30 requests; the prefill worker gets `kill -9` after the fourth answer.
    Every request is answered within its deadline: the ones whose phase 1 found no prefill
    worker were prefilled by the decode worker, which the router's fallback metric counts."""
    victim = pid_listening_as_worker(cluster.prefill_port)
    assert victim is not None
    phase_ones, fallbacks = _metric(cluster, LATENCY_COUNT), _metric(cluster, FALLBACKS)
    queue = list(range(30))
    outcomes: list[tuple[int, float]] = []
    killed = threading.Event()
    lock = threading.Lock()

    def user() -> None:
        with httpx.Client(timeout=180) as client:
            while queue:
                i = queue.pop()
                body = {"prompt": f"{SYSTEM} Visitor {i} asks about anchors.", "max_tokens": 8}
                start = time.monotonic()
                try:
                    status = client.post(f"{cluster.url}/v1/completions", json=body).status_code
                except httpx.HTTPError as exc:  # a timeout would be a hang
                    status = -1
                    print(f"request {i}: {exc!r}")
                with lock:
                    outcomes.append((status, time.monotonic() - start))
                    if len(outcomes) >= 4 and not killed.is_set():
                        killed.set()
                        os.kill(victim, signal.SIGKILL)

    users = [threading.Thread(target=user) for _ in range(6)]
    for thread in users:
        thread.start()
    for thread in users:
        thread.join(300)
    assert killed.is_set() and not any(thread.is_alive() for thread in users)
    statuses = [status for status, _ in outcomes]
    assert statuses == [200] * 30, statuses
    fallen_back = _metric(cluster, FALLBACKS) - fallbacks
    prefilled = _metric(cluster, LATENCY_COUNT) - phase_ones
    print(f"kill -9 of the prefill worker: {fallen_back:g} fallbacks, {prefilled:g} prefilled")
    assert fallen_back >= 1 and fallen_back + prefilled == 30
    # The cluster restarts it; the router sends it phase 1 again.
    wait_until(lambda: cluster.stats()["workers"][0]["is_healthy"], 240, "the prefill worker")
    assert pid_listening_as_worker(cluster.prefill_port) not in (None, victim)
    before = _metric(cluster, LATENCY_COUNT)
    _complete(cluster.url, f"{SYSTEM} One more question.")
    assert _metric(cluster, LATENCY_COUNT) == before + 1


def test_ray_workers_take_their_roles_and_share_the_store() -> None:
    """`--ray-address local`: the same two roles as Ray actors, the store under /dev/shm."""
    pytest.importorskip("ray")
    base_port, router_port = free_consecutive_ports(2), free_port()
    ray_cluster = ClusterProcess.start(
        "cluster", router_port, "--ray-address", "local", "--prefill-workers", "1",
        "--decode-workers", "1", "--base-port", str(base_port), "--router-port",
        str(router_port), "--health-interval", "0.5", "--shutdown-timeout", "5",
        str(tiny_model_dir()), *WORKER_ARGS,
    )  # fmt: skip
    try:
        assert [w["kv_role"] for w in ray_cluster.stats()["workers"]] == ["prefill", "decode"]
        answer = _complete(ray_cluster.url, f"{SYSTEM} Visitor 1 asks about masts.")
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert _metric(ray_cluster, LATENCY_COUNT) == 1
    finally:
        assert ray_cluster.stop() == 0


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", *args],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_cli_refusals_are_one_line() -> None:
    pd = ["cluster", "--router-port", "0", "--prefill-workers", "1", "--decode-workers", "1"]
    cases = {
        ("--workers", "2"): "--workers and --prefill-workers/--decode-workers are exclusive",
        ("--policy", "prefix"): "run the router's --policy pd, not prefix",
        ("--kv-role", "decode"): "--kv-role is set by the cluster",
        ("--decode-workers", "0"): "must be >= 1",
        ("--ray-address", "auto", "--kv-transfer", "store"): "needs --kv-offload-dir DIR",
        ("--kv-transfer", "ray"): "--kv-transfer ray needs --ray-address",
        ("--workers-per-node", "1"): "--workers-per-node places Ray actors",
    }
    stores = set(Path("/dev/shm").glob("nanollmserve-kv-*"))
    for extra, message in cases.items():
        result = _cli(*pd, *extra)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    alone = _cli("cluster", "--router-port", "0", "--prefill-workers", "1")
    assert alone.returncode == 2 and "go together" in alone.stderr
    unknown = _cli(*pd, "--no-such-flag")  # after the store was made: it is removed
    assert unknown.returncode == 2 and "--no-such-flag" in unknown.stderr
    assert set(Path("/dev/shm").glob("nanollmserve-kv-*")) <= stores
    for value in ("0", "nan", "inf", "-1"):
        bad = _cli("router", "--worker", "http://127.0.0.1:1", "--policy", "pd",
                   "--prefill-timeout", value)  # fmt: skip
        assert bad.returncode == 2 and "--prefill-timeout must be > 0" in bad.stderr


def test_sigterm_stops_everything_and_removes_the_store(cluster) -> None:
    pids = [pid_listening_as_worker(p) for p in (cluster.prefill_port, cluster.decode_port)]
    assert all(pids)
    args = (Path(f"/proc/{pids[1]}/cmdline").read_bytes()).split(b"\0")
    store = Path(args[args.index(b"--kv-offload-dir") + 1].decode())
    assert store.is_dir() and store.parent == Path("/dev/shm")
    assert cluster.stop(signal.SIGTERM) == 0
    wait_until(lambda: not any(is_running(pid) for pid in pids), 30, "workers gone")
    assert not store.exists()

"""The memory features through the router and gRPC (compatibility matrix, m25), on `serve`
processes (tests/compat_stack.py: a worker with its gRPC port and a router in front of it):

- a worker whose KV pool is int8 (`--kv-cache-dtype int8`) answers through the router as
  it answers directly;
- a worker with `--kv-offload-dir` and sleep mode: after a sleep emptied its pool, a prefix
  is read back from the directory for a gRPC call and for a chat through the router.
"""

from __future__ import annotations

import time

import httpx
import pytest
from cluster_process import tiny_model_dir, wait_until
from compat_stack import CompatStack

pytestmark = [pytest.mark.milestone("m25"), pytest.mark.timeout(300), pytest.mark.slow]

PROMPT = "Once upon a time, " + " ".join(f"item {i} costs {i % 7} coins;" for i in range(12))


def complete(base_url: str) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    answer = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def empty_the_pool(stack: CompatStack) -> None:
    """A level-1 sleep and a wake: the pool, and every prefix it held, are gone."""
    for path, params in (("/sleep", {"level": "1"}), ("/wake_up", {})):
        answer = httpx.post(
            f"{stack.worker.url}{path}", params=params, headers=stack.worker.admin_headers,
            timeout=120,
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
    # The router may have taken the sleeping worker out of its rotation (m27): its health
    # checks (every 0.5 s) put it back; wait past two of them, then for it to be in.
    time.sleep(1.2)
    wait_until(lambda: httpx.get(f"{stack.router.url}/health").status_code == 200, 30, "awake")


@pytest.fixture(scope="module")
def int8_kv():
    stack = CompatStack.start(
        "--model", str(tiny_model_dir()), "--served-model-name", "tiny",
        "--kv-cache-dtype", "int8",
    )  # fmt: skip
    yield stack
    stack.stop()


def test_the_router_in_front_of_an_int8_kv_worker_answers_as_the_worker(int8_kv, compat):
    assert "torch.int8 codes" in int8_kv.worker.log()
    direct = complete(int8_kv.worker.url)
    routed = complete(int8_kv.router.url)
    assert routed["choices"][0]["text"] == direct["choices"][0]["text"]
    assert routed["usage"]["completion_tokens"] == 8
    compat.exercised("kvdtype", kv_cache_dtype=compat.kv_dtype_in_log(int8_kv.worker.log()))
    compat.exercised("router", routed=int8_kv.router.stats()["workers"][0]["num_routed"])


@pytest.fixture(scope="module")
def offload(tmp_path_factory):
    stack = CompatStack.start(
        "--model", str(tiny_model_dir()), "--served-model-name", "tiny",
        "--kv-offload-dir", str(tmp_path_factory.mktemp("kv-offload")), "--enable-sleep-mode",
    )  # fmt: skip
    yield stack
    stack.stop()


def test_grpc_reads_a_prefix_from_the_store_after_the_pool_forgot_it(offload, compat):
    async def generate(client):
        return await client.generate(PROMPT, max_tokens=8, temperature=0)

    cold = offload.grpc(generate)
    assert cold.cached_tokens == 0
    empty_the_pool(offload)
    warm = offload.grpc(generate)
    assert warm.cached_tokens >= 16
    assert warm.text == cold.text
    compat.exercised("grpc", reply=warm)
    compat.exercised("offload", loaded_tokens=warm.cached_tokens)


def test_the_router_in_front_of_a_store_worker_gets_the_prefix_from_the_store(offload, compat):
    cold = complete(offload.router.url)
    empty_the_pool(offload)
    warm = complete(offload.router.url)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    compat.exercised(
        "offload", loaded_tokens=warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    )
    compat.exercised("router", routed=offload.router.stats()["workers"][0]["num_routed"])

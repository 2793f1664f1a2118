"""Issue 41, "Admin routes share the inference key and pass through the router" (m27).

- A server's admin routes (`/sleep`, `/wake_up`, `/is_sleeping`, `/debug/steps`) need
  `--admin-api-key`: off (404) without it, even with their own flags; the inference key
  never opens them (401 in the OpenAI error shape, as a missing or wrong admin key).
- The router never forwards them (404, whatever key comes along); its own admin surface
  (`/admin/workers...`, behind the router's `--admin-api-key`) sleeps, wakes and drains a
  named worker, calling it with the workers' admin key (the cluster launcher's).
- A sleeping worker is not counted healthy by the router's /health and gets no request:
  requests go to the awake workers, and with every worker asleep the router answers 503.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from cluster_process import (
    WORKER_ARGS,
    ClusterProcess,
    free_consecutive_ports,
    tiny_model_dir,
    wait_until,
)
from live_server import LiveServer, free_port

pytestmark = pytest.mark.milestone("m27")

API_KEY = "admin-test-inference-key"
ADMIN_KEY = "admin-test-operator-key"
ADMIN_PATHS = [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")]
ADMIN_PATHS += [("GET", "/debug/steps"), ("POST", "/v1/load_lora_adapter")]
ADMIN_PATHS += [("POST", "/unload_lora_adapter")]
ADMIN_FLAGS = ["--enable-sleep-mode", "--enable-debug-endpoints"]
BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
HOSTILE_LEVELS = ["nan", "inf", "-inf", "-1", "0", "3", "1.0", "1e309", "9" * 400, ""]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_openai_error(answer: httpx.Response, status: int) -> dict:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    return error


@pytest.fixture(scope="module")
def cluster():
    """Two workers with sleep mode and the debug route, behind a router with an admin key."""
    base_port, router_port = free_consecutive_ports(2), free_port()
    cluster = ClusterProcess.start(
        "cluster", router_port, "--workers", "2", "--base-port", str(base_port),
        "--router-port", str(router_port), "--health-interval", "0.3", "--shutdown-timeout",
        "5", str(tiny_model_dir()), *WORKER_ARGS, *ADMIN_FLAGS,
        api_key=API_KEY, admin_api_key=ADMIN_KEY,
    )  # fmt: skip
    cluster.worker_urls = [f"http://127.0.0.1:{base_port + i}" for i in range(2)]
    yield cluster
    for url in cluster.worker_urls:  # leave no worker asleep for the next test's fixture
        httpx.post(f"{url}/wake_up", headers=bearer(ADMIN_KEY), timeout=60)
    cluster.stop()


def admin(cluster, action: str, **params) -> httpx.Response:
    return httpx.post(
        f"{cluster.url}/admin/workers/{action}",
        params=params,
        headers=bearer(ADMIN_KEY),
        timeout=120,
    )


def routed(cluster) -> dict[str, int]:
    return {w["url"]: w["num_routed"] for w in cluster.stats()["workers"]}


def wait_router_health(cluster, status: int, what: str) -> dict:
    def seen():
        answer = httpx.get(f"{cluster.url}/health", timeout=10)
        return answer.json() if answer.status_code == status else None

    return wait_until(seen, 30, what, interval=0.2)


# -- a server's own admin routes ---------------------------------------------------------------


@pytest.mark.timeout(300)
def test_admin_routes_are_off_without_an_admin_key_even_with_their_flags():
    live = LiveServer.start("--num-kv-blocks", "64", *ADMIN_FLAGS, api_key=API_KEY)
    try:
        for method, path in ADMIN_PATHS:
            answer = httpx.request(method, f"{live.url}{path}", headers=live.headers, timeout=30)
            error = assert_openai_error(answer, 404)
            assert "--admin-api-key" in error["message"], error
        assert live.client().post("/v1/completions", json={**BODY, "model": None}).is_success
    finally:
        live.stop()


def test_the_inference_key_does_not_open_a_workers_admin_routes(cluster):
    worker = cluster.worker_urls[0]
    wrong = [{}, bearer(API_KEY), {"x-api-key": API_KEY}, bearer(ADMIN_KEY + "x")]
    wrong += [bearer("x" * 8000), {"Authorization": f"Basic {ADMIN_KEY}"}]
    for method, path in ADMIN_PATHS:
        for headers in wrong:
            answer = httpx.request(method, f"{worker}{path}", headers=headers, timeout=30)
            error = assert_openai_error(answer, 401)
            assert error["code"] == "invalid_admin_api_key", (path, headers, error)
    # The launcher gave the workers the cluster's admin key: it opens them, either header.
    steps = httpx.get(f"{worker}/debug/steps", headers=bearer(ADMIN_KEY), timeout=60)
    assert steps.status_code == 200, steps.text
    asleep = httpx.get(f"{worker}/is_sleeping", headers={"x-api-key": ADMIN_KEY}, timeout=30)
    assert asleep.json() == {"is_sleeping": False}
    # ... and the admin key is not the inference key either.
    answer = httpx.post(f"{worker}/v1/completions", json=BODY, headers=bearer(ADMIN_KEY))
    assert_openai_error(answer, 401)


def test_an_admin_key_equal_to_the_api_key_is_refused_at_start():
    env = {"NANOLLMSERVE_API_KEY": "same", "NANOLLMSERVE_ADMIN_API_KEY": "same"}
    for command in (["serve", "--num-kv-blocks", "16"], ["router", "--worker", "h:1"]):
        result = subprocess.run(
            [sys.executable, "-m", "nanollmserve.cli.main", *command],
            capture_output=True,
            text=True,
            timeout=120,
            env={**__import__("os").environ, **env},
        )
        assert result.returncode == 2, result.stderr
        assert "--admin-api-key must differ from --api-key" in result.stderr


# -- the router ---------------------------------------------------------------------------------


def test_the_router_never_forwards_admin_routes(cluster):
    before = routed(cluster)
    for method, path in [*ADMIN_PATHS, ("POST", "/sleep/"), ("GET", "/debug/steps/")]:
        for headers in (cluster.headers, {**cluster.headers, "x-api-key": ADMIN_KEY}):
            url = f"{cluster.url}{path}?level=1&mode=abort"
            answer = httpx.request(method, url, headers=headers, timeout=30)
            error = assert_openai_error(answer, 404)
            assert "never forwards" in error["message"], error
    assert routed(cluster) == before  # nothing reached a worker
    health = httpx.get(f"{cluster.url}/health", timeout=10).json()
    assert health["num_healthy_workers"] == 2 and health["num_sleeping_workers"] == 0
    assert cluster.openai().completions.create(**BODY).choices[0].text is not None


def test_the_routers_admin_surface_needs_its_admin_key(cluster):
    url = f"{cluster.url}/admin/workers"
    for headers in ({}, cluster.headers, {"x-api-key": API_KEY}, bearer("nope")):
        error = assert_openai_error(httpx.get(url, headers=headers, timeout=10), 401)
        assert error["code"] == "invalid_admin_api_key"
        answer = httpx.post(f"{url}/sleep", params={"url": cluster.worker_urls[0]}, headers=headers)
        assert_openai_error(answer, 401)
    listed = httpx.get(url, headers=bearer(ADMIN_KEY), timeout=10).json()["workers"]
    assert sorted(w["url"] for w in listed) == cluster.worker_urls
    assert all(w["is_serving"] and not w["is_sleeping"] for w in listed)


@pytest.mark.timeout(300)
def test_a_router_without_an_admin_key_has_no_admin_surface(cluster):
    port = free_port()
    router = ClusterProcess.start(
        "router", port, "--port", str(port), "--worker", cluster.worker_urls[0],
        "--health-interval", "0.3", api_key=API_KEY, num_workers=1,
    )  # fmt: skip
    try:
        for headers in (router.headers, bearer(ADMIN_KEY)):
            answer = httpx.get(f"{router.url}/admin/workers", headers=headers, timeout=10)
            assert_openai_error(answer, 404)
        answer = httpx.post(f"{router.url}/sleep", headers=router.headers, timeout=10)
        assert_openai_error(answer, 404)
    finally:
        assert router.stop() == 0


@pytest.mark.timeout(300)
def test_a_sleeping_worker_gets_no_traffic_and_is_not_healthy(cluster):
    first, second = cluster.worker_urls
    answer = admin(cluster, "sleep", url=first, level="1")
    assert answer.status_code == 200, answer.text
    assert answer.json()["is_sleeping"] and not answer.json()["is_serving"]
    try:
        health = httpx.get(f"{cluster.url}/health", timeout=10).json()
        assert health["num_healthy_workers"] == 1 and health["num_sleeping_workers"] == 1
        assert httpx.get(f"{first}/health", timeout=10).json()["status"] == "sleeping"
        before = routed(cluster)
        client = cluster.openai()
        for _ in range(4):  # every one to the awake worker, none to the sleeping one
            assert client.completions.create(**BODY).choices
        after = routed(cluster)
        assert after[first] == before[first] and after[second] == before[second] + 4
        entry = next(w for w in cluster.stats()["workers"] if w["url"] == first)
        assert entry["is_sleeping"] is True

        assert admin(cluster, "sleep", url=second, level="1").status_code == 200
        error = assert_openai_error(httpx.get(f"{cluster.url}/health", timeout=10), 503)
        assert "2 asleep" in error["message"]
        answer = httpx.post(f"{cluster.url}/v1/completions", json=BODY, headers=cluster.headers)
        error = assert_openai_error(answer, 503)
        assert error["code"] == "no_healthy_worker" and answer.headers["retry-after"]
        assert routed(cluster) == after  # the router answered it: no worker was tried
    finally:
        for url in (first, second):
            assert admin(cluster, "wake_up", url=url).status_code == 200
    health = httpx.get(f"{cluster.url}/health", timeout=10).json()
    assert health["num_healthy_workers"] == 2 and health["num_sleeping_workers"] == 0
    assert client.completions.create(**BODY).choices


@pytest.mark.timeout(300)
def test_a_worker_put_to_sleep_on_its_own_port_leaves_the_rotation(cluster):
    first = cluster.worker_urls[0]
    answer = httpx.post(f"{first}/sleep", params={"level": "1"}, headers=bearer(ADMIN_KEY))
    assert answer.status_code == 200, answer.text
    try:
        health = wait_router_health(cluster, 200, "the router to see the worker asleep")
        wait_until(
            lambda: (
                httpx.get(f"{cluster.url}/health", timeout=10).json()["num_sleeping_workers"] == 1
            ),
            30,
            "the router's health check to see the sleep",
        )
        before = routed(cluster)
        assert cluster.openai().completions.create(**BODY).choices
        assert routed(cluster)[first] == before[first]
    finally:
        assert httpx.post(f"{first}/wake_up", headers=bearer(ADMIN_KEY)).status_code == 200
    wait_until(
        lambda: httpx.get(f"{cluster.url}/health", timeout=10).json()["num_healthy_workers"] == 2,
        30,
        "the woken worker back in the rotation",
    )
    assert health["status"] == "ok"


def test_drain_and_undrain_a_named_worker(cluster):
    first, second = cluster.worker_urls
    answer = admin(cluster, "drain", url=first)
    assert answer.status_code == 200 and answer.json()["is_draining"], answer.text
    try:
        before = routed(cluster)
        for _ in range(3):
            assert cluster.openai().completions.create(**BODY).choices
        after = routed(cluster)
        assert after[first] == before[first] and after[second] == before[second] + 3
        assert httpx.get(f"{cluster.url}/health").json()["num_draining_workers"] == 1
    finally:
        assert admin(cluster, "undrain", url=first).status_code == 200
    assert httpx.get(f"{cluster.url}/health").json()["num_healthy_workers"] == 2


@pytest.mark.parametrize("level", HOSTILE_LEVELS)
def test_hostile_levels_are_400s_and_sleep_nothing(cluster, level):
    answer = admin(cluster, "sleep", url=cluster.worker_urls[0], level=level)
    error = assert_openai_error(answer, 400)
    assert error["param"] == "level" and len(error["message"]) < 200
    assert httpx.get(f"{cluster.url}/health").json()["num_sleeping_workers"] == 0


def test_hostile_worker_names_and_modes(cluster):
    first = cluster.worker_urls[0]
    cases = [
        ({}, 400, "url"),
        ({"url": ""}, 400, "url"),
        ({"url": [first, first]}, 400, "url"),
        ({"url": "http://127.0.0.1:1"}, 404, None),
        ({"url": "x" * 8000}, 404, None),
        ({"url": first, "mode": "nan"}, 400, "mode"),
        ({"url": first, "mode": "abort\x00"}, 400, "mode"),
        ({"url": first, "level": ["1", "2"]}, 400, "level"),
    ]
    for params, status, param in cases:
        for action in ("sleep", "wake_up", "drain", "undrain"):
            if action != "sleep" and param in ("mode", "level"):
                continue
            error = assert_openai_error(admin(cluster, action, **params), status)
            assert error["param"] == param and len(error["message"]) < 300, (action, error)
    assert httpx.get(f"{cluster.url}/health").json()["num_healthy_workers"] == 2

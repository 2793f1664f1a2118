"""The router's placement (m13, m32), without processes: the routing key of each request
shape, the prefix policy's affinity, its load bound, and what moves when a worker leaves.
The m32 tests check what lets router replicas agree: the placement is a function of the
prefix, the workers' URLs and their loads (consistent hashing with bounded load)."""

from __future__ import annotations

import math

import pytest

from nanollmserve.router import Worker, make_policy
from nanollmserve.router.policies import preference
from nanollmserve.router.routing_key import routing_key

pytestmark = pytest.mark.milestone("m13")

SYSTEM = "You are a helpful assistant for the ACME support desk. " * 10


def _workers(n: int) -> list[Worker]:
    return [Worker(f"http://127.0.0.1:{8001 + i}", is_healthy=True) for i in range(n)]


def test_routing_key_reads_the_start_of_every_prompt_shape() -> None:
    chat = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a"}]}
    parts = {"messages": [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}]}
    assert routing_key(chat) == routing_key(parts) == f"system: {SYSTEM}"[:256]
    assert routing_key({"prompt": SYSTEM + "question"}) == SYSTEM[:256]
    assert routing_key({"prompt": [SYSTEM, "other"]}) == SYSTEM[:256]
    assert routing_key({"input": "hello"}, prefix_chars=3) == "hel"
    assert routing_key({"prompt": [1, 2, 3]}) == "1 2 3"
    assert routing_key({"model": "m"}) is None
    assert routing_key(["not", "a", "dict"]) is None


def test_prefix_policy_keeps_a_prefix_on_one_worker_until_it_is_overloaded() -> None:
    policy = make_policy("prefix", load_bound_factor=1.5)
    workers = _workers(3)
    keys = [routing_key({"prompt": f"{i} {SYSTEM} question {j}"}) for i in range(8) for j in (1, 2)]
    chosen = {key: policy.choose(workers, key) for key in keys}
    assert len(set(chosen.values())) > 1  # different prefixes spread over the workers
    home = chosen[keys[0]]
    others = [w for w in workers if w is not home]
    others[0].num_in_flight = others[1].num_in_flight = 2
    # A worker is within the bound while load x 3 < 1.5 x (total in flight + 1).
    home.num_in_flight = 4  # 12 < 1.5 x 9: within, though it has the most
    assert policy.choose(workers, keys[0]) is home
    home.num_in_flight = 5  # 15 < 1.5 x 10 fails: past the bound, the prefix's next worker
    assert policy.choose(workers, keys[0]) is preference(keys[0], workers)[1]
    assert policy.choose(workers, None).num_in_flight == 2  # no prompt: least load


def test_round_robin_and_least_load() -> None:
    workers = _workers(2)
    round_robin = make_policy("round_robin")
    assert [round_robin.choose(workers, None) for _ in range(4)] == workers * 2
    least_load = make_policy("least_load")
    workers[0].num_in_flight = 2
    assert least_load.choose(workers, None) is workers[1]
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random")


# Consistent hashing with bounded load (m32): what lets router replicas agree.

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 6)]
KEYS = [f"system: tenant {i} prompt\n" for i in range(500)]


def _place(workers: list[Worker], keys: list[str], factor: float = 1.25) -> dict[str, str]:
    policy = make_policy("prefix", load_bound_factor=factor)
    return {key: policy.choose(workers, key).url for key in keys}


@pytest.mark.milestone("m32")
def test_placement_is_a_function_of_the_prefix_and_the_worker_set() -> None:
    # Two policies, two sets of Worker objects, the workers listed in other orders, one set
    # with a history of routed requests (it must not matter): the same worker for every key.
    first = [Worker(url, is_healthy=True) for url in URLS]
    second = [Worker(url, is_healthy=True, num_routed=7 * i) for i, url in enumerate(URLS)]
    second.reverse()
    placed = _place(first, KEYS)
    assert placed == _place(second, KEYS)
    counts = [list(placed.values()).count(url) for url in URLS]
    assert min(counts) >= 60, counts  # 100 each on average: every worker heads some keys
    # The hash is part of the contract: routers of two versions must agree, and an upgrade
    # must not move every prefix. These orders were computed once (blake2b of url and key).
    workers = [Worker(f"http://10.0.0.{i}:8000") for i in range(1, 5)]
    order = [w.url[-6] for w in preference("system: You are a helpful assistant.\n", workers)]
    assert order == ["2", "4", "1", "3"]
    assert [w.url[-6] for w in preference("hello", workers)] == ["1", "3", "2", "4"]


@pytest.mark.milestone("m32")
def test_a_worker_leaving_or_joining_moves_only_the_prefixes_it_heads() -> None:
    workers = [Worker(url, is_healthy=True) for url in URLS]
    before = _place(workers, KEYS)
    gone = workers[2]
    rest = [w for w in workers if w is not gone]
    after = _place(rest, KEYS)
    moved = [key for key in KEYS if after[key] != before[key]]
    assert set(moved) == {key for key in KEYS if before[key] == gone.url}
    assert 0.1 < len(moved) / len(KEYS) < 0.3  # about 1/5 of the keys, no more
    for key in moved:  # each to its own next worker, not to one heir of them all
        assert after[key] == preference(key, workers)[1].url
    assert len({after[key] for key in moved}) == len(rest)
    # It joins again: exactly the same keys come back to it, nothing else moves.
    assert _place(workers, KEYS) == before


@pytest.mark.milestone("m32")
@pytest.mark.parametrize("factor", [1.0, 1.25, 2.0])
def test_no_worker_exceeds_the_load_bound(factor: float) -> None:
    workers = [Worker(url, is_healthy=True) for url in URLS]
    policy = make_policy("prefix", load_bound_factor=factor)
    hot = KEYS[0]
    order = preference(hot, workers)
    used = []
    for i in range(60):  # requests that stay in flight: one hot prefix, every 4th another
        key = KEYS[1 + i] if i % 4 == 3 else hot
        total = sum(w.num_in_flight for w in workers)
        worker = policy.choose(workers, key)
        if key == hot:  # its first worker in hash order whose load x 5 < factor x (total + 1)
            position = order.index(worker)
            assert worker.num_in_flight * 5 < factor * (total + 1)
            assert all(w.num_in_flight * 5 >= factor * (total + 1) for w in order[:position])
            used.append(position)
        worker.num_in_flight += 1
        # The paper's capacity: no worker above ceil(factor x mean), the mean counting all.
        assert max(w.num_in_flight for w in workers) <= math.ceil(factor * (total + 1) / 5)
    assert used[0] == 0 and len(set(used)) > 1  # home first, then spilled in its own order
    # Ending requests brings it back home.
    for worker in workers:
        worker.num_in_flight = 0
    assert policy.choose(workers, hot) is order[0]


@pytest.mark.milestone("m32")
def test_a_loose_bound_keeps_affinity_and_bad_factors_are_refused() -> None:
    workers = [Worker(url, is_healthy=True) for url in URLS]
    policy = make_policy("prefix", load_bound_factor=100)
    home = preference(KEYS[0], workers)[0]
    for _ in range(50):  # 50 in flight on one of five workers: within 100 x the mean
        assert policy.choose(workers, KEYS[0]) is home
        home.num_in_flight += 1
    for bad in (0.99, 0, -1, 100.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="must be a number from 1 to 100"):
            make_policy("prefix", load_bound_factor=bad)
    with pytest.raises(ValueError, match="from 1 to 100"):
        make_policy("pd", load_bound_factor=0.5)


@pytest.mark.milestone("m32")
def test_the_load_bound_flag_is_checked_before_the_router_starts() -> None:
    from nanollmserve.cli.main import build_parser
    from nanollmserve.cli.router import router_settings
    from nanollmserve.errors import UserError

    parser = build_parser()
    base = ["router", "--worker", "http://127.0.0.1:1", "--policy", "prefix"]
    settings = router_settings(parser.parse_args([*base, "--load-bound-factor", "1.5"]))
    assert settings.load_bound_factor == 1.5
    assert router_settings(parser.parse_args(base)).load_bound_factor == 1.25
    for bad in ("0.5", "nan", "inf", "101"):
        with pytest.raises(UserError, match="--load-bound-factor must be a number from 1 to 100"):
            router_settings(parser.parse_args([*base, "--load-bound-factor", bad]))
    cluster = parser.parse_args(["cluster", "--workers", "2", "--load-bound-factor", "2"])
    assert router_settings(cluster).load_bound_factor == 2.0


@pytest.mark.milestone("m32")
@pytest.mark.parametrize("bad", ["nan", "inf", "-1"])
def test_a_hostile_shutdown_timeout_is_a_one_line_error(bad: str) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", "router", "--worker",
         "http://127.0.0.1:1", "--shutdown-timeout", bad],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--shutdown-timeout must be a finite number >= 0" in proc.stderr
    assert "Traceback" not in proc.stderr

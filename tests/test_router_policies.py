"""The router's placement (m13), without processes: the routing key of each request shape,
the prefix policy's affinity, its load bound, and what moves when a worker leaves."""

from __future__ import annotations

import pytest

from nanollmserve.router import Worker, make_policy
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
    policy = make_policy("prefix", balance_threshold=4)
    workers = _workers(3)
    keys = [routing_key({"prompt": f"{i} {SYSTEM} question {j}"}) for i in range(8) for j in (1, 2)]
    chosen = {key: policy.choose(workers, key) for key in keys}
    assert len(set(chosen.values())) > 1  # different prefixes spread over the workers
    home = chosen[keys[0]]
    home.num_in_flight = 3  # three more than the others: still within the bound
    assert policy.choose(workers, keys[0]) is home
    home.num_in_flight = 4  # at the bound: the least loaded worker takes it
    assert policy.choose(workers, keys[0]) is not home
    assert policy.choose(workers, None).num_in_flight == 0  # no prompt: least load


def test_a_worker_leaving_moves_only_its_own_prefixes() -> None:
    policy = make_policy("prefix")
    workers = _workers(4)
    keys = [f"system prompt {i}" for i in range(64)]
    before = {key: policy.choose(workers, key) for key in keys}
    gone = workers[1]
    after = {key: policy.choose([w for w in workers if w is not gone], key) for key in keys}
    moved = [key for key in keys if after[key] is not before[key]]
    assert moved and all(before[key] is gone for key in moved)


def test_round_robin_and_least_load() -> None:
    workers = _workers(2)
    round_robin = make_policy("round_robin")
    assert [round_robin.choose(workers, None) for _ in range(4)] == workers * 2
    least_load = make_policy("least_load")
    workers[0].num_in_flight = 2
    assert least_load.choose(workers, None) is workers[1]
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random")

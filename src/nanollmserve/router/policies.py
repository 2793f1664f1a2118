"""How the router picks a worker: small policy classes with one method,
`choose(candidates, key)`, over the healthy workers not yet tried for this request.

- `round_robin`: each in turn.
- `least_load`: the fewest requests in flight (ties: the fewest routed so far).
- `prefix`: cache-aware placement as in SGLang's router: the request's routing key (the
  start of its prompt, `routing_key.py`) picks a worker by rendezvous hashing, so requests
  sharing a prefix land where that prefix is cached, and a worker leaving moves only its own
  keys. Bounded by load: when the chosen worker has `balance_threshold` more requests in
  flight than the least loaded one, the least loaded one gets the request.
- `pd`: prefill/decode disaggregation (`pd.py` runs the two phases). A generation request's
  prefill goes to a prefill-role worker by the prefix policy (its prefix cache and the
  shared store hold that prompt's blocks), the request itself to the least loaded
  decode-role (or both-role) worker; every other request too. Prefill-role workers take
  only phase 1.

`serves(worker)` says which workers a policy places whole requests on (all, but under `pd`).
"""

from __future__ import annotations

import hashlib
import itertools

from nanollmserve.router.workers import Worker

DEFAULT_BALANCE_THRESHOLD = 8


class Policy:
    name = ""
    uses_key = False
    prefill = None
    """The policy that places phase 1 on prefill workers; None: one phase (all but `pd`)."""

    def serves(self, worker: Worker) -> bool:
        return True


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: list[Worker], key: str | None) -> Worker:
        return candidates[next(self._counter) % len(candidates)]


class LeastLoadPolicy(Policy):
    name = "least_load"

    def choose(self, candidates: list[Worker], key: str | None) -> Worker:
        return min(candidates, key=lambda w: (w.num_in_flight, w.num_routed))


class PrefixPolicy(Policy):
    name = "prefix"
    uses_key = True

    def __init__(self, balance_threshold: int = DEFAULT_BALANCE_THRESHOLD) -> None:
        self.balance_threshold = balance_threshold
        self.least_load = LeastLoadPolicy()

    def choose(self, candidates: list[Worker], key: str | None) -> Worker:
        least = self.least_load.choose(candidates, key)
        if key is None:
            return least
        chosen = max(candidates, key=lambda w: _score(key, w.url))
        if chosen.num_in_flight - least.num_in_flight >= self.balance_threshold:
            return least
        return chosen


class PDPolicy(LeastLoadPolicy):
    name = "pd"
    uses_key = True

    def __init__(self, balance_threshold: int = DEFAULT_BALANCE_THRESHOLD) -> None:
        self.prefill = PrefixPolicy(balance_threshold)

    def serves(self, worker: Worker) -> bool:
        return worker.kv_role != "prefill"

    def prefill_workers(self, workers: list[Worker]) -> list[Worker]:
        return [worker for worker in workers if worker.kv_role == "prefill"]


def _score(key: str, url: str) -> bytes:
    return hashlib.blake2b(f"{url}\n{key}".encode(), digest_size=8).digest()


POLICIES = ("round_robin", "least_load", "prefix", "pd")


def make_policy(name: str, balance_threshold: int = DEFAULT_BALANCE_THRESHOLD):
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_load":
        return LeastLoadPolicy()
    if name == "prefix":
        return PrefixPolicy(balance_threshold)
    if name == "pd":
        return PDPolicy(balance_threshold)
    raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}")

"""How the router picks a worker: small policy classes with one method,
`choose(candidates, key)`, over the healthy workers not yet tried for this request.

- `round_robin`: each in turn.
- `least_load`: the fewest requests in flight (ties: the fewest routed so far).
- `prefix`: cache-aware placement by consistent hashing with bounded load (Mirrokni,
  Thorup and Zadimoghaddam, "Consistent hashing with bounded loads"), on rendezvous
  hashing: the request's routing key (the start of its prompt, `routing_key.py`) orders the
  candidates by `blake2b(url, key)` (`preference`), and the request goes to the first of
  them under the load bound: a worker may hold at most `load_bound_factor` x the mean
  requests in flight, the new one counted (`within_bound`). So the placement is a function
  of the key, the candidates' URLs and their loads, and nothing else: two router replicas
  over the same workers send a prefix to the same worker while their loads agree (idle,
  always), a worker that leaves moves only its own prefixes (each to its next worker in
  the order), one that joins takes only the prefixes it now heads, and a hot prefix spills
  over to the same second worker every time.
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

DEFAULT_LOAD_BOUND_FACTOR = 1.25
"""The bound of the paper's experiments and of most implementations (Vimeo's HAProxy
`hash-balance-factor 125`, brpc's `c_murmurhash_bl`)."""
MIN_LOAD_BOUND_FACTOR = 1.0
"""1: no worker above the ceiling of the mean (a valid worker always exists at >= 1)."""
MAX_LOAD_BOUND_FACTOR = 100.0
"""Beyond, the bound never acts on any realistic number of workers: affinity only."""


def check_load_bound_factor(factor: float, what: str = "the load-bound factor") -> float:
    """`factor` if it is a number from 1 to 100, else ValueError naming `what` and the
    range."""
    if not (
        isinstance(factor, int | float)
        and not isinstance(factor, bool)
        and MIN_LOAD_BOUND_FACTOR <= factor <= MAX_LOAD_BOUND_FACTOR
    ):
        raise ValueError(
            f"{what} must be a number from {MIN_LOAD_BOUND_FACTOR:g} to "
            f"{MAX_LOAD_BOUND_FACTOR:g} (a worker takes at most that many times the mean "
            f"requests in flight), got {factor!r}"
        )
    return float(factor)


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

    def __init__(self, load_bound_factor: float = DEFAULT_LOAD_BOUND_FACTOR) -> None:
        self.load_bound_factor = check_load_bound_factor(load_bound_factor)
        self.least_load = LeastLoadPolicy()

    def choose(self, candidates: list[Worker], key: str | None) -> Worker:
        if key is None:  # no prompt to place by: load alone
            return self.least_load.choose(candidates, key)
        return bounded_choice(key, candidates, self.load_bound_factor)


class PDPolicy(LeastLoadPolicy):
    name = "pd"
    uses_key = True

    def __init__(self, load_bound_factor: float = DEFAULT_LOAD_BOUND_FACTOR) -> None:
        self.prefill = PrefixPolicy(load_bound_factor)

    def serves(self, worker: Worker) -> bool:
        return worker.kv_role != "prefill"

    def prefill_workers(self, workers: list[Worker]) -> list[Worker]:
        return [worker for worker in workers if worker.kv_role == "prefill"]


def preference(key: str, workers: list[Worker]) -> list[Worker]:
    """`workers` in `key`'s rendezvous order: the highest `blake2b(url, key)` first (the
    URL breaks a tie, so the order depends on nothing but the key and the URLs). Removing a
    worker leaves the others' order unchanged; an added one slots in without reordering."""
    return sorted(workers, key=lambda w: (_score(key, w.url), w.url), reverse=True)


def within_bound(worker: Worker, total_in_flight: int, num_workers: int, factor: float) -> bool:
    """Whether `worker` may take one more request: its load stays within `factor` x the mean
    once the new request is counted, i.e. below the paper's capacity
    ceil(factor x (total + 1) / n). Some worker always is (their loads sum to `total`)."""
    return worker.num_in_flight * num_workers < factor * (total_in_flight + 1)


def bounded_choice(key: str, workers: list[Worker], factor: float) -> Worker:
    """The first worker of `key`'s rendezvous order within the load bound."""
    total = sum(worker.num_in_flight for worker in workers)
    order = preference(key, workers)
    for worker in order:
        if within_bound(worker, total, len(order), factor):
            return worker
    return min(order, key=lambda w: w.num_in_flight)  # unreachable for factor >= 1


def _score(key: str, url: str) -> bytes:
    return hashlib.blake2b(f"{url}\n{key}".encode(), digest_size=8).digest()


POLICIES = ("round_robin", "least_load", "prefix", "pd")


def make_policy(name: str, load_bound_factor: float = DEFAULT_LOAD_BOUND_FACTOR):
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_load":
        return LeastLoadPolicy()
    if name == "prefix":
        return PrefixPolicy(load_bound_factor)
    if name == "pd":
        return PDPolicy(load_bound_factor)
    raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}")

"""Drive an EngineCore directly with timed arrivals, recording when each token came out.

The offline benchmarks (`bench prefix`, `bench ablation`) use this instead of `LLM.generate`
so requests can arrive over time (a request is added when its arrival time has passed) and
each one's TTFT is measured from that arrival, with no tokenizer or detokenizer in the way
(the HF baselines they are compared with produce token ids too).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from nanollmserve.bench.workload import BenchRequest

_ids = itertools.count()


@dataclass
class Timing:
    """One request's times, in perf_counter() seconds."""

    arrival: float
    first_token: float | None = None
    finish: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        return (self.first_token or self.arrival) - self.arrival

    @property
    def e2e(self) -> float:
        return (self.finish or self.arrival) - self.arrival

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


def run_engine(
    engine, requests: list[BenchRequest], arrivals: list[float] | None = None
) -> tuple[list[Timing], float]:
    """Greedy, ignore_eos, each request exactly `max_tokens` long. `arrivals[i]` is when
    request i arrives, in seconds from the start (None: all at once). Returns the timings in
    request order and the seconds from the start to the last token."""
    from nanollmserve.engine.messages import EngineCoreRequest
    from nanollmserve.sampling_params import SamplingParams

    arrivals = arrivals or [0.0] * len(requests)
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    start = time.perf_counter()
    timings = [Timing(arrival=start + a) for a in arrivals]
    by_id: dict[str, int] = {}
    next_index = 0
    while next_index < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while next_index < len(order) and timings[order[next_index]].arrival <= now:
            i = order[next_index]
            request_id = f"bench-{next(_ids)}"
            by_id[request_id] = i
            params = SamplingParams(
                temperature=0.0, max_tokens=requests[i].max_tokens, ignore_eos=True
            )
            engine.add_request(EngineCoreRequest(request_id, requests[i].prompt_token_ids, params))
            next_index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, timings[order[next_index]].arrival - time.perf_counter()))
            continue
        outputs = engine.step().outputs
        now = time.perf_counter()
        for output in outputs:
            timing = timings[by_id[output.request_id]]
            if timing.first_token is None:
                timing.first_token = now
                timing.num_cached_tokens = output.num_cached_tokens
            timing.token_times.append(now)
            timing.num_output_tokens += len(output.new_token_ids)
            if output.finished:
                timing.finish = now
    return timings, max((t.finish or start) for t in timings) - start if timings else 0.0

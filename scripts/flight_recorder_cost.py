#!/usr/bin/env python3
"""Micro-benchmark: what the flight recorder adds to one engine step, in microseconds.

Runs the engine's own recording code (`_recorded_batch` and `EngineCore._record_step`) on a
synthetic step of B decoding requests (default 32, each with one sampled token; `--drafts K`
gives each K drafts and K + 1 sampled tokens) and a KV block event per request, many times,
and prints the mean cost per step next to the read side (`StepRecord.to_json`, paid by
/debug/steps readers, not by the engine). Compare it with a step's time (`/stats`, the
stats log line, or the record's own `duration_ms.total`): at c32 on the CPU a step takes
tens of milliseconds, so a few microseconds are far below 2%.

    .venv/bin/python scripts/flight_recorder_cost.py --batch 32 --steps 20000
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

from nanollmserve.engine.engine_core import EngineCore, _recorded_batch
from nanollmserve.engine.flight_recorder import FlightRecorder
from nanollmserve.engine.kv_cache import KVCacheManager
from nanollmserve.engine.messages import EngineCoreRequest, SampledToken
from nanollmserve.engine.request import Request
from nanollmserve.engine.scheduler import SchedulerOutput
from nanollmserve.sampling_params import SamplingParams


def synthetic_step(batch: int, drafts: int):
    requests = []
    for i in range(batch):
        core = EngineCoreRequest(f"req-{i}", list(range(100)), SamplingParams(max_tokens=64))
        request = Request(core, frozenset({0}), 64)
        request.num_computed_tokens = request.num_tokens - 1  # decoding
        requests.append(request)
    scheduled = SchedulerOutput(
        requests=requests,
        num_new_tokens=[1 + drafts] * batch,
        num_decodes=batch if not drafts else 0,
        spec_token_ids={r.request_id: [7] * drafts for r in requests} if drafts else {},
    )
    sampled = [[SampledToken(5) for _ in range(1 + drafts)] for _ in requests]
    return requests, scheduled, sampled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--drafts", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20000)
    args = parser.parse_args()
    requests, scheduled, sampled = synthetic_step(args.batch, args.drafts)
    recorder = FlightRecorder(4096, {}, 1024, 16)
    kv_cache = KVCacheManager(1024, 16, True)
    kv_cache.block_events = []
    engine = SimpleNamespace(
        kv_cache=kv_cache, scheduler=SimpleNamespace(waiting=[], running=requests)
    )
    start = time.perf_counter()
    for _ in range(args.steps):
        begun = time.perf_counter()
        batch = _recorded_batch(scheduled)
        for request in requests:  # what allocate_slots adds for a request that grew a block
            kv_cache.block_events.append((request.request_id, 1, 0, 0, 0))
        times = (begun, begun, begun, begun)
        EngineCore._record_step(engine, recorder, scheduled, batch, sampled, [], times)
    per_step_us = (time.perf_counter() - start) / args.steps * 1e6
    events_us = 0.0
    start = time.perf_counter()
    for _ in range(args.steps):
        for request in requests:
            kv_cache.block_events.append((request.request_id, 1, 0, 0, 0))
        kv_cache.block_events = []
    events_us = (time.perf_counter() - start) / args.steps * 1e6
    records = recorder.records()
    start = time.perf_counter()
    for record in records:
        json.dumps(record.to_json())
    read_us = (time.perf_counter() - start) / len(records) * 1e6
    print(
        json.dumps(
            {
                "batch": args.batch,
                "drafts": args.drafts,
                "record_us_per_step": round(per_step_us, 2),
                "of_which_block_events_us": round(events_us, 2),
                "read_us_per_step": round(read_us, 2),
            }
        )
    )


if __name__ == "__main__":
    main()

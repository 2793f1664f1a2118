"""The step flight recorder: one `StepRecord` per engine step in a bounded ring buffer.

`EngineCore` feeds it (`--step-record N` steps, default 4096; 0: no recorder at all). What a
step keeps is cheap by construction: references to lists the step built anyway (the sampled
tokens, the draft tokens, the arrivals' prompt token ids), one tuple per scheduled request,
a few floats and ints. Nothing is converted while the engine runs; `StepRecord.to_json()`
builds the documented schema (docs/features/flight-recorder.md) when someone reads the
record (`/debug/steps`, `nanollmserve trace export`, `nanollmserve replay`), on their thread.

Between two steps the recorder collects the engine's inputs in order: each admitted request
(its prompt token ids, sampling params, arrival time and LoRA adapter) and each abort. They
go into the next step's record, so a record from the engine's first step holds everything
needed to re-run it (`nanollmserve/replay.py`).

Reads (`header`, `records`) may come from any thread: the ring is swapped under a lock.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from nanollmserve.engine.messages import RequestFailure

RECORD_VERSION = 1
"""The schema version, in the header line; bumped when a field changes meaning."""


class StepRecord(NamedTuple):
    """What one step did, as the engine left it (raw: see `to_json` for the schema)."""

    step: int
    wall_time: float
    """time.time() when the step began."""
    durations: tuple[float, float, float, float]
    """Seconds spent proposing drafts, scheduling, in the model (forward + sampling), updating."""
    batch: list[tuple[str, int, int, bool]]
    """Per scheduled request: (request id, tokens scheduled, tokens it had left to compute
    before the step, whether a grammar masks its sampling)."""
    drafts: dict[str, list[int]]
    """Request id -> draft tokens scheduled (speculative decoding)."""
    sampled: list | None
    """Per scheduled request, what the runner sampled (None when nothing ran, or pooling)."""
    preemptions: list[tuple[str, str, str]]
    """(request id, reason, the request it made room for)."""
    finished: list[tuple[str, str]]
    """(request id, finish reason) of the requests this step finished."""
    block_events: list[tuple[str, int, int, int, int]]
    """(request id, blocks allocated, released, prefix-cache hits, cached blocks evicted)."""
    num_waiting: int
    num_running: int
    num_used_blocks: int
    inputs: list[tuple]
    """("add", request id, prompt token ids, SamplingParams, arrival time, LoRA name),
    ("abort", request ids) and ("sleep", level) that reached the engine since the previous
    step. The order of arrivals and aborts within one gap cannot change a schedule (adding
    allocates nothing, request ids are unique), so the schema lists them as `arrivals` and
    `aborts`; a sleep's place among the arrivals is kept (`sleeps`)."""

    def to_json(self) -> dict:
        """The record in the documented schema (one JSON object per step)."""
        propose, schedule, model, update = self.durations
        batch, prefill_tokens, decode_tokens, grammar_masks = [], 0, 0, 0
        sampled = self.sampled or [None] * len(self.batch)
        for (request_id, num_tokens, num_left, has_grammar), samples in zip(
            self.batch, sampled, strict=True
        ):
            drafts = self.drafts.get(request_id, ())
            decode = num_left == 1
            if decode:
                decode_tokens += num_tokens
            else:
                prefill_tokens += num_tokens
            token_ids = _token_ids(samples)
            if has_grammar and token_ids:
                grammar_masks += 1
            batch.append(
                {
                    "request_id": request_id,
                    "phase": "decode" if decode else "prefill",
                    "num_tokens": num_tokens,
                    "draft_proposed": len(drafts),
                    "draft_accepted": max(0, len(token_ids or ()) - 1) if drafts else 0,
                    "sampled_token_ids": token_ids,
                    "failed": isinstance(samples, RequestFailure),
                }
            )
        return {
            "type": "step",
            "step": self.step,
            "time": self.wall_time,
            "duration_ms": {
                "propose": propose * 1e3,
                "schedule": schedule * 1e3,
                "model": model * 1e3,
                "update": update * 1e3,
                "total": (propose + schedule + model + update) * 1e3,
            },
            "num_prefill_tokens": prefill_tokens,
            "num_decode_tokens": decode_tokens,
            "num_waiting": self.num_waiting,
            "num_running": self.num_running,
            "batch": batch,
            "preemptions": [
                {"request_id": rid, "reason": reason, "for_request_id": for_id}
                for rid, reason, for_id in self.preemptions
            ],
            "finished": [{"request_id": rid, "reason": reason} for rid, reason in self.finished],
            "kv_blocks": {
                "used": self.num_used_blocks,
                "requests": _block_events_json(self.block_events),
            },
            "grammar_masks": grammar_masks,
            "arrivals": [_arrival_json(item) for item in self.inputs if item[0] == "add"],
            "aborts": [rid for item in self.inputs if item[0] == "abort" for rid in item[1]],
            **_sleeps_json(self.inputs),
        }


class FlightRecorder:
    """The ring buffer of the last `capacity` steps, and the inputs since the last step."""

    def __init__(self, capacity: int, config: dict, num_kv_blocks: int, block_size: int):
        self.capacity = capacity
        self.config = config
        """The engine's configuration as JSON values (what `replay` rebuilds it from)."""
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.num_steps = 0
        self._steps: deque[StepRecord] = deque(maxlen=capacity)
        self._inputs: list[tuple] = []
        self._lock = threading.Lock()

    # -- the engine thread ----------------------------------------------------------------
    def add_arrival(self, request_id: str, prompt_token_ids, params, arrival_time, lora_name):
        self._inputs.append(("add", request_id, prompt_token_ids, params, arrival_time, lora_name))

    def add_aborts(self, request_ids: list[str]) -> None:
        self._inputs.append(("abort", tuple(request_ids)))

    def add_sleep(self, level: int) -> None:
        self._inputs.append(("sleep", level))

    def take_inputs(self) -> list[tuple]:
        inputs, self._inputs = self._inputs, []
        return inputs

    def append(self, record: StepRecord) -> None:
        with self._lock:
            self._steps.append(record)
        self.num_steps += 1

    # -- any thread -----------------------------------------------------------------------
    def header(self) -> dict:
        """The first line of a record: the engine it comes from and the steps it holds."""
        with self._lock:
            first = self._steps[0].step if self._steps else self.num_steps
        return {
            "type": "engine",
            "version": RECORD_VERSION,
            "config": self.config,
            "num_kv_blocks": self.num_kv_blocks,
            "block_size": self.block_size,
            "capacity": self.capacity,
            "first_step": first,
            "num_steps": self.num_steps,
        }

    def records(self, since: int = 0) -> list[StepRecord]:
        """The kept records of the steps numbered `since` and later (a copy)."""
        with self._lock:
            steps = list(self._steps)
        if steps and since > steps[0].step:
            steps = steps[since - steps[0].step :]
        return steps

    def last(self) -> StepRecord | None:
        with self._lock:
            return self._steps[-1] if self._steps else None

    def json_lines(self, since: int = 0) -> Iterator[str]:
        """The header, then the records from step `since`, as JSON lines (lazily)."""
        yield json.dumps(self.header()) + "\n"
        for record in self.records(since):
            yield json.dumps(record.to_json()) + "\n"

    def write(self, path: str | Path, since: int = 0) -> None:
        """Save the record as JSON lines: what `nanollmserve replay` and `trace export` read."""
        with open(path, "w") as f:
            f.writelines(self.json_lines(since))


def config_json(config) -> dict:
    """An EngineConfig as JSON values (its nested configs as dicts)."""
    values = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        values[field.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return values


def _token_ids(samples) -> list[int] | None:
    if samples is None or isinstance(samples, RequestFailure) or not isinstance(samples, list):
        return None
    return [sample.token_id for sample in samples]


def _block_events_json(events) -> list[dict]:
    """Per request: the sums of its block events since the previous step."""
    totals: dict[str, list[int]] = {}
    for request_id, *counts in events:
        total = totals.setdefault(request_id, [0, 0, 0, 0])
        for i, count in enumerate(counts):
            total[i] += count
    return [
        {"request_id": rid, "allocated": a, "freed": f, "prefix_hit": h, "evicted": e}
        for rid, (a, f, h, e) in totals.items()
    ]


def _sleeps_json(inputs: list[tuple]) -> dict:
    """`sleeps`, only in a step whose gap held one: each sleep's level and how many of the
    gap's arrivals came before it (a sleep empties the prefix cache, so where it falls
    changes what later requests find; the engine was empty, so those arrivals were aborted)."""
    sleeps, num_arrivals = [], 0
    for item in inputs:
        if item[0] == "add":
            num_arrivals += 1
        elif item[0] == "sleep":
            sleeps.append({"level": item[1], "after_arrivals": num_arrivals})
    return {"sleeps": sleeps} if sleeps else {}


def _arrival_json(item: tuple) -> dict:
    _, request_id, prompt_token_ids, params, arrival_time, lora_name = item
    return {
        "request_id": request_id,
        "prompt_token_ids": list(prompt_token_ids),
        "sampling_params": dataclasses.asdict(params),
        "arrival_time": arrival_time,
        "lora_name": lora_name,
    }

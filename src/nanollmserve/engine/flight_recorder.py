"""The step flight recorder: one `StepRecord` per engine step in a bounded ring buffer.

`EngineCore` feeds it (`--step-record N` steps, default 4096; 0: no recorder at all), and
the ring is bounded twice: by steps and by the bytes its records hold
(`--step-record-max-bytes`, default 64MiB, each record's size estimated when it is appended,
`record_bytes`). What a step keeps is cheap by construction: references to lists the step
built anyway (the sampled tokens, the draft tokens), one tuple per scheduled request, a few
floats and ints.

An arrival keeps its prompt's length and a keyed hash of its token ids, and its sampling
parameters without what a tenant wrote (stop strings, logit bias, schemas): enough for the
timeline, not for a replay. With `--step-record-prompts` it keeps the token ids and the full
sampling parameters, which `nanollmserve replay` needs. Either way a `cache_salt` is never
shown: only a short hash of it keyed by a secret of this process (`cache_salt_hash`), which
tells which requests shared a salt and serves a replay as a salt of its own.

Nothing is converted while the engine runs; `StepRecord.to_json()` builds the documented
schema (docs/features/flight-recorder.md) when someone reads the record (`/debug/steps`,
`nanollmserve trace export`, `nanollmserve replay`), on their thread.

Between two steps the recorder collects the engine's inputs in order: each admitted request
(its prompt token ids, sampling params, arrival time and LoRA adapter) and each abort. They
go into the next step's record, so a record from the engine's first step holds everything
needed to re-run it (`nanollmserve/replay.py`).

Reads (`header`, `records`) may come from any thread: the ring is swapped under a lock.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import threading
from array import array
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from nanollmserve.engine.messages import RequestFailure

RECORD_VERSION = 2
"""The schema version, in the header line; bumped when a field changes meaning (2: prompts
only with --step-record-prompts, `prompt_hash`, `cache_salt_hash`)."""

HASH_BYTES = 8
"""Keyed hashes (of prompts, of cache salts) are this many bytes, shown as hex."""

# What `record_bytes` charges, in bytes of Python objects (measured with sys.getsizeof on
# CPython 3.12, rounded up): a record with its tuples, lists, floats and dicts; a scheduled
# request's tuple and id; a sampled token; one top-logprob entry; a prompt token kept as a
# list slot and an int; an arrival's tuple, id, params and hash.
RECORD_BASE_BYTES = 1024
BATCH_ENTRY_BYTES = 192
SAMPLED_TOKEN_BYTES = 128
LOGPROB_ENTRY_BYTES = 96
PROMPT_TOKEN_BYTES = 36
ARRIVAL_BYTES = 1536

REDACTED_PARAMS = ("logit_bias", "stop", "stop_token_ids", "structured_outputs", "cache_salt")
"""Sampling parameters a record without prompts does not keep: what a tenant wrote (the
salt is never kept, see `cache_salt_hash`)."""


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
    """("add", request id, prompt (token ids, or (length, hash) without --step-record-prompts),
    SamplingParams (or their redacted dict), arrival time, LoRA name, cache salt hash),
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

    def __init__(
        self,
        capacity: int,
        config: dict,
        num_kv_blocks: int,
        block_size: int,
        max_bytes: int = 64 << 20,
        keep_prompts: bool = False,
    ):
        self.capacity = capacity
        self.max_bytes = max_bytes
        """The most bytes (`record_bytes`) the ring holds; the oldest steps go first."""
        self.keep_prompts = keep_prompts
        self.config = config
        """The engine's configuration as JSON values (what `replay` rebuilds it from)."""
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.num_steps = 0
        self.num_bytes = 0
        """The estimated bytes of the records in the ring."""
        self._steps: deque[tuple[StepRecord, int]] = deque()
        self._inputs: list[tuple] = []
        self._inputs_bytes = 0
        self._key = secrets.token_bytes(32)
        """Keys the prompt and salt hashes: they cannot be computed, or a guess checked,
        without it, and it never leaves the process."""
        self._lock = threading.Lock()

    # -- the engine thread ----------------------------------------------------------------
    def add_arrival(self, request_id: str, prompt_token_ids, params, arrival_time, lora_name):
        salt = params.cache_salt
        salt_hash = None if salt is None else self._hash(salt.encode())
        size = ARRIVAL_BYTES
        if self.keep_prompts:
            prompt = prompt_token_ids
            size += PROMPT_TOKEN_BYTES * len(prompt) + _params_bytes(params)
        else:
            prompt = (len(prompt_token_ids), self._hash(array("q", prompt_token_ids).tobytes()))
            params = _redacted_params(params)
        self._inputs_bytes += size
        self._inputs.append(("add", request_id, prompt, params, arrival_time, lora_name, salt_hash))

    def add_aborts(self, request_ids: list[str]) -> None:
        self._inputs.append(("abort", tuple(request_ids)))

    def add_sleep(self, level: int) -> None:
        self._inputs.append(("sleep", level))

    def take_inputs(self) -> list[tuple]:
        inputs, self._inputs = self._inputs, []
        return inputs

    def append(self, record: StepRecord) -> None:
        """Keep `record`, dropping the oldest ones past `capacity` steps or `max_bytes` (the
        newest is always kept: `replay` compares it)."""
        size = record_bytes(record) + self._inputs_bytes
        self._inputs_bytes = 0
        with self._lock:
            self._steps.append((record, size))
            self.num_bytes += size
            while len(self._steps) > 1 and (
                len(self._steps) > self.capacity or self.num_bytes > self.max_bytes
            ):
                self.num_bytes -= self._steps.popleft()[1]
        self.num_steps += 1

    def _hash(self, data: bytes) -> str:
        return hashlib.blake2b(data, digest_size=HASH_BYTES, key=self._key).hexdigest()

    # -- any thread -----------------------------------------------------------------------
    def header(self, hide_paths: bool = False) -> dict:
        """The first line of a record: the engine it comes from and the steps it holds.
        `hide_paths` (what API clients get, `/debug/steps`): the configuration's file system
        paths are None, their fields listed in `hidden_paths`."""
        with self._lock:
            first = self._steps[0][0].step if self._steps else self.num_steps
            num_bytes = self.num_bytes
        config, hidden = hide_config_paths(self.config) if hide_paths else (self.config, [])
        return {
            "type": "engine",
            "version": RECORD_VERSION,
            "config": config,
            **({"hidden_paths": hidden} if hidden else {}),
            "num_kv_blocks": self.num_kv_blocks,
            "block_size": self.block_size,
            "capacity": self.capacity,
            "max_bytes": self.max_bytes,
            "num_bytes": num_bytes,
            "prompts": self.keep_prompts,
            "first_step": first,
            "num_steps": self.num_steps,
        }

    def records(self, since: int = 0) -> list[StepRecord]:
        """The kept records of the steps numbered `since` and later (a copy)."""
        with self._lock:
            steps = [record for record, _ in self._steps]
        if steps and since > steps[0].step:
            steps = steps[since - steps[0].step :]
        return steps

    def last(self) -> StepRecord | None:
        with self._lock:
            return self._steps[-1][0] if self._steps else None

    def json_lines(self, since: int = 0, hide_paths: bool = False) -> Iterator[str]:
        """The header, then the records from step `since`, as JSON lines (lazily)."""
        yield json.dumps(self.header(hide_paths)) + "\n"
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


PATH_FIELDS = ("model", "tokenizer", "kv_offload_dir")
"""Configuration fields that name a file or directory (and `speculative_config.model`)."""


def hide_config_paths(config: dict) -> tuple[dict, list[str]]:
    """`config` without its file system paths (None in their place), and the fields hidden
    (`speculative_config.model` for a draft model's)."""
    config, hidden = dict(config), []
    for name in PATH_FIELDS:
        if config.get(name) is not None:
            config[name] = None
            hidden.append(name)
    spec = config.get("speculative_config")
    if isinstance(spec, dict) and spec.get("model") is not None:
        config["speculative_config"] = {**spec, "model": None}
        hidden.append("speculative_config.model")
    return config, hidden


def record_bytes(record: StepRecord) -> int:
    """An estimate of the memory `record` keeps alive (its arrivals are charged when they
    arrive), in O(batch) time: the per-object constants above, times what it holds."""
    size = RECORD_BASE_BYTES + BATCH_ENTRY_BYTES * len(record.batch)
    size += 64 * (len(record.preemptions) + len(record.finished) + len(record.block_events))
    size += sum(SAMPLED_TOKEN_BYTES * len(drafts) for drafts in record.drafts.values())
    for samples in record.sampled or ():
        if isinstance(samples, list):
            for sample in samples:
                size += SAMPLED_TOKEN_BYTES
                logprobs = getattr(sample, "logprobs", None)
                if logprobs is not None:
                    size += LOGPROB_ENTRY_BYTES * len(logprobs.token_ids)
    return size


def _params_bytes(params) -> int:
    """What a kept SamplingParams holds beyond its fixed fields (stop strings, logit bias,
    a schema), roughly."""
    size = 96 * (len(params.stop) + len(params.stop_token_ids) + len(params.logit_bias or ()))
    size += sum(len(stop) for stop in params.stop)
    if params.structured_outputs is not None:
        size += 4 * len(repr(params.structured_outputs))
    return size


def _redacted_params(params) -> dict:
    """The sampling parameters a record without prompts keeps: every scalar setting, and of
    the constraint only its kind."""
    values = {
        field.name: getattr(params, field.name)
        for field in dataclasses.fields(params)
        if field.name not in REDACTED_PARAMS and field.name != "kv_transfer_params"
    }
    structured = params.structured_outputs
    values["structured_outputs"] = None if structured is None else {"kind": structured.kind}
    values["num_stop"] = len(params.stop) + len(params.stop_token_ids)
    values["num_logit_bias"] = len(params.logit_bias or ())
    values["kv_transfer"] = params.kv_transfer_params is not None
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
    _, request_id, prompt, params, arrival_time, lora_name, salt_hash = item
    arrival = {"request_id": request_id}
    if isinstance(prompt, tuple):  # without --step-record-prompts: (length, keyed hash)
        arrival["num_prompt_tokens"], arrival["prompt_hash"] = prompt
        arrival["sampling_params"] = dict(params)
    else:
        arrival["num_prompt_tokens"] = len(prompt)
        arrival["prompt_token_ids"] = list(prompt)
        arrival["sampling_params"] = {**dataclasses.asdict(params), "cache_salt": None}
    arrival.update(arrival_time=arrival_time, lora_name=lora_name, cache_salt_hash=salt_hash)
    return arrival

"""Replay a flight record: re-run its arrivals through a fresh engine, step by step, and find
the first step whose schedule or tokens differ from the record.

A record (`FlightRecorder.json_lines`: `/debug/steps`, or `FlightRecorder.write`) holds the
engine's configuration (the header line) and, per step, the requests that arrived and were
aborted before it. The replay builds an engine from that configuration (with `overrides`, to
try another setting), applies each step's arrivals and aborts, steps once, and compares the
step's own record with the recorded one: the batch (request ids, tokens scheduled, phase,
drafts proposed and accepted, sampled token ids), the preemptions and the finished requests.
Timings and KV block numbers are not compared.

Unseeded sampling reproduces too: the sampler's generator starts from the configuration's
`seed` and is drawn in the same order when the schedule is the same. So a record must start
at the engine's first step (its ring must not have wrapped): `RecordError` otherwise.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass

from nanollmserve.errors import UserError
from nanollmserve.kv_transfer import KVTransferParams
from nanollmserve.sampling_params import SamplingParams
from nanollmserve.structured_outputs import StructuredOutputsParams, ThinkingSpan

COMPARED_STEP_FIELDS = ("batch", "preemptions", "finished")


class RecordError(UserError):
    """The record cannot be replayed (malformed, or it does not start at step 0)."""


@dataclass
class Record:
    header: dict
    steps: list[dict]


@dataclass
class ReplayResult:
    num_steps: int
    """Steps replayed (up to and including the first that differs)."""
    difference: str | None = None
    """None: every step matched; otherwise what differs, first step first."""

    @property
    def identical(self) -> bool:
        return self.difference is None


def read_record(lines: Iterable[str]) -> Record:
    header, steps = None, []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise RecordError(f"line {number} of the record is not JSON: {exc}") from None
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "engine":
            header = item
        elif kind == "step":
            steps.append(item)
        else:
            raise RecordError(f"line {number} of the record is neither an engine nor a step line")
    if header is None:
        raise RecordError("the record has no engine line (its first line)")
    return Record(header, steps)


def replay(record: Record, overrides: dict | None = None) -> ReplayResult:
    """Re-run `record` on a fresh engine built from its configuration plus `overrides`."""
    from nanollmserve.llm import LLM  # loads torch: only when a replay really runs

    _check_replayable(record)
    # The directory's contents at the time are not in the record, and a replay must not
    # write into it: prefixes come from the pool only, unless --kv-offload-dir is given.
    config = {**record.header["config"], "kv_offload_dir": None, **(overrides or {})}
    config["step_record"] = max(1, len(record.steps))
    llm = LLM(**config)
    try:
        return _replay_steps(llm, record.steps)
    except (KeyError, TypeError) as exc:
        raise RecordError(f"a step line of the record is malformed: {exc!r}") from None
    finally:
        llm.shutdown()


def _check_replayable(record: Record) -> None:
    """What a replay cannot reproduce fails before any model loads."""
    if "config" not in record.header:
        raise RecordError("the record's engine line has no config")
    if record.steps and record.steps[0].get("step") != 0:
        raise RecordError(
            f"the record starts at step {record.steps[0]['step']}, not at the engine's first "
            "step: the requests that arrived before it are lost (raise --step-record, or "
            "fetch /debug/steps before the ring wraps)"
        )
    for step in record.steps:
        for arrival in step.get("arrivals", ()):
            if arrival.get("lora_name"):
                raise RecordError(
                    f"request {arrival.get('request_id')!r} ran with the LoRA adapter "
                    f"{arrival['lora_name']!r}: a record does not hold adapters, so requests "
                    "with one cannot be replayed"
                )


def _replay_steps(llm, steps: list[dict]) -> ReplayResult:
    engine = llm.engine
    for number, recorded in enumerate(steps, 1):
        arrived = 0
        for sleep in recorded.get("sleeps", ()):  # the engine was empty: earlier ones aborted
            for arrival in recorded["arrivals"][arrived : sleep["after_arrivals"]]:
                engine.add_request(_core_request(llm, arrival))
            arrived = sleep["after_arrivals"]
            engine.abort_requests(recorded["aborts"])
            engine.sleep(sleep["level"])
            engine.wake_up()
        for arrival in recorded["arrivals"][arrived:]:
            engine.add_request(_core_request(llm, arrival))
        engine.abort_requests(recorded["aborts"])
        engine.step()
        replayed = engine.flight_recorder.last().to_json()
        difference = _first_difference(recorded, replayed)
        if difference is not None:
            return ReplayResult(number, f"step {recorded['step']}: {difference}")
    return ReplayResult(len(steps))


def _core_request(llm, arrival: dict):
    from nanollmserve.engine.messages import EngineCoreRequest

    params = sampling_params_from_json(arrival["sampling_params"])
    return EngineCoreRequest(
        request_id=arrival["request_id"],
        prompt_token_ids=list(arrival["prompt_token_ids"]),
        sampling_params=params,
        arrival_time=arrival["arrival_time"],
        lora_name=arrival["lora_name"],
        grammar=llm.input_processor.compile_grammar(params),
    )


def sampling_params_from_json(values: dict) -> SamplingParams:
    """The SamplingParams a record's arrival carried (`dataclasses.asdict` of them)."""
    values = dict(values)
    structured = values.get("structured_outputs")
    if structured is not None:
        structured = dict(structured)
        thinking = structured.pop("after_thinking", None)
        parsed = StructuredOutputsParams.from_value(structured)
        if thinking is not None:
            parsed = dataclasses.replace(parsed, after_thinking=ThinkingSpan(**thinking))
        values["structured_outputs"] = parsed
    if values.get("kv_transfer_params") is not None:
        values["kv_transfer_params"] = KVTransferParams(**values["kv_transfer_params"])
    return SamplingParams(**values)


def _first_difference(recorded: dict, replayed: dict) -> str | None:
    for field in COMPARED_STEP_FIELDS:
        if recorded[field] == replayed[field]:
            continue
        if field == "batch":
            return _batch_difference(recorded["batch"], replayed["batch"])
        return f"{field} differ: recorded {recorded[field]}, replayed {replayed[field]}"
    return None


def _batch_difference(recorded: list[dict], replayed: list[dict]) -> str:
    recorded_ids = [entry["request_id"] for entry in recorded]
    replayed_ids = [entry["request_id"] for entry in replayed]
    if recorded_ids != replayed_ids:
        return f"the batch differs: recorded requests {recorded_ids}, replayed {replayed_ids}"
    for old, new in zip(recorded, replayed, strict=True):
        if old != new:
            changed = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))
            detail = ", ".join(
                f"{key} recorded {old.get(key)!r}, replayed {new.get(key)!r}" for key in changed
            )
            return f"request {old['request_id']}: {detail}"
    return "the batch differs"

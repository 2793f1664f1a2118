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

A record is input from elsewhere, so it is checked before any model loads (`RecordError`,
exit 2, one line): its lines must have the schema's shape, its arrivals must hold their prompt
token ids (`--step-record-prompts`), and each arrival passes the admission a live request
passes (the input processor's checks, the default request and structured-output limits). A
configuration that would start processes (`tensor_parallel_size` > 1), size memory
(`kv_cache_memory`) or read a path other than the model (`tokenizer`, a draft model) is used
only with `trust_config` (`--trust-record-config`) or when the command line gives those
settings itself.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass

from nanollmserve.config import EngineConfig
from nanollmserve.errors import ParamError, UserError
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
    try:
        numbered = list(enumerate(lines, 1))
    except UnicodeDecodeError:
        raise RecordError("the record is not text (JSON lines in UTF-8)") from None
    for number, line in numbered:
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise RecordError(f"line {number} of the record is not JSON: {exc}") from None
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "engine":
            if header is not None:
                raise RecordError(f"line {number} of the record is a second engine line")
            header = item
        elif kind == "step":
            steps.append(item)
        else:
            raise RecordError(f"line {number} of the record is neither an engine nor a step line")
    if header is None:
        raise RecordError("the record has no engine line (its first line)")
    return Record(header, steps)


def replay(
    record: Record, overrides: dict | None = None, trust_config: bool = False
) -> ReplayResult:
    """Re-run `record` on a fresh engine built from its configuration plus `overrides`.
    `trust_config`: use the record's settings that start processes, size memory or name
    paths other than the model (refused otherwise, unless `overrides` give them)."""
    from nanollmserve.llm import LLM  # loads torch: only when a replay really runs

    overrides = overrides or {}
    _check_replayable(record)
    _check_config(record.header, overrides, trust_config)
    # The directory's contents at the time are not in the record, and a replay must not
    # write into it: prefixes come from the pool only, unless --kv-offload-dir is given.
    config = {**record.header["config"], "kv_offload_dir": None, **overrides}
    # The replayed engine keeps every step and the prompts (it compares each step's record).
    config.update(step_record=max(1, len(record.steps)), step_record_prompts=True)
    config["step_record_max_bytes"] = 1 << 40
    try:
        EngineConfig(**config)  # a malformed value fails here, before any model loads
    except (TypeError, ValueError, AttributeError) as exc:
        raise RecordError(f"the record's config is malformed: {exc}") from None
    llm = LLM(**config)
    try:
        return _replay_steps(llm, record.steps)
    except (KeyError, TypeError, AttributeError, IndexError) as exc:
        raise RecordError(f"a step line of the record is malformed: {exc!r}") from None
    finally:
        llm.shutdown()


def untrusted_settings(config: dict, overrides: dict) -> list[str]:
    """The record's settings a replay uses only when trusted: they start processes, size
    memory or name a path other than the model (those the command line gives are not the
    record's)."""
    found = []
    tp = config.get("tensor_parallel_size")
    if "tensor_parallel_size" not in overrides and tp not in (None, 1):
        found.append(f"tensor_parallel_size {tp} (starts {tp} processes)")
    for name in ("kv_cache_memory", "tokenizer"):
        if name not in overrides and config.get(name) is not None:
            found.append(f"{name} {config[name]!r}")
    spec = config.get("speculative_config")
    if (
        "speculative_config" not in overrides
        and isinstance(spec, dict)
        and spec.get("model") is not None
    ):
        found.append(f"a draft model {spec['model']!r}")
    return found


def _check_config(header: dict, overrides: dict, trust_config: bool) -> None:
    config = header["config"]
    unknown = sorted(set(config) - {f.name for f in dataclasses.fields(EngineConfig)})
    if unknown:
        raise RecordError(f"the record's config has unknown settings {unknown[:5]}")
    hidden = [
        name
        for name in header.get("hidden_paths", ())
        if name != "kv_offload_dir" and name.split(".")[0] not in overrides
    ]
    if hidden:
        flags = " ".join("--" + name.split(".")[0].replace("_", "-") for name in hidden)
        raise RecordError(
            f"the record hides its paths ({', '.join(hidden)}), as /debug/steps does: give "
            f"them on the command line ({flags})"
        )
    untrusted = untrusted_settings(config, overrides)
    if untrusted and not trust_config:
        raise RecordError(
            f"the record's config sets {'; '.join(untrusted)}: replay uses these only with "
            "--trust-record-config (or give them on the command line)"
        )


def _check_replayable(record: Record) -> None:
    """What a replay cannot reproduce fails before any model loads."""
    if not isinstance(record.header.get("config"), dict):
        raise RecordError("the record's engine line has no config object")
    for step in record.steps:
        _check_step_shape(step)
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
            if "prompt_token_ids" not in arrival:
                raise RecordError(
                    f"request {arrival.get('request_id')!r} (step {step['step']}) has no prompt "
                    "token ids: the record was made without --step-record-prompts, which a "
                    "replay needs (it keeps only prompt lengths and hashes)"
                )


def _check_step_shape(step: dict) -> None:
    """A step line has the fields a replay reads, of the schema's types."""
    number = step.get("step")
    if not isinstance(number, int) or isinstance(number, bool):
        raise RecordError(f"a step line has no step number: {str(number)[:40]!r}")
    for name in ("arrivals", "aborts"):
        if not isinstance(step.get(name), list):
            raise RecordError(f"step {number} of the record has no {name} list")
    for arrival in step["arrivals"]:
        if not isinstance(arrival, dict) or not isinstance(arrival.get("request_id"), str):
            raise RecordError(f"step {number} of the record has an arrival without a request id")
        ids = arrival.get("prompt_token_ids")
        if ids is not None and not isinstance(ids, list):
            raise RecordError(f"step {number}: request {arrival['request_id']!r} has no token list")
        if not isinstance(arrival.get("sampling_params", {}), dict):
            raise RecordError(f"step {number}: request {arrival['request_id']!r} has no params")
    for sleep in step.get("sleeps", ()):
        if not isinstance(sleep, dict) or not isinstance(sleep.get("after_arrivals"), int):
            raise RecordError(f"step {number} of the record has a malformed sleep")


def _replay_steps(llm, steps: list[dict]) -> ReplayResult:
    engine = llm.engine
    for number, recorded in enumerate(steps, 1):
        arrived = 0
        for sleep in recorded.get("sleeps", ()):  # the engine was empty: earlier ones aborted
            for arrival in recorded["arrivals"][arrived : sleep["after_arrivals"]]:
                _admit(llm, recorded["step"], arrival)
            arrived = sleep["after_arrivals"]
            engine.abort_requests(recorded["aborts"])
            engine.sleep(sleep["level"])
            engine.wake_up()
        for arrival in recorded["arrivals"][arrived:]:
            _admit(llm, recorded["step"], arrival)
        engine.abort_requests(recorded["aborts"])
        engine.step()
        replayed = engine.flight_recorder.last().to_json()
        difference = _first_difference(recorded, replayed)
        if difference is not None:
            return ReplayResult(number, f"step {recorded['step']}: {difference}")
    return ReplayResult(len(steps))


def _admit(llm, step: int, arrival: dict) -> None:
    """Add a recorded arrival as the server admits a request: its parameters, its prompt and
    its constraint pass the same checks (a RecordError naming it otherwise)."""
    try:
        for request in _admitted(llm, arrival).children:
            llm.engine.add_request(request)
    except (ParamError, ValueError, TypeError, KeyError) as exc:
        raise RecordError(
            f"request {arrival['request_id']!r} of step {step} would not be admitted: "
            f"{str(exc) or repr(exc)}"
        ) from None


def _admitted(llm, arrival: dict):
    """The recorded arrival (one engine request: a child `id#i` of an `n` request is
    recorded as its own) through the offline LLM's admission, the server's checks with
    `nanollmserve serve`'s default limits; its one child keeps the recorded id."""
    from nanollmserve.structured_output_limits import StructuredOutputLimits

    params = sampling_params_from_json(arrival["sampling_params"])
    if arrival.get("cache_salt_hash") is not None:  # the salt's keyed hash: the same sharing
        params.cache_salt = arrival["cache_salt_hash"]
    _, prompt_token_ids = llm.input_processor.tokenize(arrival["prompt_token_ids"])
    if params.structured_outputs is not None:
        StructuredOutputLimits().check(params.structured_outputs)
    arrival_time = arrival["arrival_time"]
    if not isinstance(arrival_time, (int, float)) or isinstance(arrival_time, bool):
        raise ValueError(f"arrival_time must be a number, got {str(arrival_time)[:40]!r}")
    return llm.admission.admit(
        arrival["request_id"],
        None,
        prompt_token_ids,
        params,
        lora_name=arrival["lora_name"],
        arrival_time=arrival_time,
    )


def sampling_params_from_json(values: dict) -> SamplingParams:
    """The SamplingParams a record's arrival carried (`dataclasses.asdict` of them)."""
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"sampling_params has unknown fields {unknown[:5]}")
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

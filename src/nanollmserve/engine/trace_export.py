"""A flight record as a Chrome trace (the JSON that ui.perfetto.dev and chrome://tracing open).

Process 1, "engine", has one track per phase of a step (propose, schedule, model, update)
and a `step` track whose slices span whole steps (their args: batch size, tokens, queue
lengths), plus counters for the queues and the KV blocks in use. Process 2, "requests",
has one track per request: a `queued` slice from its arrival to its first step, then a
slice per step it ran in (`prefill N` or `decode`, over the model phase of that step), and
instant markers where it found blocks in the prefix cache, was preempted, finished or was
aborted. No track's thread id is 0 or its process id: Perfetto takes either for the process's
main thread (merging the track into it, or labelling it "main thread").

Input: the step objects of a record (`nanollmserve/replay.py` reads them), in the schema of
docs/features/flight-recorder.md.
"""

from __future__ import annotations

ENGINE_PID, REQUESTS_PID = 1, 2
PHASES = ("propose", "schedule", "model", "update")
STEP_TID = 10  # the phases follow it: 11, 12, ...
FIRST_REQUEST_TID = 100  # request tracks: 100, 101, ...


def chrome_trace(steps: list[dict]) -> dict:
    """The Chrome trace event format's JSON object of these steps."""
    events: list[dict] = [
        _meta("process_name", ENGINE_PID, 0, "engine"),
        _meta("process_name", REQUESTS_PID, 0, "requests"),
        _meta("thread_name", ENGINE_PID, STEP_TID, "step"),
    ]
    for tid, phase in enumerate(PHASES, STEP_TID + 1):
        events.append(_meta("thread_name", ENGINE_PID, tid, phase))
    if not steps:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    origin = min([steps[0]["time"]] + [a["arrival_time"] for a in steps[0]["arrivals"]])
    request_tids: dict[str, int] = {}
    arrivals: dict[str, float] = {}

    def request_tid(request_id: str) -> int:
        if request_id not in request_tids:
            request_tids[request_id] = FIRST_REQUEST_TID + len(request_tids)
            events.append(_meta("thread_name", REQUESTS_PID, request_tids[request_id], request_id))
        return request_tids[request_id]

    for step in steps:
        start = (step["time"] - origin) * 1e6
        durations = step["duration_ms"]
        events.append(
            _slice(
                f"step {step['step']}",
                ENGINE_PID,
                STEP_TID,
                start,
                durations["total"] * 1e3,
                {
                    "batch_size": len(step["batch"]),
                    "prefill_tokens": step["num_prefill_tokens"],
                    "decode_tokens": step["num_decode_tokens"],
                    "waiting": step["num_waiting"],
                    "running": step["num_running"],
                    "preemptions": len(step["preemptions"]),
                    "grammar_masks": step["grammar_masks"],
                },
            )
        )
        phase_start = {}
        offset = start
        for tid, phase in enumerate(PHASES, STEP_TID + 1):
            phase_start[phase] = offset
            events.append(_slice(phase, ENGINE_PID, tid, offset, durations[phase] * 1e3))
            offset += durations[phase] * 1e3
        queues = {"waiting": step["num_waiting"], "running": step["num_running"]}
        events.append(_counter("queue", start, queues))
        events.append(_counter("kv_blocks", start, {"used": step["kv_blocks"]["used"]}))
        for arrival in step["arrivals"]:
            arrivals[arrival["request_id"]] = (arrival["arrival_time"] - origin) * 1e6
        for entry in step["batch"]:
            request_id = entry["request_id"]
            tid = request_tid(request_id)
            arrived = arrivals.pop(request_id, None)
            if arrived is not None:  # its first step: it queued since it arrived
                events.append(_slice("queued", REQUESTS_PID, tid, arrived, start - arrived))
            name = "decode" if entry["phase"] == "decode" else f"prefill {entry['num_tokens']}"
            if entry["draft_proposed"]:
                name += f" +{entry['draft_accepted']}/{entry['draft_proposed']} drafts"
            events.append(
                _slice(
                    name,
                    REQUESTS_PID,
                    tid,
                    phase_start["model"],
                    durations["model"] * 1e3,
                    {"step": step["step"], **entry},
                )
            )
        for blocks in step["kv_blocks"]["requests"]:
            if blocks["prefix_hit"]:
                tid = request_tid(blocks["request_id"])
                name = f"prefix hit ({blocks['prefix_hit']} blocks)"
                events.append(_instant(name, tid, start, blocks))
        for preemption in step["preemptions"]:
            tid = request_tid(preemption["request_id"])
            events.append(_instant(f"preempted ({preemption['reason']})", tid, start, preemption))
        for finished in step["finished"]:
            tid = request_tid(finished["request_id"])
            events.append(_instant(f"finished ({finished['reason']})", tid, offset, {}))
        for request_id in step["aborts"]:
            if request_id in request_tids:
                events.append(_instant("aborted", request_tids[request_id], start, {}))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _meta(name: str, pid: int, tid: int, value: str) -> dict:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": {"name": value}}


def _slice(name: str, pid: int, tid: int, ts: float, dur: float, args=None) -> dict:
    event = {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": max(dur, 0.0)}
    if args:
        event["args"] = args
    return event


def _counter(name: str, ts: float, values: dict) -> dict:
    return {"ph": "C", "name": name, "pid": ENGINE_PID, "tid": 0, "ts": ts, "args": values}


def _instant(name: str, tid: int, ts: float, args: dict) -> dict:
    event = {"ph": "i", "s": "t", "name": name, "pid": REQUESTS_PID, "tid": tid, "ts": ts}
    if args:
        event["args"] = args
    return event

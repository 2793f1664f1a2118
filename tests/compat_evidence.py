"""Evidence for the compatibility matrix (scripts/compat_matrix.py): a pytest plugin, loaded
by tests/conftest.py (not a test module).

A test that a `works` cell names shows that each of the cell's two features acted, with the
`compat` fixture and what it observed (a counter, a reply, a log line), not with what it asked
for:

    compat.exercised("spec", num_drafts=stats["spec_decode"]["num_drafts"])
    compat.exercised("lora", output=with_adapter, base=without_adapter)

Each call checks its proof (`PROOFS` below: drafts were made, the adapter changed the
output, ...) and fails the test when it does not hold; a test that a `refused` cell names
records the error it saw with `compat.refused("tp", "lora", str(error))`.
`pytest --compat-evidence PATH` writes, at the end of the session, every test's outcome and
what it recorded: {nodeid: {"outcome": ..., "features": [...], "refused": [...]}};
`scripts/compat_matrix.py --collect` runs the matrix's tests with it and fails a cell whose
test failed or did not show both features (or the refusal).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest

OPTION = "--compat-evidence"


def _nonempty_text(value, what: str) -> None:
    assert isinstance(value, str) and value, f"{what}: expected a non-empty text, got {value!r}"


def _quantization(name: str) -> Callable:
    def check(*, quantization: str) -> None:
        """`quantization`: what the loaded engine reports (`engine.loaded.quantization`, the
        ready line's `quantization=`, a record's config), not the flag asked for."""
        assert quantization == name, f"the engine ran quantization={quantization!r}, not {name}"

    return check


def _tp(*, ranks: int) -> None:
    """`ranks`: how many ranks were seen running (`ranks_in_log`, `ranks_running`)."""
    assert ranks >= 2, f"{ranks} tensor-parallel rank(s) ran: no sharding"


def _lora(*, output, base) -> None:
    """`output` with the adapter and `base` without it, for the same request."""
    assert output is not None and base is not None
    assert output != base, f"the adapter did not change the output: {output!r}"


def _spec(*, num_drafts: int) -> None:
    """`num_drafts`: the engine's count of requests' steps that got drafts checked."""
    assert num_drafts > 0, "no drafts were made: speculation did not run"


def _structured(*, output, choice=None, schema=None, regex=None) -> None:
    """`output` (text, or an already parsed JSON value) conforms to the one constraint given:
    a `choice` list, a JSON `schema`, or a `regex`."""
    assert [choice, schema, regex].count(None) == 2, "give exactly one of choice/schema/regex"
    if choice is not None:
        assert output in choice, f"{output!r} is none of {choice}"
    elif schema is not None:
        import jsonschema

        value = json.loads(output) if isinstance(output, str) else output
        jsonschema.validate(value, schema)
    else:
        assert isinstance(output, str) and re.fullmatch(regex, output), (output, regex)


def _grpc(*, reply) -> None:
    """`reply`: what the gRPC client got back: a message of the nanollmserve service, or the
    error the call ended with (grpc.RpcError)."""
    import grpc
    from google.protobuf.message import Message

    from nanollmserve.api.grpc_gen import nanollmserve_pb2 as pb

    if isinstance(reply, grpc.RpcError):
        assert reply.code() is not None
        return
    assert isinstance(reply, Message), f"not a gRPC reply: {type(reply)}"
    assert reply.DESCRIPTOR.file is pb.DESCRIPTOR, f"not a nanollmserve reply: {type(reply)}"


def _router(*, routed: int) -> None:
    """`routed`: the router's own count of requests it sent to the worker (its /stats)."""
    assert routed >= 1, "the router routed no request"


def _reasoning(*, reasoning_content) -> None:
    """`reasoning_content`: the thinking the parser split from the answer."""
    _nonempty_text(reasoning_content, "reasoning_content")


def _embed(*, embedding) -> None:
    """`embedding`: a vector the pooling runner returned."""
    values = [float(x) for x in embedding]
    assert values and all(math.isfinite(x) for x in values), "no finite embedding vector"
    assert any(values), "an all-zero embedding"


def _field(value, name: str):
    return value.get(name) if isinstance(value, dict) else getattr(value, name, None)


def _messages(*, message) -> None:
    """`message`: the `/v1/messages` reply (the SDK's object or its JSON): an Anthropic
    message with content blocks, or Anthropic's error envelope (`"type": "error"`), which no
    OpenAI route answers."""
    kind = _field(message, "type")
    assert kind in ("message", "error"), f"not an Anthropic message: {message!r}"
    if kind == "message":
        assert isinstance(_field(message, "content"), list)


def _priority(*, started=None, preempted=None, recorded=None, admitted=None, refused=None) -> None:
    """One of: `started`, (priority, first_scheduled_time) of requests in the order they were
    submitted: lower priorities started first, ahead of some submitted earlier; `preempted`,
    how many preemptions were recorded with reason "priority"; `recorded`, the non-zero
    priority of a request's arrival in the flight recorder (it reached the scheduler);
    `admitted`, (priority, HTTP status) of a non-zero priority a `--scheduling-policy
    priority` server answered (fcfs refuses it); `refused`, the error an fcfs server gave a
    non-zero priority."""
    given = {k: v for k, v in locals().items() if v is not None}
    assert len(given) == 1, "give exactly one of started/preempted/recorded/admitted/refused"
    if started is not None:
        assert len(started) >= 2
        for a_priority, a_time in started:
            for b_priority, b_time in started:
                if a_priority < b_priority:
                    assert a_time <= b_time, f"priority {b_priority} ran before {a_priority}"
        overtook = any(
            later[0] < earlier[0] and later[1] < earlier[1]
            for i, earlier in enumerate(started)
            for later in started[i + 1 :]
        )
        assert overtook, f"no request overtook an earlier one by its priority: {started}"
    elif preempted is not None:
        assert preempted > 0, "no preemption for a priority"
    elif recorded is not None:
        assert isinstance(recorded, int) and recorded != 0, f"recorded priority {recorded!r}"
    elif admitted is not None:
        priority, status = admitted
        assert priority != 0 and status == 200, f"priority {priority}: HTTP {status}"
    else:
        assert "priority" in str(refused), f"the error does not name priority: {refused!r}"


def _tokenio(*, token_ids=None, prompt_logprobs=None) -> None:
    """Token ids returned (`return_token_ids`, token-id prompts answered) and/or prompt
    logprobs returned."""
    assert token_ids is not None or prompt_logprobs is not None
    if token_ids is not None:
        assert token_ids and all(isinstance(t, int) for t in token_ids), token_ids
    if prompt_logprobs is not None:
        assert [p for p in prompt_logprobs if p], "no prompt logprobs"


def _recorder(*, records: int) -> None:
    """`records`: arrivals or steps the flight recorder holds for these requests."""
    assert records > 0, "the flight recorder holds nothing"


def _tracing(*, spans: int) -> None:
    """`spans`: request spans the exporter or the OTLP receiver got."""
    assert spans > 0, "no span was received"


KV_DTYPES = {"int8", "float16", "float8_e4m3fn", "float8_e5m2", "fp8_e4m3", "fp8_e5m2"}


def _kvdtype(*, kv_cache_dtype) -> None:
    """`kv_cache_dtype`: the KV pool's dtype as the engine made it (a torch dtype or its name,
    from the pool tensor or the log line `KV cache: ... <dtype> codes`)."""
    name = str(kv_cache_dtype).removeprefix("torch.")
    assert name in KV_DTYPES, f"the KV cache is {name}, not a quantized/narrow dtype"


def _sleep(*, asleep: bool) -> None:
    """`asleep`: the engine was seen asleep (its pool released, `/is_sleeping`, a 503
    `engine_sleeping`, a gRPC UNAVAILABLE naming the sleep)."""
    assert asleep is True, "the engine was not seen asleep"


def _offload(*, loaded_tokens: int) -> None:
    """`loaded_tokens`: prompt tokens read from the KV offload store (cached tokens that the
    pool no longer held)."""
    assert loaded_tokens > 0, "nothing was read from the KV offload store"


def _pd(*, phase_1: int) -> None:
    """`phase_1`: how far the router's phase-1 counter moved for the request(s)."""
    assert phase_1 >= 1, "the router ran no prefill phase"


STOP_TYPES = ("eos", "limit", "word")


def _llamacpp(*, completion) -> None:
    """`completion`: llama.cpp's native `/completion` answer (its JSON, or a stream's last
    event), a shape no OpenAI route has: `stop` true, a `stop_type`, and `timings` whose
    counts agree with `tokens_predicted` and `tokens_evaluated` (computed plus cached)."""
    assert isinstance(completion, dict), f"not a JSON answer: {completion!r}"
    assert "choices" not in completion and "object" not in completion, (
        f"an OpenAI shape, not llama.cpp's: {completion!r}"
    )
    assert completion.get("stop") is True, f"not a finished answer: {completion!r}"
    assert isinstance(completion.get("content"), str), completion
    assert completion.get("stop_type") in STOP_TYPES, completion.get("stop_type")
    predicted, evaluated = completion.get("tokens_predicted"), completion.get("tokens_evaluated")
    assert isinstance(predicted, int) and predicted >= 1, f"tokens_predicted {predicted!r}"
    assert isinstance(evaluated, int) and evaluated >= 1, f"tokens_evaluated {evaluated!r}"
    timings = completion.get("timings")
    assert isinstance(timings, dict), f"no timings: {completion!r}"
    assert timings["predicted_n"] == predicted, (timings, predicted)
    assert timings["prompt_n"] + timings["cache_n"] == evaluated, (timings, evaluated)


PROOFS: dict[str, Callable] = {
    "tp": _tp,
    "gguf": _quantization("gguf"),
    "int8": _quantization("int8"),
    "lora": _lora,
    "spec": _spec,
    "structured": _structured,
    "grpc": _grpc,
    "router": _router,
    "reasoning": _reasoning,
    "embed": _embed,
    "messages": _messages,
    "priority": _priority,
    "tokenio": _tokenio,
    "recorder": _recorder,
    "tracing": _tracing,
    "kvdtype": _kvdtype,
    "sleep": _sleep,
    "offload": _offload,
    "pd": _pd,
    "llamacpp": _llamacpp,
}


def ranks_in_log(log: str) -> int:
    """The world size a rank other than 0 reported ready with (`rank R of N`), else 1."""
    seen = [int(n) for r, n in re.findall(r"rank (\d+) of (\d+)", log) if int(r) > 0]
    return max(seen, default=1)


def ranks_running() -> int:
    """1 + the tensor-parallel rank processes this process has running now."""
    import multiprocessing

    children = multiprocessing.active_children()
    return 1 + sum(p.name.startswith("nanollmserve-tp-rank") for p in children)


def quantization_in_log(log: str) -> str | None:
    """The `quantization=` a server's ready line reports (what its engine loaded)."""
    found = re.findall(r"nanollmserve ready: .* quantization=(\S+) ", log)
    return found[-1] if found else None


def kv_dtype_in_log(log: str) -> str | None:
    """The dtype of the KV pool an engine logged (`KV cache: N blocks of T tokens, DTYPE`)."""
    found = re.findall(r"KV cache: \d+ blocks of \d+ tokens, (\S+?)[ ,(]", log)
    return found[-1] if found else None


class Evidence:
    """What the current test showed (the `compat` fixture). Each proof is kept in the test's
    `user_properties`, which its reports carry (to the controlling process under
    pytest-xdist too)."""

    ranks_in_log = staticmethod(ranks_in_log)
    ranks_running = staticmethod(ranks_running)
    quantization_in_log = staticmethod(quantization_in_log)
    kv_dtype_in_log = staticmethod(kv_dtype_in_log)

    def __init__(self, properties: list) -> None:
        self._properties = properties

    def exercised(self, feature: str, **proof) -> None:
        """Check `proof` of `feature` (see PROOFS) and record the feature as shown."""
        if feature not in PROOFS:
            raise KeyError(f"unknown feature {feature!r}: one of {sorted(PROOFS)}")
        PROOFS[feature](**proof)
        self._properties.append((FEATURE, feature))

    def refused(self, a: str, b: str, error: str) -> None:
        """Record that the pair (a, b) was refused with `error` (the text the test saw)."""
        for feature in (a, b):
            if feature not in PROOFS and feature != "cuda":
                raise KeyError(f"unknown feature {feature!r}")
        _nonempty_text(str(error), "the refusal's error")
        self._properties.append((REFUSED, {"pair": [a, b], "error": str(error)}))


FEATURE, REFUSED = "compat_feature", "compat_refused"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        OPTION,
        action="store",
        default=None,
        metavar="PATH",
        help="write each test's outcome and the compat features it showed to PATH (JSON)",
    )


@pytest.fixture
def compat(request: pytest.FixtureRequest) -> Evidence:
    """Record that this test ran a feature of the compatibility matrix, with its proof."""
    return Evidence(request.node.user_properties)


class _Outcomes:
    """Each test's outcome (failed if any phase failed) and what it showed, from its reports;
    the file at the end of the session."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.entries.setdefault(
            report.nodeid, {"outcome": None, "features": [], "refused": []}
        )
        if report.failed:
            entry["outcome"] = "failed"
        elif report.skipped and entry["outcome"] != "failed":
            entry["outcome"] = "skipped"
        elif report.when == "call" and entry["outcome"] is None:
            entry["outcome"] = "passed"
        for kind, value in report.user_properties:
            if kind == FEATURE and value not in entry["features"]:
                entry["features"].append(value)
            elif kind == REFUSED and value not in entry["refused"]:
                entry["refused"].append(value)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.path.write_text(json.dumps(self.entries, indent=1, sort_keys=True) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption(OPTION, default=None)
    if path and not hasattr(config, "workerinput"):  # the xdist controller, or no xdist
        config.pluginmanager.register(_Outcomes(Path(path)), "compat-evidence-outcomes")

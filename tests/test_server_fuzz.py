"""Schema fuzzing: schemathesis generates requests from /openapi.json, valid and invalid,
for every operation; none may get a 5xx. A bounded number of cases per operation and mode,
against a private server with a short context (so no generated request can run long),
on the tiny random-weight model.

A request that generates (no `max_tokens`: up to the 48-token context) can take over a
minute on a loaded shared CPU; one that only timed out is sent once more with a longer
read timeout, so a hang still fails (twice) and a slow machine does not."""

from __future__ import annotations

import pytest
import requests
import schemathesis
from cluster_process import tiny_model_dir
from hypothesis import HealthCheck, given, settings
from live_server import LiveServer
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

pytestmark = [pytest.mark.milestone("m02"), pytest.mark.slow]

MAX_EXAMPLES = 25
READ_TIMEOUT_S = 60
RETRY_READ_TIMEOUT_S = 240

OPERATIONS = [
    ("GET", "/health"),
    ("GET", "/stats"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/generate"),
    ("POST", "/batch_generate"),
]


@pytest.fixture(scope="module")
def fuzz_server():
    # The tiny random-weight model (the bundled tokenizer and chat template): the API is
    # under test, and the many generating cases then take a fraction of the time.
    server = LiveServer.start(
        str(tiny_model_dir()), "--max-model-len", "48", "--num-kv-blocks", "64",
        "--max-num-seqs", "8",
    )  # fmt: skip
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.log(), server.log()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


def _fuzz(operation, mode: GenerationMode) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    def check(case):
        try:
            case.call_and_validate(checks=[not_a_server_error], timeout=READ_TIMEOUT_S)
        except requests.exceptions.ReadTimeout:
            case.call_and_validate(checks=[not_a_server_error], timeout=RETRY_READ_TIMEOUT_S)

    check()


# Invalid inputs exist only for request bodies (the GET/DELETE parameters are any string).
CASES = [(method, path, GenerationMode.POSITIVE) for method, path in OPERATIONS] + [
    (method, path, GenerationMode.NEGATIVE) for method, path in OPERATIONS if method == "POST"
]


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=str)
def test_no_server_errors(api_schema, fuzz_server, method, path, mode):
    _fuzz(api_schema[path][method], mode)
    assert fuzz_server.stats()["is_healthy"]


def test_no_server_errors_on_other_operations(api_schema, fuzz_server):
    """Routes added after this list was written are fuzzed too."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    known = set(OPERATIONS)
    for operation in operations:
        if (operation.method.upper(), operation.path) not in known:
            _fuzz(operation, GenerationMode.POSITIVE)
    assert known <= {(op.method.upper(), op.path) for op in operations}
    assert fuzz_server.stats()["is_healthy"]

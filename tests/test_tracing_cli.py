"""The tracing flag (m24) as a user meets it, the CLI run as a subprocess: without the
OpenTelemetry packages, `--otlp-traces-endpoint` (or OpenTelemetry's or our environment
variable) fails at once as one line naming the extra, on `serve`, `router` and `cluster`;
bad URLs and protocols are one-line errors; without the flag nothing of OpenTelemetry's SDK
or exporters is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.milestone("m24"), pytest.mark.timeout(120)]

ENDPOINT = "http://127.0.0.1:9/v1/traces"

# Runs the CLI as if the OpenTelemetry SDK were not installed.
WITHOUT_OTEL = (
    "import sys; sys.modules['opentelemetry.sdk'] = None; "
    "from nanollmserve.cli.main import main; sys.exit(main(sys.argv[1:]))"
)
COMMANDS = {
    "serve": ["serve", "--port", "0"],
    "router": ["router", "--worker", "http://127.0.0.1:9", "--port", "0"],
    "cluster": ["cluster", "--workers", "1", "--router-port", "0"],
}


def _run(args: list[str], env: dict[str, str] | None = None, code: str = WITHOUT_OTEL):
    environ = {k: v for k, v in os.environ.items() if "OTLP" not in k and "OTEL" not in k}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=90,
    )


def _one_line_error(result, *words: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanollmserve: error:"), result.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_flag_without_the_packages_names_the_extra(command) -> None:
    result = _run([*COMMANDS[command], "--otlp-traces-endpoint", ENDPOINT])
    _one_line_error(result, "--otlp-traces-endpoint", "pip install 'nanollmserve[otel]'")


@pytest.mark.parametrize(
    "variable", ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "NANOLLMSERVE_OTLP_TRACES_ENDPOINT"]
)
def test_the_environment_turns_tracing_on_too(variable) -> None:
    result = _run(COMMANDS["serve"], env={variable: ENDPOINT})
    _one_line_error(result, "nanollmserve[otel]")


@pytest.mark.parametrize(
    "url",
    ["ftp://collector/v1/traces", "localhost:4318", "http:///v1/traces", "http://[::1", "h" * 5000],
)
def test_bad_endpoints_are_one_line_errors(url) -> None:
    result = _run([*COMMANDS["router"], "--otlp-traces-endpoint", url], code=_PLAIN)
    _one_line_error(result, "--otlp-traces-endpoint must be an http:// or https:// URL")


def test_a_bad_protocol_is_a_one_line_error() -> None:
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "thrift"}
    result = _run([*COMMANDS["serve"], "--otlp-traces-endpoint", ENDPOINT], env, code=_PLAIN)
    _one_line_error(result, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf or grpc")


_PLAIN = "import sys; from nanollmserve.cli.main import main; sys.exit(main(sys.argv[1:]))"

NOTHING_IMPORTED = """
import sys
from nanollmserve.cli.main import build_parser
from nanollmserve.router import RouterSettings, WorkerPool, create_router_app
import nanollmserve.api.app, nanollmserve.api.grpc_server

args = build_parser().parse_args(["router", "--worker", "http://127.0.0.1:9"])
from nanollmserve.cli.router import router_settings
settings = router_settings(args)
assert settings.tracer is None
create_router_app(WorkerPool(["http://127.0.0.1:9"]), settings)
loaded = [m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))]
loaded += [m for m in sys.modules if m.startswith("nanollmserve.tracing.spans")]
print(loaded)
"""


def test_without_the_flag_nothing_of_the_sdk_is_imported() -> None:
    result = _run([], code=NOTHING_IMPORTED)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

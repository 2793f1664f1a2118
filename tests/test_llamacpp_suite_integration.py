"""llama.cpp's own server tests as m30's measure (issue 44): `scripts/llamacpp-server-tests`
runs the files that tests/external/llamacpp_expected.toml marks `ci = true` against a live
server, and this test reads each file's junit XML.

It fails when a test fails that the TOML does not classify (`model`, `config` or
`refusal`), or when a file passes fewer tests than the TOML records. A classified test that
now passes is printed (a line to move in the TOML), not a failure.

The test files come from the pinned llama-cpp-python sdist, which the script downloads with
pip once into .peer/ (gitignored). Without a network the script exits 3: the test skips,
saying why, or fails in CI (CI set), as the other integration tests do for a missing
program. Run by `make test-integration`. The fetch (a 76 MB sdist, once per clone) is capped
at FETCH_TIMEOUT_S; the run (the server's start and the selected files) at RUN_TIMEOUT_S,
four minutes: the selection leaves out the tests whose outcome depends on machine speed
(requests without a token limit), each with its reason in the TOML.
"""

from __future__ import annotations

import os
import signal
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from apt_binary import missing_prerequisite
from live_server import free_port

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

pytestmark = [pytest.mark.integration, pytest.mark.milestone("m30")]

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = ROOT / "tests" / "external" / "llamacpp_expected.toml"
SCRIPT = ROOT / "scripts" / "llamacpp-server-tests"
NO_NETWORK = 3  # the script's exit status when pip cannot fetch the sdist or `wget`
FETCH_TIMEOUT_S = 180
RUN_TIMEOUT_S = 240


def expected() -> dict:
    return tomllib.loads(EXPECTED.read_text())


def outcomes(xml: Path) -> dict[str, str]:
    """Each test of one junit XML file: its name (`test_x[param]`) to passed/failed/skipped."""
    root = ET.parse(xml).getroot()
    result = {}
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            result[case.get("name")] = "failed"
        elif case.find("skipped") is not None:
            result[case.get("name")] = "skipped"
        else:
            result[case.get("name")] = "passed"
    return result


def run_script(
    files: list[str], deselect: list[str], results: Path, **extra_env: str
) -> subprocess.Popen:
    env = {
        **os.environ,
        **extra_env,
        "LLAMACPP_TESTS_PORT": str(free_port()),
        "LLAMACPP_TESTS_RESULTS": str(results),
        # their ids are whitespace-free (checked in test_ci_selection_is_well_formed)
        "PYTEST_ARGS": " ".join(f"--deselect=unit/{test}" for test in deselect),
    }
    return subprocess.Popen(
        [str(SCRIPT), *files],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so a timeout stops the server and pytest with it
    )


def test_ci_selection_is_well_formed():
    table = expected()
    classes = {"model", "config", "refusal"}
    for name, entry in table["files"].items():
        assert name.startswith("test_") and name.endswith(".py"), name
        if not entry["ci"]:
            assert entry.get("why_not_ci"), f"{name}: say why it is not in CI"
            continue
        assert entry["passed"] >= 0
        for test, failure in entry.get("failures", {}).items():
            assert failure["class"] in classes, (name, test)
            assert failure.get("why"), (name, test)
            if failure["class"] == "refusal":
                assert (ROOT / failure["where"].split("#")[0]).is_file(), (name, test)
        for test, why in entry.get("deselect", {}).items():
            assert why and not any(c.isspace() for c in test), (name, test)


def finish(process: subprocess.Popen, timeout: float, what: str) -> str:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
        pytest.fail(f"{what} ran past {timeout} s:\n{output[-4000:]}")
    if process.returncode == NO_NETWORK:
        missing_prerequisite(f"no network for the llama-cpp-python sdist: {output[-1000:]}")
    assert process.returncode == 0, output[-4000:]
    return output


@pytest.mark.timeout(FETCH_TIMEOUT_S + RUN_TIMEOUT_S + 60)
def test_llamacpp_server_tests_pass_as_recorded(tmp_path):
    fetch = run_script([], [], tmp_path / "fetch", LLAMACPP_TESTS_FETCH_ONLY="1")
    finish(fetch, FETCH_TIMEOUT_S, "fetching llama.cpp's tests")
    table = expected()
    files = {name: entry for name, entry in table["files"].items() if entry["ci"]}
    deselect = [
        f"{name}::{test}" for name, entry in files.items() for test in entry.get("deselect", {})
    ]
    results = tmp_path / "results"
    output = finish(run_script(list(files), deselect, results), RUN_TIMEOUT_S, "llama.cpp's tests")
    print(output)

    problems, now_passing = [], []
    for name, entry in files.items():
        xml = results / f"{name.removesuffix('.py')}.xml"
        assert xml.is_file(), f"{name}: no junit XML\n{output[-4000:]}"
        seen = outcomes(xml)
        classified = entry.get("failures", {})
        for test, outcome in sorted(seen.items()):
            if outcome == "failed" and test not in classified:
                log = (results / f"{name.removesuffix('.py')}.log").read_text()
                problems.append(f"{name}::{test} failed and is not classified\n{log[-3000:]}")
            if outcome == "passed" and test in classified:
                now_passing.append(f"{name}::{test} (classified {classified[test]['class']})")
        passed = sum(outcome == "passed" for outcome in seen.values())
        print(f"{name}: {passed} passed (recorded {entry['passed']}), {len(seen)} run")
        if passed < entry["passed"]:
            problems.append(f"{name}: {passed} passed, fewer than the {entry['passed']} recorded")
    for line in now_passing:
        print(f"now passing, move it out of the failures in {EXPECTED.name}: {line}")
    assert not problems, "\n".join(problems)

"""docs/features/coming-from-llamacpp.md stays true: every flag of ours its flag table names
exists (`nanollmserve serve --help`, the CLI as a subprocess), and every endpoint row of its
endpoint table answers as the row says on the shared live server (served: neither 404 nor
405; refused: that status; not served: 404 or 405)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import shared_server

pytestmark = pytest.mark.milestone("m30")

PAGE = Path(__file__).parent.parent / "docs" / "features" / "coming-from-llamacpp.md"


def table(heading: str) -> list[list[str]]:
    """The rows (cells) of the first table after `## heading`."""
    lines = PAGE.read_text().split(f"## {heading}\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| "))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("| ")), None)
    rows = lines[start:end]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]
    return [c for c in cells[2:] if c]  # past the header and the rule


def requests_of(cell: str) -> list[tuple[str, str]]:
    """(method, path) for each path in an endpoint cell: "`GET`, `POST /x`" is both methods
    on /x; a path without a method takes the previous path's (POST at first)."""
    found, methods, pending = [], ["POST"], []
    for token in re.findall(r"`([^`]+)`", cell):
        match = re.fullmatch(r"(?:(GET|POST) ?)?(/\S*)?", token.replace("\\|", "|"))
        if match is None or not any(match.groups()):
            continue
        method, path = match.groups()
        if path is None:
            pending.append(method)
            continue
        if method:
            methods, pending = [*pending, method], []
        found += [(m, path) for m in methods]
    return found


def test_the_flags_of_ours_in_the_flag_table_exist():
    help_text = subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", "serve", "--help"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    rows = table("Flags")
    assert len(rows) > 15
    named = [flag for _, ours, _ in rows for flag in re.findall(r"`(--[a-z-]+)", ours)]
    assert len(named) > 15
    missing = [flag for flag in named if flag not in help_text]
    assert not missing, missing


def test_the_endpoint_table_says_what_the_server_answers():
    rows = table("Endpoints")
    assert len(rows) > 15
    checked = 0
    with shared_server().client() as client:
        for endpoint, here, _ in rows:
            for method, path in requests_of(endpoint):
                path = re.sub(r"\{[a-z_]+\}", "0", path)
                path = re.sub(r"\?action=([a-z]+).*", r"?action=\1", path)
                response = client.request(method, path, json={} if method == "POST" else None)
                status = response.status_code
                if here.startswith("served"):
                    assert status not in (404, 405), (method, path, status)
                elif here.startswith("refused"):
                    assert status == int(here.split()[-1]), (method, path, status)
                else:
                    assert status in (404, 405), (method, path, status)
                checked += 1
    assert checked > 20

"""The examples of program output in the docs are the program's output (m29, issue 42).

- Every `nanollmserve ready:` line in README.md and docs/ carries the fields a real start on
  the default flags logs (`kv_blocks=`, `dtype=`, ...): a default that changes fails here
  until the docs follow.
- Every `nanollmserve info` listing of the bundled model is what `nanollmserve info` prints.
- Every `--help` text that names the values of a flag names all the values it accepts:
  those of argparse's `choices`, and those an `EngineConfig` field's check accepts.

In a documented example, `...` stands for any text (a cache path, a version); the ready
line's `ready_in=` is a timing of the machine that logged it and is not compared.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from live_server import LiveServer

pytestmark = pytest.mark.milestone("m29")

ROOT = Path(__file__).resolve().parents[1]
READY = "nanollmserve ready:"
INFO_FIRST_LINE = re.compile(r"^model {2,}\S")


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def matches(documented: str, actual: str) -> bool:
    """`documented` equals `actual`, each `...` in it standing for any text."""
    pattern = ".*".join(re.escape(part) for part in documented.split("..."))
    return re.fullmatch(pattern, actual) is not None


def ready_line_fields(text: str) -> dict[str, str]:
    """The `key=value` fields of a ready line (from the text after `nanollmserve ready:`, up to
    the end of its code span or paragraph; a line break inside it is a space)."""
    text = re.split(r"`|\n\s*\n", text, maxsplit=1)[0]
    return dict(re.findall(r"(\w+)=(\S+)", text))


def documented_ready_lines() -> list[tuple[str, dict[str, str]]]:
    found = []
    for page in doc_pages():
        text = page.read_text()
        for match in re.finditer(re.escape(READY), text):
            where = f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
            fields_ = ready_line_fields(text[match.end() : match.end() + 600])
            if fields_:  # a mention of the line, not an example of it
                found.append((where, fields_))
    return found


TIMINGS = {"ready_in"}
"""Fields that are a measurement of the machine: an example's value stands as it is."""


def ready_line_mismatches(documented: dict[str, str], actual: dict[str, str]) -> list[str]:
    return [
        f"{key}={value} (a default start logs {key}={actual.get(key)})"
        for key, value in documented.items()
        if key not in actual or (key not in TIMINGS and not matches(value, actual[key]))
    ]


def documented_info_listings() -> list[tuple[str, list[str]]]:
    """Fenced blocks whose first line is `model   <name>`: the output of `nanollmserve info`."""
    found = []
    for page in doc_pages():
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            if (
                line.strip() == "```"
                and number + 1 < len(lines)
                and INFO_FIRST_LINE.match(lines[number + 1])
            ):
                block = []
                for body in lines[number + 1 :]:
                    if body.startswith("```"):
                        break
                    block.append(body)
                found.append((f"{page.relative_to(ROOT)}:{number + 2}", block))
    return found


def info_mismatches(documented: list[str], actual: list[str]) -> list[str]:
    rows = dict(re.split(r" {2,}", line.strip(), maxsplit=1) for line in actual if line.strip())
    problems = []
    for line in documented:
        key, value = re.split(r" {2,}", line.strip(), maxsplit=1)
        if key not in rows:
            problems.append(f"{key}: `info` prints no such line")
        elif not matches(value, rows[key]):
            problems.append(f"{key}: documented {value!r}, `info` prints {rows[key]!r}")
    return problems


def test_every_documented_ready_line_is_what_a_default_start_logs() -> None:
    documented = documented_ready_lines()
    assert len(documented) >= 3, documented  # getting-started, cli.md, api/server.md at least
    server = LiveServer.start()  # the default flags, as `make serve` runs them
    try:
        line = next(line for line in server.log().splitlines() if READY in line)
    finally:
        server.stop()
    actual = ready_line_fields(line.split(READY, 1)[1])
    assert {"kv_blocks", "dtype", "quantization", "max_model_len"} <= actual.keys(), line
    problems = {
        where: wrong
        for where, fields_ in documented
        if (wrong := ready_line_mismatches(fields_, actual))
    }
    assert not problems, f"ready lines in the docs differ from a real start ({line}): {problems}"


def test_every_documented_info_listing_is_what_info_prints() -> None:
    documented = documented_info_listings()
    assert documented, "docs/cli.md shows the `info` of the bundled model"
    result = subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", "info"],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    actual = result.stdout.splitlines()
    problems = {
        where: wrong for where, block in documented if (wrong := info_mismatches(block, actual))
    }
    assert not problems, f"`info` listings in the docs differ from `nanollmserve info`: {problems}"


def test_the_comparisons_catch_a_stale_example() -> None:
    """The old examples of issue 42 fail: 1456 blocks (float32 K/V) and a float32 K/V cache."""
    actual = {"kv_blocks": "2912x16", "dtype": "float32", "ready_in": "2.1s"}
    stale = ready_line_fields("http://127.0.0.1:8000 dtype=float32 kv_blocks=1456x16 ready_in=2.9s")
    assert ready_line_mismatches(stale, actual) == [
        "kv_blocks=1456x16 (a default start logs kv_blocks=2912x16)"
    ]
    assert ready_line_mismatches({"kv_blocks": "2912x16", "ready_in": "9.9s"}, actual) == []
    assert ready_line_mismatches({"kv_blocks": "...x16", "kv_pool": "1"}, actual) == [
        "kv_pool=1 (a default start logs kv_pool=None)"
    ]
    assert info_mismatches(
        ["kv cache         46,080 bytes per token (float32)"],
        ["kv cache         23,040 bytes per token (float16)"],
    )


# -- help texts ---------------------------------------------------------------------------


def help_actions(parser: argparse.ArgumentParser, path: str):
    """(command, flag, action) for every flag of every subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from help_actions(sub, f"{path} {name}")
        elif action.help not in (None, argparse.SUPPRESS):
            yield path, "/".join(action.option_strings) or action.dest, action


def engine_field_values() -> dict[str, list[str]]:
    """The values each `EngineConfig` field accepts, as its own check states them when it
    refuses one ("kv_cache_dtype must be auto | float32 | ..., got 'x'")."""
    from nanollmserve.config import EngineConfig
    from nanollmserve.errors import UserError

    values = {}
    for field in fields(EngineConfig):
        if "str" not in str(field.type):
            continue
        try:
            EngineConfig(**{field.name: "not-a-value"})
        except UserError as error:
            stated = re.fullmatch(
                rf"{field.name} must be (.+?)(?: \(or unset\))?, got 'not-a-value'", str(error)
            )
            listed = re.split(r" \| | or ", stated.group(1)) if stated else []
            if listed and all(re.fullmatch(r"[\w.:-]+", value) for value in listed):
                values[field.name] = listed
    return values


def names(text: str, value: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(value)}(?![\w-])", text) is not None


def help_value_problems(actions, engine_values: dict[str, list[str]]) -> list[str]:
    """A flag whose help lists values (`a | b | c`, the docs' form) must list each value its
    parser accepts; an engine flag (no argparse choices, so usage shows none) must name them
    all in its help."""
    problems = []
    for command, flag, action in actions:
        text = action.help or ""
        accepted = list(action.choices or ()) or engine_values.get(action.dest, [])
        if not accepted:
            continue
        lists_values = " | " in text or (action.dest in engine_values and not action.choices)
        missing = [value for value in accepted if not names(text, str(value))]
        if lists_values and missing:
            problems.append(f"{command} {flag}: the help does not name {', '.join(missing)}")
    return problems


def test_every_help_text_names_all_the_values_its_flag_accepts() -> None:
    from nanollmserve.cli.main import build_parser

    engine_values = engine_field_values()
    assert {"kv_cache_dtype", "scheduling_policy", "quantization", "runner"} <= set(engine_values)
    assert "float16" in engine_values["kv_cache_dtype"]
    problems = help_value_problems(help_actions(build_parser(), "nanollmserve"), engine_values)
    assert not problems, problems


def test_the_help_check_catches_the_old_kv_cache_dtype_text() -> None:
    """Issue 42: `--kv-cache-dtype`'s help said `auto | int8 | fp8...`, leaving out float32 and
    float16."""
    old = argparse.ArgumentParser().add_argument(
        "--kv-cache-dtype",
        help="auto (the model's dtype) | int8 | fp8_e4m3 | fp8_e5m2 (fp8 = fp8_e4m3): K and V",
    )
    values = {"kv_cache_dtype": ["auto", "float32", "float16", "int8", "fp8", "fp8_e4m3"]}
    assert help_value_problems([("serve", "--kv-cache-dtype", old)], values) == [
        "serve --kv-cache-dtype: the help does not name float32, float16"
    ]


def test_the_docs_list_every_subcommand() -> None:
    """docs/cli.md's command list is `nanollmserve --help`'s, and the docs home names every
    subcommand (issue 42: `trace`, `replay`, `router` and `cluster` were left out)."""
    from nanollmserve.cli.main import build_parser

    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    cli = (ROOT / "docs/cli.md").read_text()
    row = next(
        line
        for line in (ROOT / "docs/index.md").read_text().splitlines()
        if line.startswith("| [Command line]")
    )
    for choice in commands._choices_actions:
        line = rf"^  {re.escape(choice.dest)} +{re.escape(choice.help)}$"
        assert re.search(line, cli, re.MULTILINE), f"docs/cli.md does not list {choice.dest}"
        assert f"`{choice.dest}`" in row, f"docs/index.md does not name {choice.dest}"

"""Checks that every `nanollmserve ...` command line in the docs parses with the real CLI.

Reads the fenced code blocks of README.md and docs/**/*.md, joins backslash-continued lines,
splits each line at shell operators (`|`, `&&`, `;`, `&`, redirections), drops what runs
before the program (`$ ` prompts, `VAR=value`, `nice -n 10`, `timeout 60`, ...) and parses
every command whose program is `nanollmserve` with `nanollmserve.cli.main.build_parser()`,
as `nanollmserve` itself would, without running anything (the flags `cluster` passes
on to its workers parse as `serve` flags). Placeholders (`MODEL_DIR`, `$PORT`)
parse as the words they are; `$NAME` set earlier in the same block (`NAME="--flags"`)
expands. Not commands, so skipped: usage synopses (`[--flag X]`, `{a,b}`) and log lines
(`nanollmserve ready: ...`). Run by `make check` (scripts/check) and tests/test_docs_checks.py.
Prints one line per command that fails and exits 1 when any does.
Usage: python scripts/check_doc_commands.py [REPO_ROOT]
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FENCE_RE = re.compile(r"^\s*(```|~~~)")
SHELL_OPERATORS = {"|", "||", "&", "&&", ";", ">", ">>", "<", "2>", "2>&1", "&>", "("}
# Programs that run the next word as the command, with how many option words they take.
WRAPPERS = {"nice": {"-n"}, "timeout": set(), "taskset": {"-c"}, "time": set(), "env": set()}
ASSIGNMENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SYNOPSIS_RE = re.compile(r"\s\[[-A-Za-z.]|\s\{\w+,")


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def code_lines(text: str) -> Iterator[tuple[int, str, int]]:
    """(line number, logical line, block number) of every fenced code block, continuations
    joined."""
    in_block, pending, start, block = False, "", 0, 0
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE_RE.match(line):
            in_block, pending, block = not in_block, "", block + 1
            continue
        if not in_block:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line, block
        pending = ""


def commands(line: str, variables: dict[str, list[str]]) -> Iterator[list[str]]:
    """The argument lists (after the program name) of the `nanollmserve` commands of a line.
    A line that only assigns variables records them in `variables`."""
    if SYNOPSIS_RE.search(line):
        return
    lexer = shlex.shlex(line.strip().removeprefix("$ "), posix=True, punctuation_chars="|&;<>(")
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # an unclosed quote: a fragment, not a command line
        return
    if words and all(ASSIGNMENT_RE.match(word) for word in words):
        for word in words:
            name, _, value = word.partition("=")
            variables[name] = shlex.split(value)
        return
    segment: list[str] = []
    for word in [*words, ";"]:
        if word in SHELL_OPERATORS or word.startswith((">", "<", "2>")):
            argv = _program_argv(segment)
            if argv is not None and not (argv and argv[0].endswith(":")):  # a log line
                yield argv
            segment = []
        elif word.startswith("$") and word[1:] in variables:
            segment.extend(variables[word[1:]])
        else:
            segment.append(word)


def _program_argv(words: list[str]) -> list[str] | None:
    i = 0
    while i < len(words):
        word = words[i]
        if ASSIGNMENT_RE.match(word):
            i += 1
        elif word in WRAPPERS:
            i += 1
            while i < len(words) and (words[i].startswith("-") or words[i][:1].isdigit()):
                i += 2 if words[i] in WRAPPERS[word] else 1
        else:
            break
    if i < len(words) and Path(words[i]).name == "nanollmserve":
        return words[i + 1 :]
    return None


def parse_error(argv: list[str]) -> str | None:
    """None when `nanollmserve ARGV` parses, else argparse's message."""
    from nanollmserve.cli.main import build_parser

    parser = build_parser()
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            args, extra = parser.parse_known_args(argv)
            if extra and not getattr(args, "takes_extra_args", False):
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            if extra:  # `cluster` gives the flags it does not know to its `serve` workers
                build_parser().parse_args(["serve", *extra])
    except SystemExit as exc:
        if exc.code not in (0, None):  # --help exits 0
            lines = stderr.getvalue().strip().splitlines()
            return lines[-1] if lines else f"exit status {exc.code}"
    return None


def check(root: Path) -> tuple[int, list[str]]:
    """(commands checked, one message per command that does not parse)."""
    count, errors = 0, []
    for path in doc_files(root):
        if not path.is_file():
            continue
        variables: dict[str, list[str]] = {}
        current_block = 0
        for number, line, block in code_lines(path.read_text()):
            if block != current_block:
                variables, current_block = {}, block
            for argv in commands(line, variables):
                count += 1
                error = parse_error(argv)
                if error:
                    where = path.relative_to(root).as_posix()
                    errors.append(f"{where}:{number}: nanollmserve {shlex.join(argv)}: {error}")
    return count, errors


def main(argv: list[str]) -> int:
    root = Path(argv[0]).resolve() if argv else ROOT
    count, errors = check(root)
    for error in errors:
        print(f"check_doc_commands: {error}")
    if errors:
        print(f"check_doc_commands: {len(errors)} of {count} command line(s) do not parse")
        return 1
    print(f"check_doc_commands: ok ({count} command lines parse)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

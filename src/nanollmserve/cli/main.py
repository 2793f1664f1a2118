"""Entry point of the `nanollmserve` command: builds the parser from the subcommand modules.

Each subcommand lives in its own module under `nanollmserve.cli` and exposes
`register(subparsers)`, which adds its parser and sets `func` to the function that runs it.
Errors a user can fix (a bad path, a bad flag value) are raised as `UserError` and printed as
one line, not a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from nanollmserve.errors import UserError

SUBCOMMAND_MODULES = [
    "nanollmserve.cli.info",
    "nanollmserve.cli.generate",
    "nanollmserve.cli.bench",
    "nanollmserve.cli.serve",
    "nanollmserve.cli.profile",
    "nanollmserve.cli.router",
    "nanollmserve.cli.cluster",
    "nanollmserve.cli.trace",
    "nanollmserve.cli.replay",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanollmserve",
        description="An OpenAI-compatible LLM inference server written from scratch in Python.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra_args = parser.parse_known_args(argv)
    if extra_args and not getattr(args, "takes_extra_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra_args)}")
    args.extra_args = extra_args  # `cluster` passes them to its workers as serve flags
    args.argv = sys.argv[1:] if argv is None else list(argv)  # bench records its command
    if args.version:
        from nanollmserve import __version__

        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"nanollmserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""`nanollmserve replay RECORD`: re-run a flight record's arrivals through a fresh engine and
report the first step whose schedule or tokens differ (`nanollmserve/replay.py`).

RECORD is the JSON lines of `/debug/steps` (or `write_record`), taken from the engine's first
step, by a server started with --step-record-prompts (a record without prompts holds their
lengths and hashes only). The engine is built from the record's configuration; engine flags
given here override it (`--max-num-seqs 1`: would the run have gone the same with one
sequence at a time?). Settings of the record that start processes (--tensor-parallel-size),
size memory (--kv-cache-memory) or read a path other than the model (--tokenizer, a draft
model) are used only with --trust-record-config, or when given here. Each arrival is checked
as the server checks a request.
Exit status 0: every step matched; 1: the first difference is printed; 2: the record cannot
be replayed (one line says why).
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from nanollmserve.config import EngineConfig, add_engine_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="re-run a flight record (/debug/steps) and report the first step that differs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("record", metavar="RECORD", help="a flight record: JSON lines")
    parser.add_argument(
        "--trust-record-config",
        action="store_true",
        help="use the record's settings that start processes, size memory or read paths "
        "other than the model (refused otherwise)",
    )
    add_engine_args(parser)
    # Only the engine flags given on this command line override the record's configuration:
    # the others leave no attribute at all.
    engine_fields = {f.name for f in fields(EngineConfig)}
    for action in parser._actions:
        if action.dest in engine_fields:
            action.default = argparse.SUPPRESS
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from nanollmserve.errors import UserError
    from nanollmserve.replay import read_record, replay

    names = [f.name for f in fields(EngineConfig)]
    overrides = {name: getattr(args, name) for name in names if hasattr(args, name)}
    try:
        with open(args.record) as f:
            record = read_record(f)
    except OSError as exc:
        raise UserError(f"cannot read the record {args.record}: {exc.strerror}") from None
    result = replay(record, overrides, trust_config=args.trust_record_config)
    if result.identical:
        print(f"replay: identical: {result.num_steps} steps, every batch and token as recorded")
        return 0
    print(f"replay: differs at {result.difference}")
    return 1

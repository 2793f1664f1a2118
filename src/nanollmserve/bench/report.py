"""Shared plumbing of the benchmarks: engine flags, the JSON result (with its provenance),
statistics."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from nanollmserve.bench.provenance import provenance
from nanollmserve.config import add_engine_args


def add_common_args(parser: argparse.ArgumentParser, *, engine: bool = True) -> None:
    if engine:
        add_engine_args(parser)
    parser.add_argument("--output", default=None, help="also write the JSON result to this file")


def emit(result: dict, args: argparse.Namespace) -> int:
    """Print the result as JSON on stdout (and to --output), with its `provenance`: git
    revision, date, CPU, cores and the command that made it."""
    result = {**result, "provenance": provenance(getattr(args, "argv", None))}
    text = json.dumps(result, indent=2)
    print(text)
    if getattr(args, "output", None):
        Path(args.output).write_text(text + "\n")
    return 0


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    """q in [0, 100]; linear interpolation like numpy's default."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)

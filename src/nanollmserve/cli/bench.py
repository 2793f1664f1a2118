"""`nanollmserve bench {latency,throughput,blocks,...}`: benchmarks that print JSON."""

from __future__ import annotations

import argparse
import importlib

BENCH_MODULES = [
    "nanollmserve.bench.latency",
    "nanollmserve.bench.throughput",
    "nanollmserve.bench.blocks",
    "nanollmserve.bench.serve",
    "nanollmserve.bench.prefix",
    "nanollmserve.bench.ablation",
    "nanollmserve.bench.lora",
    "nanollmserve.bench.grammar_mask",
    "nanollmserve.bench.spec_decode",
    "nanollmserve.bench.quality",
]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="run a benchmark (JSON on stdout)", description=__doc__
    )
    bench_subparsers = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for module_name in BENCH_MODULES:
        importlib.import_module(module_name).register(bench_subparsers)

"""`nanollmserve profile --pid PID --duration S`: what a running process costs, from /proc.

Samples /proc/PID/status (VmRSS, VmPeak, Threads, voluntary and involuntary context
switches) and /proc/PID/stat (utime + stime: CPU seconds over all threads) every
`--interval` seconds, then prints a JSON summary on stdout (or a table with
`--format table`): RSS min/mean/max, peak virtual memory, threads, CPU seconds and average CPU
percent (100 = one core), context switches and their rates. `--csv FILE` writes every sample.
Linux only; no extra dependency. `scripts/profile.sh` adds `perf stat` where perf exists.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from nanollmserve.errors import UserError

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
STATUS_FIELDS = {
    "VmRSS": "rss_kb",
    "VmPeak": "vm_peak_kb",
    "Threads": "threads",
    "voluntary_ctxt_switches": "voluntary_ctxt_switches",
    "nonvoluntary_ctxt_switches": "nonvoluntary_ctxt_switches",
}


@dataclass
class Sample:
    elapsed_s: float
    rss_kb: int
    vm_peak_kb: int
    threads: int
    voluntary_ctxt_switches: int
    nonvoluntary_ctxt_switches: int
    cpu_s: float
    """utime + stime of the process (all threads), seconds."""


def read_sample(pid: int, elapsed_s: float, proc: Path = Path("/proc")) -> Sample:
    """One sample of /proc/PID; FileNotFoundError / ProcessLookupError once it is gone (a
    zombie, exited but not yet reaped, counts as gone)."""
    stat = (proc / str(pid) / "stat").read_text()
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):  # field 3, the state: zombie or dead
        raise ProcessLookupError(pid)
    values = dict.fromkeys(STATUS_FIELDS.values(), 0)
    for line in (proc / str(pid) / "status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in STATUS_FIELDS:
            values[STATUS_FIELDS[key]] = int(rest.split()[0])
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return Sample(elapsed_s=round(elapsed_s, 3), cpu_s=(utime + stime) / CLOCK_TICKS, **values)


def collect(pid: int, duration: float, interval: float) -> tuple[list[Sample], bool]:
    """Samples every `interval` s for `duration` s; (samples, whether the process exited)."""
    start = time.monotonic()
    samples: list[Sample] = []
    while True:
        elapsed = time.monotonic() - start
        try:
            samples.append(read_sample(pid, elapsed))
        except (FileNotFoundError, ProcessLookupError):
            return samples, True
        if elapsed >= duration:
            return samples, False
        time.sleep(min(interval, max(0.0, duration - elapsed)))


def summarize(pid: int, samples: list[Sample], exited: bool) -> dict:
    first, last = samples[0], samples[-1]
    wall = last.elapsed_s - first.elapsed_s
    cpu = last.cpu_s - first.cpu_s
    voluntary = last.voluntary_ctxt_switches - first.voluntary_ctxt_switches
    involuntary = last.nonvoluntary_ctxt_switches - first.nonvoluntary_ctxt_switches
    rss_mb = [s.rss_kb / 1024 for s in samples]

    def per_s(value: float) -> float:
        return round(value / wall, 2) if wall > 0 else 0.0

    return {
        "pid": pid,
        "duration_s": round(wall, 3),
        "num_samples": len(samples),
        "exited": exited,
        "rss_mb": {
            "min": round(min(rss_mb), 1),
            "mean": round(sum(rss_mb) / len(rss_mb), 1),
            "max": round(max(rss_mb), 1),
        },
        "vm_peak_mb": round(max(s.vm_peak_kb for s in samples) / 1024, 1),
        "threads": {"min": min(s.threads for s in samples), "max": max(s.threads for s in samples)},
        "cpu_s": round(cpu, 3),
        "cpu_percent": round(100 * cpu / wall, 1) if wall > 0 else 0.0,
        "voluntary_ctxt_switches": voluntary,
        "nonvoluntary_ctxt_switches": involuntary,
        "voluntary_ctxt_switches_per_s": per_s(voluntary),
        "nonvoluntary_ctxt_switches_per_s": per_s(involuntary),
    }


def format_table(summary: dict) -> str:
    rows = [
        ("pid", summary["pid"]),
        ("duration", f"{summary['duration_s']} s ({summary['num_samples']} samples)"),
        ("rss", "min {min} / mean {mean} / max {max} MiB".format(**summary["rss_mb"])),
        ("vm peak", f"{summary['vm_peak_mb']} MiB"),
        ("threads", "min {min} / max {max}".format(**summary["threads"])),
        ("cpu", f"{summary['cpu_s']} s ({summary['cpu_percent']}% of one core)"),
        (
            "voluntary ctxt switches",
            f"{summary['voluntary_ctxt_switches']} ({summary['voluntary_ctxt_switches_per_s']}/s)",
        ),
        (
            "involuntary ctxt switches",
            f"{summary['nonvoluntary_ctxt_switches']} "
            f"({summary['nonvoluntary_ctxt_switches_per_s']}/s)",
        ),
    ]
    if summary["exited"]:
        rows.append(("note", "the process exited during sampling"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def write_csv(path: str, samples: list[Sample]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(samples[0])))
        writer.writeheader()
        writer.writerows(asdict(s) for s in samples)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="sample a running process's memory, threads, CPU and context switches from /proc",
        description="Sample /proc/PID (VmRSS, VmPeak, threads, context switches, CPU time) "
        "for --duration seconds and print a summary.",
    )
    parser.add_argument("--pid", type=int, required=True, help="process to sample")
    parser.add_argument(
        "--duration", type=float, default=10.0, help="seconds (default %(default)s)"
    )
    parser.add_argument(
        "--interval", type=float, default=0.5, help="seconds between samples (default %(default)s)"
    )
    parser.add_argument("--csv", default=None, metavar="FILE", help="write every sample here")
    parser.add_argument(
        "--format",
        choices=["json", "table"],
        default="json",
        help="summary format on stdout (default %(default)s)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.duration < 0 or args.interval <= 0:
        raise UserError("--duration must be >= 0 and --interval > 0")
    if not Path("/proc", str(args.pid), "stat").exists():
        raise UserError(f"no process {args.pid} (or no /proc: profile needs Linux)")
    samples, exited = collect(args.pid, args.duration, args.interval)
    if not samples:
        raise UserError(f"process {args.pid} exited before the first sample")
    summary = summarize(args.pid, samples, exited)
    if args.csv:
        write_csv(args.csv, samples)
    if args.format == "table":
        print(format_table(summary))
    else:
        json.dump(summary, sys.stdout, indent=2)
        print()
    return 0

"""Start-up time of `nanollmserve serve`: the first start (an empty cache: GGUF conversion and
native build included) and a warm start (the same cache again), from launching the command to
the first 200 from GET /health, with the phases the server logs; optionally against the code
of another git revision, alternating, in one run.

    .venv/bin/python scripts/bench_startup.py [--baseline REV] [--repeats 3]
        [--flags "" "--quantization none"] [--output FILE.json]

Each repeat of a flag set (a serve command line after `serve --port P`; the default model is
the bundled GGUF) and code version starts the server twice on a new, empty
`NANOLLMSERVE_CACHE`: `first` (what a first-ever `make serve` does) and `warm` (everything
cached). The versions alternate (A B, then B A, ...). The baseline runs the revision's `src/`
(from `git archive`) first on PYTHONPATH with the same virtual environment. The operating
system's page cache is not dropped (that needs root): the GGUF file and the Python packages
are read from memory after the first run, as on a machine that has just installed them.

Phases come from the server's own log lines (the timestamp of each, in seconds since the
launch, under `at_s`; the durations the lines report, under `took_s`): the first log line
(interpreter start and imports), the conversion of the config and tokenizer, the native build
(in the background), the block layout, the other tensors, the model load, the tokenizer load,
ready. Prints one JSON object with provenance: per flag set, version and kind of start, the
seconds (median and all runs), the server's own `ready_in` and the median phases; with a
baseline, the ratio of the medians.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from nanollmserve.bench.provenance import provenance  # noqa: E402

READY_IN = re.compile(r"ready_in=([0-9.]+)s")
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ [\w.]+: (.*)$")
SECONDS = r"([0-9]+\.[0-9]+) s"
PHASES = {
    "first log line": re.compile(r""),
    "conversion started": re.compile(r"^first start with "),
    "config + tokenizer converted": re.compile(
        rf"^converted the config and tokenizer .* in {SECONDS}"
    ),
    "native build": re.compile(rf"^built the native kernels \(\w+\) in {SECONDS}"),
    "block layout": re.compile(rf"^laying out the quantized blocks .*: {SECONDS}"),
    "other tensors": re.compile(rf"^dequantizing the tensors besides the blocks .*: {SECONDS}"),
    "model loaded": re.compile(rf"^loaded (?!the tokenizer).* in {SECONDS}$"),
    "tokenizer loaded": re.compile(rf"^loaded the tokenizer \(\w+\) in {SECONDS}"),
    "ready": re.compile(r"^nanollmserve ready: .*ready_in=([0-9.]+)s"),
}
"""Phase -> the log line that ends it (group 1: the seconds the line reports, if any). Lines
the baseline does not write are missing from its phases."""


def baseline_src(revision: str) -> Path:
    """The revision's src/ in a temporary directory."""
    out = Path(tempfile.mkdtemp(prefix="startup-baseline-"))
    archive = out / "src.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "archive", revision, "src"], cwd=ROOT, check=True, stdout=f)
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    return out / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once(flags: list[str], pythonpath: Path | None, cache: Path, timeout: float = 600.0):
    """Seconds from Popen to the first 200 of /health, the ready_in the server logged, and
    the phases of its log."""
    port = free_port()
    env = dict(os.environ, NANOLLMSERVE_CACHE=str(cache))
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    command = [str(ROOT / ".venv/bin/nanollmserve"), "serve", "--port", str(port), *flags]
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed below, after the server stops)
    launched = time.time()
    start = time.perf_counter()
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.perf_counter() - start > timeout:
                log.seek(0)
                raise RuntimeError(f"server did not start: {log.read().decode()[-2000:]}")
            time.sleep(0.01)
        seconds = time.perf_counter() - start
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    log.seek(0)
    text = log.read().decode(errors="replace")
    log.close()
    match = READY_IN.search(text)
    return {
        "seconds": round(seconds, 3),
        "ready_in": float(match.group(1)) if match else None,
        **log_phases(text, launched),
    }


def log_phases(text: str, launched: float) -> dict:
    """{"at_s": phase -> seconds since launch of its line, "took_s": phase -> the seconds the
    line reports} (the first line matching each phase)."""
    at, took = {}, {}
    for line in text.splitlines():
        parsed = LOG_LINE.match(line)
        if parsed is None:
            continue
        stamp, message = parsed.groups()
        when = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for phase, pattern in PHASES.items():
            found = pattern.search(message)
            if found is None or phase in at:
                continue
            at[phase] = round(when - launched, 3)
            if found.groups():
                took[phase] = float(found.group(1))
    return {"at_s": at, "took_s": took}


def summary(results: list[dict]) -> dict:
    def medians(key: str) -> dict:
        phases = {phase for r in results for phase in r[key]}
        return {
            phase: statistics.median(r[key][phase] for r in results if phase in r[key])
            for phase in sorted(phases, key=list(PHASES).index)
        }

    return {
        "median_s": statistics.median(r["seconds"] for r in results),
        "seconds": [r["seconds"] for r in results],
        "ready_in": [r["ready_in"] for r in results],
        "median_at_s": medians("at_s"),
        "median_took_s": medians("took_s"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=None, help="git revision to compare with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--flags", nargs="+", default=[""], help="serve flag sets, one string each")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    versions: dict[str, Path | None] = {"current": None}
    if args.baseline:
        versions = {"baseline": baseline_src(args.baseline), "current": None}
    kinds = ("first", "warm")
    load_before = os.getloadavg()
    runs = {flags: {v: {k: [] for k in kinds} for v in versions} for flags in args.flags}
    for flags in args.flags:
        for repeat in range(args.repeats):
            order = list(versions.items())
            if repeat % 2:
                order.reverse()
            for name, path in order:
                cache = Path(tempfile.mkdtemp(prefix="startup-cache-"))
                try:
                    for kind in kinds:
                        result = start_once(shlex.split(flags), path, cache)
                        runs[flags][name][kind].append(result)
                        label = f"{flags or '(default)'} {name} {kind}"
                        print(f"{label}: {result['seconds']} s", file=sys.stderr, flush=True)
                finally:
                    shutil.rmtree(cache, ignore_errors=True)
    record = provenance()
    record["command"] = shlex.join([".venv/bin/python", "scripts/bench_startup.py", *sys.argv[1:]])
    report = {"benchmark": "startup", "baseline": args.baseline, "repeats": args.repeats}
    report |= {"provenance": record, "load_average": [load_before, os.getloadavg()], "results": {}}
    for flags, by_version in runs.items():
        entry: dict = {}
        for name, by_kind in by_version.items():
            entry[name] = {kind: summary(results) for kind, results in by_kind.items()}
        if len(by_version) == 2:
            entry["current_vs_baseline"] = {
                kind: round(
                    entry["current"][kind]["median_s"] / entry["baseline"][kind]["median_s"], 3
                )
                for kind in kinds
            }
        report["results"][flags or "(default)"] = entry
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

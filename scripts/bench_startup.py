"""Start-up time of `nanollmserve serve`: from launching the command to the first 200 from
GET /health, ours against the code of another git revision, alternating, in one run.

    .venv/bin/python scripts/bench_startup.py [--baseline REV] [--repeats 5]
        [--flags "" "--quantization none"] [--output FILE.json]
    .venv/bin/python scripts/bench_startup.py --phases 3

Each flag set (a serve command line after `serve --port P`; the default model, so the
bundled GGUF from the conversion cache) is started `--repeats` times with each code version,
the two versions alternating (A B, then B A, ...), after one untimed start of each that fills
whatever cache it keeps. The baseline runs the revision's `src/` (from `git archive`) first on
PYTHONPATH with the same virtual environment. Prints one JSON object: per flag set and
version the start-up seconds (median, all runs) and the server's own `ready_in`, and the
ratio of the medians.

`--phases N` instead times the phases of a default start of the current code, each in a
fresh process N times (median per phase): the CLI parser, importing torch and the engine
modules, the config, building and loading the weights, the GGUF blocks, the KV pool, the
tokenizer, the API modules. They run one after another here; `serve` imports the API
modules on its main thread while the engine thread loads the model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
READY_IN = re.compile(r"ready_in=([0-9.]+)s")


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


def start_once(flags: list[str], pythonpath: Path | None, timeout: float = 300.0) -> dict:
    """Seconds from Popen to the first 200 of /health, and the ready_in the server logged."""
    port = free_port()
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    command = [str(ROOT / ".venv/bin/nanollmserve"), "serve", "--port", str(port), *flags]
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed below, after the server stops)
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
    match = READY_IN.search(log.read().decode(errors="replace"))
    log.close()
    return {"seconds": round(seconds, 3), "ready_in": float(match.group(1)) if match else None}


def time_phases() -> dict[str, float]:
    """Seconds of each phase of a default start, in this (fresh) process."""
    laps: dict[str, float] = {}
    last = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal last
        now = time.perf_counter()
        laps[name] = round(now - last, 3)
        last = now

    from nanollmserve.cli.main import build_parser

    build_parser()
    lap("cli parser")
    import torch

    from nanollmserve.frontend.async_engine import AsyncEngine  # noqa: F401

    lap("import torch + engine modules")
    from nanollmserve.engine.model_runner import zeroed_tensor
    from nanollmserve.frontend.tokenizer import load_tokenizer
    from nanollmserve.layers.gguf_linear import apply_gguf_blocks
    from nanollmserve.model.gguf_cache import cached_gguf_blocks
    from nanollmserve.model.loader import load_model
    from nanollmserve.model.model_config import ModelConfig
    from nanollmserve.model.source import resolve_model
    from nanollmserve.native.build import load_kernels

    cpu, dtype = torch.device("cpu"), torch.float32
    source = resolve_model(None)
    config = ModelConfig.from_pretrained(source.path)
    lap("source + config")
    model = load_model(source.path, config, dtype, cpu, cache_fused=True)
    lap("build + load weights")
    load_kernels()
    lap("native kernels (built once per machine)")
    blocks = cached_gguf_blocks(source.path, source.gguf_path, config)
    lap("GGUF blocks")
    apply_gguf_blocks(model, blocks)
    lap("apply blocks")
    heads, head_dim = config.num_kv_heads, config.head_dim
    zeroed_tensor((2, config.num_layers, 1456, 16, heads, head_dim), dtype, cpu)
    lap("KV pool")
    load_tokenizer(source.path)
    lap("tokenizer")
    import uvicorn  # noqa: F401

    from nanollmserve.api import create_app  # noqa: F401

    lap("FastAPI + API modules + uvicorn")
    return laps


def phases(repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        done = subprocess.run(
            [sys.executable, __file__, "--phase-run"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        )
        runs.append(json.loads(done.stdout))
        print(runs[-1], file=sys.stderr, flush=True)
    medians = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
    return {"benchmark": "startup-phases", "repeats": repeats, "median_s": medians, "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=None, help="git revision to compare with")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--flags", nargs="+", default=[""], help="serve flag sets, one string each")
    parser.add_argument("--output", default=None)
    parser.add_argument("--phases", type=int, default=0, metavar="N", help="time phases instead")
    parser.add_argument("--phase-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase_run:
        print(json.dumps(time_phases()))
        return 0
    if args.phases:
        text = json.dumps(phases(args.phases), indent=2)
        print(text)
        if args.output:
            Path(args.output).write_text(text + "\n")
        return 0
    versions = {"current": None}
    if args.baseline:
        versions = {"baseline": baseline_src(args.baseline), "current": None}
    runs: dict = {flags: {name: [] for name in versions} for flags in args.flags}
    for flags in args.flags:
        for path in versions.values():  # untimed: fills the caches
            start_once(flags.split(), path)
        for repeat in range(args.repeats):
            order = list(versions.items())
            if repeat % 2:
                order.reverse()
            for name, path in order:
                result = start_once(flags.split(), path)
                runs[flags][name].append(result)
                print(f"{flags or '(default)'} {name}: {result}", file=sys.stderr, flush=True)
    report = {"benchmark": "startup", "baseline": args.baseline, "repeats": args.repeats}
    report["results"] = {}
    for flags, by_version in runs.items():
        entry = {}
        for name, results in by_version.items():
            entry[name] = {
                "median_s": statistics.median(r["seconds"] for r in results),
                "seconds": [r["seconds"] for r in results],
                "ready_in": [r["ready_in"] for r in results],
            }
        if len(by_version) == 2:
            entry["current_vs_baseline"] = round(
                entry["current"]["median_s"] / entry["baseline"]["median_s"], 3
            )
        report["results"][flags or "(default)"] = entry
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

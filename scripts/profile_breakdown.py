"""Where an engine step's time goes: the breakdown table of docs/benchmarks.md.

    .venv/bin/python scripts/profile_breakdown.py [--batch 1,32] [--steps 30]
        [--paths native,forward] [--kv-cache-dtype auto] [--serve] [--model FILE]

Offline part: the bundled model or `--model FILE` (CPU default dtype), B requests decoding
together; each step is split, with wall-clock timers around the engine's own functions (no
profiler, whose per-op cost would distort a step of ~1000 small ops), into scheduling, input
building (the step's `StepBatch`, and the forward's attention context from it), model forward,
the attention layers inside it (K/V store, gather through the block tables, SDPA), logits (or,
with GGUF blocks, the native decode step that does all three, itself split by its own timers
into its products, attention, rotary + K/V write and the rest: `ops.decode_profile`), sampling,
engine update and detokenization (the output processor). `--paths native,forward` measures each
batch both ways in one run: the native step, then the PyTorch forward on the same engine
(`native_decode` switched off). `--serve` adds the server's share: our server under `bench
serve` at concurrency 32, with the CPU time of the HTTP thread (the process's main thread:
asyncio, JSON, SSE) against the whole process, read from /proc.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from nanollmserve import LLM, SamplingParams
from nanollmserve.engine.step_batch import StepBatch
from nanollmserve.layers.attention import PagedAttention


def offline(llm: LLM, batch: int, steps: int, path: str) -> dict:
    from nanollmserve.native import ops

    engine, runner = llm.engine, llm.engine.model_runner
    runner.native_decode = NATIVE_STEP.get(runner, runner.native_decode)
    NATIVE_STEP[runner] = runner.native_decode
    if path == "forward":
        runner.native_decode = None
    timings = dict.fromkeys(
        ["schedule", "inputs", "forward", "attention", "logits", "native", "sampling", "update",
         "detokenize"],
        0.0,
    )  # fmt: skip

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timings[name] += time.perf_counter() - start

        return wrapper

    originals = [
        (engine.scheduler, "schedule", "schedule"),
        (engine.scheduler, "update_from_output", "update"),
        (StepBatch, "of_scheduled", "inputs"),
        (runner, "_forward_inputs", "inputs"),
        (runner.model, "forward", "forward"),
        (PagedAttention, "forward", "attention"),
        (runner.model, "compute_logits", "logits"),
        (runner, "native_decode", "native"),
        (runner.sampler.__class__, "__call__", "sampling"),
        (llm.driver.output_processor, "process_outputs", "detokenize"),
    ]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in originals]
    for owner, attr, name in originals:
        if getattr(owner, attr) is not None:
            setattr(owner, attr, timed(name, getattr(owner, attr)))
    processor = llm.driver.output_processor
    for i in range(batch):
        output_id, text = f"{path}-{batch}-{i}", "Once upon a time " * 32
        prompt, token_ids = llm.input_processor.tokenize(text)
        params = SamplingParams(temperature=0.0, max_tokens=steps + 40, ignore_eos=True)
        llm.driver.add_request(llm.admission.admit(output_id, prompt, token_ids, params))
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        processor.process_outputs(engine.step().outputs)
    for _ in range(5):
        processor.process_outputs(engine.step().outputs)
    for key in timings:
        timings[key] = 0.0
    ops.decode_profile(enable=True)
    start = time.perf_counter()
    for _ in range(steps):
        processor.process_outputs(engine.step().outputs)
    total = time.perf_counter() - start
    native_parts = ops.decode_profile(enable=False)
    attention = timings["attention"]
    for i in range(batch):
        llm.driver.abort_request(f"{path}-{batch}-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    for owner, attr, original in saved:
        setattr(owner, attr, original)
    parts = {
        "model forward (without attention)": timings["forward"] - attention,
        "attention (paged: store, gather, SDPA)": attention,
        "logits (lm_head)": timings["logits"],
        "native decode step (forward + logits in one call)": timings["native"],
        "sampling": timings["sampling"],
        "scheduling + inputs + update": timings["schedule"] + timings["inputs"] + timings["update"],
        "detokenize (output processor)": timings["detokenize"],
    }
    parts["other"] = total - sum(parts.values())
    result = {
        "batch": batch,
        "path": path,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "step_ms": round(total / steps * 1000, 2),
        "ms_per_step": {k: round(v / steps * 1000, 2) for k, v in parts.items()},
        "percent": {k: round(100 * v / total, 1) for k, v in parts.items()},
    }
    if timings["native"]:
        result["native_step_ms"] = {k: round(v / steps * 1000, 2) for k, v in native_parts.items()}
    return result


NATIVE_STEP: dict = {}
"""The runner's native step, kept while a `forward` measurement switches it off."""


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_share(port: int = 8123) -> dict:
    exe = [sys.executable, "-m", "nanollmserve.cli.main"]
    server = subprocess.Popen(
        [*exe, "serve", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        for line in server.stderr:
            if b"ready" in line:
                break
        before = cpu_seconds(server.pid), cpu_seconds(server.pid, server.pid)
        subprocess.run(
            [*exe, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--ignore-eos",
             "--num-prompts", "64", "--input-len", "128", "--output-len", "128",
             "--max-concurrency", "32", "--disable-tqdm"],
            check=True, capture_output=True,
        )  # fmt: skip
        total = cpu_seconds(server.pid) - before[0]
        http = cpu_seconds(server.pid, server.pid) - before[1]
    finally:
        server.terminate()
        server.wait()
    return {
        "workload": "bench serve, 64 requests, 128 in / 128 out, concurrency 32",
        "process_cpu_s": round(total, 2),
        "http_thread_cpu_s": round(http, 2),
        "http_percent": round(100 * http / total, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--paths", default="native", help="native, forward or native,forward")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the engine's --kv-cache-dtype")
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--model", default=None, help="a GGUF file or model dir (default: bundled)")
    args = parser.parse_args()
    from nanollmserve.bench.provenance import provenance

    result = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    model = {"model": args.model} if args.model else {}
    llm = LLM(**model, num_kv_blocks=4096, kv_cache_dtype=args.kv_cache_dtype)
    result["offline"] = [
        offline(llm, int(b), args.steps, path)
        for b in args.batch.split(",")
        for path in args.paths.split(",")
    ]
    if args.serve:
        result["serve"] = serve_share()
    result["provenance"] = provenance() | {
        "command": shlex.join([".venv/bin/python", "scripts/profile_breakdown.py", *sys.argv[1:]])
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

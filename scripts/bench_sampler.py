"""The sampler alone: time per call on the bundled model's real logits, ours against the
sampler of another git revision, in one process, alternating repeats.

    .venv/bin/python scripts/bench_sampler.py [--baseline REV] [--batch 1,32,50]
        [--repeats 7] [--calls 20] [--output FILE.json]

The logits are those of the bundled model (float32) at every position of a fixed English
text, so each batch row is a real next-token distribution over the 49152-token vocabulary.
Each setting (greedy, temperature 0.7 with top_p 0.95, temperature 1.0 alone, top_k 50)
runs `--calls` times per repeat; repeats alternate between the two samplers and the JSON
reports the median per-call time of each, in milliseconds, and their ratio. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from nanollmserve import LLM
from nanollmserve.layers import sampler as current
from nanollmserve.layers.attention_context import AttentionContext, reset_context, set_context

SETTINGS = {  # name: (temperature, top_k, top_p)
    "greedy": (0.0, 0, 1.0),
    "t0.7_top_p0.95": (0.7, 0, 0.95),
    "t1.0": (1.0, 0, 1.0),
    "t1.0_top_k50": (1.0, 50, 1.0),
}
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was "
    "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it "
    "was the season of Light, it was the season of Darkness, it was the spring of hope, it "
    "was the winter of despair, we had everything before us, we had nothing before us."
)


def sampler_at(revision: str):
    """The sampler module of a git revision, imported from a temporary file."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{revision}:src/nanollmserve/layers/sampler.py"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_sampler.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_sampler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def real_logits() -> torch.Tensor:
    llm = LLM(dtype="float32", num_kv_blocks=64)
    model = llm.engine.loaded.model
    ids = llm.tokenizer.encode(TEXT)
    set_context(AttentionContext.causal_prefill([len(ids)]))
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))
    reset_context()
    return logits.float()


def metadata(module, batch: int, setting: tuple):
    temperature, top_k, top_p = setting
    meta = module.SamplingMetadata(
        temperature=torch.full((batch,), temperature), all_greedy=temperature == 0
    )
    if top_k:
        meta.top_k, meta.max_top_k = torch.full((batch,), top_k), top_k
    if top_p < 1:
        meta.top_p = torch.full((batch,), top_p)
    return meta


def time_calls(module, logits: torch.Tensor, setting: tuple, calls: int) -> float:
    sampler = module.Sampler(seed=0)
    meta = metadata(module, logits.shape[0], setting)
    sampler(logits, meta)  # warm-up
    start = time.perf_counter()
    for _ in range(calls):
        sampler(logits, meta)
    return (time.perf_counter() - start) / calls * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=None, help="git revision of the 'before' sampler")
    parser.add_argument("--batch", default="1,32,50")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    samplers = {"after": current}
    if args.baseline:
        samplers = {"before": sampler_at(args.baseline), "after": current}
    logits = real_logits()
    batches = [int(b) for b in args.batch.split(",")]
    times: dict = {}
    with torch.inference_mode():
        for repeat in range(args.repeats):
            order = list(samplers) if repeat % 2 == 0 else list(reversed(samplers))
            for name in order:
                for batch in batches:
                    rows = logits[torch.arange(batch) % logits.shape[0]].contiguous()
                    for setting_name, setting in SETTINGS.items():
                        key = (batch, setting_name)
                        ms = time_calls(samplers[name], rows, setting, args.calls)
                        times.setdefault(key, {}).setdefault(name, []).append(ms)
    results = []
    for (batch, setting_name), by_sampler in times.items():
        row = {"batch": batch, "setting": setting_name}
        for name, values in by_sampler.items():
            row[f"{name}_ms"] = round(statistics.median(values), 3)
        if "before" in by_sampler:
            row["before_over_after"] = round(row["before_ms"] / row["after_ms"], 2)
        results.append(row)
    report = {
        "benchmark": "sampler",
        "vocab_size": logits.shape[1],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "baseline": args.baseline,
        "repeats": args.repeats,
        "calls_per_repeat": args.calls,
        "results": results,
    }
    text = json.dumps(report, indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())

"""Where the native step beats the PyTorch forward on prefill: the table behind
`NATIVE_PREFILL_MAX_TOKENS` and `NATIVE_MAX_TOKENS` (engine/step_batch.py).

    .venv/bin/python scripts/native_prefill_crossover.py [--repeats 3] [--output FILE.json]

One offline engine (the bundled model, default flags, `max_num_batched_tokens` 512). Each
shape is a prefill step of 512 tokens: 8 prompts of 64 tokens, 4 of 128, 2 of 256, 1 of 512
(random token ids, one output token), run once with every prefill on the native step and once
with every step on the forward (the two constants patched), the order alternating by repeat,
new prompts each run (no prefix-cache hits). Prints one JSON object with provenance: per
shape, the median seconds of each path and native / forward.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import nanollmserve.engine.step_batch as step_batch  # noqa: E402
from nanollmserve import LLM, SamplingParams  # noqa: E402
from nanollmserve.bench.provenance import provenance  # noqa: E402

SHAPES = ((8, 64), (4, 128), (2, 256), (1, 512))


def timed_prefill(llm: LLM, num_prompts: int, length: int, path: str, seed: int) -> float:
    native = path == "native"
    step_batch.NATIVE_PREFILL_MAX_TOKENS = 4096 if native else 0
    step_batch.NATIVE_MAX_TOKENS = 4096 if native else 0
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(num_prompts)]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    limits = (step_batch.NATIVE_PREFILL_MAX_TOKENS, step_batch.NATIVE_MAX_TOKENS)
    llm = LLM(max_num_batched_tokens=512)
    timed_prefill(llm, 4, 128, "native", 1)  # warm-up, both paths
    timed_prefill(llm, 4, 128, "forward", 2)
    seconds: dict[str, dict[str, list[float]]] = {}
    for repeat in range(args.repeats):
        for num_prompts, length in SHAPES:
            order = ("native", "forward") if repeat % 2 == 0 else ("forward", "native")
            for path in order:
                seed = 1000 * repeat + 10 * length + order.index(path)
                took = timed_prefill(llm, num_prompts, length, path, seed)
                seconds.setdefault(f"{num_prompts}x{length}", {}).setdefault(path, []).append(took)
    results = {}
    for shape, paths in seconds.items():
        native, forward = (statistics.median(paths[p]) for p in ("native", "forward"))
        results[shape] = {
            "native_ms": round(1000 * native, 1),
            "forward_ms": round(1000 * forward, 1),
            "native_over_forward": round(native / forward, 3),
            "all_ms": {p: [round(1000 * s, 1) for s in v] for p, v in paths.items()},
        }
    report = {
        "benchmark": "native_prefill_crossover",
        "limits_in_code": {"NATIVE_PREFILL_MAX_TOKENS": limits[0], "NATIVE_MAX_TOKENS": limits[1]},
        "results": results,
        "provenance": provenance(),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

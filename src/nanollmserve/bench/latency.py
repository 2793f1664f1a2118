"""`nanollmserve bench latency`: one request at a time, TTFT / TPOT / tokens per second.

Side by side in one run, on the same weights, dtype and prompt: the engine, HF transformers
`generate` with its KV cache, and the naive loop that recomputes the whole sequence for every
token (no cache). Each is repeated and the median reported. With `--quantization`, HF runs the
float weights in the dtype the engine computes in (float32 for `fp16`); the JSON names both.

TTFT is cold for every system: each repeat gets a fresh random prompt (the same prompts for
every system), so the engine's prefix cache never serves a timed prompt (the JSON records
the cached prompt tokens: 0). Every system first runs the same untimed warm-up request (a
prompt no timed run uses, the full output length), HF baselines included.
"""

from __future__ import annotations

import argparse

from nanollmserve.bench import hf_baselines
from nanollmserve.bench.report import add_common_args, emit, log, median, ratio
from nanollmserve.bench.workload import random_requests


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("latency", help="single-request latency vs HF baselines")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3, help="runs per system (median kept)")
    parser.add_argument("--no-baselines", action="store_true", help="measure the engine only")
    parser.add_argument("--no-naive", action="store_true", help="skip the no-cache HF loop")
    add_common_args(parser)
    parser.set_defaults(func=run)


def summarize(times: list[list[float]], output_len: int) -> dict:
    """Per-token ready times of each run -> median TTFT, TPOT and rates."""
    ttft = median([t[0] for t in times])
    tpot = median([(t[-1] - t[0]) / (len(t) - 1) for t in times])
    e2e = median([t[-1] for t in times])
    return {
        "ttft_ms": round(ttft * 1000, 2),
        "tpot_ms": round(tpot * 1000, 2),
        "decode_tokens_per_s": round(1 / tpot, 2),
        "e2e_s": round(e2e, 3),
        "tokens_per_s": round(output_len / e2e, 2),
    }


def run(args: argparse.Namespace) -> int:
    from nanollmserve import SamplingParams
    from nanollmserve.config import engine_config_from_args
    from nanollmserve.llm import LLM
    from nanollmserve.model.device import dtype_name

    llm = LLM(**vars(engine_config_from_args(args)))
    engine = llm.engine
    # Prompt 0 is the warm-up; 1..repeat are timed, one fresh prompt per repeat (cold TTFT).
    warmup, *prompts = [
        r.prompt_token_ids
        for r in random_requests(
            args.repeat + 1,
            (args.input_len,) * 2,
            (args.output_len,) * 2,
            engine.model_config.vocab_size,
            seed=0,
        )
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    cached_tokens: list[int] = []

    def engine_times(prompt: list[int]) -> list[float]:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        m = out.metrics
        cached_tokens.append(m.num_cached_tokens)
        # TTFT and the last token's time; intermediate tokens are evenly spaced by TPOT.
        ttft = m.first_token_time - m.arrival_time
        last = m.last_token_time - m.arrival_time
        n = len(out.outputs[0].token_ids)
        return [ttft + (last - ttft) * i / (n - 1) for i in range(n)]

    def measure(name: str, times_of) -> list[list[float]]:
        log(f"{name}: warm-up, then {args.repeat} timed run(s)")
        times_of(warmup)  # the same untimed warm-up request for every system
        return [times_of(prompt) for prompt in prompts]

    systems = {"engine": measure("engine", engine_times)}
    engine_cached = cached_tokens[1:]  # the timed runs only
    if not args.no_baselines:
        hf = hf_baselines.load_hf_model(engine.loaded.model_dir, engine.dtype)
        systems["hf_generate_kv_cache"] = measure(
            "hf generate with cache",
            lambda p: hf_baselines.generate_with_cache(hf, p, args.output_len)[1],
        )
        if not args.no_naive:
            systems["hf_naive_no_cache"] = measure(
                "hf naive loop without cache",
                lambda p: hf_baselines.naive_loop(hf, p, args.output_len)[1],
            )
    results = {name: summarize(times, args.output_len) for name, times in systems.items()}
    ratios = {}
    for name in ("hf_generate_kv_cache", "hf_naive_no_cache"):
        if name in results:
            ratios[f"engine_vs_{name}_decode"] = ratio(
                results["engine"]["decode_tokens_per_s"], results[name]["decode_tokens_per_s"]
            )
            ratios[f"engine_vs_{name}_e2e"] = ratio(
                results["engine"]["tokens_per_s"], results[name]["tokens_per_s"]
            )
    return emit(
        {
            "benchmark": "latency",
            "model": engine.loaded.source.name,
            "device": str(engine.device),
            "dtype": dtype_name(engine.dtype),
            "quantization": engine.loaded.quantization,  # what ran, the GGUF default included
            "input_len": args.input_len,
            "output_len": args.output_len,
            "repeat": args.repeat,
            "ttft": "cold: a fresh prompt per repeat, none seen before by any system",
            "engine_cached_prompt_tokens": engine_cached,
            "warmup": {
                "requests_per_system": 1,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "note": "untimed, the same prompt for every system, HF baselines included",
            },
            "results": results,
            "ratios": ratios,
        },
        args,
    )

"""`nanollmserve bench throughput`: many requests, output tokens per second.

Side by side in one run, on the same weights, dtype and requests (seeded random prompts and
output lengths, ignore_eos): the engine with everything submitted at once (continuous
batching), HF `generate` one request at a time, and HF static batching (padded batches of
`--static-batch-size`, each running until its longest output is done). One-at-a-time HF is
slow, so it runs on the first `--hf-requests` requests; its rate does not depend on how many
requests there are.
"""

from __future__ import annotations

import argparse
import time

from nanollmserve.bench import hf_baselines
from nanollmserve.bench.report import add_common_args, emit, log, ratio
from nanollmserve.bench.workload import parse_range, random_requests


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("throughput", help="batch throughput vs HF baselines")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="96-160", help="N or LOW-HIGH tokens")
    parser.add_argument("--output-len", default="96-160", help="N or LOW-HIGH tokens")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--static-batch-size", type=int, default=8)
    parser.add_argument(
        "--hf-requests", type=int, default=8, help="requests for the one-at-a-time HF baseline"
    )
    parser.add_argument("--no-baselines", action="store_true", help="measure the engine only")
    add_common_args(parser)
    parser.set_defaults(func=run)


def _rates(num_requests: int, output_tokens: int, seconds: float) -> dict:
    return {
        "requests": num_requests,
        "output_tokens": output_tokens,
        "elapsed_s": round(seconds, 3),
        "requests_per_s": round(num_requests / seconds, 3),
        "output_tokens_per_s": round(output_tokens / seconds, 2),
    }


def run(args: argparse.Namespace) -> int:
    from nanollmserve import SamplingParams
    from nanollmserve.config import engine_config_from_args
    from nanollmserve.llm import LLM
    from nanollmserve.model.device import dtype_name

    llm = LLM(**vars(engine_config_from_args(args)))
    engine = llm.engine
    requests = random_requests(
        args.num_prompts,
        parse_range(args.input_len),
        parse_range(args.output_len),
        engine.model_config.vocab_size,
        seed=args.workload_seed,
    )
    total_out = sum(r.max_tokens for r in requests)
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests
    ]
    prompts = [r.prompt_token_ids for r in requests]

    log("engine: warmup")
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    log(f"engine: {len(requests)} requests")
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    engine_seconds = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == total_out
    results = {"engine": _rates(len(requests), total_out, engine_seconds)}
    stats = engine.stats()
    results["engine"]["peak_kv_blocks_used"] = stats.kv_cache.peak_used_blocks

    if not args.no_baselines:
        hf = hf_baselines.load_hf_model(engine.loaded.model_dir, engine.dtype)
        subset = requests[: args.hf_requests]
        log(f"hf generate one at a time: {len(subset)} requests")
        start = time.perf_counter()
        for r in subset:
            hf_baselines.generate_with_cache(hf, r.prompt_token_ids, r.max_tokens)
        results["hf_one_at_a_time"] = _rates(
            len(subset), sum(r.max_tokens for r in subset), time.perf_counter() - start
        )
        log(f"hf static batching: batches of {args.static_batch_size}")
        seconds = hf_baselines.static_batches(hf, requests, args.static_batch_size)
        results["hf_static_batching"] = _rates(len(requests), total_out, seconds)

    engine_rate = results["engine"]["output_tokens_per_s"]
    ratios = {
        f"engine_vs_{name}": ratio(engine_rate, r["output_tokens_per_s"])
        for name, r in results.items()
        if name != "engine"
    }
    return emit(
        {
            "benchmark": "throughput",
            "model": engine.loaded.source.name,
            "device": str(engine.device),
            "dtype": dtype_name(engine.dtype),
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "max_num_seqs": engine.config.max_num_seqs,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "results": results,
            "ratios": ratios,
        },
        args,
    )

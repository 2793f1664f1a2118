"""`nanollmserve bench prefix`: what the prefix cache does to TTFT.

Requests share a `--prefix-len` (512) token system prompt and each add a `--suffix-len`
question; they run one at a time, so TTFT is prefill time alone (no queueing):
- cold: each request gets a prefix never seen before (every prompt token is computed);
- warm: after one priming request, each request reuses the shared prefix's cached blocks.
With `--restart` (offline, with `--kv-offload-dir`), each warm request runs in an engine
started after the priming one (its pool empty), so its prefix comes from the offload
directory: TTFT with a prefix cache that outlived the process.
Reported: TTFT mean / p50 / p95 each way, warm/cold p50 ratio (target <= 0.2), the hit rate
over the warm requests (cached prompt tokens / prompt tokens) and the cached tokens each.

Compare like with like. By default the offline engine runs it (engine flags apply, e.g.
`--block-size`): TTFT is engine time alone, with no HTTP, tokenization or server in it, so
it compares with nothing but itself (cold vs warm). Over HTTP, the same prompts go as text to
a server's `/v1/completions` (streaming): `--serve` starts our server (`--server-args` adds
serve flags), `--base-url` measures a running one (e.g. llama.cpp's llama-server); those two
compare with each other. The hit rate is read from the server's `/stats` when it has one
(nanollmserve); other servers report none.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import statistics

from nanollmserve.bench.report import add_common_args, emit, log, percentile, ratio
from nanollmserve.bench.workload import BenchRequest

TARGET_RATIO = 0.2


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("prefix", help="TTFT with a cold vs warm prefix cache")
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=8, help="per phase (cold, warm)")
    parser.add_argument("--workload-seed", type=int, default=0)
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--base-url", default=None, help="measure this server over HTTP")
    target.add_argument(
        "--serve", action="store_true", help="start our server and measure it over HTTP"
    )
    parser.add_argument(
        "--server-args", default="", help="extra `nanollmserve serve` flags (with --serve)"
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--restart",
        action="store_true",
        help="offline, with --kv-offload-dir: run each warm request in a freshly started "
        "engine, its prefix read from the offload directory",
    )
    parser.add_argument("--plot", default=None, help="write a PNG bar chart here")
    add_common_args(parser)
    parser.set_defaults(func=run)


def make_prompts(words, args) -> tuple[list[BenchRequest], BenchRequest, list[BenchRequest]]:
    """Cold requests (fresh prefix each), the priming request and the warm requests."""
    rng = random.Random(args.workload_seed)
    shared = words.sample(rng, args.prefix_len)

    def request(prefix: list[int]) -> BenchRequest:
        return BenchRequest(prefix + words.sample(rng, args.suffix_len), args.output_len)

    cold = [request(words.sample(rng, args.prefix_len)) for _ in range(args.num_requests)]
    return cold, request(shared), [request(shared) for _ in range(args.num_requests)]


def _dist(values_s: list[float]) -> dict:
    ms = [v * 1000 for v in values_s]
    return {
        "mean": round(statistics.fmean(ms), 2),
        "p50": round(percentile(ms, 50), 2),
        "p95": round(percentile(ms, 95), 2),
    }


def run_offline(args, config) -> dict:
    from nanollmserve.bench.engine_driver import run_engine
    from nanollmserve.bench.serve_workloads import WordTokens
    from nanollmserve.engine.engine_core import EngineCore
    from nanollmserve.frontend.tokenizer import load_tokenizer
    from nanollmserve.model.device import dtype_name

    engine = EngineCore(config)
    cold, prime, warm = make_prompts(WordTokens(load_tokenizer(engine.loaded.model_dir)), args)
    log("warmup")
    run_engine(engine, [BenchRequest(cold[0].prompt_token_ids[::-1], 2)])

    def one_by_one(requests):
        return [run_engine(engine, [r])[0][0] for r in requests]

    log(f"cold: {len(cold)} requests")
    cold_t = one_by_one(cold)
    one_by_one([prime])
    before = engine.stats()
    log(f"warm: {len(warm)} requests")
    if args.restart:  # each in a new engine: the prefix comes from --kv-offload-dir
        warm_t, queries, hits = [], 0, 0
        for request in warm:
            engine.shutdown()
            del engine
            engine = EngineCore(config)
            run_engine(engine, [BenchRequest(cold[0].prompt_token_ids[::-1], 2)])
            before = engine.stats()
            warm_t += one_by_one([request])
            queries += engine.stats().prefix_cache_queries - before.prefix_cache_queries
            hits += engine.stats().prefix_cache_hits - before.prefix_cache_hits
        engine.shutdown()
    else:
        warm_t = one_by_one(warm)
        after = engine.stats()
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        hits = after.prefix_cache_hits - before.prefix_cache_hits
    return {
        "mode": "offline engine",
        "compare_with": "itself only (engine time, no HTTP); servers: --serve / --base-url",
        "model": engine.loaded.source.name,
        "dtype": dtype_name(engine.dtype),
        "block_size": config.block_size,
        "enable_prefix_caching": config.enable_prefix_caching,
        "kv_offload_dir": config.kv_offload_dir,
        "restart": args.restart,
        "cold_ttft_s": [t.ttft for t in cold_t],
        "warm_ttft_s": [t.ttft for t in warm_t],
        "warm_cached_tokens": [t.num_cached_tokens for t in warm_t],
        "cold_cached_tokens": [t.num_cached_tokens for t in cold_t],
        "hit_rate": round(hits / queries, 4) if queries else 0.0,
    }


async def run_server(args, words, base_url: str) -> dict:
    from nanollmserve.bench.serve_client import OpenAIBackend
    from nanollmserve.bench.serve_workloads import ServeRequest

    cold, prime, warm = make_prompts(words, args)
    backend = OpenAIBackend(base_url, "completions", args.api_key)
    backend.extra_body = {"temperature": 0.0}
    try:
        backend.model = await backend.fetch_model()

        async def one_by_one(requests):
            results = []
            for r in requests:
                result = await backend.send(
                    ServeRequest(words.text(r.prompt_token_ids), r.prompt_token_ids, r.max_tokens)
                )
                if not result.success:
                    raise RuntimeError(f"request failed: {result.error}")
                results.append(result)
            return results

        await one_by_one([BenchRequest(cold[0].prompt_token_ids[::-1], 2)])  # warmup
        cold_r = await one_by_one(cold)
        await one_by_one([prime])
        before = await backend.server_stats()
        warm_r = await one_by_one(warm)
        after = await backend.server_stats()
    finally:
        await backend.close()
    result = {
        "mode": "server over HTTP",
        "compare_with": "other servers over HTTP (--serve for ours, --base-url for a peer)",
        "base_url": args.base_url or "own server",
        "model": backend.model,
        "cold_ttft_s": [r.ttft for r in cold_r],
        "warm_ttft_s": [r.ttft for r in warm_r],
        "hit_rate": None,
    }
    if before and after:
        queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        result["hit_rate"] = round(hits / queries, 4) if queries else 0.0
    return result


def run(args: argparse.Namespace) -> int:
    from nanollmserve.config import engine_config_from_args

    if min(args.prefix_len, args.suffix_len, args.output_len, args.num_requests) < 1:
        from nanollmserve.errors import UserError

        raise UserError("--prefix-len, --suffix-len, --output-len, --num-requests must be >= 1")
    config = engine_config_from_args(args)
    if args.server_args and not args.serve:
        from nanollmserve.errors import UserError

        raise UserError("--server-args needs --serve")
    if args.restart and (args.base_url or args.serve or config.kv_offload_dir is None):
        from nanollmserve.errors import UserError

        raise UserError("--restart runs offline and needs --kv-offload-dir")
    if args.base_url or args.serve:
        from nanollmserve.bench.serve_workloads import WordTokens
        from nanollmserve.frontend.tokenizer import load_tokenizer
        from nanollmserve.model.source import resolve_model

        words = WordTokens(load_tokenizer(resolve_model(config.model).path))
        if args.base_url:
            raw = asyncio.run(run_server(args, words, args.base_url))
        else:
            from nanollmserve.bench.server_process import OwnServer

            serve_args = shlex.split(args.server_args)
            with OwnServer(serve_args) as server:
                raw = asyncio.run(run_server(args, words, server.url))
            raw["server_args"] = " ".join(serve_args)
    else:
        raw = run_offline(args, config)
    cold, warm = _dist(raw.pop("cold_ttft_s")), _dist(raw.pop("warm_ttft_s"))
    warm_over_cold = ratio(warm["p50"], cold["p50"])
    result = {
        "benchmark": "prefix",
        **raw,
        "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len,
        "output_len": args.output_len,
        "num_requests": args.num_requests,
        "cold_ttft_ms": cold,
        "warm_ttft_ms": warm,
        "warm_over_cold_p50": warm_over_cold,
        "target_ratio": TARGET_RATIO,
        "meets_target": warm_over_cold is not None and warm_over_cold <= TARGET_RATIO,
    }
    if args.plot:
        from nanollmserve.bench.plots import plot_bars

        plot_bars(
            f"Prefix cache: {args.prefix_len}-token shared prompt + {args.suffix_len}-token "
            f"question (hit rate {result['hit_rate']})",
            ["cold cache", "warm cache"],
            [
                ("TTFT p50 (ms)", [cold["p50"], warm["p50"]]),
                ("TTFT p95 (ms)", [cold["p95"], warm["p95"]]),
            ],
            args.plot,
        )
        log(f"wrote {args.plot}")
    return emit(result, args)

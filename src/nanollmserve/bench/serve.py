"""`nanollmserve bench serve`: a load generator for any OpenAI-compatible server.

    nanollmserve bench serve --num-prompts 200 --max-concurrency 32      # starts our server
    nanollmserve bench serve --base-url http://127.0.0.1:8081 --endpoint chat   # any server
    nanollmserve bench serve --preset mini-vllm
    nanollmserve bench serve --sweep-concurrency 1,4,16,32,64 --plot sweep.png

Without `--base-url` it starts our server on the bundled model (`--server-args` adds serve
flags) on a free port and stops it after. The model name comes from `/v1/models`, token
counts from `usage`, so llama.cpp's server, vLLM and ours are measured the same way. Requests
are sent all at once under `--max-concurrency`, or by a seeded Poisson process at
`--request-rate` per second. Metrics follow `vllm bench serve` (see serve_metrics.py); JSON
goes to stdout (and `--output`), a progress bar to stderr, CDF plots to `--plot`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import time

from nanollmserve.bench import serve_workloads as workloads
from nanollmserve.bench.report import add_common_args, emit, log, ratio
from nanollmserve.bench.serve_metrics import parse_goodput, summarize, summarize_kinds
from nanollmserve.errors import UserError

PRESETS = {
    # The Mini-vLLM write-up's CPU serving run: 500 requests, concurrency 50, 30 output
    # tokens each (it gives no prompt length; 32-token prompts are our choice).
    "mini-vllm": {
        "num_prompts": 500,
        "max_concurrency": 50,
        "output_len": "30",
        "input_len": "32",
        "ignore_eos": True,
    },
}
DEFAULTS = {"num_prompts": 100, "input_len": "128", "output_len": "128", "ignore_eos": False}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="load-test an OpenAI-compatible server")
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default=None, help="server root (default: start ours)")
    target.add_argument(
        "--server-args", default="", help="extra `nanollmserve serve` flags for our own server"
    )
    target.add_argument(
        "--backend",
        choices=["openai", "grpc", "both"],
        default="openai",
        help="both: the same workload over HTTP, then over gRPC, on one server; one JSON",
    )
    target.add_argument("--grpc-target", default=None, help="host:port of gRPC (with --base-url)")
    target.add_argument(
        "--endpoint",
        choices=["completions", "chat", "embeddings", "messages"],
        default="completions",
        help="embeddings: /v1/embeddings (our own server then runs --runner pooling); "
        "messages: Anthropic's /v1/messages",
    )
    target.add_argument("--model", default=None, help="model name (default: from /v1/models)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    target.add_argument(
        "--tokenizer", default=None, help="tokenizer that builds prompts (default: bundled)"
    )
    load = p.add_argument_group("workload")
    load.add_argument("--workload", choices=workloads.WORKLOADS, default="random")
    load.add_argument("--preset", choices=sorted(PRESETS), default=None)
    load.add_argument("--num-prompts", type=int, default=None, help="default 100")
    load.add_argument("--input-len", default=None, help="N or LOW-HIGH tokens (default 128)")
    load.add_argument("--output-len", default=None, help="N or LOW-HIGH tokens (default 128)")
    load.add_argument("--num-groups", type=int, default=4, help="shared-prefix: prompt groups")
    load.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens")
    load.add_argument(
        "--long-input-len",
        default=workloads.DEFAULT_LONG_INPUT_LEN,
        help="mixed: the long prompts' tokens, N or LOW-HIGH (the short ones: --input-len)",
    )
    load.add_argument(
        "--long-fraction",
        type=float,
        default=workloads.DEFAULT_LONG_FRACTION,
        help="mixed: the share of long prompts, 0 to 1",
    )
    load.add_argument("--dataset-path", default=None, help="sharegpt: JSON or JSONL file")
    load.add_argument("--max-model-len", type=int, default=2048, help="sharegpt length filter")
    load.add_argument("--prompt-format", choices=["text", "ids"], default="text")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--ignore-eos", action="store_true", default=None)
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument(
        "--extra-body",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="merged into every OpenAI request, e.g. '{\"response_format\": {...}}'",
    )
    load.add_argument("--top-p", type=float, default=1.0, help="sent when below 1")
    arrival = p.add_argument_group("arrival")
    arrival.add_argument("--max-concurrency", type=int, default=None)
    arrival.add_argument("--request-rate", type=float, default=math.inf, help="Poisson, req/s")
    arrival.add_argument("--sweep-concurrency", default=None, help="e.g. 1,4,16,32,64")
    arrival.add_argument("--num-warmups", type=int, default=1)
    out = p.add_argument_group("report")
    out.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS")
    out.add_argument("--plot", default=None, help="write latency CDFs (and sweep) PNG here")
    out.add_argument("--save-detailed", action="store_true", help="per-request values in JSON")
    out.add_argument("--disable-tqdm", action="store_true")
    out.add_argument(
        "--hf-baseline",
        action="store_true",
        help="with --endpoint embeddings: also encode the run's texts with transformers "
        "(batches of 32, float32, the --tokenizer model) and report both throughputs",
    )
    add_common_args(p, engine=False)
    p.set_defaults(func=run)


def resolve_defaults(args: argparse.Namespace) -> None:
    """Fill unset workload flags from the preset, then from DEFAULTS."""
    preset = PRESETS.get(args.preset or "", {})
    for name in ("num_prompts", "input_len", "output_len", "ignore_eos", "max_concurrency"):
        if name == "output_len" and args.workload == "sharegpt" and not preset:
            continue  # each conversation's own reply length
        if getattr(args, name) is None:
            setattr(args, name, preset.get(name, DEFAULTS.get(name)))


def build_requests(args: argparse.Namespace, words: workloads.WordTokens, seed: int) -> list:
    if args.workload == "sharegpt":
        if not args.dataset_path:
            raise UserError("--workload sharegpt needs --dataset-path FILE")
        return workloads.sharegpt_workload(
            words.tokenizer, args.dataset_path, args.num_prompts,
            args.output_len, args.max_model_len, seed,
        )  # fmt: skip
    if args.workload == "shared-prefix":
        return workloads.shared_prefix_workload(
            words, args.num_prompts, args.num_groups, args.prefix_len,
            args.input_len, args.output_len, seed,
        )  # fmt: skip
    if args.workload == "mixed":
        return workloads.mixed_workload(
            words, args.num_prompts, args.input_len, args.long_input_len,
            args.long_fraction, args.output_len, seed,
        )  # fmt: skip
    return workloads.random_workload(words, args.num_prompts, args.input_len, args.output_len, seed)


async def run_load(backend, requests, max_concurrency, request_rate, seed, progress) -> tuple:
    """Send every request (Poisson gaps at `request_rate`, at most `max_concurrency` in
    flight); returns the results in request order, the duration and the peak in flight."""
    from nanollmserve.bench.serve_client import RequestResult

    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    in_flight = peak = 0

    async def one(request) -> RequestResult:
        nonlocal in_flight, peak
        async with limit:
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await backend.send(request)
            except Exception as exc:  # a backend bug must not stop the benchmark
                return RequestResult(error=f"{type(exc).__name__}: {exc}"[:300])
            finally:
                in_flight -= 1
                progress.update(1)

    start = time.perf_counter()
    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(one(request)))
        if request_rate != math.inf:
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start, peak


def stats_delta(before: dict | None, after: dict | None) -> dict | None:
    """What our server's /stats says about the run (prefix-cache hits, peak running)."""
    if not before or not after:
        return None
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    return {
        "prefix_cache_queried_tokens": queries,
        "prefix_cache_hit_tokens": hits,
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
        "num_requests_rejected": after["num_requests_rejected"] - before["num_requests_rejected"],
        "peak_running_requests_since_start": after["peak_running_requests"],
    }


async def benchmark(args, backend, words: workloads.WordTokens) -> tuple[dict, list]:
    from tqdm import tqdm

    backend.model = args.model or await backend.fetch_model()
    levels = [args.max_concurrency]
    if args.sweep_concurrency:
        levels = [int(x) for x in args.sweep_concurrency.split(",") if x.strip()]
    if args.num_warmups:
        warm = [workloads.warmup_request(words, args.seed)]
        log(f"warmup: {args.num_warmups} request(s)")
        for result in [await backend.send(warm[0]) for _ in range(args.num_warmups)]:
            if not result.success:
                raise UserError(f"the warmup request failed: {result.error}")
    slos = parse_goodput(args.goodput)
    runs, raw = [], []
    for index, level in enumerate(levels):
        # Every level gets fresh prompts (seed + index), so none hits the prefix cache of
        # an earlier level; the length distributions are the same.
        requests = build_requests(args, words, args.seed + index)
        before = await backend.server_stats()
        desc = f"concurrency {level}" if level else "requests"
        with tqdm(total=len(requests), desc=desc, disable=args.disable_tqdm) as progress:
            results, duration, peak = await run_load(
                backend, requests, level, args.request_rate, args.seed, progress
            )
        await backend.fill_missing_counts(requests, results)
        summary = {"max_concurrency": level, **summarize(results, duration, peak, slos)}
        if any(request.kind for request in requests):
            summary["by_kind"] = summarize_kinds(requests, results)
        if (server := stats_delta(before, await backend.server_stats())) is not None:
            summary["server"] = server
        if args.save_detailed:
            summary["requests"] = [_detail(r) for r in results]
        runs.append(summary)
        raw.append(results)
        log(
            f"{desc}: {summary['completed']} done, {summary['failed']} failed, "
            f"{summary['output_throughput']} output tok/s, "
            f"TTFT p50 {summary['ttft_ms']['p50']} ms"
        )
    head = {
        "benchmark": "serve",
        "backend": backend.name,
        "endpoint": args.endpoint,
        "base_url": args.base_url or ("" if args.grpc_target else "own server"),
        "grpc_target": args.grpc_target if backend.name == "grpc" else None,
        "model": backend.model,
        "workload": args.workload,
        "preset": args.preset,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len if args.workload != "sharegpt" else None,
        "output_len": args.output_len,
        "prompt_format": args.prompt_format,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "extra_body": args.extra_body,
        "top_p": args.top_p,
        "request_rate": None if args.request_rate == math.inf else args.request_rate,
        "seed": args.seed,
    }
    if args.workload == "shared-prefix":
        head.update(num_groups=args.num_groups, prefix_len=args.prefix_len)
    if args.workload == "mixed":
        head.update(long_input_len=args.long_input_len, long_fraction=args.long_fraction)
    if args.sweep_concurrency:
        return {**head, "sweep": runs}, raw
    return {**head, **runs[0]}, raw


def _detail(r) -> dict:
    """One RequestResult as the JSON of `--save-detailed`."""
    return {
        "success": r.success,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "ttft_ms": round(r.ttft * 1000, 3),
        "e2el_ms": round(r.e2e * 1000, 3),
        "itl_ms": [round(x * 1000, 3) for x in r.itl],
        "error": r.error or None,
    }


def _side_by_side(measured: list[tuple[dict, list]]) -> tuple[dict, list]:
    """HTTP and gRPC results of one workload in one JSON, with gRPC/HTTP ratios."""
    (http, http_raw), (grpc, _) = measured
    result = {"benchmark": "serve", "backend": "both", "openai": http, "grpc": grpc}
    if "sweep" not in http:
        result["ratios"] = {
            "grpc_vs_openai_output_throughput": ratio(
                grpc["output_throughput"], http["output_throughput"]
            ),
            "grpc_vs_openai_ttft_p50": ratio(grpc["ttft_ms"]["p50"], http["ttft_ms"]["p50"]),
            "grpc_vs_openai_tpot_p50": ratio(grpc["tpot_ms"]["p50"], http["tpot_ms"]["p50"]),
        }
    return result, http_raw  # the plot shows the HTTP run


def _hf_embed_baseline(args, words: workloads.WordTokens, result: dict) -> dict:
    """transformers encoding the first run's texts (after the server stopped), and how our
    input-token throughput compares with it."""
    from nanollmserve.bench.hf_embed import hf_embed_throughput
    from nanollmserve.model.source import resolve_model

    texts = [r.completion_prompt() for r in build_requests(args, words, args.seed)]
    log(f"hf baseline: encoding {len(texts)} texts with transformers, batches of 32")
    baseline = hf_embed_throughput(resolve_model(args.tokenizer).path, texts)
    ours = result.get("sweep", [result])[0]
    baseline["ours_vs_hf_input_token_throughput"] = ratio(
        ours["total_token_throughput"], baseline["input_token_throughput"]
    )
    return baseline


def make_backend(args, name: str, base_url: str, grpc_target: str | None):
    from nanollmserve.bench.serve_client import GrpcBackend, OpenAIBackend

    if name == "grpc":
        if args.endpoint in ("embeddings", "messages"):
            raise UserError(
                f"--endpoint {args.endpoint} is served over HTTP only (--backend openai)"
            )
        if not grpc_target:
            raise UserError("--backend grpc with --base-url needs --grpc-target HOST:PORT")
        backend = GrpcBackend(grpc_target, args.endpoint, args.api_key, stats_url=base_url)
        backend.extra = {"temperature": args.temperature, "ignore_eos": bool(args.ignore_eos)}
        if args.top_p < 1:
            backend.extra["top_p"] = args.top_p
        return backend
    extra: dict = {"temperature": args.temperature}
    if args.top_p < 1:
        extra["top_p"] = args.top_p
    if args.ignore_eos:
        # ignore_eos: vLLM, nanollmserve, llama.cpp's own server. llama-cpp-python has no
        # such field (it ignores it) but honours min_tokens, set to max_tokens per request.
        extra["ignore_eos"] = True
    extra.update(args.extra_body or {})
    backend = OpenAIBackend(base_url, args.endpoint, args.api_key, args.prompt_format, extra)
    backend.min_tokens_is_max_tokens = bool(args.ignore_eos)
    return backend


def run(args: argparse.Namespace) -> int:
    from nanollmserve.bench.server_process import OwnServer
    from nanollmserve.frontend.tokenizer import load_tokenizer
    from nanollmserve.model.source import resolve_model

    resolve_defaults(args)
    if args.num_prompts < 1:
        raise UserError("--num-prompts must be >= 1")
    parse_goodput(args.goodput)  # fail on a typo before a server starts
    if not 0.0 <= args.long_fraction <= 1.0:
        raise UserError(f"--long-fraction must be within [0, 1], got {args.long_fraction}")
    if args.hf_baseline and args.endpoint != "embeddings":
        raise UserError("--hf-baseline needs --endpoint embeddings")
    words = workloads.WordTokens(load_tokenizer(resolve_model(args.tokenizer).path))

    names = ["openai", "grpc"] if args.backend == "both" else [args.backend]

    async def measure(base_url: str, grpc_target: str | None):
        results = []
        for index, name in enumerate(names):
            backend = make_backend(args, name, base_url, grpc_target)
            # The second backend gets other prompts (same lengths): no prefix-cache help.
            run_args = argparse.Namespace(**{**vars(args), "seed": args.seed + 1000 * index})
            try:
                results.append(await benchmark(run_args, backend, words))
            finally:
                await backend.close()
        return results

    if args.base_url or (args.backend != "openai" and args.grpc_target):
        measured = asyncio.run(measure(args.base_url, args.grpc_target))
        server_args = None
    else:
        serve_args = shlex.split(args.server_args)
        if args.endpoint == "embeddings" and not {"--runner", "--task"} & set(serve_args):
            serve_args += ["--runner", "pooling"]
        if "--max-queue-len" not in serve_args:  # never reject a request of the benchmark
            serve_args += ["--max-queue-len", str(max(256, args.num_prompts))]
        with OwnServer(serve_args, grpc="grpc" in names) as server:
            target = server.grpc_target if "grpc" in names else None
            measured = asyncio.run(measure(server.url, target))
        server_args = " ".join(serve_args)
    result, raw = measured[0] if len(measured) == 1 else _side_by_side(measured)
    if server_args is not None:
        result["server_args"] = server_args
    if args.hf_baseline:
        result["hf_baseline"] = _hf_embed_baseline(args, words, result)
    if args.plot:
        from nanollmserve.bench.plots import plot_serve

        plot_serve(result, raw, args.plot)
        log(f"wrote {args.plot}")
    return emit(result, args)

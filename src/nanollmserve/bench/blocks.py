"""`nanollmserve bench blocks`: what paging buys in KV memory.

For a mix of request lengths (prompt + output tokens), allocate every request in the real
KVCacheManager at several block sizes and compare with contiguous max-length reservation
(what a server without paging must hold per request): how much reserved memory holds real
tokens (utilization), how much is lost in partly filled last blocks (internal
fragmentation), and how many requests fit a fixed KV budget each way. No model is needed.
"""

from __future__ import annotations

import argparse
import random

from nanollmserve.bench.report import add_common_args, emit, log


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("blocks", help="KV utilization: paged blocks vs contiguous")
    parser.add_argument(
        "--lengths", default=None, help="comma-separated request lengths in tokens (default: mix)"
    )
    parser.add_argument("--num-requests", type=int, default=256, help="size of the default mix")
    parser.add_argument("--block-sizes", default="8,16,32")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=2048,
        help="what contiguous reservation holds per request",
    )
    parser.add_argument(
        "--kv-budget-tokens",
        type=int,
        default=32768,
        help="KV budget for the max-concurrency comparison",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, help="write a PNG bar chart here")
    add_common_args(parser, engine=False)
    parser.set_defaults(func=run)


def realistic_lengths(num_requests: int, max_len: int, seed: int) -> list[int]:
    """Chat-like mix: log-normal prompts (median ~200) plus log-normal outputs (median ~150),
    capped at max_len; a heavy tail, like ShareGPT conversations."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(num_requests):
        prompt = int(rng.lognormvariate(5.3, 0.8))
        output = int(rng.lognormvariate(5.0, 0.7))
        lengths.append(max(1, min(max_len, prompt + output)))
    return lengths


def paged_report(lengths: list[int], block_size: int, budget_tokens: int) -> dict:
    from nanollmserve.engine.kv_cache import KVCacheManager
    from nanollmserve.engine.messages import EngineCoreRequest
    from nanollmserve.engine.request import Request
    from nanollmserve.sampling_params import SamplingParams

    def request(i: int, n: int) -> Request:
        core = EngineCoreRequest(str(i), [0] * n, SamplingParams(max_tokens=1))
        return Request(core, set(), 1)

    # Everything at once in a pool big enough: utilization and fragmentation.
    total_blocks = sum(-(-n // block_size) for n in lengths)
    kv = KVCacheManager(total_blocks, block_size, enable_prefix_caching=False)
    for i, n in enumerate(lengths):
        assert kv.allocate_slots(request(i, n), n)
    stats = kv.stats()
    # A fixed budget: admit requests in order until the pool is full.
    budget = KVCacheManager(budget_tokens // block_size, block_size, enable_prefix_caching=False)
    fit = 0
    for i, n in enumerate(lengths):
        if not budget.allocate_slots(request(i, n), n):
            break
        fit += 1
    return {
        "reserved_tokens": stats.reserved_tokens,
        "allocated_tokens": stats.allocated_tokens,
        "utilization": round(1 - stats.internal_fragmentation, 4),
        "internal_fragmentation": round(stats.internal_fragmentation, 4),
        "wasted_tokens_per_request": round(
            (stats.reserved_tokens - stats.allocated_tokens) / len(lengths), 2
        ),
        "max_concurrent_requests_in_budget": fit,
    }


def contiguous_report(lengths: list[int], max_model_len: int, budget_tokens: int) -> dict:
    reserved = max_model_len * len(lengths)
    allocated = sum(lengths)
    return {
        "reserved_tokens": reserved,
        "allocated_tokens": allocated,
        "utilization": round(allocated / reserved, 4),
        "internal_fragmentation": round(1 - allocated / reserved, 4),
        "wasted_tokens_per_request": round((reserved - allocated) / len(lengths), 2),
        "max_concurrent_requests_in_budget": min(len(lengths), budget_tokens // max_model_len),
    }


def run(args: argparse.Namespace) -> int:
    if args.lengths:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    else:
        lengths = realistic_lengths(args.num_requests, args.max_model_len, args.seed)
    if not lengths or min(lengths) < 1 or max(lengths) > args.max_model_len:
        from nanollmserve.errors import UserError

        raise UserError(f"request lengths must be in [1, --max-model-len={args.max_model_len}]")
    block_sizes = [int(x) for x in args.block_sizes.split(",")]
    schemes = {
        f"paged_block_{bs}": paged_report(lengths, bs, args.kv_budget_tokens) for bs in block_sizes
    }
    schemes["contiguous_max_len"] = contiguous_report(
        lengths, args.max_model_len, args.kv_budget_tokens
    )
    result = {
        "benchmark": "blocks",
        "num_requests": len(lengths),
        "mean_length": round(sum(lengths) / len(lengths), 1),
        "max_length": max(lengths),
        "max_model_len": args.max_model_len,
        "kv_budget_tokens": args.kv_budget_tokens,
        "schemes": schemes,
    }
    if args.plot:
        _plot(result, args.plot)
        log(f"wrote {args.plot}")
    return emit(result, args)


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["schemes"])
    labels = [
        n.replace("paged_block_", "block ").replace("contiguous_max_len", "contiguous")
        for n in names
    ]
    util = [result["schemes"][n]["utilization"] * 100 for n in names]
    fit = [result["schemes"][n]["max_concurrent_requests_in_budget"] for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(labels, util, color="tab:blue")
    ax1.set_ylabel("KV utilization (%)")
    ax1.set_ylim(0, 100)
    ax1.set_title("Reserved KV slots holding real tokens")
    ax2.bar(labels, fit, color="tab:green")
    ax2.set_ylabel("requests")
    ax2.set_title(f"Requests that fit {result['kv_budget_tokens']} KV tokens")
    fig.suptitle(
        f"{result['num_requests']} requests, mean length {result['mean_length']} tokens, "
        f"max_model_len {result['max_model_len']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)

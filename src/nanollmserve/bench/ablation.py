"""`nanollmserve bench ablation`: what each engine feature adds, on one workload, in one run.

Five systems, same weights, dtype, prompts, output lengths (greedy, ignore_eos) and arrival
times (all at once by default; `--request-rate` for seeded Poisson arrivals):

1. `hf_one_at_a_time`: HF `generate` with its KV cache, one request after the other.
2. `hf_static_batching`: HF `generate` on padded batches of `--static-batch-size` formed
   from the requests that have arrived; a batch runs until its longest output is done.
3. `engine_continuous_batching`: our engine with prefix caching off and chunked prefill off.
   Our scheduler splits a prompt only when it does not fit what is left of the step's token
   budget, so "off" is a budget no step can exceed: the `max_num_seqs` longest prompts of
   the workload plus one decode token per sequence. Every prompt is then prefilled whole, in
   the step it is admitted (what vLLM does with chunked prefill disabled).
4. `engine_prefix_caching`: 3 + prefix caching.
5. `engine_chunked_prefill`: 4 with the budget `--max-num-batched-tokens` (default 512):
   long prompts are prefilled in chunks, one budget per step, beside the running decodes.
   This is the engine as shipped.

The workload makes each feature matter: most requests share one of `--num-groups` system
prompts of `--prefix-len` tokens, and every `--long-every`-th request is a unique
`--long-len` prompt. Before the timed run each engine serves one request per system prompt
(untimed), as a server that has seen its system prompts before would have; requests that
prefill in the same step cannot reuse each other's blocks, so a cold burst would hide what
prefix caching does. The HF baselines get the same warm-up (code paths only: no cache).
Reported per system: output tokens/s, TTFT p50/p95, ITL p95/p99 (a long prefill done in
one step stalls every running decode for that step; chunking bounds the stall) and the
prefix-cache hit rate of the timed run.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import time

from nanollmserve.bench import hf_baselines
from nanollmserve.bench.engine_driver import Timing, run_engine
from nanollmserve.bench.report import add_common_args, emit, log, percentile, ratio
from nanollmserve.bench.workload import BenchRequest, parse_range

SYSTEMS = (
    "hf_one_at_a_time",
    "hf_static_batching",
    "engine_continuous_batching",
    "engine_prefix_caching",
    "engine_chunked_prefill",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("ablation", help="HF baselines vs each engine feature, one run")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--num-groups", type=int, default=4, help="shared system prompts")
    p.add_argument("--prefix-len", type=int, default=384, help="tokens per system prompt")
    p.add_argument("--question-len", default="16-64", help="N or LOW-HIGH tokens after it")
    p.add_argument("--long-len", type=int, default=1024, help="tokens of each long prompt")
    p.add_argument("--long-every", type=int, default=8, help="every Nth request is long; 0: none")
    p.add_argument("--output-len", default="32-64", help="N or LOW-HIGH tokens")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson req/s")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--static-batch-size", type=int, default=16)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    p.add_argument("--plot", default=None, help="write a PNG bar chart here")
    add_common_args(p)
    p.set_defaults(func=run)


def make_workload(args, vocab_size: int) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """Request i is long (unique prompt) when i % long_every == 1, else shared prefix i %
    num_groups plus its own question; token ids avoid the first 100 (special tokens). Also
    one warm-up request per system prompt (its prefix and a fixed 8-token question)."""
    rng = random.Random(args.workload_seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab_size) for _ in range(n)]

    prefixes = [ids(args.prefix_len) for _ in range(args.num_groups)]
    question, output = parse_range(args.question_len), parse_range(args.output_len)
    requests = []
    for i in range(args.num_requests):
        if args.long_every and i % args.long_every == 1:
            prompt = ids(args.long_len)
        else:
            prompt = prefixes[i % args.num_groups] + ids(rng.randint(*question))
        requests.append(BenchRequest(prompt, rng.randint(*output)))
    tail = ids(8)
    return requests, [BenchRequest(prefix + tail, 2) for prefix in prefixes]


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    if rate == float("inf"):
        return [0.0] * n
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _wait_until(t: float) -> None:
    time.sleep(max(0.0, t - time.perf_counter()))


def hf_one_at_a_time(model, requests, arrivals) -> tuple[list[Timing], float]:
    start = time.perf_counter()
    timings = [Timing(arrival=start + a) for a in arrivals]
    for i in sorted(range(len(requests)), key=lambda i: arrivals[i]):
        _wait_until(timings[i].arrival)
        t0 = time.perf_counter()
        _, times = hf_baselines.generate_with_cache(
            model, requests[i].prompt_token_ids, requests[i].max_tokens
        )
        timing = timings[i]
        timing.token_times = [t0 + t for t in times]
        timing.first_token, timing.finish = timing.token_times[0], timing.token_times[-1]
        timing.num_output_tokens = len(times)
    return timings, max(t.finish for t in timings) - start


class _StepTimes:
    """A logits processor that only records when each decoding step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


@hf_baselines.inference_mode
def _static_batch(model, batch: list[BenchRequest]) -> list[float]:
    """One padded batch (left padding) until its longest output; the step times."""
    import torch

    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
        mask[row, width - len(r.prompt_token_ids) :] = 1
    longest = max(r.max_tokens for r in batch)
    steps = _StepTimes()
    model.generate(
        ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
        do_sample=False, eos_token_id=None, pad_token_id=0, logits_processor=[steps],
    )  # fmt: skip
    return steps.times


def hf_static_batching(model, requests, arrivals, batch_size) -> tuple[list[Timing], float]:
    start = time.perf_counter()
    timings = [Timing(arrival=start + a) for a in arrivals]
    queue = sorted(range(len(requests)), key=lambda i: arrivals[i])
    while queue:
        _wait_until(timings[queue[0]].arrival)
        now = time.perf_counter()
        batch = [i for i in queue[:batch_size] if timings[i].arrival <= now]
        queue = queue[len(batch) :]
        steps = _static_batch(model, [requests[i] for i in batch])
        for i in batch:  # each request's tokens are ready at the steps of its own length
            timing = timings[i]
            timing.token_times = steps[: requests[i].max_tokens]
            timing.first_token, timing.finish = steps[0], steps[-1]
            timing.num_output_tokens = requests[i].max_tokens
    return timings, max(t.finish for t in timings) - start


def engine_configs(base, prompt_lens: list[int]) -> dict:
    # No step can need more: the max_num_seqs longest prompts whole, plus a decode token each.
    most = sum(sorted(prompt_lens)[-base.max_num_seqs :]) + base.max_num_seqs
    no_chunking = max(most, base.max_num_batched_tokens)
    return {
        "engine_continuous_batching": dataclasses.replace(
            base, enable_prefix_caching=False, max_num_batched_tokens=no_chunking
        ),
        "engine_prefix_caching": dataclasses.replace(
            base, enable_prefix_caching=True, max_num_batched_tokens=no_chunking
        ),
        "engine_chunked_prefill": dataclasses.replace(base, enable_prefix_caching=True),
    }


def summarize(timings: list[Timing], seconds: float) -> dict:
    out_tokens = sum(t.num_output_tokens for t in timings)
    ttft = [t.ttft * 1000 for t in timings]
    itl = [g * 1000 for t in timings for g in t.itl]
    return {
        "requests": len(timings),
        "output_tokens": out_tokens,
        "elapsed_s": round(seconds, 3),
        "output_tokens_per_s": round(out_tokens / seconds, 2),
        "ttft_p50_ms": round(percentile(ttft, 50), 2),
        "ttft_p95_ms": round(percentile(ttft, 95), 2),
        "itl_p95_ms": round(percentile(itl, 95), 2) if itl else None,
        "itl_p99_ms": round(percentile(itl, 99), 2) if itl else None,
    }


def run(args: argparse.Namespace) -> int:
    from nanollmserve.config import engine_config_from_args
    from nanollmserve.engine.engine_core import EngineCore
    from nanollmserve.engine.model_loading import load_engine_model
    from nanollmserve.errors import UserError
    from nanollmserve.model.device import dtype_name

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := set(systems) - set(SYSTEMS):
        raise UserError(f"unknown --systems {sorted(unknown)}; choose from {SYSTEMS}")
    base = engine_config_from_args(args)
    loaded = load_engine_model(base)
    requests, warmups = make_workload(args, loaded.model_config.vocab_size)
    arrivals = arrival_times(len(requests), args.request_rate, args.workload_seed)
    longest = max(len(r.prompt_token_ids) for r in requests)
    configs = engine_configs(base, [len(r.prompt_token_ids) for r in requests])
    if longest <= base.max_num_batched_tokens:
        log(f"note: the longest prompt ({longest}) fits --max-num-batched-tokens; nothing chunks")
    results = {}
    hf = None
    for name in systems:
        log(f"{name}: {len(requests)} requests")
        if name.startswith("hf_"):
            if hf is None:
                hf = hf_baselines.load_hf_model(loaded.model_dir, loaded.dtype)
                for warmup in warmups:  # no cache to fill: this only warms the code paths
                    hf_baselines.generate_with_cache(hf, warmup.prompt_token_ids, 2)
            if name == "hf_one_at_a_time":
                timings, seconds = hf_one_at_a_time(hf, requests, arrivals)
            else:
                timings, seconds = hf_static_batching(
                    hf, requests, arrivals, args.static_batch_size
                )
            results[name] = summarize(timings, seconds)
            continue
        config = configs[name]
        engine = EngineCore(config, loaded)
        run_engine(engine, warmups)  # a server that has seen its system prompts before
        before = engine.stats()
        timings, seconds = run_engine(engine, requests, arrivals)
        after = engine.stats()
        results[name] = summarize(timings, seconds)
        results[name]["enable_prefix_caching"] = config.enable_prefix_caching
        results[name]["max_num_batched_tokens"] = config.max_num_batched_tokens
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        results[name]["prefix_cache_hit_rate"] = round(hits / queries, 4) if queries else 0.0
        del engine
        gc.collect()
    result = {
        "benchmark": "ablation",
        "model": loaded.source.name,
        "device": str(loaded.device),
        "dtype": dtype_name(loaded.dtype),
        "num_requests": len(requests),
        "num_long_prompts": sum(len(r.prompt_token_ids) == args.long_len for r in requests),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "output_tokens": sum(r.max_tokens for r in requests),
        "workload": {
            k: getattr(args, k)
            for k in (
                "num_groups",
                "prefix_len",
                "question_len",
                "long_len",
                "long_every",
                "output_len",
                "static_batch_size",
                "workload_seed",
            )
        },  # fmt: skip
        "request_rate": None if args.request_rate == float("inf") else args.request_rate,
        "max_num_seqs": base.max_num_seqs,
        "systems": results,
        "ratios": _ratios(results),
    }
    if args.plot:
        _plot(result, args.plot)
        log(f"wrote {args.plot}")
    return emit(result, args)


def _ratios(results: dict) -> dict:
    ratios = {}
    for name, r in results.items():
        if name.startswith("engine_") and "hf_static_batching" in results:
            ratios[f"{name}_vs_hf_static_batching_tokens_per_s"] = ratio(
                r["output_tokens_per_s"], results["hf_static_batching"]["output_tokens_per_s"]
            )
    return ratios


def _plot(result: dict, path: str) -> None:
    from nanollmserve.bench.plots import plot_bars

    names = list(result["systems"])
    labels = [n.replace("engine_", "engine: ").replace("hf_", "HF ") for n in names]
    systems = result["systems"]
    plot_bars(
        f"Ablation: {result['num_requests']} requests, {result['model']} ({result['dtype']})",
        labels,
        [
            ("output tokens/s", [systems[n]["output_tokens_per_s"] for n in names]),
            ("TTFT p95 (ms)", [systems[n]["ttft_p95_ms"] for n in names]),
            ("ITL p95 (ms)", [systems[n]["itl_p95_ms"] or 0 for n in names]),
        ],
        path,
    )

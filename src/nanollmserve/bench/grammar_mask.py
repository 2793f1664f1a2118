"""`nanollmserve bench grammar`: what structured output costs per engine step.

For each batch size, it times the model runner's hook (`GrammarBitmask.apply`: fill one
batched bitmask from every row's grammar state, then mask the logits) on rows without a
grammar and on rows that all have one, walking each grammar through real states (each row
accepts a random allowed token per step, restarting when its grammar ends). CPU time of
the process (`time.process_time`), so other load on the machine inflates it far less than
wall time. Also reports the grammar's compile time, cold and from the cache.

`--generate N` adds the end-to-end cost: N chat requests (`--max-tokens` each, temperature
1.0, `ignore_eos`) through the offline `LLM`, with the schema and without, alternating
(`--repeat` pairs after a warm-up pair), as output tokens per CPU second of the process and
per wall second; `constrained_vs_unconstrained` is the median over the pairs of the ratio.
Run it with `OMP_NUM_THREADS=1` so the CPU seconds are the work done, not threads spinning
while the machine is shared. JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from nanollmserve.bench.report import emit

DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("grammar", help="structured output: mask cost per step")
    p.add_argument("model", nargs="?", default=None, help="model (tokenizer) to mask for")
    p.add_argument("--batch-sizes", default="1,32", help="comma-separated")
    p.add_argument("--steps", type=int, default=100, help="steps timed per configuration")
    p.add_argument("--schema", type=json.loads, default=None, help="JSON schema (JSON text)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--generate", type=int, default=0, metavar="N", help="also: N chat requests end to end"
    )
    p.add_argument("--max-tokens", type=int, default=32, help="--generate: tokens per request")
    p.add_argument("--repeat", type=int, default=3, help="--generate: timed pairs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from nanollmserve.engine.grammar_compiler import GrammarCompiler
    from nanollmserve.engine.structured_output import GrammarBitmask, GrammarState
    from nanollmserve.frontend.tokenizer import load_tokenizer
    from nanollmserve.model.model_config import ModelConfig
    from nanollmserve.model.source import resolve_model
    from nanollmserve.structured_outputs import StructuredOutputsParams

    source = resolve_model(args.model)
    tokenizer = load_tokenizer(source.path)
    config = ModelConfig.from_pretrained(source.path)
    vocab_size = config.vocab_size
    compiler = GrammarCompiler(tokenizer, vocab_size, sorted(config.eos_token_ids))
    params = StructuredOutputsParams(json=args.schema or DEFAULT_SCHEMA)
    compiler.compile(StructuredOutputsParams(choice=["warm-up"]))  # tokenizer info built
    start = time.perf_counter()
    compiled = compiler.compile(params)
    compile_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    compiler.compile(params)
    cached_ms = (time.perf_counter() - start) * 1e3

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    hook = GrammarBitmask()
    results = []
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        for with_grammar in (False, True):
            rows = [
                _Row(GrammarState(compiled) if with_grammar else None) for _ in range(batch_size)
            ]
            logits = torch.randn(batch_size, vocab_size)
            times = []
            for _ in range(args.steps):
                masked = logits.clone()
                start = time.process_time()
                hook.apply(masked, rows)
                times.append(time.process_time() - start)
                for i, row in enumerate(rows):
                    if row.grammar is not None:
                        _advance(row, masked[i], compiled, rng)
            results.append(
                {
                    "batch_size": batch_size,
                    "grammar": with_grammar,
                    "mean_us_per_step": round(statistics.mean(times) * 1e6, 1),
                    "median_us_per_step": round(statistics.median(times) * 1e6, 1),
                }
            )
    report = {
        "model": source.name,
        "vocab_size": vocab_size,
        "engine": "xgrammar",
        "compile_ms": round(compile_ms, 2),
        "compile_cached_ms": round(cached_ms, 3),
        "steps": args.steps,
        "results": results,
    }
    if args.generate:
        report["generate"] = _generate(args, args.schema or DEFAULT_SCHEMA)
    return emit(report, args)


def _generate(args: argparse.Namespace, schema: dict) -> dict:
    """Output tokens per CPU second and per wall second of `args.generate` chat requests,
    with the schema and without, alternating which goes first."""
    from nanollmserve import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(args.model)
    messages = [
        [{"role": "user", "content": f"Describe item {i} as a JSON object."}]
        for i in range(args.generate)
    ]

    def once(constrained: bool) -> dict:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=1.0,
            ignore_eos=True,
            seed=args.seed,
            structured_outputs=StructuredOutputsParams(json=schema) if constrained else None,
        )
        cpu, wall = time.process_time(), time.perf_counter()
        outputs = llm.chat(messages, params, use_tqdm=False)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {"tokens": tokens, "tok_per_cpu_s": tokens / cpu, "tok_per_s": tokens / wall}

    once(True)  # warm-up: the grammar's compile, first-step costs
    once(False)
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for i in range(args.repeat):
        for constrained in (True, False) if i % 2 == 0 else (False, True):
            runs[constrained].append(once(constrained))

    def ratio(key: str) -> float:
        pairs = zip(runs[True], runs[False], strict=True)
        return round(statistics.median(c[key] / u[key] for c, u in pairs), 3)

    def rounded(run: dict) -> dict:
        return {k: round(v, 2) for k, v in run.items()}

    return {
        "requests": args.generate,
        "max_tokens": args.max_tokens,
        "constrained": [rounded(r) for r in runs[True]],
        "unconstrained": [rounded(r) for r in runs[False]],
        "constrained_vs_unconstrained": {
            "tok_per_cpu_s": ratio("tok_per_cpu_s"),
            "tok_per_s": ratio("tok_per_s"),
        },
    }


class _Row:
    """A stand-in for an engine Request: the hook reads only `.grammar`."""

    def __init__(self, grammar) -> None:
        self.grammar = grammar


def _advance(row: _Row, masked_logits, compiled, rng: random.Random) -> None:
    """Accept a random token the mask allowed; a grammar that ended starts over."""
    from nanollmserve.engine.structured_output import GrammarState

    allowed = (masked_logits > float("-inf")).nonzero().flatten().tolist()
    row.grammar.accept_token(rng.choice(allowed))
    if row.grammar.is_finished:
        row.grammar = GrammarState(compiled)

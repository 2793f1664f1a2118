"""`nanollmserve bench spec-decode`: single-stream TPOT with and without speculative decoding.

One run, two engines on the same weights: one without speculation, one with
`--speculative-config` (default: ngram, 4 drafts, lookup 2..4). Two workloads, greedy,
`--output-len` tokens each:

- copy: a chat request to repeat ~`--input-len` tokens of code (this package's KV block
  pool) exactly, where prompt lookup finds long runs to propose;
- random: a prompt of `--input-len` random token ids, greedy (the bundled model answers
  such a prompt repetitively, so prompt lookup finds runs in its own output);
- random_sampled: the same prompts at temperature 1 (a seed per repeat, the same for both
  engines), whose output rarely repeats: what speculation costs when its drafts fail;
- copy_json: a chat request to repeat a ~`--input-len`-token JSON list of records, answered
  under that list's JSON schema (structured output: the grammar checks the drafts and masks
  every verified position), greedy.

Each repeat runs every workload on the two engines back to back, alternating which goes
first, so load drifting on a shared machine hits both alike; each engine first runs an
untimed warm-up of each workload. Reported: the median TPOT of each engine per workload,
the speed-up (median TPOT without / with), the median of the per-repeat speed-ups (each a
side-by-side pair), the acceptance numbers of the timed runs, and how many of the speculating
engine's steps ran as one native call (decode, verify, prefill; GGUF path only).
"""

from __future__ import annotations

import argparse
import inspect

from nanollmserve.bench.provenance import cpu_model
from nanollmserve.bench.report import add_common_args, emit, log, median, ratio
from nanollmserve.bench.workload import random_requests

DEFAULT_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "spec-decode", help="TPOT with and without speculative decoding (copy vs random)"
    )
    parser.add_argument("--input-len", type=int, default=400, help="prompt tokens (about)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per engine/workload")
    add_common_args(parser)
    parser.set_defaults(func=run)


def copy_prompt_token_ids(tokenizer, input_len: int) -> list[int]:
    """A chat request to repeat ~`input_len` tokens of Python code exactly."""
    from nanollmserve.engine import kv_cache
    from nanollmserve.frontend.tokenizer import chat_prompt_token_ids

    code_ids = tokenizer.encode(inspect.getsource(kv_cache.BlockPool), add_special_tokens=False)
    code_ids = code_ids[:input_len]
    code = tokenizer.decode(code_ids)
    message = f"Repeat this code exactly, with no other text:\n\n```python\n{code}\n```"
    return chat_prompt_token_ids(tokenizer, [{"role": "user", "content": message}])


RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "city": {"type": "string"},
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "city", "active"],
    "additionalProperties": False,
}
JSON_SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": RECORD_SCHEMA}},
    "required": ["records"],
    "additionalProperties": False,
}


def copy_json_prompt_token_ids(tokenizer, input_len: int) -> list[int]:
    """A chat request to repeat a JSON list of records (~`input_len` tokens) exactly; the
    answer is constrained to `JSON_SCHEMA`."""
    import json

    from nanollmserve.frontend.tokenizer import chat_prompt_token_ids

    names = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Frances", "John"]
    cities = ["London", "Paris", "Berlin", "Madrid", "Rome", "Vienna", "Oslo"]
    records: list[dict] = []
    while (
        len(tokenizer.encode(json.dumps({"records": records}), add_special_tokens=False))
        < input_len
    ):
        i = len(records)
        name, city = names[i % len(names)], cities[i % len(cities)]
        records.append({"id": 100 + i, "name": name, "city": city, "active": i % 3 != 0})
    message = "Repeat this JSON object exactly:\n" + json.dumps({"records": records})
    return chat_prompt_token_ids(tokenizer, [{"role": "user", "content": message}])


def run(args: argparse.Namespace) -> int:
    import torch

    from nanollmserve import SamplingParams
    from nanollmserve.config import engine_config_from_args
    from nanollmserve.llm import LLM
    from nanollmserve.model.device import dtype_name

    config = vars(engine_config_from_args(args))
    spec = config.pop("speculative_config") or DEFAULT_SPEC
    engines = {"no_spec": LLM(**config), "spec": LLM(**config, speculative_config=spec)}
    base = engines["no_spec"]
    copy_ids = copy_prompt_token_ids(base.tokenizer, args.input_len)
    json_ids = copy_json_prompt_token_ids(base.tokenizer, args.input_len)
    warmup, *randoms = [
        r.prompt_token_ids
        for r in random_requests(
            args.repeat + 1,
            (args.input_len,) * 2,
            (args.output_len,) * 2,
            base.engine.model_config.vocab_size,
            seed=0,
        )
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=args.output_len, structured_outputs={"json": JSON_SCHEMA}
    )

    def sampled(seed: int) -> SamplingParams:
        return SamplingParams(
            temperature=1.0, seed=seed, max_tokens=args.output_len, ignore_eos=True
        )

    def tpot(llm: LLM, prompt: list[int], params: SamplingParams = greedy) -> float:
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        m = output.metrics  # a constrained answer may end before output_len
        return (m.last_token_time - m.first_token_time) / (len(output.outputs[0].token_ids) - 1)

    log("warm-up: one untimed run of each workload per engine")
    for llm in engines.values():
        tpot(llm, copy_ids)
        tpot(llm, warmup)
        tpot(llm, warmup, sampled(0))
        tpot(llm, json_ids, constrained)
    workloads = ("copy", "random", "random_sampled", "copy_json")
    tpots = {w: {name: [] for name in engines} for w in workloads}
    accepted = {w: [0, 0, 0] for w in tpots}  # drafts, draft tokens, accepted tokens
    for r in range(args.repeat):
        log(f"repeat {r + 1}/{args.repeat}")
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for workload, prompt, params in (
            ("copy", copy_ids, greedy),
            ("random", randoms[r], greedy),
            ("random_sampled", randoms[r], sampled(r + 1)),
            ("copy_json", json_ids, constrained),
        ):
            for name in order:  # the two engines back to back on each workload
                llm = engines[name]
                before = llm.engine.stats().spec_decode
                tpots[workload][name].append(tpot(llm, prompt, params))
                after = llm.engine.stats().spec_decode
                if before is not None:
                    counts = accepted[workload]
                    counts[0] += after.num_drafts - before.num_drafts
                    counts[1] += after.num_draft_tokens - before.num_draft_tokens
                    counts[2] += after.num_accepted_tokens - before.num_accepted_tokens

    results = {}
    for workload, by_engine in tpots.items():
        drafts, draft_tokens, accepted_tokens = accepted[workload]
        no_spec, with_spec = median(by_engine["no_spec"]), median(by_engine["spec"])
        paired = [a / b for a, b in zip(by_engine["no_spec"], by_engine["spec"], strict=True)]
        results[workload] = {
            "tpot_ms_no_spec": round(no_spec * 1000, 2),
            "tpot_ms_spec": round(with_spec * 1000, 2),
            "speedup": ratio(no_spec, with_spec),
            "speedup_paired_median": round(median(paired), 3),
            "tpot_ms_all": {n: [round(t * 1000, 2) for t in v] for n, v in by_engine.items()},
            "num_drafts": drafts,
            "acceptance_rate": round(accepted_tokens / draft_tokens, 3) if draft_tokens else 0.0,
            "mean_acceptance_length": round(1 + accepted_tokens / drafts, 3) if drafts else 0.0,
        }
    return emit(
        {
            "benchmark": "spec_decode",
            "model": base.engine.loaded.source.name,
            "device": str(base.engine.device),
            "dtype": dtype_name(base.engine.dtype),
            "quantization": base.engine.loaded.quantization,
            "cpu_model": cpu_model(),
            "torch_threads": torch.get_num_threads(),
            "speculative_config": dict(vars(engines["spec"].config.speculative_config)),
            # steps of the engine with speculation that ran as one native call, by kind
            "spec_native_steps": dict(engines["spec"].engine.model_runner.native_steps),
            "copy_prompt_tokens": len(copy_ids),
            "copy_json_prompt_tokens": len(json_ids),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "repeat": args.repeat,
            "results": results,
        },
        args,
    )

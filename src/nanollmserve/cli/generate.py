"""`nanollmserve generate`: complete one prompt (or one chat turn) from the command line.

It runs the same engine as the server through the offline `LLM` API; `--show-stats` prints
token counts and timings after the text, `--json` prints both as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from nanollmserve.config import add_engine_args, engine_config_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text for one prompt",
        description="Generate text for one prompt with the engine (offline, no server).",
    )
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument(
        "--chat", action="store_true", help="treat the prompt as a user message (chat template)"
    )
    parser.add_argument("--system", default=None, help="system message (implies --chat)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--show-stats", action="store_true", help="print token counts and timings")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_engine_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from nanollmserve import SamplingParams
    from nanollmserve.errors import UserError
    from nanollmserve.llm import LLM
    from nanollmserve.model.device import dtype_name

    config = engine_config_from_args(args)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,  # --seed (an engine flag) also makes this request reproducible
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    llm = LLM(**vars(config))
    start = time.perf_counter()
    try:
        if args.chat or args.system:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": args.prompt})
            output = llm.chat(messages, params, use_tqdm=False)[0]
        else:
            output = llm.generate(args.prompt, params, use_tqdm=False)[0]
    except ValueError as exc:
        raise UserError(str(exc)) from None
    elapsed = time.perf_counter() - start
    completion = output.outputs[0]
    m = output.metrics
    stats = {
        "prompt_tokens": len(output.prompt_token_ids),
        "generated_tokens": len(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "elapsed_s": round(elapsed, 4),
        "ttft_s": round(m.ttft, 4) if m.ttft is not None else None,
        "tpot_s": round(m.tpot, 4) if m.tpot is not None else None,
        "tokens_per_s": round(len(completion.token_ids) / elapsed, 2) if elapsed else None,
        "device": str(llm.engine.device),
        "dtype": dtype_name(llm.engine.dtype),
    }
    spec = llm.engine.stats().spec_decode
    if spec is not None:
        stats.update(
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_acceptance_rate=round(spec.acceptance_rate, 4),
            spec_decode_mean_acceptance_length=round(spec.mean_acceptance_length, 3),
        )
    if args.json:
        print(json.dumps({"text": completion.text, **stats}))
        return 0
    print(completion.text)
    if args.show_stats:
        for key, value in stats.items():
            print(f"{key}: {value}", file=sys.stderr)
    return 0

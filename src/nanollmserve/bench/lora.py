"""`nanollmserve bench lora`: throughput of a batch mixing LoRA adapters and the base model
against the same batch on the base model only, in one run, on one engine.

The engine starts with `enable_lora` and `--num-adapters` slots; the adapters are random PEFT
directories written for the run (rank `--lora-rank` on every projection, shaped from the
model's config). The same seeded requests (ignore_eos) run on the base model only, then
round-robin over the base model and each adapter (so every step mixes them), alternated for
`--rounds` rounds so that both see the same machine; the rates use the median time. The
ratio is the cost of serving adapters in one batch.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from nanollmserve.bench.report import add_common_args, emit, log, median, ratio
from nanollmserve.bench.workload import parse_range, random_requests

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("lora", help="mixed LoRA batch vs base-only throughput")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", default="64-96", help="N or LOW-HIGH tokens")
    parser.add_argument("--output-len", default="48", help="N or LOW-HIGH tokens")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--num-adapters", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument(
        "--rounds", type=int, default=3, help="base-only / mixed runs, alternated (median)"
    )
    add_common_args(parser)
    parser.set_defaults(func=run)


def write_random_adapter(out_dir: Path, model_config, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory with random A and B on every projection of every layer."""
    import torch
    from safetensors.torch import save_file

    c = model_config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {  # (in, out) of each projection
        "self_attn.q_proj": (c.hidden_size, q),
        "self_attn.k_proj": (c.hidden_size, kv),
        "self_attn.v_proj": (c.hidden_size, kv),
        "self_attn.o_proj": (q, c.hidden_size),
        "mlp.gate_proj": (c.hidden_size, c.intermediate_size),
        "mlp.up_proj": (c.hidden_size, c.intermediate_size),
        "mlp.down_proj": (c.intermediate_size, c.hidden_size),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_layers):
        for name, (n_in, n_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=generator) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=generator) * 0.02
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none"}
    config["target_modules"] = list(TARGETS)
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    return out_dir


def run(args: argparse.Namespace) -> int:
    from nanollmserve import LoRARequest, SamplingParams
    from nanollmserve.config import engine_config_from_args
    from nanollmserve.llm import LLM
    from nanollmserve.model.device import dtype_name

    config = vars(engine_config_from_args(args))
    config.update(enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.lora_rank)
    llm = LLM(**config)
    engine = llm.engine
    requests = random_requests(
        args.num_prompts,
        parse_range(args.input_len),
        parse_range(args.output_len),
        engine.model_config.vocab_size,
        seed=args.workload_seed,
    )
    prompts = [r.prompt_token_ids for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests
    ]
    total_out = sum(r.max_tokens for r in requests)
    with tempfile.TemporaryDirectory(prefix="nanollmserve-bench-lora-") as folder:
        adapters = [
            LoRARequest(
                f"adapter{i}",
                i + 1,
                str(
                    write_random_adapter(
                        Path(folder, str(i)), engine.model_config, args.lora_rank, i
                    )
                ),
            )
            for i in range(args.num_adapters)
        ]
        mixed = [([None, *adapters])[i % (len(adapters) + 1)] for i in range(len(prompts))]
        log("warmup")
        llm.generate(prompts[:2], params[:2], use_tqdm=False, lora_request=mixed[:2])
        seconds: dict[str, list[float]] = {"base_only": [], "mixed": []}
        for round_index in range(args.rounds):  # alternated: both see the same machine
            for name, lora_requests in [("base_only", None), ("mixed", mixed)]:
                log(f"round {round_index + 1}/{args.rounds} {name}: {len(prompts)} requests")
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
                seconds[name].append(time.perf_counter() - start)
                assert sum(len(o.outputs[0].token_ids) for o in outputs) == total_out
        results = {
            name: {
                "elapsed_s": [round(s, 3) for s in runs],
                "output_tokens": total_out,
                "output_tokens_per_s": round(total_out / median(runs), 2),
            }
            for name, runs in seconds.items()
        }
    return emit(
        {
            "benchmark": "lora",
            "model": engine.loaded.source.name,
            "device": str(engine.device),
            "dtype": dtype_name(engine.dtype),
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_adapters": args.num_adapters,
            "lora_rank": args.lora_rank,
            "rounds": args.rounds,
            "max_num_seqs": engine.config.max_num_seqs,
            "results": results,
            "ratios": {
                "mixed_vs_base_only": ratio(
                    results["mixed"]["output_tokens_per_s"],
                    results["base_only"]["output_tokens_per_s"],
                )
            },
        },
        args,
    )

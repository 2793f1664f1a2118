"""`nanollmserve bench quality`: what each weight format costs in accuracy, in one run.

Each configuration (`--configs`, default fp32, bf16, int8, fp16, gguf) is the bundled model (or
`--model`) loaded as the engine loads it (`load_engine_model`): `fp32` and `bf16` are the GGUF
dequantized to float32 / bfloat16 (`--dtype`), `int8` and `fp16` are `--quantization int8|fp16`
and `gguf` is `--quantization gguf` (the file's own blocks, every step forced through the
native block kernel as decode steps run, not the dense copy large steps use). Every configuration
scores the same fixed public-domain English text (tests/data/quality, ~4.2k tokens) through the
engine's model forward over the same sliding windows (`bench/perplexity.py`) and reports its
perplexity, the tokens scored, the relative perplexity difference against fp32 (the
reference), the mean KL divergence KL(fp32 || config) of the next-token distributions and how
often its top token is fp32's. `--hf-reference` adds transformers' float32 model as a row (our
fp32 should match it within ~0.1%).

`--llamacpp` also starts llama.cpp's native `llama-server` on the same GGUF and reports, per
configuration, how many tokens its greedy answers to eight chat prompts share with
llama.cpp's before the first divergence (`bench/greedy_agreement.py`).
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from nanollmserve.bench.report import add_common_args, emit, log

CONFIGS = {
    "fp32": {"dtype": "float32", "quantization": "none"},
    "bf16": {"dtype": "bfloat16", "quantization": "none"},
    "int8": {"quantization": "int8"},
    "fp16": {"quantization": "fp16"},
    "gguf": {"quantization": "gguf"},
    "gguf_kv32": {"quantization": "gguf", "kv_cache_dtype": "float32"},
    "gguf_kv16": {"quantization": "gguf", "kv_cache_dtype": "float16"},
    "gguf_kv8": {"quantization": "gguf", "kv_cache_dtype": "int8"},
}
"""Configuration name -> the engine arguments that make it. A configuration that names a
`kv_cache_dtype` scores through a paged cache of that type (`perplexity.cached_engine_scorer`):
its rows differ from `gguf_kv32`'s by what the cache's element type costs."""
DEFAULT_CONFIGS = "fp32,bf16,int8,fp16,gguf"
REFERENCE = "fp32"
HF_REFERENCE = "hf_fp32"
DEFAULT_TEXT = Path(__file__).resolve().parents[3] / "tests/data/quality/public_domain_en.txt"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "quality", help="perplexity and KL vs fp32 of each weight format on a fixed text"
    )
    parser.add_argument("--model", default=None, help="model to load (default: the bundled one)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help=f"comma-separated, from {', '.join(CONFIGS)} (default: {DEFAULT_CONFIGS}); "
        f"{REFERENCE} is always run: it is the reference",
    )
    parser.add_argument(
        "--text",
        default=None,
        help="text file to score (default: tests/data/quality/public_domain_en.txt)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="score only the text's first N tokens"
    )
    parser.add_argument(
        "--window",
        type=int,
        default=None,
        help="tokens per window (default: the model's context, at most 8192: the bundled "
        "model scores the whole text as one sequence)",
    )
    parser.add_argument(
        "--stride", type=int, default=None, help="tokens between window starts (default: half)"
    )
    parser.add_argument(
        "--llamacpp-chunks",
        action="store_true",
        help="score as llama.cpp's llama-perplexity does (its -c is --window): "
        "non-overlapping windows, each scoring its second half's predictions",
    )
    parser.add_argument(
        "--hf-reference", action="store_true", help="add transformers' float32 model as a row"
    )
    parser.add_argument(
        "--llamacpp",
        action="store_true",
        help="greedy agreement with native llama-server on 8 chat prompts",
    )
    parser.add_argument(
        "--llamacpp-bin",
        default=".peer/llama.cpp/build/bin/llama-server",
        help="the llama-server binary (scripts/peer-llamacpp setup builds it)",
    )
    parser.add_argument("--llamacpp-threads", type=int, default=2, help="llama-server -t/-tb")
    parser.add_argument(
        "--agreement-tokens", type=int, default=64, help="greedy answer length for --llamacpp"
    )
    add_common_args(parser, engine=False)
    parser.set_defaults(func=run)


def config_names(value: str) -> list[str]:
    from nanollmserve.errors import UserError

    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        raise UserError(f"unknown --configs {', '.join(unknown)} (known: {', '.join(CONFIGS)})")
    return [REFERENCE, *dict.fromkeys(name for name in names if name != REFERENCE)]


def read_text(path: str | None) -> tuple[Path, str]:
    from nanollmserve.errors import UserError

    text_path = Path(path) if path else DEFAULT_TEXT
    if not text_path.is_file():
        raise UserError(f"no text file {text_path}: pass --text FILE")
    return text_path, text_path.read_text()


def run(args: argparse.Namespace) -> int:
    from nanollmserve.bench import perplexity
    from nanollmserve.config import EngineConfig
    from nanollmserve.engine.model_loading import load_engine_model
    from nanollmserve.errors import UserError
    from nanollmserve.frontend.tokenizer import load_tokenizer
    from nanollmserve.model.device import dtype_name

    names = config_names(args.configs)
    text_path, text = read_text(args.text)
    loaded = {}
    for name in names:
        log(f"{name}: loading {CONFIGS[name]}")
        config = EngineConfig(model=args.model, device=args.device, **CONFIGS[name])
        loaded[name] = load_engine_model(config)
    source = loaded[REFERENCE].source
    tokenizer = load_tokenizer(loaded[REFERENCE].model_dir)
    token_ids = tokenizer.encode(text, add_special_tokens=False)[: args.max_tokens]
    scorers = {name: engine_scorer(name, m) for name, m in loaded.items()}
    if args.hf_reference:
        import torch

        from nanollmserve.bench.hf_baselines import load_hf_model

        hf_model = load_hf_model(loaded[REFERENCE].model_dir, torch.float32)
        scorers[HF_REFERENCE] = perplexity.hf_scorer(hf_model)
    window = args.window or min(loaded[REFERENCE].model_config.max_context_len, 8192)
    stride = window if args.llamacpp_chunks else args.stride or max(1, window // 2)
    try:
        windows = (
            perplexity.llamacpp_chunks(len(token_ids), window)
            if args.llamacpp_chunks
            else perplexity.sliding_windows(len(token_ids), window, stride)
        )
    except ValueError as error:
        raise UserError(f"bench quality: {error}") from None
    log(f"scoring {len(token_ids)} tokens, window {window}, stride {stride}")
    totals = perplexity.score(
        scorers, token_ids, windows, REFERENCE, on_window=lambda i, n: log(f"window {i + 1}/{n}")
    )
    reference_ppl = totals[REFERENCE].perplexity
    results = {}
    for name, t in totals.items():
        row = {"engine_args": CONFIGS.get(name, "transformers AutoModelForCausalLM, float32")}
        if name in loaded:
            row["dtype"] = dtype_name(loaded[name].dtype)
            row["quantization"] = loaded[name].quantization or "none"
            row["load_s"] = round(loaded[name].load_seconds, 2)
        row.update(
            perplexity=round(t.perplexity, 4),
            mean_nll=round(t.mean_nll, 6),
            tokens_scored=t.num_tokens,
            perplexity_rel_diff_vs_fp32=round(t.perplexity / reference_ppl - 1, 6),
            kl_vs_fp32=round(t.mean_kl, 7),
            top1_agreement_vs_fp32=round(t.top1_agreement, 5),
            score_s=round(t.seconds, 2),
        )
        results[name] = row
    result = {
        "benchmark": "quality",
        "model": source.name,
        "model_source": source.kind,
        "device": str(loaded[REFERENCE].device),
        "text": {
            "path": text_path.name,
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "num_tokens": len(token_ids),
        },
        "window": window,
        "stride": stride,
        "windows": "llama-perplexity chunks" if args.llamacpp_chunks else "sliding",
        "num_windows": len(windows),
        "reference": REFERENCE,
        "kl": "mean over scored positions of KL(fp32 || config) of next-token distributions, nats",
        "configs": results,
        "checks": checks(results),
    }
    if args.llamacpp:
        end_ids = {tokenizer.eos_token_id, *loaded[REFERENCE].model_config.eos_token_ids}
        scorers.clear()  # free the scoring models before the engines load theirs
        loaded.clear()
        result["llamacpp_greedy_agreement"] = llamacpp_agreement(args, names, tokenizer, end_ids)
    return emit(result, args)


def engine_scorer(name: str, loaded):
    """Configuration `name`'s scorer: through a paged cache when it names a KV cache type."""
    from nanollmserve.bench import perplexity

    kv_cache_dtype = CONFIGS[name].get("kv_cache_dtype")
    model = loaded.model.eval()
    if kv_cache_dtype is None:
        return perplexity.engine_scorer(model, loaded.device)
    return perplexity.cached_engine_scorer(model, loaded.device, kv_cache_dtype, loaded.dtype)


def checks(results: dict) -> dict:
    """The issue's accuracy bars that apply to this run."""
    out = {}
    if "gguf" in results:
        out["gguf_within_1pct_of_fp32"] = abs(results["gguf"]["perplexity_rel_diff_vs_fp32"]) < 0.01
    if HF_REFERENCE in results:
        out["fp32_within_0.1pct_of_hf"] = (
            abs(results[HF_REFERENCE]["perplexity_rel_diff_vs_fp32"]) < 0.001
        )
    return out


def llamacpp_agreement(
    args: argparse.Namespace, names: list[str], tokenizer, end_ids: set[int]
) -> dict:
    """Greedy answers of llama-server, then of each configuration's engine, compared."""
    from nanollmserve.bench import greedy_agreement
    from nanollmserve.bench.llamacpp_server import LlamaCppServer, greedy_token_ids
    from nanollmserve.errors import UserError
    from nanollmserve.llm import LLM
    from nanollmserve.model.source import bundled_gguf_path

    gguf = Path(args.model) if args.model else bundled_gguf_path()
    if gguf.suffix.lower() != ".gguf":
        raise UserError("--llamacpp needs a GGUF model (the bundled one or --model FILE.gguf)")
    prompts = greedy_agreement.prompt_token_ids(tokenizer)
    server = LlamaCppServer(Path(args.llamacpp_bin), gguf, args.llamacpp_threads)
    with server:
        log(f"llama-server: {len(prompts)} greedy answers")
        peer = [
            greedy_agreement.strip_end(
                greedy_token_ids(server.url, p, args.agreement_tokens), end_ids
            )
            for p in prompts
        ]
    per_config = {}
    for name in names:
        log(f"{name}: {len(prompts)} greedy answers")
        llm = LLM(model=args.model, device=args.device, num_kv_blocks=256, **CONFIGS[name])
        ours = greedy_agreement.engine_greedy(llm, prompts, args.agreement_tokens, end_ids)
        llm.shutdown()
        per_config[name] = greedy_agreement.agreement(ours, peer)
    return {
        "server": server.version(),
        "gguf": gguf.name,
        "max_tokens": args.agreement_tokens,
        "prompts": greedy_agreement.CHAT_PROMPTS,
        "llamacpp_answer_lengths": [len(p) for p in peer],
        "configs": per_config,
    }

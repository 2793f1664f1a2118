"""`nanollmserve info`: what a model is and where its weights come from, without loading them.

The parameter count is that of the native model (built on the meta device, a tied embedding
counted once), so it is what `serve` would hold in memory. "native step" says whether its
steps would run as one native call: GGUF blocks and every `DecoderOptions` field it sets
implemented by the C step (`native/supported.py`), or the reason they would not.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "info",
        help="show a model's architecture, size and where its weights come from",
        description="Show a model's architecture, size and where its weights come from.",
    )
    parser.add_argument(
        "model_pos", nargs="?", metavar="MODEL", help="same as --model (positional form)"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a local HF directory, a *.gguf file, or empty for the bundled model",
    )
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from nanollmserve.config import EngineConfig
    from nanollmserve.engine.model_loading import quantization_dtype, resolve_quantization
    from nanollmserve.errors import UserError
    from nanollmserve.layers.kv_quant import kv_cache_storage_dtype, resolve_kv_cache_dtype
    from nanollmserve.layers.quantization import COMPUTE_DTYPES
    from nanollmserve.model import (
        ModelConfig,
        build_model,
        count_parameters,
        resolve_device,
        resolve_dtype,
        resolve_model,
    )
    from nanollmserve.model.device import dtype_name
    from nanollmserve.model.loader import checkpoint_files

    if args.model_pos and args.model and args.model_pos != args.model:
        raise UserError("give the model once: positional MODEL or --model, not both")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    source = resolve_model(args.model_pos or args.model)
    config = ModelConfig.from_pretrained(source.path)
    # the dtypes `serve` would run with its defaults: the GGUF blocks compute in float32 and
    # keep a float16 KV cache (--kv-cache-dtype auto)
    engine = EngineConfig(model=args.model_pos or args.model, dtype=args.dtype, device=args.device)
    quantization = resolve_quantization(engine, source, device)
    if quantization in COMPUTE_DTYPES:
        dtype = quantization_dtype(engine, quantization, dtype)
    kv_dtype = kv_cache_storage_dtype(resolve_kv_cache_dtype("auto", quantization), dtype)
    model = build_model(config)
    num_params = count_parameters(model)
    files = checkpoint_files(source.path)
    size_mb = sum(f.stat().st_size for f in files) / 1e6
    rope = f"theta {config.rope_theta:g}"
    if config.rope_scaling:
        rope += f", {config.rope_scaling['rope_type']} scaling x{config.rope_scaling['factor']:g}"
    rows = [
        ("model", source.name),
        ("architecture", config.architecture),
        ("parameters", f"{num_params:,} ({num_params / 1e6:.1f} M)"),
        ("layers", config.num_layers),
        ("hidden size", config.hidden_size),
        ("heads", config.num_heads),
        ("kv heads", config.num_kv_heads),
        ("head dim", config.head_dim),
        ("vocab size", config.vocab_size),
        ("max context", config.max_context_len),
        ("rope", rope),
        ("tied embeddings", "yes" if config.tie_word_embeddings else "no"),
        ("eos token ids", ", ".join(map(str, config.eos_token_ids)) or "-"),
        ("dtype", dtype_name(dtype)),
        ("device", str(device)),
        (
            "kv cache",
            f"{config.kv_bytes_per_token(kv_dtype):,} bytes per token ({dtype_name(kv_dtype)})",
        ),
        ("native step", _native_step(model, quantization)),
        ("checkpoint", f"{len(files)} safetensors file(s), {size_mb:,.1f} MB"),
        ("weights", source.description),
        ("versions", _versions()),
    ]
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _native_step(model, quantization: str | None) -> str:
    """Whether `serve` would run steps as one native call, as far as the model's options and
    weights tell (the kernels' build is not tried here)."""
    from nanollmserve.native.supported import refusal

    if quantization != "gguf":
        return "no: the weights are not GGUF blocks"
    options = getattr(model, "options", None)
    if options is None:
        return f"no: {type(model).__name__} declares no decoder options"
    reason = refusal(options)
    return f"no: {reason}" if reason else "yes: every decoder option it declares is implemented"


def _versions() -> str:
    import torch
    import transformers

    from nanollmserve import __version__

    libraries = f"torch {torch.__version__}, transformers {transformers.__version__}"
    return f"nanollmserve {__version__}, {libraries}"

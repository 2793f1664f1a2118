"""How much the block kernels' activation quantization moves a model's next-token distribution:
int16 per block of 32 (what `native/gguf_cpu.c` and `native/kquant_cpu.c` use) against int8
per 32 (llama.cpp's Q8_0 / Q8_1 activations) and int8 per 256 (its Q8_K, for K-quants).

    .venv/bin/python scripts/activation_precision.py --model FILE.gguf [--max-tokens 2048]
        [--window 512] [--output FILE.json]

The file's weights are dequantized to float32 and stay exact; only the input of every linear
layer (the projections and the output head) is rounded as the kernel would round it: per
block of B inputs, scale = max |x| / L (L = 32767 for int16, 127 for int8), x -> scale *
round(x / scale). So the numbers isolate the activations' share of the error, the question
issue 40 asks before choosing int8 or int16 per block type. Each mode is scored against the
unrounded float32 forward with `bench quality`'s machinery (bench/perplexity.py: the same
windows of the same text, KL(float32 || mode) in nats, top-1 agreement, perplexity).
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager

MODES = {"float32": None, "int16/32": (32767, 32), "int8/32": (127, 32), "int8/256": (127, 256)}
"""Mode -> (largest code L, block size B), None: no rounding (the reference)."""


def fake_quantize(x, levels: int, block: int):
    """x rounded per block of `block` along its last dimension to `levels` steps each side."""
    import torch

    shape = x.shape
    blocks = x.float().reshape(-1, shape[-1] // block, block)
    scale = blocks.abs().amax(-1, keepdim=True) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(blocks / safe) * scale).reshape(shape).to(x.dtype)


@contextmanager
def rounding_inputs(model, mode: str):
    """Every nn.Linear of `model` sees its input rounded as `mode` says, while inside."""
    import torch

    setting = MODES[mode]
    handles = []
    if setting is not None:
        levels, block = setting
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.in_features % block == 0:
                handles.append(
                    module.register_forward_pre_hook(
                        lambda _m, args: (fake_quantize(args[0], levels, block), *args[1:])
                    )
                )
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--output")
    args = parser.parse_args(argv)

    from nanollmserve.bench import perplexity
    from nanollmserve.bench.quality import read_text
    from nanollmserve.config import EngineConfig
    from nanollmserve.engine.model_loading import load_engine_model
    from nanollmserve.frontend.tokenizer import load_tokenizer

    loaded = load_engine_model(
        EngineConfig(model=args.model, device="cpu", dtype="float32", quantization="none")
    )
    model = loaded.model.eval()
    base = perplexity.engine_scorer(model, loaded.device)

    def scorer(mode: str) -> perplexity.Scorer:
        def hidden(ids, first: int, last: int):
            with rounding_inputs(model, mode):
                return base.hidden(ids, first, last)

        def logits(rows):
            with rounding_inputs(model, mode):
                return base.logits(rows)

        return perplexity.Scorer(hidden, logits)

    text_path, text = read_text(None)
    tokenizer = load_tokenizer(loaded.model_dir)
    ids = tokenizer.encode(text, add_special_tokens=False)[: args.max_tokens]
    totals = perplexity.score(
        {mode: scorer(mode) for mode in MODES}, ids, args.window, args.window // 2, "float32"
    )
    linears = sum(isinstance(m, __import__("torch").nn.Linear) for m in model.modules())
    result = {
        "model": args.model,
        "text": text_path.name,
        "tokens": len(ids),
        "window": args.window,
        "linear_layers_rounded": linears,
        "modes": {
            mode: {
                "perplexity": round(t.perplexity, 4),
                "kl_vs_float32": round(t.mean_kl, 7),
                "top1_agreement": round(t.top1_agreement, 5),
            }
            for mode, t in totals.items()
        },
    }
    text_out = json.dumps(result, indent=2)
    print(text_out)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text_out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The transformers baseline of `bench serve --endpoint embeddings --hf-baseline`: the same
texts encoded the way sentence-transformers encodes with a causal model, in padded batches
(32 by default) through the base model (`AutoModel`: the final normed hidden states, no LM
head), the last real token's state taken and L2-normalized (our server's default pooling),
float32 on the CPU. Tokenizing, padding, the forward pass and pooling are all timed; one
batch runs first untimed (warm-up), as the serve benchmark warms the server up.
"""

from __future__ import annotations

import time

from nanollmserve.bench.hf_baselines import inference_mode


@inference_mode
def hf_embed_throughput(model_dir, texts: list[str], batch_size: int = 32) -> dict:
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.padding_side = "left"  # the last real token is at position -1 of every row
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def encode(batch: list[str]) -> int:
        inputs = tokenizer(batch, return_tensors="pt", padding=True)
        hidden = model(**inputs).last_hidden_state[:, -1]
        torch.nn.functional.normalize(hidden, dim=-1)
        return int(inputs["attention_mask"].sum())

    encode(texts[:batch_size])  # warm-up
    start = time.perf_counter()
    num_tokens = sum(encode(texts[i : i + batch_size]) for i in range(0, len(texts), batch_size))
    duration = max(time.perf_counter() - start, 1e-9)
    return {
        "engine": "transformers AutoModel, padded batches, last-token pooling, float32",
        "batch_size": batch_size,
        "num_texts": len(texts),
        "total_input_tokens": num_tokens,
        "duration_s": round(duration, 3),
        "request_throughput": round(len(texts) / duration, 3),
        "input_token_throughput": round(num_tokens / duration, 2),
    }

"""Hugging Face transformers baselines, run on the same weights, dtype and inputs as the
engine: the naive loop without a KV cache, `generate` with its cache one request at a time,
and static batching (padded batches, everyone waits for the longest)."""

from __future__ import annotations

import functools
import time

from nanollmserve.bench.workload import BenchRequest


def inference_mode(fn):
    """`torch.inference_mode()` as a decorator that imports torch only when called: the CLI
    imports this module to build its parser, and `--help` must not load torch."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import torch

        with torch.inference_mode():
            return fn(*args, **kwargs)

    return wrapper


def load_hf_model(model_dir, dtype):
    """transformers' model of the engine's weights. A GGUF cache entry gets its dequantized
    float32 weights first: a first start writes none (the engine runs the blocks)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from nanollmserve.model import gguf_cache

    if gguf_cache.is_gguf_entry(Path(model_dir)):
        gguf_cache.cached_dense_weights(Path(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model.eval()


@inference_mode
def naive_loop(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Recompute the whole sequence for every new token (no KV cache). Returns the tokens and
    the time each one was ready (seconds from the start)."""
    import torch

    ids = torch.tensor([prompt])
    start, times, out = time.perf_counter(), [], []
    for _ in range(max_tokens):
        next_id = model(ids, use_cache=False).logits[0, -1].argmax()
        out.append(int(next_id))
        times.append(time.perf_counter() - start)
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return out, times


class _Timer:
    """A streamer that records when each generate step produced its tokens."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self._skipped_prompt = False

    def put(self, value) -> None:
        if not self._skipped_prompt:  # generate first "streams" the prompt itself
            self._skipped_prompt = True
            return
        self.times.append(time.perf_counter() - self.start)

    def end(self) -> None:
        pass


@inference_mode
def generate_with_cache(model, prompt: list[int], max_tokens: int):
    """HF `generate` (greedy, KV cache on) for one request: tokens and per-token times."""
    import torch

    timer = _Timer()
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        streamer=timer,
    )
    return out[0, len(prompt) :].tolist(), timer.times


@inference_mode
def static_batches(model, requests: list[BenchRequest], batch_size: int) -> float:
    """Run the requests in padded batches of `batch_size` (left padding); each batch runs
    until its longest output is done. Returns the elapsed seconds."""
    import torch

    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - n :] = 1
        longest = max(r.max_tokens for r in batch)
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return time.perf_counter() - start

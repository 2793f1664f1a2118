"""Perplexity and KL divergence of one token sequence under several models, window by window.

The text is cut into windows of `window` tokens that start every `stride` tokens (Hugging
Face's sliding-window perplexity): each window is its own sequence (positions from 0), and
it scores only the targets the previous window did not, so every token after the first is
scored exactly once, with at least `window - stride` tokens of context from the second window
on. A text shorter than the window is one sequence, each token scored with all of its past.
A window's next-token log-probabilities are the log-softmax of the model's float32 logits.

Every model sees the same windows, so for each scored position the reference model's
distribution P and another model's Q give `KL(P || Q) = sum_v P(v) (log P(v) - log Q(v))`
(nats) and whether both put their top token on the same id. Perplexity is
`exp(mean negative log-likelihood of the targets)`.

A `Scorer` is a model as two functions: the hidden states of a window's positions that predict
scored targets, then float32 logits for some of those rows (computed `ROW_CHUNK` rows at a time
for every model, so a window of thousands of tokens never holds more than a chunk of
vocabulary-wide rows per model). `engine_scorer` runs the engine's own model forward (the one
the server runs), `hf_scorer` a transformers model, and `cached_engine_scorer` the engine's
forward in chunks that read every key and value back from a paged KV cache of a given
`--kv-cache-dtype`, as decode steps do (a whole-window forward attends to its K/V as
computed, so the cache's element type would not show).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanollmserve.bench.hf_baselines import inference_mode

ROW_CHUNK = 512
"""Scored positions whose logits are materialized at once, per model."""


@dataclass(frozen=True)
class Scorer:
    hidden: Callable[[Any, int, int], Any]
    """(window_ids [n], first_row, last_row) -> hidden states of rows first..last - 1."""
    logits: Callable[[Any], Any]
    """hidden rows [k, hidden] -> logits [k, vocab]."""


@dataclass(frozen=True)
class Window:
    """Tokens `start..end - 1` run as one sequence; targets `score_from..end - 1` are scored."""

    start: int
    end: int
    score_from: int

    @property
    def rows(self) -> tuple[int, int]:
        """The window positions whose logits predict the scored targets."""
        return self.score_from - 1 - self.start, self.end - 1 - self.start


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """Windows of `window` tokens every `stride` tokens; together they score tokens
    1..num_tokens - 1 once each."""
    if not 0 < stride <= window:
        raise ValueError(f"need 0 < stride <= window, got stride {stride}, window {window}")
    if num_tokens < 2:
        raise ValueError("need at least 2 tokens to score")
    windows, scored_to = [], 1
    for start in range(0, num_tokens, stride):
        end = min(start + window, num_tokens)
        if end > scored_to:
            windows.append(Window(start, end, scored_to))
            scored_to = end
        if end == num_tokens:
            break
    return windows


def llamacpp_chunks(num_tokens: int, window: int) -> list[Window]:
    """llama.cpp's `llama-perplexity` windows: non-overlapping chunks of `window` tokens, each
    scoring the predictions of its second half (logits at positions window / 2 .. window - 2,
    so targets window / 2 + 1 .. window - 1); a tail shorter than a chunk is not scored."""
    if window < 4:
        raise ValueError(f"need a window of at least 4 tokens, got {window}")
    if num_tokens < window:
        raise ValueError(f"need at least one chunk of {window} tokens, got {num_tokens}")
    first = window // 2 + 1
    return [Window(s, s + window, s + first) for s in range(0, num_tokens - window + 1, window)]


@dataclass
class ScoreTotals:
    """Running sums over the scored positions of one model."""

    nll_sum: float = 0.0
    kl_sum: float = 0.0
    num_top1_agree: int = 0
    num_tokens: int = 0
    seconds: float = 0.0
    """Time spent in this model's forward and logits."""

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.num_tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / self.num_tokens

    @property
    def top1_agreement(self) -> float:
        return self.num_top1_agree / self.num_tokens


@inference_mode
def score(
    scorers: dict[str, Scorer],
    token_ids: list[int],
    windows: list[Window],
    reference: str,
    on_window: Callable[[int, int], None] | None = None,
) -> dict[str, ScoreTotals]:
    """Score `token_ids` with every scorer over the same `windows` (`sliding_windows` or
    `llamacpp_chunks`); KL and top-1 agreement are against `scorers[reference]`.
    `on_window(i, n)` is called before window i of n."""
    import torch

    ids = torch.tensor(token_ids, dtype=torch.long)
    totals = {name: ScoreTotals() for name in scorers}
    order = [reference, *(name for name in scorers if name != reference)]

    def timed(name: str, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        totals[name].seconds += time.perf_counter() - start
        return out

    for i, w in enumerate(windows):
        if on_window is not None:
            on_window(i, len(windows))
        window_ids = ids[w.start : w.end]
        hidden = {name: timed(name, scorers[name].hidden, window_ids, *w.rows) for name in order}
        for first in range(0, w.end - w.score_from, ROW_CHUNK):
            targets = ids[w.score_from + first : min(w.score_from + first + ROW_CHUNK, w.end)]
            rows = slice(first, first + len(targets))
            ref_logprobs = None
            for name in order:
                logits = timed(name, scorers[name].logits, hidden[name][rows])
                logprobs = logits.float().log_softmax(-1)
                if ref_logprobs is None:
                    ref_logprobs = logprobs
                t = totals[name]
                t.nll_sum -= logprobs.gather(1, targets[:, None]).double().sum().item()
                kl = ref_logprobs.exp() * (ref_logprobs - logprobs)
                t.kl_sum += kl.double().sum().item()
                t.num_top1_agree += int((logprobs.argmax(-1) == ref_logprobs.argmax(-1)).sum())
                t.num_tokens += len(targets)
    return totals


def engine_scorer(model, device) -> Scorer:
    """The engine's model forward over one window as a plain causal sequence (no KV cache),
    then its `compute_logits`."""
    import torch

    from nanollmserve.layers.attention_context import (
        AttentionContext,
        reset_context,
        set_context,
    )

    def hidden(window_ids, first_row: int, last_row: int):
        n = len(window_ids)
        set_context(AttentionContext.causal_prefill([n]))
        try:
            out = model(window_ids.to(device), torch.arange(n, device=device))
        finally:
            reset_context()
        return out[first_row:last_row]

    return Scorer(hidden, lambda rows: model.compute_logits(rows).cpu())


CACHE_CHUNK = 64
"""Tokens per forward of `cached_engine_scorer`: a prefill chunk's size."""
CACHE_BLOCK = 16
"""Tokens per block of `cached_engine_scorer`'s paged cache: the engine's default."""


def cached_engine_scorer(model, device, kv_cache_dtype: str, dtype) -> Scorer:
    """The engine's model forward over one window, `CACHE_CHUNK` tokens at a time, each chunk
    writing its K/V into a paged cache of `kv_cache_dtype` (`layers/kv_quant.py`; the model's
    dtype is `dtype`) and attending to all of the window's keys so far, its own included,
    read back from that cache: what a decode step or a later prefill chunk reads. The pool
    is the engine's own (`ModelRunner`), made for the window and released after it."""
    import torch

    from nanollmserve.engine.model_runner import ModelRunner
    from nanollmserve.layers.attention_context import (
        AttentionContext,
        PrefillSpan,
        reset_context,
        set_context,
    )

    def hidden(window_ids, first_row: int, last_row: int):
        n = len(window_ids)
        num_blocks = -(-n // CACHE_BLOCK)
        runner = ModelRunner(
            model, num_blocks, CACHE_BLOCK, device, dtype, kv_cache_dtype=kv_cache_dtype
        )
        block_ids = torch.arange(num_blocks, device=device)
        outs = []
        try:
            for start in range(0, n, CACHE_CHUNK):
                end = min(start + CACHE_CHUNK, n)
                positions = torch.arange(start, end, device=device)
                span = PrefillSpan.over_cache(0, end - start, end, block_ids, dtype)
                set_context(AttentionContext(slot_mapping=positions, prefills=[span]))
                outs.append(model(window_ids[start:end].to(device), positions))
        finally:
            reset_context()
            runner.release_kv_cache()
        return torch.cat(outs)[first_row:last_row]

    return Scorer(hidden, lambda rows: model.compute_logits(rows).cpu())


def hf_scorer(model) -> Scorer:
    """A transformers causal LM over one window (batch of one): its decoder, then lm_head."""

    def hidden(window_ids, first_row: int, last_row: int):
        out = model.model(input_ids=window_ids[None], use_cache=False)
        return out.last_hidden_state[0, first_row:last_row]

    return Scorer(hidden, lambda rows: model.lm_head(rows).float())

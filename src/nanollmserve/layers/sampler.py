"""The sampler: logits of the rows that sample this step -> one token per row (+ logprobs).

Everything is vectorized across the batch; per-row Python is limited to building the
metadata (once per request, not per token) and to drawing noise for seeded rows. Sampling is
the "exponential race" (argmax of probs / Exp(1) noise), an exact categorical draw that lets
each seeded row draw its noise from its own generator, so a seeded request samples the same
tokens whatever else is in the batch.

Order of processing: logit_bias, min_tokens (stop tokens masked), penalties, then for
non-greedy rows temperature, top-k, top-p, min-p. Logprobs are those of the raw model
distribution (log_softmax of the logits), as vLLM returns by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Penalties:
    """Rows with a repetition/presence/frequency penalty and their token histories."""

    rows: torch.Tensor  # [P] long
    prompt_ids: torch.Tensor  # [P, max_prompt] long, padded with vocab_size
    output_ids: torch.Tensor  # [P, max_output] long, padded with vocab_size
    repetition: torch.Tensor  # [P, 1]
    presence: torch.Tensor  # [P, 1]
    frequency: torch.Tensor  # [P, 1]


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [S], 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [S] long, 0 = off
    max_top_k: int = 0
    top_p: torch.Tensor | None = None  # [S]
    min_p: torch.Tensor | None = None  # [S]
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> generator
    penalties: Penalties | None = None
    bias_index: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids)
    bias_values: torch.Tensor | None = None
    blocked_index: tuple[torch.Tensor, torch.Tensor] | None = None  # stop tokens < min_tokens
    max_num_logprobs: int | None = None  # None: no row wants logprobs


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S]
    logprobs: torch.Tensor | None = None  # [S, 1 + K]: sampled token's, then the top K
    logprob_token_ids: torch.Tensor | None = None  # [S, 1 + K]
    ranks: torch.Tensor | None = None  # [S]: rank of the sampled token (1 = most likely)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_constraints(logits, meta)

        token_ids = logits.argmax(dim=-1) if meta.all_greedy else self._sample(logits, meta)

        out = SamplerOutput(token_ids=token_ids)
        if raw_logprobs is not None:
            sampled = raw_logprobs.gather(1, token_ids[:, None])
            out.ranks = (raw_logprobs > sampled).sum(dim=-1) + 1
            top = raw_logprobs.topk(meta.max_num_logprobs, dim=-1)
            out.logprobs = torch.cat([sampled, top.values], dim=1)
            out.logprob_token_ids = torch.cat([token_ids[:, None], top.indices], dim=1)
        return out

    def _apply_constraints(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.bias_index is not None:
            logits = logits.index_put(meta.bias_index, meta.bias_values, accumulate=True)
        if meta.blocked_index is not None:
            logits = logits.index_put(meta.blocked_index, torch.tensor(float("-inf")))
        if meta.penalties is not None:
            logits = _apply_penalties(logits, meta.penalties)
        return logits

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = meta.temperature == 0
        temperature = torch.where(greedy, 1.0, meta.temperature)
        greedy_tokens = logits.argmax(dim=-1)
        logits = logits / temperature[:, None]
        if meta.top_k is not None:
            logits = _apply_top_k(logits, meta.top_k, meta.max_top_k)
        if meta.top_p is not None:
            logits = _apply_top_p(logits, meta.top_p)
        probs = torch.softmax(logits, dim=-1)
        if meta.min_p is not None:
            keep = probs >= meta.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs * keep  # renormalizing is unnecessary for an argmax race
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, generator in meta.generators.items():
            noise[row].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, sampled)


def _apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    vocab_size = logits.shape[1]
    rows = logits[p.rows]
    counts = torch.zeros(rows.shape[0], vocab_size + 1, device=logits.device)
    counts.scatter_add_(1, p.output_ids, torch.ones_like(p.output_ids, dtype=counts.dtype))
    counts = counts[:, :vocab_size]
    seen = torch.zeros(rows.shape[0], vocab_size + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, p.prompt_ids, True)
    seen = seen[:, :vocab_size] | (counts > 0)
    penalized = torch.where(rows > 0, rows / p.repetition, rows * p.repetition)
    rows = torch.where(seen, penalized, rows)
    rows = rows - p.frequency * counts - p.presence * (counts > 0)
    logits = logits.clone()
    logits[p.rows] = rows
    return logits


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's top_k logits (ties at the threshold are kept); rows with 0 keep all."""
    vocab_size = logits.shape[1]
    max_top_k = min(max_top_k, vocab_size)
    top_values = logits.topk(max_top_k, dim=-1).values
    k = torch.where(top_k > 0, top_k.clamp(max=max_top_k), max_top_k)
    threshold = top_values.gather(1, (k - 1)[:, None])
    threshold = torch.where(top_k[:, None] > 0, threshold, float("-inf"))
    return logits.masked_fill(logits < threshold, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens before it already cover top_p (the first always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before > top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))

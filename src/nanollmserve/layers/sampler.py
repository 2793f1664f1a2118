"""The sampler: logits of the rows that sample this step -> one token per row (+ logprobs).

Everything is vectorized across the batch; per-row Python is limited to building the
metadata (once per request, not per token) and to drawing the uniform of seeded rows.
Sampling is an inverse-CDF draw: one uniform number per row, a cumulative sum of the kept
probabilities in token-id order and a binary search, an exact categorical draw. Seeded rows
draw their number from their own generator, so a seeded request samples the same tokens
whatever else is in the batch. top-k / top-p / min-p look for the kept set among each row's
most likely tokens (`torch.topk`, growing); only a row whose kept set is larger sorts its
whole vocabulary. On the CPU the native library draws the filtered rows instead
(`filtered_draw` in `native/ops.py`, `native/sampling_cpu.c`: candidates by a margin below
the row's largest logit, no `topk`),
with the same kept set and the same token for the same uniform: the PyTorch path stays as
the reference the tests compare it with, and for GPUs.

Order of processing: logit_bias, min_tokens (stop tokens masked), penalties, then for
non-greedy rows temperature, top-k, top-p, min-p. Logprobs are those of the raw model
distribution (log_softmax of the logits), as vLLM returns by default; -inf (a masked token)
and NaN become `LOGPROB_FLOOR` (vLLM's -9999), so they stay numbers a JSON body can carry.

No row can make the step fail or emit a token outside the vocabulary: a row whose token is
not a finite candidate of its constrained logits (every token masked, say a grammar that
has ended while `min_tokens` blocks its stop token; a NaN or an overflow that spoiled the
draw) takes the argmax of the logits as they came in, NaN read as -inf (the grammar mask is
applied before the sampler, so an ended grammar still picks its end token). The check is one
gather per step; the fallback runs only for such rows.
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


LOGPROB_FLOOR = -9999.0
"""The logprob returned for a masked token (-inf) or a NaN."""

# Candidate-set sizes tried in turn by a row with top-k/top-p/min-p before it sorts its
# whole vocabulary. After a flat distribution (random-word prompts) top_p 0.95 keeps more than
# 1024 of the 49152 tokens on ~18% of rows; `topk` of 4096 / 16384 takes 0.7 / 1.6 ms on one
# row where sorting the row took 2-32 ms (one thread, machine under load).
CANDIDATES = (64, 256, 1024, 4096, 16384)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
            raw_logprobs.nan_to_num_(nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR)
        constrained = self._apply_constraints(logits, meta)

        token_ids = argmax_rows(constrained) if meta.all_greedy else self._sample(constrained, meta)
        token_ids = _with_fallback(token_ids, constrained, logits)

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
        u = self._uniforms(logits.shape[0], meta.generators, logits.device)
        greedy = meta.temperature == 0
        rows = None if not bool(greedy.any()) else torch.nonzero(~greedy).squeeze(1)

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return t if t is None or rows is None else t[rows]

        x = take(logits) / take(meta.temperature)[:, None]
        sampled = _draw(x, take(u), take(meta.top_k), take(meta.top_p), take(meta.min_p))
        if rows is None:
            return sampled
        tokens = argmax_rows(logits)  # the greedy rows' tokens; sampled rows overwritten
        return tokens.index_copy_(0, rows, sampled)

    def _uniforms(
        self, num_rows: int, generators: dict[int, torch.Generator], device: torch.device
    ) -> torch.Tensor:
        """One uniform number in [0, 1) per row (float64): seeded rows take theirs from
        their own generator, the rest from the sampler's."""
        u = torch.rand(num_rows, generator=self.generator, device=device, dtype=torch.float64)
        for row, generator in generators.items():
            u[row : row + 1] = torch.rand(1, generator=generator, device=device, dtype=u.dtype)
        return u


def _draw(
    x: torch.Tensor,
    u: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """One token per row of the temperature-scaled logits `x`, drawn with the row's uniform
    `u` from softmax(x) restricted by top-k, then top-p, then min-p.

    A row without filters draws over the whole vocabulary. A filtered row first looks for
    its kept set among its `CANDIDATES[i]` most likely tokens (growing); only a row whose
    kept set reaches past the largest candidate set sorts its whole vocabulary. Every path
    keeps the same set (a threshold on the logit) and draws over it in token-id order, so
    a row samples the same token whatever path it takes and whatever else is in the batch.
    """
    num_rows, vocab_size = x.shape
    probs = torch.softmax(x, dim=-1)
    filtered = torch.zeros(num_rows, dtype=torch.bool, device=x.device)
    if top_k is not None:
        filtered |= (top_k > 0) & (top_k < vocab_size)
    if top_p is not None:
        filtered |= top_p < 1
    if min_p is not None:
        filtered |= min_p > 0
    if not bool(filtered.any()):
        return _inverse_cdf(probs, u)

    tokens = torch.empty(num_rows, dtype=torch.long, device=x.device)
    whole = torch.nonzero(~filtered).squeeze(1)
    if whole.numel():
        tokens[whole] = _inverse_cdf(probs[whole], u[whole])
    pending = torch.nonzero(filtered).squeeze(1)
    native = _native_kernels(x)
    if native is not None:
        tokens[pending] = _native_draw(x, probs, pending, top_k, top_p, min_p, u)
        return tokens
    for k in CANDIDATES:
        if not pending.numel():
            return tokens
        k = min(k, vocab_size)
        values, ids = _take(x, pending).topk(k, dim=-1)
        candidate_probs = _take(probs, pending).gather(1, ids)
        params = [None if p is None else p[pending] for p in (top_k, top_p, min_p)]
        threshold, covered = _threshold(values, candidate_probs, *params)
        if k == vocab_size:
            covered[:] = True
        # Covered rows draw over their kept candidates, in token-id order.
        order = ids.argsort(dim=-1)
        ids, values = ids.gather(1, order), values.gather(1, order)
        kept_probs = candidate_probs.gather(1, order) * (values >= threshold)
        index = _inverse_cdf(kept_probs, u[pending])
        drawn = ids.gather(1, index.clamp(min=0)[:, None]).squeeze(1).masked_fill_(index < 0, -1)
        tokens[pending[covered]] = drawn[covered]
        pending = pending[~covered]
    if pending.numel():
        # The exact path: the rows left sort their whole vocabulary.
        rows_x = _take(x, pending)
        values, ids = rows_x.sort(dim=-1, descending=True)
        rows_probs = _take(probs, pending)
        params = [None if p is None else p[pending] for p in (top_k, top_p, min_p)]
        threshold, _ = _threshold(values, rows_probs.gather(1, ids), *params)
        tokens[pending] = _inverse_cdf(rows_probs * (rows_x >= threshold), u[pending])
    return tokens


def _native_kernels(x: torch.Tensor):
    """The native ops (`native/ops.py`) when they can draw these rows (float32 on the CPU),
    else None."""
    from nanollmserve.native import ops

    if x.device.type != "cpu" or x.dtype != torch.float32 or not ops.available():
        return None
    return ops


def _native_draw(x, probs, rows, top_k, top_p, min_p, u) -> torch.Tensor:
    """The filtered rows' tokens from the native draw: the same kept set and draw as the
    candidate path below, without a `topk` per candidate size."""
    from nanollmserve.native.ops import filtered_draw

    count = rows.numel()

    def per_row(values: torch.Tensor | None, off: float, dtype: torch.dtype) -> torch.Tensor:
        if values is None:
            return torch.full((count,), off, dtype=dtype)
        return values[rows].to(dtype)

    return filtered_draw(
        _take(x, rows),
        _take(probs, rows),
        per_row(top_k, 0, torch.int64),
        per_row(top_p, 1.0, torch.float32),
        per_row(min_p, 0.0, torch.float32),
        u[rows].to(torch.float64),
    )


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest logit: the first of ties, a NaN's if it has one, 0 for a
    row of -inf, as `argmax` gives. `max(dim).indices` is `argmax` 2.5-3x faster on the CPU
    (64 rows of 49,152: 0.8 against 2.0-2.6 ms, torch 2.13), and a greedy step takes it once."""
    return logits.max(dim=-1).indices


def _with_fallback(
    tokens: torch.Tensor, constrained: torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    """`tokens`, except where a row's token is not a finite candidate of its `constrained`
    logits (an id outside the vocabulary, or a token of logit -inf/+inf/NaN: the row had no
    finite candidate, or a NaN or infinity spoiled its draw): there the argmax of `logits`,
    the row as it came in, NaN read as -inf (index 0 for a row with nothing finite). Always
    an id in [0, vocab). Costs one gather when every token is valid."""
    vocab_size = constrained.shape[1]
    in_vocab = (tokens >= 0) & (tokens < vocab_size)
    picked = constrained.gather(1, tokens.clamp(0, vocab_size - 1)[:, None]).squeeze(1)
    valid = in_vocab & picked.isfinite()
    if bool(valid.all()):
        return tokens
    bad = torch.nonzero(~valid).squeeze(1)
    fallback = logits[bad].nan_to_num(nan=float("-inf")).argmax(dim=-1)
    return tokens.index_copy(0, bad, fallback)


def _take(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`t[rows]`, without a copy when `rows` (ascending) are all of t's rows."""
    return t if rows.numel() == t.shape[0] else t[rows]


def _threshold(
    values: torch.Tensor,
    probs: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest logit each row keeps (`[R, 1]`; every token at or above it is kept, ties
    included) and whether the candidates cover the kept set (`[R]`), from the candidates'
    logits `values` sorted in descending order and their probabilities under the whole
    vocabulary's softmax.

    top-k keeps the k best; top-p then drops a token once the more likely kept tokens
    already cover top_p of the kept mass; min-p drops probabilities below min_p times the
    row's largest.
    """
    num_rows, k = values.shape
    keep = torch.ones_like(values, dtype=torch.bool)
    known = torch.ones(num_rows, dtype=torch.bool, device=values.device)
    mass = torch.ones(num_rows, 1, dtype=probs.dtype, device=values.device)
    if top_k is not None:
        active = (top_k > 0)[:, None]
        kth = values.gather(1, (top_k.clamp(1, k) - 1)[:, None])
        keep &= ~active | (values >= kth)
        known &= (top_k <= k) | (top_k == 0)  # the k-th best is among the candidates
    if top_p is not None:
        kept_probs = probs * keep
        cumulative = kept_probs.cumsum(dim=-1)
        if top_k is not None:  # top-p renormalizes over what top-k kept
            mass = torch.where((top_k > 0)[:, None], cumulative[:, -1:], mass)
        before = cumulative - kept_probs
        keep &= (before <= top_p[:, None] * mass) | (top_p >= 1)[:, None]
    if min_p is not None:
        keep &= probs >= min_p[:, None] * probs[:, :1]
    num_kept = keep.sum(dim=-1, keepdim=True).clamp(min=1)
    threshold = values.gather(1, num_kept - 1)
    # Nothing beyond the candidates is kept when the last candidate is not (or has no mass).
    covered = known & ((values[:, -1:] < threshold) | (probs[:, -1:] == 0)).squeeze(1)
    return threshold, covered


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative mass exceeds u * total mass: an exact
    categorical draw from one uniform number (an entry of mass 0 is never chosen). A row
    with no mass, or NaN mass (an infinite logit), gets -1, which the sampler's fallback
    replaces; never an index past the row."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    index.clamp_(max=probs.shape[1] - 1)
    return index.masked_fill_(~(total.squeeze(1) > 0), -1)


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

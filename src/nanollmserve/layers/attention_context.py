"""The per-step attention context: what every attention layer needs to find its K/V.

The model forward keeps the signature `(input_ids, positions)` over one flat batch of tokens
(no padding). Everything the attention needs to know about how those tokens split into
sequences and where their keys and values live in the paged KV cache is set once per step by
the model runner (`set_context`) and read by each attention layer (`get_context`).

The flat batch is ordered decodes first: the first `num_decode_tokens` tokens are one token
of one sequence each. The rest are prefill spans (a whole prompt, a chunk of one, or the
recompute of a preempted request), one span per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSpan:
    """One sequence's new tokens in the flat batch: `query_start:query_end`.

    `block_ids` (1-D) lists the KV blocks holding the sequence's first `context_len` tokens,
    the new ones included, and `attn_mask` ([new tokens, context_len], additive: 0 or -inf)
    lets each new token see the keys up to its own position. `block_ids=None` means the span
    starts at position 0 and attends only to its own keys (plain causal attention, no cache
    read needed).
    """

    query_start: int
    query_end: int
    context_len: int
    block_ids: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None

    @classmethod
    def over_cache(
        cls,
        query_start: int,
        query_end: int,
        context_len: int,
        block_ids: torch.Tensor,
        dtype: torch.dtype,
    ) -> PrefillSpan:
        """A span whose earlier tokens are already in the cache (prefix hit or a later chunk):
        query i sits at position context_len - num_new + i and sees keys 0 .. that position."""
        num_new = query_end - query_start
        device = block_ids.device
        query_pos = torch.arange(context_len - num_new, context_len, device=device)
        key_pos = torch.arange(context_len, device=device)
        mask = additive_mask(key_pos[None, :] <= query_pos[:, None], dtype)
        return cls(query_start, query_end, context_len, block_ids, mask)


@dataclass
class AttentionContext:
    """Where each token's K/V is written (`slot_mapping`) and read from (block tables)."""

    slot_mapping: torch.Tensor | None = None  # [num_tokens] long; None: do not write the cache
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] long
    # [num_decodes, 1, 1, max_blocks * block_size], additive: 0 where a key is valid, else -inf
    decode_mask: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] long: keys per decode
    prefills: list[PrefillSpan] = field(default_factory=list)

    @classmethod
    def causal_prefill(cls, seq_lens: list[int]) -> AttentionContext:
        """Context for running whole sequences back to back without a KV cache (parity tests,
        scoring): every sequence is one prefill span with plain causal attention."""
        spans, start = [], 0
        for n in seq_lens:
            spans.append(PrefillSpan(start, start + n, n))
            start += n
        return cls(prefills=spans)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool "may attend" -> 0 / -inf in the model dtype. CPU SDPA is several times faster
    with an additive float mask than with a bool one."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


_context = AttentionContext()


def set_context(context: AttentionContext) -> None:
    global _context
    _context = context


def get_context() -> AttentionContext:
    return _context


def reset_context() -> None:
    set_context(AttentionContext())

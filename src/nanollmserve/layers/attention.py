"""Attention over the paged KV cache.

Each layer owns views `k_cache` / `v_cache` of shape `[num_blocks, block_size, kv_heads,
head_dim]` into the one KV allocation made by the model runner. A forward does two things:

1. write the new tokens' K/V into their slots (`slot_mapping`, one slot per token);
2. attend: decode tokens read their whole context through their block tables in one batched
   SDPA call; each prefill span reads its cached prefix (if any) plus its own tokens, causally.

Reading through whole blocks (`index_select` on block ids) copies large contiguous rows, which
on CPU is several times cheaper than gathering token by token. On the CPU in float32 the
decode tokens instead read their keys and values in place, in C (`paged_decode_attention` in
`native/ops.py`, `native/attention_cpu.c`): no gather, no padding to the longest sequence;
SDPA over the gathered blocks stays for GPUs and as the reference.

A float16 cache (`--kv-cache-dtype float16`) under a float32 model is cast as it is written and
as its blocks are gathered; the native attention reads its halves in place. A quantized cache
(`--kv-cache-dtype`, `layers/kv_quant.py`) holds 8-bit codes in `k_cache` /
`v_cache` and a float32 scale per token and KV head in `k_scale` / `v_scale` ([num_blocks,
block_size, kv_heads]): the write quantizes, the native decode attention reads int8 codes in
place (dequantized in registers), and SDPA (fp8, GPUs, prefill over a cached prefix) reads
the gathered blocks dequantized, never the whole pool. A prefill from position 0 attends to
its own K/V as computed, before they are quantized.

A sliding-window layer (`sliding_window`, Gemma 3's local layers) lets a query at position p
see the keys at p - window + 1 .. p only: its masks (decode, prefill, prefill over a cached
prefix) leave out the older keys, and its decodes take SDPA, not the native kernel (which
reads whole contexts). Every key stays in the cache: the window is applied as the cache is
read, so the blocks out of the window are not freed early.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanollmserve.layers.attention_context import additive_mask, get_context
from nanollmserve.layers.kv_quant import dequantize, quantize


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        """None: full attention; else each query sees its last `sliding_window` keys."""
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.group_size = num_heads // num_kv_heads
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale: torch.Tensor | None = None
        """With a quantized cache, the scales of `k_cache`'s rows; else None."""
        self.v_scale: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, heads*dim]."""
        ctx = get_context()
        has_cache = self.k_cache.numel() > 0
        if has_cache and ctx.slot_mapping is not None:
            self._store(k, v, ctx.slot_mapping)
        # The flat batch is decodes, then prefill spans in order: their outputs concatenate.
        parts = []
        num_decodes = ctx.num_decode_tokens
        if num_decodes:
            parts.append(self._decode(q[:num_decodes], ctx))
        for span in ctx.prefills:
            s, e = span.query_start, span.query_end
            parts.append(self._prefill(q[s:e], k[s:e], v[s:e], span))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _store(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        kv_shape = (-1, self.num_kv_heads, self.head_dim)
        for cache, scale, x in ((self.k_cache, self.k_scale, k), (self.v_cache, self.v_scale, v)):
            if scale is None:
                cache.view(kv_shape).index_copy_(0, slot_mapping, x.to(cache.dtype))
                continue
            codes, scales = quantize(x, cache.dtype)
            # as bytes: index_copy_ has no float8 kernel
            rows = cache.view(kv_shape).view(torch.uint8)
            rows.index_copy_(0, slot_mapping, codes.view(torch.uint8))
            scale.view(-1, self.num_kv_heads).index_copy_(0, slot_mapping, scales)

    def _gather(
        self,
        cache: torch.Tensor,
        block_ids: torch.Tensor,
        scale: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """[..., num_blocks] block ids -> [..., kv_heads, num_blocks * block_size, head_dim]
        in `dtype` (None: the cache's); a quantized cache's blocks (`scale` given)
        dequantized."""
        ids = block_ids.reshape(-1)
        if scale is None:
            rows = cache.index_select(0, ids)
            rows = rows if dtype is None else rows.to(dtype)
        else:
            codes = cache.view(torch.uint8).index_select(0, ids).view(cache.dtype)
            rows = dequantize(codes, scale.index_select(0, ids), dtype)
        rows = rows.view(*block_ids.shape[:-1], -1, self.num_kv_heads, self.head_dim)
        return rows.transpose(-3, -2)

    def _decode(self, q: torch.Tensor, ctx) -> torch.Tensor:
        native = _native_kernels(q, self.k_cache, self.head_dim)
        if native is not None and ctx.decode_context_lens is not None and not self.sliding_window:
            return self._decode_native(q, ctx)
        # Grouped-query trick: the query heads that share a KV head become that head's
        # "query length", so K/V are never repeated: [D, kv_heads, group, head_dim].
        num_decodes = q.shape[0]
        q = q.reshape(num_decodes, self.num_kv_heads, self.group_size, self.head_dim)
        k = self._gather(self.k_cache, ctx.decode_block_tables, self.k_scale, q.dtype)
        v = self._gather(self.v_cache, ctx.decode_block_tables, self.v_scale, q.dtype)
        mask = ctx.decode_mask
        if self.sliding_window:  # keys before len - window are out of the window
            key_pos = torch.arange(mask.shape[-1], device=mask.device)
            first = (ctx.decode_context_lens - self.sliding_window).view(-1, 1, 1, 1)
            mask = mask.masked_fill(key_pos < first, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out.reshape(num_decodes, self.num_heads, self.head_dim)

    def _decode_native(self, q: torch.Tensor, ctx) -> torch.Tensor:
        """The decode tokens' attention read in place from the paged cache (C, one work item
        per sequence and KV head): no gather of every sequence's blocks, no padding mask.
        ValueError when a length or block id is outside the tables or the pool."""
        from nanollmserve.native.ops import paged_decode_attention

        return paged_decode_attention(
            q, self.k_cache, self.v_cache, ctx.decode_block_tables, ctx.decode_context_lens,
            self.scale, k_scale=self.k_scale, v_scale=self.v_scale,
        )  # fmt: skip

    def _prefill(self, q, k, v, span) -> torch.Tensor:
        q = q.transpose(0, 1).unsqueeze(0)  # [1, heads, Tq, dim]
        if span.block_ids is None and self.sliding_window and q.shape[2] > self.sliding_window:
            k = k.transpose(0, 1).unsqueeze(0)
            v = v.transpose(0, 1).unsqueeze(0)
            pos = torch.arange(q.shape[2], device=q.device)
            allowed = (pos[None, :] <= pos[:, None]) & (
                pos[None, :] > pos[:, None] - self.sliding_window
            )
            mask = additive_mask(allowed, q.dtype)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
        elif span.block_ids is None:
            k = k.transpose(0, 1).unsqueeze(0)
            v = v.transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            k = self._gather(self.k_cache, span.block_ids, self.k_scale, q.dtype)
            v = self._gather(self.v_cache, span.block_ids, self.v_scale, q.dtype)
            k = k[:, : span.context_len].unsqueeze(0)
            v = v[:, : span.context_len].unsqueeze(0)
            mask = span.attn_mask
            if self.sliding_window and span.context_len > self.sliding_window:
                num_new = q.shape[2]
                query_pos = torch.arange(span.context_len - num_new, span.context_len)
                key_pos = torch.arange(span.context_len)
                old = key_pos[None, :] <= query_pos[:, None] - self.sliding_window
                mask = mask.masked_fill(old.to(mask.device), float("-inf"))
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
        return out.squeeze(0).transpose(0, 1)


def _native_kernels(q: torch.Tensor, k_cache: torch.Tensor, head_dim: int):
    """The native ops (`native/ops.py`) when they can attend these decodes (float32 queries
    on the CPU, a contiguous float32, float16 or int8 cache, head_dim a multiple of 8 up to
    `MAX_HEAD_DIM`), else None: SDPA over gathered blocks."""
    from nanollmserve.native import ops

    if (
        q.device.type != "cpu"
        or q.dtype != torch.float32
        or k_cache.dtype not in (torch.float32, torch.float16, torch.int8)
        or not k_cache.is_contiguous()
        or head_dim % 8
        or head_dim > ops.MAX_HEAD_DIM
        or not ops.available()
    ):
        return None
    return ops

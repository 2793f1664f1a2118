"""PagedAttention against dense attention: the same numbers whether K/V sit in scattered
blocks of the paged cache or in one contiguous tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanollmserve.layers.attention import PagedAttention
from nanollmserve.layers.attention_context import (
    AttentionContext,
    PrefillSpan,
    additive_mask,
    reset_context,
    set_context,
)

pytestmark = pytest.mark.milestone("m07")

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4


def dense_reference(q, k, v, num_query: int) -> torch.Tensor:
    """q [Tq, H, D] at the last Tq positions of k/v [L, KVH, D]; causal; -> [Tq, H*D]."""
    length = k.shape[0]
    rep = HEADS // KV_HEADS
    kk = k.repeat_interleave(rep, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    qq = q.transpose(0, 1)
    q_pos = torch.arange(length - num_query, length)[:, None]
    allowed = torch.arange(length)[None, :] <= q_pos
    out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=allowed, scale=DIM**-0.5)
    return out.transpose(0, 1).reshape(num_query, HEADS * DIM)


def paged_layer(num_blocks: int) -> PagedAttention:
    layer = PagedAttention(HEADS, KV_HEADS, DIM, scale=DIM**-0.5)
    layer.k_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM)
    layer.v_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM)
    return layer


def write_history(layer, k, v, blocks: list[int]) -> None:
    """Put the first len(k) tokens of a sequence into its (scattered) blocks."""
    slots = [blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(k.shape[0])]
    layer._store(k, v, torch.tensor(slots, dtype=torch.long))


@pytest.mark.parametrize("path", ["native", "sdpa"])
def test_decode_batch_reads_scattered_blocks_like_dense_attention(path, monkeypatch):
    """Through the native in-place read (CPU float32 default, given the context lengths) and
    through SDPA over the gathered blocks."""
    from nanollmserve.layers import attention as attention_module

    if path == "sdpa":
        monkeypatch.setattr(attention_module, "_native_kernels", lambda *args: None)
    else:
        from nanollmserve.native.ops import kernels_unavailable_reason

        if kernels_unavailable_reason():
            pytest.skip(kernels_unavailable_reason())
        calls = []
        native_decode = attention_module.PagedAttention._decode_native
        monkeypatch.setattr(
            attention_module.PagedAttention,
            "_decode_native",
            lambda self, *args: calls.append(1) or native_decode(self, *args),
        )
    torch.manual_seed(0)
    layer = paged_layer(num_blocks=32)
    lengths = [5, 13, 1, 9]
    tables = [[7, 2], [30, 3, 17, 11], [5], [0, 21, 9]]
    qs, ks, vs, slot_mapping = [], [], [], []
    for length, table in zip(lengths, tables, strict=True):
        k, v = torch.randn(length, KV_HEADS, DIM), torch.randn(length, KV_HEADS, DIM)
        write_history(layer, k[:-1], v[:-1], table)
        ks.append(k), vs.append(v), qs.append(torch.randn(1, HEADS, DIM))
        last = length - 1
        slot_mapping.append(table[last // BLOCK] * BLOCK + last % BLOCK)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    valid = torch.arange(width * BLOCK)[None, :] < torch.tensor(lengths)[:, None]
    set_context(
        AttentionContext(
            slot_mapping=torch.tensor(slot_mapping),
            num_decode_tokens=len(lengths),
            decode_block_tables=block_tables,
            decode_mask=additive_mask(valid, torch.float32).view(len(lengths), 1, 1, -1),
            decode_context_lens=torch.tensor(lengths),
        )
    )
    try:
        out = layer(torch.cat(qs), torch.cat([k[-1:] for k in ks]), torch.cat([v[-1:] for v in vs]))
    finally:
        reset_context()
    for i, (q, k, v) in enumerate(zip(qs, ks, vs, strict=True)):
        torch.testing.assert_close(out[i : i + 1], dense_reference(q, k, v, 1))
    if path == "native":
        assert calls, "the native path ran"


def test_prefill_chunk_over_a_cached_prefix_is_causal_like_dense_attention():
    torch.manual_seed(1)
    layer = paged_layer(num_blocks=16)
    total, cached = 19, 11  # 11 tokens in the cache already, a chunk of 8 new ones
    table = [9, 4, 14, 1, 6]
    k, v = torch.randn(total, KV_HEADS, DIM), torch.randn(total, KV_HEADS, DIM)
    q = torch.randn(total - cached, HEADS, DIM)
    write_history(layer, k[:cached], v[:cached], table)
    slots = torch.tensor([table[i // BLOCK] * BLOCK + i % BLOCK for i in range(cached, total)])
    span = PrefillSpan.over_cache(0, total - cached, total, torch.tensor(table), torch.float32)
    set_context(AttentionContext(slot_mapping=slots, prefills=[span]))
    try:
        out = layer(q, k[cached:], v[cached:])
    finally:
        reset_context()
    torch.testing.assert_close(out, dense_reference(q, k, v, total - cached))


def test_fresh_prefills_and_decodes_in_one_batch():
    """A decode and two whole prompts in one flat batch, as the model runner builds it."""
    torch.manual_seed(2)
    layer = paged_layer(num_blocks=16)
    dk, dv = torch.randn(6, KV_HEADS, DIM), torch.randn(6, KV_HEADS, DIM)
    write_history(layer, dk[:-1], dv[:-1], [3, 8])
    p1 = [torch.randn(7, n, DIM) for n in (HEADS, KV_HEADS, KV_HEADS)]
    p2 = [torch.randn(3, n, DIM) for n in (HEADS, KV_HEADS, KV_HEADS)]
    dq = torch.randn(1, HEADS, DIM)
    slots = (
        [8 * BLOCK + 1] + [10 * BLOCK + i for i in range(4)] + [11 * BLOCK + i for i in range(3)]
    )
    slots += [12 * BLOCK + i for i in range(3)]
    valid = torch.arange(2 * BLOCK)[None, :] < 6
    set_context(
        AttentionContext(
            slot_mapping=torch.tensor(slots),
            num_decode_tokens=1,
            decode_block_tables=torch.tensor([[3, 8]]),
            decode_mask=additive_mask(valid, torch.float32).view(1, 1, 1, -1),
            prefills=[PrefillSpan(1, 8, 7), PrefillSpan(8, 11, 3)],
        )
    )
    try:
        out = layer(
            torch.cat([dq, p1[0], p2[0]]),
            torch.cat([dk[-1:], p1[1], p2[1]]),
            torch.cat([dv[-1:], p1[2], p2[2]]),
        )
    finally:
        reset_context()
    torch.testing.assert_close(out[:1], dense_reference(dq, dk, dv, 1))
    torch.testing.assert_close(out[1:8], dense_reference(*p1, 7))
    torch.testing.assert_close(out[8:], dense_reference(*p2, 3))
    # the prompts' K/V landed in their slots for later decodes
    torch.testing.assert_close(layer.k_cache[10], p1[1][:4])
    torch.testing.assert_close(layer.v_cache[12, :3], p2[2])

"""The input embedding read from the GGUF file's Q8_0 blocks (m25, issue 25): with the
weights in GGUF blocks (the default) no float32 embedding table is kept; each looked-up row is
the dequantized table's row bit for bit, in the PyTorch forward and in the native step, so the
answers do not move. The dequantized weights (`--quantization none`, `--dtype float32`) keep
the float32 table."""

from __future__ import annotations

import pytest
import torch

from nanollmserve import SamplingParams
from nanollmserve.layers.gguf_embedding import GGUFEmbedding
from nanollmserve.native.abi import KIND_Q8

pytestmark = [pytest.mark.milestone("m25"), pytest.mark.timeout(600)]

CHATS = ["What is the capital of France?", "Write a haiku about the sea."]


def float32_tables(model) -> list[str]:
    """Names of the model's float32 tensors the size of the embedding table."""
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return [n for n, t in tensors if t.dtype == torch.float32 and t.numel() == vocab * hidden]


def test_the_gguf_embedding_is_the_q8_blocks_row_for_row_and_no_float32_table_is_kept(make_llm):
    gguf = make_llm(dtype="auto")  # the default: the bundled file's own blocks
    dense = make_llm(dtype="float32")  # the dequantized weights (`--quantization none`)
    model = gguf.engine.loaded.model
    embedding = model.model.embed_tokens
    assert isinstance(embedding, GGUFEmbedding)
    assert embedding.tiles.data_ptr() == model.lm_head.tiles.data_ptr(), "the lm_head's blocks"
    assert float32_tables(model) == []
    table = dense.engine.loaded.model.model.embed_tokens.weight
    assert float32_tables(dense.engine.loaded.model) == ["model.embed_tokens.weight"]
    every_id = torch.arange(table.shape[0])
    assert torch.equal(embedding(every_id), table)
    assert torch.equal(embedding(every_id[:6].view(2, 3)), table[:6].view(2, 3, -1))

    declared = model.native_decoder()
    assert declared.embed_kind == KIND_Q8
    assert declared.embed.data_ptr() == model.lm_head.tiles.data_ptr()


def test_native_and_pytorch_steps_read_the_same_rows_and_keep_the_answers(make_llm):
    """Greedy chats through the native step (the default) and through the PyTorch forward
    over the same blocks (the native step off) give the same tokens as the float32 model."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    chats = [[{"role": "user", "content": c}] for c in CHATS]
    expected = [list(o.outputs[0].token_ids) for o in make_llm(dtype="float32").chat(chats, params)]

    gguf = make_llm(dtype="auto")
    runner = gguf.engine.model_runner
    assert runner.native_decode is not None
    native = [list(gguf.chat([chat], params)[0].outputs[0].token_ids) for chat in chats]
    assert sum(runner.native_steps.values()) > 0
    runner.native_decode = None  # every step through the PyTorch forward and GGUFEmbedding
    forward = [list(gguf.chat([chat], params)[0].outputs[0].token_ids) for chat in chats]
    assert native == expected
    assert forward == expected

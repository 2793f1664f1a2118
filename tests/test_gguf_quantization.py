"""`--quantization gguf`: the GGUF file's own 4-bit blocks, run through PyTorch's int4 kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanollmserve import SamplingParams
from nanollmserve.errors import UserError
from nanollmserve.layers.gguf_linear import (
    MAX_INT4_ROWS,
    GGUFInt4Linear,
    int4_kernel_for_every_step,
    pack_int4_blocks,
)
from nanollmserve.layers.quantization import Fp16Linear
from nanollmserve.model.gguf_blocks import Int4Blocks, read_int4_blocks
from nanollmserve.model.gguf_cache import cache_root
from nanollmserve.model.source import bundled_gguf_path

pytestmark = pytest.mark.milestone("m17")

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three fruits.",
    "Explain gravity in one sentence.",
]


def _random_blocks(rows: int, cols: int, q4_1: bool = True) -> Int4Blocks:
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.int32)
    d = torch.rand(rows, cols // 32) * 0.05
    m = -torch.rand(rows, cols // 32) * 0.4 if q4_1 else torch.zeros(rows, cols // 32)
    return Int4Blocks(codes, d, m + 8 * d if q4_1 else m)


@pytest.mark.parametrize("rows", [1, 3, MAX_INT4_ROWS, MAX_INT4_ROWS + 1, 40])
def test_int4_linear_computes_the_blocks_weights_at_every_step_size(rows):
    blocks = _random_blocks(96, 128)
    weight = blocks.dequantize()
    bias = torch.randn(96)
    layer = GGUFInt4Linear(weight, bias, **pack_int4_blocks(blocks, torch.bfloat16))
    x = torch.randn(rows, 128)
    expected = F.linear(x, weight, bias)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    # Small steps run the int4 kernel in bfloat16 (activations and block constants rounded to
    # 8 significant bits), large ones the dense float32 copy (exact).
    tolerance = 2e-2 if rows <= MAX_INT4_ROWS else 1e-5
    assert (got - expected).abs().max() / expected.abs().max() < tolerance


def test_bench_quality_can_force_every_step_through_the_int4_kernel():
    blocks = _random_blocks(64, 96)
    model = nn.Sequential(
        GGUFInt4Linear(blocks.dequantize(), None, **pack_int4_blocks(blocks, torch.bfloat16))
    )
    x = torch.randn(MAX_INT4_ROWS + 8, 96)
    dense = model(x)
    int4_kernel_for_every_step(model)
    kernel = model(x)
    assert not torch.equal(kernel, dense)  # bfloat16 arithmetic, not the float32 copy
    assert (kernel - dense).abs().max() / dense.abs().max() < 2e-2


def test_the_file_blocks_are_the_weights_of_the_converted_checkpoint(make_llm):
    """Nothing is re-quantized: the blocks dequantize bit for bit to what transformers made of
    the same file (q/k row order of llama.cpp undone, q/k/v and gate/up fused)."""
    llm = make_llm(dtype="float32")
    weights = llm.engine.loaded.model.state_dict()
    blocks = read_int4_blocks(bundled_gguf_path(), llm.engine.loaded.model_config)
    assert len(blocks) == 30 * 4  # qkv, o, gate_up, down of every layer (the file is Q4_1)
    for name, b in blocks.items():
        assert torch.equal(b.dequantize(), weights[name]), name


def test_the_bundled_model_answers_like_float32_with_gguf_blocks(make_llm):
    plain = make_llm(dtype="float32")
    gguf = make_llm(quantization="gguf")
    model = gguf.engine.loaded.model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, GGUFInt4Linear) for m in model.modules()) == 120
    assert isinstance(model.lm_head, Fp16Linear)  # the tied Q8_0 table as float16
    params = SamplingParams(temperature=0.0, max_tokens=32)
    chats = [[{"role": "user", "content": c}] for c in CHATS]
    expected = [o.outputs[0].token_ids for o in plain.chat(chats, params)]
    got = [o.outputs[0] for o in gguf.chat(chats, params)]
    assert "Paris" in got[0].text
    # bfloat16 activations in the int4 kernel may flip a late near-tie; most answers agree
    # token for token, and every one for its first 8 tokens.
    assert sum(list(g.token_ids) == list(e) for g, e in zip(got, expected, strict=True)) >= 3
    assert all(list(g.token_ids[:8]) == list(e[:8]) for g, e in zip(got, expected, strict=True))
    packed_files = list((cache_root() / "gguf").glob("*/gguf-int4-*.safetensors"))
    assert packed_files, "the packed blocks are kept in the conversion cache"


def test_gguf_quantization_needs_a_gguf_model(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from nanollmserve.config import EngineConfig
    from nanollmserve.engine.model_loading import load_engine_model

    config = LlamaConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="needs|GGUF file's blocks"):
        load_engine_model(EngineConfig(model=str(tmp_path), quantization="gguf", dtype="float32"))


def test_gguf_blocks_are_the_default_for_a_gguf_model_with_dtype_auto(make_llm):
    default = make_llm(dtype="auto")
    assert default.engine.loaded.quantization == "gguf"
    off = make_llm(dtype="auto", quantization="none")
    assert off.engine.loaded.quantization is None
    assert any(isinstance(m, nn.Linear) for m in off.engine.loaded.model.modules())
    # An explicit --dtype asks for the dequantized weights in that dtype (today's behaviour).
    assert make_llm(dtype="float32").engine.loaded.quantization is None

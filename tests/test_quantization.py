"""Weight-only quantization (int8, fp16): close to the float weights, same answers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from nanollmserve import EngineConfig, SamplingParams
from nanollmserve.errors import UserError
from nanollmserve.layers.attention_context import AttentionContext, reset_context, set_context
from nanollmserve.layers.quantization import (
    Fp16Linear,
    Int8Linear,
    WeightOnlyLinear,
    quantize_model,
)
from nanollmserve.quantization_names import WEIGHT_ONLY_METHODS

pytestmark = pytest.mark.milestone("m17")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_close_to_the_float_layer(dtype):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True).to(dtype)
    quantized = Int8Linear.from_linear(linear)
    assert quantized.qweight.dtype == torch.int8 and quantized.qweight.shape == (96, 64)
    x = torch.randn(2, 5, 64, dtype=dtype)  # any leading shape
    expected, got = linear(x).float(), quantized(x).float()
    assert got.shape == (2, 5, 96)
    assert (got - expected).abs().max() / expected.abs().max() < 0.02


def test_the_bundled_model_answers_the_same_with_int8_weights(make_llm):
    plain = make_llm(dtype="bfloat16")
    int8 = make_llm(dtype="bfloat16", quantization="int8")
    model = int8.engine.loaded.model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear)  # tied embeddings: a quantized copy
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    answer = int8.chat(chat, SamplingParams(temperature=0.0, max_tokens=24))[0]
    assert "Paris" in answer.outputs[0].text
    # Next-token argmax at every position of a prompt mostly agrees with the float model.
    ids = plain.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    top = []
    for llm in (plain, int8):
        m = llm.engine.loaded.model
        set_context(AttentionContext.causal_prefill([len(ids)]))
        with torch.inference_mode():
            top.append(m.compute_logits(m(torch.tensor(ids), torch.arange(len(ids)))).argmax(-1))
        reset_context()
    assert (top[0] == top[1]).float().mean() > 0.9


def test_fp16_linear_is_close_to_the_float32_layer():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True)
    converted = Fp16Linear.from_linear(linear)
    x = torch.randn(2, 5, 64)
    expected, got = linear(x), converted(x)
    assert got.shape == (2, 5, 96) and got.dtype == torch.float32
    assert (got - expected).abs().max() / expected.abs().max() < 2e-3
    with pytest.raises(ValueError, match="float32"):
        Fp16Linear.from_linear(nn.Linear(4, 4).to(torch.bfloat16))


def test_fp16_weights_compute_in_float32_and_answer_like_the_float32_model(make_llm):
    fp32 = make_llm(dtype="float32")
    fp16 = make_llm(dtype="auto", quantization="fp16")
    loaded = fp16.engine.loaded
    assert loaded.dtype == torch.float32  # auto picks the dtype the fp16 kernel computes in
    assert not any(isinstance(m, nn.Linear) for m in loaded.model.modules())
    assert isinstance(loaded.model.lm_head, Fp16Linear)
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    for question in ["What is the capital of France?", "Write a haiku about the sea."]:
        chat = [{"role": "user", "content": question}]
        expected = fp32.chat(chat, greedy)[0].outputs[0]
        got = fp16.chat(chat, greedy)[0].outputs[0]
        assert got.token_ids == expected.token_ids, (question, got.text, expected.text)


def test_fp16_weights_refuse_another_activation_dtype(make_llm):
    with pytest.raises(UserError, match="computes in float32: use --dtype float32 or auto"):
        make_llm(dtype="bfloat16", quantization="fp16")


@pytest.mark.milestone("m28")
@pytest.mark.parametrize("method", WEIGHT_ONLY_METHODS)
def test_every_weight_only_name_converts_a_model(method):
    """The names `--quantization` accepts (a torch-free leaf) and the classes agree."""
    model = quantize_model(nn.Sequential(nn.Linear(64, 32)), method)
    assert isinstance(model[0], WeightOnlyLinear)
    assert EngineConfig(quantization=method).quantization == method


def test_quantize_model_rejects_unknown_methods():
    with pytest.raises(ValueError, match="supported: int8, fp16"):
        quantize_model(nn.Sequential(nn.Linear(4, 4)), "int4")


def test_cli_rejects_an_unknown_quantization_in_one_line(compat):
    proc = subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", "generate", "--prompt", "hi",
         "--quantization", "int4"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "nanollmserve: error: quantization must be int8 or fp16 or gguf or none (or unset), "
        "got 'int4'"
    )
    compat.refused("gguf", "int8", proc.stderr)

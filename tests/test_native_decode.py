"""The single-stream decode step as one native call (`engine/native_decode.py`): it runs for
steps of one request's next token with the weights in GGUF blocks, and computes what the
PyTorch forward over the same blocks computes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_model_parity import CASES, make_tiny_hf_model
from torch import nn
from transformers import AutoTokenizer

from nanollmserve import LLM, SamplingParams
from nanollmserve.engine.native_decode import NativeDecodeStep
from nanollmserve.errors import UserError
from nanollmserve.layers.gguf_linear import GGUFLinear
from nanollmserve.model.gguf_blocks import KIND_Q8, BlockRows
from nanollmserve.model.source import resolve_model

pytestmark = [pytest.mark.milestone("m17"), pytest.mark.timeout(600)]

PROMPTS = [
    "The quick brown fox",
    "Write a long story about a lighthouse keeper who finds a message in a bottle. " * 3,
    "1, 2, 3, 4,",
]


class CountingStep:
    """Wraps the runner's native step and keeps the logits of every call."""

    def __init__(self, step: NativeDecodeStep) -> None:
        self.step = step
        self.calls: list[tuple[int, torch.Tensor]] = []

    def __call__(self, token_id: int, position: int, block_ids: list[int]) -> torch.Tensor:
        logits = self.step(token_id, position, block_ids)
        self.calls.append((position, logits.clone()))
        return logits


def forward_logits(runner, scheduled) -> torch.Tensor:
    """The PyTorch forward's logits for the same single-decode step."""
    input_ids, positions, _, logits_indices = runner._prepare_inputs(scheduled)
    return runner.run_model(input_ids, positions, logits_indices)


def check_step_against_forward(llm, prompts, max_tokens: int) -> tuple[int, float]:
    """Generate greedily, one request at a time; at every native step also run the PyTorch
    forward (it rewrites the same K/V slot) -> (native steps, worst relative logits error)."""
    runner = llm.engine.model_runner
    step = runner.native_decode
    execute = runner.execute_model
    worst, steps = 0.0, 0

    def execute_and_compare(scheduled):
        nonlocal worst, steps
        if runner._is_single_decode(scheduled):
            request = scheduled.requests[0]
            position = request.num_computed_tokens
            native = step(request.all_token_ids[position], position, scheduled.block_ids[0])
            reference = forward_logits(runner, scheduled)
            worst = max(worst, float((native - reference).norm() / reference.norm()))
            steps += 1
        return execute(scheduled)

    runner.execute_model = execute_and_compare
    try:
        for prompt in prompts:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            llm.generate([prompt], params, use_tqdm=False)
    finally:
        runner.execute_model = execute
    return steps, worst


def test_a_single_stream_decodes_natively_with_the_forwards_answers(make_llm):
    llm = make_llm(quantization="gguf", block_size=16)
    runner = llm.engine.model_runner
    assert isinstance(runner.native_decode, NativeDecodeStep)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    counting = CountingStep(runner.native_decode)
    runner.native_decode = counting
    native = [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    # one prefill step, then 39 native decode steps per prompt (positions cross block ends)
    assert len(counting.calls) == 39 * len(PROMPTS)
    assert any(position % 16 == 0 for position, _ in counting.calls)
    runner.native_decode = None
    forward = [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    assert native == forward
    # A batch of several requests runs the PyTorch forward (no native call).
    runner.native_decode = counting
    counting.calls.clear()
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert batched == forward
    assert not counting.calls


def test_native_step_logits_equal_the_forwards_at_every_position(make_llm):
    llm = make_llm(quantization="gguf", block_size=16)
    steps, worst = check_step_against_forward(llm, PROMPTS[:2], max_tokens=24)
    assert steps == 2 * 23
    assert worst < 1e-3, worst


def test_sampling_logprobs_and_stops_work_on_native_steps(make_llm):
    llm = make_llm(quantization="gguf")
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, logprobs=3)
    first = llm.generate(["Once upon a time"], params)[0].outputs[0]
    again = llm.generate(["Once upon a time"], params)[0].outputs[0]
    assert first.token_ids == again.token_ids  # seeded: the same draw each time
    assert len(first.logprobs) == len(first.token_ids)
    assert all(len(entry) >= 3 for entry in first.logprobs)
    stopped = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0.0, stop=[","]))
    assert stopped[0].outputs[0].finish_reason == "stop"


def q8_rows(weight: torch.Tensor) -> BlockRows:
    """Quantize a float32 weight to Q8_0-like rows (d = max|w| / 127 per block of 32)."""
    out, cols = weight.shape
    w = weight.detach().double().numpy().reshape(out, cols // 32, 32)
    d = (np.abs(w).max(axis=-1) / 127).astype(np.float16)
    safe = np.where(d == 0, 1, d.astype(np.float64))
    codes = np.clip(np.rint(w / safe[..., None]), -127, 127).astype(np.int8)
    rows = np.concatenate(
        [codes.reshape(out, cols).view(np.uint8), d.view(np.uint8).reshape(out, -1)], axis=1
    )
    return BlockRows(KIND_Q8, torch.from_numpy(np.ascontiguousarray(rows)))


def to_block_layers(model: nn.Module) -> None:
    """Every projection of the decoder as a GGUFLinear over Q8 blocks of its own weights."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and ".layers." in name:
            blocks = q8_rows(module.weight)
            parent_name, _, attr = name.rpartition(".")
            layer = GGUFLinear(blocks, module.bias, module.out_features, module.in_features)
            setattr(model.get_submodule(parent_name), attr, layer)


@pytest.mark.parametrize("case", ["llama-attention-bias", "qwen2", "qwen3", "qwen3-untied"])
def test_the_native_step_covers_biases_qk_norm_and_untied_heads(case, tmp_path):
    """Tiny random models of each Llama-family option (q/k/v and o biases, Qwen3's q/k norms,
    an untied output projection that stays in PyTorch), their projections in Q8 blocks."""
    config_cls, overrides = CASES[case]
    make_tiny_hf_model(config_cls, tmp_path, **overrides)
    AutoTokenizer.from_pretrained(resolve_model(None).path).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=16)
    runner = llm.engine.model_runner
    assert runner.native_decode is None  # dense weights: the PyTorch forward
    to_block_layers(runner.model)
    runner.native_decode = NativeDecodeStep.for_model(runner.model, 64 * 16)
    assert runner.native_decode is not None
    prompts = [[5, 9, 17, 33, 2, 71], list(range(3, 40))]
    steps, worst = check_step_against_forward(llm, prompts, 20)
    assert steps == 2 * 19
    assert worst < 1e-3, worst  # a missing bias or norm moves the logits by ~10-100%


def test_a_model_with_mlp_biases_is_not_decoded_natively(tmp_path):
    """The C layer has no MLP bias: a model with `mlp_bias` keeps the PyTorch forward (which
    adds it) instead of decoding wrong logits silently."""
    from transformers import LlamaConfig

    make_tiny_hf_model(LlamaConfig, tmp_path, mlp_bias=True)
    AutoTokenizer.from_pretrained(resolve_model(None).path).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=16)
    runner = llm.engine.model_runner
    to_block_layers(runner.model)
    assert runner.model.model.layers[0].mlp.down_proj.bias is not None
    assert NativeDecodeStep.for_model(runner.model, 64 * 16) is None


def test_without_the_native_kernels_gguf_is_a_clear_error_and_the_default_dequantizes(
    make_llm, monkeypatch
):
    from nanollmserve.native import build

    monkeypatch.setattr(build, "kernels_unavailable_reason", lambda: "no C compiler (test)")
    with pytest.raises(UserError, match="needs the native kernels: no C compiler"):
        make_llm(quantization="gguf")
    fallback = make_llm(dtype="auto")
    assert fallback.engine.loaded.quantization is None
    assert fallback.engine.model_runner.native_decode is None


def test_a_missing_compiler_is_reported_not_raised(tmp_path):
    code = (
        "from nanollmserve.native.build import kernels_unavailable_reason, load_kernels\n"
        "assert load_kernels() is None\n"
        "print(kernels_unavailable_reason())\n"
    )
    env = {"CC": str(tmp_path / "no-such-cc"), "NANOLLMSERVE_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    assert "no C compiler" in result.stdout

"""The one-token matmul kernel switch: on only where it helps, always restored, same math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanollmserve import SamplingParams
from nanollmserve.layers.cpu_matmul import matmul_kernels_for

pytestmark = pytest.mark.milestone("m03")
CPU = torch.device("cpu")


def test_onednn_is_off_only_inside_a_one_row_bfloat16_cpu_step():
    assert torch._C._get_mkldnn_enabled()
    with matmul_kernels_for(1, CPU, torch.bfloat16):
        assert not torch._C._get_mkldnn_enabled()
    assert torch._C._get_mkldnn_enabled()
    for rows, dtype in [(2, torch.bfloat16), (64, torch.bfloat16), (1, torch.float32)]:
        with matmul_kernels_for(rows, CPU, dtype):
            assert torch._C._get_mkldnn_enabled()


def test_the_switch_is_restored_when_the_step_raises():
    with pytest.raises(RuntimeError), matmul_kernels_for(1, CPU, torch.bfloat16):
        raise RuntimeError("model failed")
    assert torch._C._get_mkldnn_enabled()


def test_the_one_row_kernel_computes_the_same_product():
    torch.manual_seed(0)
    x = torch.randn(1, 576, dtype=torch.bfloat16)
    w = torch.randn(960, 576, dtype=torch.bfloat16) * 0.05
    reference = F.linear(x.float(), w.float())
    onednn = F.linear(x, w).float()
    with matmul_kernels_for(1, CPU, torch.bfloat16):
        native = F.linear(x, w).float()
    # Both accumulate in float32 and round the result to bfloat16 once.
    assert (native - reference).abs().max() <= (onednn - reference).abs().max() * 2 + 1e-6
    assert (native - onednn).abs().max() < 0.02 * reference.abs().max()


def test_bfloat16_single_stream_and_batched_decode_agree(make_llm):
    """One request alone (one-token steps on ATen's kernel) and the same request in a batch
    of four (oneDNN) give the same greedy answer on the bundled model in bfloat16."""
    llm = make_llm(dtype="bfloat16")
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    alone = llm.chat(question, greedy)[0].outputs[0]
    others = [[{"role": "user", "content": q}] for q in ("Name a color.", "Count to 3.", "Hi!")]
    batched = llm.chat([question, *others], greedy)[0].outputs[0]
    assert "Paris" in alone.text
    assert alone.token_ids == batched.token_ids
